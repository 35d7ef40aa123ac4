"""The SGLang-style frontend language over pagedserve's HTTP API (no torch here).

    from pagedserve.lang import function, gen, select, set_default_backend, Runtime

    @function
    def echo_agent(s):
        s.state["history"] = s.state.get("history", [])
        s.state["history"].append(s.text)
        s += gen("reply", max_tokens=128)

    set_default_backend(Runtime("http://localhost:8000"))
    echo_agent("Hello, world!")
    print(echo_agent("How are you?").state["history"])   # both inputs

A program appends text (``s += "..."``), role blocks (``system`` / ``user`` / ``assistant``, through
the model's chat template), generations (``gen``, constrained by ``regex``, ``json_schema`` or
``choices``) and choices scored by their logprobs (``select``); ``s.fork(n)`` branches share the
parent's prefix pages on the server (prefix caching). ``s.state`` lasts across calls of the same
function, and across client processes with ``session_id=`` (kept by the server).

A tool step: ``s += declare_tools(TOOLS)`` shows the model its tools (its chat template's tools
turn), ``s += assistant(gen("call", tools=TOOLS))`` makes it call one (``s["call"]`` is the
parsed ``ToolCall``), and ``s += tool(result)`` appends the tool's result.
"""

from pagedserve.lang.backend import Runtime, RuntimeEndpoint
from pagedserve.lang.interpreter import (
    ProgramState,
    function,
    get_default_backend,
    run_batch,
    set_default_backend,
)
from pagedserve.lang.ir import ToolCall, assistant, declare_tools, gen, select, system, tool, user

__all__ = [
    "ProgramState",
    "Runtime",
    "RuntimeEndpoint",
    "ToolCall",
    "assistant",
    "declare_tools",
    "function",
    "gen",
    "get_default_backend",
    "run_batch",
    "select",
    "set_default_backend",
    "system",
    "tool",
    "user",
]
