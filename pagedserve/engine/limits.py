"""What a request may ask of one engine: the checks both the engine and the HTTP process run
before a request is queued (the HTTP process holds only these numbers, not the engine)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pagedserve.config import UsageContext
from pagedserve.sampling_params import SamplingParams


class RequestRejectedError(ValueError):
    """A request that can never be served with this engine's limits; the message gives the numbers,
    ``param`` the request field at fault, and ``too_long`` whether the request is longer than the
    engine can hold (the server's ``context_length_exceeded``) rather than invalid."""

    def __init__(self, message: str, param: str = "prompt", too_long: bool = False):
        super().__init__(message)
        self.param, self.too_long = param, too_long


@dataclass(frozen=True)
class EngineLimits:
    max_model_len: int
    vocab_size: int
    num_kv_pages: int
    block_size: int
    max_num_seqs: int
    usage_context: UsageContext = UsageContext.OPENAI_API_SERVER

    def to_dict(self) -> dict:
        return {**asdict(self), "usage_context": self.usage_context.value}

    @classmethod
    def from_dict(cls, d: dict) -> EngineLimits:
        return cls(**{**d, "usage_context": UsageContext(d["usage_context"])})

    def can_fit(self, num_tokens: int) -> bool:
        """Whether a sequence of ``num_tokens`` could ever fit in the whole KV cache."""
        return -(-num_tokens // self.block_size) <= self.num_kv_pages

    def check_request(self, prompt_ids: list[int], params: SamplingParams) -> SamplingParams:
        """The params this request runs with (``max_tokens`` filled in), or
        ``RequestRejectedError`` saying why it can never run. Changes nothing."""
        if params.max_tokens is None:
            room = max(self.max_model_len - len(prompt_ids), 1)
            if params.min_tokens > room:
                ctx = self.usage_context
                raise RequestRejectedError(
                    f"min_tokens={params.min_tokens} does not fit: the prompt's "
                    f"{len(prompt_ids)} tokens leave room for {room} in max_model_len "
                    f"{self.max_model_len}; lower min_tokens, shorten the prompt, or "
                    f"{ctx.start_with} a larger {ctx.name_of('max_model_len')}",
                    "min_tokens",
                    too_long=True,
                )
            params = SamplingParams(**{**vars(params), "max_tokens": room})
        self._check_fits(prompt_ids, params)
        return params

    def _check_fits(self, prompt_ids: list[int], params: SamplingParams) -> None:
        n_prompt, total = len(prompt_ids), len(prompt_ids) + params.max_tokens
        if n_prompt == 0:
            raise RequestRejectedError("the prompt is empty; send at least one token")
        if params.n > self.max_num_seqs:  # its n sequences could never run at once
            raise RequestRejectedError(
                f"n={params.n} sequences cannot run at once with "
                f"{self.usage_context.name_of('max_num_seqs')} {self.max_num_seqs}; lower n or "
                f"{self.usage_context.start_with} a larger {self.usage_context.name_of('max_num_seqs')}",
                "n",
            )
        vocab = self.vocab_size
        for what, param, ids in (
            ("prompt token id", "prompt", prompt_ids),
            ("stop_token_ids", "stop_token_ids", params.stop_token_ids),
        ):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise RequestRejectedError(
                    f"{what} {bad[0]} is outside the vocabulary [0, {vocab})", param
                )
        ctx = self.usage_context
        if total > self.max_model_len:
            raise RequestRejectedError(
                f"this request needs {total} tokens ({n_prompt} in the prompt + max_tokens "
                f"{params.max_tokens}), but max_model_len is {self.max_model_len}; shorten the "
                f"prompt, lower max_tokens, or {ctx.start_with} a larger "
                f"{ctx.name_of('max_model_len')}",
                too_long=True,
            )
        if not self.can_fit(total):
            capacity = self.num_kv_pages * self.block_size
            raise RequestRejectedError(
                f"this request needs {total} tokens ({n_prompt} in the prompt + max_tokens "
                f"{params.max_tokens}), but the whole KV cache holds {capacity} tokens "
                f"({self.num_kv_pages} pages of {self.block_size}); lower max_tokens or "
                f"{ctx.start_with} more KV cache (a higher "
                f"{ctx.name_of('gpu_memory_utilization')}, more {ctx.name_of('num_kv_pages')} "
                f"or a larger {ctx.name_of('device')})",
                too_long=True,
            )
