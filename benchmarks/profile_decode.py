"""Where a batch-1 token's time goes, and how far each part is from this machine's memory roofline.

    python -m benchmarks.profile_decode [--model 122m] [--quantization int4|w4a8] [--lm-head int4]
                                        [--kernels all|auto|avx512|avx2|portable|eager ...]

Runs the batch-1 workload of compare.py (32-token prompt, 64 greedy tokens, INT4 weights) twice
per kernel variant (default: every native target this CPU executes): as served (timers around the
engine's stages, lm_head and each decoder layer's one native call), then op by op (the fused
layers off, a timer around every HAL op); each the fastest of 3 runs. Prints milliseconds per
token for each part, the bytes each part streams and its rate against the read bandwidth measured
here (a 1 GiB sum), and per variant the share of that roofline the decoder layers reach. Writes
benchmarks/results/profile_decode_<model>_<kernels>.json.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from benchmarks.bench_models import build_model
from benchmarks.results import write_result
from pagedserve import LLM, SamplingParams
from pagedserve.config import KERNEL_CHOICES
from pagedserve.hal.int4 import Int4Linear
from pagedserve.hal.int8 import Int8Linear
from pagedserve.hal.native import executable_targets

HAL_OPS = [
    "add_rms_norm",
    "rms_norm",
    "rotary_and_write_kv",
    "paged_attention",
    "silu_and_mul",
    "argmax",
]
NEW_TOKENS = 64


def read_bandwidth_gbs() -> float:
    """Bytes per second a sum over 1 GiB reads, best of 10 (this machine varies: the best is the
    roofline)."""
    big = torch.ones(2**28, dtype=torch.float32)
    best = float("inf")
    for _ in range(10):
        start = time.perf_counter()
        big.sum()
        best = min(best, time.perf_counter() - start)
    return big.numel() * 4 / best / 1e9


def nbytes(w) -> int:
    if isinstance(w, (Int4Linear, Int8Linear)):
        return w.nbytes
    return w.numel() * w.element_size()


class Timers:
    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)

    def wrap(self, obj, attr: str, label: str, weight_bytes=None) -> None:
        fn = getattr(obj, attr)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            self.seconds[label] += time.perf_counter() - start
            self.calls[label] += 1
            if weight_bytes is not None:
                self.bytes[label] += weight_bytes(*args)
            return out

        setattr(obj, attr, timed)


def run_profiled(llm, params, prompt, wrap, undo, runs: int = 3) -> tuple[float, Timers]:
    """Seconds for one generate and its timers (the fastest of ``runs``), ``wrap(timers)``
    installing the timers and ``undo()`` removing them around each run."""
    best = None
    for _ in range(runs):
        timers = Timers()
        wrap(timers)
        start = time.perf_counter()
        llm.generate(prompt, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        undo()
        if best is None or seconds < best[0]:
            best = (seconds, timers)
    return best


def print_table(title: str, total: float, t: Timers, bandwidth: float) -> dict:
    print(f"\n{title}: {NEW_TOKENS / total:.1f} tokens/s ({total / NEW_TOKENS * 1e3:.3f} ms/token)")
    print(f"{'part':<46} {'ms/token':>9} {'share':>6} {'MB/token':>9} {'GB/s':>6} {'of peak':>8}")
    rows = {}
    for label in sorted(t.seconds, key=lambda k: -t.seconds[k]):
        ms = t.seconds[label] / NEW_TOKENS * 1e3
        row = {"ms_per_token": ms, "share": t.seconds[label] / total}
        line = f"{label:<46} {ms:9.3f} {row['share']:6.1%}"
        if t.bytes[label]:
            mb = t.bytes[label] / NEW_TOKENS / 1e6
            rate = t.bytes[label] / t.seconds[label] / 1e9
            row |= {"mb_per_token": mb, "gb_per_s": rate, "of_peak": rate / bandwidth}
            line += f" {mb:9.1f} {rate:6.1f} {rate / bandwidth:8.0%}"
        rows[label] = row
        print(line)
    return {"tokens_per_s": NEW_TOKENS / total, "parts": rows}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="122m")
    ap.add_argument("--quantization", default="int4", choices=["int4", "w4a8"])
    ap.add_argument("--lm-head", default="int4", choices=["none", "int8", "int4"])
    ap.add_argument(
        "--kernels",
        nargs="+",
        default=["all"],
        choices=["all", *KERNEL_CHOICES],
        help="the variants to profile (all: every native target this CPU executes)",
    )
    args = ap.parse_args()
    variants = executable_targets() if args.kernels == ["all"] else args.kernels
    bandwidth = read_bandwidth_gbs()
    summary = {}
    for kernels in variants:
        figures = profile(args, kernels, bandwidth)
        layers = figures["as_served"]["parts"].get("decoder layers (one native call each)", {})
        summary[figures["kernels"]] = layers.get("of_peak")
    print(f"\nread bandwidth {bandwidth:.1f} GB/s; decoder layers' share of it, by kernels:")
    for name, share in summary.items():
        print(f"  {name:<9} {'-' if share is None else f'{share:.0%}'}")


def profile(args: argparse.Namespace, kernels: str, bandwidth: float) -> dict:
    llm = LLM(
        model=str(build_model(args.model)),
        dtype="bfloat16",
        quantization=args.quantization,
        quantize_lm_head=args.lm_head,
        max_model_len=2048,
        kernels=kernels,
        enable_prefix_caching=False,
    )
    engine = llm.llm_engine
    dev, model, runner = engine.device, engine.model, engine.runner
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompt = [{"prompt_token_ids": list(range(10, 42))}]
    llm.generate(prompt, params, use_tqdm=False)  # warm-up
    layer_bytes = {
        name: nbytes(getattr(model.layers[0], name))
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    }

    originals = {
        (obj, attr): getattr(obj, attr)
        for obj, attr in [
            (engine, "step"), (engine.scheduler, "schedule"), (runner, "prepare_inputs"),
            (runner, "sampler"), (engine, "_update"), (model, "compute_logits"),
            (model, "forward"), (dev, "linear"), *((dev, op) for op in HAL_OPS),
        ]
    }  # fmt: skip
    fused_layers = list(model.fused_layers)

    def undo() -> None:  # the timers off again
        for (obj, attr), fn in originals.items():
            setattr(obj, attr, fn)
        model.fused_layers = list(fused_layers)

    def stages(t: Timers) -> None:  # the step as served
        t.wrap(engine, "step", "whole step")
        t.wrap(engine.scheduler, "schedule", "engine: schedule")
        t.wrap(runner, "prepare_inputs", "engine: prepare inputs")
        t.wrap(runner, "sampler", "engine: sample")  # (no prompt logprobs asked for here)
        t.wrap(engine, "_update", "engine: outputs, detokenize, stop checks")
        t.wrap(model, "compute_logits", "lm_head", lambda hidden: nbytes(model.lm_head))
        forward = model.forward

        def timed_forward(input_ids, positions, meta, *rest):  # (kv_cache, and lora)
            label = (
                "model forward: decode steps"
                if meta.is_decode_only
                else ("model forward: prefill (the 32-token prompt)")
            )
            start = time.perf_counter()
            out = forward(input_ids, positions, meta, *rest)
            t.seconds[label] += time.perf_counter() - start
            return out

        model.forward = timed_forward
        fused = model.fused_layers
        if any(f is not None for f in fused):
            model.fused_layers = [_timed(f, t, sum(layer_bytes.values())) for f in fused]

    def ops(t: Timers) -> None:  # the decoder op by op: where a layer's time goes
        model.fused_layers = [None] * len(model.layers)
        by_weight = {id(getattr(layer, n)): n for layer in model.layers for n in layer_bytes}
        linear = dev.linear

        def timed_linear(x, w, b=None):
            start = time.perf_counter()
            out = linear(x, w, b)
            name = by_weight.get(id(w))
            if name is not None:
                t.seconds[f"linear {name}"] += time.perf_counter() - start
                t.bytes[f"linear {name}"] += layer_bytes[name]
            return out

        dev.linear = timed_linear
        for op in HAL_OPS:
            t.wrap(dev, op, op)
        t.wrap(model, "forward", "model forward, all ops with Python between them")

    served = print_table(
        f"{args.model}, {args.quantization}, lm_head {args.lm_head}, {dev.kernel_set} kernels, "
        f"{torch.get_num_threads()} threads, read bandwidth {bandwidth:.1f} GB/s; as served",
        *run_profiled(llm, params, prompt, stages, undo),
        bandwidth,
    )
    by_op = print_table(
        "the decoder op by op", *run_profiled(llm, params, prompt, ops, undo), bandwidth
    )
    figures = {
        "model": args.model,
        "quantization": args.quantization,
        "lm_head": args.lm_head,
        "kernels": dev.kernel_set,
        "threads": torch.get_num_threads(),
        "read_bandwidth_gbs": bandwidth,
        "as_served": served,
        "op_by_op": by_op,
    }
    write_result(f"profile_decode_{args.model}_{dev.kernel_set}", figures)
    return figures


def _timed(layer, t: Timers, weight_bytes: int):
    label = "decoder layers (one native call each)"

    def timed(*args):
        start = time.perf_counter()
        out = layer(*args)
        t.seconds[label] += time.perf_counter() - start
        t.bytes[label] += weight_bytes
        return out

    return None if layer is None else timed


if __name__ == "__main__":
    main()
