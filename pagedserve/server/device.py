"""The operator's routes under ``/device`` (behind the API key): what ``pagedserve smi`` and the
web console show, the weight tier's scrub on demand, the KV pool's consistency check, and fault
injection when the server allows it.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter

from pagedserve.engine.async_engine import EngineDeadError
from pagedserve.server.errors import APIError, bad_request
from pagedserve.server.protocol import FaultRequest
from pagedserve.server.serving import OpenAIServing


def device_router(serving: OpenAIServing, enable_fault_injection: bool) -> APIRouter:
    """The operator's routes under /device (behind the API key): the weight tier's scrub on
    demand, the KV pool's consistency check, and fault injection when the server allows it."""

    async def call(name: str, *args: Any) -> Any:
        try:
            return await serving.engine.call_utility(name, *args)
        except EngineDeadError as e:
            raise APIError(503, str(e), code="engine_dead") from e

    async def scrub() -> dict:
        """Verify every weight page's checksum now; corrupted pages are restored."""
        return await call("scrub_weights")

    async def invariants() -> dict:
        """The KV pool's own consistency check (``problems`` empty when all is well) and what
        is in flight: after a soak, nothing running, nothing waiting, no page in use."""
        return await call("check_invariants")

    async def inject_fault(body: FaultRequest) -> dict:
        """Inject a device fault (kunlun-emu, with --enable-fault-injection)."""
        if not enable_fault_injection:
            raise APIError(
                403,
                "fault injection is off: start the server with --enable-fault-injection",
                code="fault_injection_disabled",
            )
        try:
            return await call("inject_fault", body.kind, body.tag, body.page)
        except RuntimeError as e:  # the engine's ValueError: no such page or tag, not kunlun-emu
            raise bad_request(str(e)) from e

    async def device() -> dict | list[dict]:
        try:
            stats = await serving.engine.get_device_stats()
        except EngineDeadError as e:
            raise APIError(503, str(e), code="engine_dead") from e
        shared = {
            "model": serving.model_name,
            "tokens_per_second": serving.engine.tokens_per_second(),
            "tokens_per_second_history": serving.engine.token_rate_history.per_second(
                time.monotonic()
            ),
        }
        if isinstance(stats, list):  # one record per tensor-parallel card
            return [{**card, **shared} for card in stats]
        return {**stats, **shared}

    async def device_pages() -> dict:
        """The KV page pool frame by frame: a digit per page (the console's page map)."""
        try:
            return await serving.engine.get_page_map()
        except EngineDeadError as e:
            raise APIError(503, str(e), code="engine_dead") from e

    router = APIRouter()  # plain functions registered: a decorated one is out of mutmut's reach
    router.add_api_route("/device/scrub", scrub, methods=["POST"])
    router.add_api_route("/device/invariants", invariants, methods=["GET"])
    router.add_api_route("/device/faults", inject_fault, methods=["POST"])
    router.add_api_route("/device", device, methods=["GET"])
    router.add_api_route("/device/pages", device_pages, methods=["GET"])
    return router
