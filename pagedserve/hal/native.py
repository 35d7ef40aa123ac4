"""The native CPU kernels (``csrc/cpu_kernels.cpp``): built once per machine, cached on disk.

The first start on a machine compiles them with the C++ compiler PyTorch's extensions use (about 30 s
on 2 cores) into ``$PAGEDSERVE_CACHE_DIR`` (default ``~/.cache/pagedserve``); later starts load the
cached library in well under a second. Where they cannot be built (no compiler, no AVX-512
BF16 and VNNI) the
CPU backends run eager PyTorch and say so once; ``--enforce-eager`` asks for eager explicitly.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCE = CSRC / "cpu_kernels.cpp"  # includes the headers beside it
CFLAGS = ["-O3", "-march=native", "-fopenmp"]  # built on the machine it runs on


def cache_dir() -> Path:
    root = os.environ.get("PAGEDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pagedserve"
    return Path(root) / "kernels"


def _build_key() -> str:
    """Source (and where it is installed), torch version, flags and CPU: a change of any of them
    means a new build directory. Two installs never share one: torch rebuilds in place when the
    source path changes, and the two would keep rebuilding each other's library."""
    h = hashlib.sha256(str(CSRC.resolve()).encode())
    for path in sorted(CSRC.iterdir()):
        h.update(path.name.encode() + path.read_bytes())
    h.update(f"{torch.__version__} {CFLAGS} {platform.machine()} {_cpu_flags()}".encode())
    return h.hexdigest()[:16]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _missing_tool() -> str | None:
    if not SOURCE.is_file():
        return f"{SOURCE} is not installed"
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return f"no C++ compiler ({compiler!r} is not on PATH)"
    if shutil.which("ninja") is None:
        return "ninja is not installed"
    return None


def _warn_eager(reason: str) -> None:
    logger.warning(
        "native CPU kernels unavailable (%s); running eager PyTorch kernels, which are several "
        "times slower at small batches. Install a C++ compiler (g++) and ninja to enable them.",
        reason,
    )


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


@cache
def load_native_kernels() -> ModuleType | None:
    """The compiled kernels, or None (with one warning saying why) where they cannot be had."""
    from torch.utils import cpp_extension

    missing = _missing_tool()
    if missing:
        _warn_eager(missing)
        return None
    build_dir = cache_dir() / _build_key()
    build_dir.mkdir(parents=True, exist_ok=True)
    fresh = not any(build_dir.glob("*.so"))
    if fresh:
        logger.info("building the native CPU kernels for this machine (once; about 30 s) ...")
    start = time.monotonic()
    try:
        with _exclusive(build_dir):
            module = cpp_extension.load(
                name="pagedserve_cpu_kernels",
                sources=[str(SOURCE)],
                extra_cflags=CFLAGS,
                extra_ldflags=["-fopenmp"],
                build_directory=str(build_dir),
                verbose=False,
            )
    except (OSError, RuntimeError, ImportError, FileNotFoundError) as e:
        _warn_eager(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
        return None
    if not module.available:
        logger.warning(
            "this CPU lacks AVX-512 BF16 and VNNI, which the native kernels need; running eager "
            "PyTorch"
        )
        return None
    if fresh:
        logger.info(
            "native CPU kernels built in %.0f s (cached in %s)", time.monotonic() - start, build_dir
        )
    return module
