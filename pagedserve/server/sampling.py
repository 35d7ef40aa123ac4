"""OpenAI and vLLM request fields -> the engine's ``SamplingParams``, for completions and chat.

Every sampling field a request may carry is mapped here and nowhere else; a field left out is the
engine's default, as in vLLM. Bad values become a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

from pagedserve.sampling_params import SamplingParams
from pagedserve.server.errors import bad_request
from pagedserve.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields

MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
OPTIONAL_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def completion_sampling_params(
    body: CompletionRequest, max_num_seqs: int, vocab_size: int, max_logprobs: int = MAX_LOGPROBS
) -> SamplingParams:
    check_logprobs(body.logprobs, "logprobs", max_logprobs)
    if body.suffix is not None:
        raise bad_request("suffix is not supported; put the whole text in the prompt", "suffix")
    prompt_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
    return sampling_params(
        body,
        max_num_seqs,
        vocab_size,
        max_tokens=body.max_tokens,
        logprobs=body.logprobs,
        prompt_logprobs=prompt_logprobs,
    )


def chat_sampling_params(
    body: ChatCompletionRequest,
    max_num_seqs: int,
    vocab_size: int,
    max_logprobs: int = MAX_LOGPROBS,
) -> SamplingParams:
    check_logprobs(body.top_logprobs, "top_logprobs", max_logprobs)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    max_tokens = body.max_tokens
    if body.max_completion_tokens is not None:  # OpenAI's newer name wins
        max_tokens = body.max_completion_tokens
    return sampling_params(body, max_num_seqs, vocab_size, max_tokens=max_tokens, logprobs=logprobs)


def sampling_params(
    body: SamplingFields, max_num_seqs: int, vocab_size: int, **fields: Any
) -> SamplingParams:
    """The fields both endpoints share, plus the endpoint's own ``fields``."""
    if body.n > max_num_seqs:
        raise bad_request(
            f"n={body.n} is more than this server's --max-num-seqs {max_num_seqs}; lower n", "n"
        )
    optional = {k: getattr(body, k) for k in OPTIONAL_FIELDS if getattr(body, k) is not None}
    try:
        return SamplingParams(
            n=body.n,
            seed=body.seed,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            logit_bias=logit_bias(body.logit_bias, vocab_size),
            stop=body.stop or [],
            stop_token_ids=body.stop_token_ids or [],
            ignore_eos=body.ignore_eos,
            min_tokens=body.min_tokens,
            skip_special_tokens=body.skip_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
            **optional,
            **fields,
        )
    except ValueError as e:
        raise bad_request(str(e), str(e).split("=", 1)[0]) from e


def logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    """OpenAI's string token-id keys as ints, each bias clipped to [-100, 100]."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        token = int(key) if key.isascii() and key.isdigit() else -1
        if not 0 <= token < vocab_size:
            raise bad_request(
                f"logit_bias key {key!r} is not a token id in [0, {vocab_size})", "logit_bias"
            )
        out[token] = max(-100.0, min(100.0, value))
    return out


def check_logprobs(value: int | None, param: str, max_logprobs: int = MAX_LOGPROBS) -> None:
    if value is not None and not 0 <= value <= max_logprobs:
        raise bad_request(
            f"{param}={value} must be in [0, {max_logprobs}] (this server's --max-logprobs)", param
        )
