"""What a program appends to its state: text, generations, selections, role blocks and the
tools block."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


class Expr:
    """Parts of a program concatenate: ``"Answer: " + gen("a") + "\n"``."""

    def __add__(self, other: Any) -> Concat:
        return Concat([self, other])

    def __radd__(self, other: Any) -> Concat:
        return Concat([other, self])


class Concat(list, Expr):
    def __add__(self, other: Any) -> Concat:
        return Concat([*self, other])

    def __radd__(self, other: Any) -> Concat:
        return Concat([other, *self])


@dataclass
class Gen(Expr):
    name: str | None
    max_tokens: int = 128
    stop: list[str] = field(default_factory=list)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    regex: str | None = None
    json_schema: str | None = None
    tools: list[dict] | None = None  # a tool step: the model calls one of these
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = False

    def sampling_params(self) -> dict[str, Any]:
        params = {"max_new_tokens": self.max_tokens, "stop": self.stop or None}
        for key in ("temperature", "top_p", "top_k", "regex", "json_schema"):
            if getattr(self, key) is not None:
                params[key] = getattr(self, key)
        return params

    def tool_fields(self) -> dict[str, Any]:
        """The /generate fields of a tool step (none for a plain generation)."""
        if self.tools is None:
            return {}
        fields = {"tools": self.tools, "parallel_tool_calls": self.parallel_tool_calls}
        return fields | ({"tool_choice": self.tool_choice} if self.tool_choice else {})


@dataclass(slots=True)
class ToolCall:
    """A call a tool step read from the model's text: ``s[name].name``, ``.arguments``."""

    id: str
    name: str
    arguments: dict[str, Any]

    @classmethod
    def from_openai(cls, call: dict[str, Any]) -> ToolCall:
        function = call["function"]
        arguments = function.get("arguments") or "{}"
        if isinstance(arguments, str):
            arguments = json.loads(arguments)
        return cls(call.get("id", ""), function["name"], arguments)


@dataclass
class ToolsBlock(Expr):
    """The model's own declaration of ``tools`` (its chat template's tools turn)."""

    tools: list[dict]


@dataclass
class Select(Expr):
    name: str | None
    choices: list[str]


@dataclass
class RoleBlock(Expr):
    role: str
    content: Any  # str, Gen, Select or a list of them; None: opened by ``with s.user():``


def gen(
    name: str | None = None,
    max_tokens: int = 128,
    stop: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    regex: str | None = None,
    json_schema: str | dict | None = None,
    choices: list[str] | None = None,
    tools: list[dict] | None = None,
    tool_choice: str | dict | None = "required",
    parallel_tool_calls: bool = False,
) -> Gen | Select:
    """Generate text into ``s[name]``; ``choices`` makes it a ``select``.

    With ``tools`` (OpenAI's shape) it is a tool step: the server holds the model to a call in
    its own format (``tool_choice`` "required" by default, or a named function, or "auto"), and
    ``s[name]`` is the ``ToolCall`` it read (None if the model answered in text), or the list
    of them with ``parallel_tool_calls``. ``s += tool(result)`` then appends the result."""
    if choices is not None:
        return select(name, choices)
    if isinstance(json_schema, dict):
        json_schema = json.dumps(json_schema)
    stop = [stop] if isinstance(stop, str) else list(stop or [])
    return Gen(
        name, max_tokens, stop, temperature, top_p, top_k, regex, json_schema,
        tools, tool_choice if tools is not None else None, parallel_tool_calls,
    )  # fmt: skip


def select(name: str | None = None, choices: list[str] | None = None) -> Select:
    """The choice whose tokens the model finds most likely (mean logprob per token)."""
    if not choices:
        raise ValueError("select needs a non-empty list of choices")
    return Select(name, list(choices))


def system(content: Any = None) -> RoleBlock:
    return RoleBlock("system", content)


def user(content: Any = None) -> RoleBlock:
    return RoleBlock("user", content)


def assistant(content: Any = None) -> RoleBlock:
    return RoleBlock("assistant", content)


def tool(content: Any = None) -> RoleBlock:
    """A tool's result, as the model's chat template shows one (GLM-4: an observation turn)."""
    return RoleBlock("tool", content)


def declare_tools(tools: list[dict]) -> ToolsBlock:
    """The tools the model may call, as its chat template declares them (GLM-4: a system turn
    of ``## name`` headings and JSON definitions). Put it before the conversation."""
    return ToolsBlock(list(tools))
