"""What the reliability benchmarks share: a `pagedserve serve` on 127.0.0.1 for the length of a
run, and the resident memory of its processes (the HTTP process and the engine core)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

BENCHMARKS = Path(__file__).resolve().parents[1]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serve(
    *flags: str,
    port: int | None = None,
    log: IO | None = None,
    log_level: str | None = "warning",
    timeout: float = 300,
) -> Iterator[tuple[subprocess.Popen, str]]:
    """`pagedserve serve FLAGS` on 127.0.0.1 (``port``, default a free one) once /health answers
    200; terminated (then killed) after. Its output goes to ``log`` (default: this process's);
    ``log_level`` None leaves the server's own. The test suite's servers start here too."""
    import httpx

    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "pagedserve", "serve", *flags]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--log-level", log_level] if log_level else []
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT if log else None)
    try:
        deadline = time.monotonic() + timeout
        while True:
            assert server.poll() is None, f"the server exited with {server.returncode}"
            assert time.monotonic() < deadline, f"the server did not answer /health in {timeout} s"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        yield server, url
    finally:
        if server.poll() is None:
            server.terminate()
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(10)


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (from /proc: the engine core is a child of the server)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    return tree


def rss_bytes(pids: list[int]) -> int:
    """Resident memory of these processes together (VmRSS; a gone process counts 0)."""
    return sum(rss_by_process(pids).values())


def rss_by_process(pids: list[int]) -> dict[str, int]:
    """Resident memory per process, named by role: the first is the server's HTTP process, a
    spawned child running the engine is ``engine_core``, others by their command name."""
    rss = {}
    for i, pid in enumerate(pids):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        role = "http" if i == 0 else "engine_core" if "spawn_main" in cmdline else "other"
        kib = next(
            int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")
        )
        rss[role] = rss.get(role, 0) + kib * 1024
    return rss


def logged_errors(log_text: str) -> list[str]:
    """The server's ERROR lines and tracebacks (an error a vanished client never saw is still
    one)."""
    return [
        line for line in log_text.splitlines() if " ERROR " in line or line.startswith("Traceback")
    ]
