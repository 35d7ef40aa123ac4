"""What the reliability benchmarks read of a running server's processes: their tree (the HTTP
process and the engine core), their resident memory, and the errors in the server's log. The server
itself starts with ``pagedserve.testing.serve``."""

from __future__ import annotations

from pathlib import Path


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
