"""Per-request sampling settings, named and defaulted as vLLM's ``SamplingParams``."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
FLOAT_FIELDS = (
    "temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
)  # fmt: skip
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # what a torch.Generator can be started from
INT32_MAX = 2**31 - 1


@dataclass
class StructuredOutputsParams:
    """One constraint on the output, as vLLM's ``StructuredOutputsParams``: a JSON schema, a
    regular expression, a choice among strings, a grammar (Lark or GBNF/EBNF), or any JSON
    object. Plain data: it travels with the request to the engine core, which compiles it."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured outputs take exactly one of {', '.join(STRUCTURED_KINDS)}; got "
                f"{', '.join(given) or 'none'}"
            )
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) for c in self.choice)
        ):
            raise ValueError("choice must be a non-empty list of strings")

    @property
    def kind(self) -> str:
        return next(k for k in STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as one string: with ``kind``, the key its compiled grammar is cached by."""
        value = getattr(self, self.kind)
        if self.kind == "json" and isinstance(value, str):
            value = json.loads(value)
        if self.kind in ("json", "choice"):  # key order kept: it is the properties' order
            return json.dumps(value)
        return "" if self.kind == "json_object" else value

    @property
    def key(self) -> tuple[str, str]:
        return self.kind, self.spec


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) keeps the whole vocabulary
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    logprobs: int | None = (
        None  # top-N logprobs per generated token (the chosen one always included)
    )
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):  # from the wire
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        self.verify()

    def verify(self) -> None:
        """Raise ``ValueError`` naming the field, its value and the allowed range: no value that
        torch cannot hold (NaN, infinity, integers past 64 bits) reaches the sampler."""
        for name in FLOAT_FIELDS:
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name}={getattr(self, name)!r} must be a finite number")
        bias = self.logit_bias or {}
        if not all(math.isfinite(v) for v in bias.values()):
            raise ValueError(f"logit_bias={bias!r} must hold finite numbers")
        checks = [
            (self.n >= 1, "n", self.n, "must be at least 1"),
            (self.temperature >= 0.0, "temperature", self.temperature, "must be >= 0"),
            (0.0 < self.top_p <= 1.0, "top_p", self.top_p, "must be in (0, 1]"),
            (
                self.top_k == -1 or 1 <= self.top_k <= INT32_MAX,
                "top_k",
                self.top_k,
                f"must be -1 (off) or in [1, {INT32_MAX}]",
            ),
            (
                self.seed is None or INT64_MIN <= self.seed <= INT64_MAX,
                "seed",
                self.seed,
                f"must be in [{INT64_MIN}, {INT64_MAX}]",
            ),
            (0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "must be in [0, 1]"),
            (
                -2.0 <= self.presence_penalty <= 2.0,
                "presence_penalty",
                self.presence_penalty,
                "must be in [-2, 2]",
            ),
            (
                -2.0 <= self.frequency_penalty <= 2.0,
                "frequency_penalty",
                self.frequency_penalty,
                "must be in [-2, 2]",
            ),
            (
                self.repetition_penalty > 0.0,
                "repetition_penalty",
                self.repetition_penalty,
                "must be > 0",
            ),
            (
                self.max_tokens is None or self.max_tokens >= 1,
                "max_tokens",
                self.max_tokens,
                "must be at least 1",
            ),
            (self.min_tokens >= 0, "min_tokens", self.min_tokens, "must be >= 0"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                "min_tokens",
                self.min_tokens,
                f"must not exceed max_tokens ({self.max_tokens})",
            ),
            (
                self.logprobs is None or self.logprobs >= 0,
                "logprobs",
                self.logprobs,
                "must be >= 0",
            ),
            (
                self.prompt_logprobs is None or self.prompt_logprobs >= 0,
                "prompt_logprobs",
                self.prompt_logprobs,
                "must be >= 0",
            ),
        ]
        for ok, name, value, rule in checks:
            if not ok:
                raise ValueError(f"{name}={value!r} {rule}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
