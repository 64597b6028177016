"""`braid bench sweep` end to end on the tiny model (two modes, two rates), and its parts."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from braid.bench.args import MODES as MODES_FLAG_DEFAULT
from braid.bench.sweep import DEFAULT, MODES, QUICK, mode_flags, parse_rates, resolve_sizing
from braid.bench.sweep_report import mean_k
from braid.cli import build_parser, main
from tests.server.conftest import ENGINE_FLAGS
from tests.tiny import save_tiny_model


def test_mode_flags() -> None:
    assert mode_flags("baseline") == ["--no-enable-chunked-prefill"]
    assert mode_flags("chunked") == ["--enable-chunked-prefill"]
    spec = mode_flags("spec", draft_model="d")
    assert spec[:2] == ["--no-enable-chunked-prefill", "--speculative-config"]
    assert json.loads(spec[2]) == {"method": "draft_model", "num_speculative_tokens": 3,
                                   "policy": "fixed", "model": "d"}
    dynamic = json.loads(mode_flags("chunked_dynamic")[2])
    assert (dynamic["num_speculative_tokens"], dynamic["policy"]) == (5, "goodput")
    with pytest.raises(ValueError, match="unknown mode"):
        mode_flags("turbo")
    assert ",".join(MODES) == MODES_FLAG_DEFAULT


def test_rates_and_sizing() -> None:
    assert parse_rates("0.1, 0.2,inf") == [0.1, 0.2, float("inf")]
    for bad in ("", "0", "a,b", "-1"):
        with pytest.raises(ValueError, match="--request-rates"):
            parse_rates(bad)
    args = build_parser().parse_args(["bench", "sweep", "--quick", "--num-prompts", "7"])
    resolve_sizing(args)
    assert (args.request_rates, args.num_prompts, args.max_output_len) == (
        QUICK.request_rates, 7, QUICK.max_output_len)
    args = build_parser().parse_args(["bench", "sweep"])
    resolve_sizing(args)
    assert args.request_rates == DEFAULT.request_rates and args.out == "docs/benchmarks"
    assert args.goodput == ["ttft:10000", "tpot:500"]
    assert mean_k({"0": 1, "3": 3}) == pytest.approx(2.25) and mean_k({}) is None


def test_sweep_end_to_end(tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture
                          ) -> None:
    out = tmp_path / "bench"
    argv = ["bench", "sweep", "--model", str(tiny_model_dir), "--draft-model",
            str(tiny_model_dir), "--dataset", "random", "--random-input-len", "6",
            "--modes", "baseline,chunked_fixed", "--request-rates", "4,inf", "--num-prompts", "4",
            "--max-output-len", "10", "--goodput", "ttft:60000", "--server-args",
            " ".join([*ENGINE_FLAGS, "--api-key", "k"]),  # the load sends the servers' key
            "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    sweep = json.loads((out / "sweep_random.json").read_text())
    assert sweep["schema"] == "braid.bench.sweep/1" and list(sweep["modes"]) == [
        "baseline", "chunked_fixed"]
    for entry in sweep["modes"].values():
        assert entry["error"] is None and entry["exit_code"] == 0
        assert [r["config"]["request_rate"] for r in entry["runs"]] == [4.0, "inf"]
        assert all(r["completed"] == 4 and r["total_output_tokens"] == 40 for r in entry["runs"])
        assert all(r["goodput"] == pytest.approx(r["request_throughput"]) for r in entry["runs"])
    spec = sweep["modes"]["chunked_fixed"]["runs"][0]["spec"]
    assert spec["num_draft_tokens"] > 0 and "3" in spec["chosen_k"]
    assert spec["acceptance_rate"] > 0.5  # the draft is the target itself
    md = (out / "sweep_random.md").read_text()
    assert "braid bench sweep --model" in md and "| chunked_fixed | inf | 4/0 |" in md
    assert "--no-enable-chunked-prefill" in md and sweep["machine"]["cpus_available"] >= 1
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert "sweep_random_tpot_p99.png" in pngs and len(pngs) == 6
    assert all(f"]({name})" in md for name in pngs)


def test_a_mode_whose_server_fails_is_reported(tmp_path: Path) -> None:
    """...beside the last results, which a sweep whose servers all failed does not replace.
    Here the weights are unreadable: the model's config.json passes the checks made before
    any server starts, and each server fails while it loads."""
    out = tmp_path / "bench"
    out.mkdir()
    (out / "sweep_random.json").write_text("{}")
    model = save_tiny_model(tmp_path / "broken")
    (model / "model.safetensors").write_bytes(b"not safetensors")
    argv = ["bench", "sweep", "--model", str(model), "--dataset", "random",
            "--modes", "baseline", "--request-rates", "1", "--num-prompts", "1",
            "--out", str(out), "--no-progress", "--server-timeout", "60"]
    assert main(argv) == 1
    entry = json.loads((out / "sweep_random_failed.json").read_text())["modes"]["baseline"]
    assert entry["error"].startswith("server did not start") and entry["runs"] == []
    assert "FAILED" in (out / "sweep_random_failed.md").read_text()
    assert (out / "sweep_random.json").read_text() == "{}"
    assert not (out / "sweep_random.md").exists()


@pytest.mark.parametrize("server_args, message", [
    ("--block-size 0", "--server-args '--no-enable-chunked-prefill --block-size 0': "
                       "--block-size must be > 0, got 0"),
    ("--max-num-seqs", "argument --max-num-seqs: expected one argument"),
    ("--kv-cache-gib 'x", "--server-args \"--kv-cache-gib 'x\": No closing quotation"),
    # the sweep's own: its servers listened elsewhere and it waited for them in vain
    ("--port 8129", "--server-args '--port 8129': --port is the sweep's to choose"),
    ("--host=0.0.0.0", "--server-args '--host=0.0.0.0': --host is the sweep's to choose"),
])
def test_server_args_serve_refuses_stop_the_sweep_before_it_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture, server_args: str, message: str) -> None:
    """Before, each mode's server exited at its start and the sweep reported every mode as
    failed, after loading the dataset."""
    argv = ["bench", "sweep", "--dataset", "random", "--modes", "baseline",
            f"--server-args={server_args}", "--out", str(tmp_path / "bench"), "--no-progress"]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "bench").exists()


def test_server_args_the_model_refuses_stop_the_sweep_before_it_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A value only the model's config.json can refuse (a --max-model-len beyond the model's,
    the KV cache for it) is caught before any server starts, as a usage error."""
    model = save_tiny_model(tmp_path / "tiny")
    argv = ["bench", "sweep", "--model", str(model), "--dataset", "random", "--modes",
            "baseline", "--server-args=--max-model-len 100000", "--out", str(tmp_path / "bench"),
            "--no-progress"]
    assert main(argv) == 2
    assert ("--server-args '--no-enable-chunked-prefill --max-model-len 100000': "
            "--max-model-len 100000 exceeds the model's") in capsys.readouterr().err
    assert not (tmp_path / "bench").exists()


def test_bench_serve_cli_parses_the_issue_flags() -> None:
    args = build_parser().parse_args([
        "bench", "serve", "--base-url", "http://h:1", "--model", "m", "--dataset", "random",
        "--random-input-len", "5", "--random-output-len", "6", "--num-prompts", "3",
        "--request-rate", "inf", "--burstiness", "0.5", "--max-concurrency", "2", "--seed", "9",
        "--goodput", "ttft:100", "tpot:20", "--endpoint", "completions", "--result-json", "r"])
    assert args.request_rate == float("inf") and args.goodput == ["ttft:100", "tpot:20"]
    assert isinstance(args, argparse.Namespace) and args.max_concurrency == 2


def test_a_timeout_must_be_positive(capsys: pytest.CaptureFixture) -> None:
    """--server-timeout -1 ran every mode into "not healthy after -1.0 s"."""
    with pytest.raises(SystemExit):
        main(["bench", "sweep", "--server-timeout", "-1"])
    assert "argument --server-timeout: must be a number > 0, got -1" in capsys.readouterr().err


def test_a_missing_model_is_named_as_the_flag_given(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture) -> None:
    """It was reported as a --server-args value the user never gave."""
    argv = ["bench", "sweep", "--model", str(tmp_path / "nope"), "--modes", "baseline",
            "--dataset", "random", "--out", str(tmp_path / "bench"), "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"braid: error: --model: model '{tmp_path / 'nope'}' not found" in err
    assert "--server-args" not in err and not (tmp_path / "bench").exists()
