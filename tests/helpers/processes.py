"""Which processes a test started, found again after their parent is gone: each child process gets
a tag in its environment, which every process it starts inherits (tensor-parallel ranks, engine
cores), so a test can tell whether any of them outlived the program it ran."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

TAG = "PAGEDSERVE_TEST_PROCESS_TAG"


def tagged_env(**extra: str) -> tuple[dict[str, str], str]:
    """(an environment for a child process, its tag)."""
    tag = uuid.uuid4().hex
    return {**os.environ, TAG: tag, **extra}, tag


def live_processes(tag: str) -> list[int]:
    """The pids of the processes alive now whose environment carries ``tag`` (zombies, which
    have exited and only wait to be reaped, do not count)."""
    needle = f"{TAG}={tag}".encode()
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if needle in (proc / "environ").read_bytes().split(b"\0") and not _zombie(proc):
                pids.append(int(proc.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return pids


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie does not)."""
    try:
        return not _zombie(Path(f"/proc/{pid}"))
    except OSError:
        return False


def wait_until_gone(tag: str, timeout: float = 30.0) -> list[int]:
    """The tagged processes still alive after ``timeout`` seconds (none: all ended)."""
    deadline = time.monotonic() + timeout
    while (left := live_processes(tag)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _zombie(proc: Path) -> bool:
    stat = (proc / "stat").read_text()
    return stat[stat.rindex(")") + 2] == "Z"
