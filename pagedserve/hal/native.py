"""The native CPU kernels (``csrc/``): one library per instruction-set target, built once per
machine and cached on disk.

Targets, best first (``csrc/vec/<target>.h``):

- ``avx512``: AVX-512 F/BW/CD/DQ/VL with BF16 and VNNI (Zen 4 and 5, Sapphire Rapids, Cooper
  Lake);
- ``avx2``: AVX2 with FMA and F16C, the x86-64-v3 level (Zen 1-3, Haswell and later), with
  AVX-VNNI's dot products where the CPU has them;
- ``portable``: plain C++ for any CPU (ARM included); its INT4 layers use PyTorch's kernel.

``choose_kernels("auto")`` takes the best target this CPU can execute and says, once, why a better
one was not taken; ``--kernels NAME`` asks for one (``eager``: no native kernels at all). A target
is built only on a CPU that can run it, with that target's flags alone (never ``-march=native``),
so a cache directory shared by several machines (a container moved to another host) never hands a
CPU code it cannot execute: the flags are checked again at every load. The first build of a
target takes a minute or two on 2 cores (avx2 74 s, portable 95 s on a Zen 3: its translation
units compiled at once), into ``$PAGEDSERVE_CACHE_DIR`` (default ``~/.cache/pagedserve``); later
starts load the cached library in well under a second.
``$PAGEDSERVE_CPU_FLAGS`` replaces the CPU flags read from ``/proc/cpuinfo`` (for tests).
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

from pagedserve.config import KERNEL_CHOICES
from pagedserve.hal.cpu_targets import (
    AMX_FLAGS,
    TARGETS,
    Target,
    cpu_flags,
    executable_targets,
    missing_flags,
)

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
# One library of several translation units, which ninja compiles at once on as many cores: the
# binding (bindings.cpp, with the ops that build quickly), the INT4 GEMMs (int4.cpp) and the paged
# attention ops (attention.cpp), each over the headers beside it.
SOURCES = (CSRC / "bindings.cpp", CSRC / "int4.cpp", CSRC / "attention.cpp")


@dataclass(frozen=True)
class KernelChoice:
    """The kernels a CPU backend runs: a target's library, or None (eager PyTorch)."""

    name: str  # avx512, avx2, portable or eager
    module: ModuleType | None
    reason: str = ""  # why a better target was not taken ("" when none was passed over)


def target_cflags(target: Target) -> list[str]:
    extra = ["-mavxvnni"] if target.name == "avx2" and "avx_vnni" in cpu_flags() else []
    return [
        "-O3", "-fopenmp", "-fvisibility=hidden", f"-DPAGEDSERVE_TARGET={target.macro}",
        *target.cflags, *extra,
    ]  # fmt: skip


def cache_dir() -> Path:
    root = os.environ.get("PAGEDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pagedserve"
    return Path(root) / "kernels"


def build_key(target: Target) -> str:
    """Source (and where it is installed), torch version, the target's flags and the machine
    architecture: a change of any of them means a new build directory. Two installs never share
    one: torch rebuilds in place when the source path changes, and the two would keep rebuilding
    each other's library."""
    h = hashlib.sha256(str(CSRC.resolve()).encode())
    for path in sorted(CSRC.rglob("*")):
        if path.is_file():
            h.update(str(path.relative_to(CSRC)).encode() + path.read_bytes())
    h.update(f"{torch.__version__} {target_cflags(target)} {platform.machine()}".encode())
    return f"{target.name}-{h.hexdigest()[:16]}"


def _missing_tool() -> str | None:
    absent = [str(source) for source in SOURCES if not source.is_file()]
    if absent:
        return f"{' '.join(absent)} not installed"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} is not on PATH)"
    if shutil.which("ninja") is None:
        return "ninja is not installed"
    return None


@contextmanager
def _exclusive(build_dir: Path) -> Iterator[None]:
    """One process builds or loads at a time, under an flock that the kernel drops if its holder
    dies. torch's own build lock is a plain file: a build killed half way (a server stopped during
    its first start) leaves it behind and every later start would wait on it forever. Holding the
    flock, no live builder owns that file, so it is stale and goes."""
    with open(build_dir / "pagedserve.flock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            logger.warning("removing a stale build lock left by an interrupted build: %s", stale)
            stale.unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class KernelBuildError(RuntimeError):
    """A target's kernels could not be had here (no compiler, a failed build)."""


def build_library(
    name: str, sources: Sequence[Path], cflags: list[str], build_dir: Path
) -> ModuleType:
    """The Python module ``name`` compiled from ``sources`` with ``cflags`` (and OpenMP) in
    ``build_dir``, or loaded from there where it is built; one process at a time (_exclusive)."""
    from torch.utils import cpp_extension

    build_dir.mkdir(parents=True, exist_ok=True)
    with _exclusive(build_dir):
        return cpp_extension.load(
            name=name,
            sources=[str(source) for source in sources],
            extra_cflags=cflags,
            extra_ldflags=["-fopenmp"],
            build_directory=str(build_dir),
            verbose=False,
        )


@cache
def load_target(name: str) -> ModuleType:
    """The compiled kernels of target ``name``, built on first use; raises if this CPU cannot
    execute them or they cannot be built."""
    target = TARGETS[name]
    missing = missing_flags(target)
    if missing:
        raise KernelBuildError(
            f"this CPU cannot run the {name} kernels: it lacks {' '.join(missing)}"
        )
    tool = _missing_tool()
    if tool:
        raise KernelBuildError(tool)
    build_dir = cache_dir() / build_key(target)
    build_dir.mkdir(parents=True, exist_ok=True)
    fresh = not any(build_dir.glob("*.so"))
    if fresh:
        logger.info(
            "building the %s CPU kernels for this machine (once; a minute or two) ...", name
        )
    start = time.monotonic()
    try:
        module = build_library(
            f"pagedserve_kernels_{name}", SOURCES, target_cflags(target), build_dir
        )
    except (OSError, RuntimeError, ImportError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise KernelBuildError(f"building the {name} kernels failed: {first_line}") from e
    if fresh:
        logger.info(
            "%s CPU kernels built in %.0f s (cached in %s)",
            name,
            time.monotonic() - start,
            build_dir,
        )
    if hasattr(module, "amx_enable"):
        module.amx_enable(AMX_FLAGS <= cpu_flags())
    return module


def uses_amx(module: ModuleType | None) -> bool:
    """Whether a loaded target runs its few-rows bf16 GEMV on the AMX tile unit (csrc/amx.h):
    avx512 on a CPU whose flags name AMX, where Linux granted the tile state."""
    return module is not None and hasattr(module, "amx_enabled") and module.amx_enabled()


def choose_kernels(kernels: str = "auto") -> KernelChoice:
    """The kernels for ``--kernels``: ``auto`` takes the best target this CPU executes (falling
    back, with one warning, to the next where a build fails, and to eager PyTorch at the end);
    a named target the CPU cannot execute is an error naming the missing flags."""
    if kernels not in KERNEL_CHOICES:
        raise ValueError(f"--kernels {kernels!r}: choose one of {', '.join(KERNEL_CHOICES)}")
    if kernels == "eager":
        return KernelChoice("eager", None)
    if kernels != "auto":
        missing = missing_flags(TARGETS[kernels])
        if missing:
            raise ValueError(
                f"--kernels {kernels}: this CPU cannot execute them (it lacks {' '.join(missing)}); "
                f"it can run {', '.join(executable_targets())}; use --kernels auto"
            )
        return KernelChoice(kernels, load_target(kernels))
    return _choose_auto()


@cache
def _choose_auto() -> KernelChoice:
    passed_over = []
    for name, target in TARGETS.items():
        missing = missing_flags(target)
        if missing:
            passed_over.append(f"{name}: this CPU lacks {' '.join(missing)}")
            continue
        try:
            module = load_target(name)
        except KernelBuildError as e:
            passed_over.append(f"{name}: {e}")
            continue
        return _announce(KernelChoice(name, module, "; ".join(passed_over)))
    return _announce(KernelChoice("eager", None, "; ".join(passed_over)))


def _announce(choice: KernelChoice) -> KernelChoice:
    if choice.name == "eager":
        logger.warning(
            "native CPU kernels unavailable (%s); running eager PyTorch kernels, which are several "
            "times slower at small batches. Install a C++ compiler (g++) and ninja to enable them.",
            choice.reason,
        )
    else:
        amx = (
            " with AMX tiles for few-row layers and decode attention"
            if uses_amx(choice.module)
            else ""
        )
        passed_over = f" (not {choice.reason})" if choice.reason else ""
        logger.info("CPU kernels: %s%s%s", choice.name, amx, passed_over)
    return choice
