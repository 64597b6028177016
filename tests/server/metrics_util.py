"""Reading a server's /metrics with prometheus-client's own parser."""

from __future__ import annotations

import httpx

from braid.bench.server_metrics import parse


def scrape(url: str) -> dict[str, float]:
    """Sample name (plus its labels other than model_name, as `name{k=v}`) -> value."""
    return parse(httpx.get(f"{url}/metrics", timeout=10).text)
