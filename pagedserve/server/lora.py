"""vLLM's run-time LoRA routes: ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``.

They change what the server serves, so they answer only where the operator allowed it:
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=true`` (vLLM's variable) or ``--allow-runtime-lora-updating``.
An adapter is read and checked between two engine steps; one that does not fit the base model
is a 400 naming what is wrong. Unloading an adapter that requests still run with is refused
(409, naming them): they keep it until they finish.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from pagedserve.engine.async_engine import EngineDeadError
from pagedserve.server.errors import APIError, bad_request
from pagedserve.server.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from pagedserve.server.serving import OpenAIServing

ALLOW_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_lora_updating_allowed(flag: bool = False) -> bool:
    """The flag, or vLLM's environment variable set to true (or 1)."""
    return flag or os.environ.get(ALLOW_ENV, "").strip().lower() in ("1", "true")


def lora_router(serving: OpenAIServing, allow_updating: bool) -> APIRouter:
    def check_allowed() -> None:
        if not allow_updating:
            raise APIError(
                403,
                f"loading and unloading LoRA adapters at run time is off: start the server with "
                f"{ALLOW_ENV}=true or --allow-runtime-lora-updating",
                code="runtime_lora_updating_disabled",
            )
        if not serving.engine.lora_enabled:
            raise bad_request("LoRA is off: start the server with --enable-lora")

    async def call(method: Callable[..., Awaitable[dict]], *args: Any) -> dict:
        try:
            return await method(*args)
        except EngineDeadError as e:
            raise APIError(503, str(e), code="engine_dead") from e

    async def load(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        """Load a PEFT adapter directory under ``lora_name``; requests then name it as their
        ``model``."""
        check_allowed()
        if body.lora_name == serving.model_name:
            raise bad_request(
                f"lora_name {body.lora_name!r} is the base model's name; choose another",
                "lora_name",
            )
        if body.lora_name in serving.engine.lora_adapters:
            raise bad_request(
                f"the LoRA adapter {body.lora_name!r} has already been loaded", "lora_name"
            )
        result = await call(serving.engine.load_lora_adapter, body.lora_name, body.lora_path)
        if "error" in result:
            raise bad_request(result["error"], "lora_path")
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    async def unload(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        """Unload an adapter that no request runs with."""
        check_allowed()
        result = await call(serving.engine.unload_lora_adapter, body.lora_name)
        if result.get("not_found"):
            raise APIError(404, result["error"], "lora_name", "model_not_found")
        if result.get("in_use"):
            raise APIError(409, result["error"], "lora_name", "lora_adapter_in_use")
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    router = APIRouter()  # plain functions registered, as the other routers
    router.add_api_route("/v1/load_lora_adapter", load, methods=["POST"])
    router.add_api_route("/v1/unload_lora_adapter", unload, methods=["POST"])
    return router
