"""One data-parallel replica: a whole engine (its engine core process and KV pool) in a Ray Serve
replica, streaming each request's outputs (``RequestOutput``: detokenized, stop strings applied)
to the ingress.

Ray Serve calls ``check_health`` every few seconds: once the engine core is dead it raises, and
Ray replaces the replica; the requests the replica held have failed at once already (the engine
client fails them all when its core dies), and the router sends no new one to it meanwhile
(``record_routing_stats`` says the core is dead). A replica that Ray stops (scale-down,
redeploy, shutdown) is sent no new requests and keeps serving those it holds for up to the
deployment's ``graceful_shutdown_timeout_s`` (``--shutdown-timeout``); then its engine core is
stopped.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from pagedserve.engine.async_engine import AsyncLLMEngine, EngineDeadError
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger("pagedserve.ray_serve")


class ReplicaUnavailableError(EngineDeadError):
    """The replica's engine core was dead before the request reached it: nothing was computed,
    and the ingress sends the request to another replica."""

    def __init__(self, replica: str, reason: str):
        super().__init__(f"replica {replica}: {reason}")
        self.replica, self.reason = replica, reason

    def __reduce__(self):  # raised in the replica, re-raised in the ingress
        return type(self), (self.replica, self.reason)


class EngineReplica:
    """The engine deployment's class (``serve.deployment`` applies the options)."""

    async def __init__(self, engine_kwargs: dict[str, Any], log_level: str = "info"):
        """Async, so that the engine client reads its core's messages on the event loop that
        serves the requests."""
        from pagedserve.config import EngineConfig

        logging.basicConfig(level=log_level.upper())
        config = EngineConfig.from_kwargs(**engine_kwargs)
        self.engine = AsyncLLMEngine.from_config(config, None, log_level)  # once loaded
        self.engine.start()
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        logger.info("replica %s: engine core pid %s", self.replica_id, self.engine.client.pid)

    async def info(self) -> dict[str, Any]:
        """What the engine says of itself once loaded (limits, model, tokenizer directory)."""
        return {**self.engine.client.info, "replica": self.replica_id}

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        session: str | None = None,
        exclude: tuple[str, ...] = (),
        lora_name: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs; ``session`` and ``exclude`` are for the router; ``lora_name``:
        the LoRA adapter it runs with."""
        if not self.engine.is_alive:
            reason = self.engine.dead_error or self.engine.client.exit_reason()
            raise ReplicaUnavailableError(
                self.replica_id, f"the engine loop is not running: {reason}"
            )
        stream = self.engine.generate(request_id, prompt_token_ids, params, prompt, lora_name)
        async for output in stream:
            yield output

    async def call_utility(self, name: str, *args: Any) -> Any:
        """The engine core's ``name(*args)`` between two of its steps (``/device`` and kin)."""
        return await self.engine.call_utility(name, *args)

    def record_routing_stats(self) -> dict[str, Any]:
        """What the router keeps of this replica (every ``request_routing_stats_period_s``)."""
        engine = self.engine
        return {
            "engine_alive": engine.is_alive,
            "health": engine.health(),
            "stats": engine.stats,
            "num_unfinished": engine.num_unfinished,
            "num_kv_pages": engine.limits.num_kv_pages,
            "tokens_per_second": engine.tokens_per_second(),
            "pid": os.getpid(),
        }

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine core died is replaced."""
        if not self.engine.is_alive:
            reason = self.engine.dead_error or self.engine.client.exit_reason()
            raise RuntimeError(f"the engine loop is not running: {reason}")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
