"""Servers for the test suite and the benchmarks: ``pagedserve serve`` in a child process, or an
app served by uvicorn in a thread of this process, each on a free port of 127.0.0.1 and up before
the ``with`` block starts. No torch here, and uvicorn and httpx only once a server starts.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import IO, Any

HOST = "127.0.0.1"


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@contextmanager
def serve(
    *flags: str,
    port: int | None = None,
    log: IO | int | None = subprocess.DEVNULL,
    log_level: str | None = None,
    timeout: float = 600,
    env: Mapping[str, str] | None = None,
    start_new_session: bool = False,
) -> Iterator[tuple[subprocess.Popen, str]]:
    """``pagedserve serve FLAGS`` on 127.0.0.1 (``port``, default a free one) in a child process:
    (the process, its base URL) once /health answers 200; terminated (then killed) after. Its
    output goes to ``log`` (default: dropped; None: this process's); ``log_level`` None leaves the
    server's own (or the one FLAGS set). ``env``: its environment (default: this process's);
    ``start_new_session``: a process group of its own, which a signal can reach as a terminal's
    Ctrl-C reaches a foreground job."""
    import httpx

    port = port or free_port()
    url = f"http://{HOST}:{port}"
    cmd = [sys.executable, "-m", "pagedserve", "serve", *flags, "--host", HOST, "--port", str(port)]
    cmd += ["--log-level", log_level] if log_level else []
    server = subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT if log is not None else None,
        env=env,
        start_new_session=start_new_session,
    )
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


@contextmanager
def serve_app(app: Any, log_level: str = "warning", **uvicorn_config: Any) -> Iterator[str]:
    """``app`` (ASGI) served by uvicorn in a thread of this process: its base URL once it accepts
    connections; stopped after. The port is bound before the thread starts, so no other process
    can take it in between."""
    import uvicorn

    sock = socket.socket()
    sock.bind((HOST, 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, **uvicorn_config))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        while not server.started:  # however long a loaded machine takes; callers bound it
            if not thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        yield f"http://{HOST}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
