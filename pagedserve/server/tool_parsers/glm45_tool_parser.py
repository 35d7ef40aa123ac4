"""``--tool-call-parser glm45`` (also ``glm47``): the XML form of GLM-4.5 and later, the one vLLM's
and SGLang's GLM parsers read::

    <tool_call>get_weather
    <arg_key>location</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

(GLM-4.7 writes it without the newlines.) Text may come before and between calls. A value is
the raw text between its tags: a string where the schema says the argument is one, else JSON
(a number, a list, an object). The arguments come back as a JSON object, keys in the order the
model wrote them.
"""

from __future__ import annotations

import json
from typing import Any

from pagedserve.engine.structured_output.backend_guidance import strict_schema
from pagedserve.server.protocol import ChatCompletionToolsParam
from pagedserve.server.tool_parsers.abstract_tool_parser import (
    CallSegment,
    Segment,
    TextSegment,
    ToolParser,
    ToolParserManager,
    partial_mark_length,
)

OPEN, CLOSE = "<tool_call>", "</tool_call>"
KEY_OPEN, KEY_CLOSE = "<arg_key>", "</arg_key>"
VALUE_OPEN, VALUE_CLOSE = "<arg_value>", "</arg_value>"
TURN_ENDS = ("<|observation|>", "<|user|>", "<|endoftext|>")


@ToolParserManager.register_module("glm45", "glm47")
class Glm45ToolParser(ToolParser):
    def segments(self, text: str, final: bool) -> list[Segment]:
        found = [i for end in TURN_ENDS if (i := text.find(end)) >= 0]
        complete = final or bool(found)
        text = text[: min(found)] if found else text
        if not complete:  # a turn end may be arriving in pieces: wait for it
            text = text[: len(text) - partial_mark_length(text, *TURN_ENDS)]
        out: list[Segment] = []
        while text:
            start = text.find(OPEN)
            if start < 0:
                shown = text if complete else text[: len(text) - partial_mark_length(text, OPEN)]
                out.append(TextSegment(shown))
                break
            if start:
                out.append(TextSegment(text[:start]))
            end = text.find(CLOSE, start)
            block_end = len(text) if end < 0 else end + len(CLOSE)
            out.append(self._call(text[start:block_end], closed=end >= 0 or complete))
            text = text[block_end:]
        return [seg for seg in out if not (isinstance(seg, TextSegment) and not seg.text)]

    def _call(self, block: str, closed: bool) -> Segment:
        inner = block[len(OPEN) :].removesuffix(CLOSE)
        cut = [i for mark in ("\n", KEY_OPEN) if (i := inner.find(mark)) >= 0]
        if not cut and not closed:
            return TextSegment("")  # the name is not over
        name = (inner[: min(cut)] if cut else inner).strip()
        if name not in self.tools:
            return TextSegment(block)
        pairs, pending = _pairs(inner)  # the name holds no tag: the pairs of what follows it
        items = [
            f"{json.dumps(k, ensure_ascii=False)}: {self._value(name, k, v)}" for k, v in pairs
        ]
        arguments = "{" + ", ".join(items)
        if closed:
            return CallSegment(name, arguments + "}", block)
        if pending is not None:
            key, partial = pending
            arguments += (", " if items else "") + f"{json.dumps(key, ensure_ascii=False)}: "
            if partial is not None and self._type(name, key) == "string":
                arguments += '"' + json.dumps(partial, ensure_ascii=False)[1:-1]
        return CallSegment(name, arguments, block)

    def _type(self, name: str, key: str) -> Any:
        params = self.tools[name].function.parameters or {}
        schema = (params.get("properties") or {}).get(key)
        return schema.get("type") if isinstance(schema, dict) else None

    def _value(self, name: str, key: str, raw: str) -> str:
        if self._type(name, key) != "string":
            try:
                return json.dumps(json.loads(raw), ensure_ascii=False)
            except json.JSONDecodeError:
                pass
        return json.dumps(raw, ensure_ascii=False)

    # ---- constraining --------------------------------------------------------------------------
    # Where the tags are text, not special tokens, a value runs up to its closing tag as one
    # piece (a rule with ``stop``): a greedy token would swallow the tag.
    def grammar(
        self,
        tools: list[ChatCompletionToolsParam],
        parallel: bool,
        enforced: set[str] | None = None,
    ) -> str:
        rules = []
        for i, tool in enumerate(tools):
            schema = strict_schema(self.arguments_schema(tool, enforced))  # as glm4's JSON
            entries = self._entries(i, schema, rules)
            name = json.dumps(tool.function.name)
            rules.append(f'fn_{i}: {name} "\\n"? {entries} {self.token(CLOSE)} "\\n"?')
        functions = " | ".join(f"fn_{i}" for i in range(len(tools)))
        rules.append(f"function: {functions}")
        rules.append(f"call: {self.token(OPEN)} function")
        rules.append("calls: call+" if parallel else "calls: call")
        rules.append("KEY_TEXT: /[^<\\n]+/")
        rules.append(self._text_rule("value_text", "", VALUE_CLOSE))
        if not self.has_special(OPEN):  # auto: text, then a call
            rules.append(self._text_rule("text_then_call", "", OPEN))
        return "\n".join(rules)

    def _entries(self, i: int, schema: dict[str, Any], rules: list[str]) -> str:
        """The key/value pairs of ``schema``'s properties, in its order (the required ones
        required), then any other pairs unless the schema is closed (``strict_schema`` closes one
        that lists its properties, even none, unless it says otherwise), their values held to
        its ``additionalProperties`` schema where it gives one."""
        required = set(schema.get("required") or [])
        parts = []
        for j, (key, sub) in enumerate((schema.get("properties") or {}).items()):
            value = self._value_rule(f"value_{i}_{j}", sub, rules)
            rules.append(f"arg_{i}_{j}: {self._pair(json.dumps(key), value)}")
            parts.append(f"arg_{i}_{j}" if key in required else f"arg_{i}_{j}?")
        extra = schema.get("additionalProperties")
        if extra is not False:  # open
            value = "value_text"
            if isinstance(extra, dict):
                value = self._value_rule(f"extra_{i}", extra, rules)
            rules.append(f"any_{i}: {self._pair('KEY_TEXT', value)}")
            parts.append(f"any_{i}*")
        return " ".join(parts)

    def _pair(self, key: str, value_and_close: str) -> str:
        t = self.token
        return f'{t(KEY_OPEN)} {key} {t(KEY_CLOSE)} "\\n"? {t(VALUE_OPEN)} {value_and_close} "\\n"?'

    def _value_rule(self, name: str, schema: dict[str, Any], rules: list[str]) -> str:
        """A rule for a value and its closing tag."""
        close = self.token(VALUE_CLOSE)
        if schema.get("type") != "string":
            return f"{self.json_rule(schema)} {close}"
        if schema.get("enum"):
            return "(" + " | ".join(json.dumps(v) for v in schema["enum"]) + f") {close}"
        if "minLength" not in schema and "maxLength" not in schema:
            return "value_text"
        length = f"{{{schema.get('minLength', 0)},{schema.get('maxLength', '')}}}"
        rules.append(self._text_rule(name, length, VALUE_CLOSE))
        return name

    def _text_rule(self, name: str, length: str, mark: str) -> str:
        """``name``: text (of ``length``) and then ``mark``."""
        if self.has_special(mark):  # a special token never appears inside text
            return f"{name}: /(?s:.{length or '*'})/ {mark}"
        return f"{name}[stop={json.dumps(mark)}]: /(?s:.{length or '*'})/"

    def free_text(self, tools: list[ChatCompletionToolsParam]) -> str:
        if self.has_special(OPEN):
            return "/(?s:.*)/"
        return f"/(?s:.*)/ & ~/(?s:.*){OPEN}(?s:.*)/"  # the tag holds no character a regex reads

    def auto_start(self) -> str:
        if self.has_special(OPEN):
            return "FREE | FREE? calls"
        return "FREE | text_then_call function call*"


def _pairs(args: str) -> tuple[list[tuple[str, str]], tuple[str, str | None] | None]:
    """The complete (key, value) pairs of ``args``, and the pending one: (key, the value so far
    or None before it opens), or None. The pending pair is read only while the call is open."""
    pairs: list[tuple[str, str]] = []
    while True:
        k0 = args.find(KEY_OPEN)
        if k0 < 0:
            return pairs, None
        k1 = args.find(KEY_CLOSE, k0)
        if k1 < 0:
            return pairs, None  # the key is not over
        key = args[k0 + len(KEY_OPEN) : k1].strip()
        v0 = args.find(VALUE_OPEN, k1)
        if v0 < 0:
            return pairs, (key, None)
        v1 = args.find(VALUE_CLOSE, v0)
        if v1 < 0:
            value = args[v0 + len(VALUE_OPEN) :]
            return pairs, (
                key,
                value[: len(value) - partial_mark_length(value, VALUE_CLOSE)].strip(),
            )
        pairs.append((key, args[v0 + len(VALUE_OPEN) : v1].strip()))
        args = args[v1 + len(VALUE_CLOSE) :]
