"""The OpenAI-compatible ingress over the engine replicas: ``pagedserve serve``'s own app
(``server.app.build_app``: the same routes, errors, streaming, tools and auth) over
``ReplicasEngine``, an ``EngineClient`` whose requests go through a Ray Serve handle to the
replica the router picks.

The ingress tokenizes, renders chat templates and parses tool calls, as the single server's HTTP
process does; each replica's engine client detokenizes and applies stop strings, and streams
``RequestOutput``s back. ``/health`` and ``/metrics`` sum what the replicas report every second
(``EngineReplica.record_routing_stats``); ``/health`` lists each replica.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import ray.exceptions
from ray import serve
from ray.serve.handle import DeploymentHandle

from pagedserve.engine.async_engine import TokenRateHistory
from pagedserve.engine.limits import EngineLimits
from pagedserve.engine.output_processor import EngineDeadError, EngineStepError
from pagedserve.engine.protocol import EngineClient
from pagedserve.entrypoints.ray_serve.replica import ReplicaUnavailableError
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.server.serving import SESSION_KEY

logger = logging.getLogger("pagedserve.ray_serve")

# (application, deployment) -> the router of its handle in this process (router.EngineRouter
# adds itself: Ray Serve ships a router class by value, with a copy of its module's globals)
ROUTERS: dict[tuple[str, str], Any] = {}
MAX_ATTEMPTS = 3  # replicas a request is offered to while each says its engine is dead
WATCH_PERIOD_S = 1.0
# figures that are a share or a rate: the replicas' mean, not their sum
MEAN_STATS = ("kv_cache_usage_perc", "host_kv_cache_usage_perc", "spec_decode_draft_acceptance_rate",
              "spec_decode_mean_acceptance_length")  # fmt: skip


class ReplicasEngine(EngineClient):
    """The engine surface the server reads, over the engine deployment's replicas."""

    def __init__(self, handle: DeploymentHandle, info: dict[str, Any], tokenizer: Any = None):
        self.handle = handle
        self.limits = EngineLimits.from_dict(info["limits"])
        self.model = info["model"]
        self.description = info["describe"]
        # every replica loads the same --lora-modules (run-time loads are one engine's: refused)
        self.lora_enabled = info.get("lora_enabled", False)
        self.lora_adapters = {a["name"]: a for a in info.get("lora_adapters", [])}
        if tokenizer is None and info["tokenizer_dir"]:
            from pagedserve.models.tokenizer import Tokenizer

            tokenizer = Tokenizer(Path(info["tokenizer_dir"]))
        self.tokenizer = tokenizer
        self.max_queue_len: int | None = None
        self.draining = False
        self.stats: dict[str, Any] = {}
        self.reports: list[dict[str, Any]] = []
        self.token_rate_history = TokenRateHistory()
        self._num_streams = 0
        self._watch_task: asyncio.Task | None = None

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        if self._watch_task is None:
            self._watch_task = asyncio.get_running_loop().create_task(self._watch())

    def shutdown(self) -> None:
        if self._watch_task is not None:
            self._watch_task.cancel()

    async def _watch(self) -> None:
        while True:
            try:
                self.refresh()
            except Exception:  # noqa: BLE001 - logged; the next period tries again
                logger.exception("reading the replicas' reports failed")
            await asyncio.sleep(WATCH_PERIOD_S)

    def refresh(self) -> None:
        """Read the replicas' last reports (the router keeps them)."""
        router = self._router()
        if router is None:
            return
        self.reports = router.replica_reports()
        self.stats = sum_stats([r.get("stats", {}) for r in self.reports])
        self.token_rate_history.record(
            time.monotonic(), self.stats.get("generation_tokens_total", 0)
        )

    # ---- state ----------------------------------------------------------------------------------
    @property
    def alive_reports(self) -> list[dict[str, Any]]:
        return [r for r in self.reports if r.get("engine_alive", True)]

    @property
    def is_alive(self) -> bool:
        """While any replica's engine core runs (or none has reported yet)."""
        return not self.reports or bool(self.alive_reports)

    @property
    def dead_error(self) -> str | None:
        if self.is_alive:
            return None
        return "no replica's engine core is running; Ray Serve is restarting them"

    def health(self) -> dict[str, Any]:
        self.refresh()
        replicas = [
            {
                "replica": r["replica"],
                "node_id": r["node_id"],
                "engine": r.get("health", {}).get("engine", "starting"),
                "pid": r.get("health", {}).get("pid"),
                "num_requests_running": r.get("health", {}).get("num_requests_running", 0),
                "num_requests_waiting": r.get("health", {}).get("num_requests_waiting", 0),
                "num_routed": r["num_routed"],
            }
            for r in self.reports
        ]
        return {
            "engine": "alive" if self.is_alive else "dead",
            "num_replicas": len(replicas),
            "num_requests_running": sum(r["num_requests_running"] for r in replicas),
            "num_requests_waiting": self.num_waiting,
            "replicas": replicas,
        }

    @property
    def num_waiting(self) -> int:
        return sum(r.get("health", {}).get("num_requests_waiting", 0) for r in self.reports)

    @property
    def num_unfinished(self) -> int:
        return self._num_streams

    def queue_full(self) -> bool:
        """``--max-queue-len`` is each replica's: the bound is that times the live replicas."""
        if self.max_queue_len is None:
            return False
        return self.num_waiting >= self.max_queue_len * max(len(self.alive_reports), 1)

    def tokens_per_second(self) -> float:
        return sum(r.get("tokens_per_second", 0.0) for r in self.alive_reports)

    # ---- requests -----------------------------------------------------------------------------
    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        lora_name: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        session = SESSION_KEY.get()
        return self._generate(request_id, prompt_token_ids, params, prompt, session, lora_name)

    async def _generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None,
        session: str | None,
        lora_name: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        exclude: list[str] = []
        self._num_streams += 1
        try:
            while True:
                stream = _as_own_request(
                    self.handle.options(stream=True).generate.remote,
                    request_id, prompt_token_ids, params, prompt, session=session,
                    exclude=tuple(exclude), lora_name=lora_name,
                )  # fmt: skip
                try:
                    first = True
                    async for output in _replica_errors(stream):
                        if first:  # its prefill is done: the router counts it no more
                            self._prefilled(request_id)
                            first = False
                        yield output
                    return
                except ReplicaUnavailableError as e:  # nothing computed: another replica
                    exclude.append(e.replica)
                    if len(exclude) >= MAX_ATTEMPTS:
                        raise
                    logger.warning("%s; sending %s to another replica", e, request_id)
                finally:
                    stream.cancel()  # a consumer gone mid-stream: the replica aborts it
        finally:
            self._num_streams -= 1

    def _prefilled(self, request_id: str) -> None:
        router = self._router()
        if router is not None:
            router.prefilled(request_id)

    def _router(self):
        """The router of this handle's calls, in this process (None until the first call)."""
        return ROUTERS.get((self.handle.app_name, self.handle.deployment_name))

    async def call_utility(self, name: str, *args: Any) -> Any:
        """On the replica the router picks (the least loaded)."""
        try:
            return await self.handle.call_utility.remote(name, *args)
        except Exception as e:  # noqa: BLE001 - mapped to what the server expects of an engine
            raise _engine_error(e) from e


def _as_own_request(remote, *args: Any, **kwargs: Any):
    """``remote(*args, **kwargs)`` outside the HTTP request's context. Ray Serve gives every
    handle call made while serving one HTTP request that request's internal id, and a router
    that matches calls to their routing by that id (all but FIFO ones) routes concurrent calls
    of one id one at a time at best: a completion of several prompts would wait forever. Each
    engine call goes out as a request of its own."""
    return contextvars.Context().run(remote, *args, **kwargs)


async def _replica_errors(stream) -> AsyncIterator[RequestOutput]:
    """The stream's outputs, its errors as an engine's: the replica's own exception, or
    ``EngineDeadError`` when the replica itself is gone."""
    try:
        async for output in stream:
            yield output
    except Exception as e:  # noqa: BLE001 - each mapped
        raise _engine_error(e) from e


def _engine_error(e: Exception) -> Exception:
    if isinstance(e, ray.exceptions.RayTaskError):
        cause = e.cause
        if isinstance(cause, (EngineDeadError, EngineStepError, ValueError, RuntimeError)):
            return cause
        return EngineStepError(f"the replica failed: {cause!r}")
    if isinstance(e, ray.exceptions.RayActorError):
        return EngineDeadError(f"the replica serving this request is gone: {e}")
    return e


def sum_stats(per_replica: list[dict[str, Any]]) -> dict[str, Any]:
    """The replicas' figures as one engine's: counts summed, shares and rates averaged."""
    total: dict[str, Any] = {}
    for stats in per_replica:
        for key, value in stats.items():
            if isinstance(value, bool) or value is None:
                continue
            if isinstance(value, (int, float)):
                total[key] = total.get(key, 0) + value
            elif isinstance(value, dict):
                total[key] = Counter(total.get(key, {})) + Counter(value)
            elif isinstance(value, (list, tuple)):  # per position: summed position by position
                mine = total.get(key, [])
                total[key] = [
                    (mine[i] if i < len(mine) else 0) + (value[i] if i < len(value) else 0)
                    for i in range(max(len(mine), len(value)))
                ]
    for key in MEAN_STATS:
        if key in total and per_replica:
            total[key] /= sum(1 for s in per_replica if key in s)
    return {k: dict(v) if isinstance(v, Counter) else v for k, v in total.items()}


@serve.ingress()
class OpenAIIngress:
    """The ingress deployment's class: ``build_app`` over ``ReplicasEngine``."""

    def __init__(self, engine: DeploymentHandle, app_settings: dict[str, Any]):
        self.engine_handle = engine
        self.app_settings = app_settings
        self.engine: ReplicasEngine | None = None

    async def __serve_build_asgi_app__(self):
        from pagedserve.server.app import build_app
        from pagedserve.server.tool_parsers import ToolParserManager

        settings = dict(self.app_settings)
        plugin = settings.pop("tool_parser_plugin", None)
        if plugin:
            ToolParserManager.import_tool_parser(plugin)
        info = await self.engine_handle.info.remote()
        self.engine = ReplicasEngine(self.engine_handle, info)
        return build_app(self.engine, **settings)

    async def drain(self) -> int:
        """Admit nothing new (503, as the single server on SIGTERM); the requests in flight."""
        self.engine.draining = True
        return self.engine.num_unfinished

    async def num_unfinished(self) -> int:
        return self.engine.num_unfinished
