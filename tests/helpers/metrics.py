"""The live server's Prometheus figures, as the server tests read them."""

from __future__ import annotations

import re

import httpx

SAMPLE = re.compile(r"^(pagedserve:\w+(?:\{[^}]*\})?) ([-+\deE.naif]+)$")


def read_metrics(url: str) -> dict[str, float]:
    """Each ``pagedserve:`` sample of ``GET url/metrics`` (labels included in its name)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {m.group(1): float(m.group(2)) for m in map(SAMPLE.match, text.splitlines()) if m}
