"""The sampling work of one engine step, without a model: random logits over the default
target's 151,936-token vocabulary through the step's sampler (`rows_metadata` then `verify`,
as `StepSampler` runs them), for a batch of ordinary requests alone and beside one request
that asks for a lot (a long logit_bias, many bad words, n=64 with a repetition penalty); and
the output processor's cost per token (stop checks, the streaming hold-back, logprobs' text)
with and without 10k stop strings, and its cost to add such a request.

    python benchmarks/bench_sampling.py [--k 0,3] [--repeats 7] [--out FILE.json]

Prints markdown tables (the best of the repeats, after a warm-up: the machine is shared, so
the least disturbed run is the one to compare) and saves them as JSON with the machine and
versions. Seeded: the same logits and lists every run.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from braid.bench.sweep_report import machine_info
from braid.config import comma_list, positive_int
from braid.core.request import Request
from braid.engine.output import OutputProcessor
from braid.outputs import Logprob
from braid.sampling_params import SamplingParams
from braid.tokenizer import Tokenizer
from braid.worker.step import rows_metadata
from braid.worker.verify import verify

VOCAB = 151_936
EOS = frozenset({151_643, 151_645})
PROMPT_LEN, OUTPUT_LEN = 512, 256
OUTPUT_TOKENS = 256  # tokens the output processor appends per measurement


def ordinary(n: int = 8) -> list[SamplingParams]:
    """Half greedy, half seeded random with top-p: a plain batch."""
    return [SamplingParams(temperature=0) if i % 2 else
            SamplingParams(temperature=0.8, top_p=0.95, seed=i) for i in range(n)]


def heavy_requests(rng: random.Random) -> dict[str, list[SamplingParams]]:
    """Case -> the requests it adds to the ordinary batch."""
    bias = {t: rng.uniform(-5, 5) for t in rng.sample(range(VOCAB), 150_000)}
    bad = [[rng.randrange(VOCAB) for _ in range(rng.randint(1, 3))] for _ in range(100_000)]
    return {
        "baseline (8 requests)": [],
        "+ logit_bias, 150k entries": [SamplingParams(temperature=0.7, logit_bias=bias)],
        "+ bad words, 100k": [SamplingParams(temperature=0.7, bad_words_token_ids=bad)],
        "+ n=64, repetition_penalty 1.1": [
            SamplingParams(temperature=0.5, repetition_penalty=1.1, seed=j) for j in range(64)],
    }


def requests_of(params: list[SamplingParams], rng: random.Random) -> list[Request]:
    out = []
    for i, p in enumerate(params):
        req = Request(str(i), [rng.randrange(VOCAB) for _ in range(PROMPT_LEN)], p, seed=i)
        req.output_token_ids = [rng.randrange(VOCAB) for _ in range(OUTPUT_LEN)]
        out.append(req)
    return out


def best_ms(work: Callable[[], object], repeats: int) -> float:
    work()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def sampling_step(requests: list[Request], k: int, seed: int) -> Callable[[], object]:
    """One step's sampling: every request a window of k drafts (k = 0: a plain decode)."""
    gen = torch.Generator().manual_seed(seed)
    drafts = [torch.randint(0, VOCAB, (k,), generator=gen).tolist() for _ in requests]
    logits = torch.randn(len(requests) * (k + 1), VOCAB, generator=gen) * 3
    rows = [(r, d[:j]) for r, d in zip(requests, drafts, strict=True) for j in range(k + 1)]

    def step() -> object:
        meta = rows_metadata(rows, VOCAB, torch.device("cpu"), EOS)
        return verify(logits, drafts, meta)
    return step


def byte_tokenizer() -> Tokenizer:
    """Byte-level BPE without merges: one token per byte (the output processor's work per
    token does not depend on the vocabulary)."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    from braid.models.gguf_tokenizer import bytes_to_unicode

    backend = Backend(models.BPE(vocab={ch: b for b, ch in bytes_to_unicode().items()},
                                 merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<|endoftext|>"])
    return Tokenizer(backend, {"eos_token": "<|endoftext|>"})


def output_cases(rng: random.Random) -> dict[str, SamplingParams]:
    """Stop strings in capitals never match the lowercase output, so every token is checked
    against all of them."""
    letters = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    stops = ["".join(rng.choices(letters, k=rng.randint(3, 10))) for _ in range(10_000)]
    return {"plain": SamplingParams(max_tokens=None),
            "10k stop strings": SamplingParams(max_tokens=None, stop=stops),
            "logprobs=20": SamplingParams(max_tokens=None, logprobs=20)}


def output_costs(params: SamplingParams, tokenizer: Tokenizer, rng: random.Random,
                 repeats: int) -> tuple[float, float]:
    """(ms to add the request, ms per token): OUTPUT_TOKENS tokens appended one by one to a
    fresh request, as a step appends them: the stop check, the logprobs' text where asked
    for, and a streamed output after each. Medians over the repeats, after a warm-up."""
    text = " ".join("".join(rng.choices("abcdefghijklmnopqrstuvwxyz", k=rng.randint(2, 8)))
                    for _ in range(OUTPUT_TOKENS))
    tokens = tokenizer.encode(text, add_special_tokens=False)[:OUTPUT_TOKENS]
    top = rng.sample(range(256), 20)  # the byte tokenizer's ids
    admission, per_token = [], []
    for _ in range(repeats + 1):
        processor = OutputProcessor(tokenizer, frozenset({256}), 1 << 20)
        req = Request("r", tokenizer.encode("hello", add_special_tokens=False), params)
        start = time.perf_counter()
        processor.add(req)
        added = time.perf_counter()
        for t in tokens:
            req.output_token_ids.append(t)
            if processor.check_stop(req, t) is not None:
                raise AssertionError("a stop string matched: the case measures none")
            if params.logprobs:
                entry = {t: Logprob(-1.0, 1)} | {u: Logprob(-2.0, j + 1)
                                                 for j, u in enumerate(top)}
                processor.add_logprobs(req, [entry])
            processor.make_output(req)
        admission.append(added - start)
        per_token.append((time.perf_counter() - added) / len(tokens))
    return min(admission[1:]) * 1e3, min(per_token[1:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=comma_list(int), default=[0, 3],
                        help="drafts per request (0: plain decodes), comma-separated")
    parser.add_argument("--repeats", type=positive_int, default=7)
    parser.add_argument("--out", default="docs/benchmarks/sampling.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    info = machine_info()
    print(f"{info['cpu']}, {info['cpus_available']} cpus, {torch.get_num_threads()} torch "
          f"threads, python {info['python']}, torch {info['versions']['torch']}, "
          f"commit {info['git_commit']}{' (dirty)' if info['git_dirty'] else ''}", flush=True)
    rng = random.Random(0)
    results: dict[str, Any] = {"machine": info, "vocab": VOCAB, "sampling": [], "output": []}
    print(f"\nsampling per step, ms (vocabulary {VOCAB:,}; prompts {PROMPT_LEN}, outputs "
          f"{OUTPUT_LEN} tokens)\n")
    print("| case | rows (k=0) | " + " | ".join(f"k={k}" for k in args.k) + " |")
    print("|---|---|" + "---|" * len(args.k))
    for case, extra in heavy_requests(rng).items():
        requests = requests_of(ordinary() + extra, rng)
        ms = [best_ms(sampling_step(requests, k, seed=1), args.repeats) for k in args.k]
        results["sampling"].append({"case": case, "requests": len(requests),
                                    "ms": dict(zip(args.k, ms, strict=True))})
        print(f"| {case} | {len(requests)} | " + " | ".join(f"{m:.1f}" for m in ms) + " |",
              flush=True)
    tokenizer = byte_tokenizer()
    print(f"\noutput processor, one request of {OUTPUT_TOKENS} tokens\n")
    print("| case | ms to add it | ms per token |")
    print("|---|---|---|")
    for case, params in output_cases(rng).items():
        added, per_token = output_costs(params, tokenizer, rng, args.repeats)
        results["output"].append({"case": case, "add_ms": added, "ms_per_token": per_token})
        print(f"| {case} | {added:.2f} | {per_token:.3f} |", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
