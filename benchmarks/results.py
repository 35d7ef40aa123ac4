"""Results files: every figure the README quotes comes from one of these, written by the benchmark
command that measured it (JSON under benchmarks/results/, with the date, the machine, the torch
version and the command line)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


# The CPU flags that decide which kernels run (ours and the peers'): every results file names them.
ISA_FLAGS = (
    "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
    "avx512_bf16", "amx_bf16", "amx_int8", "asimd", "sve",
)  # fmt: skip


def machine() -> dict:
    model, flags = platform.processor(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model == platform.processor():
                model = line.split(":", 1)[1].strip()
            elif line.startswith(("flags", "Features")) and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    from benchmarks.cpu_clock import microarchitecture

    return {
        "cpu": model,
        "microarchitecture": microarchitecture(),
        "cores": os.cpu_count(),
        "isa_flags": [f for f in ISA_FLAGS if f in flags],
        "system": platform.platform(),
        # others' work on a shared machine slows a benchmark: 1, 5 and 15 minutes, as uptime
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def this_command() -> list[str]:
    """How this benchmark was started: ``python -m benchmarks.NAME ARGS`` (a script run by its
    path: ``python PATH ARGS``)."""
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    if spec is not None and spec.name:
        return ["python", "-m", spec.name, *sys.argv[1:]]
    return ["python", *sys.argv]


def write_result(name: str, figures: dict, command: list[str] | None = None) -> Path:
    import torch

    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "torch": torch.__version__,
        "command": " ".join(command or this_command()),
        **figures,
    }
    path.write_text(json.dumps(record, indent=2) + "\n")
    return path


def spread(values: list[float]) -> dict:
    """Median and range of repeated runs."""
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "runs": values,
    }
