"""``pagedserve bench --dataset agent``: concurrent multi-step agent programs against a server,
reported as ``sglang-bench`` reports them.

Each program (pagedserve.lang over SGLang's native API) reads a shared system prompt and its
task, then (``--agent-program select``, the default) picks a tool with ``select``, forks two
thoughts, and writes a JSON answer constrained by a schema; or (``--agent-program tools``)
calls one of three functions in the model's own tool-call format (``tool_choice`` "required":
a grammar makes the call valid), reads the function's result and answers. Reported: ``avg_latency_ms`` (one whole program), ``num_completed_requests`` (programs),
programs per second, and per step its mean latency and, for generations, the mean time to its
first token (``ttft_ms``). Run the server with and without ``--enable-prefix-caching`` to see
what sharing the system prompt's pages between steps and programs is worth.
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pagedserve.benchmarks.request import check_reachable
from pagedserve.lang import (
    Runtime,
    assistant,
    declare_tools,
    function,
    gen,
    select,
    system,
    tool,
    user,
)

SYSTEM = (
    "You are an agent in a support system. You read the task, choose one tool, think about "
    "the task in two independent ways, and give a short structured answer. "
) * 6
TASKS = [
    "find the opening hours of the city library",
    "add 127 and 986",
    "summarise the last message from the customer",
    "look up the weather in Paris tomorrow",
    "convert 30 degrees Celsius to Fahrenheit",
    "check whether order 5521 has shipped",
]
TOOLS = ["search", "calculator", "none"]
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {
        "tool": {"enum": TOOLS},
        "answer": {"type": "string", "maxLength": 48},
        "confident": {"type": "boolean"},
    },
    "required": ["tool", "answer", "confident"],
}


FUNCTIONS = [  # the tool-calling program's functions, in OpenAI's shape
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {argument: schema},
                "required": [argument],
            },
        },
    }
    for name, description, argument, schema in [
        ("search", "Search the web", "query", {"type": "string", "maxLength": 40}),
        ("calculator", "Evaluate arithmetic", "expression", {"type": "string", "maxLength": 24}),
        ("lookup_order", "An order's status", "order_id", {"type": "integer", "minimum": 0}),
    ]
]


def run_function(call) -> dict:
    """A made-up result of the call (the benchmark times the model, not the tools)."""
    if call is None:
        raise RuntimeError("the model made no call")
    results = {
        "search": {"results": ["The library opens at 9:00."]},
        "calculator": {"value": 1113},
        "lookup_order": {"status": "shipped"},
    }
    return {"function": call.name, **results[call.name]}


class TimedRuntime(Runtime):
    """Records when each streamed generation's first text arrives (per thread)."""

    local = threading.local()

    def generate_stream(self, text, sampling_params, **extra):
        start, first = time.perf_counter(), None
        for piece, meta in super().generate_stream(text, sampling_params, **extra):
            if first is None and piece:
                first = time.perf_counter() - start
                self.local.__dict__.setdefault("ttfts", []).append(first)
            yield piece, meta


def agent_program(thought_tokens: int, answer_tokens: int):
    @function
    def agent(s, task):
        steps = s.variables.setdefault("steps", [])
        s += SYSTEM + f"\nTask: {task}\n"
        t = time.perf_counter()
        s += "Tool: " + select("tool", TOOLS)
        steps.append(("select", time.perf_counter() - t, None))
        t = time.perf_counter()
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f"\nThought {i + 1}:" + gen("thought", max_tokens=thought_tokens, stop="\n")
        forks.join()
        steps.append(("fork", time.perf_counter() - t, _take_ttft()))
        t = time.perf_counter()
        s += "\nAnswer: " + gen("answer", max_tokens=answer_tokens, json_schema=ANSWER_SCHEMA)
        steps.append(("constrained_gen", time.perf_counter() - t, _take_ttft()))

    return agent


def tool_program(call_tokens: int, answer_tokens: int):
    @function
    def agent(s, task):
        steps = s.variables.setdefault("steps", [])
        s += declare_tools(FUNCTIONS)
        s += system(SYSTEM)
        s += user(task)
        t = time.perf_counter()
        s += assistant(gen("call", tools=FUNCTIONS, max_tokens=call_tokens, temperature=0))
        steps.append(("tool_call", time.perf_counter() - t, _take_ttft()))
        s += tool(json.dumps(run_function(s["call"])))
        t = time.perf_counter()
        s += assistant(gen("answer", max_tokens=answer_tokens))
        steps.append(("answer", time.perf_counter() - t, _take_ttft()))

    return agent


PROGRAMS = {"select": lambda: agent_program(16, 64), "tools": lambda: tool_program(48, 32)}


def _take_ttft() -> float | None:
    ttfts = TimedRuntime.local.__dict__.setdefault("ttfts", [])
    first = ttfts[0] if ttfts else None
    ttfts.clear()
    return first


def run_agent_bench(args) -> int:
    try:
        check_reachable(args.base_url)
    except ValueError as exc:
        print(f"pagedserve bench: error: {exc}", file=sys.stderr)
        return 2
    runtime = TimedRuntime(args.base_url, api_key=args.api_key, timeout=args.timeout)
    program = PROGRAMS[args.agent_program]()
    concurrency = args.max_concurrency or 8
    tasks = [TASKS[i % len(TASKS)] + f" (case {i})" for i in range(args.num_prompts)]

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda t: _run_isolated(program, runtime, t), tasks))
    duration = time.perf_counter() - start
    figures = agent_metrics(results, duration)
    figures |= {"num_prompts": args.num_prompts, "max_concurrency": concurrency}
    figures["program"] = args.agent_program
    print(json.dumps(figures, indent=2))
    if args.output_file:
        Path(args.output_file).write_text(json.dumps(figures, indent=2))
    errors = [str(state.error) for state, _ in results if state.error is not None]
    if errors:
        print(f"{len(errors)} programs failed; first error: {errors[0]}", file=sys.stderr)
    return 0 if figures["num_completed_requests"] else 1


def _run_isolated(program, runtime, task):
    start = time.perf_counter()
    state = program.run(task, backend=runtime, stream=True).wait()
    return state, time.perf_counter() - start


def agent_metrics(results, duration: float) -> dict:
    done = [(s, t) for s, t in results if s.error is None]
    steps = defaultdict(lambda: {"latency": [], "ttft": []})
    for state, _ in done:
        for name, latency, ttft in state.variables.get("steps", []):
            steps[name]["latency"].append(latency)
            if ttft is not None:
                steps[name]["ttft"].append(ttft)
    ms = lambda xs: round(statistics.mean(xs) * 1e3, 1) if xs else None  # noqa: E731
    return {
        "num_completed_requests": len(done),
        "num_failed_requests": len(results) - len(done),
        "avg_latency_ms": ms([t for _, t in done]),
        "programs_per_s": round(len(done) / duration, 3),
        "duration_s": round(duration, 2),
        "steps": {
            name: {"avg_latency_ms": ms(v["latency"]), "avg_ttft_ms": ms(v["ttft"])}
            for name, v in steps.items()
        },
    }
