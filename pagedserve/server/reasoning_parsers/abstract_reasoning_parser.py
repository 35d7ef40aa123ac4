"""What every reasoning parser shares, and the registry that names them (vLLM's ReasoningParser
and ReasoningParserManager: ``--reasoning-parser NAME``).

A reasoning parser splits a thinking model's output into its thinking and its answer, for the
whole output and for the output so far (streaming: the thinking grows until the answer starts,
and text that may still be the end-of-thinking mark is held back).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pagedserve.sampling_params import SamplingParams


class ReasoningParser:
    """One request's parser. ``prompt`` is the text the chat template made (a template may open
    the thinking itself)."""

    def __init__(self, tokenizer: Any, prompt: str):
        self.tokenizer = tokenizer
        self.prompt = prompt

    def adjust_request(self, params: SamplingParams) -> None:
        """Keep the special tokens in the text when the marks are special tokens."""

    def split(self, text: str, final: bool) -> tuple[str | None, str | None]:
        """(the thinking so far or None, the answer so far or None while still thinking)."""
        raise NotImplementedError

    def grammar_prefix(self) -> tuple[str, str] | None:
        """(Lark rules, expression) of the thinking before a constrained answer, or None when
        the output starts with the answer."""
        return None


class ReasoningParserManager:
    reasoning_parsers: dict[str, type[ReasoningParser]] = {}

    @classmethod
    def register_module(
        cls, *names: str
    ) -> Callable[[type[ReasoningParser]], type[ReasoningParser]]:
        def register(parser: type[ReasoningParser]) -> type[ReasoningParser]:
            for name in names:
                cls.reasoning_parsers[name] = parser
            return parser

        return register

    @classmethod
    def get_reasoning_parser(cls, name: str) -> type[ReasoningParser]:
        if name not in cls.reasoning_parsers:
            raise ValueError(
                f"--reasoning-parser {name}: no such parser; the parsers are "
                f"{', '.join(sorted(cls.reasoning_parsers))}"
            )
        return cls.reasoning_parsers[name]
