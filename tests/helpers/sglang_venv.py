"""SGLang's own frontend, in a virtual environment of its own, for
tests/server/test_sglang_frontend.py.

SGLang cannot be a test extra: ``pip install sglang`` pulls its own CUDA torch. Its frontend needs
only the package and a few small ones, so they go into a venv that sees the running environment's
packages (torch and transformers stay as they are; ``tests/helpers/venvs.py`` says how), cached
under ``~/.cache/pagedserve`` (``$PAGEDSERVE_CACHE_DIR``) so that a second run costs nothing:

    python3 -m tests.helpers.sglang_venv     # prints the venv's python

``.ci/run`` builds it beside the suite (the build mostly waits on the network and the disk) and
the test waits for that build to end. Only the stdlib is used: the build starts before the test
extras are installed, so it imports nothing from the environment it inherits.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from tests.helpers.venvs import make_inheriting_venv

SGLANG = "sglang==0.5.23"  # installed with --no-deps: its own requirements are CUDA's
# what `import sglang` and its RuntimeEndpoint import (triton: sglang/srt/utils/common.py)
FRONTEND_DEPS = [
    "psutil", "pybase64", "msgspec", "aiohttp", "requests", "triton", "orjson", "pillow",
    "ipython", "pyzmq",
]  # fmt: skip


def cache_root() -> Path:
    """Where pagedserve caches what it builds (the native kernels' rule)."""
    return Path(os.environ.get("PAGEDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pagedserve")


def venv_dir() -> Path:
    """One venv per recipe and per environment it inherits from."""
    key = "\n".join([SGLANG, *FRONTEND_DEPS, sys.prefix, sys.version])
    return cache_root() / f"sglang-venv-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def sglang_python() -> Path:
    """The frontend's python: ``$PAGEDSERVE_SGLANG_PYTHON``, else the cached venv's."""
    named = os.environ.get("PAGEDSERVE_SGLANG_PYTHON")
    return Path(named) if named else venv_dir() / "bin" / "python"


def ensure_venv() -> Path:
    """The cached venv's python, building the venv first where it is missing or unfinished. The
    build holds the venv's lock (``wait_for_venv`` waits on it); its marker file is written last,
    so an interrupted build is built again."""
    venv = venv_dir()
    venv.parent.mkdir(parents=True, exist_ok=True)
    with _lock(venv, fcntl.LOCK_EX):
        if not (venv / "complete").exists():
            _build(venv)
    return venv / "bin" / "python"


def wait_for_venv() -> None:
    """Wait while a build of the cached venv runs (``.ci/run`` builds it beside the suite)."""
    if venv_dir().parent.is_dir():
        with _lock(venv_dir(), fcntl.LOCK_SH):
            pass


@contextlib.contextmanager
def _lock(venv: Path, how: int) -> Iterator[None]:
    with open(venv.with_name(venv.name + ".lock"), "a") as f:
        fcntl.flock(f, how)
        yield


def _build(venv: Path) -> None:
    shutil.rmtree(venv, ignore_errors=True)
    python = make_inheriting_venv(venv)
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-compile"]
    subprocess.run([*pip, "--no-deps", SGLANG], check=True)
    subprocess.run([*pip, *FRONTEND_DEPS], check=True)
    (venv / "complete").write_text(SGLANG + "\n")


if __name__ == "__main__":
    print(ensure_venv())
