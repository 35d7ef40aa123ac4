"""What a chat choice's text becomes: its thinking (``--reasoning-parser``), its answer, and the
tool calls in the answer (the request's tool-call parser), for the whole text (``parse``) or as
streamed deltas (``delta``, called with the text so far after each step).

Streaming sends each piece once it can no longer change: a call's id, type and name when its
first line is complete, then its arguments as they grow; text that may still open a call, and
an answer that is only whitespace so far, wait. The deltas add up to what ``parse`` returns for
the same text, but for one case: a call already streamed whose arguments end up not being JSON
stays a call (logged), where ``parse`` returns its text.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from pagedserve.server.protocol import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from pagedserve.server.reasoning_parsers import ReasoningParser
from pagedserve.server.tool_parsers import CallSegment, ToolParser

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class ParsedOutput:
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)
    reasoning: str | None = None


class ChatOutputParser:
    """One choice's parser. ``specials``: special-token texts to drop from what the client sees
    (the parsers had special tokens kept in the text; the client asked for them skipped)."""

    def __init__(
        self,
        tool_parser: ToolParser | None = None,
        reasoning_parser: ReasoningParser | None = None,
        parallel: bool = True,
        specials: tuple[str, ...] = (),
        include_reasoning: bool = True,
    ):
        self.tool_parser = tool_parser
        self.reasoning_parser = reasoning_parser
        self.parallel = parallel
        self.specials = specials
        self.include_reasoning = include_reasoning
        self._reasoning = ""
        self._content = ""
        self._calls: list[str] = []  # each streamed call's arguments, as sent

    # ---- the whole text ------------------------------------------------------------------------
    def parse(self, text: str) -> ParsedOutput:
        reasoning, answer = self._split(text, final=True)
        if answer is None:
            return ParsedOutput(None, [], self._shown_reasoning(reasoning))
        if self.tool_parser is None:
            return ParsedOutput(self._clean(answer), [], self._shown_reasoning(reasoning))
        found = self.tool_parser.extract_tool_calls(answer, self.parallel)
        content = None if found.content is None else self._clean(found.content)
        return ParsedOutput(content, found.tool_calls, self._shown_reasoning(reasoning))

    # ---- streaming -----------------------------------------------------------------------------
    def delta(self, text: str, finished: bool) -> DeltaMessage | None:
        """What the text so far adds to what was sent; None when nothing."""
        reasoning, answer = self._split(text, final=finished)
        out = DeltaMessage()
        if reasoning is not None and self.include_reasoning:
            piece = _growth(self._reasoning, self._clean(reasoning))
            if piece:
                self._reasoning += piece
                out.reasoning_content = out.reasoning = piece
        if answer is not None:
            content, calls = self._answer_so_far(answer, finished)
            if content.strip() or self.tool_parser is None or (finished and not calls):
                piece = _growth(self._content, content)
                if piece:
                    self._content += piece
                    out.content = piece
            out.tool_calls = self._call_deltas(calls) or None
        if out.content is None and out.reasoning is None and out.tool_calls is None:
            return None
        return out

    @property
    def called(self) -> bool:
        """Whether a call was streamed."""
        return bool(self._calls)

    def _answer_so_far(self, answer: str, finished: bool) -> tuple[str, list[CallSegment]]:
        if self.tool_parser is None:
            return self._clean(answer), []
        text, calls = [], []
        for seg in self.tool_parser.segments(answer, final=finished):
            if not isinstance(seg, CallSegment):
                text.append(seg.text)
                continue
            error = seg.error() if finished else None
            if error is not None and len(calls) >= len(self._calls):
                logger.warning("not a tool call of %s, kept as text: %s", seg.name, error)
                text.append(seg.source)
                continue
            if error is not None:
                logger.warning("a streamed tool call of %s is not valid: %s", seg.name, error)
            calls.append(seg)
        return self._clean("".join(text)), calls if self.parallel else calls[:1]

    def _call_deltas(self, calls: list[CallSegment]) -> list[DeltaToolCall]:
        deltas = []
        for index, seg in enumerate(calls):
            if index == len(self._calls):
                call = ToolCall(function=FunctionCall(name=seg.name))
                self._calls.append(seg.arguments)
                function = DeltaFunctionCall(name=seg.name, arguments=seg.arguments)
                deltas.append(
                    DeltaToolCall(index=index, id=call.id, type="function", function=function)
                )
                continue
            piece = _growth(self._calls[index], seg.arguments)
            if piece:
                self._calls[index] += piece
                deltas.append(
                    DeltaToolCall(index=index, function=DeltaFunctionCall(arguments=piece))
                )
        return deltas

    # ---- pieces --------------------------------------------------------------------------------
    def _split(self, text: str, final: bool) -> tuple[str | None, str | None]:
        if self.reasoning_parser is None:
            return None, text
        return self.reasoning_parser.split(text, final)

    def _shown_reasoning(self, reasoning: str | None) -> str | None:
        if reasoning is None or not self.include_reasoning:
            return None
        return self._clean(reasoning)

    def _clean(self, text: str) -> str:
        for special in self.specials:
            text = text.replace(special, "")
        return text


def _growth(sent: str, now: str) -> str:
    """What ``now`` adds to ``sent`` (nothing if it does not extend it)."""
    return now[len(sent) :] if now.startswith(sent) else ""
