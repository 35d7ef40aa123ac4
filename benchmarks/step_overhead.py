"""What one engine step costs besides the model, at 64 running requests on the demo model.

    python -m benchmarks.step_overhead [--num-requests 64] [--steps 200] [--sampling]

64 requests with 128-token prompts decode together (greedy by default; ``--sampling``:
temperature 1 with a per-request seed). After every request has produced its first token, a timer
around each part of ``LLMEngine.step`` measures STEPS decode steps: the scheduler (the block
manager's share separately), input preparation, the model forward and lm_head, the sampler, and
the output processing that follows (appending tokens, stop checks, building outputs). The core
path (``EngineCore.step``: token deltas encoded for the HTTP process, no detokenization) is timed
the same way when this version has one. Writes benchmarks/results/step_overhead.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from benchmarks.results import write_result
from pagedserve.config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.sampling_params import SamplingParams

PROMPT_LEN = 128


class Timers:
    """Seconds spent in wrapped callables, per step."""

    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.active = False

    def wrap(self, obj, attr: str, label: str) -> None:
        fn = getattr(obj, attr)

        def timed(*args, **kwargs):
            if not self.active:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[label] += time.perf_counter() - start

        setattr(obj, attr, timed)

    def take(self) -> dict[str, float]:
        out, self.seconds = dict(self.seconds), defaultdict(float)
        return out


def build_engine(args) -> LLMEngine:
    config = EngineConfig.from_kwargs(
        model="demo",
        max_num_seqs=args.num_requests,
        max_model_len=PROMPT_LEN + args.steps + 64,
        device=args.device,
        enforce_eager=args.enforce_eager,
    )
    return LLMEngine(config)


def add_requests(engine, add, args) -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    for i in range(args.num_requests):
        prompt = torch.randint(10, vocab - 10, (PROMPT_LEN,), generator=gen).tolist()
        params = SamplingParams(
            max_tokens=args.steps + 32,
            ignore_eos=True,
            temperature=1.0 if args.sampling else 0.0,
            seed=i if args.sampling else None,
        )
        add(engine, str(i), prompt, params)


def instrument(engine, t: Timers) -> None:
    runner = engine.runner
    t.wrap(engine.scheduler, "schedule", "schedule (incl. block manager)")
    t.wrap(engine.block_manager, "allocate_slots", "  block manager: allocate_slots")
    t.wrap(runner, "prepare_inputs", "prepare inputs")
    t.wrap(engine.model, "forward", "model forward")
    t.wrap(engine.model, "compute_logits", "lm_head")
    t.wrap(runner, "sampler", "sampler")
    t.wrap(runner, "_sampling_metadata", "  sampling metadata")
    t.wrap(runner, "execute_model", "execute_model (inputs + model + sampler)")


def measure(engine, step, args) -> dict:
    """Per-step milliseconds of each part over ``args.steps`` decode steps."""
    t = Timers()
    instrument(engine, t)
    while any(not s.output_token_ids for s in engine.scheduler.running) or engine.scheduler.waiting:
        step()  # prefill
    for _ in range(5):
        step()
    per_step: dict[str, list[float]] = defaultdict(list)
    t.active = True
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        total = time.perf_counter() - start
        parts = t.take()
        parts["whole step"] = total
        outside = total - parts["schedule (incl. block manager)"]
        outside -= parts["execute_model (inputs + model + sampler)"]
        parts["output processing (after the model)"] = outside
        for k, v in parts.items():
            per_step[k].append(v * 1e3)
    t.active = False
    assert len(engine.scheduler.running) == args.num_requests, "requests finished early"
    return {k: statistics.median(v) for k, v in per_step.items()}


def report(title: str, ms: dict) -> dict:
    """The Python parts are the medians of their own timers; "everything else" is the whole step
    less the model, so on a busy machine it also holds the time the process waited for a core."""
    model = ms["model forward"] + ms.get("lm_head", 0.0) + ms.get("sampler", 0.0)
    overhead = ms["whole step"] - model
    print(f"\n{title}: {ms['whole step']:.3f} ms per step, model + lm_head + sampler {model:.3f} ms, "
          f"everything else {overhead:.3f} ms ({overhead / ms['whole step']:.1%})")  # fmt: skip
    for label in sorted(ms, key=lambda k: -ms[k]):
        print(f"  {label:<44} {ms[label]:8.3f} ms {ms[label] / ms['whole step']:6.1%}")
    python = sum(ms[k] for k in PYTHON_PARTS if k in ms)
    print(f"  Python parts (schedule + prepare inputs + output processing): {python:.3f} ms")
    return {"ms_per_step": ms, "model_ms": model, "overhead_ms": overhead, "python_ms": python}


PYTHON_PARTS = (
    "schedule (incl. block manager)",
    "prepare inputs",
    "output processing (after the model)",
)


def offline_step(engine):
    return engine.step()


def offline_add(engine, rid, prompt, params):
    engine.add_request(rid, prompt, params)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--sampling", action="store_true")
    ap.add_argument("--device", default="kunlun-emu")
    ap.add_argument("--enforce-eager", action="store_true")
    args = ap.parse_args()
    figures = {
        "num_requests": args.num_requests,
        "prompt_len": PROMPT_LEN,
        "steps": args.steps,
        "sampling": args.sampling,
        "threads": torch.get_num_threads(),
    }
    engine = build_engine(args)
    figures["device"] = engine.device.describe()
    add_requests(engine, offline_add, args)
    figures["offline"] = report("offline LLMEngine.step", measure(engine, engine.step, args))
    try:
        from pagedserve.engine.core import EngineCore
    except ImportError:
        EngineCore = None  # noqa: N806 - a version without an engine core
    if EngineCore is not None:
        core = EngineCore(build_engine(args))
        add_requests(core.engine, lambda e, *a: core.add_request(*a), args)
        figures["core"] = report(
            "engine core EngineCore.step (encoded outputs)",
            measure(core.engine, core.step_encoded, args),
        )
    write_result("step_overhead", figures)


if __name__ == "__main__":
    main()
