"""``POST /v1/chat/completions``: chat completions over the model's chat template, whole or
streamed, with OpenAI's tools (``tools.py``) and a thinking model's reasoning
(``--reasoning-parser``); ``chat_output.py`` reads each choice's text.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from functools import partial

from fastapi import APIRouter, Request

from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.server.chat_output import ChatOutputParser
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
from pagedserve.server.tools import ToolRequest, attach_tool_grammar, finish_reason, tool_request

OutputParsers = Callable[[], ChatOutputParser]


def chat_output_parsers(
    serving: OpenAIServing,
    body: ChatCompletionRequest,
    tools: ToolRequest | None,
    prompt: Prompt,
    params: SamplingParams,
) -> OutputParsers:
    """Set up the request's parsing (the parsers keep special tokens in the text; a tool choice
    may constrain the output) and return a maker of one choice's parser."""
    tok = serving.tokenizer
    reasoning = serving.reasoning_parser(tok, prompt[0]) if serving.reasoning_parser else None
    tool_parser = None
    if tools is not None and tools.choice != "none":
        tool_parser = serving.tool_parser_for(tools)
        attach_tool_grammar(params, tools, tool_parser, reasoning)
    shown_skipped = params.skip_special_tokens
    for parser in (tool_parser, reasoning):
        if parser is not None:
            parser.adjust_request(params)
    specials = serving.special_texts if shown_skipped and not params.skip_special_tokens else ()
    parallel = tools.parallel if tools is not None else True
    return partial(
        ChatOutputParser, tool_parser, reasoning, parallel, specials, body.include_reasoning
    )


def _chat_choice(
    serving: OpenAIServing,
    body: ChatCompletionRequest,
    tools: ToolRequest | None,
    parser: ChatOutputParser,
    o: CompletionOutput,
):
    logprobs = None
    if body.logprobs:
        logprobs = serving.chat_logprobs(o.token_ids, o.logprobs or [], body.top_logprobs or 0)
    parsed = parser.parse(o.text)
    message = ChatResponseMessage(
        content=parsed.content,
        tool_calls=parsed.tool_calls,
        reasoning_content=parsed.reasoning,
        reasoning=parsed.reasoning,
    )
    return ChatCompletionChoice(
        index=o.index,
        message=message,
        logprobs=logprobs,
        finish_reason=finish_reason(tools, o.finish_reason, bool(parsed.tool_calls)),
        stop_reason=o.stop_reason,
    )


async def create_chat_completion(serving: OpenAIServing, body: ChatCompletionRequest, raw: Request):
    lora_name = serving.check_model(body.model)
    tools = tool_request(
        body.tools, body.tool_choice, body.parallel_tool_calls, serving.enable_auto_tool_choice
    )
    prompt = serving.chat_prompt(body.messages, body.add_generation_prompt, body.tools)
    params = chat_sampling_params(
        body, serving.max_num_seqs, serving.vocab_size, serving.max_logprobs
    )
    attach_structured_outputs(params, body, serving.tokenizer)
    parsers = chat_output_parsers(serving, body, tools, prompt, params)
    serving.check_fits([prompt], params, "messages")
    serving.check_admission()
    request_id = random_id("chatcmpl")
    session = serving.session_key(raw, body.user)
    streams = serving.start(request_id, [prompt], params, session, lora_name)
    if body.stream:
        return sse_response(
            _chat_stream(serving, body, tools, parsers, request_id, prompt, streams[0])
        )
    (final,) = await serving.collect(raw, streams)
    choices = [_chat_choice(serving, body, tools, parsers(), o) for o in final.outputs]
    return ChatCompletionResponse(
        id=request_id,
        model=serving.model_for(body.model),
        choices=choices,
        usage=usage_info([prompt], [final]),
    )


async def _chat_stream(
    serving: OpenAIServing,
    body: ChatCompletionRequest,
    tools: ToolRequest | None,
    parsers: OutputParsers,
    request_id: str,
    prompt: Prompt,
    stream: AsyncIterator[RequestOutput],
) -> AsyncIterator[str]:
    created = int(time.time())
    choice_parsers = [parsers() for _ in range(body.n)]
    sent_tokens = [0] * body.n
    done = [False] * body.n

    model = serving.model_for(body.model)
    chunk = partial(sse_chunk, ChatCompletionChunk, request_id, created, model)

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
            if done[i]:
                continue
            new_tokens = o.token_ids[sent_tokens[i] :]
            delta = choice_parsers[i].delta(o.text, o.finished)
            if delta is None and not new_tokens and not o.finished:
                continue
            logprobs = None
            if body.logprobs:
                logprobs = serving.chat_logprobs(
                    new_tokens, (o.logprobs or [])[sent_tokens[i] :], body.top_logprobs or 0
                )
            sent_tokens[i] = len(o.token_ids)
            done[i] = o.finished
            called = choice_parsers[i].called
            reason = finish_reason(tools, o.finish_reason, called)
            yield chunk(
                [
                    ChatCompletionStreamChoice(
                        index=i,
                        delta=delta or DeltaMessage(content=None if called else ""),
                        logprobs=logprobs,
                        finish_reason=reason,
                        stop_reason=o.stop_reason,
                    )
                ]
            )
        final = out
    if body.stream_options and body.stream_options.include_usage and final is not None:
        yield chunk([], usage_info([prompt], [final]))


def chat_router(serving: OpenAIServing) -> APIRouter:
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        return await create_chat_completion(serving, body, raw)

    router = APIRouter()  # a plain function registered: a decorated one is out of mutmut's reach
    router.add_api_route(
        "/v1/chat/completions",
        chat_completions,
        methods=["POST"],
        response_model=ChatCompletionResponse,
    )
    return router
