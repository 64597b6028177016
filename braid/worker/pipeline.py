"""Pipeline parallelism (`--pipeline-parallel-size P`): the decoder layers split over P
processes that pass each step's hidden states on with torch.distributed (gloo on the CPU;
the same calls take NCCL on GPUs).

Rank 0 is the engine's executor: it holds the scheduler's side, the embedding, the first
stage's layers, the final norm and LM head, the sampler and the draft model. Each forward it
sends the batch (`ModelInput`: ids, positions, attention metadata) to every stage
(`broadcast_object_list`), runs the embedding and its layers, and sends the hidden states
[T, hidden] to rank 1; each later rank runs its layers over its own KV cache (its layers'
share of every block) and sends on; the last rank sends back only the rows whose logits
the forward needs, and rank 0 scores and samples them as one process would. The kernels are
batch invariant and hidden states cross in full precision, so the output is the one
process's, token for token.

A large forward (prefill chunks) goes as micro-batches that overlap across the stages
(PipelineRunner); a small one (decodes) passes the stages one after another, costing the whole
model's compute plus P - 1 transfers of [T, hidden] and one of [rows, hidden]. P processes
on one machine buy memory (each holds its share of the layers and of the
KV cache after loading; the stages load the whole file one after another and drop the
others' layers, so the peak is the first stage's share and one model), not speed. The
later stages are local processes (127.0.0.1), or with `--distributed-executor-backend ray`
Ray actors placed where the cluster has their CPUs, other machines included (rank 0 listens
on its node's address).
"""

from __future__ import annotations

import bisect
import contextlib
import datetime
import logging
import multiprocessing
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from braid.config import ConfigError, EngineConfig
from braid.models.interface import CausalLM
from braid.models.kv_layout import KVLayout, kv_layout
from braid.worker.cluster import connected, join_cluster, wait_placed
from braid.worker.executor import InProcessExecutor
from braid.worker.lifetime import ExecutorBroken, exit_on_failure, follow_parent
from braid.worker.runner import ModelInput, ModelRunner, QuerySpan

logger = logging.getLogger("braid")

# Later stages wait for the next forward as long as the engine idles; a stage that dies
# closes its connections, which fails the step at once, so no timeout is needed for that
TIMEOUT = datetime.timedelta(days=365)
MIN_PART_TOKENS = 32  # a forward's micro-batches have at least this many query tokens


def stage_layers(num_layers: int, size: int, rank: int) -> range:
    """Rank's share of the decoder layers: contiguous, as even as they divide, the earlier
    ranks one more where they do not (rank 0 also embeds, scores and samples)."""
    if not 1 <= size <= num_layers:
        raise ConfigError(f"--pipeline-parallel-size {size}: between 1 and the model's "
                         f"{num_layers} layers")
    base, extra = divmod(num_layers, size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


class PipelineRunner(ModelRunner):
    """The first stage's runner: each forward goes through every stage (`hidden_rows`), so
    everything that runs the target (steps, the cost model's warm-up) runs the pipeline.

    A forward of at least 2 * MIN_PART_TOKENS prompt tokens goes as up to P micro-batches of
    about equal tokens (`micro_batches`: the flat batch cut in order, a span cut where a cut
    falls), one after another through each stage, so while stage 2 runs the first, stage 1
    runs the second. A later part's tokens attend to an earlier part's as chunked prefill
    does: each stage wrote the earlier part's KV before it runs the later one. Small
    forwards (decodes) go whole: their time is the weights' streaming, which each part would
    pay again."""

    def __init__(self, model: CausalLM, num_blocks: int, block_size: int,
                 device: torch.device, kv_dtype: torch.dtype, size: int,
                 layout: KVLayout | None = None) -> None:
        layers = stage_layers(model.config.num_hidden_layers, size, 0)
        model.keep_layers(layers)
        super().__init__(model, num_blocks, block_size, device, kv_dtype, layers, layout)
        self.size = size
        self.broken: str | None = None  # why the pipeline broke
        self.micro_batched = 0  # forwards sent as micro-batches

    def build_input(self, spans: list[QuerySpan]) -> ModelInput:
        whole = super().build_input(spans)
        # prompt tokens only: a decode's or a verification window's tokens are all rows
        prefill = sum(len(s.token_ids) - s.num_logits for s in spans)
        parts = min(self.size, prefill // MIN_PART_TOKENS)
        if parts < 2:
            return whole
        pieces = micro_batches(spans, parts)
        self.micro_batched += 1
        return PipelineInput(whole.input_ids, whole.positions, whole.attn_metadata,
                             whole.logits_indices, whole.num_prompt_rows,
                             [super(PipelineRunner, self).build_input([p for p, _ in part])
                              for part in pieces], rows_order(pieces))

    def hidden_rows(self, inp: ModelInput) -> torch.Tensor:
        """The forward through every stage. One that fails leaves the stages out of step
        with this one (or one of them is gone): the pipeline is broken for good, and every
        later forward says so at once instead of waiting on the others. This stage's own
        layers failing is not that: the stages get zeros for its parts and stay in step."""
        if self.broken is not None:
            raise ExecutorBroken(f"the pipeline broke: {self.broken}")
        parts, order = (inp.parts, inp.order) if isinstance(inp, PipelineInput) else ([inp], None)
        try:
            dist.broadcast_object_list([parts], src=0)
            rows, error = self._through_stages(parts)
        except Exception as e:
            self.broken = f"{type(e).__name__}: {e}"
            raise ExecutorBroken(f"the pipeline broke: {self.broken}") from e
        if error is not None:
            raise error
        return rows if order is None else rows[order]

    def _through_stages(self, parts: list[ModelInput]) -> tuple[torch.Tensor, Exception | None]:
        """Each part through this stage's layers and sent on, then every part's rows from the
        last stage; the error this stage's layers raised, if any."""
        model, error, sends = self.model, None, []
        for part in parts:
            hidden = None
            if error is None:
                try:
                    hidden = model.forward_layers(model.embed(part.input_ids), part.positions,
                                                  part.attn_metadata, self.layers)
                except Exception as e:
                    error = e
            if hidden is None:  # the stages stay in step; the step runs again in parts
                hidden = torch.zeros(len(part.input_ids), model.config.hidden_size,
                                     dtype=model.dtype)
            sends.append(dist.isend(hidden.contiguous(), dst=1))
        rows = [torch.empty(len(p.logits_indices), model.config.hidden_size, dtype=model.dtype)
                for p in parts]
        for r in rows:
            dist.recv(r, src=self.size - 1)
        _wait(sends)
        return torch.cat(rows), error


@dataclass(slots=True)
class PipelineInput(ModelInput):
    """A forward sent as micro-batches: the whole's layout (its rows) and its parts;
    `order`: the whole's rows from the parts' rows one after another."""

    parts: list[ModelInput] = field(default_factory=list)
    order: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.long))


def micro_batches(spans: list[QuerySpan], parts: int) -> list[list[tuple[QuerySpan, int]]]:
    """The flat batch of `spans` cut into `parts` runs of about equal tokens, in order; a
    span a cut falls in is cut there (its later piece starts where the earlier ends, as a
    next prefill chunk would). Each piece with its first token's index in the flat batch."""
    total = sum(len(s.token_ids) for s in spans)
    cuts = [total * j // parts for j in range(1, parts)]  # where part j + 1 begins
    out: list[list[tuple[QuerySpan, int]]] = [[] for _ in range(parts)]
    flat = 0
    for span in spans:
        n, lo = len(span.token_ids), 0
        while lo < n:
            part = bisect.bisect_right(cuts, flat + lo)
            hi = n if part == len(cuts) else min(n, cuts[part] - flat)
            out[part].append((_piece(span, lo, hi), flat + lo))
            lo = hi
        flat += n
    return [p for p in out if p]


def _piece(span: QuerySpan, lo: int, hi: int) -> QuerySpan:
    """Tokens [lo, hi) of `span`, with the logits rows and prompt rows that fall in them."""
    n = len(span.token_ids)
    rows = span.prompt_rows
    return QuerySpan(span.token_ids[lo:hi], span.start + lo, span.block_table,
                     max(0, hi - max(lo, n - span.num_logits)),
                     range(max(rows.start, lo) - lo, max(min(rows.stop, hi) - lo, 0)),
                     span.more_tables)


def rows_order(pieces: list[list[tuple[QuerySpan, int]]]) -> torch.Tensor:
    """Where each of the whole forward's rows is among the parts' rows one after another.
    A forward's rows are its prompt rows, then its logits rows, each in flat-batch order
    (ModelRunner.build_input); so are each part's."""
    keys = []
    for part in pieces:
        keys += [(0, flat + offset) for piece, flat in part for offset in piece.prompt_rows]
        keys += [(1, flat + len(piece.token_ids) - piece.num_logits + i)
                 for piece, flat in part for i in range(piece.num_logits)]
    return torch.tensor(sorted(range(len(keys)), key=keys.__getitem__), dtype=torch.long)


class PipelineExecutor(InProcessExecutor):
    """The engine's executor over P stages: this process is the first (PipelineRunner), the
    others are processes it starts and ends: local ones, or Ray actors wherever the cluster
    has their CPUs (`--distributed-executor-backend ray`)."""

    def __init__(self, config: EngineConfig, model: CausalLM, num_blocks: int,
                 kv_dtype: torch.dtype, eos_token_ids: frozenset[int]) -> None:
        size = config.pipeline_parallel_size
        num_layers = model.config.num_hidden_layers
        model.keep_layers(stage_layers(num_layers, size, 0))  # (a ConfigError first)
        self.stages: list[Any] = []
        self.leave: Callable[[], None] | None = None  # where this joined a Ray cluster
        try:
            store = self._start_stages(config, [
                (rank, num_blocks, kv_dtype, stage_layers(num_layers, size, rank))
                for rank in range(1, size)])
            self._wait_joined(store)
            dist.init_process_group("gloo", store=store, rank=0, world_size=size,
                                    timeout=TIMEOUT)
            for _ in range(1, size):
                dist.barrier()  # the stages load one after another (a peak of one model)
        except BaseException:
            self.shutdown()
            raise
        runner = PipelineRunner(model, num_blocks, config.block_size,
                                torch.device(config.device), kv_dtype, size,
                                kv_layout(model.config, config))
        super().__init__(config, model, num_blocks, kv_dtype, eos_token_ids, runner)

    def _start_stages(self, config: EngineConfig, stages: list[tuple]) -> dist.TCPStore:
        """Start the later stages (`stages`: each one's rank, KV blocks, KV dtype and layers);
        the store they meet at, which this rank serves."""
        ray = None
        if config.distributed_executor_backend == "ray":
            joined = connected()
            ray = join_cluster()
            if not joined:  # an engine in this process (the offline LLM): it leaves at the end
                self.leave = ray.shutdown
        host = "127.0.0.1" if ray is None else ray.util.get_node_ip_address()
        address = (host, _free_port("127.0.0.1" if ray is None else ""))
        store = dist.TCPStore(*address, is_master=True, timeout=TIMEOUT, wait_for_workers=False)
        context = multiprocessing.get_context("spawn")
        for args in stages:
            if ray is not None:
                self.stages.append(_RayStage(ray, config, address, args))
                continue
            process = context.Process(target=_stage_main, name=f"braid-stage-{args[0]}",
                                      daemon=True, args=(config, address, *args))
            process.start()
            self.stages.append(process)
        return store

    def _wait_joined(self, store: dist.TCPStore) -> None:
        """Until every stage has reached the store; one that ended before (it failed to
        start) is an error now, not a wait without end."""
        keys = [f"stage-{rank}" for rank in range(1, len(self.stages) + 1)]
        while True:
            try:
                store.wait(keys, datetime.timedelta(seconds=1))
                return
            except RuntimeError:  # not all of them yet (a timeout)
                for rank, stage in enumerate(self.stages, 1):
                    if _ended(stage):
                        raise RuntimeError(f"pipeline stage {rank} ended before it joined "
                                           "(its error is in the log above)") from None

    def shutdown(self) -> None:
        runner = getattr(self, "runner", None)
        if dist.is_initialized():
            if isinstance(runner, PipelineRunner) and runner.broken is None:
                dist.broadcast_object_list([None], src=0)  # the stages' loops end
            dist.destroy_process_group()
        for stage in self.stages:
            stage.join(10)
            stage.kill()  # (one that ended: nothing to do)
        if self.leave is not None:
            self.leave()


class _StageActor:
    """A later stage as a Ray actor (made one in `_RayStage`)."""

    def ready(self) -> None:
        """Answers once the actor has its CPUs (placed)."""

    def run(self, config: EngineConfig, address: tuple[str, int], rank: int, num_blocks: int,
            kv_dtype: torch.dtype, layers: range) -> None:
        """The stage's loop; where it fails the actor's process ends, as a local stage's
        would, so its connections close and the first stage's transfer fails at once
        (an actor that raised would keep them open and the first stage waiting)."""
        exit_on_failure(f"pipeline stage {rank}", _stage_loop, config, address, rank,
                        num_blocks, kv_dtype, layers)


class _RayStage:
    """A Ray actor running a stage's loop, ended as a process is (join, kill). Ray ends it
    with the engine's process or actor that started it (its owner)."""

    def __init__(self, ray: Any, config: EngineConfig, address: tuple[str, int], args: tuple
                 ) -> None:
        self.ray = ray
        self.actor = ray.remote(_StageActor).options(num_cpus=config.threads).remote()
        wait_placed(ray, self.actor.ready.remote(), f"pipeline stage {args[0]}",
                    config.threads)
        self.done = self.actor.run.remote(config, address, *args)

    def join(self, timeout: float) -> None:
        self.ray.wait([self.done], timeout=timeout)

    def ended(self) -> bool:
        return bool(self.ray.wait([self.done], timeout=0)[0])

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            self.ray.kill(self.actor)


def _ended(stage: Any) -> bool:
    """Whether a stage (a local process or a `_RayStage`) has ended."""
    return stage.ended() if isinstance(stage, _RayStage) else stage.exitcode is not None


def _stage_main(config: EngineConfig, address: tuple[str, int], rank: int, num_blocks: int,
                kv_dtype: torch.dtype, layers: range) -> None:
    """A later stage in a local process: it ends with the engine's."""
    follow_parent()
    _stage_loop(config, address, rank, num_blocks, kv_dtype, layers)


def _stage_loop(config: EngineConfig, address: tuple[str, int], rank: int, num_blocks: int,
                kv_dtype: torch.dtype, layers: range) -> None:
    """A later stage: load the model, keep `layers`, then run them for every forward rank 0
    broadcasts until it broadcasts None."""
    torch.set_num_threads(config.threads)
    size = config.pipeline_parallel_size
    # joined before loading: a stage that fails to load ends its connections, and the
    # first stage's wait fails at once
    store = dist.TCPStore(*address, is_master=False, timeout=TIMEOUT)
    store.set(f"stage-{rank}", "up")
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=TIMEOUT)
    for turn in range(1, size):
        if turn == rank:
            runner = _load_stage(config, num_blocks, kv_dtype, layers)
        dist.barrier()
    last = rank == size - 1
    while True:
        message: list[Any] = [None]
        dist.broadcast_object_list(message, src=0)
        if message[0] is None:
            break
        _run_stage(runner, message[0], rank, last)
    dist.destroy_process_group()


def _load_stage(config: EngineConfig, num_blocks: int, kv_dtype: torch.dtype, layers: range
                ) -> ModelRunner:
    from braid.models.build import load_model

    model, _ = load_model(config.model, config.torch_dtype, config.device, config.quantization,
                          with_tokenizer=False, max_model_len=config.max_model_len)
    model.keep_layers(layers, ends=False)
    return ModelRunner(model, num_blocks, config.block_size, torch.device(config.device),
                       kv_dtype, layers,
                       kv_layout(model.config, config))


@torch.inference_mode()
def _run_stage(runner: ModelRunner, parts: list[ModelInput], rank: int, last: bool) -> None:
    """A forward's parts through this stage's layers, each sent on as soon as it is done."""
    model, sends = runner.model, []
    for inp in parts:
        hidden = torch.empty(len(inp.input_ids), model.config.hidden_size, dtype=model.dtype)
        dist.recv(hidden, src=rank - 1)
        hidden = model.forward_layers(hidden, inp.positions, inp.attn_metadata, runner.layers)
        out = hidden[inp.logits_indices] if last else hidden
        sends.append(dist.isend(out.contiguous(), dst=0 if last else rank + 1))
    _wait(sends)


def _wait(sends: list[Any]) -> None:
    """Until every send has left (its tensor may be freed then)."""
    for send in sends:
        if send is not None:
            send.wait()


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]

