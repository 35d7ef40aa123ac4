"""``POST /tokenize`` and ``POST /detokenize``, as vLLM's server has them. ``/tokenize`` with
``messages`` (and ``tools``) also answers the text the chat template made of them (``prompt``,
as TGI's ``/chat_tokenize`` does): what the model is shown."""

from __future__ import annotations

from fastapi import APIRouter

from pagedserve.server.errors import bad_request
from pagedserve.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from pagedserve.server.serving import OpenAIServing


def tokenization_router(serving: OpenAIServing) -> APIRouter:
    """The routes, as plain functions registered on the router (a decorated one is out of
    mutmut's reach); each one's response model is its return annotation."""

    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        serving.check_model(body.model)
        text = None
        if body.messages is not None:
            text, ids = serving.chat_prompt(body.messages, body.add_generation_prompt, body.tools)
        elif body.prompt is not None:
            ids = serving.require_tokenizer().encode(body.prompt, body.add_special_tokens)
        else:
            raise bad_request("send 'prompt' (a string) or 'messages'", "prompt")
        return TokenizeResponse(
            count=len(ids), max_model_len=serving.max_model_len, tokens=ids, prompt=text
        )

    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        serving.check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < serving.vocab_size]
        if bad:
            raise bad_request(
                f"token id {bad[0]} is outside the vocabulary [0, {serving.vocab_size})", "tokens"
            )
        return DetokenizeResponse(prompt=serving.require_tokenizer().decode(body.tokens))

    router = APIRouter()
    router.add_api_route("/tokenize", tokenize, methods=["POST"])
    router.add_api_route("/detokenize", detokenize, methods=["POST"])
    return router
