"""What constrained decoding costs per decode step, against unconstrained, at 16 concurrent requests.

    python -m benchmarks.structured_cost [--model demo] [--concurrency 16] [--steps 48]

Both runs decode the same 16 prompts with the same settings; the constrained run adds a JSON
schema to every request (every row of every step is masked). Only steps in which all 16 rows
decode are timed (the prefill step and the tail where requests finish are left out). The overhead
is the matchers' bitmask fill, the bitmask applied in the sampler and the matchers' advance.
"""

from __future__ import annotations

import argparse
import statistics
import time

from benchmarks.results import write_result
from pagedserve.config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.sampling_params import SamplingParams, StructuredOutputsParams

# open-ended enough that no row finishes within the timed steps
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "items": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["title", "items"],
}


def step_times(engine: LLMEngine, params: SamplingParams, n: int, steps: int) -> list[float]:
    for i in range(n):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", [5 + i, 17, 42, 99], params)
    times = []
    while engine.has_unfinished_requests():
        full = len(engine.scheduler.running) == n and not engine.scheduler.waiting
        t = time.perf_counter()
        engine.step()
        if full and len(times) < steps:
            times.append(time.perf_counter() - t)
        if len(times) >= steps:
            engine.abort_request(list(engine.groups))
    return times[1:]  # the first full step still samples after the prefill


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    engine = LLMEngine(
        EngineConfig.from_kwargs(model=args.model, max_num_seqs=args.concurrency, max_model_len=512)
    )
    plain = SamplingParams(temperature=0.8, seed=0, max_tokens=400, ignore_eos=True)
    constrained = SamplingParams(
        temperature=0.8,
        seed=0,
        max_tokens=400,
        structured_outputs=StructuredOutputsParams(json=SCHEMA),
    )
    step_times(engine, constrained, args.concurrency, 4)  # compile and warm the caches
    runs = {"unconstrained": [], "json_schema": []}
    for _ in range(args.repeats):
        for name, params in (("unconstrained", plain), ("json_schema", constrained)):
            runs[name].append(
                statistics.median(step_times(engine, params, args.concurrency, args.steps))
            )
    plain_ms = statistics.median(runs["unconstrained"]) * 1e3
    constrained_ms = statistics.median(runs["json_schema"]) * 1e3
    figures = {
        "model": args.model,
        "concurrency": args.concurrency,
        "decode_step_ms": {
            "unconstrained": round(plain_ms, 2),
            "json_schema": round(constrained_ms, 2),
        },
        "runs_ms": {k: [round(v * 1e3, 2) for v in vs] for k, vs in runs.items()},
        "overhead_percent": round(100 * (constrained_ms - plain_ms) / plain_ms, 1),
    }
    print(figures)
    print(write_result("structured_cost", figures))


if __name__ == "__main__":
    main()
