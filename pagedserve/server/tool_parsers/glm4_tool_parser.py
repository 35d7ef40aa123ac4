"""``--tool-call-parser glm4``: GLM-4-9B-chat's and GLM-4-0414's own form, which vLLM's and
SGLang's GLM parsers (the GLM-4.5 XML form) do not read.

The model answers a call with the function's name right after ``<|assistant|>``, a newline, then
the JSON arguments, and ends the turn on ``<|observation|>`` (the result comes back as an
``<|observation|>`` turn)::

    <|assistant|>get_weather
    {"location": "Paris"}<|observation|>

Several calls in one turn are several such pieces, each opened by ``<|assistant|>`` (as THUDM's
OpenAI server renders a message with several ``tool_calls``). A piece whose first line is not a
declared function's name is text; so is one whose arguments are not a JSON object. A name alone
before ``<|assistant|>`` or ``<|observation|>``, or followed by nothing but its newline, is a
call without arguments.
"""

from __future__ import annotations

import json

from pagedserve.server.protocol import ChatCompletionToolsParam
from pagedserve.server.tool_parsers.abstract_tool_parser import (
    CallSegment,
    Segment,
    TextSegment,
    ToolParser,
    ToolParserManager,
    partial_mark_length,
)

CALL_START = "<|assistant|>"  # opens each call of a turn after the first
CALL_END = "<|observation|>"  # the turn ends in a call
TURN_ENDS = (CALL_END, "<|user|>", "<|endoftext|>")
MARKERS = (CALL_START, *TURN_ENDS)
NEWLINE = "\n"
HELD = TextSegment("")  # text that may still open a call: nothing of it is shown yet


@ToolParserManager.register_module("glm4")
class Glm4ToolParser(ToolParser):
    def segments(self, text: str, final: bool) -> list[Segment]:
        text, end = _cut_at_turn_end(text)
        if not final and end is None:  # a marker may be arriving in pieces: wait for it
            text = text[: len(text) - partial_mark_length(text, *MARKERS)]
        pieces = text.split(CALL_START)
        out: list[Segment] = []
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            complete = final or end is not None or not last
            before_call = not last or end == CALL_END
            out.append(self._piece(piece, complete, before_call))
        return [seg for seg in out if seg is not HELD]

    def _piece(self, piece: str, complete: bool, before_call: bool) -> Segment:
        body = piece.lstrip()
        first, newline, rest = body.partition("\n")
        if not newline:  # the name's line is not over
            if complete:
                if first.rstrip() in self.tools and before_call:
                    return CallSegment(first.rstrip(), "{}", piece)
                return TextSegment(piece)
            stem = body.rstrip()  # a name may be followed by spaces before its newline
            held = any(name.startswith(body) or name == stem for name in self.tools)
            return HELD if held else TextSegment(piece)
        if first.rstrip() not in self.tools:
            return TextSegment(piece)
        arguments = rest.strip()
        if complete:
            return CallSegment(first.rstrip(), arguments or "{}", piece)
        if not arguments:
            return HELD
        if not arguments.startswith("{"):
            return TextSegment(piece)
        return CallSegment(first.rstrip(), arguments, piece)

    # ---- constraining --------------------------------------------------------------------------
    def grammar(
        self,
        tools: list[ChatCompletionToolsParam],
        parallel: bool,
        enforced: set[str] | None = None,
    ) -> str:
        rules = [
            f"fn_{i}: {json.dumps(t.function.name + NEWLINE)} "
            + self.json_rule(self.arguments_schema(t, enforced))
            for i, t in enumerate(tools)
        ]
        rules.append("call: " + " | ".join(f"fn_{i}" for i in range(len(tools))))
        if parallel and self.has_special(CALL_START):  # (a newline after it, as the demo model's)
            rules.append(f"calls: call ({self.token(CALL_START)} {json.dumps(NEWLINE)}? call)*")
        else:
            rules.append("calls: call")
        return "\n".join(rules)

    def free_text(self, tools: list[ChatCompletionToolsParam]) -> str:
        names = "|".join(t.function.name for t in tools)
        return rf"/(?s:.*)/ & ~/[ \t\n]*({names})\n(?s:.*)/"


def _cut_at_turn_end(text: str) -> tuple[str, str | None]:
    """The text before the token that ended the turn, and that token (None: not ended)."""
    found = [(i, end) for end in TURN_ENDS if (i := text.find(end)) >= 0]
    if not found:
        return text, None
    i, end = min(found)
    return text[:i], end
