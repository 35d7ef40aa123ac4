"""A `pagedserve serve` for a benchmark: on a free port, up once /health answers, stopped after
(``reliability/server.py`` starts it; this is the form the demo benchmarks use)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

from reliability.server import serve


@contextmanager
def demo_server(flags: list[str], timeout: float = 600) -> Iterator[tuple[int, str]]:
    """`pagedserve serve FLAGS` on a free port until /health answers: (pid, url)."""
    with serve(*flags, log=subprocess.DEVNULL, timeout=timeout) as (proc, url):
        yield proc.pid, url
