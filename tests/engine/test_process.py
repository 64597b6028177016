"""The engine in a process of its own (braid/engine/process.py), as `braid serve` runs it:
the same outputs as the engine in this process, a refused request refused with its own
error, load figures after every call, and no process left behind."""

from __future__ import annotations

import dataclasses
import pickle
import queue
import threading
import time
from pathlib import Path

import pytest

from braid.config import EngineConfig
from braid.engine import process
from braid.engine.engine import LLMEngine
from braid.engine.input import RequestError
from braid.engine.process import EngineDied, EngineProcess, EngineSide, build_engine
from braid.outputs import Logprob, PackedLogprobs
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
    assert engine.add_requests([(rid, prompt, SEEDED if rid == "c" else PARAMS, None, 0, None)
                                for rid, prompt in PROMPTS.items()]) == [None] * len(PROMPTS)
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


def test_the_engine_steps_without_waiting_for_the_server(config: EngineConfig,
                                                        folder: Path) -> None:
    """The engine's process steps on its own: a server that reads late finds every step's
    outputs waiting, in order, and the same tokens as an engine that was asked step by step.
    Requests added one at a time (the first runs before the others arrive) end the same."""
    alone = LLMEngine(EngineConfig(model=str(folder), max_model_len=256, num_kv_blocks=64,
                                   block_size=4, log_stats_interval=0))
    expected = {rid: steps[-1] for rid, steps in run(alone).items()}
    engine = EngineProcess(config)
    try:
        for rid, prompt in PROMPTS.items():
            engine.add_request(rid, prompt, SEEDED if rid == "c" else PARAMS)
        deadline = time.monotonic() + 30
        while engine._load.has_unfinished and time.monotonic() < deadline:
            time.sleep(0.05)  # the server is busy: it does not read
            engine._conn.poll(0) and engine._next_message()
        outputs = engine.step()  # every step's, at once
        assert not engine.has_unfinished_requests()
        finals = {}
        for o in outputs:
            c = o.outputs[0]
            finals[o.request_id] = (c.text, c.token_ids, c.logprobs, c.cumulative_logprob,
                                    c.finish_reason, o.prompt_logprobs, o.finished)
        assert sum(o.request_id == "a" for o in outputs) == PARAMS.max_tokens
        assert finals == expected
        assert isinstance(finals["c"][5], PackedLogprobs)
    finally:
        engine.shutdown()


def test_large_calls_and_large_outputs_cross_at_once(config: EngineConfig) -> None:
    """A call of megabytes (200,000 bad words' ids) sent while the engine sends steps with
    prompt logprobs of the whole vocabulary: neither side waits for the other to read."""
    engine = EngineProcess(dataclasses.replace(config, max_logprobs=-1))
    try:
        wide = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, prompt_logprobs=-1)
        engine.add_request("wide", list(range(3, 200)), wide)
        bad = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                             bad_words_token_ids=[[7, 8 + i % 50] for i in range(200_000)])
        engine.add_request("bad", [5, 6, 7], bad)
        finished = set()
        while engine.has_unfinished_requests():
            finished |= {o.request_id for o in engine.step() if o.finished}
        assert finished == {"wide", "bad"}
    finally:
        engine.shutdown()


def test_a_refused_request_is_refused_alone(config: EngineConfig) -> None:
    engine = EngineProcess(config)
    try:
        errors = engine.add_requests([("ok", [5, 6, 7], PARAMS, None, 0, None),
                                      ("long", [5] * 300, PARAMS, None, 0, None)])
        assert errors[0] is None and isinstance(errors[1], RequestError)
        assert "prompt is 300 tokens" in str(errors[1])
        with pytest.raises(RequestError, match="already in use"):
            engine.add_request("ok", [5, 6, 7], PARAMS)
        assert engine.has_unfinished_requests()
        engine.step()
        assert engine.num_running == 1 and engine.kv_usage > 0
        out = engine.abort("ok")
        assert out is not None and out.outputs[0].finish_reason == "abort"
        while engine.has_unfinished_requests():  # the steps it made before the abort
            assert engine.step() == []  # are not news after it
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


def test_packed_logprobs_read_as_the_entries_they_pack() -> None:
    entries = [None, {5: Logprob(-0.5, 1, "a"), 9: Logprob(-1.25, 2, None)},
               {7: Logprob(-3.0, None, "b")}, {}, {8: Logprob(float("-inf"), 4, "c")}]
    packed = pickle.loads(pickle.dumps(PackedLogprobs(entries)))
    assert len(packed) == len(entries) and list(packed) == entries and packed == entries
    assert [packed[i] for i in range(len(entries))] == entries
    assert packed[-1] == entries[-1] and packed[1:3] == entries[1:3]
    with pytest.raises(IndexError):
        packed[len(entries)]
    assert PackedLogprobs([]) == [] and packed != entries[:-1]


def test_packed_logprobs_grow_chunk_by_chunk() -> None:
    """A prompt scored in chunks: each chunk's rows appended, as one list of entries would."""
    first = [None, {5: Logprob(-0.5, 1, "a")}]
    second = [{7: Logprob(-3.0, 2, None), 8: Logprob(-0.1, 1, "c")}, {9: Logprob(-1.0, 1)}]
    grown = PackedLogprobs(first)
    grown.extend(PackedLogprobs.from_rows([7, 8, 9], [-3.0, -0.1, -1.0], [2, 1, 1], [2, 1],
                                          ["x", "c", None]).with_texts([None, "c", None]))
    grown.extend(PackedLogprobs([None]))
    assert list(grown) == first + second + [None] and grown[3] == second[1] and grown[4] is None


def test_a_message_that_does_not_pickle_goes_as_a_failure() -> None:
    """The engine's writer thread never stops on a bad message (the server would wait for
    it forever): the message goes as its kind's failure, and the next one after it."""
    import multiprocessing
    import queue
    import threading

    from braid.engine.process import _write_messages

    reader, writer = multiprocessing.Pipe(duplex=False)
    outbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
    threading.Thread(target=_write_messages, args=(writer, outbox), daemon=True).start()
    outbox.put(("answer", True, lambda: None, None))
    outbox.put(("step", True, [], None))
    kind, ok, value, _ = reader.recv()
    assert (kind, ok) == ("answer", False) and "did not pickle" in str(value)
    assert reader.recv() == ("step", True, [], None)


SKEW = 1000.0  # how far ahead the other machine's monotonic clock runs


class ElsewhereEngine(EngineProcess):
    """The transport of an engine on another machine (a Ray actor's), played by a thread of
    this process whose clock the `elsewhere` fixture sets SKEW seconds ahead."""

    def __init__(self, config: EngineConfig) -> None:
        self._inbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, args=(config,),
                                        name="braid-elsewhere", daemon=True)
        self._thread.start()
        self._start()

    def _serve(self, config: EngineConfig) -> None:
        engine, first = build_engine(config)
        self._outbox.put(first)
        EngineSide(engine, self._inbox, self._outbox, server_pid=None).run()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._inbox.put(("stop",))
        self._thread.join(timeout)

    def _put(self, message: tuple) -> None:
        self._inbox.put(message)

    def _has_message(self) -> bool:
        return not self._outbox.empty()

    def _get(self) -> tuple:
        return self._outbox.get()


@pytest.fixture
def elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monotonic, clock = time.monotonic, process.clock

    def far() -> bool:
        return threading.current_thread().name == "braid-elsewhere"

    monkeypatch.setattr(time, "monotonic", lambda: monotonic() + (SKEW if far() else 0.0))
    monkeypatch.setattr(process, "clock",
                        lambda: ("elsewhere", time.monotonic()) if far() else clock())


@pytest.mark.usefixtures("elsewhere")
def test_an_engine_on_another_machines_clock_reports_times_on_this_ones(
        config: EngineConfig) -> None:
    """Arrival goes to the engine on its clock, and its times come back on this one's: the
    server's TTFT, queue and e2e times stay true where the two clocks differ."""
    engine = ElsewhereEngine(config)
    try:
        assert abs(engine._clock_offset + SKEW) < 1.0
        for _ in range(2):  # a second batch after idle
            arrival = time.monotonic() - 0.5  # the server took half a second to add it
            engine.add_request("r", PROMPTS["b"], PARAMS, arrival_time=arrival)
            outputs = []
            while engine.has_unfinished_requests():
                outputs += engine.step()
            m = outputs[-1].metrics
            assert abs(m.arrival_time - arrival) < 0.1
            assert m.first_token_time is not None and m.finish_time is not None
            assert m.first_scheduled_time is not None
            # (this side reads them late by the info message's transit: milliseconds)
            assert arrival + 0.5 <= m.first_scheduled_time <= m.first_token_time
            assert m.first_token_time <= m.finish_time <= time.monotonic() + 0.25
    finally:
        engine.shutdown()
