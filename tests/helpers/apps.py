"""The server's app in this process, without a socket: ``build_app`` over the demo model's engine,
driven by FastAPI's TestClient (the in-process tests of tests/server/, fast enough for mutation
testing)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

KEY = "app-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMITS = dict(max_model_len=64, max_num_seqs=4, num_kv_pages=32, block_size=16)


def demo_engine(**limits):
    """An ``LLMEngine`` over the demo model with small limits (64 tokens of context, unless
    ``limits`` say otherwise)."""
    from pagedserve.config import EngineConfig
    from pagedserve.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig.from_kwargs(model="demo", device="cpu", **{**LIMITS, **limits}))


@contextmanager
def served(engine, started: bool = True, **settings) -> Iterator:
    """A TestClient of ``build_app(engine, "demo", api_key=KEY, **settings)``; ``started``
    False: its lifespan never runs, so its engine loop is not running (a dead engine)."""
    from fastapi.testclient import TestClient

    from pagedserve.server.app import build_app

    name = settings.pop("served_model_name", "demo")
    client = TestClient(build_app(engine, name, **{"api_key": KEY, **settings}))
    if not started:
        yield client
        return
    with client:
        yield client
