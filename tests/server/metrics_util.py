"""Reading a server's /metrics with prometheus-client's own parser."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import httpx

from braid.bench.server_metrics import parse


def scrape(url: str, verify: Any = True) -> dict[str, float]:
    """Sample name (plus its labels other than model_name, as `name{k=v}`) -> value."""
    return parse(httpx.get(f"{url}/metrics", timeout=10, verify=verify).text)


def wait_until_in_engine(url: str, count: int, log: str = "", timeout: float = 30,
                         done: Callable[[], int] = lambda: 0, verify: Any = True) -> None:
    """Until `count` requests run or wait in the engine, or finished there (`done()` of
    them): one still in the listen backlog when a SIGTERM closes the listener is reset,
    which a shutdown test is not about."""
    deadline = time.monotonic() + timeout
    while True:
        finished = done()
        values = scrape(url, verify)
        if (values.get("braid:num_requests_running", 0)
                + values.get("braid:num_requests_waiting", 0) + finished) >= count:
            return
        assert time.monotonic() < deadline, log
        time.sleep(0.05)
