"""``POST /v1/completions``: text completions, whole or streamed, with echo and logprobs."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from functools import partial

from fastapi import APIRouter, Request

from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.server.errors import bad_request
from pagedserve.server.protocol import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    random_id,
)
from pagedserve.server.sampling import completion_sampling_params
from pagedserve.server.serving import OpenAIServing, Prompt, TextOffsets, usage_info
from pagedserve.server.streaming import merge_streams, sse_chunk, sse_response
from pagedserve.server.structured import attach_structured_outputs


def _completion_choice(
    serving: OpenAIServing,
    body: CompletionRequest,
    prompt: Prompt,
    prompt_output: RequestOutput,
    o: CompletionOutput,
    index: int,
) -> CompletionChoice:
    prefix = serving.prompt_text(prompt) if body.echo else ""
    logprobs = None
    if body.logprobs is not None:
        ids = prompt[1]
        logprobs = CompletionLogprobs()
        if body.echo:
            logprobs = serving.completion_logprobs(
                ids,
                prompt_output.prompt_logprobs,  # asked for with echo and logprobs
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
    lora_name = serving.check_model(body.model)
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
    session = serving.session_key(raw, body.user)
    streams = serving.start(request_id, prompts, params, session, lora_name)
    if body.stream:
        return sse_response(_completion_stream(serving, body, request_id, prompts, streams))
    finals = await serving.collect(raw, streams)
    choices = [
        _completion_choice(serving, body, prompts[p], out, o, p * body.n + o.index)
        for p, out in enumerate(finals)
        for o in out.outputs
    ]
    return CompletionResponse(
        id=request_id,
        model=serving.model_for(body.model),
        choices=choices,
        usage=usage_info(prompts, finals),
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

    chunk = partial(sse_chunk, CompletionChunk, request_id, created, serving.model_for(body.model))

    async for p, out in merge_streams(streams):
        for o in out.outputs:
            index = p * body.n + o.index
            if index not in sent_text:
                sent_text[index], sent_tokens[index] = 0, 0
                if body.echo:
                    yield chunk(
                        [CompletionChoice(index=index, text=serving.prompt_text(prompts[p]))]
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
        yield chunk([], usage_info(prompts, [finals[p] for p in sorted(finals)]))


def completions_router(serving: OpenAIServing) -> APIRouter:
    async def completions(body: CompletionRequest, raw: Request):
        return await create_completion(serving, body, raw)

    router = APIRouter()  # a plain function registered: a decorated one is out of mutmut's reach
    router.add_api_route(
        "/v1/completions", completions, methods=["POST"], response_model=CompletionResponse
    )
    return router
