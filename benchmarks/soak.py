"""Soak test of `braid serve`: open-loop load for N minutes with random client aborts, bad
requests, n > 1 and hostile requests (braid/bench/hostile.py) mixed in; then the checks a
long-running server must pass.

    python benchmarks/soak.py [--minutes 10] [--rate 0.1] [--model M]
                              [--speculative-config JSON] [--out F.json] [-- extra serve flags]

Load: Poisson arrivals of HumanEval prompts (greedy, ignore EOS, random output lengths);
a share of them stream and are dropped by the client after a few chunks, some ask n = 2,
some are bad (malformed JSON, unknown or invalid fields, a lone surrogate, a body over
--max-request-bytes, a prompt over --max-model-len). Checks, printed and saved as JSON:
- every good request's greedy output equals the same request run alone afterwards (and both
  choices of an n = 2 request equal it);
- every bad request got its 4xx, and the server never answered 5xx;
- after the load, running, waiting and KV usage return to 0;
- resident memory does not grow (the second half's peak against the first half's);
- the longest gap in a running stream while the server handles the largest allowed body,
  beyond the stream's usual gap between chunks (goal: under 100 ms);
- every hostile request got a 4xx or a completion, none a 5xx; one is sent every
  --hostile-every seconds after the first third of the run, in turn;
- an innocent stream runs all along: its tokens/s while a hostile request is in flight
  within 2x of its median pace while none is;
- /health, probed every 50 ms all along, answers under 100 ms at p99.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from braid.bench.datasets import humaneval
from braid.bench.hostile import HOSTILE, Hostile, Observer, encoded, paces, percentiles
from braid.bench.server_metrics import scrape
from braid.bench.server_process import ServerProcess, check_serve_flags, child_pids
from braid.config import positive_float

BODY_LIMIT = 4 * 2**20


@dataclass
class Report:
    minutes: float
    rate: float
    spec: str | None
    good: int = 0
    mismatched: list[str] = field(default_factory=list)
    aborted: int = 0
    bad: int = 0
    bad_wrong_status: list[str] = field(default_factory=list)
    server_errors: list[str] = field(default_factory=list)
    overloaded: int = 0
    idle_after: dict[str, float] = field(default_factory=dict)
    rss_mb: list[float] = field(default_factory=list)
    stall_ms: float = 0.0
    usual_gap_ms: float = 0.0
    added_stall_ms: float = 0.0  # stall_ms beyond the usual gap: what the large body cost
    hostile: dict[str, list[str]] = field(default_factory=dict)  # name -> "status in s"
    hostile_wrong: list[str] = field(default_factory=list)
    pace_calm: float = 0.0  # the innocent stream's median tokens/s, no hostile in flight
    pace_hostile: list[tuple[str, float]] = field(default_factory=list)  # (in flight, tok/s)
    worst_pace_ratio: float = 0.0  # pace_calm / the slowest pace beside a hostile request
    health_ms: dict[str, float] = field(default_factory=dict)  # p50, p99, max

    @property
    def ok(self) -> bool:
        idle = all(v == 0 for v in self.idle_after.values())
        half = len(self.rss_mb) // 2
        grew = half > 0 and max(self.rss_mb[half:]) > 1.1 * max(self.rss_mb[:half])
        return (not self.mismatched and not self.bad_wrong_status and not self.server_errors
                and idle and not grew and not self.hostile_wrong
                and self.worst_pace_ratio <= 2.0 and self.health_ms.get("p99", 0) < 100)


def vocab_size(model: str) -> int:
    from braid.models.loader import load_config, model_folder

    return load_config(model_folder(model)).vocab_size


def rss_mb(pid: int) -> float:
    """Resident memory of the server and its children (the engine's process among them)."""
    total = 0.0
    for proc in [pid, *child_pids(pid)]:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{proc}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
    return total


def bad_requests(model: str, max_model_len: int) -> list[tuple[str, bytes, int]]:
    """(name, raw body, expected status) of requests the server must refuse."""
    def body(**fields: object) -> bytes:
        return json.dumps({"model": model, "prompt": "hi", "max_tokens": 4, **fields}).encode()

    return [
        ("malformed json", b'{"prompt": "hi", "max_tokens": ', 400),
        ("unknown field", body(frobnicate=1), 400),
        ("negative temperature", body(temperature=-1), 400),
        ("lone surrogate", body(prompt="a\ud800"), 400),
        ("seed overflow", body(seed=2**64), 400),
        ("prompt over max_model_len", body(prompt="x " * max_model_len), 400),
        ("body over the limit", body(prompt="x" * (BODY_LIMIT + 10)), 413),
    ]


class Soak:
    def __init__(self, server: ServerProcess, args: argparse.Namespace) -> None:
        self.server = server
        self.args = args
        self.prompts = [p.prompt for p in humaneval(32)]
        self.outputs: dict[tuple[int, int], list[str]] = {}  # (prompt, max_tokens) -> texts
        self.report = Report(args.minutes, args.rate, args.speculative_config)
        self.rng = random.Random(0)
        self.hostile_spans: list[tuple[float, float, str]] = []  # (start, end, name)
        self.vocab = vocab_size(args.model)

    def body(self, i: int, max_tokens: int, **fields: object) -> dict:
        return {"model": self.server.model, "prompt": self.prompts[i], "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, **fields}

    async def good(self, client: httpx.AsyncClient, n: int) -> None:
        i, max_tokens = self.rng.randrange(len(self.prompts)), self.rng.choice([16, 32, 64])
        r = await client.post("/v1/completions", json=self.body(i, max_tokens, n=n))
        if r.status_code == 503:
            self.report.overloaded += 1
            return
        if r.status_code != 200:
            self.report.server_errors.append(f"good request: {r.status_code} {r.text[:200]}")
            return
        self.report.good += 1
        texts = [c["text"] for c in r.json()["choices"]]
        self.outputs.setdefault((i, max_tokens), []).extend(texts)

    async def dropped(self, client: httpx.AsyncClient) -> None:
        """A stream the client closes after a few chunks."""
        i = self.rng.randrange(len(self.prompts))
        async with client.stream("POST", "/v1/completions",
                                 json=self.body(i, 64, stream=True)) as r:
            if r.status_code >= 500 and r.status_code != 503:
                self.report.server_errors.append(f"stream: {r.status_code}")
            count = 0
            async for line in r.aiter_lines():
                count += line.startswith("data:")
                if count >= 3:
                    break
        self.report.aborted += 1

    async def bad(self, client: httpx.AsyncClient) -> None:
        name, raw, status = self.rng.choice(bad_requests(self.server.model, 32768))
        r = await client.post("/v1/completions", content=raw,
                              headers={"content-type": "application/json"})
        self.report.bad += 1
        if r.status_code != status:
            self.report.bad_wrong_status.append(f"{name}: {r.status_code} {r.text[:200]}")

    async def one(self, client: httpx.AsyncClient) -> None:
        kind = self.rng.choices(["good", "n2", "dropped", "bad"], [0.55, 0.15, 0.15, 0.15])[0]
        try:
            if kind == "dropped":
                await self.dropped(client)
            elif kind == "bad":
                await self.bad(client)
            else:
                await self.good(client, 2 if kind == "n2" else 1)
        except httpx.HTTPError as e:
            self.report.server_errors.append(f"{kind}: {type(e).__name__}: {e}")

    async def hostile_loop(self, deadline: float) -> None:
        """One hostile request every --hostile-every seconds, in turn, from a third of the
        run on (the innocent stream's calm pace is measured before)."""
        await asyncio.sleep(self.args.minutes * 20)
        tasks = []
        async with httpx.AsyncClient(base_url=self.server.url, timeout=900) as client:
            for i in itertools.count():
                if time.monotonic() >= deadline:
                    break
                tasks.append(asyncio.create_task(self.send_hostile(
                    client, HOSTILE[i % len(HOSTILE)])))
                await asyncio.sleep(self.args.hostile_every)
            await asyncio.gather(*tasks)

    async def send_hostile(self, client: httpx.AsyncClient, hostile: Hostile) -> None:
        raw = await asyncio.to_thread(encoded, hostile, self.server.model, self.vocab)
        start = time.monotonic()
        try:
            r = await client.post(hostile.path, content=raw,
                                  headers={"content-type": "application/json"})
            status = str(r.status_code)
            if r.status_code not in hostile.statuses:
                self.report.hostile_wrong.append(f"{hostile.name}: {status} {r.text[:200]}")
        except httpx.HTTPError as e:
            status = type(e).__name__
            self.report.hostile_wrong.append(f"{hostile.name}: {status}: {e}")
        self.hostile_spans.append((start, time.monotonic(), hostile.name))
        self.report.hostile.setdefault(hostile.name, []).append(
            f"{status} in {time.monotonic() - start:.2f} s")

    def judge_paces(self, streams: list[tuple[float, float, float]]) -> None:
        """Each innocent stream beside the hostile requests in flight during it against the
        median pace of those beside none."""
        self.report.pace_calm, beside = paces(streams, self.hostile_spans)
        self.report.pace_hostile = [(names, round(pace, 1)) for names, pace in beside]
        slowest = min((p for _, p in beside), default=0.0)
        self.report.worst_pace_ratio = round(self.report.pace_calm / slowest, 2) \
            if slowest else 0.0
        self.report.pace_calm = round(self.report.pace_calm, 1)

    async def load(self) -> None:
        deadline = time.monotonic() + self.args.minutes * 60
        tasks: set[asyncio.Task] = set()
        watcher = Observer(self.server.url, self.body(1, 48, stream=True))
        side = [asyncio.create_task(self.hostile_loop(deadline))]
        next_sample, started = time.monotonic(), time.monotonic()
        async with httpx.AsyncClient(base_url=self.server.url, timeout=600) as client:
            while time.monotonic() < deadline:
                task = asyncio.create_task(self.one(client))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                await asyncio.sleep(self.rng.expovariate(self.args.rate))
                if time.monotonic() >= next_sample:
                    self.report.rss_mb.append(round(rss_mb(self.server.proc.pid), 1))
                    next_sample += 10
                    done = (time.monotonic() - started) / 60
                    print(f"  {done:.1f} / {self.args.minutes} min: {self.report.good} good, "
                          f"{self.report.aborted} dropped, {self.report.bad} bad, "
                          f"{sum(map(len, self.report.hostile.values()))} hostile, "
                          f"{len(tasks)} in flight, RSS {self.report.rss_mb[-1]:.0f} MB",
                          flush=True)
            await asyncio.gather(*tasks, *side)
        self.report.rss_mb.append(round(rss_mb(self.server.proc.pid), 1))
        health, streams = await asyncio.to_thread(watcher.stop)
        self.report.health_ms = percentiles(health)
        self.judge_paces(streams)

    def check_outputs(self) -> None:
        """Each (prompt, length) run alone now; every output under load must equal it."""
        with httpx.Client(base_url=self.server.url, timeout=600) as client:
            for (i, max_tokens), texts in sorted(self.outputs.items()):
                alone = client.post("/v1/completions", json=self.body(i, max_tokens)).json()
                want = alone["choices"][0]["text"]
                if any(t != want for t in texts):
                    self.report.mismatched.append(f"prompt {i}, {max_tokens} tokens")

    def check_idle(self) -> None:
        time.sleep(2)
        metrics = scrape(self.server.url) or {}
        names = ("braid:num_requests_running", "braid:num_requests_waiting",
                 "braid:kv_cache_usage_perc")
        self.report.idle_after = {k: metrics.get(k, -1.0) for k in names}

    async def stall(self) -> None:
        """The longest gap between chunks of a running stream while the server takes in and
        refuses the largest body it accepts (a prompt of BODY_LIMIT bytes, too long)."""
        gaps: list[float] = []
        async with httpx.AsyncClient(base_url=self.server.url, timeout=600) as client:
            async def stream() -> None:
                async with client.stream("POST", "/v1/completions", json=self.body(
                        0, 256, stream=True)) as r:
                    last = time.perf_counter()
                    async for line in r.aiter_lines():
                        if line.startswith("data:"):
                            now = time.perf_counter()
                            gaps.append(now - last)
                            last = now

            # Encoded beforehand and sent from another thread: this loop only reads the stream.
            text = ("x" * 1000 + " ") * ((BODY_LIMIT - 1000) // 1001)
            raw = json.dumps({"model": self.server.model, "prompt": text, "max_tokens": 1})
            task = asyncio.create_task(stream())
            while len(gaps) < 20 and not task.done():
                await asyncio.sleep(0.05)
            if len(gaps) < 20:
                self.report.server_errors.append("the stall check's stream gave fewer than 20 "
                                                 "chunks (a prompt too long for the model?)")
                return
            usual = statistics.median(gaps)
            mark = len(gaps)
            status = await asyncio.to_thread(lambda: httpx.post(
                f"{self.server.url}/v1/completions", content=raw.encode(), timeout=600,
                headers={"content-type": "application/json"}).status_code)
            if status != 400:
                self.report.server_errors.append(f"largest body: {status}")
            await asyncio.sleep(0.5)
            self.report.stall_ms = round(max(gaps[mark - 1:]) * 1e3, 1)
            self.report.usual_gap_ms = round(usual * 1e3, 1)
            self.report.added_stall_ms = round(max(0.0, max(gaps[mark - 1:]) - usual) * 1e3, 1)
            await task


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=positive_float, default=10.0)
    ap.add_argument("--rate", type=positive_float, default=0.1,
                    help="requests per second (Poisson); 0.5 overloads the default model on 2 "
                    "cores")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--speculative-config", default=None)
    ap.add_argument("--hostile-every", type=positive_float, default=15.0,
                    help="seconds between hostile requests (after the first third)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("serve_flags", nargs="*", help="more `braid serve` flags (after --)")
    args = ap.parse_args()
    flags = [*args.serve_flags, "--max-request-bytes", str(BODY_LIMIT)]
    if args.speculative_config:
        flags += ["--speculative-config", args.speculative_config]
    try:  # before the server starts: it would exit, and the soak report only that
        check_serve_flags(["--model", args.model, *flags], "serve flags")
    except ValueError as e:
        ap.error(str(e))
    log_dir = Path("/tmp") / "braid-soak"
    log_dir.mkdir(exist_ok=True)
    print(f"starting braid serve --model {args.model} {' '.join(flags)}", flush=True)
    server = ServerProcess(args.model, log_dir, *flags, timeout_s=600)
    soak = Soak(server, args)
    try:
        asyncio.run(soak.load())
        print("load done; running each request alone to compare", flush=True)
        soak.check_idle()
        soak.check_outputs()
        asyncio.run(soak.stall())
    finally:
        code = server.stop()
    report = soak.report
    summary = {**asdict(report), "ok": report.ok, "exit_code": code}
    print(json.dumps(summary, indent=1))
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1))
    return 0 if report.ok and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
