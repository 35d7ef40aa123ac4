"""``--reasoning-parser glm4``: GLM-Z1's thinking, ``<think>...</think>`` before the answer.

GLM-Z1-0414's chat template opens ``<think>`` itself (the generation prompt ends with it), so the
output carries only ``</think>``: everything before it is thinking, everything after the answer.
An output that never closes its thinking (cut by ``max_tokens``) is all thinking. A prompt that
does not open ``<think>`` (GLM-4-0414, or a template with thinking off) starts with the answer,
unless the output itself opens ``<think>``.
"""

from __future__ import annotations

import json

from pagedserve.sampling_params import SamplingParams
from pagedserve.server.reasoning_parsers.abstract_reasoning_parser import (
    ReasoningParser,
    ReasoningParserManager,
)
from pagedserve.server.tool_parsers.abstract_tool_parser import (
    is_special_token,
    partial_mark_length,
)

THINK_START, THINK_END = "<think>", "</think>"


@ReasoningParserManager.register_module("glm4")
class Glm4ReasoningParser(ReasoningParser):
    @property
    def opened_by_prompt(self) -> bool:
        return self.prompt.rstrip().endswith(THINK_START)

    def adjust_request(self, params: SamplingParams) -> None:
        if is_special_token(self.tokenizer, THINK_END):
            params.skip_special_tokens = False

    def split(self, text: str, final: bool) -> tuple[str | None, str | None]:
        if not self.opened_by_prompt:
            head = text.lstrip()
            if not head.startswith(THINK_START):
                if not final and head and THINK_START.startswith(head):
                    return None, None  # may be opening its thinking
                return None, text
            text = head[len(THINK_START) :]
        end = text.find(THINK_END)
        if end >= 0:
            return text[:end], text[end + len(THINK_END) :]
        if final:
            return text, None
        return text[: len(text) - partial_mark_length(text, THINK_END)], None

    def grammar_prefix(self) -> tuple[str, str] | None:
        """The thinking, its end, and the newlines the answer may start with."""
        if not self.opened_by_prompt:
            return None
        newlines = json.dumps("\n") + "*"
        if is_special_token(self.tokenizer, THINK_END):
            return "THINKING: /(?s:.*)/", f"THINKING {THINK_END} {newlines}"
        # text up to and with the mark, as one piece: a greedy token would swallow the mark
        return f"thinking[stop={json.dumps(THINK_END)}]: /(?s:.*)/", f"thinking {newlines}"
