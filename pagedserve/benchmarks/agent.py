"""``pagedserve bench --dataset agent``: concurrent multi-step agent programs against a server,
reported as ``sglang-bench`` reports them.

Each program (pagedserve.lang over SGLang's native API) reads a shared system prompt and its
task, picks a tool with ``select``, forks two thoughts, and writes a JSON answer constrained by a
schema. Reported: ``avg_latency_ms`` (one whole program), ``num_completed_requests`` (programs),
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
from pagedserve.lang import Runtime, function, gen, select

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
    program = agent_program(16, 64)
    concurrency = args.max_concurrency or 8
    tasks = [TASKS[i % len(TASKS)] + f" (case {i})" for i in range(args.num_prompts)]

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda t: _run_isolated(program, runtime, t), tasks))
    duration = time.perf_counter() - start
    figures = agent_metrics(results, duration)
    figures |= {"num_prompts": args.num_prompts, "max_concurrency": concurrency}
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
