"""Scale-out by simulation: multi-turn ShareGPT sessions replayed over 8-64 simulated replicas,
comparing the routers (TTFT p50 / p99, prefix-cache hit rate, throughput).

A planning tool, not a measurement: each replica is a simplified braid engine (stall-free
steps: every running request past its prompt decodes a token, prompt chunks fill the rest
of the token budget, up to --max-num-seqs running; its prefix cache a least-recently-used set
of block hashes as large as its KV cache), and a step lasts what braid's own cost model
(`ForwardCost`, braid/spec_decode/cost_model.py) predicts once fitted to forwards measured
on this machine (--calibrate runs the model and writes them; without it the file written
last is read). What is real is the routing: every request goes through braid's own router
(braid/engine/router.py) with the replicas' loads at that moment, as the server routes.
No speculation is simulated.

    python benchmarks/simulate_replicas.py --calibrate        # measure forwards (~2 min)
    python benchmarks/simulate_replicas.py --replicas 8,16,64
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from braid.bench.args import comma_choices
from braid.bench.datasets import sharegpt_conversations, tokenizer_for
from braid.bench.sweep_report import machine_info
from braid.config import DEFAULT_TARGET, comma_list, positive_float, positive_int
from braid.engine.router import (
    ROUTER_POLICIES,
    BlockRecord,
    Router,
    RouterConfig,
    make_router,
    prompt_hashes,
)
from braid.spec_decode.cost_model import ForwardCost, attention_work

CALIBRATION = Path("docs/benchmarks/replica_calibration.json")
BLOCK = 16


@dataclass
class Turn:
    prompt: list[int]  # the conversation so far, as token ids
    output_len: int


@dataclass
class Request:
    session: int
    turn: int
    prompt: list[int]
    output_len: int
    arrival: float
    hashes: list[bytes] = field(default_factory=list)
    computed: int = 0  # prompt tokens with KV (cached ones included)
    generated: int = 0
    cached: int = 0
    first_token: float | None = None


class Replica:
    """One simulated engine: waiting queue, running batch, prefix cache of block hashes."""

    def __init__(self, cost: ForwardCost, capacity_blocks: int, budget: int, max_seqs: int
                 ) -> None:
        self.cost, self.budget, self.max_seqs = cost, budget, max_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.cache = BlockRecord(capacity_blocks)
        self.stepping = False  # a step is under way or due

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.running)

    def step(self, now: float) -> tuple[float, list[Request], list[Request]]:
        """One step from `now`: its end, the requests that got their first token, those
        that finished."""
        scheduled: list[tuple[Request, int]] = []
        budget = self.budget
        for r in self.running:
            if r.computed >= len(r.prompt) and budget > 0:
                scheduled.append((r, 1))
                budget -= 1
        while self.waiting and len(self.running) < self.max_seqs:
            r = self.waiting.popleft()
            self._admit(r)
            self.running.append(r)
        for r in self.running:
            if r.computed < len(r.prompt) and budget > 0:
                chunk = min(len(r.prompt) - r.computed, budget)
                scheduled.append((r, chunk))
                budget -= chunk
        tokens = sum(n for _, n in scheduled)
        attention = sum(attention_work(n, r.computed + r.generated) for r, n in scheduled)
        rows = sum(1 for r, n in scheduled if r.computed + n >= len(r.prompt))
        end = now + self.cost(tokens, attention, rows)
        return end, *self._advance(scheduled, end)

    def _admit(self, r: Request) -> None:
        matched = self.cache.matched(r.hashes, touch=True)
        r.cached = r.computed = min(matched * BLOCK, len(r.prompt) - 1)

    def _advance(self, scheduled: list[tuple[Request, int]], end: float
                 ) -> tuple[list[Request], list[Request]]:
        first, done = [], []
        for r, n in scheduled:
            if r.computed < len(r.prompt):
                r.computed += n
                if r.computed < len(r.prompt):
                    continue
            r.generated += 1
            if r.first_token is None:
                r.first_token = end
                first.append(r)
                self.cache.remember(r.hashes)
            if r.generated >= r.output_len:
                done.append(r)
        self.running = [r for r in self.running if r not in done]
        return first, done


class Simulation:
    """Sessions start at Poisson times; a session's next turn comes --think-time after its
    previous answer ended (exponentially distributed)."""

    def __init__(self, sessions: list[list[Turn]], router: Router, replicas: list[Replica],
                 rate: float, think: float, seed: int) -> None:
        self.sessions, self.router, self.replicas = sessions, router, replicas
        self.think, self.rng = think, random.Random(seed)
        self.events: list[tuple[float, int, str, Any]] = []
        self.order = 0
        t = 0.0
        for i in range(len(sessions)):
            t += self.rng.expovariate(rate)
            self._at(t, "arrive", (i, 0))
        self.finished: list[Request] = []

    def _at(self, time: float, kind: str, what: Any) -> None:
        self.order += 1
        heapq.heappush(self.events, (time, self.order, kind, what))

    def run(self) -> float:
        now = 0.0
        while self.events:
            now, _, kind, what = heapq.heappop(self.events)
            if kind == "arrive":
                self._arrive(now, *what)
            else:
                self._step(now, what)
        return now

    def _arrive(self, now: float, session: int, turn: int) -> None:
        t = self.sessions[session][turn]
        r = Request(session, turn, t.prompt, t.output_len, now, prompt_hashes(t.prompt, BLOCK))
        route = self.router.route(r.prompt, [x.load for x in self.replicas])
        replica = self.replicas[route.replica]
        replica.waiting.append(r)
        if not replica.stepping:
            replica.stepping = True
            self._at(now, "step", route.replica)

    def _step(self, now: float, index: int) -> None:
        replica = self.replicas[index]
        if not replica.running and not replica.waiting:
            replica.stepping = False
            return
        end, _, done = replica.step(now)
        for r in done:
            self.finished.append(r)
            if r.turn + 1 < len(self.sessions[r.session]):
                self._at(end + self.rng.expovariate(1 / self.think), "arrive",
                         (r.session, r.turn + 1))
        self._at(end, "step", index)


def summary(finished: list[Request], duration: float) -> dict[str, float]:
    ttft = np.array([r.first_token - r.arrival for r in finished if r.first_token is not None])
    prompt = sum(len(r.prompt) for r in finished)
    return {"requests": len(finished), "ttft_p50_s": float(np.percentile(ttft, 50)),
            "ttft_p99_s": float(np.percentile(ttft, 99)),
            "hit_rate": sum(r.cached for r in finished) / prompt if prompt else 0.0,
            "output_tok_s": sum(r.generated for r in finished) / duration}


def sessions_of(args: argparse.Namespace, num: int) -> list[list[Turn]]:
    """ShareGPT conversations as token ids: turn i's prompt is every message before its
    answer (the reference answers resent, as a chat client resends the server's)."""
    tokenizer = tokenizer_for(args.model)
    convs = sharegpt_conversations(num, args.max_turns, args.seed, tokenizer,
                                   args.max_prompt_len, args.max_output_len)

    def ids(text: str) -> list[int]:
        if tokenizer is not None:
            return tokenizer.encode(text)
        return [hash(w) % 150_000 for w in text.split()]

    out = []
    for conv in convs:
        turns, history = [], []
        for turn in conv:
            for role, text in turn.messages[len(history):]:
                history.append(ids(f"<|{role}|>{text}"))
            turns.append(Turn([t for m in history for t in m], turn.output_len))
        out.append(turns)
    return out


def calibrate(model: str, path: Path) -> None:
    """Time the model's steps (single-request prompt chunks at several contexts and decode
    batches of several sizes) and write them as (tokens, attention, rows, seconds)."""
    from braid.llm import LLM
    from braid.sampling_params import SamplingParams

    llm = LLM(model, max_num_batched_tokens=512, max_num_seqs=64)
    stats = llm.engine.stats
    samples: list[list[float]] = []
    for batch, prompt_len in ((1, 2048), (4, 256), (16, 256), (32, 128), (64, 64)):
        prompts = [[(b * 977 + i * 13) % 30_000 + 100 for i in range(prompt_len)]
                   for b in range(batch)]
        steps = stats.num_steps
        llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
        new = min(stats.num_steps - steps, len(stats.recent))
        for s in list(stats.recent)[len(stats.recent) - new:]:
            tokens = s.num_prefill_tokens + s.num_decode_tokens
            if s.num_prefill_tokens == 0:
                attention = s.num_context_tokens + s.num_decode_tokens
            elif s.num_requests == 1:
                attention = attention_work(tokens, s.num_context_tokens)
            else:
                continue  # a mixed step: its attention work is not known from its stats
            samples.append([tokens, attention, s.num_decode_tokens or 1, s.step_time])
        print(f"calibration: {batch} x {prompt_len}-token prompts, {len(samples)} steps")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"model": model, "machine": machine_info(),
                                "steps": samples}, indent=1))


def fitted(path: Path) -> ForwardCost:
    if not path.is_file():
        raise SystemExit(f"no calibration at {path}: run with --calibrate first")
    cost = ForwardCost()
    for tokens, attention, rows, seconds in json.loads(path.read_text())["steps"]:
        cost.observe(tokens, attention, rows, seconds, anchor=True)
    return cost


def simulate(args: argparse.Namespace, cost: ForwardCost, sessions: list[list[Turn]],
             size: int, policy: str) -> dict[str, float]:
    config = RouterConfig(policy)
    router = make_router(config, size, BLOCK, args.kv_blocks)
    replicas = [Replica(cost, args.kv_blocks, args.max_num_batched_tokens, args.max_num_seqs)
                for _ in range(size)]
    sim = Simulation(sessions, router, replicas, args.session_rate * size, args.think_time,
                     args.seed)
    duration = sim.run()
    return summary(sim.finished, duration)


def table(results: dict[str, dict[str, float]]) -> str:
    lines = ["| replicas | router | requests | TTFT p50 / p99 (s) | prefix hit rate | "
             "output tok/s |", "|---|---|---|---|---|---|"]
    for key, r in results.items():
        size, policy = key.split("|")
        lines.append(f"| {size} | {policy} | {r['requests']} | {r['ttft_p50_s']:.2f} / "
                     f"{r['ttft_p99_s']:.2f} | {r['hit_rate']:.0%} | {r['output_tok_s']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calibrate", action="store_true",
                        help="measure the model's steps first and write --calibration")
    parser.add_argument("--calibration", type=Path, default=CALIBRATION,
                        help="the measured steps the cost model is fitted to")
    parser.add_argument("--model", default=DEFAULT_TARGET)
    parser.add_argument("--replicas", type=comma_list(positive_int), default=[8, 16, 64],
                        help="replica counts to simulate")
    parser.add_argument("--routers", default=",".join(ROUTER_POLICIES),
                        help="router policies to compare")
    parser.add_argument("--sessions-per-replica", type=positive_int, default=12)
    parser.add_argument("--session-rate", type=positive_float, default=0.02,
                        help="sessions starting per second and replica")
    parser.add_argument("--think-time", type=positive_float, default=10.0,
                        help="mean seconds between an answer and the next turn")
    parser.add_argument("--max-turns", type=positive_int, default=6)
    parser.add_argument("--max-prompt-len", type=positive_int, default=2048)
    parser.add_argument("--max-output-len", type=positive_int, default=256)
    parser.add_argument("--kv-blocks", type=positive_int, default=4096,
                        help="each replica's KV cache, in 16-token blocks")
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=256)
    parser.add_argument("--max-num-seqs", type=positive_int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    args = parser.parse_args()
    policies = comma_choices(parser, "--routers", args.routers, ROUTER_POLICIES)
    if args.calibrate:
        calibrate(args.model, args.calibration)
    cost = fitted(args.calibration)
    results: dict[str, dict[str, float]] = {}
    for size in args.replicas:
        sessions = sessions_of(args, args.sessions_per_replica * size)
        for policy in policies:
            results[f"{size}|{policy}"] = simulate(args, cost, sessions, size, policy)
            print(f"{size} replicas, {policy}: {results[f'{size}|{policy}']}", flush=True)
    print(table(results))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "simulate_replicas.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=1))


if __name__ == "__main__":
    main()
