"""The OpenAI-compatible HTTP API over one ``AsyncLLMEngine``.

Every request is validated here, before it reaches the engine loop: user input becomes a 400,
never a 500.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2.exceptions import TemplateError
from prometheus_client import CONTENT_TYPE_LATEST

import pagedserve
from pagedserve.engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineStepError
from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.server.body_limit import DEFAULT_MAX_REQUEST_BODY, BodySizeLimit
from pagedserve.server.errors import APIError, bad_request, error_body, install_error_handlers
from pagedserve.server.metrics import RequestTimer, ServerMetrics
from pagedserve.server.protocol import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    FaultRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    TopLogprob,
    UsageInfo,
    VersionResponse,
    random_id,
)
from pagedserve.server.sampling import (
    MAX_LOGPROBS,
    chat_sampling_params,
    completion_sampling_params,
)
from pagedserve.server.session_state import SessionStore, session_router
from pagedserve.server.sglang_api import sglang_router
from pagedserve.server.structured import attach_structured_outputs
from pagedserve.server.web_ui import install_web_ui, is_web_ui_path

if TYPE_CHECKING:
    from pagedserve.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

RETRY_AFTER_S = "1"
PUBLIC_PATHS = ("/health", "/metrics", "/version", "/docs", "/openapi.json", "/redoc")
GENERATE_PATHS = ("/v1/completions", "/v1/chat/completions")

Prompt = tuple[str | None, list[int]]  # (text if the user sent text, token ids)


class OpenAIServing:
    """Turns OpenAI requests into engine requests and engine outputs into OpenAI responses."""

    def __init__(
        self,
        engine: LLMEngine | AsyncLLMEngine,
        served_model_name: str | None,
        max_queue_len: int | None,
        max_logprobs: int = MAX_LOGPROBS,
    ):
        if isinstance(engine, AsyncLLMEngine):  # the engine core in a process of its own
            self.llm_engine, self.engine = None, engine
            if max_queue_len is not None:
                engine.max_queue_len = max_queue_len
        else:  # the engine core in a thread of this process
            self.llm_engine, self.engine = engine, AsyncLLMEngine.from_engine(engine, max_queue_len)
        self.model_name = served_model_name or self.engine.model
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.limits.max_model_len
        self.vocab_size = self.engine.limits.vocab_size
        self.max_num_seqs = self.engine.limits.max_num_seqs
        self.max_logprobs = max_logprobs
        self.metrics = ServerMetrics()
        self._token_strs: dict[int, str] = {}

    # ---- validation ---------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"the model {model!r} does not exist; this server serves "
                f"{self.model_name!r} (see GET /v1/models)",
                "model",
                "model_not_found",
            )

    def check_admission(self) -> None:
        if not self.engine.is_alive:
            raise APIError(
                503,
                "the engine loop is not running; see the server log",
                code="engine_dead",
                headers={"Retry-After": RETRY_AFTER_S},
            )
        if self.engine.draining:
            raise APIError(
                503,
                "the server is shutting down and admits no new requests",
                code="shutting_down",
                headers={"Retry-After": RETRY_AFTER_S},
            )
        if self.engine.queue_full():
            raise APIError(
                503,
                f"the server is busy: {self.engine.num_waiting} requests are waiting "
                f"(--max-queue-len {self.engine.max_queue_len}); retry shortly",
                code="queue_full",
                headers={"Retry-After": RETRY_AFTER_S},
            )

    def require_tokenizer(self):
        if self.tokenizer is None:
            raise bad_request(
                "this model has no tokenizer.json: send token ids as the prompt", "prompt"
            )
        return self.tokenizer

    def encode_prompts(self, prompt: Any) -> list[Prompt]:
        if isinstance(prompt, str):
            return [(prompt, self.require_tokenizer().encode(prompt))]
        if not prompt:
            raise bad_request(
                "prompt is empty; send a string, a list of strings or token ids", "prompt"
            )
        if isinstance(prompt[0], int):
            return [(None, list(prompt))]
        if isinstance(prompt[0], str):
            return [(p, self.require_tokenizer().encode(p)) for p in prompt]
        return [(None, list(p)) for p in prompt]

    def chat_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool) -> Prompt:
        tok = self.require_tokenizer()
        conversation = [_message_dict(m) for m in messages]
        try:
            text = tok.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt
            )
        except (TemplateError, ValueError) as e:
            raise bad_request(
                f"messages could not be rendered with the chat template: {e}", "messages"
            ) from e
        return text, tok.encode(text, add_special_tokens=False)

    def check_fits(self, prompts: list[Prompt], params: SamplingParams) -> None:
        limits = self.engine.limits
        for _, ids in prompts:
            try:
                limits.check_request(ids, params)
            except ValueError as e:
                raise bad_request(str(e), "prompt", "context_length_exceeded") from e

    # ---- running ------------------------------------------------------------------------------
    def start(self, request_id: str, prompts: list[Prompt], params: SamplingParams):
        return [
            self._timed(
                self.engine.generate(f"{request_id}-{i}", ids, params, prompt=text), params.n
            )
            for i, (text, ids) in enumerate(prompts)
        ]

    async def _timed(
        self, stream: AsyncIterator[RequestOutput], n: int
    ) -> AsyncIterator[RequestOutput]:
        """Observe latencies, and count each of the ``n`` sequences once by finish reason."""
        timer = RequestTimer(self.metrics)
        reasons: list[str | None] = [None] * n
        try:
            async for output in stream:
                timer.on_output(sum(len(o.token_ids) for o in output.outputs), output.metrics)
                for o in output.outputs:
                    reasons[o.index] = o.finish_reason
                yield output
        finally:
            timer.on_finish(reasons)  # a sequence unfinished when the stream ends was aborted
            await stream.aclose()

    async def collect(self, raw: Request, streams: list) -> list[RequestOutput]:
        """The final output of each stream; abort them all if the client disconnects first."""
        gather = asyncio.ensure_future(asyncio.gather(*(_last(s) for s in streams)))
        watcher = asyncio.ensure_future(_wait_for_disconnect(raw))
        try:
            await asyncio.wait({gather, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not gather.done():
                # the streams abort as the cancellation reaches them, a moment later: until then
                # the gathering future is neither done nor cancelled, and nobody reads it after
                gather.cancel()
                gather.add_done_callback(_retrieve)
        if not gather.done() or gather.cancelled():
            raise APIError(499, "client disconnected")
        try:
            return gather.result()
        except (EngineStepError, EngineDeadError) as e:
            raise APIError(500, str(e)) from e
        except ValueError as e:
            raise bad_request(str(e)) from e

    # ---- token text ---------------------------------------------------------------------------
    def token_str(self, token_id: int) -> str:
        if token_id not in self._token_strs:
            text = (
                self.tokenizer.decode([token_id], skip_special_tokens=False)
                if self.tokenizer
                else f"token_id:{token_id}"
            )
            self._token_strs[token_id] = text
        return self._token_strs[token_id]

    def prompt_offsets(self, token_ids: list[int], text: str) -> list[int]:
        """Where each prompt token starts in the echoed prompt ``text``; a token whose text is
        not where the previous one ended (the ``[gMASK]<sop>`` the tokenizer puts before a text
        prompt) takes no room. See ``TextOffsets`` for the rest."""
        offsets = TextOffsets(self.tokenizer, [], skip_special_tokens=False)
        return offsets.take(token_ids, shown=text)

    def completion_offsets(
        self, prompt_ids: list[int], body: CompletionRequest, start: int = 0
    ) -> TextOffsets:
        """The ``TextOffsets`` of one completion whose text starts at ``start``."""
        return TextOffsets(self.tokenizer, prompt_ids, body.skip_special_tokens, start)

    def completion_logprobs(
        self,
        token_ids: list[int],
        logprobs: list[dict[int, float] | None],
        top_n: int,
        offsets: list[int],
    ) -> CompletionLogprobs:
        out = CompletionLogprobs(text_offset=offsets)
        for tid, lp in zip(token_ids, logprobs, strict=False):
            out.tokens.append(self.token_str(tid))
            if lp is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(lp.get(tid))
            top: dict[str, float] = {}
            for t, v in _top(lp, top_n):  # tokens that decode alike: keep the most likely
                top.setdefault(self.token_str(t), v)
            out.top_logprobs.append(top)
        return out

    def chat_logprobs(
        self, token_ids: list[int], logprobs: list[dict[int, float]], top_n: int
    ) -> ChatLogprobs:
        content = []
        for tid, lp in zip(token_ids, logprobs, strict=False):
            top = [self._top_logprob(t, v) for t, v in _top(lp, top_n)]
            content.append(
                ChatTokenLogprob(**self._top_logprob(tid, lp[tid]).model_dump(), top_logprobs=top)
            )
        return ChatLogprobs(content=content)

    def _top_logprob(self, token_id: int, logprob: float) -> TopLogprob:
        text = self.token_str(token_id)
        return TopLogprob(
            token=text, logprob=max(logprob, -9999.0), bytes=list(text.encode("utf-8"))
        )


class TextOffsets:
    """``logprobs.text_offset``: where each token starts in the returned text, in characters.

    Tokens are decoded in turn as the incremental detokenizer splits the output text (a token
    inside a UTF-8 character adds nothing until the one that completes it; a skipped special token
    adds nothing), so the offsets never go back and ``text[offset[i]:offset[i + 1]]`` is token
    i's text."""

    def __init__(
        self, tokenizer, context_ids: list[int], skip_special_tokens: bool, start: int = 0
    ) -> None:
        params = SamplingParams(skip_special_tokens=skip_special_tokens)
        self.detokenizer = (
            IncrementalDetokenizer(tokenizer, context_ids, params) if tokenizer else None
        )
        self.pos = start

    def take(
        self, token_ids: list[int], end: int | None = None, shown: str | None = None
    ) -> list[int]:
        """Offsets of the next tokens, at most ``end``. With ``shown`` (the text from offset 0),
        a token whose text is not where the previous one ended takes no room."""
        offsets = []
        for tid in token_ids:
            offsets.append(self.pos if end is None else min(self.pos, end))
            piece = self._piece(tid)
            if shown is None or shown.startswith(piece, self.pos):
                self.pos += len(piece)
        return offsets

    def _piece(self, token_id: int) -> str:
        if self.detokenizer is None:
            return f"token_id:{token_id}"
        return self.detokenizer.add_token(token_id)[0]


# ---- /v1/completions --------------------------------------------------------------------------
def _completion_choice(
    serving: OpenAIServing,
    body: CompletionRequest,
    prompt: Prompt,
    prompt_output: RequestOutput,
    o: CompletionOutput,
    index: int,
) -> CompletionChoice:
    prefix = _prompt_text(serving, prompt) if body.echo else ""
    logprobs = None
    if body.logprobs is not None:
        ids = prompt[1]
        logprobs = CompletionLogprobs()
        if body.echo:
            logprobs = serving.completion_logprobs(
                ids,
                prompt_output.prompt_logprobs or [None] * len(ids),
                body.logprobs,
                serving.prompt_offsets(ids, prefix),
            )
        offsets = serving.completion_offsets(ids, body, len(prefix))
        end = len(prefix) + len(o.text)  # a matched stop string cut the text
        tail = serving.completion_logprobs(
            o.token_ids, o.logprobs or [], body.logprobs, offsets.take(o.token_ids, end=end)
        )
        for field in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(logprobs, field).extend(getattr(tail, field))
    return CompletionChoice(
        index=index,
        text=prefix + o.text,
        logprobs=logprobs,
        finish_reason=o.finish_reason,
        stop_reason=o.stop_reason,
    )


async def create_completion(serving: OpenAIServing, body: CompletionRequest, raw: Request):
    serving.check_model(body.model)
    if body.echo and body.stream and body.logprobs is not None:
        raise bad_request("echo with logprobs is not supported when streaming", "echo")
    prompts = serving.encode_prompts(body.prompt)
    params = completion_sampling_params(
        body, serving.max_num_seqs, serving.vocab_size, serving.max_logprobs
    )
    attach_structured_outputs(params, body, serving.tokenizer)
    serving.check_fits(prompts, params)
    serving.check_admission()
    request_id = random_id("cmpl")
    streams = serving.start(request_id, prompts, params)
    if body.stream:
        return _sse(_completion_stream(serving, body, request_id, prompts, streams))
    finals = await serving.collect(raw, streams)
    choices = [
        _completion_choice(serving, body, prompts[p], out, o, p * body.n + o.index)
        for p, out in enumerate(finals)
        for o in out.outputs
    ]
    return CompletionResponse(
        id=request_id, model=serving.model_name, choices=choices, usage=_usage(prompts, finals)
    )


async def _completion_stream(
    serving: OpenAIServing,
    body: CompletionRequest,
    request_id: str,
    prompts: list[Prompt],
    streams: list,
) -> AsyncIterator[str]:
    created = int(time.time())
    sent_text: dict[int, int] = {}
    sent_tokens: dict[int, int] = {}
    offsets: dict[int, TextOffsets] = {}
    finals: dict[int, RequestOutput] = {}

    def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
        return _data(
            CompletionChunk(
                id=request_id,
                created=created,
                model=serving.model_name,
                choices=choices,
                usage=usage,
            )
        )

    async for p, out in _merge(streams):
        for o in out.outputs:
            index = p * body.n + o.index
            if index not in sent_text:
                sent_text[index], sent_tokens[index] = 0, 0
                if body.echo:
                    yield chunk(
                        [CompletionChoice(index=index, text=_prompt_text(serving, prompts[p]))]
                    )
            if sent_text[index] < 0:
                continue
            delta = o.text[sent_text[index] :]
            new_tokens = o.token_ids[sent_tokens[index] :]
            if not delta and not new_tokens and not o.finished:
                continue
            logprobs = None
            if body.logprobs is not None:
                if index not in offsets:
                    offsets[index] = serving.completion_offsets(prompts[p][1], body)
                logprobs = serving.completion_logprobs(
                    new_tokens,
                    (o.logprobs or [])[sent_tokens[index] :],
                    body.logprobs,
                    offsets[index].take(new_tokens, end=len(o.text)),
                )
            sent_text[index] = -1 if o.finished else len(o.text)
            sent_tokens[index] = len(o.token_ids)
            yield chunk(
                [
                    CompletionChoice(
                        index=index,
                        text=delta,
                        logprobs=logprobs,
                        finish_reason=o.finish_reason,
                        stop_reason=o.stop_reason,
                    )
                ]
            )
        if out.finished:
            finals[p] = out
    if body.stream_options and body.stream_options.include_usage:
        yield chunk([], _usage(prompts, [finals[p] for p in sorted(finals)]))


# ---- /v1/chat/completions ---------------------------------------------------------------------
def _chat_choice(serving: OpenAIServing, body: ChatCompletionRequest, o: CompletionOutput):
    logprobs = None
    if body.logprobs:
        logprobs = serving.chat_logprobs(o.token_ids, o.logprobs or [], body.top_logprobs or 0)
    return ChatCompletionChoice(
        index=o.index,
        message=ChatResponseMessage(content=o.text),
        logprobs=logprobs,
        finish_reason=o.finish_reason,
        stop_reason=o.stop_reason,
    )


async def create_chat_completion(serving: OpenAIServing, body: ChatCompletionRequest, raw: Request):
    serving.check_model(body.model)
    prompt = serving.chat_prompt(body.messages, body.add_generation_prompt)
    params = chat_sampling_params(
        body, serving.max_num_seqs, serving.vocab_size, serving.max_logprobs
    )
    attach_structured_outputs(params, body, serving.tokenizer)
    serving.check_fits([prompt], params)
    serving.check_admission()
    request_id = random_id("chatcmpl")
    streams = serving.start(request_id, [prompt], params)
    if body.stream:
        return _sse(_chat_stream(serving, body, request_id, prompt, streams[0]))
    (final,) = await serving.collect(raw, streams)
    choices = [_chat_choice(serving, body, o) for o in final.outputs]
    return ChatCompletionResponse(
        id=request_id, model=serving.model_name, choices=choices, usage=_usage([prompt], [final])
    )


async def _chat_stream(
    serving: OpenAIServing,
    body: ChatCompletionRequest,
    request_id: str,
    prompt: Prompt,
    stream: AsyncIterator[RequestOutput],
) -> AsyncIterator[str]:
    created = int(time.time())
    sent_text = [0] * body.n
    sent_tokens = [0] * body.n

    def chunk(choices: list[ChatCompletionStreamChoice], usage: UsageInfo | None = None) -> str:
        return _data(
            ChatCompletionChunk(
                id=request_id,
                created=created,
                model=serving.model_name,
                choices=choices,
                usage=usage,
            )
        )

    yield chunk(
        [
            ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
            for i in range(body.n)
        ]
    )
    final = None
    async for _, out in _merge([stream]):
        for o in out.outputs:
            i = o.index
            if sent_text[i] < 0:
                continue
            delta, new_tokens = o.text[sent_text[i] :], o.token_ids[sent_tokens[i] :]
            if not delta and not new_tokens and not o.finished:
                continue
            logprobs = None
            if body.logprobs:
                logprobs = serving.chat_logprobs(
                    new_tokens, (o.logprobs or [])[sent_tokens[i] :], body.top_logprobs or 0
                )
            sent_text[i] = -1 if o.finished else len(o.text)
            sent_tokens[i] = len(o.token_ids)
            yield chunk(
                [
                    ChatCompletionStreamChoice(
                        index=i,
                        delta=DeltaMessage(content=delta),
                        logprobs=logprobs,
                        finish_reason=o.finish_reason,
                        stop_reason=o.stop_reason,
                    )
                ]
            )
        final = out
    if body.stream_options and body.stream_options.include_usage and final is not None:
        yield chunk([], _usage([prompt], [final]))


# ---- helpers ----------------------------------------------------------------------------------
def _message_dict(message: ChatMessage) -> dict[str, Any]:
    content = message.content
    if isinstance(content, list):
        content = "".join(part.text or "" for part in content if part.type == "text")
    extra = {k: v for k, v in (message.model_extra or {}).items()}
    return {**extra, "role": message.role, "content": content or ""}


def _prompt_text(serving: OpenAIServing, prompt: Prompt) -> str:
    text, ids = prompt
    if text is not None:
        return text
    return serving.tokenizer.decode(ids, skip_special_tokens=False) if serving.tokenizer else ""


def _top(logprobs: dict[int, float], n: int) -> list[tuple[int, float]]:
    return sorted(logprobs.items(), key=lambda kv: kv[1], reverse=True)[:n]


def _usage(prompts: list[Prompt], finals: list[RequestOutput]) -> UsageInfo:
    prompt_tokens = sum(len(ids) for _, ids in prompts)
    completion = sum(len(o.token_ids) for out in finals for o in out.outputs)
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion,
        total_tokens=prompt_tokens + completion,
    )


def _data(model) -> str:
    return f"data: {model.model_dump_json(exclude_none=False)}\n\n"


def _sse(chunks: AsyncIterator[str]) -> StreamingResponse:
    async def with_done() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield chunk
        except (EngineStepError, EngineDeadError, ValueError) as e:
            status = 400 if isinstance(e, ValueError) else 500
            yield f"data: {json.dumps(error_body(status, str(e)))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(
        with_done(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )


async def _last(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    last = None
    async for output in stream:
        last = output
    return last


async def _merge(streams: list) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several output streams as (stream index, output); closing it aborts them all."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream) -> None:
        try:
            async for output in stream:
                await queue.put((i, output))
        except BaseException as e:  # noqa: BLE001 - re-raised on the consumer side
            await queue.put((i, e))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()


def _retrieve(future: asyncio.Future) -> None:
    """Read an abandoned future's outcome, so that asyncio does not log it as never retrieved."""
    if not future.cancelled():
        future.exception()


async def _wait_for_disconnect(raw: Request) -> None:
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


# ---- the app ----------------------------------------------------------------------------------
def build_app(
    engine: LLMEngine | AsyncLLMEngine,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_queue_len: int | None = None,
    web_ui: bool = True,
    enable_fault_injection: bool = False,
    max_logprobs: int = MAX_LOGPROBS,
    max_request_body: int = DEFAULT_MAX_REQUEST_BODY,
    allowed_origins: list[str] | None = None,
) -> FastAPI:
    """A FastAPI app serving ``engine``: an ``AsyncLLMEngine`` (the engine core in a process of
    its own, as ``pagedserve serve`` runs it) or an ``LLMEngine``, whose core then runs in a
    thread of this process. The app's lifespan starts and stops the engine core. ``web_ui``: the
    web console at ``/`` (``pagedserve serve --disable-web-ui`` turns it off).

    ``allowed_origins``: the browser origins CORS admits; none (the default) sends no CORS
    headers, so no web page of another origin can call the server."""
    serving = OpenAIServing(engine, served_model_name, max_queue_len, max_logprobs)

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
    _add_routes(app, serving)
    _add_device_routes(app, serving, enable_fault_injection)
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
            for model in schema.get("components", {}).get("schemas", {}).values():
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


def _add_device_routes(app: FastAPI, serving: OpenAIServing, enable_fault_injection: bool) -> None:
    """The operator's routes under /device (behind the API key): the weight tier's scrub on
    demand, the KV pool's consistency check, and fault injection when the server allows it."""

    async def call(name: str, *args: Any) -> Any:
        try:
            return await serving.engine.call_utility(name, *args)
        except EngineDeadError as e:
            raise APIError(503, str(e), code="engine_dead") from e

    @app.post("/device/scrub")
    async def scrub() -> dict:
        """Verify every weight page's checksum now; corrupted pages are restored."""
        return await call("scrub_weights")

    @app.get("/device/invariants")
    async def invariants() -> dict:
        """The KV pool's own consistency check (``problems`` empty when all is well) and what
        is in flight: after a soak, nothing running, nothing waiting, no page in use."""
        return await call("check_invariants")

    @app.post("/device/faults")
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


def _add_routes(app: FastAPI, serving: OpenAIServing) -> None:
    @app.post("/v1/completions", response_model=CompletionResponse)
    async def completions(body: CompletionRequest, raw: Request):
        return await create_completion(serving, body, raw)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse)
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        return await create_chat_completion(serving, body, raw)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        card = ModelCard(
            id=serving.model_name,
            root=serving.engine.model,
            max_model_len=serving.max_model_len,
        )
        return ModelList(data=[card])

    @app.get("/health")
    async def health() -> Response:
        """Answered here, never by the engine: 200 while the engine core is alive (with its step
        counter and the age of its last message), 503 once it is dead."""
        engine = serving.engine
        if not engine.is_alive:
            reason = engine.dead_error or "it is not running"
            body = error_body(503, f"the engine loop is not running: {reason}", code="engine_dead")
            return JSONResponse(body, 503)
        return JSONResponse(engine.health())

    @app.get("/metrics")
    async def metrics() -> Response:
        stats = serving.engine.stats  # from the engine core's last message
        return Response(serving.metrics.render(stats), media_type=CONTENT_TYPE_LATEST)

    @app.get("/device")
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

    @app.get("/device/pages")
    async def device_pages() -> dict:
        """The KV page pool frame by frame: a digit per page (the console's page map)."""
        try:
            return await serving.engine.get_page_map()
        except EngineDeadError as e:
            raise APIError(503, str(e), code="engine_dead") from e

    @app.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        serving.check_model(body.model)
        if body.messages is not None:
            _, ids = serving.chat_prompt(body.messages, body.add_generation_prompt)
        elif body.prompt is not None:
            ids = serving.require_tokenizer().encode(body.prompt, body.add_special_tokens)
        else:
            raise bad_request("send 'prompt' (a string) or 'messages'", "prompt")
        return TokenizeResponse(count=len(ids), max_model_len=serving.max_model_len, tokens=ids)

    @app.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        serving.check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < serving.vocab_size]
        if bad:
            raise bad_request(
                f"token id {bad[0]} is outside the vocabulary [0, {serving.vocab_size})", "tokens"
            )
        return DetokenizeResponse(prompt=serving.require_tokenizer().decode(body.tokens))

    @app.get("/version", response_model=VersionResponse)
    async def version() -> VersionResponse:
        return VersionResponse(version=pagedserve.__version__)
