"""A request's ``tools`` and ``tool_choice``, in OpenAI's shapes: checked before the request is
queued (a 400 naming the field), turned into the constraint a choice demands, and the rules of
OpenAI's answer (``finish_reason``).

- ``none``: the tools are shown to the model (the chat template renders them), nothing is parsed.
- ``auto`` (the default with tools; needs ``--enable-auto-tool-choice``): the model may answer in
  text or call tools, read by ``--tool-call-parser``; only tools marked ``strict: true`` are held
  to their schema (by a grammar that allows free text or such calls).
- ``required``, or a named function: a grammar makes the model call (that) one, with arguments
  its JSON schema accepts, in the parser's format (``--tool-call-parser``, else ``glm4``).

The constraint is an llguidance grammar carried by ``SamplingParams.structured_outputs``, as any
structured output: the engine never sees tool-call text.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pagedserve.engine.structured_output.backend_guidance import check_structured_outputs
from pagedserve.sampling_params import SamplingParams, StructuredOutputsParams
from pagedserve.server.errors import bad_request
from pagedserve.server.protocol import ChatCompletionToolsParam, ToolChoice
from pagedserve.server.reasoning_parsers import ReasoningParser
from pagedserve.server.structured import build, check_depth
from pagedserve.server.tool_parsers import ToolParser

NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for a function's name
UNENFORCEABLE = "Unimplemented keys"  # llguidance: valid JSON Schema it cannot decode by


@dataclass(slots=True)
class ToolRequest:
    """What a request's tools ask for: ``choice`` is none, auto, required or named."""

    tools: list[ChatCompletionToolsParam]
    choice: str
    named: str | None = None
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "named")

    def enforced(self) -> list[ChatCompletionToolsParam]:
        """The tools a grammar holds to their schema."""
        if self.choice == "named":
            return [t for t in self.tools if t.function.name == self.named]
        if self.choice == "required":
            return self.tools
        if self.choice == "auto":
            return [t for t in self.tools if t.function.strict]
        return []


def tool_request(
    tools: list[ChatCompletionToolsParam] | None,
    tool_choice: ToolChoice | None,
    parallel_tool_calls: bool | None,
    enable_auto_tool_choice: bool,
) -> ToolRequest | None:
    """The request's tools, checked; None when it has none."""
    if tools is None:
        if tool_choice not in (None, "none"):
            raise bad_request(
                "tool_choice needs tools: send the functions the model may call in 'tools', or "
                "leave tool_choice out",
                "tool_choice",
            )
        return None
    if not tools:
        raise bad_request("tools is empty: send at least one function, or leave tools out", "tools")
    _check_names(tools)
    choice, named = _choice(tool_choice, tools, enable_auto_tool_choice)
    request = ToolRequest(tools, choice, named, parallel_tool_calls is not False)
    enforced = {t.function.name for t in request.enforced()}
    for i, tool in enumerate(tools):
        _check_schema(tool, i, tool.function.name in enforced)
    return request


def _check_names(tools: list[ChatCompletionToolsParam]) -> None:
    seen = set()
    for i, tool in enumerate(tools):
        name = tool.function.name
        if not NAME.match(name):
            raise bad_request(
                f"function name {name!r} must be 1 to 64 letters, digits, underscores or dashes",
                f"tools.{i}.function.name",
            )
        if name in seen:
            raise bad_request(f"two tools are named {name!r}; give each a name of its own", "tools")
        seen.add(name)


def _choice(
    tool_choice: ToolChoice | None, tools: list[ChatCompletionToolsParam], enable_auto: bool
) -> tuple[str, str | None]:
    if tool_choice is None or tool_choice == "auto":
        if not enable_auto:
            raise bad_request(
                "tool_choice 'auto' (the default when tools are sent) needs a server started with "
                "--enable-auto-tool-choice and --tool-call-parser NAME; send tool_choice "
                "'required', a named function or 'none', or restart the server with those flags",
                "tool_choice",
            )
        return "auto", None
    if isinstance(tool_choice, str):
        return tool_choice, None
    name = tool_choice.function.name
    if name not in {t.function.name for t in tools}:
        names = ", ".join(t.function.name for t in tools)
        raise bad_request(
            f"tool_choice names the function {name!r}, which is not among the tools ({names})",
            "tool_choice",
        )
    return "named", name


def _check_schema(tool: ChatCompletionToolsParam, i: int, enforced: bool) -> None:
    """A schema llguidance rejects is a 400, but for valid JSON Schema it cannot decode by, on a
    tool no grammar has to hold to it."""
    schema = tool.function.parameters
    if schema is None:
        return
    kind = schema.get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        raise bad_request(
            f"the parameters of function {tool.function.name!r} have type {kind!r}: a call's "
            f"arguments are a JSON object, so its schema's type must be 'object'",
            f"tools.{i}.function.parameters",
            "invalid_tool_schema",
        )
    try:
        check_depth(schema)
        check_structured_outputs(StructuredOutputsParams(json=schema))
    except ValueError as e:
        if enforced or UNENFORCEABLE not in str(e):
            raise bad_request(
                f"the parameters of function {tool.function.name!r} are not a usable JSON "
                f"schema: {e}",
                f"tools.{i}.function.parameters",
                "invalid_tool_schema",
            ) from e


# ---- the constraint -----------------------------------------------------------------------------
def attach_tool_grammar(
    params: SamplingParams,
    request: ToolRequest,
    parser: ToolParser,
    reasoning: ReasoningParser | None = None,
) -> None:
    """Hold the output to the grammar the choice demands: one or more calls (required, named),
    or free text or calls whose strict tools keep to their schemas (auto with strict tools)."""
    enforced = request.enforced()
    if not enforced:
        return
    if params.structured_outputs is not None:
        raise bad_request(
            f"tool_choice {request.choice!r} constrains the output, and so does the request's "
            f"structured output (response_format or guided_*): send one of them",
            "tool_choice",
        )
    names = {t.function.name for t in enforced}
    if request.forced:
        rules = parser.grammar(enforced, request.parallel)
        start = "calls"
    else:
        rules = parser.grammar(request.tools, request.parallel, enforced=names)
        rules += f"\nFREE: {parser.free_text(enforced)}"
        start = parser.auto_start()
    prefix = reasoning.grammar_prefix() if reasoning is not None else None
    if prefix is not None:
        rules += "\n" + prefix[0]
        start = f"{prefix[1]} ({start})"
    params.structured_outputs = build({"grammar": f"start: {start}\n{rules}"}, "tool_choice")


def finish_reason(request: ToolRequest | None, reason: str | None, called: bool) -> str | None:
    """OpenAI's rule: ``tool_calls`` when the model ended on calls it chose (auto) or had to make
    (required); ``stop`` for a named function, whose call the client asked for."""
    if request is None or not called or reason != "stop" or request.choice == "named":
        return reason
    return "tool_calls"
