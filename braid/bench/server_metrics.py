"""The server's own speculation figures for a run: /metrics scraped before and after."""

from __future__ import annotations

from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

_SPEC = "braid:spec_decode_"
_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def scrape(base_url: str, timeout_s: float = 10.0) -> dict[str, float] | None:
    """Sample name (with labels other than model_name, as `name{k=v}`) -> value; None when
    the server has no Prometheus /metrics (not every OpenAI-compatible server does)."""
    try:
        res = httpx.get(f"{base_url.rstrip('/')}/metrics", timeout=timeout_s)
    except httpx.HTTPError:
        return None
    if res.status_code != 200:
        return None
    return parse(res.text)


def parse(text: str) -> dict[str, float]:
    """Sample name (with its labels but model_name) -> value. A series of one of several
    replicas counts under its own name and, summed with the other replicas', under the name
    without the replica label (so the figures of one engine and of replicas read alike)."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k != "model_name"}
            values[_key(sample.name, labels)] = sample.value
            if "replica" in labels:
                del labels["replica"]
                total = _key(sample.name, labels)
                values[total] = values.get(total, 0.0) + sample.value
    return values


def _key(name: str, labels: dict[str, str]) -> str:
    text = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    return f"{name}{{{text}}}" if text else name


def spec_figures(before: dict[str, float] | None,
                 after: dict[str, float] | None) -> dict[str, Any] | None:
    """Speculation during the run (counter differences), vLLM's definitions: acceptance rate =
    accepted / drafted; mean acceptance length = 1 + accepted / drafts. None without braid's
    speculation counters."""
    if before is None or after is None or f"{_SPEC}num_drafts_total" not in after:
        return None
    delta = {name: after.get(f"{_SPEC}{name}_total", 0.0) - before.get(f"{_SPEC}{name}_total", 0.0)
             for name in _COUNTERS}
    drafts, drafted, accepted = (int(delta[n]) for n in _COUNTERS)
    return {
        "num_drafts": drafts,
        "num_draft_tokens": drafted,
        "num_accepted_tokens": accepted,
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        "accepted_per_position": _per_position(before, after),
        "chosen_k": _chosen_k(before, after),
    }


def _per_position(before: dict[str, float], after: dict[str, float]) -> list[int]:
    prefix = f"{_SPEC}num_accepted_tokens_per_pos_total{{position="
    counts: dict[int, int] = {}
    for key, value in after.items():
        if key.startswith(prefix) and "replica=" not in key:  # the replicas' sum
            counts[int(key[len(prefix):-1])] = int(value - before.get(key, 0.0))
    return [counts.get(i, 0) for i in range(max(counts) + 1)] if counts else []


def _chosen_k(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    """k (as a string, JSON's key type) -> decisions during the run, from the cumulative
    histogram's integer buckets."""
    prefix = f"{_SPEC}chosen_k_bucket{{le="
    cumulative: dict[float, float] = {}
    for key, value in after.items():
        if key.startswith(prefix) and not key.endswith("+Inf}") and "replica=" not in key:
            cumulative[float(key[len(prefix):-1])] = value - before.get(key, 0.0)
    dist: dict[str, int] = {}
    below = 0.0
    for le in sorted(cumulative):
        if cumulative[le] - below > 0:
            dist[str(int(le))] = int(cumulative[le] - below)
        below = cumulative[le]
    return dist
