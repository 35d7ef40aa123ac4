"""SGLang's native API, in SGLang's shapes, so that its frontend (``sglang.RuntimeEndpoint``) and
clients run against pagedserve unchanged.

- ``POST /generate``: ``text`` or ``input_ids``, one prompt or a batch; ``sampling_params`` with
  SGLang's names (``max_new_tokens``, ``regex``, ``json_schema``, ``ebnf``, ...);
  ``return_logprob``, ``logprob_start_len``, ``top_logprobs_num``, ``return_text_in_logprobs``;
  ``stream`` as SSE (each chunk carries the text so far) ending ``data: [DONE]``. Logprobs are
  SGLang's ``(logprob, token_id, text or None)`` tuples. ``max_new_tokens: 0`` prefills the
  prompt (its full pages enter the prefix cache) and returns no tokens. pagedserve's extras:
  OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls`` (``tools.py``), the calls read
  from the text in ``meta_info.tool_calls`` (pagedserve.lang's tool step).
- ``GET /get_model_info`` (also ``/model_info``), ``GET /server_info`` (also ``/get_server_info``),
  ``POST /flush_cache``.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ConfigDict, Field

import pagedserve
from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.server.errors import bad_request
from pagedserve.server.protocol import (
    MAX_PROMPTS,
    MAX_TOOLS,
    ChatCompletionToolsParam,
    Count,
    Int64,
    LogitBias,
    OpenAIModel,
    Penalty,
    PositiveCount,
    Probability,
    RepetitionPenalty,
    StopStrings,
    StopTokenIds,
    Temperature,
    TokenId,
    ToolChoice,
    TopK,
    TopP,
    random_id,
)
from pagedserve.server.sampling import check_logprobs, logit_bias
from pagedserve.server.serving import top_logprobs
from pagedserve.server.streaming import merge_streams, sse_response
from pagedserve.server.structured import build
from pagedserve.server.tool_parsers import ToolParser
from pagedserve.server.tools import ToolRequest, attach_tool_grammar, tool_request

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
# SGLang's sampling_params -> ours; the constraints become a StructuredOutputsParams
_RENAMES = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "sampling_seed": "seed",
}
_CONSTRAINTS = {"regex": "regex", "json_schema": "json", "ebnf": "grammar"}
_NO_EFFECT = ("spaces_between_special_tokens", "no_stop_trim", "custom_params")


class SGLangSamplingParams(OpenAIModel):
    """SGLang's ``sampling_params``, with the same ranges as the OpenAI fields; an unknown name
    is a 400 (SGLang's own server ignores it silently: a typo would go unnoticed)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
    max_new_tokens: Count | None = None  # 0: prefill only
    min_new_tokens: Count | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: Probability | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    stop: StopStrings | None = None
    stop_token_ids: StopTokenIds | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    n: PositiveCount | None = None
    seed: Int64 | None = None
    sampling_seed: Int64 | None = None
    logit_bias: LogitBias | None = None
    regex: str | None = None
    json_schema: str | dict[str, Any] | None = None
    ebnf: str | None = None
    stop_regex: str | list[str] | None = None
    # accepted, no effect here
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    custom_params: dict[str, Any] | None = None


class GenerateReqInput(OpenAIModel):
    text: str | Annotated[list[str], Field(max_length=MAX_PROMPTS)] | None = None
    input_ids: (
        list[TokenId] | Annotated[list[list[TokenId]], Field(max_length=MAX_PROMPTS)] | None
    ) = None
    sampling_params: (
        SGLangSamplingParams
        | Annotated[list[SGLangSamplingParams], Field(max_length=MAX_PROMPTS)]
        | None
    ) = None
    return_logprob: bool | Annotated[list[bool], Field(max_length=MAX_PROMPTS)] = False
    logprob_start_len: Int64 | Annotated[list[Int64], Field(max_length=MAX_PROMPTS)] = -1
    top_logprobs_num: Count | Annotated[list[Count], Field(max_length=MAX_PROMPTS)] = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | Annotated[list[str], Field(max_length=MAX_PROMPTS)] | None = None
    # pagedserve's: OpenAI's tools, for every prompt of the request
    tools: Annotated[list[ChatCompletionToolsParam], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = True
    # SGLang's: the LoRA adapter (its name on this server) each prompt runs with; None: the base
    lora_path: str | Annotated[list[str | None], Field(max_length=MAX_PROMPTS)] | None = None

    def check_batch(self, num_prompts: int) -> None:
        """A per-prompt list must have one entry per prompt."""
        names = ("sampling_params", "return_logprob", "logprob_start_len", "top_logprobs_num")
        for name in (*names, "lora_path"):
            value = getattr(self, name)
            if isinstance(value, list) and len(value) != num_prompts:
                raise bad_request(
                    f"{name} has {len(value)} entries for {num_prompts} prompts; send one per "
                    f"prompt or a single value for all",
                    name,
                )


def sglang_sampling_params(fields: SGLangSamplingParams, vocab_size: int) -> SamplingParams:
    """SGLang's sampling_params as ours; a 400 naming a bad value."""
    given = fields.model_dump(exclude_none=True, exclude=set(_NO_EFFECT))
    if given.pop("stop_regex", None):
        raise bad_request("stop_regex is not supported; use stop strings", "stop_regex")
    constraints = {_CONSTRAINTS[k]: given.pop(k) for k in list(given) if k in _CONSTRAINTS}
    ours = {_RENAMES.get(k, k): v for k, v in given.items()}
    ours.setdefault("max_tokens", DEFAULT_MAX_NEW_TOKENS)
    if ours["max_tokens"] == 0:  # prefill only: one token is computed with the prompt anyway
        ours["max_tokens"] = 1
    if "logit_bias" in ours:
        ours["logit_bias"] = logit_bias(ours["logit_bias"], vocab_size)
    if len(constraints) > 1:
        raise bad_request("send one of regex, json_schema and ebnf", "sampling_params")
    try:
        params = SamplingParams(**ours)
    except ValueError as e:
        raise bad_request(str(e), str(e).split("=", 1)[0]) from e
    if constraints:
        name = next(k for k, v in _CONSTRAINTS.items() if v in constraints)
        params.structured_outputs = build(constraints, name)
    return params


def _per_prompt(value: Any, i: int) -> Any:
    return value[i] if isinstance(value, list) else value


class SGLangServing:
    """``/generate`` over the OpenAI server's ``OpenAIServing`` (admission, limits, streams)."""

    def __init__(self, serving):
        self.serving = serving

    def tool_parser(self, body: GenerateReqInput, params: list[SamplingParams]):
        """(the request's tools, the parser of their calls), constraining each prompt's output
        as the tool choice demands; (None, None) without tools."""
        tools = tool_request(
            body.tools, body.tool_choice, body.parallel_tool_calls,
            self.serving.enable_auto_tool_choice,
        )  # fmt: skip
        if tools is None or tools.choice == "none":
            return tools, None
        parser = self.serving.tool_parser_for(tools)
        for p in params:
            attach_tool_grammar(p, tools, parser)
            parser.adjust_request(p)
        return tools, parser

    # ---- the request --------------------------------------------------------------------------
    def prompts(self, body: GenerateReqInput) -> tuple[list[tuple[str | None, list[int]]], bool]:
        """(prompts, whether the request is a batch)."""
        if (body.text is None) == (body.input_ids is None):
            raise bad_request("send exactly one of text and input_ids", "text")
        if body.text is not None:
            texts = [body.text] if isinstance(body.text, str) else body.text
            if not texts:
                raise bad_request("text is an empty list", "text")
            tok = self.serving.require_tokenizer()
            return [(t, tok.encode(t)) for t in texts], isinstance(body.text, list)
        ids = body.input_ids
        if not ids:
            raise bad_request("input_ids is empty", "input_ids")
        batch = isinstance(ids[0], list)
        return ([(None, list(p)) for p in ids] if batch else [(None, list(ids))]), batch

    def params(self, body: GenerateReqInput, i: int) -> SamplingParams:
        fields = _per_prompt(body.sampling_params, i) or SGLangSamplingParams()
        serving = self.serving
        params = sglang_sampling_params(fields, serving.vocab_size)
        if params.structured_outputs is not None and self.serving.tokenizer is None:
            raise bad_request("structured outputs need the model's tokenizer.json", "regex")
        if _per_prompt(body.return_logprob, i):
            top = _per_prompt(body.top_logprobs_num, i) or 0
            check_logprobs(top, "top_logprobs_num", self.serving.max_logprobs)
            params.logprobs = top
            params.prompt_logprobs = top
        if params.n > self.serving.max_num_seqs:
            raise bad_request(
                f"n={params.n} is more than this server's --max-num-seqs "
                f"{self.serving.max_num_seqs}; lower n",
                "n",
            )
        return params

    # ---- the answer ---------------------------------------------------------------------------
    def result(
        self,
        body: GenerateReqInput,
        i: int,
        rid: str,
        prompt_ids: list[int],
        out: RequestOutput,
        o: CompletionOutput,
        prefill_only: bool,
        tools: tuple[ToolRequest, ToolParser] | None = None,
    ) -> dict[str, Any]:
        token_ids = [] if prefill_only else list(o.token_ids)
        text = "" if prefill_only else o.text
        now = time.monotonic()
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": self.finish_reason(o, token_ids, prefill_only),
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": len(token_ids),
            "cached_tokens": out.num_cached_tokens,
            "e2e_latency": now - out.metrics.get("arrival_time", now),
        }
        if _per_prompt(body.return_logprob, i):
            self.add_logprobs(meta, body, i, prompt_ids, out, o, prefill_only)
        if tools is not None:
            text = self.with_tool_calls(meta, tools, o)
        return {"text": text, "output_ids": token_ids, "meta_info": meta}

    def with_tool_calls(self, meta: dict, tools: tuple[ToolRequest, ToolParser], o) -> str:
        """The text without the special tokens the parser needed; the calls, once it ends."""
        request, parser = tools
        if o.finished:
            found = parser.extract_tool_calls(o.text, request.parallel)
            meta["tool_calls"] = [call.model_dump() for call in found.tool_calls]
        text = o.text
        for special in self.serving.special_texts:
            text = text.replace(special, "")
        return text

    @staticmethod
    def finish_reason(o: CompletionOutput, token_ids: list[int], prefill_only: bool):
        if o.finish_reason is None:
            return None
        if prefill_only or o.finish_reason == "length":
            return {"type": "length", "length": len(token_ids)}
        if o.finish_reason == "stop":
            matched = o.stop_reason if o.stop_reason is not None else (token_ids or [None])[-1]
            return {"type": "stop", "matched": matched}
        return {"type": "abort", "message": o.finish_reason}

    def add_logprobs(self, meta, body, i, prompt_ids, out, o, prefill_only) -> None:
        with_text = body.return_text_in_logprobs
        top_n = _per_prompt(body.top_logprobs_num, i) or 0
        start = _per_prompt(body.logprob_start_len, i)
        start = len(prompt_ids) - 1 if start is None or start < 0 else min(start, len(prompt_ids))
        prompt_lps = out.prompt_logprobs or [None] * len(prompt_ids)
        positions = range(start, len(prompt_ids))
        meta["input_token_logprobs"] = [
            self._entry(prompt_lps[p], prompt_ids[p], with_text) for p in positions
        ]
        meta["input_top_logprobs"] = [self._top(prompt_lps[p], top_n, with_text) for p in positions]
        lps = [] if prefill_only else (o.logprobs or [])
        meta["output_token_logprobs"] = [
            self._entry(lp, t, with_text) for lp, t in zip(lps, o.token_ids, strict=False)
        ]
        meta["output_top_logprobs"] = [self._top(lp, top_n, with_text) for lp in lps]

    def _entry(self, logprobs: dict[int, float] | None, token_id: int, with_text: bool) -> list:
        value = None if logprobs is None else logprobs.get(token_id)
        return [value, token_id, self.serving.token_str(token_id) if with_text else None]

    def _top(self, logprobs: dict[int, float] | None, n: int, with_text: bool):
        if logprobs is None or n <= 0:
            return None
        top = top_logprobs(logprobs, n)
        return [[v, t, self.serving.token_str(t) if with_text else None] for t, v in top]


# ---- routes -----------------------------------------------------------------------------------
def sglang_router(serving) -> APIRouter:
    router = APIRouter()
    sgl = SGLangServing(serving)

    @router.post("/generate")
    @router.put("/generate", operation_id="generate_put")
    async def generate(body: GenerateReqInput, raw: Request):
        prompts, batch = sgl.prompts(body)
        body.check_batch(len(prompts))
        params = [sgl.params(body, i) for i in range(len(prompts))]
        request, parser = sgl.tool_parser(body, params)
        tools = (request, parser) if parser is not None else None
        prefill_only = [
            getattr(_per_prompt(body.sampling_params, i), "max_new_tokens", None) == 0
            for i in range(len(prompts))
        ]
        field = "text" if body.text is not None else "input_ids"
        for prompt, p in zip(prompts, params, strict=True):
            serving.check_fits([prompt], p, field)
        serving.check_admission()
        base = body.rid if isinstance(body.rid, str) else random_id("generate")
        rids = [f"{base}-{i}" for i in range(len(prompts))]
        loras = [
            serving.check_model(_per_prompt(body.lora_path, i), "lora_path")
            for i in range(len(prompts))
        ]
        streams = [
            serving.start(rid, [prompt], p, lora_name=lora)[0]
            for rid, prompt, p, lora in zip(rids, prompts, params, loras, strict=True)
        ]
        many = batch or params[0].n > 1
        if body.stream:
            return sse_response(
                _stream(sgl, body, prompts, rids, streams, prefill_only, many, tools)
            )
        finals = await serving.collect(raw, streams)
        results = [
            sgl.result(body, i, rids[i], prompts[i][1], out, o, prefill_only[i], tools)
            for i, out in enumerate(finals)
            for o in out.outputs
        ]
        return results if many else results[0]

    @router.get("/get_model_info")
    @router.get("/model_info")
    async def model_info() -> dict:
        tok = serving.tokenizer
        return {
            "model_path": serving.engine.model,
            "tokenizer_path": str(tok.model_dir) if tok is not None else None,
            "served_model_name": serving.model_name,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "chat_template_roles": chat_template_roles(tok),
        }

    @router.get("/server_info")
    @router.get("/get_server_info")
    async def server_info() -> dict:
        limits = serving.engine.limits
        return {
            "model_path": serving.engine.model,
            "served_model_name": serving.model_name,
            "context_length": limits.max_model_len,
            "max_running_requests": limits.max_num_seqs,
            "max_total_num_tokens": limits.num_kv_pages * limits.block_size,
            "page_size": limits.block_size,
            "internal_states": [dict(serving.engine.stats)],
            "version": pagedserve.__version__,
            "engine": "pagedserve",
            "frontend": "python",
        }

    @router.post("/flush_cache")
    @router.get("/flush_cache", operation_id="flush_cache_get")
    async def flush_cache() -> Response:
        stats = serving.engine.stats
        busy = stats.get("num_requests_running", 0) + serving.engine.num_waiting
        if busy:
            return Response(
                "Flush cache failed: there are running or waiting requests.\n", status_code=400
            )
        await serving.engine.reset_prefix_cache()
        return Response("Cache flushed.\n", status_code=200)

    return router


async def _stream(
    sgl, body, prompts, rids, streams, prefill_only, many, tools
) -> AsyncIterator[str]:
    """Each chunk carries the text so far, as SGLang's server streams it."""
    async for p, out in merge_streams(streams):
        n = len(out.outputs)
        for o in out.outputs:
            result = sgl.result(body, p, rids[p], prompts[p][1], out, o, prefill_only[p], tools)
            if many:
                result["index"] = p * n + o.index
            yield f"data: {json.dumps(result)}\n\n"


# ---- role blocks ------------------------------------------------------------------------------
_SENTINEL = "\x00PAGEDSERVE_CONTENT\x00"


def chat_template_roles(tokenizer) -> dict[str, Any] | None:
    """What the model's chat template puts around each role's content: ``begin`` (before the
    first message) and ``[prefix, suffix]`` per role (``tool`` too, where the template knows
    tool results), for frontends that build chat text piece
    by piece (pagedserve.lang's role blocks). None without a chat template."""
    if tokenizer is None or tokenizer.chat_template is None:
        return None
    try:
        begin = tokenizer.apply_chat_template([], add_generation_prompt=False)
        roles = {
            role: _role_pieces(tokenizer, role, begin) for role in ("system", "user", "assistant")
        }
        generation = tokenizer.apply_chat_template([], add_generation_prompt=True)[len(begin) :]
    except Exception:  # noqa: BLE001 - a template that cannot render pieces: no role blocks
        return None
    try:  # a tool result's turn, where the template has one
        roles["tool"] = _role_pieces(tokenizer, "tool", begin)
    except Exception:  # noqa: BLE001
        pass
    return {"begin": begin, "roles": roles, "generation_prompt": generation}


def _role_pieces(tokenizer, role: str, begin: str) -> list[str]:
    text = tokenizer.apply_chat_template(
        [{"role": role, "content": _SENTINEL}], add_generation_prompt=False
    )
    head, _, tail = text.partition(_SENTINEL)
    return [head[len(begin) :] if head.startswith(begin) else head, tail]
