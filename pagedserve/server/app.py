"""The FastAPI app over one engine: the endpoint families' routers (``completions``, ``chat``,
``info``, ``tokenization``, ``device``, SGLang's ``sglang_api``, ``session_state``), the API key,
CORS, the request-body limit and the web console.
"""

from __future__ import annotations

import hmac
import logging
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse

import pagedserve
from pagedserve.engine.protocol import EngineClient
from pagedserve.server.body_limit import DEFAULT_MAX_REQUEST_BODY, BodySizeLimit
from pagedserve.server.chat import chat_router
from pagedserve.server.completions import completions_router
from pagedserve.server.device import device_router
from pagedserve.server.errors import error_body, install_error_handlers
from pagedserve.server.info import info_router
from pagedserve.server.lora import lora_router, runtime_lora_updating_allowed
from pagedserve.server.reasoning_parsers import ReasoningParserManager
from pagedserve.server.sampling import MAX_LOGPROBS
from pagedserve.server.serving import OpenAIServing
from pagedserve.server.session_state import SessionStore, session_router
from pagedserve.server.sglang_api import sglang_router
from pagedserve.server.tokenization import tokenization_router
from pagedserve.server.tool_parsers import ToolParserManager
from pagedserve.server.web_ui import install_web_ui, is_web_ui_path

if TYPE_CHECKING:
    from pagedserve.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

PUBLIC_PATHS = ("/health", "/metrics", "/version", "/docs", "/openapi.json", "/redoc")


def build_app(
    engine: LLMEngine | EngineClient,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_queue_len: int | None = None,
    web_ui: bool = True,
    enable_fault_injection: bool = False,
    max_logprobs: int = MAX_LOGPROBS,
    max_request_body: int = DEFAULT_MAX_REQUEST_BODY,
    allowed_origins: list[str] | None = None,
    tool_call_parser: str | None = None,
    enable_auto_tool_choice: bool = False,
    reasoning_parser: str | None = None,
    chat_template: str | None = None,
    allow_runtime_lora_updating: bool = False,
) -> FastAPI:
    """A FastAPI app serving ``engine``: an ``EngineClient`` (an ``AsyncLLMEngine``, the engine
    core in a process of its own, as ``pagedserve serve`` runs it; or the Ray Serve ingress's
    client of data-parallel replicas) or an ``LLMEngine``, whose core then runs in a thread of
    this process. The app's lifespan starts and stops the engine core. ``web_ui``: the
    web console at ``/`` (``pagedserve serve --disable-web-ui`` turns it off).

    ``allowed_origins``: the browser origins CORS admits; none (the default) sends no CORS
    headers, so no web page of another origin can call the server.

    Tools (vLLM's flags): ``tool_call_parser`` names the parser of the model's tool-call format
    (``--tool-call-parser``), ``enable_auto_tool_choice`` lets the model decide
    (``tool_choice: "auto"``); ``reasoning_parser`` splits a thinking model's output;
    ``chat_template`` (the text of one) replaces the model's own.

    ``allow_runtime_lora_updating`` (or ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=true``): the LoRA
    adapters may be loaded and unloaded while serving (``server/lora.py``)."""
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME (e.g. glm4)")
    tools = ToolParserManager.get_tool_parser(tool_call_parser) if tool_call_parser else None
    reasoning = (
        ReasoningParserManager.get_reasoning_parser(reasoning_parser) if reasoning_parser else None
    )
    serving = OpenAIServing(
        engine,
        served_model_name,
        max_queue_len,
        max_logprobs,
        tool_parser=tools,
        enable_auto_tool_choice=enable_auto_tool_choice,
        reasoning_parser=reasoning,
        chat_template=chat_template,
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        serving.engine.start()
        yield
        serving.engine.shutdown()

    app = FastAPI(
        title="pagedserve",
        version=pagedserve.__version__,
        lifespan=lifespan,
        description="OpenAI-compatible API of the pagedserve paged inference engine",
    )
    app.state.serving = serving
    install_error_handlers(app)
    _install_auth(app, api_key)
    app.add_middleware(BodySizeLimit, max_bytes=max_request_body)
    if allowed_origins:  # outermost: a preflight is answered before the key is asked for
        app.add_middleware(
            CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"], allow_headers=["*"]
        )
    for router in (
        completions_router(serving),
        chat_router(serving),
        info_router(serving),
        tokenization_router(serving),
        device_router(serving, enable_fault_injection),
        lora_router(serving, runtime_lora_updating_allowed(allow_runtime_lora_updating)),
    ):
        app.include_router(router)
    app.include_router(sglang_router(serving))
    app.include_router(session_router(SessionStore()))
    if web_ui:
        install_web_ui(app)
    _state_limits_in_openapi(app, serving)
    return app


def _state_limits_in_openapi(app: FastAPI, serving: OpenAIServing) -> None:
    """``/openapi.json`` states this server's own limits as each integer's ``maximum`` (``n`` up
    to --max-num-seqs, logprobs up to --max-logprobs, output tokens up to --max-model-len), so
    that a client or a fuzzer generating from the schema sends what this server serves."""
    most_tokens = serving.max_model_len - 1  # a prompt has at least one token
    limits = {
        "n": serving.max_num_seqs,
        "logprobs": serving.max_logprobs,
        "top_logprobs": serving.max_logprobs,
        "top_logprobs_num": serving.max_logprobs,
        "max_tokens": most_tokens,
        "max_completion_tokens": most_tokens,
        "max_new_tokens": most_tokens,
        "min_tokens": most_tokens,
        "min_new_tokens": most_tokens,
    }
    build_schema = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build_schema()
            for model in schema["components"]["schemas"].values():  # the request models
                for name, prop in model.get("properties", {}).items():
                    for alternative in prop.get("anyOf", [prop]):
                        if name in limits and alternative.get("type") == "integer":
                            alternative["maximum"] = limits[name]
        return app.openapi_schema

    app.openapi = openapi


def _install_auth(app: FastAPI, api_key: str | None) -> None:
    """Every route but ``PUBLIC_PATHS`` asks for the key. Compared in constant time (the time a
    wrong key takes says nothing about how much of it was right), and never logged."""
    if not api_key:
        return
    expected = f"Bearer {api_key}".encode()

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        if _is_public(request.url.path) or request.method == "OPTIONS":
            return await call_next(request)
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            body = error_body(
                401,
                "missing or wrong API key: send 'Authorization: Bearer <key>' "
                "with the server's --api-key",
                code="invalid_api_key",
            )
            return JSONResponse(body, status_code=401)
        return await call_next(request)


def _is_public(path: str) -> bool:
    """Routes open without the API key: liveness, metrics, API docs, and the web console's page
    and files (they hold no data; the page asks for the key and sends it on every call)."""
    return path.startswith(PUBLIC_PATHS) or is_web_ui_path(path)
