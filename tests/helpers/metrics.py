"""The live server's Prometheus figures, as the server tests read them."""

from __future__ import annotations

import re
import time

import httpx
import pytest

SAMPLE = re.compile(r"^(pagedserve:\w+(?:\{[^}]*\})?) ([-+\deE.naif]+)$")


def read_metrics(url: str) -> dict[str, float]:
    """Each ``pagedserve:`` sample of ``GET url/metrics`` (labels included in its name)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {m.group(1): float(m.group(2)) for m in map(SAMPLE.match, text.splitlines()) if m}


def wait_idle(url: str, timeout: float = 120.0) -> dict[str, float]:
    """The metrics once nothing runs or waits and no KV page is in use (an abort reaches the
    engine loop asynchronously); the test fails, showing them, if that takes over ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        m = read_metrics(url)
        busy = {k: m[f"pagedserve:{k}"] for k in IDLE_GAUGES if m[f"pagedserve:{k}"]}
        if not busy:
            return m
        if time.monotonic() > deadline:
            pytest.fail(f"the server is not idle {timeout:.0f} s on: {busy}")
        time.sleep(0.05)


IDLE_GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
