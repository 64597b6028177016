"""Structured output on the default pair: tok/s, acceptance and per-token mask cost with and
without a JSON schema, with and without draft speculation; and the grammar engines compared
(compile time, mask time per token on this CPU's 151,936-token vocabulary).

    python benchmarks/bench_structured.py                 # ~15 min here
    python benchmarks/bench_structured.py --modes none,draft3 --max-tokens 48
    python benchmarks/bench_structured.py --modes ""       # the grammar engines only

Each mode is one engine over the same chat prompts (greedy, all at once, then one alone);
"schema" rows constrain every request to a JSON schema of its question. Prints markdown
tables; writes JSON and a plot. xgrammar is measured only where it is installed.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from braid.bench.args import comma_choices
from braid.bench.datasets import tokenizer_for
from braid.bench.sweep_report import machine_info
from braid.config import DEFAULT_DRAFT, DEFAULT_TARGET, EngineConfig, positive_int
from braid.engine.engine import LLMEngine
from braid.sampling_params import SamplingParams, StructuredOutputsParams
from braid.structured.grammar import grammar_for
from braid.tokenizer import Tokenizer

PERSON = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
    "languages": {"type": "array", "items": {"enum": ["python", "c", "rust", "go"]},
                  "maxItems": 4},  # unbounded, greedy decoding repeats "c" to max_tokens
    "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                 "country": {"type": "string"}},
                "required": ["city", "country"]}},
    "required": ["name", "age", "languages", "address"]}
FUNCTION = {"type": "object", "properties": {
    "name": {"type": "string"}, "parameters": {"type": "array", "items": {
        "type": "object", "properties": {"name": {"type": "string"},
                                         "type": {"enum": ["int", "str", "float", "list"]}},
        "required": ["name", "type"]}},
    "returns": {"type": "string"}, "docstring": {"type": "string"}},
    "required": ["name", "parameters", "returns", "docstring"]}
PROMPTS = [
    ("Describe a fictional software engineer as JSON: name, age, languages and address.",
     PERSON),
    ("Describe, as JSON, a Python function that merges two sorted lists.", FUNCTION),
    ("Describe a retired Norwegian programmer as JSON: name, age, languages, address.",
     PERSON),
    ("Describe, as JSON, a Python function that checks whether a string is a palindrome.",
     FUNCTION),
]
MODES = {
    "none": None,
    "draft3": {"method": "draft_model", "num_speculative_tokens": 3, "policy": "fixed"},
    "goodput": {"method": "draft_model", "num_speculative_tokens": 3, "policy": "goodput"},
    "ngram3": {"method": "ngram", "num_speculative_tokens": 3, "policy": "fixed"},
    "suffix4": {"method": "suffix", "num_speculative_tokens": 4, "policy": "fixed"},
    "goodput_suffix": {"method": "suffix", "num_speculative_tokens": 8, "policy": "goodput"},
}


def run_mode(args: argparse.Namespace, spec: dict[str, Any] | None, schema: bool
             ) -> tuple[dict[str, Any], int]:
    """Figures per batch, and the model's vocabulary size."""
    engine = LLMEngine(EngineConfig(
        model=args.model, max_model_len=2048, kv_cache_gib=0.5, log_stats_interval=0,
        speculative_config=None if spec is None else {**spec, "model": args.draft_model}
        if spec["method"] == "draft_model" else spec))
    tokenizer = engine.tokenizer
    assert tokenizer is not None
    ids = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]),
                            add_special_tokens=False) for q, _ in PROMPTS]

    def params(i: int) -> SamplingParams:
        so = StructuredOutputsParams(json=PROMPTS[i][1]) if schema else None
        return SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=not schema,
                              structured_outputs=so)

    engine.add_request("warm", ids[0], params(0))  # kernels, grammar tokenizer, first steps
    list(engine.run_until_done())
    result: dict[str, Any] = {}
    for label, batch in (("all at once", range(len(PROMPTS))), ("alone", [0])):
        before = (engine.stats.grammar.num_masks, engine.stats.grammar.mask_time,
                  engine.stats.spec_stats.num_draft_tokens,
                  engine.stats.spec_stats.num_accepted_tokens,
                  engine.stats.grammar.num_rejected_drafts)
        start = time.perf_counter()
        for i in batch:
            engine.add_request(f"{label}-{i}", ids[i], params(i))
        outs = [o for o in engine.run_until_done() if o.finished]
        seconds = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        masks = engine.stats.grammar.num_masks - before[0]
        mask_s = engine.stats.grammar.mask_time - before[1]
        drafted = engine.stats.spec_stats.num_draft_tokens - before[2]
        result[label] = {
            "tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds,
            "masks": masks, "mask_us_per_mask": mask_s / masks * 1e6 if masks else None,
            "mask_share": mask_s / seconds,
            "acceptance": (engine.stats.spec_stats.num_accepted_tokens - before[3]) / drafted
            if drafted else None,
            "grammar_cut_drafts": engine.stats.grammar.num_rejected_drafts - before[4],
            "valid_json": sum(_valid(o.outputs[0].text) for o in outs) if schema else None,
        }
    if engine.structured is not None:
        engine.structured.shutdown()
    return result, engine.model_config.vocab_size


def _valid(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def compare_backends(tokenizer: Tokenizer, vocab_size: int) -> dict[str, Any]:
    """Compile time and mask time per token along a valid document, per grammar engine."""
    import llguidance

    doc = json.dumps({"name": "Ada Lovelace", "age": 36, "languages": ["python", "c"],
                      "address": {"city": "London", "country": "UK"}})
    ids = tokenizer.encode(doc, add_special_tokens=False)
    schema = json.dumps(PERSON)
    out: dict[str, Any] = {}
    start = time.perf_counter()
    ll_tok = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size,
                                    eos_token=tokenizer.eos_token_id or 0)
    setup = time.perf_counter() - start
    grammar = grammar_for(StructuredOutputsParams(json=PERSON))

    def llg() -> tuple[Any, Any]:
        return llguidance.LLMatcher(ll_tok, grammar), None

    out["llguidance"] = _measure_backend(setup, llg, ids, vocab_size, "llguidance")
    try:
        import xgrammar as xgr
    except ImportError:
        out["xgrammar"] = "not installed"
        return out
    start = time.perf_counter()
    vocab = [tokenizer.backend.id_to_token(i) or "" for i in range(vocab_size)]
    info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.BYTE_LEVEL, vocab_size=vocab_size,
                             stop_token_ids=sorted(tokenizer.eos_token_ids))
    compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    setup = time.perf_counter() - start

    def xg() -> tuple[Any, Any]:
        return xgr.GrammarMatcher(compiler.compile_json_schema(schema)), xgr

    out["xgrammar"] = _measure_backend(setup, xg, ids, vocab_size, "xgrammar")
    return out


def _measure_backend(setup: float, make: Any, ids: list[int], vocab_size: int, name: str
                     ) -> dict[str, Any]:
    import torch

    compile_s = []
    for _ in range(5):
        start = time.perf_counter()
        matcher, xgr = make()
        compile_s.append(time.perf_counter() - start)
    mask = torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32)
    times = []
    for token in ids:
        start = time.perf_counter()
        if xgr is None:
            matcher.unsafe_compute_mask_ptr(mask.data_ptr(), mask.numel() * 4)
            ok = matcher.consume_token(token)
        else:
            matcher.fill_next_token_bitmask(mask, 0)
            ok = matcher.accept_token(token)
        times.append(time.perf_counter() - start)
        assert ok, f"{name} refused token {token}"
    t = np.array(times) * 1e6
    return {"tokenizer_setup_s": setup, "compile_ms_median": float(np.median(compile_s) * 1e3),
            "mask_us_median": float(np.median(t)), "mask_us_p99": float(np.percentile(t, 99)),
            "tokens": len(ids)}


def table(results: dict[str, Any]) -> str:
    lines = ["| mode | schema | batch | tok/s | acceptance | grammar-cut drafts | "
             "mask us / mask | mask share of time | valid JSON |", "|---|---|---|---|---|---|"
             "---|---|---|"]
    for key, r in results.items():
        mode, schema = key.split("|")
        for batch, m in r.items():
            acc = "-" if m["acceptance"] is None else f"{m['acceptance']:.2f}"
            us = "-" if m["mask_us_per_mask"] is None else f"{m['mask_us_per_mask']:.0f}"
            valid = "-" if m["valid_json"] is None else str(m["valid_json"])
            lines.append(f"| {mode} | {schema} | {batch} | {m['tok_s']:.2f} | {acc} | "
                         f"{m['grammar_cut_drafts']} | {us} | {m['mask_share']:.2%} | {valid} |")
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = sorted({k.split("|")[0] for k in results}, key=list(MODES).index)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, batch in zip(axes, ("all at once", "alone"), strict=True):
        x = np.arange(len(modes))
        for j, schema in enumerate(("no", "yes")):
            values = [results.get(f"{m}|{schema}", {}).get(batch, {}).get("tok_s", 0)
                      for m in modes]
            ax.bar(x + (j - 0.5) * 0.38, values, 0.38,
                   label="JSON schema" if schema == "yes" else "no schema")
        ax.set(xticks=x, xticklabels=modes, ylabel="output tok/s",
               title=f"{len(PROMPTS) if batch != 'alone' else 1} request(s) {batch}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_TARGET)
    parser.add_argument("--draft-model", default=DEFAULT_DRAFT)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--max-tokens", type=positive_int, default=200,
                        help="per request (schema answers end when their JSON is complete)")
    parser.add_argument("--out", default="docs/benchmarks")
    args = parser.parse_args()
    modes = comma_choices(parser, "--modes", args.modes, MODES, allow_empty=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    vocab_size = 0
    for mode in modes:
        for schema in (False, True):
            start = time.monotonic()
            r, vocab_size = run_mode(args, MODES[mode], schema)
            results[f"{mode}|{'yes' if schema else 'no'}"] = r
            print(f"{mode:>8} schema={schema!s:>5}: " + ", ".join(
                f"{b} {m['tok_s']:.2f} tok/s" for b, m in r.items())
                + f" ({time.monotonic() - start:.0f} s)", flush=True)
            _save(out, args, results, None)
    tokenizer = tokenizer_for(args.model)
    backends = compare_backends(tokenizer, vocab_size or tokenizer.vocab_size)
    _save(out, args, results, backends)
    if results:
        print(table(results))
        plot(results, out / "structured_output.png")
    print(json.dumps(backends, indent=1))


def _save(out: Path, args: argparse.Namespace, results: dict[str, Any],
          backends: dict[str, Any] | None) -> None:
    """Write the JSON; a run of the grammar engines alone (--modes "") keeps the engine
    results an earlier run saved there."""
    path = out / "structured_output.json"
    data = {"args": vars(args), "machine": machine_info(), "results": results,
            "backends": backends}
    if not args.modes.strip(", ") and path.is_file():
        data = {**json.loads(path.read_text()), "backends": backends}
    path.write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
