"""Speculative decoding benchmark on the default pair: tokens/s per mode and load.

    python benchmarks/bench_spec.py --workload humaneval --num-prompts 16 --max-tokens 128 \
        --concurrency 1 --modes none,ngram4,draft1,draft2,draft3,draft4,draft5,goodput
    python benchmarks/bench_spec.py --temperature 0.7 \
        --modes none,draft3/greedy,draft3/coupled,draft3/rejection,goodput/coupled
    python benchmarks/bench_spec.py --workload agentic --num-prompts 12 --concurrency 1,8 \
        --modes none,suffix8,goodput_suffix,goodput

The agentic workload (braid/bench/agentic.py) runs multi-turn tool-calling sessions: a
"prompt" there is a session, whose turns follow each other as the model's tool calls are
answered.

A draft model's mode may end in `:N`, the draft's vocabulary limit (`draft_vocab_size`,
e.g. `goodput:32768`). A mode's suffix sets how a draft model's drafts are sampled and
verified (requests with temperature > 0): /greedy (its argmax, coupled verification),
/coupled (drawn with the target's numbers, coupled verification; the default), /rejection
(drawn with numbers of its own, standard rejection sampling with its probabilities).

Closed loop: `concurrency` requests in flight until all prompts are done (greedy); each load
level runs max(--num-prompts, --prompts-per-slot * concurrency) prompts, so high levels
measure a steady state, not one batch that starts and ends together. Prints a
table (throughput, speedup over no speculation, acceptance) and saves JSON and a plot of
throughput vs concurrency in --out. With --repeats the modes alternate order run by run and
the ratio to no speculation is the median of each repeat's own ratio; --warm-engines keeps
one engine per mode over the repeats (what a running server has learned) instead of a fresh
one per run (which pays the policy's exploration every time). --ceiling prints instead what
draft-model speculation could gain at concurrency 1 at best, from forwards timed now (see
`ceiling`). --replay records how many drafts in a row the target accepts at each output
position, then plays fixed ks and the acceptance estimate's weightings back on that record
(braid/bench/acceptance.py): the policy's choices compared without the machine's noise.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from braid.bench import agentic
from braid.bench.acceptance import Costs, lookup_record, play_rules, record_runs
from braid.bench.datasets import (
    EXTRACTION_SCHEMA,
    BenchPrompt,
    edit_prompts,
    extraction_prompts,
    humaneval,
    sharegpt,
)
from braid.config import (
    DEFAULT_DRAFT,
    DEFAULT_TARGET,
    DTYPES,
    QUANTIZATIONS,
    ConfigError,
    EngineConfig,
    SpecConfig,
    comma_list,
    positive_int,
)
from braid.core.stats import SpecStats
from braid.engine.engine import LLMEngine
from braid.models.build import load_model
from braid.sampling_params import SamplingParams, StructuredOutputsParams
from braid.spec_decode.build import resolve_draft_dtype
from braid.spec_decode.ngram import NgramMatcher
from braid.spec_decode.policy import age_floor, expected_tokens
from braid.spec_decode.speculator import PRIOR_ALPHA, Speculator
from braid.worker.runner import QuerySpan

REPLAY_LONGEST = 5  # --replay: the most drafts a window takes (goodput's k <= 5)
SAMPLING_MODES = {
    "greedy": {"draft_sampling": "greedy", "verification": "coupled"},
    "coupled": {"draft_sampling": "coupled", "verification": "coupled"},
    "rejection": {"draft_sampling": "independent", "verification": "rejection"},
}


def spec_config(mode: str) -> dict[str, Any] | None:
    """A mode's speculative config (None: no speculation); a ValueError naming what is wrong
    for a mode this benchmark does not know."""
    name, _, vocab = mode.partition(":")
    name, _, sampling = name.partition("/")
    config = _method_config(name)
    if vocab:  # draft3:32768: the draft scores only the first 32768 token ids
        if config is None or config["method"] != "draft_model" or not vocab.isdigit():
            raise ValueError(f"{mode}: only a draft model's mode takes a vocabulary limit, "
                             "a positive integer")
        config["draft_vocab_size"] = int(vocab)
    if sampling:
        if config is None or config["method"] != "draft_model" or sampling not in SAMPLING_MODES:
            raise ValueError(f"{mode}: a draft model's mode takes "
                             f"/{', /'.join(SAMPLING_MODES)}")
        config.update(SAMPLING_MODES[sampling])
    if config is not None:
        try:
            SpecConfig.from_dict(dict(config))
        except ConfigError as e:
            raise ValueError(f"{mode}: {e}") from None
    return config


def _method_config(mode: str) -> dict[str, Any] | None:
    if mode == "none":
        return None
    for prefix, method in (("ngram", "ngram"), ("draft", "draft_model"), ("suffix", "suffix")):
        if mode.startswith(prefix) and mode[len(prefix):].isdigit():
            return {"method": method, "num_speculative_tokens": int(mode[len(prefix):]),
                    "policy": "fixed"}
    goodput = {"goodput": ("draft_model", 5), "goodput_ngram": ("ngram", 5),
               "goodput_suffix": ("suffix", 8)}
    if mode.replace("-", "_") in goodput:
        method, k = goodput[mode.replace("-", "_")]
        return {"method": method, "num_speculative_tokens": k, "policy": "goodput"}
    raise ValueError(f"unknown mode {mode!r} (known: none, ngramK, draftK, suffixK, goodput, "
                     "goodput_ngram, goodput_suffix)")


def prompts_for(workload: str, num: int, tokenizer: Any, max_prompt_len: int = 1024
                ) -> list[list[int]]:
    """The workload's prompts (agentic: each session's first one)."""
    items: list[BenchPrompt]
    if workload == "agentic":
        return [session_prompt(s, tokenizer) for s in agentic.sessions(num)]
    if workload == "humaneval":
        items = humaneval(num)
        return [tokenizer.encode(p.prompt, add_special_tokens=False) for p in items]
    items = (edit_prompts(num) if workload == "edit" else extraction_prompts(num)
             if workload == "extraction"
             else sharegpt(num, tokenizer=tokenizer, max_prompt_len=max_prompt_len))
    return [tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": r, "content": c} for r, c in p.messages]), add_special_tokens=False)
        for p in items]


def predictions_for(workload: str, num: int, tokenizer: Any) -> list[list[int]]:
    """Edit: each request's predicted output (OpenAI's `prediction`), the code it was given
    back in a block, as a client sending the file it asked to have edited would."""
    if workload != "edit":
        raise ValueError("--predict: only the edit workload has predicted outputs")
    return [tokenizer.encode("```python\n" + p.prompt + "```", add_special_tokens=False)
            for p in humaneval(num)]


def workload_schema(workload: str) -> dict[str, Any] | None:
    """The JSON schema the workload's answers are constrained to, if any."""
    return EXTRACTION_SCHEMA if workload == "extraction" else None


def session_prompt(session: agentic.Session, tokenizer: Any) -> list[int]:
    text = tokenizer.apply_chat_template(session.template_messages(), tools=agentic.TOOLS)
    return tokenizer.encode(text, add_special_tokens=False)


def run_sessions(engine: LLMEngine, sessions: list[agentic.Session], concurrency: int,
                 max_tokens: int, temperature: float = 0.0) -> dict[str, Any]:
    """Closed loop over agentic sessions: `concurrency` sessions in flight, each one's next
    turn added as soon as its reply (and its tool results) are in."""
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens)
    pending, active, generated = list(enumerate(sessions)), {}, 0

    def submit(i: int, s: agentic.Session) -> None:
        rid = f"{i}-{len(s.replies)}"
        engine.add_request(rid, session_prompt(s, engine.tokenizer), params)
        active[rid] = (i, s)

    start = time.perf_counter()
    with tqdm(total=len(sessions), desc=f"  c={concurrency}", leave=False) as bar:
        while pending or active:
            while pending and len(active) < concurrency:
                submit(*pending.pop(0))
            for out in engine.step():
                if out.finished:
                    i, s = active.pop(out.request_id)
                    generated += len(out.outputs[0].token_ids)
                    if s.add_reply(out.outputs[0].text):
                        submit(i, s)
                    else:
                        bar.update(1)
    seconds = time.perf_counter() - start
    return {"tokens": generated, "seconds": seconds, "tok_per_s": generated / seconds,
            "turns": sum(len(s.replies) for s in sessions),
            "tool_calls": sum(s.num_calls for s in sessions),
            **engine.stats.spec_stats.as_dict(), **_figures(engine)}


def _figures(engine: LLMEngine) -> dict[str, Any]:
    figures = engine.speculation_figures()
    if figures is None or not figures.chosen_k:
        return {}
    windows = (dict(engine.speculator.windows_by_source)
               if isinstance(engine.speculator, Speculator) else {})
    return {"chosen_k": dict(sorted(figures.chosen_k.items())),
            "cost_model_error": round(figures.cost_model_error, 3),
            "windows_by_source": windows}


def run_mode(engine: LLMEngine, prompts: list[list[int]], concurrency: int,
             max_tokens: int, temperature: float = 0.0,
             predictions: list[list[int]] | None = None,
             schema: dict[str, Any] | None = None) -> dict[str, Any]:
    """Closed loop over `prompts`; `predictions`: each one's predicted output (token ids);
    `schema`: the JSON schema every answer is constrained to."""
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens,
                            structured_outputs=None if schema is None
                            else StructuredOutputsParams(json=schema))
    pending, in_flight, generated = list(enumerate(prompts)), 0, 0
    start = time.perf_counter()
    with tqdm(total=len(prompts), desc=f"  c={concurrency}", leave=False) as bar:
        while pending or engine.has_unfinished_requests():
            while pending and in_flight < concurrency:
                i, p = pending.pop(0)
                engine.add_request(str(i), p, params if predictions is None else replace(
                    params, prediction_token_ids=predictions[i]))
                in_flight += 1
            for out in engine.step():
                if out.finished:
                    in_flight -= 1
                    generated += len(out.outputs[0].token_ids)
                    bar.update(1)
    seconds = time.perf_counter() - start
    spec = engine.stats.spec_stats
    return {"tokens": generated, "seconds": seconds, "tok_per_s": generated / seconds,
            **spec.as_dict(), **_figures(engine)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload",
                        choices=["humaneval", "edit", "sharegpt", "agentic", "extraction"],
                        default="humaneval")
    parser.add_argument("--num-prompts", type=positive_int, default=16,
                        help="at least this many")
    parser.add_argument("--prompts-per-slot", type=int, default=0,
                        help="at least this many prompts per concurrent request")
    parser.add_argument("--max-tokens", type=positive_int, default=128)
    parser.add_argument("--max-prompt-len", type=positive_int, default=1024,
                        help="ShareGPT: skip longer prompts (tokens)")
    parser.add_argument("--concurrency", type=comma_list(positive_int), default=[1],
                        help="comma-separated list")
    parser.add_argument("--modes", default="none,ngram4,draft1,draft3,draft5,goodput")
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=128)
    parser.add_argument("--draft-dtype", default="auto", choices=DTYPES,
                        help="as speculative_config's draft_dtype")
    parser.add_argument("--temperature", type=comma_list(float), default=[0.0],
                        help="comma-separated: every request's temperature, one table each "
                        "(requests are unseeded: the engine seeds them)")
    parser.add_argument("--quantization", default="auto", choices=QUANTIZATIONS,
                        help="the target's --quantization")
    parser.add_argument("--draft-quantization", default=None, choices=QUANTIZATIONS,
                        help="the draft's --quantization (default: the target's)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=DTYPES,
                        help="both models' --kv-cache-dtype")
    parser.add_argument("--repeats", type=positive_int, default=1,
                        help="runs of every mode per load, in alternating order (mean tok/s; "
                        "the ratio to none is the median of the repeats' own ratios)")
    parser.add_argument("--warm-engines", action="store_true",
                        help="one engine per mode and load, kept for all its repeats (what a "
                        "running server has learned), instead of a fresh engine per run")
    parser.add_argument("--predict", action="store_true",
                        help="edit workload: every request sends the code it was given as its "
                        "predicted output (OpenAI's `prediction`)")
    parser.add_argument("--ceiling", action="store_true",
                        help="print the most draft-model speculation could gain at "
                        "concurrency 1 on these prompts (see `ceiling`) and exit")
    parser.add_argument("--replay", action="store_true",
                        help="record how many draft-model and prompt-lookup drafts in a row "
                        "the target accepts at each output position (greedy), then play fixed "
                        "ks and the acceptance estimate's prior weights back on it at "
                        "concurrency 1, priced by forwards timed now (see "
                        "braid/bench/acceptance.py), and exit")
    parser.add_argument("--replay-costs", type=costs_arg, default=None,
                        help="--replay's prices instead of timed ones, in target decodes: "
                        "'draft=D,W2,W3,...' (a draft forward, windows of 2, 3, ... tokens; "
                        "give at least 5 windows)")
    parser.add_argument("--replay-runs", default=None, metavar="JSON",
                        help="--replay on the record an earlier --replay saved (its JSON) "
                        "instead of recording: no model is loaded; needs --replay-costs")
    parser.add_argument("--out", default="docs/benchmarks")
    parser.add_argument("--stem", default=None, help="file name of the JSON and plot "
                        "(default spec_WORKLOAD)")
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if not modes:
        parser.error("--modes: name at least one mode")
    try:
        for mode in modes:
            spec_config(mode)
    except ValueError as e:
        parser.error(f"--modes: {e}")
    if args.replay and args.workload == "extraction":
        parser.error("--replay: the record is of unconstrained output; the extraction "
                     "workload's answers follow a schema")
    if args.replay and args.workload == "agentic":
        parser.error("--replay: the agentic workload's turns depend on the replies; use "
                     "humaneval, sharegpt or edit")
    if args.replay_runs is not None and args.replay_costs is None:
        parser.error("--replay-runs: give --replay-costs too (there is no model to time)")
    if args.replay_costs is not None and len(args.replay_costs.windows) < 6:
        parser.error("--replay-costs: give the costs of windows of 2 to 6 tokens at least")
    if args.predict and args.workload != "edit":
        parser.error("--predict: only the edit workload has predicted outputs")
    if args.prompts_per_slot < 0:
        parser.error(f"--prompts-per-slot: must be >= 0, got {args.prompts_per_slot}")
    if not all(0 <= t < float("inf") for t in args.temperature):
        parser.error(f"--temperature: must be >= 0, got {args.temperature}")

    if args.replay_runs is not None:  # play back a record: no model
        runs = json.loads(Path(args.replay_runs).read_text())["runs"]
        replay_to_json(replay_study(runs, None, [], args), args)
        return
    torch.manual_seed(0)
    target = load_model(DEFAULT_TARGET, quantization=args.quantization)
    draft_dtype = resolve_draft_dtype(args.draft_dtype, torch.float32)
    uses_draft = args.ceiling or args.replay or any(
        (spec_config(m) or {}).get("method") == "draft_model" for m in modes)
    draft = (load_model(DEFAULT_DRAFT, draft_dtype,
                        quantization=args.draft_quantization or args.quantization)[0]
             if uses_draft else None)
    levels = args.concurrency
    counts = {c: max(args.num_prompts, args.prompts_per_slot * c) for c in levels}
    prompts = prompts_for(args.workload, max(counts.values()), target[1], args.max_prompt_len)
    args.predictions = (predictions_for(args.workload, max(counts.values()), target[1])
                        if args.predict else None)
    print(f"{platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads;"
          f" draft in {str(draft_dtype).removeprefix('torch.')};"
          f" {args.workload}: {counts} prompts per concurrency, {args.max_tokens} new tokens,"
          f" temperature {','.join(map(str, args.temperature))}, quantization "
          f"{args.quantization} (draft {args.draft_quantization or args.quantization}), KV "
          f"cache {args.kv_cache_dtype}")
    if args.ceiling:
        ceiling(make_engine("goodput", target, draft, 1, args, prompts[0]),
                prompts[:counts[min(levels)]], args.max_tokens)
        return
    if args.replay:
        engine = make_engine("goodput", target, draft, 1, args, prompts[0])
        prompts = prompts[:counts[min(levels)]]
        runs = record_runs(engine, prompts, args.max_tokens, REPLAY_LONGEST)
        replay_to_json(replay_study(runs, engine, prompts, args), args)
        return
    results: list[dict[str, Any]] = []
    # Load level outside, mode inside: the modes compared at one level run back to back, so
    # a drift in machine speed over the run does not masquerade as a difference between them.
    temperatures = args.temperature
    for temperature in temperatures:
        for c in levels:
            engines: dict[str, LLMEngine] = {}  # --warm-engines: kept over the repeats
            for rep in range(args.repeats):
                for mode in modes if rep % 2 == 0 else modes[::-1]:
                    engine = engines.get(mode) or make_engine(mode, target, draft, max(levels),
                                                              args, prompts[0])
                    if args.warm_engines:
                        engines[mode] = engine
                    record(results, measure(engine, mode, c, counts[c], prompts, args,
                                            temperature))
                    save(results, args)  # after every run: a long run that stops keeps its rows
    for temperature in temperatures:
        print(f"\ntemperature {temperature}:")
        print(markdown_table([r for r in results if r["temperature"] == temperature]))


def costs_arg(text: str) -> Costs:
    try:
        return Costs.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def make_engine(mode: str, target: Any, draft: Any, max_num_seqs: int,
                args: argparse.Namespace, warm_up: list[int]) -> LLMEngine:
    """An engine for `mode` on the loaded models, after a short warm-up on `warm_up`. A
    warm engine sees the same prompts again: prefix caching is off there, so every repeat
    does the same work."""
    engine = LLMEngine(
        EngineConfig(max_num_batched_tokens=args.max_num_batched_tokens,
                     max_num_seqs=max_num_seqs, kv_cache_gib=1.0, log_stats_interval=0,
                     kv_cache_dtype=args.kv_cache_dtype,
                     enable_prefix_caching=not args.warm_engines,
                     speculative_config=spec_config(mode)),
        model=target[0], tokenizer=target[1], draft_model=draft)
    run_mode(engine, [warm_up], 1, 8, schema=workload_schema(args.workload))
    return engine


def forward_costs(engine: LLMEngine, prompts: list[list[int]], max_tokens: int,
                  repeats: int = 9) -> tuple[int, dict[str, float]]:
    """The mean prompt length n, and the medians of forwards timed now on this machine
    (seconds; each size `repeats` times, round robin, after an untimed round): the target's
    prefill of n tokens, windows of 1-9 tokens half-way through the output ("window T"), the
    draft's catch-up over the prompt and one draft forward."""
    assert isinstance(engine.speculator, Speculator), "needs a draft model"
    proposer, draft = engine.speculator.proposer, engine.speculator.draft_runner
    assert draft is not None, "needs a draft model"
    n = round(statistics.mean(len(p) for p in prompts))
    context = n + max_tokens // 2
    target = engine.runner
    draft_run = draft.execute_greedy if proposer.coarse_head else draft.execute
    times: dict[str, list[float]] = {}
    with engine.scheduler.scratch_blocks(context + 9) as tables:
        assert tables is not None, "the KV cache is too small for the timed forwards"
        table, more = tables[0], tuple(tables[1:])  # (more: a hybrid target's layer groups)
        # name -> (runner, its forward, the span)
        forwards = {f"window {t}": (target, target.execute,
                                    QuerySpan([0] * t, context, table, t, more_tables=more))
                    for t in range(1, 10)}
        forwards["prefill"] = (target, target.execute,
                               QuerySpan([0] * n, 0, table, 1, more_tables=more))
        forwards["catch-up"] = (draft, draft_run, QuerySpan([0] * n, 0, table, 1))
        forwards["draft"] = (draft, draft_run, QuerySpan([0], context, table, 1))
        for _ in range(repeats + 1):  # the first round pays first-call costs, untimed
            for name, (runner, run, span) in forwards.items():
                inp = runner.build_input([span])
                start = time.perf_counter()
                run(inp)
                times.setdefault(name, []).append(time.perf_counter() - start)
    return n, {name: statistics.median(t[1:]) for name, t in times.items()}


def ceiling(engine: LLMEngine, prompts: list[list[int]], max_tokens: int,
            alphas: tuple[float, ...] = (0.85, 0.91, 0.95, 1.0)) -> None:
    """The most draft-model speculation can gain at concurrency 1 here, from forwards timed
    now (`forward_costs`): a prompt of the mean length costs the target's prefill (both
    ways) and the draft's catch-up, then max_tokens come at one decode each, or at the best
    fixed k for a per-draft acceptance alpha (k draft forwards and a window of k + 1 per
    expected_tokens(alpha, k)). Host time, prompt lookups and a request's last window are
    left out."""
    n, med = forward_costs(engine, prompts, max_tokens)
    sizes = range(1, 10)
    decode, draft_s = med["window 1"], med["draft"]
    print(f"prompt {n} tokens, {max_tokens} new: target prefill {med['prefill'] * 1e3:.0f} ms, "
          f"draft catch-up {med['catch-up'] * 1e3:.0f} ms, decode {decode * 1e3:.1f} ms, draft "
          f"forward {draft_s * 1e3:.1f} ms ({draft_s / decode:.2f} decodes); windows of 2-9 "
          "tokens: " + ", ".join(f"{med[f'window {t}'] / decode:.2f}" for t in sizes[1:])
          + " decodes")
    plain = med["prefill"] + max_tokens * decode
    for alpha in alphas:
        per_token, k = min(((k * draft_s + med[f"window {k + 1}"]) / expected_tokens(alpha, k),
                            k) for k in sizes[:-1])
        spec = med["prefill"] + med["catch-up"] + max_tokens * per_token
        print(f"acceptance {alpha:.2f}: best k {k}, decoding {decode / per_token:.2f}x, end to "
              f"end {plain / spec:.2f}x")


def replay_study(runs: dict[str, Any], engine: LLMEngine | None,
                 prompts: list[list[int]], args: argparse.Namespace,
                 longest: int = REPLAY_LONGEST) -> dict[str, Any]:
    """Play back on recorded acceptance (`record_runs`): every fixed k, the acceptance
    estimate with fixed prior weights and with its fitted one, and each request's hindsight
    alpha, priced by --replay-costs or by forwards of `engine` timed now; prints a table
    per proposer and returns the figures."""
    if args.replay_costs is None:
        assert engine is not None, "timed costs need the engine"
        _, med = forward_costs(engine, prompts, args.max_tokens)
        windows = tuple(med[f"window {t}"] / med["window 1"] for t in range(1, longest + 2))
        costs = Costs(windows, med["draft"] / med["window 1"])
    else:
        costs = args.replay_costs
    print(f"costs in decodes: draft forward {costs.draft:.2f}, windows of 1-{longest + 1}: "
          + ", ".join(f"{w:.2f}" for w in costs.windows[:longest + 1]))
    figures: dict[str, Any] = {"costs": {"draft": costs.draft, "windows": costs.windows},
                               "runs": runs}
    matcher = NgramMatcher(SpecConfig.prompt_lookup_min, SpecConfig.prompt_lookup_max)
    runs = {**runs, **lookup_record(runs["sequences"], longest, matcher)}
    for method in ("draft_model", "ngram"):
        requests = runs[method]
        priced = costs if method == "draft_model" else Costs(costs.windows, 0.0)
        rules, weight = play_rules(requests, priced, longest, PRIOR_ALPHA[method],
                                   runs.get(f"{method}_lengths"),
                                   age_floor(method != "draft_model"),
                                   runs.get(f"{method}_levels"))
        best = max(v.speedup for name, v in rules.items() if name.startswith("fixed"))
        print(f"\n{method}: {len(requests)} requests, {sum(map(len, requests))} positions; "
              f"fitted weight ended at {weight:g}")
        print("| rule | speedup over no drafts | vs best fixed k | k chosen |\n|---|---|---|---|")
        for name, r in rules.items():
            print(f"| {name} | {r.speedup:.3f}x | {r.speedup / best:.3f} | "
                  f"{dict(sorted(r.ks.items()))} |")
        figures[method] = {name: {"speedup": r.speedup, "ks": dict(r.ks)}
                           for name, r in rules.items()}
        figures[method]["fitted_weight"] = weight
    return figures


def replay_to_json(figures: dict[str, Any], args: argparse.Namespace) -> None:
    """--out/--stem.json (default replay_WORKLOAD, or the played record's name + _replayed):
    the run's arguments and machine, the record, the prices and each rule's figures."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = args.stem or (f"replay_{args.workload}" if args.replay_runs is None
                         else f"{Path(args.replay_runs).stem}_replayed")
    machine = {"machine": platform.machine(), "torch": torch.__version__,
               "threads": torch.get_num_threads()}
    (out / f"{stem}.json").write_text(json.dumps(
        {"args": {k: v for k, v in vars(args).items() if k != "replay_costs"},
         "host": machine, **figures}, indent=1))


def measure(engine: LLMEngine, mode: str, c: int, count: int, prompts: list[list[int]],
            args: argparse.Namespace, temperature: float = 0.0) -> dict[str, Any]:
    """One run of `mode` at concurrency c (its figures from this run only)."""
    engine.stats.spec_stats = SpecStats()
    if isinstance(engine.speculator, Speculator):
        engine.speculator.chosen_k.clear()
        engine.speculator.windows_by_source.clear()
    run = (run_sessions(engine, agentic.sessions(count), c, args.max_tokens, temperature)
           if args.workload == "agentic" else
           run_mode(engine, prompts[:count], c, args.max_tokens, temperature,
                    None if args.predictions is None else args.predictions[:count],
                    workload_schema(args.workload)))
    return {"mode": mode, "concurrency": c, "temperature": temperature, "prompts": count,
            **run}


def record(results: list[dict[str, Any]], run: dict[str, Any]) -> None:
    """One row per mode and load: a repeated run adds its tok/s to the row's runs, and the
    row's tok/s is their mean (with the order reversed on every other repeat, a steady drift
    in machine speed cancels out of the mean); the other figures are the last run's."""
    key = ("mode", "concurrency", "temperature")
    at = next((i for i, r in enumerate(results) if all(r.get(k) == run[k] for k in key)),
              len(results))
    runs = [*(results[at]["tok_per_s_runs"] if at < len(results) else []), run["tok_per_s"]]
    row = {**run, "tok_per_s": sum(runs) / len(runs), "tok_per_s_runs": runs}
    results[at:at + 1] = [row]
    print_row(row, results)


def ratio_to_none(row: dict[str, Any], results: list[dict[str, Any]]) -> float | None:
    """The row's speed over no speculation's at its load: the median over the repeats of
    each repeat's own ratio where both ran more than once (the machine's speed drifts by more
    than the effects measured, and a repeat's runs are minutes apart), else of the means."""
    base = next((x for x in results if x["mode"] == "none" and x["concurrency"]
                 == row["concurrency"] and x.get("temperature") == row["temperature"]), None)
    if base is None:
        return None
    pairs = [r / b for r, b in zip(row["tok_per_s_runs"], base["tok_per_s_runs"],
                                   strict=False)]  # (mid-repeat, one may have run once more)
    if len(pairs) < 2:
        return row["tok_per_s"] / base["tok_per_s"]
    return statistics.median(pairs)


def markdown_table(results: list[dict[str, Any]]) -> str:
    """tok/s and the ratio to no speculation, one row per mode, one column per load; the
    best fixed k at each load in bold."""
    levels = sorted({r["concurrency"] for r in results})
    modes = list(dict.fromkeys(r["mode"] for r in results))
    at = {(r["mode"], r["concurrency"]): r["tok_per_s"] for r in results}
    ratio = {(r["mode"], r["concurrency"]): ratio_to_none(r, results) for r in results}
    fixed = ("draft", "ngram", "suffix")
    best = {c: max((v for (m, cc), v in at.items() if cc == c and m.startswith(fixed)),
                   default=None) for c in levels}
    lines = ["| mode | " + " | ".join(f"c={c}" for c in levels) + " |",
             "|---|" + "---|" * len(levels)]
    for mode in modes:
        cells = []
        for c in levels:
            v, x = at.get((mode, c)), ratio.get((mode, c))
            if v is None:
                cells.append("-")
                continue
            cell = f"{v:.2f} ({x:.2f}x)" if x is not None else f"{v:.2f}"
            cells.append(f"**{cell}**" if v == best[c] else cell)
        lines.append(f"| {mode} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def print_row(r: dict[str, Any], results: list[dict[str, Any]]) -> None:
    x = ratio_to_none(r, results)
    speedup = f"{x:.2f}x" if x is not None else "-"
    spec = (f"acceptance {r['acceptance_rate']:.2f}, mean length "
            f"{r['mean_acceptance_length']:.2f}" if r["num_drafts"] else "")
    ks = f", k chosen {r['chosen_k']}" if "chosen_k" in r else ""
    runs = (f" (runs {', '.join(f'{v:.2f}' for v in r['tok_per_s_runs'])})"
            if len(r["tok_per_s_runs"]) > 1 else "")
    print(f"{r['mode']:>16} t={r['temperature']:<4} c={r['concurrency']:<3} "
          f"{r['tok_per_s']:7.2f} tok/s {speedup:>6}  "
          f"{spec}{ks}{runs}", flush=True)


def save(results: list[dict[str, Any]], args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = args.stem or f"spec_{args.workload}"
    (out / f"{stem}.json").write_text(json.dumps({"args": vars(args), "results": results},
                                                 indent=1))
    levels = sorted({r["concurrency"] for r in results})
    if len({r["temperature"] for r in results}) > 1 and len(levels) == 1:
        plot_vs_temperature(results, out / f"{stem}.png", args.workload)
    if len(levels) < 2:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, rel) = plt.subplots(1, 2, figsize=(12, 4))
    base = {(r["concurrency"], r["temperature"]): r["tok_per_s"] for r in results
            if r["mode"] == "none"}
    temperatures = sorted({r["temperature"] for r in results})
    for mode, t in dict.fromkeys((r["mode"], r["temperature"]) for r in results):
        label = mode if len(temperatures) == 1 else f"{mode} t={t}"
        rows = [r for r in results if (r["mode"], r["temperature"]) == (mode, t)]
        ax.plot([r["concurrency"] for r in rows], [r["tok_per_s"] for r in rows], marker="o",
                label=label)
        rows = [r for r in rows if (r["concurrency"], t) in base]
        rel.plot([r["concurrency"] for r in rows],
                 [r["tok_per_s"] / base[r["concurrency"], t] for r in rows], marker="o",
                 label=label)
    ax.set(ylabel="output tokens/s", title=f"braid speculation modes, {args.workload}")
    rel.set(ylabel="throughput / no speculation", title="relative to no speculation")
    for a in (ax, rel):
        a.set(xscale="log", xlabel="concurrent requests")
        a.set_xticks(levels, [str(c) for c in levels])
        a.minorticks_off()
    rel.axhline(1.0, color="gray", linewidth=0.8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=120)
    plt.close(fig)


def plot_vs_temperature(results: list[dict[str, Any]], path: Path, workload: str) -> None:
    """Speedup over no speculation and acceptance rate against temperature, one line a mode
    (one load level)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = {r["temperature"]: r["tok_per_s"] for r in results if r["mode"] == "none"}
    fig, (speed, accept) = plt.subplots(1, 2, figsize=(12, 4))
    for mode in dict.fromkeys(r["mode"] for r in results if r["mode"] != "none"):
        rows = sorted((r for r in results if r["mode"] == mode and r["temperature"] in base),
                      key=lambda r: r["temperature"])
        temps = [r["temperature"] for r in rows]
        speed.plot(temps, [r["tok_per_s"] / base[r["temperature"]] for r in rows], marker="o",
                   label=mode)
        accept.plot(temps, [r["acceptance_rate"] for r in rows], marker="o", label=mode)
    speed.axhline(1.0, color="gray", linewidth=0.8)
    speed.set(xlabel="temperature", ylabel="throughput / no speculation",
              title=f"speculation vs temperature, {workload}, c={results[0]['concurrency']}")
    accept.set(xlabel="temperature", ylabel="acceptance rate", title="accepted drafts")
    speed.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
