"""Shared fixtures: a tiny GLM-4 model directory and a live pagedserve server on 127.0.0.1."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pytest
from hypothesis import Phase, settings

# the benchmarks' server starter (benchmarks/reliability/server.py) starts the suite's servers too
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "reliability"))
from server import free_port, serve  # noqa: E402

API_KEY = "test-key"

# Property tests draw the same examples on every run (derandomize), so a failure is not luck and
# reruns the same; a failing example is printed with @reproduce_failure(...) to paste back.
# HYPOTHESIS_PROFILE=explore draws new examples each run, to search further.
settings.register_profile(
    "pagedserve", derandomize=True, print_blob=True, deadline=None, database=None
)
settings.register_profile("explore", print_blob=True, deadline=None)
# tools/mutation.py: a failing example needs no shrinking there, only the failure
settings.register_profile(
    "mutation",
    derandomize=True,
    deadline=None,
    database=None,
    phases=(Phase.explicit, Phase.reuse, Phase.generate),
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "pagedserve"))


def serve_subprocess(
    *flags: str, port: int | None = None, log: IO | None = None, timeout: float = 600
):
    """`pagedserve serve FLAGS` on 127.0.0.1 in a child process, once /health answers 200;
    terminated (then killed) on exit. Output is dropped unless ``log`` takes it; the log level is
    the server's default unless FLAGS set one. The benchmarks start their servers the same way."""
    return serve(*flags, port=port, log=log or subprocess.DEVNULL, log_level=None, timeout=timeout)


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
def live_server(tiny_glm4):
    """One uvicorn server (in a thread) over the tiny model, shared by the server/SDK/smi tests."""
    import uvicorn

    from pagedserve.config import EngineConfig
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.server.app import build_app

    model_dir, _ = tiny_glm4
    engine = LLMEngine(
        EngineConfig.from_kwargs(
            model=str(model_dir),
            dtype="float32",
            num_kv_pages=256,
            block_size=16,
            max_model_len=256,
            max_num_seqs=16,
            device="cpu",
        )
    )
    app = build_app(engine, "tiny", api_key=API_KEY, max_queue_len=64)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:  # however long a loaded machine takes; pytest-timeout bounds it
        assert thread.is_alive(), "server did not start"
        time.sleep(0.02)
    yield LiveServer(f"http://127.0.0.1:{port}", API_KEY, "tiny", app)
    server.should_exit = True
    thread.join(10)


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
