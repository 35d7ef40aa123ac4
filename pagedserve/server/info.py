"""What the server says about itself: ``GET /v1/models``, ``/health`` (answered here, never by the
engine), ``/metrics`` (Prometheus) and ``/version``.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

import pagedserve
from pagedserve.server.errors import error_body
from pagedserve.server.protocol import ModelCard, ModelList, VersionResponse
from pagedserve.server.serving import OpenAIServing


def info_router(serving: OpenAIServing) -> APIRouter:
    """The routes, as plain functions registered on the router (a decorated one is out of
    mutmut's reach); each one's response model is its return annotation."""

    async def models() -> ModelList:
        """The base model, then each LoRA adapter with its ``parent`` (vLLM's list)."""
        card = ModelCard(
            id=serving.model_name,
            root=serving.engine.model,
            max_model_len=serving.max_model_len,
        )
        adapters = [
            ModelCard(
                id=a["name"],
                root=a["path"],
                parent=a["base_model_name"] or serving.model_name,
                max_model_len=serving.max_model_len,
            )
            for a in serving.engine.lora_adapters.values()
        ]
        return ModelList(data=[card, *adapters])

    async def health() -> Response:
        """Answered here, never by the engine: 200 while the engine core is alive (with its step
        counter and the age of its last message), 503 once it is dead."""
        engine = serving.engine
        if not engine.is_alive:
            # a core that has just exited: the client tells how, until the loop has handled it
            reason = engine.dead_error or engine.client.exit_reason()
            body = error_body(503, f"the engine loop is not running: {reason}", code="engine_dead")
            return JSONResponse(body, 503)
        return JSONResponse(engine.health())

    async def metrics() -> Response:
        stats = serving.engine.stats  # from the engine core's last message
        return Response(serving.metrics.render(stats), media_type=CONTENT_TYPE_LATEST)

    async def version() -> VersionResponse:
        return VersionResponse(version=pagedserve.__version__)

    router = APIRouter()
    router.add_api_route("/v1/models", models, methods=["GET"])
    router.add_api_route("/health", health, methods=["GET"])
    router.add_api_route("/metrics", metrics, methods=["GET"])
    router.add_api_route("/version", version, methods=["GET"])
    return router
