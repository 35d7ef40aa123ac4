"""What a program appends to its state: text, generations, selections and role blocks."""

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

    def sampling_params(self) -> dict[str, Any]:
        params = {"max_new_tokens": self.max_tokens, "stop": self.stop or None}
        for key in ("temperature", "top_p", "top_k", "regex", "json_schema"):
            if getattr(self, key) is not None:
                params[key] = getattr(self, key)
        return params


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
) -> Gen | Select:
    """Generate text into ``s[name]``; ``choices`` makes it a ``select``."""
    if choices is not None:
        return select(name, choices)
    if isinstance(json_schema, dict):
        json_schema = json.dumps(json_schema)
    stop = [stop] if isinstance(stop, str) else list(stop or [])
    return Gen(name, max_tokens, stop, temperature, top_p, top_k, regex, json_schema)


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
