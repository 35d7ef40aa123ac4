"""A `pagedserve serve` for a benchmark: on a free port, up once /health answers, stopped after."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def demo_server(flags: list[str], timeout: float = 600) -> Iterator[tuple[int, str]]:
    """`pagedserve serve FLAGS` on a free port until /health answers: (pid, url)."""
    url = f"http://127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "pagedserve.cli", "serve", *flags, "--host", "127.0.0.1"]
    proc = subprocess.Popen(
        [*cmd, "--port", url.rsplit(":", 1)[1]],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + timeout
        while not _healthy(url):
            assert proc.poll() is None, f"serve exited with {proc.returncode}"
            assert time.monotonic() < deadline, f"serve did not answer /health in {timeout}s"
            time.sleep(0.2)
        yield proc.pid, url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
