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
    router = APIRouter()

    async def call(name: str, *args: Any) -> Any:
        try:
            return await serving.engine.call_utility(name, *args)
        except EngineDeadError as e:
            raise APIError(503, str(e), code="engine_dead") from e

    @router.post("/device/scrub")
    async def scrub() -> dict:
        """Verify every weight page's checksum now; corrupted pages are restored."""
        return await call("scrub_weights")

    @router.get("/device/invariants")
    async def invariants() -> dict:
        """The KV pool's own consistency check (``problems`` empty when all is well) and what
        is in flight: after a soak, nothing running, nothing waiting, no page in use."""
        return await call("check_invariants")

    @router.post("/device/faults")
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

    @router.get("/device")
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

    @router.get("/device/pages")
    async def device_pages() -> dict:
        """The KV page pool frame by frame: a digit per page (the console's page map)."""
        try:
            return await serving.engine.get_page_map()
        except EngineDeadError as e:
            raise APIError(503, str(e), code="engine_dead") from e

    return router
