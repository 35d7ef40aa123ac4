"""The CPU kernel targets (``native.py`` builds one library per target) and what this CPU can
execute, by its flags alone: nothing here builds or imports torch, so the memory plan
(``engine/memory_plan.py``) can ask which INT4 layout ``serve`` will pack.

``$PAGEDSERVE_CPU_FLAGS`` replaces the CPU flags read from ``/proc/cpuinfo`` (for tests).
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path

# What x86-64-v3 lets a compiler emit (AVX2, FMA, F16C, BMI1/2, LZCNT, MOVBE, and v2's SSE4.2,
# POPCNT, CMPXCHG16B, LAHF), by their /proc/cpuinfo names.
_X86_64_V3 = (
    "avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe", "xsave",
    "sse4_1", "sse4_2", "ssse3", "pni", "popcnt", "cx16", "lahf_lm",
)  # fmt: skip
_X86_64_V4 = (*_X86_64_V3, "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl")
AMX_FLAGS = frozenset({"amx_tile", "amx_bf16"})  # the avx512 target's GEMV uses them if present


@dataclass(frozen=True)
class Target:
    name: str
    macro: int  # PAGEDSERVE_TARGET in csrc/vec.h
    cpu_flags: tuple[str, ...]  # what the CPU must have
    cflags: tuple[str, ...]  # what the compiler may use
    machines: tuple[str, ...] = ("x86_64", "amd64")  # empty: any


TARGETS = {
    "avx512": Target(
        "avx512",
        1,
        (*_X86_64_V4, "avx512_bf16", "avx512_vnni"),
        ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"),
    ),
    "avx2": Target("avx2", 2, _X86_64_V3, ("-march=x86-64-v3",)),
    "portable": Target("portable", 3, (), (), machines=()),
}


def cpu_flags() -> frozenset[str]:
    override = os.environ.get("PAGEDSERVE_CPU_FLAGS")
    if override is not None:
        return frozenset(override.split())
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def missing_flags(target: Target, flags: frozenset[str] | None = None) -> list[str]:
    """What this CPU lacks for ``target`` (its architecture, or CPU flags); [] if it can run it."""
    if target.machines and platform.machine().lower() not in target.machines:
        return [f"an x86-64 CPU (this is {platform.machine()})"]
    flags = cpu_flags() if flags is None else flags
    return [f for f in target.cpu_flags if f not in flags]


def executable_targets() -> list[str]:
    """The targets this CPU can execute, best first."""
    return [name for name, t in TARGETS.items() if not missing_flags(t)]


# The targets whose INT4 layers run their own kernels (csrc/int4_<target>.h), whose tiles keep a
# group's zero points in one byte each; the portable target and eager use PyTorch's kernel, whose
# layout keeps them in bf16.
OWN_INT4_TARGETS = ("avx512", "avx2")


def int4_zero_point_bytes(kernels: str = "auto") -> int:
    """The bytes a row's zero point takes per INT4 group in what the CPU kernels ``kernels`` pack
    (``auto``: the best target this CPU executes; a target whose build fails falls back further
    when ``serve`` starts, which this cannot know): 1 in the avx512 and avx2 tiles, 2 in PyTorch's
    layout."""
    name = (executable_targets() or ["eager"])[0] if kernels == "auto" else kernels
    return 1 if name in OWN_INT4_TARGETS else 2
