"""Tests that need a tool outside Python's test extras (a browser, SGLang's frontend, zsh, a C++
compiler): where it is missing they skip, saying why and how to install it, except in CI
(``CI=true``, as ``.ci/run`` sets and CI services do), where a missing tool fails the test: CI
installs every tool, so one missing is a broken CI, not a test to leave out."""

from __future__ import annotations

import fcntl
import importlib
import os
import shutil
from types import ModuleType

import pytest

from tests.helpers.sglang_venv import cache_root


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1")


def missing_tool(why: str) -> None:
    """Skip the test (fail it in CI), saying ``why``: what is missing and how to install it."""
    if in_ci():
        pytest.fail(f"{why} (CI=true: CI installs every tool the tests need, so this fails)")
    pytest.skip(why, allow_module_level=True)


def require_module(name: str, why: str) -> ModuleType:
    """``pytest.importorskip``, failing in CI."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        missing_tool(f"{why} ({e})")
        raise  # not reached: missing_tool raises


def which(command: str) -> str | None:
    """``shutil.which``, once ``.ci/run``'s apt step (which runs beside the suite, holding
    ``ci-installs.lock`` in the cache) has ended."""
    lock = cache_root() / "ci-installs.lock"
    if lock.exists():
        with open(lock) as f:
            fcntl.flock(f, fcntl.LOCK_SH)
    return shutil.which(command)
