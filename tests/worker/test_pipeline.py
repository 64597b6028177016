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
from braid.worker.pipeline import (
    PipelineInput,
    PipelineRunner,
    micro_batches,
    rows_order,
    stage_layers,
)
from braid.worker.runner import ModelRunner, QuerySpan
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
        if size > 1 and llm.engine.config.max_num_batched_tokens >= 64:
            assert llm.engine.executor.runner.micro_batched > 0  # type: ignore[attr-defined]
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


@pytest.mark.parametrize("size, quantization, spec, budget", [
    (2, "auto", None, 16), (3, "auto", None, 16), (2, "int8", None, 16),
    (2, "auto", "ngram", 16), (2, "auto", "draft_model", 16), (2, "int8", "draft_model", 16),
    (2, "auto", None, 128), (3, "int8", "ngram", 128),  # prefills in micro-batches
])
def test_stages_answer_as_one_process(model_dir: Path, one_process: Callable[[str], list],
                                      size: int, quantization: str, spec: str | None,
                                      budget: int) -> None:
    options: dict[str, object] = {"quantization": quantization,
                                  "max_num_batched_tokens": budget}
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


def _spans() -> list[QuerySpan]:
    """A step's spans: a prefill chunk after cached context, a whole prompt scoring its
    prompt logprobs, a verification window (4 logits rows) and two decodes."""
    return [QuerySpan(list(range(20, 60)), 8, list(range(0, 12)), 1),
            QuerySpan(list(range(60, 90)), 0, list(range(12, 20)), 1, range(0, 29)),
            QuerySpan([5, 6, 7, 8], 12, list(range(20, 24)), 4),
            QuerySpan([9], 3, [24], 1), QuerySpan([10], 6, [25, 26], 1)]


@pytest.mark.parametrize("parts", [2, 3, 5])
def test_micro_batches_cut_the_flat_batch_in_order(parts: int) -> None:
    spans = _spans()
    pieces = micro_batches(spans, parts)
    flat = [t for s in spans for t in s.token_ids]
    assert [t for part in pieces for piece, _ in part for t in piece.token_ids] == flat
    sizes = [sum(len(p.token_ids) for p, _ in part) for part in pieces]
    assert len(pieces) == parts and max(sizes) - min(sizes) <= max(len(s.token_ids)
                                                                    for s in spans)
    for part in pieces:
        for piece, start in part:
            assert flat[start:start + len(piece.token_ids)] == piece.token_ids
    # the rows: each part's rows one after another, put in the whole forward's order
    runner_rows = []
    for part in pieces:
        runner_rows += [start + off for piece, start in part for off in piece.prompt_rows]
        runner_rows += [start + len(p.token_ids) - p.num_logits + i
                        for p, start in part for i in range(p.num_logits)]
    whole = []
    at = 0
    for s in spans:
        whole += [at + off for off in s.prompt_rows]
        at += len(s.token_ids)
    at = 0
    for s in spans:
        at += len(s.token_ids)
        whole += range(at - s.num_logits, at)
    assert torch.tensor(runner_rows)[rows_order(pieces)].tolist() == whole


def test_micro_batches_one_after_another_equal_the_whole_forward(model_dir: Path) -> None:
    """The parts of a forward run in order over one KV cache give the whole forward's
    logits rows: a later part's tokens see the earlier parts' KV, as a next chunk would."""
    from braid.models.build import load_model

    logits = []
    for parts in (1, 3):
        model, _ = load_model(str(model_dir), with_tokenizer=False)
        runner = ModelRunner(model, 40, 4, torch.device("cpu"))
        spans = _spans()
        if parts == 1:
            logits.append(runner.execute(runner.build_input(spans)))
            continue
        pieces = micro_batches(spans, parts)
        rows = torch.cat([runner.hidden_rows(runner.build_input([p for p, _ in part]))
                          for part in pieces])
        logits.append(model.compute_logits(rows[rows_order(pieces)], None))
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)


def test_only_prompt_tokens_make_micro_batches(model_dir: Path) -> None:
    """Decodes and verification windows go through the stages whole however many there are
    (their time is the weights' streaming, which each part would pay again); a step with
    enough prompt tokens goes in parts."""
    from braid.models.build import load_model

    model, _ = load_model(str(model_dir), with_tokenizer=False)
    runner = PipelineRunner(model, 40, 4, torch.device("cpu"), torch.float32, size=2)
    decodes = [QuerySpan([i], 3, [0], 1) for i in range(64)]
    windows = [QuerySpan([1, 2, 3, 4], 3, [0, 1], 4) for _ in range(16)]
    prompt = [QuerySpan(list(range(1, 70)), 0, list(range(18)), 1)]
    assert not isinstance(runner.build_input(decodes + windows), PipelineInput)
    split = runner.build_input(decodes + prompt)
    assert isinstance(split, PipelineInput) and len(split.parts) == 2


def test_a_ray_stage_that_fails_ends_its_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage's loop that raises in a Ray actor ends the actor's process, as a local
    stage's process ends, so its connections close and the first stage fails at once."""
    from braid.worker import lifetime, pipeline

    def fails(*args: object) -> None:
        raise FileNotFoundError("no model file on this node")

    exits = []
    monkeypatch.setattr(pipeline, "_stage_loop", fails)
    monkeypatch.setattr(lifetime.os, "_exit", exits.append)
    pipeline._StageActor().run(None, "tcp://127.0.0.1:1", 1, 4, torch.float32, range(2, 4))
    assert exits == [1]


def test_a_stage_that_ends_before_joining_is_an_error_not_a_wait() -> None:
    """A stage process that dies before it reaches the store (its start failed) ends the
    first stage's wait within seconds, naming the stage, instead of a wait without end."""
    import multiprocessing
    import time

    import torch.distributed as dist

    from braid.worker import pipeline

    store = dist.TCPStore("127.0.0.1", pipeline._free_port("127.0.0.1"), is_master=True,
                          wait_for_workers=False)
    dead = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(0,))
    dead.start()
    dead.join()
    executor = object.__new__(pipeline.PipelineExecutor)
    executor.stages = [dead]
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="pipeline stage 1 ended before it joined"):
        executor._wait_joined(store)
    assert time.monotonic() - start < 10


def test_the_first_stages_own_failure_keeps_the_pipeline(model_dir: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The first stage's layers raise once (whole forward and micro-batches alike): the
    later stages get zeros and stay in step, the step runs again in parts, the pipeline is
    not broken and the tokens are one process's."""
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = LLM(str(model_dir), **OPTIONS)
    want = [o.outputs[0].token_ids for o in alone.generate(PROMPTS, params, use_tqdm=False)]
    alone.shutdown()
    llm = LLM(str(model_dir), pipeline_parallel_size=2,
              **{**OPTIONS, "max_num_batched_tokens": 128})
    try:
        model = llm.engine.executor.runner.model  # type: ignore[attr-defined]
        plain, failed = model.forward_layers, []

        def once(*args: object) -> object:
            if not failed:
                failed.append(True)
                raise RuntimeError("out of memory")
            return plain(*args)

        monkeypatch.setattr(model, "forward_layers", once)
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        assert failed and got == want
        assert llm.engine.executor.runner.broken is None  # type: ignore[attr-defined]
    finally:
        llm.shutdown()
