"""Model-layer benchmark: step cost vs query tokens, decode speed vs the memory roofline, load
times and peak memory, for the default target on this machine.

    python benchmarks/bench_model.py [--model NAME] [--quantization auto|none] [--cold]
        [--vs-llamacpp BIN_DIR [--pairs 4]]
        [--kv-cache-dtypes float32,float16,bfloat16 [--kv-requests 16] [--kv-context 700]]
        [--perplexity [--ppl-context 1024] [--ppl-chunks 2]]

Prints a table; `--cold` also times a load into an empty cache folder (tokenizer conversion).
`--vs-llamacpp` (a llama.cpp build's bin folder, see the README's peers note) alternates
llama-bench tg64 on the same GGUF with braid's single-request decode, pair after pair, and
prints each pair's ratio: this machine's memory bandwidth drifts by 10-30% over minutes, so
only side-by-side pairs compare. `--kv-cache-dtypes` times a batched decode step (16 requests
of 700 distinct cached tokens by default) with each KV cache type in turn, over the same
loaded model, for `--rounds` rounds, and prints each step time and each type's ratio to the
first type's in the same round. `--perplexity` scores the held text (the source of
`textwrap`) as llama-perplexity does: chunks of `--ppl-context` tokens, each starting with
BOS, the second half of each scored; with `--vs-llamacpp` over llama.cpp's own tokens of the
text (llama-tokenize, so both score the same ids; whether braid's tokenizer gives the same
ids is printed too), beside llama-perplexity's figure on the same file.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from braid.bench.args import comma_choices
from braid.config import (
    DEFAULT_TARGET,
    DTYPES,
    QUANTIZATIONS,
    EngineConfig,
    positive_float,
    positive_int,
)
from braid.engine.engine import LLMEngine
from braid.sampling_params import SamplingParams


def measure_bandwidth(gib: float = 2.0, repeats: int = 5) -> float:
    """Streaming read bandwidth (bytes/s): the best of several sums over a large fp32 tensor,
    in a child process so its buffer does not count toward this process's peak memory."""
    code = (f"import time, torch; torch.set_num_threads({torch.get_num_threads()}); "
            f"x = torch.ones({int(gib * 2**30 / 4)}); best = float('inf')\n"
            f"for _ in range({repeats}):\n"
            "    t = time.perf_counter(); x.sum(); best = min(best, time.perf_counter() - t)\n"
            "print(x.numel() * 4 / best)")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True)
    return float(out.stdout.strip())


def time_load(model: str, quantization: str, cache_dir: str | None) -> float:
    """Seconds to load the model in a fresh process (optionally with another cache dir)."""
    env = dict(os.environ, **({"BRAID_CACHE_DIR": cache_dir} if cache_dir else {}))
    code = ("import time; t = time.perf_counter(); from braid.models.build import load_model; "
            f"load_model({model!r}, quantization={quantization!r}); "
            "print(time.perf_counter() - t)")
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                         capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def gguf_ratio(model: str, peak: int, kv_bytes: int) -> str:
    """', N.NNx GGUF + KV' for a GGUF model (the [M7] goal's measure: the file's bytes,
    embedding included, not the bytes a forward streams); '' for other models."""
    from braid.models.loader import resolve_model_path

    path = resolve_model_path(model)
    if not path.is_file():
        return ""
    return f", {peak / (path.stat().st_size + kv_bytes):.2f}x GGUF + KV"


def step_ms(engine: LLMEngine, num_query_tokens: int, repeats: int = 3) -> float:
    """Median ms of one forward whose flat batch holds `num_query_tokens` prefill tokens."""
    times = []
    for i in range(repeats):
        rid = f"q{num_query_tokens}-{i}"
        engine.add_request(rid, list(range(1000, 1000 + num_query_tokens)) + [5],
                           SamplingParams(max_tokens=1, temperature=0))
        engine.scheduler.max_num_batched_tokens = num_query_tokens
        start = time.perf_counter()
        engine.step()  # exactly num_query_tokens prompt tokens, no sampling
        times.append(time.perf_counter() - start)
        engine.abort(rid)
    return sorted(times)[len(times) // 2] * 1e3


def decode_rate(engine: LLMEngine, new_tokens: int = 64) -> tuple[float, float]:
    """Single-request greedy decode: (tokens/s, median ms per decode step)."""
    engine.scheduler.max_num_batched_tokens = engine.config.max_num_batched_tokens or 128
    engine.add_request("decode", list(range(2000, 2032)),
                       SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))
    engine.step()  # the prompt
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return len(times) / sum(times), sorted(times)[len(times) // 2] * 1e3


def run_llamacpp(bin_dir: str, tool: str, *args: str) -> subprocess.CompletedProcess[str]:
    """One of llama.cpp's tools from its build's bin folder (its libraries beside it)."""
    return subprocess.run([os.path.join(bin_dir, tool), *args], check=True, capture_output=True,
                          text=True, env=dict(os.environ, LD_LIBRARY_PATH=bin_dir))


def llama_bench_rate(bin_dir: str, gguf: str) -> float:
    """llama-bench's tg64 tokens/s on 2 threads."""
    out = run_llamacpp(bin_dir, "llama-bench", "-m", gguf, "-t", "2", "-p", "0", "-n", "64",
                       "-o", "json")
    return float(json.loads(out.stdout)[0]["avg_ts"])


def versus_llamacpp(engine: LLMEngine, bin_dir: str, pairs: int) -> None:
    """Alternate llama-bench tg64 and braid's decode on the same GGUF; print each pair."""
    from braid.models.loader import resolve_model_path

    path = resolve_model_path(engine.config.model)  # a default model's name or a file
    if not path.is_file():
        raise SystemExit(f"--vs-llamacpp needs a GGUF model, not the folder {path}")
    gguf = str(path)
    ratios = []
    for i in range(pairs):
        theirs = llama_bench_rate(bin_dir, gguf)
        ours, _ = decode_rate(engine)
        ratios.append(ours / theirs)
        print(f"pair {i + 1}: llama.cpp tg64 {theirs:6.2f} tok/s, braid {ours:6.2f} tok/s, "
              f"ratio {ratios[-1]:.2f}x", flush=True)
    print(f"braid / llama.cpp decode, median of {pairs} pairs: {statistics.median(ratios):.2f}x")


def held_text() -> str:
    import textwrap

    return inspect.getsource(textwrap)


def llamacpp_tokens(bin_dir: str, gguf: str, text_file: str, escape: bool) -> list[int]:
    """llama.cpp's tokens of the file, with backslash escapes such as \\n processed as
    llama-perplexity does by default, unless `escape` is False (llama-perplexity also drops
    the file's final newline; the chunks it scores end long before it)."""
    flags = [] if escape else ["--no-escape"]
    out = run_llamacpp(bin_dir, "llama-tokenize", "-m", gguf, "-f", text_file, "--ids",
                       "--log-disable", *flags)
    return json.loads(out.stdout.strip().splitlines()[-1])


def llamacpp_perplexity(bin_dir: str, gguf: str, text_file: str, context: int, chunks: int
                        ) -> float:
    out = run_llamacpp(bin_dir, "llama-perplexity", "-m", gguf, "-f", text_file, "-c",
                       str(context), "--chunks", str(chunks), "-t", "2", "-b", str(context))
    return float((out.stdout + out.stderr).split("Final estimate: PPL = ")[1].split()[0])


def braid_perplexity(engine: LLMEngine, ids: list[int], context: int, chunks: int) -> float:
    """llama-perplexity's estimate through the engine (prompt logprobs): chunk c is
    ids[c * context : (c + 1) * context] with BOS in place of its first token; the tokens
    after its first half are scored."""
    bos = engine.tokenizer.bos_token_id if engine.tokenizer is not None else None
    if len(ids) < context * chunks:
        raise SystemExit(f"the held text has {len(ids)} tokens, fewer than {chunks} chunks of "
                         f"{context}")
    nll, scored = 0.0, 0
    for c in range(chunks):
        chunk = ids[c * context:(c + 1) * context]
        if bos is not None:
            chunk[0] = bos
        engine.add_request(f"ppl{c}", chunk, SamplingParams(max_tokens=1, prompt_logprobs=0))
        [out] = [o for o in engine.run_until_done() if o.finished]
        assert out.prompt_logprobs is not None
        for j in range(context // 2 + 1, context):
            entry = out.prompt_logprobs[j]
            assert entry is not None
            nll -= entry[chunk[j]].logprob
            scored += 1
    return float(torch.tensor(nll / scored).exp())


def perplexity_report(engine: LLMEngine, bin_dir: str | None, context: int, chunks: int
                      ) -> None:
    from braid.models.loader import resolve_model_path

    assert engine.tokenizer is not None
    text = held_text()
    ours = engine.tokenizer.encode(text)
    print(f"held text (textwrap's source): {len(ours)} braid tokens; {context}-token chunks: "
          f"{chunks}, {chunks * (context // 2 - 1)} tokens scored", flush=True)
    if bin_dir is None:
        print(f"braid perplexity: {braid_perplexity(engine, ours, context, chunks):.4f}")
        return
    gguf = str(resolve_model_path(engine.config.model))
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write(text)
        f.flush()
        theirs = llamacpp_tokens(bin_dir, gguf, f.name, escape=False)
        scored = llamacpp_tokens(bin_dir, gguf, f.name, escape=True)  # llama-perplexity's
        reference = llamacpp_perplexity(bin_dir, gguf, f.name, context, chunks)
    same = sum(a == b for a, b in zip(ours, theirs, strict=False))
    print(f"braid's tokens equal llama.cpp's: {ours == theirs} ({len(ours)} and {len(theirs)} "
          f"tokens, {same} positions equal)")
    mine = braid_perplexity(engine, scored, context, chunks)
    print(f"perplexity on llama.cpp's tokens: braid {mine:.4f}, llama-perplexity "
          f"{reference:.4f}, ratio {mine / reference:.4f}")


def distinct_prompts(tokenizer, requests: int, tokens: int) -> list[list[int]]:
    """`requests` prompts of `tokens` tokens each, no two sharing a block: consecutive spans
    of standard-library sources (prefix caching cannot shorten them)."""
    text = "".join(inspect.getsource(importlib.import_module(name)) for name in (
        "argparse", "difflib", "email.message", "http.client", "json", "textwrap"))
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < requests * tokens:
        raise SystemExit(f"--kv-requests x --kv-context needs {requests * tokens} tokens of "
                         f"text; this benchmark has {len(ids)}")
    return [ids[i * tokens:(i + 1) * tokens] for i in range(requests)]


def kv_cache_steps(engine: LLMEngine, dtypes: list[str], requests: int, context: int,
                   rounds: int, steps: int = 24) -> None:
    """A decode step of `requests` requests with `context` cached tokens each, per KV cache
    type, rounds alternated over the same loaded model; prints ms per step and ratios."""
    model, tokenizer = engine.runner.model, engine.tokenizer
    prompts = distinct_prompts(tokenizer, requests, context)
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    for r in range(rounds):
        times: dict[str, float] = {}
        for dtype in dtypes:
            e = LLMEngine(EngineConfig(model=engine.config.model, kv_cache_dtype=dtype,
                                       max_model_len=context + steps + 16,
                                       kv_cache_gib=engine.config.kv_cache_gib,
                                       max_num_batched_tokens=512, log_stats_interval=0,
                                       enable_prefix_caching=False),
                          model=model, tokenizer=tokenizer)  # binds the model to its cache
            for i, p in enumerate(prompts):
                e.add_request(str(i), p, params)
            start = time.perf_counter()
            while e.scheduler.waiting or any(q.num_computed_tokens < context
                                             for q in e.scheduler.running):
                e.step()
            prefill = time.perf_counter() - start
            start = time.perf_counter()
            for _ in range(steps):
                e.step()
            times[dtype] = (time.perf_counter() - start) / steps * 1e3
            while e.has_unfinished_requests():
                e.step()
            print(f"round {r + 1}, KV cache {dtype:>8}: prefill {prefill:5.1f} s, decode step "
                  f"of {requests} x {context} tokens {times[dtype]:6.1f} ms "
                  f"({times[dtype] / times[dtypes[0]]:.3f}x {dtypes[0]})", flush=True)
    engine.runner.model.bind_kv_cache(engine.runner.kv_cache)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_TARGET)
    parser.add_argument("--quantization", default="auto", choices=QUANTIZATIONS)
    parser.add_argument("--cold", action="store_true", help="also time a GGUF conversion")
    parser.add_argument("--kv-cache-gib", type=positive_float, default=1.0)
    parser.add_argument("--vs-llamacpp", metavar="BIN_DIR",
                        help="a llama.cpp bin folder: alternate llama-bench and braid decode")
    parser.add_argument("--pairs", type=positive_int, default=4, help="with --vs-llamacpp")
    parser.add_argument("--kv-cache-dtypes", default=None,
                        help=f"compare batched decode steps over these KV cache types "
                        f"({', '.join(DTYPES)})")
    parser.add_argument("--kv-requests", type=positive_int, default=16)
    parser.add_argument("--kv-context", type=positive_int, default=700)
    parser.add_argument("--rounds", type=positive_int, default=2, help="with --kv-cache-dtypes")
    parser.add_argument("--perplexity", action="store_true",
                        help="perplexity of the held text (against llama.cpp's with "
                        "--vs-llamacpp)")
    parser.add_argument("--ppl-context", type=positive_int, default=1024)
    parser.add_argument("--ppl-chunks", type=positive_int, default=2)
    args = parser.parse_args()
    if args.kv_cache_dtypes is not None:
        args.kv_cache_dtypes = comma_choices(parser, "--kv-cache-dtypes", args.kv_cache_dtypes,
                                             DTYPES)

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    # Best of two: the first may read the GGUF from disk, not the page cache.
    cached_load = min(time_load(args.model, args.quantization, None) for _ in range(2))
    cold_load = None
    if args.cold:
        with tempfile.TemporaryDirectory() as tmp:
            cold_load = time_load(args.model, args.quantization, tmp)
    engine = LLMEngine(EngineConfig(model=args.model, quantization=args.quantization,
                                    kv_cache_gib=args.kv_cache_gib,
                                    max_num_batched_tokens=512, log_stats_interval=0,
                                    enable_prefix_caching=False))
    model = engine.runner.model
    weight_bytes = model.weight_bytes()
    kv_bytes = engine.runner.kv_cache.numel() * engine.runner.kv_cache.element_size()
    bandwidth = measure_bandwidth()
    roofline_ms = weight_bytes / bandwidth * 1e3
    for n in (1, 4, 16, 64, 256):
        step_ms(engine, n, repeats=1)  # warm-up
        print(f"step with {n:>3} query tokens: {step_ms(engine, n):8.1f} ms", flush=True)
    rate, decode_ms = decode_rate(engine)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"weights:                 {weight_bytes / 1e9:8.2f} GB")
    print(f"KV cache:                {kv_bytes / 1e9:8.2f} GB")
    print(f"memory bandwidth:        {bandwidth / 1e9:8.1f} GB/s")
    print(f"roofline step:           {roofline_ms:8.1f} ms")
    print(f"decode step (median):    {decode_ms:8.1f} ms  "
          f"({decode_ms / roofline_ms:.2f}x roofline)")
    print(f"single-request decode:   {rate:8.2f} tok/s")
    print(f"cached load:             {cached_load:8.1f} s")
    if cold_load is not None:
        print(f"cold load (new cache):   {cold_load:8.1f} s")
    print(f"peak RSS:                {peak / 1e9:8.2f} GB "
          f"({peak / (weight_bytes + kv_bytes):.2f}x weights + KV"
          f"{gguf_ratio(args.model, peak, kv_bytes)})")
    if args.vs_llamacpp:
        versus_llamacpp(engine, args.vs_llamacpp, args.pairs)
    if args.perplexity:
        perplexity_report(engine, args.vs_llamacpp, args.ppl_context, args.ppl_chunks)
    if args.kv_cache_dtypes:
        kv_cache_steps(engine, args.kv_cache_dtypes, args.kv_requests, args.kv_context,
                       args.rounds)


if __name__ == "__main__":
    main()
