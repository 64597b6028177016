"""benchmarks/*.py refuse bad flag values with argparse's usage error naming the flag (before
loading anything), and their --help describes them in whole sentences."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "benchmarks"


def run_script(name: str, *argv: str, monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(sys, "argv", [name, *argv])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(SCRIPTS / name), run_name="__main__")
    return exit_.value.code  # type: ignore[return-value]


@pytest.mark.parametrize("script, argv, message", [
    ("bench_chunked.py", ["--chunk", "0"], "argument --chunk: must be >= 1, got 0"),
    ("bench_chunked.py", ["--request-rate", "nan"], "argument --request-rate: must be a number "
                                                    "> 0, got nan"),
    ("bench_kernels.py", ["--rows", "1,abc"], "argument --rows: 'abc' is not a number"),
    ("bench_kernels.py", ["--rows", ","], "argument --rows: give at least one value"),
    ("bench_model.py", ["--quantization", "int3"], "argument --quantization: invalid choice"),
    ("bench_model.py", ["--pairs", "0"], "argument --pairs: must be >= 1, got 0"),
    ("bench_model.py", ["--kv-cache-dtypes", "float32,fp8"], "--kv-cache-dtypes: unknown fp8 "
                                                             "(known: auto, float32, bfloat16, "
                                                             "float16)"),
    ("bench_prefix.py", ["--rates", "0.1,-1"], "argument --rates: -1: must be a number > 0"),
    ("bench_prefix.py", ["--workloads", "multiturn,foo"], "--workloads: unknown foo"),
    ("bench_prefix.py", ["--modes", " , "], "--modes: name at least one of cache"),
    ("bench_prefix.py", ["--workloads", ","], "--workloads: name at least one of multiturn"),
    ("bench_quant.py", ["--modes", "auto,foo"], "--modes: foo: starts with a --quantization"),
    ("bench_quant.py", ["--modes", "auto+k3:x"], "--modes: auto+k3:x: a draft vocabulary limit"),
    ("bench_quant.py", ["--modes", "auto+k5"], "--modes: auto+k5: +k5 is not one of"),
    ("bench_spec.py", ["--modes", "none,draft99"], "--modes: draft99: --speculative-config: "
                                                   "num_speculative_tokens must be"),
    ("bench_spec.py", ["--modes", "draftx"], "--modes: unknown mode 'draftx'"),
    ("bench_spec.py", ["--modes", "ngram4:100"], "--modes: ngram4:100: only a draft model's"),
    ("bench_spec.py", ["--modes", "draft3/foo"], "--modes: draft3/foo: a draft model's mode "
                                                 "takes /greedy"),
    ("bench_spec.py", ["--modes", ","], "--modes: name at least one mode"),
    ("bench_spec.py", ["--predict"], "--predict: only the edit workload has predicted outputs"),
    ("bench_spec.py", ["--concurrency", "1,0"], "argument --concurrency: 0: must be >= 1"),
    ("bench_spec.py", ["--temperature", "0,-1"], "--temperature: must be >= 0"),
    ("bench_spec.py", ["--prompts-per-slot", "-1"], "--prompts-per-slot: must be >= 0"),
    ("bench_spec.py", ["--replay-costs", "draft=x"], "argument --replay-costs: 'draft=x': "
                                                     "give draft=D"),
    ("bench_spec.py", ["--replay-costs", "1.2,1.4"], "--replay-costs: give the costs of "
                                                     "windows of 2 to 6"),
    ("bench_spec.py", ["--replay-runs", "r.json"], "--replay-runs: give --replay-costs too"),
    ("bench_spec.py", ["--replay", "--workload", "agentic"], "--replay: the agentic workload"),
    ("bench_spec.py", ["--replay", "--workload", "extraction"], "--replay: the record is of "
                                                                 "unconstrained output"),
    ("bench_structured.py", ["--max-tokens", "0"], "argument --max-tokens: must be >= 1"),
    ("bench_hostile.py", ["--repeats", "0"], "argument --repeats: must be >= 1, got 0"),
    ("bench_hostile.py", ["--", "--bogus"], "serve flags '--bogus': "),
    ("bench_pipeline.py", ["--configs", "1:2,0:1"], "argument --configs: 0:1: must be >= 1"),
    ("bench_kv_groups.py", ["--rounds", "0"], "argument --rounds: must be >= 1, got 0"),
    ("simulate_replicas.py", ["--routers", "prefix_aware,random"], "--routers: unknown random"),
    ("simulate_replicas.py", ["--replicas", "8,0"], "argument --replicas: 0: must be >= 1"),
    ("soak.py", ["--minutes", "-1"], "argument --minutes: must be a number > 0, got -1"),
    ("soak.py", ["--", "--bogus"], "serve flags '--model qwen2.5-coder-1.5b-instruct --bogus "),
    ("soak.py", ["--speculative-config", "{}"], "serve flags '--model qwen2.5-coder-1.5b-instruct "
                "--max-request-bytes 4194304 --speculative-config {}': --speculative-config "
                "needs 'method'"),
    ("bench_prefix.py", ["--server-args", "--max-model-len x"], "--server-args '--max-model-len "
                        "x': braid serve: error: argument --max-model-len: expected an integer "
                        "such as 4096"),
])
def test_bad_flag_values_are_usage_errors(script: str, argv: list[str], message: str,
                                          monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    assert run_script(script, *argv, monkeypatch=monkeypatch) == 2
    err = capsys.readouterr().err
    assert f"{script}: error: {message}" in err and "Traceback" not in err


@pytest.mark.parametrize("script", sorted(p.name for p in SCRIPTS.glob("*.py")))
def test_help_gives_the_script_s_first_paragraph_whole(
        script: str, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setenv("COLUMNS", "10000")  # one line: no word broken at a hyphen
    assert run_script(script, "--help", monkeypatch=monkeypatch) == 0
    doc = (SCRIPTS / script).read_text().split('"""')[1]
    first_paragraph = " ".join(doc.split("\n\n")[0].split())
    assert first_paragraph.endswith(".")
    assert first_paragraph in " ".join(capsys.readouterr().out.split())
