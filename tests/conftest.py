"""Shared fixtures: a tiny GLM-4 model directory, a live pagedserve server over it on 127.0.0.1,
and one over the demo model."""

from __future__ import annotations

import os
import random
import time
import zlib
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings

from pagedserve.testing import serve_app

API_KEY = "test-key"

# One intra-op thread for every process the suite starts (this one, its servers, their engine
# cores and tensor-parallel ranks, the scripts it runs), unless OMP_NUM_THREADS says otherwise.
# The tests' models are tiny, and a test runs a client and a server (or several ranks) at once: on
# a 2-core machine OpenMP's threads then wait on each other, and a tiny model's step takes 127 ms
# instead of 5 (the short soak: 52 s instead of 3). test_native_kernels.py still runs its
# kernels on 2 threads where it asks for them.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Property tests draw the same examples on every run (derandomize), so a failure is not luck and
# reruns the same; a failing example is printed with @reproduce_failure(...) to paste back.
# HYPOTHESIS_PROFILE=explore draws new examples each run, to search further.
settings.register_profile(
    "pagedserve", derandomize=True, print_blob=True, deadline=None, database=None
)
settings.register_profile("explore", print_blob=True, deadline=None)
# tools/mutation.py: a failing example needs no shrinking there, only the failure; and its runs go
# at nice 19 beside the benchmarks, where drawing the examples takes what a loaded core gives:
# Hypothesis's too_slow check times that drawing on the wall clock and fails a test that is fine
settings.register_profile(
    "mutation",
    derandomize=True,
    deadline=None,
    database=None,
    phases=(Phase.explicit, Phase.reuse, Phase.generate),
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "pagedserve"))


@pytest.fixture(autouse=True)
def _seeded_generators(request: pytest.FixtureRequest) -> None:
    """Each test draws the same random numbers (torch's and Python's global generators) on every
    run, whatever order or worker it runs in, as the property tests do: a failure reruns the
    same, and a tolerance is never passed by the luck of what ran before."""
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    random.seed(seed)


_kernel_builds: list = []


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: a worker per core, at most 4. Each holds its files' models and servers (about
    1-2 GB), and the tests' processes are single-threaded, so two cores run two workers."""
    return max(1, min(len(os.sched_getaffinity(0)), 4))


def pytest_sessionstart(session: pytest.Session) -> None:
    """On a run of the whole suite (no paths given), build the native kernels of each target this
    CPU runs that the cache lacks, one process per target, beside the first tests: a target's
    build takes a core for about a minute, and a fresh machine would otherwise build them one
    after the other where tests first need them (they wait on the target's build lock instead)."""
    import subprocess
    import sys

    if session.config.args_source == pytest.Config.ArgsSource.ARGS:
        return
    if os.environ.get("PYTEST_XDIST_WORKER"):  # under -n, the controller starts the builds
        return
    from pagedserve.hal import native

    for name in native.executable_targets():
        if not any((native.cache_dir() / native.build_key(native.TARGETS[name])).glob("*.so")):
            code = f"from pagedserve.hal import native; native.load_target({name!r})"
            # quiet: a build that fails fails again, and says why, in the first test needing it
            _kernel_builds.append(
                subprocess.Popen(
                    [sys.executable, "-c", code],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )


def pytest_sessionfinish(session: pytest.Session) -> None:
    import signal

    for build in _kernel_builds:  # a run that ended before a build did: the next one rebuilds
        if build.poll() is None:
            os.killpg(build.pid, signal.SIGKILL)  # the compiler too
        build.wait()


@pytest.fixture
def short_tmp_path():
    """A new directory right under /tmp, for Unix sockets (a socket's path has at most 107 bytes):
    pytest's own tmp_path, deeper still under pytest-xdist, leaves too few of them."""
    import shutil
    import tempfile
    from pathlib import Path

    path = Path(tempfile.mkdtemp(prefix="ps-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_glm4(tmp_path_factory):
    """(model directory, HF reference model) of a random tiny Glm4ForCausalLM with a tokenizer."""
    import torch

    from tests.helpers.models import build_tiny_model_dir

    torch.set_num_threads(1)
    model_dir = tmp_path_factory.mktemp("tiny-glm4")
    return model_dir, build_tiny_model_dir(model_dir, "glm4")


@dataclass
class LiveServer:
    url: str
    api_key: str
    model: str
    app: Any

    @property
    def serving(self):
        return self.app.state.serving


@pytest.fixture(scope="session")
def live_server_settings(tiny_glm4) -> dict[str, Any]:
    """The engine settings of the live server (tests compare it with an offline engine of the
    same settings)."""
    return dict(
        model=str(tiny_glm4[0]),
        dtype="float32",
        num_kv_pages=256,
        block_size=16,
        max_model_len=256,
        max_num_seqs=16,
        device="cpu",
    )


@pytest.fixture(scope="session")
def live_server(live_server_settings):
    """One uvicorn server (in a thread) over the tiny model, shared by the server/SDK/smi tests."""
    from pagedserve.config import EngineConfig
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.server.app import build_app

    engine = LLMEngine(EngineConfig.from_kwargs(**live_server_settings))
    app = build_app(engine, "tiny", api_key=API_KEY, max_queue_len=64)
    with serve_app(app) as url:
        yield LiveServer(url, API_KEY, "tiny", app)


@pytest.fixture
def slow_steps(live_server, monkeypatch):
    """Engine steps of the live server that last at least 10 ms, for tests where a client leaves
    mid-generation: the tiny model's 200 steps can otherwise end before a loaded machine's HTTP
    thread sees the client go, and the request finishes instead of being aborted."""
    engine = live_server.app.state.serving.llm_engine
    execute_step = engine.execute_step

    def slow_step():
        time.sleep(0.01)
        return execute_step()

    monkeypatch.setattr(engine, "execute_step", slow_step)


@pytest.fixture(scope="session")
def demo_thread_server():
    """(base URL, engine) of the demo model served by uvicorn in a thread, for the frontends'
    tests (pagedserve.lang, SGLang's own): one server for all of them."""
    from pagedserve.config import EngineConfig
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.server.app import build_app

    engine = LLMEngine(EngineConfig.from_kwargs(model="demo", max_num_seqs=16, num_kv_pages=512))
    with serve_app(build_app(engine, "demo")) as url:
        yield url, engine
