"""A sweep's markdown table and matplotlib plots (one line per mode against the request rate),
with the machine, versions and command line recorded beside the numbers."""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

from braid.bench.serve import save_json

# file suffix -> (result key, statistic or None for a scalar, axis label)
PLOTS: dict[str, tuple[str, str | None, str]] = {
    "tpot_p50": ("tpot_ms", "median", "TPOT p50 (ms)"),
    "tpot_p99": ("tpot_ms", "p99", "TPOT p99 (ms)"),
    "itl_p99": ("itl_ms", "p99", "ITL p99 (ms)"),
    "ttft_p50": ("ttft_ms", "median", "TTFT p50 (ms)"),
    "ttft_p99": ("ttft_ms", "p99", "TTFT p99 (ms)"),
    "throughput": ("output_throughput", None, "output throughput (tok/s)"),
}
COLUMNS = ("mode", "rate (req/s)", "ok/failed", "req/s", "out tok/s", "TTFT p50", "TTFT p99",
           "TPOT p50", "TPOT p99", "ITL p50", "ITL p99", "E2E p50", "goodput", "accept rate",
           "mean accept len", "mean k")


def machine_info() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpus_available": len(os.sched_getaffinity(0)),
        "memory_gib": _memory_gib(),
        "python": platform.python_version(),
        "versions": {p: _version(p) for p in ("braid", "torch", "httpx", "numpy")},
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gib() -> float | None:
    try:
        kib = int(Path("/proc/meminfo").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return round(kib / 2**20, 1)


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _git(*args: str) -> str | None:
    try:
        res = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout.strip() if res.returncode == 0 else None


def _fmt(value: Any, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def table_row(mode: str, run: dict[str, Any]) -> list[str]:
    spec = run.get("spec") or {}
    return [mode, str(run["config"]["request_rate"]), f"{run['completed']}/{run['failed']}",
            _fmt(run["request_throughput"], 3), _fmt(run["output_throughput"], 2),
            _fmt(run["ttft_ms"]["median"], 0), _fmt(run["ttft_ms"]["p99"], 0),
            _fmt(run["tpot_ms"]["median"], 0), _fmt(run["tpot_ms"]["p99"], 0),
            _fmt(run["itl_ms"]["median"], 0), _fmt(run["itl_ms"]["p99"], 0),
            _fmt(run["e2el_ms"]["median"], 0), _fmt(run["goodput"], 3),
            _fmt(spec.get("acceptance_rate"), 3), _fmt(spec.get("mean_acceptance_length"), 2),
            _fmt(mean_k(spec.get("chosen_k") or {}), 2)]


def mean_k(chosen_k: dict[str, int]) -> float | None:
    """Mean draft length the server chose per decoding request and step."""
    total = sum(chosen_k.values())
    return sum(int(k) * n for k, n in chosen_k.items()) / total if total else None


def markdown(sweep: dict[str, Any], plots: list[Path]) -> str:
    m, s = sweep["machine"], sweep["settings"]
    versions = ", ".join(f"{k} {v}" for k, v in m["versions"].items())
    lines = [f"# Serving sweep: {s['dataset']}", "",
             f"Run {sweep['date']}; every number below comes from this command:", "",
             "```", sweep["command"], "```", "",
             f"- Machine: {m['cpu']}, {m['cpus_available']} CPUs available, "
             f"{m['memory_gib']} GiB RAM, {m['platform']}",
             f"- Versions: Python {m['python']}, {versions}; git {m['git_commit']}"
             f"{' (uncommitted changes)' if m['git_dirty'] else ''}",
             f"- Settings: `{_settings_text(s)}`", "",
             "Latencies in ms (p50 = median); goodput in req/s under the SLOs in the settings.",
             "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for mode, entry in sweep["modes"].items():
        lines += ["| " + " | ".join(table_row(mode, run)) + " |" for run in entry["runs"]]
    lines += _mode_notes(sweep["modes"]) + [""]
    lines += [f"![{p.stem}]({p.name})" for p in plots]
    return "\n".join(lines) + "\n"


def _settings_text(s: dict[str, Any]) -> str:
    keys = ("model", "num_prompts", "request_rates", "max_output_len", "max_input_len",
            "endpoint", "seed", "goodput", "server_args")
    return ", ".join(f"{k}={s[k]}" for k in keys if s.get(k) is not None)


def _mode_notes(modes: dict[str, Any]) -> list[str]:
    lines = ["", "Server flags per mode (startup and total time in seconds):", ""]
    for mode, entry in modes.items():
        flags = shlex.join(entry["server_flags"])
        if entry["error"]:
            lines.append(f"- `{mode}`: `{flags}` -- FAILED: {entry['error']}")
        else:
            lines.append(f"- `{mode}`: `{flags}` ({_fmt(entry.get('startup_s'), 0)} s startup, "
                         f"{_fmt(entry.get('elapsed_s'), 0)} s total)")
    return lines


def plot(sweep: dict[str, Any], out: Path, stem: str) -> list[Path]:
    """One PNG per entry of PLOTS; x = request rate (a sent-all-at-once run is left out)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for suffix, (key, stat, label) in PLOTS.items():
        fig, ax = plt.subplots(figsize=(6, 4))
        for mode, entry in sweep["modes"].items():
            points = [(r["config"]["request_rate"], r[key] if stat is None else r[key][stat])
                      for r in entry["runs"] if r["config"]["request_rate"] != "inf"]
            points = [(x, y) for x, y in points if y is not None]
            if points:
                ax.plot(*zip(*points, strict=True), marker="o", label=mode)
        ax.set(xlabel="request rate (req/s)", ylabel=label, title=f"{label} vs request rate")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend()
        paths.append(out / f"{stem}_{suffix}.png")
        fig.savefig(paths[-1], dpi=100, bbox_inches="tight")
        plt.close(fig)
    return paths


def report_stem(sweep: dict[str, Any], dataset: str) -> str:
    """sweep_<dataset>, or sweep_<dataset>_failed while no mode has run: a sweep whose
    servers all failed (a bad --server-args value) must not replace the last results."""
    ok = any(entry["error"] is None for entry in sweep["modes"].values())
    return f"sweep_{dataset}" if ok else f"sweep_{dataset}_failed"


def write_report(sweep: dict[str, Any], out: Path, dataset: str) -> Path:
    """<stem>.json, the PNGs and <stem>.md into `out` (stem: `report_stem`)."""
    out.mkdir(parents=True, exist_ok=True)
    stem = report_stem(sweep, dataset)
    save_json(sweep, out / f"{stem}.json")
    md = out / f"{stem}.md"
    md.write_text(markdown(sweep, plot(sweep, out, stem)))
    return md
