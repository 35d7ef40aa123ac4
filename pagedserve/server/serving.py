"""The request handling every endpoint shares: ``OpenAIServing`` turns OpenAI requests into engine
requests (the model name, admission, prompts and the chat template, the limits) and engine
outputs into response pieces (token text, logprobs, ``text_offset``, usage).

Every request is validated before it reaches the engine loop: user input becomes a 400, never
a 500.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any

from fastapi import Request
from jinja2.exceptions import TemplateError

from pagedserve.engine.async_engine import AsyncLLMEngine, EngineDeadError, EngineStepError
from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.engine.limits import RequestRejectedError
from pagedserve.engine.protocol import EngineClient
from pagedserve.models.chat_templates import builtin_chat_template, tool_template_for
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.server.errors import APIError, bad_request
from pagedserve.server.metrics import RequestTimer, ServerMetrics
from pagedserve.server.protocol import (
    ChatCompletionToolsParam,
    ChatLogprobs,
    ChatMessage,
    ChatTokenLogprob,
    CompletionLogprobs,
    CompletionRequest,
    TopLogprob,
    UsageInfo,
)
from pagedserve.server.reasoning_parsers import ReasoningParser
from pagedserve.server.sampling import MAX_LOGPROBS
from pagedserve.server.tool_parsers import Glm4ToolParser, ToolParser

if TYPE_CHECKING:
    from pagedserve.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

RETRY_AFTER_S = "1"
SESSION_HEADER = "x-session-id"

# The session key of the request being started, read by an engine client that routes over
# data-parallel replicas (a single engine ignores it): set around each ``generate`` call.
SESSION_KEY: ContextVar[str | None] = ContextVar("session_key", default=None)

Prompt = tuple[str | None, list[int]]  # (text if the user sent text, token ids)


class OpenAIServing:
    """Turns OpenAI requests into engine requests and engine outputs into OpenAI responses."""

    def __init__(
        self,
        engine: LLMEngine | EngineClient,
        served_model_name: str | None,
        max_queue_len: int | None,
        max_logprobs: int = MAX_LOGPROBS,
        tool_parser: type[ToolParser] | None = None,
        enable_auto_tool_choice: bool = False,
        reasoning_parser: type[ReasoningParser] | None = None,
        chat_template: str | None = None,
    ):
        if isinstance(engine, EngineClient):  # the engine core in a process of its own
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
        limits = self.engine.limits
        self.metrics = ServerMetrics(
            self.model_name,
            {"block_size": limits.block_size, "num_gpu_blocks": limits.num_kv_pages},
        )
        self._token_strs: dict[int, str] = {}
        # tools: --tool-call-parser's form, else GLM-4's (auto needs the flag; build_app checks)
        self.tool_parser = tool_parser or Glm4ToolParser
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.reasoning_parser = reasoning_parser
        self._set_chat_template(chat_template)

    def _set_chat_template(self, chat_template: str | None) -> None:
        """``--chat-template``, else the built-in counterpart of a published GLM-4 template
        (which renders tool calls only in GLM's own message shape)."""
        if self.tokenizer is None:
            return
        if chat_template is not None:
            self.tokenizer.chat_template = chat_template
            return
        builtin = tool_template_for(self.tokenizer.chat_template)
        if builtin is not None:
            logger.info(
                "the model's chat template is GLM-4's published one, which renders tool calls only "
                "in GLM's own message shape; serving with the built-in %r (the same prompts, and "
                "OpenAI's tool messages too; --chat-template chooses another)",
                builtin,
            )
            self.tokenizer.chat_template = builtin_chat_template(builtin)

    def tool_parser_for(self, tools) -> ToolParser:
        """The parser of a request's calls (a ``tools.ToolRequest`` that reads some): that of
        --tool-call-parser, else GLM-4's for a call the grammar forces (auto needs the flag)."""
        return self.tool_parser(self.require_tokenizer(), tools.tools)

    @property
    def special_texts(self) -> tuple[str, ...]:
        """The special tokens' texts, longest first (to drop them from text shown to a client)."""
        if self.tokenizer is None:
            return ()
        texts = {self.token_str(i) for i in self.tokenizer.all_special_ids}
        return tuple(sorted(texts, key=len, reverse=True))

    # ---- validation ---------------------------------------------------------------------------
    def check_model(self, model: str | None, param: str = "model") -> str | None:
        """The LoRA adapter a request's ``model`` names (None: the base model); a 404 in
        OpenAI's shape for a name this server does not serve (``param``: the field that named
        it: SGLang's /generate names adapters by ``lora_path``)."""
        if model is None or model == self.model_name:
            return None
        if model in self.engine.lora_adapters:
            return model
        adapters = sorted(self.engine.lora_adapters)
        also = f" and the LoRA adapters {', '.join(map(repr, adapters))}" if adapters else ""
        raise APIError(
            404,
            f"the model {model!r} does not exist; this server serves "
            f"{self.model_name!r}{also} (see GET /v1/models)",
            param,
            "model_not_found",
        )

    def model_for(self, model: str | None) -> str:
        """The name a response gives its model: the adapter's, as vLLM's, else the served name."""
        return model if model in self.engine.lora_adapters else self.model_name

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
            return [self._encode_text(prompt, "prompt")]
        if not prompt:
            raise bad_request(
                "prompt is empty; send a string, a list of strings or token ids", "prompt"
            )
        if isinstance(prompt[0], int):
            return [(None, list(prompt))]
        if isinstance(prompt[0], str):
            return [self._encode_text(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
        return [(None, list(p)) for p in prompt]

    def _encode_text(self, text: str, where: str) -> Prompt:
        """An empty text is a 400, as vLLM's server answers it, although GLM-4's tokenizer would
        give it the ``[gMASK]<sop>`` prefix to start from."""
        if not text:
            raise bad_request(f"{where} is an empty string; send some text", "prompt")
        return text, self.require_tokenizer().encode(text)

    def chat_prompt(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        tools: list[ChatCompletionToolsParam] | None = None,
    ) -> Prompt:
        tok = self.require_tokenizer()
        conversation = [_message_dict(m) for m in messages]
        tool_dicts = [t.model_dump(exclude_unset=True) for t in tools] if tools else None
        try:
            text = tok.apply_chat_template(
                conversation, add_generation_prompt=add_generation_prompt, tools=tool_dicts
            )
        except (TemplateError, ValueError) as e:
            raise bad_request(
                f"messages could not be rendered with the chat template: {e}", "messages"
            ) from e
        return text, tok.encode(text, add_special_tokens=False)

    def check_fits(
        self, prompts: list[Prompt], params: SamplingParams, prompt_param: str = "prompt"
    ) -> None:
        """A 400 naming the field at fault; ``context_length_exceeded`` only for a request longer
        than the engine holds, as OpenAI's API answers it. ``prompt_param``: the request's field
        the prompt came from (a chat request's is ``messages``)."""
        limits = self.engine.limits
        for _, ids in prompts:
            try:
                limits.check_request(ids, params)
            except RequestRejectedError as e:
                code = "context_length_exceeded" if e.too_long else None
                param = prompt_param if e.param == "prompt" else e.param
                raise bad_request(str(e), param, code) from e

    # ---- running ------------------------------------------------------------------------------
    def start(
        self,
        request_id: str,
        prompts: list[Prompt],
        params: SamplingParams,
        session: str | None = None,
        lora_name: str | None = None,
    ):
        """Each prompt's output stream. ``session``: the request's session key, which a
        data-parallel router may keep on one replica (``session_key``); ``lora_name``: the LoRA
        adapter ``check_model`` found (None: the base model)."""
        token = SESSION_KEY.set(session)
        try:
            return [
                self._timed(
                    self.engine.generate(f"{request_id}-{i}", ids, params, text, lora_name),
                    params.n,
                )
                for i, (text, ids) in enumerate(prompts)
            ]
        finally:
            SESSION_KEY.reset(token)

    @staticmethod
    def session_key(raw: Request, user: str | None) -> str | None:
        """The ``X-Session-ID`` header, else the request's ``user`` field."""
        return raw.headers.get(SESSION_HEADER) or user

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
        except EngineDeadError as e:
            raise engine_dead(e) from e
        except EngineStepError as e:
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
            for t, v in top_logprobs(lp, top_n):  # tokens that decode alike: keep the most likely
                top.setdefault(self.token_str(t), v)
            out.top_logprobs.append(top)
        return out

    def chat_logprobs(
        self, token_ids: list[int], logprobs: list[dict[int, float]], top_n: int
    ) -> ChatLogprobs:
        content = []
        for tid, lp in zip(token_ids, logprobs, strict=False):
            top = [self._top_logprob(t, v) for t, v in top_logprobs(lp, top_n)]
            content.append(
                ChatTokenLogprob(**self._top_logprob(tid, lp[tid]).model_dump(), top_logprobs=top)
            )
        return ChatLogprobs(content=content)

    def _top_logprob(self, token_id: int, logprob: float) -> TopLogprob:
        text = self.token_str(token_id)
        return TopLogprob(
            token=text, logprob=max(logprob, -9999.0), bytes=list(text.encode("utf-8"))
        )

    def prompt_text(self, prompt: Prompt) -> str:
        """The text of a prompt as the user sent it, or its tokens decoded."""
        text, ids = prompt
        if text is not None:
            return text
        return self.tokenizer.decode(ids, skip_special_tokens=False) if self.tokenizer else ""


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


def _message_dict(message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates take it (HF's conventions): its text, and each field it
    was sent with (``name``, ``tool_calls``, ``tool_call_id``, ``reasoning_content``, others)."""
    content = message.content
    if isinstance(content, list):
        content = "".join(part.text or "" for part in content if part.type == "text")
    return {**message.model_dump(exclude_none=True), "content": content or ""}


def engine_dead(e: EngineDeadError) -> APIError:
    """A request the engine loop's death ended: 503 (the server, or a data-parallel replica, is
    restarted; the request may be sent again), as an admission check answers once it is dead."""
    return APIError(503, str(e), code="engine_dead", headers={"Retry-After": RETRY_AFTER_S})


def top_logprobs(logprobs: dict[int, float], n: int) -> list[tuple[int, float]]:
    """The ``n`` most likely (token id, logprob) pairs."""
    return sorted(logprobs.items(), key=lambda kv: kv[1], reverse=True)[:n]


def usage_info(prompts: list[Prompt], finals: list[RequestOutput]) -> UsageInfo:
    prompt_tokens = sum(len(ids) for _, ids in prompts)
    completion = sum(len(o.token_ids) for out in finals for o in out.outputs)
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion,
        total_tokens=prompt_tokens + completion,
    )


async def _last(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    last = None
    async for output in stream:
        last = output
    return last


def _retrieve(future: asyncio.Future) -> None:
    """Read an abandoned future's outcome, so that asyncio does not log it as never retrieved."""
    if not future.cancelled():
        future.exception()


async def _wait_for_disconnect(raw: Request) -> None:
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return
