"""Offline API shaped like vLLM's: `LLM(model).generate(prompts, sampling_params)`."""

from __future__ import annotations

import itertools
import logging
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from braid.config import DEFAULT_TARGET, EngineConfig
from braid.engine.engine import LLMEngine
from braid.messages import ChatMessage
from braid.outputs import RequestOutput
from braid.sampling_params import RequestOutputKind, SamplingParams, choice_seed

logger = logging.getLogger("braid")
# vLLM options with nothing to do in braid (see LLM.__init__)
_VLLM_NO_OPS = ("trust_remote_code", "enforce_eager")
# A text, token ids, or vLLM's TextPrompt / TokensPrompt dicts ({"prompt": ...} or
# {"prompt_token_ids": [...]})
Prompt = str | list[int] | dict[str, Any]


class LLM:
    """Loads a model once and generates for batches of prompts with continuous batching."""

    def __init__(self, model: str = DEFAULT_TARGET, **engine_options: Any) -> None:
        """`engine_options` are EngineConfig's fields. vLLM's options that change nothing
        on one CPU are accepted so vLLM scripts run unchanged: `trust_remote_code` and
        `enforce_eager` (as `braid serve` takes them), `tensor_parallel_size` of 1, and
        `gpu_memory_utilization` (ignored: `kv_cache_gib` sizes the KV cache).
        `pipeline_parallel_size` splits the layers over processes (docs/scaling.md; end
        them with `shutdown()`)."""
        for name in _VLLM_NO_OPS:
            engine_options.pop(name, None)
        if engine_options.pop("tensor_parallel_size", 1) != 1:
            raise ValueError("tensor_parallel_size must be 1: braid has no tensor parallelism")
        if engine_options.pop("gpu_memory_utilization", None) is not None:
            logger.info("gpu_memory_utilization is ignored: braid runs on the CPU, and "
                        "kv_cache_gib sizes the KV cache")
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self._ids = itertools.count()

    @property
    def llm_engine(self) -> LLMEngine:
        """vLLM's name for `engine`."""
        return self.engine

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate and chat use without sampling_params: SamplingParams' defaults, with
        the model's generation_config.json recommendations over them (as vLLM)."""
        return SamplingParams(**self.engine.default_sampling)

    def shutdown(self) -> None:
        """End the processes the engine started (a pipeline's later stages)."""
        self.engine.shutdown()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: None = None,
    ) -> list[RequestOutput]:
        """One output per prompt, in prompt order. One SamplingParams for all, or one each;
        `n > 1` gives n completions per prompt (n engine requests; seeds seed, seed + 1, ...).
        `priority`, one per prompt, counts under scheduling_policy="priority". braid has no
        LoRA adapters: `lora_request` may only be None."""
        if lora_request is not None:
            raise ValueError("lora_request must be None: braid has no LoRA adapters")
        prompt_list = _as_prompt_list(prompts)
        params = _as_params_list(self.get_default_sampling_params() if sampling_params is None
                                 else sampling_params, len(prompt_list))
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError(f"priority has {len(priority)} entries for {len(prompt_list)} "
                             "prompts")
        self._check_structured(params)
        groups: list[list[str]] = []
        try:
            for i, (prompt, p) in enumerate(zip(prompt_list, params, strict=True)):
                rid = str(next(self._ids))
                groups.append([f"{rid}-{j}" for j in range(p.n)] if p.n > 1 else [rid])
                for sub_id, sub in zip(groups[-1], _fan_out(p), strict=True):
                    self.engine.add_request(sub_id, prompt, sub,
                                            priority=0 if priority is None else priority[i],
                                            group=rid)
            return self._run(groups, use_tqdm)
        except BaseException:
            # a bad prompt, a failed step or an interrupt leaves none of this call's requests
            # behind to run into the next call
            for rid in itertools.chain.from_iterable(groups):
                self.engine.abort(rid)
            raise

    def _check_structured(self, params: Sequence[SamplingParams]) -> None:
        """ValueError naming the field for a structured output the grammar engine refuses,
        before any request is added (the engine would end such a request with "error")."""
        specs = {id(p.structured_outputs): p.structured_outputs for p in params
                 if p.structured_outputs is not None}
        if specs and self.engine.structured is None:
            raise ValueError("structured_outputs needs a tokenizer: this model has none")
        for spec in specs.values():
            assert self.engine.structured is not None and spec is not None
            self.engine.structured.validate(spec).result()

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with a chat template (default: the model's), then
        generate. As in vLLM: `continue_final_message` (with add_generation_prompt=False)
        continues the last message instead of closing it; `chat_template_kwargs` are more
        template variables."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer; this model has none")
        if not isinstance(messages, list | tuple) or not all(
                isinstance(m, dict) or (isinstance(m, list | tuple)
                                        and all(isinstance(x, dict) for x in m))
                for m in messages):
            raise ValueError("messages must be a conversation (a list of message dicts with "
                             "'role' and 'content') or a list of conversations, got "
                             f"{messages!r:.80}")
        conversations: Sequence[Any] = (
            [messages] if messages and isinstance(messages[0], dict) else messages)
        # as the server renders them: content parts joined, a missing content empty
        # chat_template_kwargs over the arguments of the same names, as vLLM's; the text is
        # tokenized here, so a `tokenize` among them goes
        options = {"add_generation_prompt": add_generation_prompt, "tools": tools,
                   "chat_template": chat_template,
                   "continue_final_message": continue_final_message,
                   **(chat_template_kwargs or {})}
        options.pop("tokenize", None)
        texts = [tokenizer.apply_chat_template(
            [ChatMessage.model_validate(m).as_template_dict() for m in c], **options)
            for c in conversations]
        prompts: list[Prompt] = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
        outputs = self.generate(prompts, sampling_params, use_tqdm)
        for out, text in zip(outputs, texts, strict=True):
            out.prompt = text  # the rendered conversation, as vLLM reports it
        return outputs

    def _run(self, groups: list[list[str]], use_tqdm: bool) -> list[RequestOutput]:
        """Step until every engine request finished; the bar counts prompts (a prompt's n
        completions finish it together), as vLLM's."""
        finished: dict[str, RequestOutput] = {}
        prompt_of = {rid: i for i, g in enumerate(groups) for rid in g}
        left = [len(g) for g in groups]  # unfinished engine requests of each prompt
        with tqdm(total=len(groups), desc="Generating", unit="prompt",
                  disable=not use_tqdm) as bar:
            while len(finished) < len(prompt_of):
                for out in self.engine.step():
                    if out.finished and out.request_id in prompt_of:  # not another caller's
                        finished[out.request_id] = out
                        left[prompt_of[out.request_id]] -= 1
                        if left[prompt_of[out.request_id]] == 0:
                            bar.update(1)
        return [_merge([finished[i] for i in g]) for g in groups]

    def _unsupported(self, method: str) -> None:
        raise NotImplementedError(f"LLM.{method}: braid runs generative models only (no "
                                  "pooling, embedding, scoring or beam search); use generate "
                                  "or chat")

    def encode(self, *args: Any, **kwargs: Any) -> None:
        self._unsupported("encode")

    def embed(self, *args: Any, **kwargs: Any) -> None:
        self._unsupported("embed")

    def classify(self, *args: Any, **kwargs: Any) -> None:
        self._unsupported("classify")

    def score(self, *args: Any, **kwargs: Any) -> None:
        self._unsupported("score")

    def beam_search(self, *args: Any, **kwargs: Any) -> None:
        self._unsupported("beam_search")


def _fan_out(params: SamplingParams) -> list[SamplingParams]:
    """The engine requests of one prompt, each returning only its final output (as vLLM's
    LLM takes any output_kind): the engine makes no output of an unfinished one."""
    if params.n == 1:
        return [params if params.output_kind == RequestOutputKind.FINAL_ONLY
                else replace(params, output_kind=RequestOutputKind.FINAL_ONLY)]
    return [replace(params, n=1, seed=choice_seed(params.seed, j),
                    output_kind=RequestOutputKind.FINAL_ONLY) for j in range(params.n)]


def _merge(outs: list[RequestOutput]) -> RequestOutput:
    """The n completions of one prompt as one output (choices indexed 0..n-1)."""
    if len(outs) == 1:
        return outs[0]
    first = outs[0]
    completions = [replace(o.outputs[0], index=j) for j, o in enumerate(outs)]
    return replace(first, request_id=first.request_id.rsplit("-", 1)[0], outputs=completions)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[str | list[int]]:
    if isinstance(prompts, bytes) or not isinstance(prompts, Iterable):
        raise ValueError("prompts must be a prompt (a text, token ids or a dict) or a list "
                         f"of them, got {prompts!r:.80}")
    if isinstance(prompts, str | dict):
        return [_prompt_of(prompts)]
    items = list(prompts)
    if items and all(_is_token_id(t) for t in items):
        return [[int(t) for t in items]]  # type: ignore[arg-type]
    return [_prompt_of(p) for p in items]


def _is_token_id(value: object) -> bool:
    """An integer (numpy's too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool | np.bool_)


def _prompt_of(prompt: object) -> str | list[int]:
    """A text or token ids from one prompt of any accepted form (ValueError otherwise)."""
    if isinstance(prompt, dict):
        if set(prompt) == {"prompt_token_ids"}:
            ids = _prompt_of(prompt["prompt_token_ids"])
            if isinstance(ids, str):
                raise ValueError(f"prompt_token_ids must be token ids, got {ids!r:.80}")
            return ids
        if set(prompt) == {"prompt"}:
            return _prompt_of(prompt["prompt"])
        raise ValueError("a prompt dict takes one key, 'prompt' (a text) or "
                         f"'prompt_token_ids' (token ids), got {sorted(prompt)}")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, np.ndarray) and prompt.ndim == 1:
        prompt = prompt.tolist()
    if isinstance(prompt, list | tuple) and all(_is_token_id(t) for t in prompt):
        return [int(t) for t in prompt]
    raise ValueError(f"a prompt is a text, a list of token ids (integers) or a dict, got "
                     f"{prompt!r:.80}")


def _as_params_list(
    params: SamplingParams | Sequence[SamplingParams], n: int
) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * n
    if not isinstance(params, list | tuple) or not all(
            isinstance(p, SamplingParams) for p in params):
        raise ValueError("sampling_params must be a SamplingParams or a list of them (one "
                         f"per prompt), got {params!r:.80}")
    if len(params) != n:
        raise ValueError(f"sampling_params has {len(params)} entries for {n} prompts")
    return list(params)
