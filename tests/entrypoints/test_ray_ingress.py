"""The ingress's engine client over a stand-in for Ray Serve's handle (no Ray instance): a replica
whose engine was already dead passes the request on, a replica gone mid-stream is a dead engine
(the server's 503), the replicas' reports become one engine's figures and health, and the
session key reaches the router."""

from __future__ import annotations

import asyncio

import pytest

from tests.helpers.tools import require_module

ray = require_module("ray", "the Ray Serve tests need Ray: pip install 'pagedserve[ray]'")

from pagedserve.engine.output_processor import EngineDeadError  # noqa: E402
from pagedserve.entrypoints.ray_serve import ingress  # noqa: E402
from pagedserve.entrypoints.ray_serve.ingress import ReplicasEngine, sum_stats  # noqa: E402
from pagedserve.entrypoints.ray_serve.replica import ReplicaUnavailableError  # noqa: E402
from pagedserve.sampling_params import SamplingParams  # noqa: E402
from pagedserve.server.serving import SESSION_KEY  # noqa: E402

INFO = {
    "limits": {
        "max_model_len": 64, "vocab_size": 100, "num_kv_pages": 8, "block_size": 16,
        "max_num_seqs": 4, "usage_context": "serve",
    },
    "model": "m", "describe": "m", "tokenizer_dir": None,
}  # fmt: skip


class Stream:
    def __init__(self, items):
        self.items, self.cancelled = list(items), False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self):
        self.cancelled = True


class Handle:
    """``handle.options(stream=True).generate.remote(...)``: each call's stream, in turn."""

    app_name, deployment_name = "app", "engine"

    def __init__(self, *streams):
        self.streams, self.calls = list(streams), []
        self.generate = self

    def options(self, **_):
        return self

    def remote(self, *args, **kwargs):
        self.calls.append((args, kwargs))
        return self.streams.pop(0)


def outputs(engine: ReplicasEngine) -> list:
    async def run():
        return [o async for o in engine.generate("r", [1, 2], SamplingParams(), None)]

    return asyncio.run(run())


def task_error(cause: Exception) -> Exception:
    return ray.exceptions.RayTaskError("generate", "traceback", cause)


def test_a_replica_whose_engine_was_dead_passes_the_request_to_another():
    first = Stream([task_error(ReplicaUnavailableError("a", "the engine loop is not running"))])
    second = Stream(["out-1", "out-2"])
    handle = Handle(first, second)
    assert outputs(ReplicasEngine(handle, INFO)) == ["out-1", "out-2"]
    assert [kwargs["exclude"] for _, kwargs in handle.calls] == [(), ("a",)]


def test_after_three_refusals_the_request_fails_as_a_dead_engine():
    refusals = [Stream([task_error(ReplicaUnavailableError(r, "dead"))]) for r in "abc"]
    with pytest.raises(EngineDeadError, match="replica c: dead"):
        outputs(ReplicasEngine(Handle(*refusals), INFO))


def test_a_replica_gone_mid_stream_is_a_dead_engine_and_an_error_raised_there_is_its_own():
    gone = Stream(["out-1", ray.exceptions.RayActorError()])
    with pytest.raises(EngineDeadError, match="the replica serving this request is gone"):
        outputs(ReplicasEngine(Handle(gone), INFO))
    dead = Stream([task_error(EngineDeadError("the engine core process exited with code -9"))])
    with pytest.raises(EngineDeadError, match="exited with code -9"):
        outputs(ReplicasEngine(Handle(dead), INFO))
    refused = Stream([task_error(ValueError("prompt too long"))])
    with pytest.raises(ValueError, match="prompt too long"):
        outputs(ReplicasEngine(Handle(refused), INFO))


def test_the_session_key_of_the_request_goes_with_each_call():
    handle = Handle(Stream(["out"]))
    engine = ReplicasEngine(handle, INFO)
    token = SESSION_KEY.set("alice")
    try:
        stream = engine.generate("r", [1], SamplingParams())
    finally:
        SESSION_KEY.reset(token)

    async def drain():
        return [o async for o in stream]

    assert asyncio.run(drain()) == ["out"]
    assert handle.calls[0][1]["session"] == "alice"


def test_the_replicas_figures_are_summed_and_their_shares_averaged():
    a = {"num_requests_running": 2, "kv_cache_usage_perc": 0.5, "device_faults_total": {"step": 1},
         "spec_decode_num_accepted_tokens_per_pos": [3, 1]}  # fmt: skip
    b = {"num_requests_running": 1, "kv_cache_usage_perc": 0.25, "device_faults_total": {"kv_page": 2},
         "spec_decode_num_accepted_tokens_per_pos": [1]}  # fmt: skip
    assert sum_stats([a, b]) == {
        "num_requests_running": 3,
        "kv_cache_usage_perc": 0.375,
        "device_faults_total": {"step": 1, "kv_page": 2},
        "spec_decode_num_accepted_tokens_per_pos": [4, 1],
    }


class Router:
    def __init__(self, reports):
        self.reports = reports

    def replica_reports(self):
        return self.reports


def report(replica: str, alive: bool, waiting: int) -> dict:
    health = {"engine": "alive" if alive else "dead", "pid": 7, "num_requests_running": 1,
              "num_requests_waiting": waiting}  # fmt: skip
    return {"replica": replica, "node_id": "n", "num_routed": 3, "engine_alive": alive,
            "health": health, "stats": {"generation_tokens_total": 5}}  # fmt: skip


def test_health_lists_the_replicas_and_the_engine_lives_while_one_does(monkeypatch):
    engine = ReplicasEngine(Handle(), INFO)
    router = Router([report("a", True, 2), report("b", False, 3)])
    monkeypatch.setitem(ingress.ROUTERS, ("app", "engine"), router)
    health = engine.health()
    assert (health["engine"], health["num_replicas"], health["num_requests_waiting"]) == (
        "alive",
        2,
        5,
    )
    assert [r["engine"] for r in health["replicas"]] == ["alive", "dead"]
    assert engine.stats["generation_tokens_total"] == 10
    engine.max_queue_len = 5
    assert engine.queue_full()  # 5 waiting, one live replica's bound
    router.reports = [report("a", False, 0), report("b", False, 0)]
    engine.refresh()  # as the ingress does every second
    assert not engine.is_alive and "no replica's engine core is running" in engine.dead_error
