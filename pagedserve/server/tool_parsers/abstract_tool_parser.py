"""What every tool-call parser shares, and the registry that names them (vLLM's ToolParser and
ToolParserManager: ``--tool-call-parser NAME``, ``--tool-parser-plugin FILE``).

A parser reads the calls out of the text a model writes in its own format. It says what it reads
as a list of segments (``segments``): text, and calls with their arguments so far. From that one
method come the whole answer (``extract_tool_calls``) and, for streaming, the state after each
new piece of text (``chat_output.py`` turns successive states into deltas: a call's id, type and
name once it is certain, then its arguments as they grow). A segment is only reported once it
can no longer change kind: text that may still be the start of a call is held back.

A parser also writes the grammar (llguidance's Lark) that makes a model emit a valid call in its
format (``grammar``): ``tool_choice`` "required" and a named function go through the same
constraint machinery as structured output, so even a small model calls a declared function with
arguments its JSON schema accepts.

A plugin (``--tool-parser-plugin my_parser.py``) is a file that defines a subclass and registers
it::

    @ToolParserManager.register_module("mine")
    class MyToolParser(ToolParser):
        def segments(self, text, final): ...
        def grammar(self, tools, parallel): ...
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedserve.engine.structured_output.backend_guidance import JSON_OPTIONS, strict_schema
from pagedserve.sampling_params import SamplingParams
from pagedserve.server.protocol import ChatCompletionToolsParam, FunctionCall, ToolCall

logger = logging.getLogger(__name__)

NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
ANY_OBJECT = {"type": "object"}  # the arguments of a call that auto does not hold to its schema


@dataclass(slots=True)
class TextSegment:
    text: str


@dataclass(slots=True)
class CallSegment:
    """A call: its function's name and its arguments (the JSON text so far, without the
    whitespace around it); ``source``, the model's text of it, is what it becomes if the
    arguments turn out not to be a JSON object."""

    name: str
    arguments: str
    source: str

    def error(self) -> str | None:
        """Why the arguments are not a call's (None: they are a JSON object)."""
        try:
            value = json.loads(self.arguments)
        except json.JSONDecodeError as e:
            return f"arguments are not JSON ({e})"
        return None if isinstance(value, dict) else "arguments are not a JSON object"


Segment = TextSegment | CallSegment


@dataclass(slots=True)
class ExtractedToolCalls:
    """vLLM's ExtractedToolCallInformation: the calls, and the text that is not a call."""

    tools_called: bool
    tool_calls: list[ToolCall] = field(default_factory=list)
    content: str | None = None


class ToolParser:
    """One request's parser. ``tokenizer`` is the server's (for special tokens), ``tools`` the
    request's; a name not among them is text, not a call."""

    def __init__(self, tokenizer: Any, tools: list[ChatCompletionToolsParam]):
        self.tokenizer = tokenizer
        self.tools = {t.function.name: t for t in tools}

    # ---- reading -------------------------------------------------------------------------------
    def adjust_request(self, params: SamplingParams) -> None:
        """Calls are delimited by special tokens: the text must keep them."""
        params.skip_special_tokens = False

    def segments(self, text: str, final: bool) -> list[Segment]:
        """What ``text`` holds so far (``final``: the whole output)."""
        raise NotImplementedError

    def extract_tool_calls(self, model_output: str, parallel: bool = True) -> ExtractedToolCalls:
        """The calls of a whole output; a call whose arguments are not a JSON object is text
        (and the reason is logged). ``parallel`` False keeps the first call only."""
        calls, text = [], []
        for seg in self.segments(model_output, final=True):
            if isinstance(seg, CallSegment) and (error := seg.error()) is not None:
                logger.warning("not a tool call of %s, kept as text: %s", seg.name, error)
                seg = TextSegment(seg.source)
            if isinstance(seg, CallSegment):
                calls.append(
                    ToolCall(function=FunctionCall(name=seg.name, arguments=seg.arguments))
                )
            else:
                text.append(seg.text)
        calls = calls if parallel else calls[:1]
        content = "".join(text)
        return ExtractedToolCalls(
            bool(calls), calls, content if content.strip() or not calls else None
        )

    # ---- constraining --------------------------------------------------------------------------
    def grammar(
        self,
        tools: list[ChatCompletionToolsParam],
        parallel: bool,
        enforced: set[str] | None = None,
    ) -> str:
        """Lark rules whose rule ``calls`` is one or more calls (one without ``parallel``) of
        ``tools``, each with arguments valid for its schema (those ``enforced`` only, when it
        is given: the others take any JSON object)."""
        raise NotImplementedError

    def free_text(self, tools: list[ChatCompletionToolsParam]) -> str:
        """A Lark token expression of any text that does not start a call of ``tools``."""
        raise NotImplementedError

    def auto_start(self) -> str:
        """``auto`` with ``strict`` tools: free text (the token ``FREE``) or ``calls``."""
        return "FREE | calls"

    def token(self, text: str) -> str:
        """``text`` in a grammar: a special token of the vocabulary by name, else a literal."""
        return text if is_special_token(self.tokenizer, text) else json.dumps(text)

    def has_special(self, text: str) -> bool:
        return is_special_token(self.tokenizer, text)

    @staticmethod
    def arguments_schema(tool: ChatCompletionToolsParam, enforced: set[str] | None) -> dict:
        if enforced is not None and tool.function.name not in enforced:
            return ANY_OBJECT
        schema = tool.function.parameters
        if schema is None:
            return NO_ARGUMENTS
        return schema if "type" in schema else {"type": "object", **schema}  # arguments: an object

    @staticmethod
    def json_rule(schema: dict[str, Any] | None) -> str:
        """A JSON value for ``schema``, as %json (strict objects, at most one space between
        tokens: what structured output uses)."""
        body = strict_schema(schema if schema is not None else NO_ARGUMENTS)
        body = {**body, "x-guidance": JSON_OPTIONS}
        return f"%json {json.dumps(body, ensure_ascii=False)}"


def is_special_token(tokenizer: Any, text: str) -> bool:
    """Whether ``text`` is one special token of the vocabulary (llguidance names it ``<...>``
    in a grammar; decoding drops it unless told to keep special tokens)."""
    token_id = tokenizer.token_to_id(text) if tokenizer is not None else None
    return token_id is not None and token_id in set(tokenizer.all_special_ids)


def partial_mark_length(text: str, *marks: str) -> int:
    """How long the end of ``text`` is that one of ``marks`` could still begin with: text to
    hold back while the rest of the mark may be on its way."""
    for n in range(min(len(text), max(map(len, marks)) - 1), 0, -1):
        if any(mark.startswith(text[-n:]) for mark in marks):
            return n
    return 0


class ToolParserManager:
    """Parsers by name; a plugin file registers its own."""

    tool_parsers: dict[str, type[ToolParser]] = {}

    @classmethod
    def register_module(cls, *names: str) -> Callable[[type[ToolParser]], type[ToolParser]]:
        def register(parser: type[ToolParser]) -> type[ToolParser]:
            for name in names:
                cls.tool_parsers[name] = parser
            return parser

        return register

    @classmethod
    def get_tool_parser(cls, name: str) -> type[ToolParser]:
        if name not in cls.tool_parsers:
            raise ValueError(
                f"--tool-call-parser {name}: no such parser; the parsers are "
                f"{', '.join(sorted(cls.tool_parsers))} (a file given to --tool-parser-plugin "
                f"can register another)"
            )
        return cls.tool_parsers[name]

    @classmethod
    def import_tool_parser(cls, plugin: str) -> None:
        """Run the plugin file (its ``register_module`` calls register its parsers); a file that
        fails to run is a ``ValueError`` naming the flag, with the plugin's own error."""
        path = Path(plugin)
        if not path.is_file():
            raise FileNotFoundError(f"--tool-parser-plugin {plugin}: no such file")
        spec = importlib.util.spec_from_file_location(f"pagedserve_tool_plugin_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as e:  # the plugin's own code: any error it makes is the flag's
            raise ValueError(
                f"--tool-parser-plugin {plugin} failed to load: {type(e).__name__}: {e}"
            ) from e
