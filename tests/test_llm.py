"""Offline LLM API."""

from __future__ import annotations

import pytest


def test_n_completions_per_prompt(tmp_path) -> None:
    from braid import LLM, SamplingParams
    from tests.tiny import save_tiny_model

    llm = LLM(str(save_tiny_model(tmp_path)), num_kv_blocks=256, block_size=4,
              max_model_len=256, log_stats_interval=0)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
    out = llm.generate(["hello", "bye"], params, use_tqdm=False)
    assert [len(o.outputs) for o in out] == [3, 3]
    assert [c.index for c in out[0].outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out[0].outputs}) > 1  # seeds 7, 8, 9 differ
    again = llm.generate("hello", params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out[0].outputs]


def test_structured_output_offline(tmp_path) -> None:
    """SamplingParams(structured_outputs=...) through LLM.generate and LLM.chat, n = 2."""
    import re

    from braid import LLM, SamplingParams
    from braid.sampling_params import StructuredOutputsParams
    from tests.tiny import save_tiny_model

    llm = LLM(str(save_tiny_model(tmp_path)), num_kv_blocks=256, block_size=4,
              max_model_len=256, log_stats_interval=0)
    regex = StructuredOutputsParams(regex=r"[a-f]{3}\d")
    out = llm.generate(["hello"], SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=20,
                                                 structured_outputs=regex), use_tqdm=False)
    assert all(re.fullmatch(r"[a-f]{3}\d", c.text) for c in out[0].outputs)
    choice = StructuredOutputsParams(choice=["alpha", "beta"])
    chat = llm.chat([{"role": "user", "content": "pick"}],
                    SamplingParams(temperature=0, max_tokens=20, structured_outputs=choice),
                    use_tqdm=False)
    assert chat[0].outputs[0].text in ("alpha", "beta")


def test_a_stop_token_text_is_kept_only_with_include_stop_str_in_output(tmp_path) -> None:
    """vLLM's semantics: a stop_token_ids token is cut from the text unless
    include_stop_str_in_output, which keeps it as it keeps a stop string."""
    from braid import LLM, SamplingParams
    from tests.tiny import save_tiny_model

    llm = LLM(str(save_tiny_model(tmp_path)), num_kv_blocks=256, block_size=4,
              max_model_len=256, log_stats_interval=0)

    def first(**fields: object):  # noqa: ANN202
        params = SamplingParams(temperature=0, ignore_eos=True, **fields)  # type: ignore[arg-type]
        return llm.generate("stop here", params, use_tqdm=False)[0].outputs[0]

    ref = first(max_tokens=12).token_ids
    at = 4
    stop = ref[at]
    at = ref.index(stop)
    for keep, upto in ((False, at), (True, at + 1)):
        out = first(max_tokens=12, stop_token_ids=[stop], include_stop_str_in_output=keep)
        assert out.token_ids == ref[: at + 1]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        assert out.text == (first(max_tokens=upto).text if upto else "")


def test_a_failed_call_leaves_nothing_behind(tmp_path, monkeypatch) -> None:
    """A bad prompt in a batch, a step that fails or a limit past the vocabulary: the call
    raises, none of its requests stays in the engine, and the next call works."""
    import pytest

    from braid import LLM, SamplingParams
    from braid.engine.engine import RequestError
    from tests.tiny import save_tiny_model

    llm = LLM(str(save_tiny_model(tmp_path)), num_kv_blocks=256, block_size=4,
              max_model_len=64, log_stats_interval=0)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    want = llm.generate(["fine"], greedy, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(RequestError, match="prompt is"):
        llm.generate(["fine", "x" * 100], greedy, use_tqdm=False)
    assert not llm.engine.requests
    with pytest.raises(RequestError, match=r"logprobs 1000000 exceeds --max-logprobs \(20\)"):
        llm.generate(["fine"], SamplingParams(max_tokens=2, logprobs=10**6), use_tqdm=False)
    assert not llm.engine.requests

    def failing_step() -> None:
        raise RuntimeError("a step failed")

    with monkeypatch.context() as m:
        m.setattr(llm.engine, "step", failing_step)
        with pytest.raises(RuntimeError, match="a step failed"):
            llm.generate(["fine", "also fine"], SamplingParams(n=2, max_tokens=4),
                         use_tqdm=False)
    assert not llm.engine.requests and llm.engine.blocks.num_used_blocks == 0
    assert llm.generate(["fine"], greedy, use_tqdm=False)[0].outputs[0].token_ids == want
    # n > 1 at the last seed: the choices' seeds wrap around instead of failing
    out = llm.generate(["fine"], SamplingParams(n=2, seed=2**64 - 1, max_tokens=3),
                       use_tqdm=False)[0]
    assert len(out.outputs) == 2


def test_prompt_forms_and_chat_messages_as_the_server_takes_them(tmp_path) -> None:
    """vLLM's prompt dicts give what their text or ids give; other shapes are a clear error.
    LLM.chat takes content parts and a missing content as the server does."""
    import numpy as np
    import pytest

    from braid import LLM, SamplingParams
    from tests.tiny import save_tiny_model

    llm = LLM(str(save_tiny_model(tmp_path)), num_kv_blocks=256, block_size=4,
              max_model_len=256, log_stats_interval=0)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    def ids(prompt) -> list[int]:  # noqa: ANN001
        return llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids

    tokens = llm.get_tokenizer().encode("dict prompt")
    want = ids("dict prompt")
    assert ids({"prompt": "dict prompt"}) == ids({"prompt_token_ids": tokens}) == want
    assert ids([{"prompt": "dict prompt"}, "other"]) == want
    # numpy token ids, as vLLM takes them in practice
    assert ids(np.array(tokens)) == ids([np.int64(t) for t in tokens]) == want
    assert ids({"prompt_token_ids": np.array(tokens)}) == want
    for bad in ({"prompt": "x", "extra": 1}, {"text": "x"}, [["x"]], [3.5], [[True, False]],
                {"prompt_token_ids": "ab"}):
        with pytest.raises(ValueError, match="prompt"):
            llm.generate(bad, greedy, use_tqdm=False)
    with pytest.raises(ValueError, match="logit_bias keys must be token ids"):
        SamplingParams(logit_bias={"5": 1.0})  # as JSON spells them: the server converts
    assert not llm.engine.requests

    def chat(messages: list[dict]) -> list[int]:
        return llm.chat(messages, greedy, use_tqdm=False)[0].outputs[0].token_ids

    plain = chat([{"role": "user", "content": "hi\nthere"}])
    # text parts are joined with a newline, as vLLM joins them
    assert chat([{"role": "user", "content": [{"type": "text", "text": "hi"},
                                              {"type": "text", "text": "there"}]}]) == plain
    assert chat([{"role": "user", "content": "hi there"},
                 {"role": "assistant", "content": None}, {"role": "user"}])
    with pytest.raises(ValueError, match="content"):
        chat([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}])
    # vLLM's SamplingParams.truncate_prompt_tokens: the prompt's last k tokens
    ids = llm.get_tokenizer().encode("abcdefghij")
    out = llm.generate("abcdefghij", SamplingParams(truncate_prompt_tokens=4, max_tokens=1),
                       use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[-4:]
    for bad in (0, -2, 1.5):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)
    # vLLM's LLM.chat options: an assistant prefill continued, another template, variables
    prefill = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure, "}]
    out = llm.chat(prefill, greedy, use_tqdm=False, add_generation_prompt=False,
                   continue_final_message=True)[0]
    assert llm.get_tokenizer().decode(out.prompt_token_ids, False).endswith(
        "<|im_start|>assistant\nSure, ")
    assert out.prompt is not None and out.prompt.endswith("<|im_start|>assistant\nSure, ")
    out = llm.chat(prefill, greedy, use_tqdm=False, chat_template="{{ a }}{{ messages | length }}",
                   chat_template_kwargs={"a": "n="})[0]
    assert llm.get_tokenizer().decode(out.prompt_token_ids) == "n=2"
    with pytest.raises(ValueError, match="continue_final_message and add_generation_prompt"):
        llm.chat(prefill, greedy, use_tqdm=False, continue_final_message=True)
    assert not llm.engine.requests


def test_logprobs_are_vllm_logprob_objects(tmp_path) -> None:
    """As vLLM's offline API: per position {token_id: Logprob(logprob, rank, decoded_token)}
    for generated and prompt tokens, so `lp[token].logprob` code runs unchanged."""
    import math

    from braid import LLM, Logprob, SamplingParams
    from tests.tiny import save_tiny_model

    llm = LLM(str(save_tiny_model(tmp_path)), num_kv_blocks=256, block_size=4,
              max_model_len=256, log_stats_interval=0)
    tokenizer = llm.get_tokenizer()
    out = llm.generate("hello", SamplingParams(temperature=0, max_tokens=5, ignore_eos=True,
                                               logprobs=2, prompt_logprobs=1),
                       use_tqdm=False)[0]
    completion = out.outputs[0]
    assert completion.logprobs is not None and len(completion.logprobs) == 5
    for token, entry in zip(completion.token_ids, completion.logprobs, strict=True):
        assert all(isinstance(lp, Logprob) for lp in entry.values())
        assert entry[token].rank == 1  # greedy: the sampled token is the most likely
        assert {lp.rank for lp in entry.values()} == {1, 2}
        for t, lp in entry.items():
            assert lp.decoded_token == tokenizer.decode([t], skip_special_tokens=False)
            assert lp.logprob <= entry[token].logprob
    prompt = out.prompt_logprobs
    assert prompt is not None and prompt[0] is None and len(prompt) == len(out.prompt_token_ids)
    for token, entry in zip(out.prompt_token_ids[1:], prompt[1:], strict=True):
        assert entry is not None and token in entry and 1 <= len(entry) <= 2
        assert entry[token].rank is not None and entry[token].rank >= 1
        assert math.isfinite(entry[token].logprob) and entry[token].decoded_token is not None


def test_max_logprobs_caps_what_a_request_may_ask(tmp_path) -> None:
    """--max-logprobs (20 by default, as vLLM) refuses more logprobs or prompt_logprobs per
    position, naming the field; -1 allows the whole vocabulary."""
    import pytest

    from braid import LLM, SamplingParams
    from braid.config import ConfigError
    from braid.engine.engine import RequestError
    from tests.tiny import save_tiny_model

    folder = str(save_tiny_model(tmp_path))
    options = {"num_kv_blocks": 64, "block_size": 4, "max_model_len": 64,
               "log_stats_interval": 0}
    llm = LLM(folder, **options)
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(RequestError, match=f"^{field} 21 exceeds --max-logprobs \\(20\\)"):
            llm.generate("hello", SamplingParams(max_tokens=2, **{field: 21}), use_tqdm=False)
    assert not llm.engine.requests
    llm = LLM(folder, max_logprobs=-1, **options)
    vocab = llm.engine.model_config.vocab_size
    out = llm.generate("hello", SamplingParams(temperature=0, max_tokens=2, logprobs=vocab),
                       use_tqdm=False)[0].outputs[0]
    assert out.logprobs is not None and all(len(e) == vocab for e in out.logprobs)
    whole = llm.generate("hello", SamplingParams(temperature=0, max_tokens=2, logprobs=-1,
                                                 prompt_logprobs=-1), use_tqdm=False)[0]
    assert whole.outputs[0].logprobs == out.logprobs  # -1: the whole vocabulary, as vLLM
    assert whole.prompt_logprobs is not None
    assert all(len(e) >= vocab for e in whole.prompt_logprobs[1:] if e is not None)
    with pytest.raises(RequestError, match=f"logprobs {vocab + 1} exceeds --max-logprobs "
                       f"\\({vocab}\\)"):  # -1: the vocabulary
        llm.generate("hello", SamplingParams(max_tokens=2, logprobs=vocab + 1), use_tqdm=False)
    llm = LLM(folder, max_logprobs=10 * vocab, **options)
    with pytest.raises(RequestError, match="prompt_logprobs must be <= the vocabulary size"):
        llm.generate("hello", SamplingParams(max_tokens=2, prompt_logprobs=vocab + 1),
                     use_tqdm=False)
    with pytest.raises(ConfigError, match="--max-logprobs must be -1"):
        LLM(folder, max_logprobs=-2, **options)


def test_generation_config_sampling_defaults_as_in_vllm(tmp_path) -> None:
    """The model folder's generation_config.json recommends sampling; LLM uses it without
    sampling_params (a request's own fields win); --generation-config vllm ignores it; a bad
    file or folder is a ConfigError naming the flag."""
    import json

    import pytest

    from braid import LLM, SamplingParams
    from braid.config import ConfigError
    from tests.tiny import save_tiny_model

    folder = save_tiny_model(tmp_path / "model")
    (folder / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": 2, "do_sample": True, "temperature": 0.7, "top_k": 1, "top_p": 0.9}))
    engine = dict(num_kv_blocks=256, block_size=4, max_model_len=256, log_stats_interval=0)
    llm = LLM(str(folder), **engine)
    default = llm.get_default_sampling_params()
    assert (default.temperature, default.top_k, default.top_p) == (0.7, 1, 0.9)
    assert default.max_tokens == SamplingParams().max_tokens
    greedy = llm.generate("hello", SamplingParams(temperature=0), use_tqdm=False)[0]
    out = llm.generate("hello", use_tqdm=False)[0]  # top_k 1 is greedy
    assert out.outputs[0].token_ids == greedy.outputs[0].token_ids
    plain = LLM(str(folder), generation_config="vllm", **engine)
    assert plain.get_default_sampling_params() == SamplingParams()
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_p": 5}))
    with pytest.raises(ConfigError, match="--generation-config: .*generation_config.json: top_p"):
        LLM(str(folder), generation_config=str(other), **engine)
    with pytest.raises(ConfigError, match="--generation-config nowhere: expected auto, vllm"):
        LLM(str(folder), generation_config="nowhere", **engine)
    empty = tmp_path / "empty"  # a folder without the file: named, not silently nothing
    empty.mkdir()
    with pytest.raises(ConfigError, match="expected auto, vllm or a folder holding"):
        LLM(str(folder), generation_config=str(empty), **engine)
    (other / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="generation_config.json: expected a JSON object"):
        LLM(str(folder), generation_config=str(other), **engine)
    # --override-generation-config: merged over the file's, alone with vllm (JSON text too)
    over = LLM(str(folder), override_generation_config={"temperature": 0.2, "min_p": 0.1},
               **engine).get_default_sampling_params()
    assert (over.temperature, over.top_k, over.min_p) == (0.2, 1, 0.1)
    only = LLM(str(folder), generation_config="vllm",
               override_generation_config='{"top_p": 0.5}', **engine)
    assert only.get_default_sampling_params() == SamplingParams(top_p=0.5)
    # max_new_tokens (the HF name, as vLLM's) is the default max_tokens, from the file too
    longer = LLM(str(folder), override_generation_config={"max_new_tokens": 40}, **engine)
    assert longer.get_default_sampling_params().max_tokens == 40
    assert len(longer.generate("hello", SamplingParams(temperature=0, ignore_eos=True,
                                                       max_tokens=50), use_tqdm=False)[0]
               .outputs[0].token_ids) == 50  # offline it is no limit, as in vLLM
    (other / "generation_config.json").write_text(json.dumps({"max_new_tokens": 7}))
    assert LLM(str(folder), generation_config=str(other), **engine
               ).get_default_sampling_params() == SamplingParams(max_tokens=7)
    for bad, message in (({"max_tokens": 5}, "max_tokens is not one of temperature"),
                         ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
                         ({"top_p": 2}, "top_p must be in"), ("{", "invalid JSON")):
        with pytest.raises(ConfigError, match=f"--override-generation-config: {message}"):
            LLM(str(folder), override_generation_config=bad, **engine)


def test_bad_words_are_never_generated_with_or_without_speculation(tmp_path) -> None:
    """vLLM's bad_words: a word's last token is refused where the output ends with the rest
    of it; greedy speculation (draft model, prompt lookup) equals greedy without it."""
    import pytest

    from braid import LLM, SamplingParams
    from tests.tiny import save_tiny_model

    folder = str(save_tiny_model(tmp_path / "model"))
    engine = dict(num_kv_blocks=256, block_size=4, max_model_len=256, log_stats_interval=0)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    banned = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, bad_words=["nc", "%"])
    llm = LLM(folder, **engine)
    free = llm.generate(["hello", "hi there"], greedy, use_tqdm=False)
    assert "nc" in free[0].outputs[0].text and "%" in free[0].outputs[0].text
    texts = []
    for spec in (None, {"method": "draft_model", "model": folder, "num_speculative_tokens": 3},
                 {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}):
        llm = LLM(folder, speculative_config=spec, **engine)
        for _ in range(2):  # a second batch after the engine went idle
            outs = llm.generate(["hello", "hi there"], banned, use_tqdm=False)
            texts.append([o.outputs[0].text for o in outs])
        sampled = llm.generate("hello", SamplingParams(temperature=1.0, seed=3, max_tokens=24,
                                                       ignore_eos=True, bad_words=["nc"]),
                               use_tqdm=False)[0].outputs[0].text
        assert "nc" not in sampled
    assert all(t == texts[0] for t in texts)
    assert all("nc" not in t and "%" not in t and len(t) for t in texts[0])
    with pytest.raises(ValueError, match="bad_words"):
        llm.generate("hello", SamplingParams(bad_words=[" "]), use_tqdm=False)


def test_constraints_that_leave_no_token_end_the_request(tmp_path) -> None:
    """allowed_token_ids against a grammar, bad_words or min_tokens can leave a row no token:
    it takes its eos and ends, greedy or sampled, with logprobs, beside other requests and
    with speculation as without. (It drew an id past the vocabulary, and with logprobs the
    whole step failed.)"""
    from braid import LLM, SamplingParams
    from braid.sampling_params import StructuredOutputsParams
    from tests.tiny import save_tiny_model

    folder = str(save_tiny_model(tmp_path / "model"))
    engine = dict(num_kv_blocks=256, block_size=4, max_model_len=256, log_stats_interval=0)
    conflicts = [{"allowed_token_ids": [ord("a")],
                  "structured_outputs": StructuredOutputsParams(json_object=True)},
                 {"allowed_token_ids": [ord("a")], "bad_words": ["a"]}]
    results = []
    for spec in (None, {"method": "draft_model", "model": folder, "num_speculative_tokens": 3}):
        llm = LLM(folder, speculative_config=spec, **engine)
        eos = min(llm.get_tokenizer().eos_token_ids)
        conflicts.append({"allowed_token_ids": [eos], "min_tokens": 2})
        params = [SamplingParams(temperature=t, seed=1, max_tokens=6, logprobs=2, **c)
                  for c in conflicts for t in (0.0, 0.7)]
        healthy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        outs = llm.generate(["hi"] * len(params) + ["ok"], [*params, healthy], use_tqdm=False)
        for out in outs[:-1]:
            c = out.outputs[0]
            assert c.finish_reason == "stop" and c.token_ids[-1] == eos, c
            assert all(t == eos for t in c.token_ids)
        assert len(outs[-1].outputs[0].token_ids) == 6
        results.append([o.outputs[0].token_ids for o in outs])
        conflicts.pop()
    assert results[0] == results[1]


def test_a_draft_vocabulary_limit_with_a_float_draft_as_loaded(tmp_path) -> None:
    """draft_vocab_size with a float draft loaded from its files (its LM head packed for
    oneDNN, which has no rows to slice): lossless, where the warm-up forward crashed."""
    from braid import LLM, SamplingParams
    from tests.spec_decode.test_spec_engine import FixedStepCosts
    from tests.tiny import save_tiny_model

    folder = str(save_tiny_model(tmp_path))
    options = {"num_kv_blocks": 256, "block_size": 4, "max_model_len": 256,
               "log_stats_interval": 0}
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = LLM(folder, **options).generate(["hello there"], greedy, use_tqdm=False)
    spec = {"method": "draft_model", "model": folder, "num_speculative_tokens": 3,
            "draft_vocab_size": 100}
    llm = LLM(folder, speculative_config=spec, **options)  # (the goodput policy's warm-up)
    # fixed step costs, so that it drafts whatever the machine's load
    llm.engine.speculator.policy.cost = FixedStepCosts()  # type: ignore[union-attr]
    got = llm.generate(["hello there"], greedy, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert llm.engine.stats.spec_stats.num_draft_tokens > 0


def test_generate_takes_the_generation_config_under_its_flags(tmp_path, capsys) -> None:
    """`braid generate` samples with --override-generation-config (and generation_config
    .json) where its own flags are unset, as the server and LLM.generate do; it ignored
    them. A flag given wins."""
    from braid.cli import main
    from tests.tiny import save_tiny_model

    flags = ["generate", "--model", str(save_tiny_model(tmp_path)), "--num-kv-blocks", "256",
             "--block-size", "4", "--max-model-len", "256", "--raw", "--ignore-eos",
             "--override-generation-config", '{"max_new_tokens": 3}', "hi"]
    assert main(flags) == 0
    assert "[3 tokens, finish_reason=length" in capsys.readouterr().err
    assert main([*flags[:-1], "--max-tokens", "5", "hi"]) == 0
    assert "[5 tokens, finish_reason=length" in capsys.readouterr().err



def test_generate_warns_of_a_max_tokens_past_the_context(tmp_path, capsys, caplog) -> None:
    """The output stops where --max-model-len does (as LLM.generate's): said up front."""
    from braid.cli import main
    from tests.tiny import save_tiny_model

    assert main(["generate", "--model", str(save_tiny_model(tmp_path)), "--num-kv-blocks", "64",
                 "--block-size", "4", "--max-model-len", "32", "--raw", "--ignore-eos",
                 "--max-tokens", "100", "abcdef"]) == 0
    assert ("--max-tokens 100: the prompt's 6 tokens leave room for 26 in --max-model-len 32"
            in caplog.text)
    assert "[26 tokens, finish_reason=length" in capsys.readouterr().err


def _collect(engine, requests: dict) -> dict[str, list]:  # noqa: ANN001
    """Every output of each request, step by step, until all finish."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    seen: dict[str, list] = {rid: [] for rid in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    return seen


def test_output_kinds_when_the_engine_is_driven_directly(tmp_path) -> None:
    """vLLM's RequestOutputKind, with and without speculation (windows emit several tokens
    a step) and a stop string the text is held back for: DELTA outputs add up to the
    CUMULATIVE one (text, tokens, logprobs; prompt logprobs once; cumulative_logprob
    running), FINAL_ONLY gives the finished output alone; LLM.generate returns whole
    outputs whatever the kind."""
    from dataclasses import replace

    from braid import LLM, RequestOutputKind, SamplingParams
    from tests.tiny import save_tiny_model

    folder = save_tiny_model(tmp_path)
    base = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=2,
                          prompt_logprobs=1)
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 3,
                        "prompt_lookup_min": 1}):
        llm = LLM(str(folder), num_kv_blocks=256, block_size=4, max_model_len=256,
                  log_stats_interval=0, speculative_config=spec)
        prompt = "abcabcabcabc abc"
        reference = llm.generate(prompt, base, use_tqdm=False)[0].outputs[0]
        stop = reference.text[12:14]
        params = replace(base, stop=[stop])
        kinds = {kind.name: replace(params, output_kind=kind) for kind in RequestOutputKind}
        seen = _collect(llm.engine, {name: (prompt, p) for name, p in kinds.items()})
        final = seen["CUMULATIVE"][-1]
        whole = final.outputs[0]
        assert final.finished and whole.finish_reason == "stop" and whole.stop_reason == stop
        assert len(seen["CUMULATIVE"]) > 1 and all(
            not o.finished for o in seen["CUMULATIVE"][:-1])
        deltas = seen["DELTA"]
        assert len(deltas) == len(seen["CUMULATIVE"]) and deltas[-1].finished
        assert "".join(o.outputs[0].text for o in deltas) == whole.text
        assert sum((o.outputs[0].token_ids for o in deltas), []) == whole.token_ids
        assert sum((o.outputs[0].logprobs for o in deltas), []) == whole.logprobs
        assert deltas[-1].outputs[0].cumulative_logprob == whole.cumulative_logprob
        assert [o.prompt_logprobs is not None for o in deltas].count(True) == 1
        assert next(o.prompt_logprobs for o in deltas if o.prompt_logprobs) == \
            final.prompt_logprobs
        [only] = seen["FINAL_ONLY"]
        assert only.finished and only.outputs[0].text == whole.text
        assert only.outputs[0].token_ids == whole.token_ids
        if spec is not None:
            assert llm.engine.stats.spec_stats.num_accepted_tokens > 0
            assert any(len(o.outputs[0].token_ids) > 1 for o in deltas)
        for kind in kinds.values():  # the engine went idle; LLM makes each kind whole
            out = llm.generate(prompt, kind, use_tqdm=False)[0].outputs[0]
            assert (out.text, out.token_ids) == (whole.text, whole.token_ids)


def test_detokenize_false_gives_token_ids_only(tmp_path) -> None:
    from braid import LLM, SamplingParams
    from tests.tiny import save_tiny_model

    llm = LLM(str(save_tiny_model(tmp_path)), num_kv_blocks=256, block_size=4,
              max_model_len=256, log_stats_interval=0)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1,
                            stop_token_ids=[7])
    texts, ids = llm.generate(["one", "two"], params, use_tqdm=False), []
    bare = llm.generate(["one", "two"], SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, logprobs=1, stop_token_ids=[7],
        detokenize=False), use_tqdm=False)
    for with_text, without in zip(texts, bare, strict=True):
        a, b = with_text.outputs[0], without.outputs[0]
        ids.append(b.token_ids)
        assert a.text and b.text == ""
        assert (b.token_ids, b.finish_reason) == (a.token_ids, a.finish_reason)
        assert all(lp.decoded_token is None for e in b.logprobs for lp in e.values())
        assert all(lp.decoded_token is not None for e in a.logprobs for lp in e.values())
    assert ids[0] != ids[1]


def test_vllm_script_idioms(tmp_path, capsys) -> None:
    """What vLLM scripts pass and call: options that change nothing on one CPU, vLLM's
    names, clear errors for what braid lacks or a wrongly typed argument, a progress bar
    counting prompts."""
    import braid
    from braid import LLM, SamplingParams
    from tests.tiny import save_tiny_model

    folder = str(save_tiny_model(tmp_path))
    llm = LLM(folder, num_kv_blocks=256, block_size=4, max_model_len=256, log_stats_interval=0,
              trust_remote_code=True, enforce_eager=True, tensor_parallel_size=1,
              pipeline_parallel_size=1, gpu_memory_utilization=0.5)
    assert llm.llm_engine is llm.engine and isinstance(llm.engine, braid.LLMEngine)
    with pytest.raises(ValueError, match="tensor_parallel_size must be 1"):
        LLM(folder, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="--pipeline-parallel-size 9: between 1 and the "
                                         "model's 2 layers"):
        LLM(folder, pipeline_parallel_size=9)
    params = SamplingParams(temperature=0, max_tokens=3, n=3, ignore_eos=True)
    out = llm.generate(["a", "b"], params, lora_request=None)
    assert all(c.finished() for o in out for c in o.outputs)
    m = out[0].metrics  # vLLM's names for a request's times
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time
    assert m.first_token_time < m.last_token_time <= m.finished_time == m.finish_time
    assert m.time_in_queue == m.first_scheduled_time - m.arrival_time
    assert "2/2" in capsys.readouterr().err  # prompts, not the 6 engine requests
    with pytest.raises(ValueError, match="lora_request must be None"):
        llm.generate("a", params, lora_request=object())  # type: ignore[arg-type]
    for method in ("encode", "embed", "classify", "score", "beam_search"):
        with pytest.raises(NotImplementedError, match=f"LLM.{method}: braid runs generative"):
            getattr(llm, method)("a")
    for prompts in (None, 5):
        with pytest.raises(ValueError, match="prompts must be a prompt"):
            llm.generate(prompts, params)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sampling_params must be a SamplingParams or a list"):
        llm.generate(["a"], {"temperature": 0})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="messages must be a conversation"):
        llm.chat("hi")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="stop must be a string or a list of strings"):
        llm.generate("a", SamplingParams(stop=[1]))  # type: ignore[list-item]
    assert not llm.engine.has_unfinished_requests()
    # prompts as any iterable (a generator, a dataset column)
    assert len(llm.generate((p for p in ("x", "y")), params, use_tqdm=False)) == 2
    # the engine driven directly takes one completion a request; LLM ignores requests it
    # did not add
    from braid.engine.engine import RequestError
    with pytest.raises(RequestError, match="n must be 1 for one engine request, got 3"):
        llm.engine.add_request("mine", "a", params)
    llm.engine.add_request("mine", "a", SamplingParams(max_tokens=2))
    assert len(llm.generate(["a"], params, use_tqdm=False)[0].outputs) == 3
    clone = params.clone()
    assert clone == params and clone is not params


def test_the_tokenizer_answers_to_transformers_names(tmp_path) -> None:
    from braid import LLM
    from tests.tiny import save_tiny_model

    llm = LLM(str(save_tiny_model(tmp_path)), num_kv_blocks=64, log_stats_interval=0)
    tok = llm.get_tokenizer()
    messages = [{"role": "user", "content": "hi"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert isinstance(text, str) and ids == tok.encode(text, add_special_tokens=False)
    # an argument, not a template variable (it used to reach the template as one)
    assert tok.apply_chat_template(messages, chat_template="{{ tokenize }}",
                                   tokenize=False) == ""
    out = llm.generate({"prompt_token_ids": ids}, use_tqdm=False)[0]
    assert out.prompt_token_ids == ids
    assert tok("hi") == {"input_ids": tok.encode("hi")}
    assert tok(["hi", "yo"])["input_ids"] == [tok.encode("hi"), tok.encode("yo")]
    assert len(tok) == tok.vocab_size == len(tok.get_vocab())
    assert tok.convert_tokens_to_ids(tok.eos_token) == tok.eos_token_id
    assert tok.convert_tokens_to_ids(["<nope>"]) == [None]
    assert tok.batch_decode([tok.encode("hi"), tok.encode("yo")]) == ["hi", "yo"]
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token is tok.pad_token_id is None
    # chat_template_kwargs over chat's arguments, as vLLM's; tokenize among them is dropped
    # (the text is tokenized by chat itself)
    plain = llm.chat(messages, use_tqdm=False)[0].prompt_token_ids
    assert llm.chat(messages, use_tqdm=False, chat_template_kwargs={"tokenize": True}
                    )[0].prompt_token_ids == plain == ids
    assert llm.chat(messages, use_tqdm=False, chat_template_kwargs={
        "add_generation_prompt": False})[0].prompt_token_ids == tok.apply_chat_template(
            messages, add_generation_prompt=False, tokenize=True)
