"""Pipeline stages (--pipeline-parallel-size) on local processes or Ray actors over gloo:
the layers' split, and outputs token for token those of one process, greedy and seeded,
through chunked prefill, preemption, prefix caching and speculation (the draft on the first
stage); a stage that is gone breaks the pipeline at once."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from braid import LLM, SamplingParams
from braid.config import ConfigError
from braid.worker.lifetime import ExecutorBroken
from braid.worker.pipeline import stage_layers
from tests.tiny import save_tiny_model

PROMPTS = ["the cat sat on the mat and the cat sat on the", "once upon a time",
           "a b c d e f g a b c d e f", "pipeline stages pass hidden states"]
# a small cache (preemptions), a small budget (chunked prefill), prefix caching on
OPTIONS = dict(num_kv_blocks=40, block_size=4, max_model_len=128, max_num_batched_tokens=16,
               max_num_seqs=4, log_stats_interval=0)


def test_layers_split_contiguously_the_earlier_stages_taking_the_remainder() -> None:
    assert [stage_layers(7, 3, r) for r in range(3)] == [range(0, 3), range(3, 5), range(5, 7)]
    assert [stage_layers(4, 2, r) for r in range(2)] == [range(0, 2), range(2, 4)]
    with pytest.raises(ConfigError, match="--pipeline-parallel-size 5"):
        stage_layers(4, 5, 0)


@pytest.mark.parametrize("quantization", ["auto", "int8"])
def test_a_later_stage_holds_only_its_layers(model_dir: Path, quantization: str) -> None:
    """The first stage keeps the embedding and LM head with its layers; a later stage only
    its layers (and the final norm's few bytes): the others' weights are freed."""
    from braid.models.build import load_model

    first, _ = load_model(str(model_dir), quantization=quantization, with_tokenizer=False)
    later, _ = load_model(str(model_dir), quantization=quantization, with_tokenizer=False)
    first.keep_layers(range(0, 2))
    later.keep_layers(range(2, 4), ends=False)
    cfg = first.config
    assert first.weight_bytes() - later.weight_bytes() >= cfg.vocab_size * cfg.hidden_size
    with pytest.raises(RuntimeError, match="the embedding runs on another pipeline stage"):
        later.embed(torch.tensor([1, 2]))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("pp-model"), num_hidden_layers=4)


def _outputs(model: Path, size: int, **options: object) -> list[list[list[int]]]:
    llm = LLM(str(model), pipeline_parallel_size=size, **{**OPTIONS, **options})
    try:
        runs = []
        for params in (SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                       SamplingParams(temperature=0.9, seed=11, max_tokens=24,
                                      ignore_eos=True, n=2)):
            for _ in range(2):  # the second time from the prefix cache
                out = llm.generate(PROMPTS, params, use_tqdm=False)
                runs.append([c.token_ids for o in out for c in o.outputs])
        assert llm.engine.stats.num_preemptions > 0
        assert llm.engine.stats.prefix_cache_hits > 0
        return runs
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def one_process(model_dir: Path) -> Callable[[str], list]:
    """One process's outputs (no speculation) by --quantization, each computed once."""
    runs: dict[str, list] = {}

    def outputs(quantization: str) -> list:
        if quantization not in runs:
            runs[quantization] = _outputs(model_dir, 1, quantization=quantization)
        return runs[quantization]

    return outputs


@pytest.mark.parametrize("size, quantization, spec", [
    (2, "auto", None), (3, "auto", None), (2, "int8", None), (2, "auto", "ngram"),
    (2, "auto", "draft_model"), (2, "int8", "draft_model"),
])
def test_stages_answer_as_one_process(model_dir: Path, one_process: Callable[[str], list],
                                      size: int, quantization: str, spec: str | None) -> None:
    options: dict[str, object] = {"quantization": quantization}
    if spec is not None:
        config: dict[str, object] = {"method": spec, "num_speculative_tokens": 3}
        if spec == "draft_model":
            config["model"] = str(model_dir)  # the draft runs on the first stage
        options["speculative_config"] = config
    assert _outputs(model_dir, size, **options) == one_process(quantization)


def test_stages_as_ray_actors_answer_as_one_process_and_break_when_one_is_gone(
        model_dir: Path, one_process: Callable[[str], list]) -> None:
    """`--distributed-executor-backend ray`: the later stage is an actor of the local
    cluster the engine joins (and leaves at its end); the same tokens as one process. An
    actor killed breaks the pipeline: the next step raises ExecutorBroken (the engine ends),
    no request is blamed for it."""
    ray = pytest.importorskip("ray")
    assert not ray.is_initialized()
    assert _outputs(model_dir, 2, distributed_executor_backend="ray") == one_process("auto")
    assert not ray.is_initialized()
    llm = LLM(str(model_dir), pipeline_parallel_size=2, distributed_executor_backend="ray",
              **OPTIONS)
    try:
        [stage] = llm.engine.executor.stages  # type: ignore[attr-defined]
        ray.kill(stage.actor)
        with pytest.raises(ExecutorBroken, match="the pipeline broke"):
            llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4), use_tqdm=False)
    finally:
        llm.shutdown()
    assert not ray.is_initialized()
