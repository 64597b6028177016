"""The engine in a process of its own (braid/engine/process.py), as `braid serve` runs it:
the same outputs as the engine in this process, a refused request refused with its own
error, load figures after every call, and no process left behind."""

from __future__ import annotations

from pathlib import Path

import pytest

from braid.config import EngineConfig
from braid.engine.engine import LLMEngine
from braid.engine.input import RequestError
from braid.engine.process import EngineDied, EngineProcess
from braid.sampling_params import SamplingParams
from tests.tiny import save_tiny_model

PROMPTS = {"a": [5, 6, 7, 8, 9], "b": list(range(10, 40)), "c": [3] * 17}
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.8, seed=11, max_tokens=12, ignore_eos=True, logprobs=3,
                        prompt_logprobs=2)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def config(folder: Path) -> EngineConfig:
    return EngineConfig(model=str(folder), max_model_len=256, num_kv_blocks=64, block_size=4,
                        log_stats_interval=0)


def run(engine: LLMEngine | EngineProcess) -> dict[str, tuple]:
    """Each request's outputs, every step's (cumulative: each whole so far)."""
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, SEEDED if rid == "c" else PARAMS)
    seen: dict[str, list] = {rid: [] for rid in PROMPTS}
    while engine.has_unfinished_requests():
        for o in engine.step():
            c = o.outputs[0]
            seen[o.request_id].append((c.text, c.token_ids, c.logprobs, c.cumulative_logprob,
                                       c.finish_reason, o.prompt_logprobs, o.finished))
    return {rid: tuple(steps) for rid, steps in seen.items()}


def test_outputs_equal_the_engine_in_this_process(config: EngineConfig, folder: Path) -> None:
    alone = run(LLMEngine(EngineConfig(model=str(folder), max_model_len=256, num_kv_blocks=64,
                                       block_size=4, log_stats_interval=0)))
    engine = EngineProcess(config)
    try:
        assert run(engine) == alone
        assert run(engine) == alone  # a second batch, after the engine went idle
        engine.log_idle_stats()
        assert engine.num_running == engine.num_waiting == engine.num_used_blocks == 0
        assert engine.stats.generation_tokens == 2 * 12 * len(PROMPTS)
        assert not engine._whole
    finally:
        engine.shutdown()
    assert not engine._process.is_alive()


def test_a_refused_request_is_refused_alone(config: EngineConfig) -> None:
    engine = EngineProcess(config)
    try:
        engine.add_request("ok", [5, 6, 7], PARAMS)
        with pytest.raises(RequestError, match="prompt is 300 tokens"):
            engine.add_request("long", [5] * 300, PARAMS)
        assert engine.num_waiting == 1 and engine.has_unfinished_requests()
        engine.step()
        assert engine.num_running == 1 and engine.kv_usage > 0
        out = engine.abort("ok")
        assert out is not None and out.outputs[0].finish_reason == "abort"
        assert not engine.has_unfinished_requests()
    finally:
        engine.shutdown()


def test_a_load_error_is_the_servers_error(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="nowhere"):
        EngineProcess(EngineConfig(model=str(tmp_path / "nowhere")))


def test_a_dead_engine_process_is_reported(config: EngineConfig) -> None:
    engine = EngineProcess(config)
    engine._process.kill()
    engine._process.join()
    with pytest.raises(EngineDied, match="engine process"):
        engine.step()
    engine.shutdown()
