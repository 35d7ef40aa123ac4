"""``POST /v1/chat/completions``: chat completions over the model's chat template, whole or
streamed.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from functools import partial

from fastapi import APIRouter, Request

from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.server.protocol import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatResponseMessage,
    DeltaMessage,
    random_id,
)
from pagedserve.server.sampling import chat_sampling_params
from pagedserve.server.serving import OpenAIServing, Prompt, usage_info
from pagedserve.server.streaming import merge_streams, sse_chunk, sse_response
from pagedserve.server.structured import attach_structured_outputs


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
        return sse_response(_chat_stream(serving, body, request_id, prompt, streams[0]))
    (final,) = await serving.collect(raw, streams)
    choices = [_chat_choice(serving, body, o) for o in final.outputs]
    return ChatCompletionResponse(
        id=request_id,
        model=serving.model_name,
        choices=choices,
        usage=usage_info([prompt], [final]),
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

    chunk = partial(sse_chunk, ChatCompletionChunk, request_id, created, serving.model_name)

    yield chunk(
        [
            ChatCompletionStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))
            for i in range(body.n)
        ]
    )
    final = None
    async for _, out in merge_streams([stream]):
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
        yield chunk([], usage_info([prompt], [final]))


def chat_router(serving: OpenAIServing) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/chat/completions", response_model=ChatCompletionResponse)
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        return await create_chat_completion(serving, body, raw)

    return router
