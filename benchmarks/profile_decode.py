"""Where a batch-1 token's time goes, and how far each part is from this machine's memory roofline.

    python benchmarks/profile_decode.py [--model 122m] [--lm-head int4] [--enforce-eager]

Runs the batch-1 workload of compare.py (32-token prompt, 64 greedy tokens, INT4 weights) with a
timer around every HAL op and every engine stage, then prints milliseconds per token for each, the
bytes each linear streams and the rate it streams them at, against the read bandwidth measured here
(a 1 GiB sum). Writes benchmarks/results/profile_decode_<model>.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_models import build_model  # noqa: E402
from results import write_result  # noqa: E402

from pagedserve import LLM, SamplingParams  # noqa: E402
from pagedserve.hal.int4 import Int4Linear  # noqa: E402
from pagedserve.hal.int8 import Int8Linear  # noqa: E402

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
    """Bytes per second a sum over 1 GiB reads, best of 5."""
    big = torch.ones(2**28, dtype=torch.float32)
    best = float("inf")
    for _ in range(5):
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


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="122m")
    ap.add_argument("--lm-head", default="int4", choices=["none", "int8", "int4"])
    ap.add_argument("--enforce-eager", action="store_true")
    args = ap.parse_args()
    llm = LLM(
        model=str(build_model(args.model)),
        dtype="bfloat16",
        quantization="int4",
        quantize_lm_head=args.lm_head,
        max_model_len=2048,
        enforce_eager=args.enforce_eager,
    )
    engine = llm.llm_engine
    dev, model, runner = engine.device, engine.model, engine.runner
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompt = [{"prompt_token_ids": list(range(10, 42))}]
    llm.generate(prompt, params, use_tqdm=False)  # warm-up

    t = Timers()
    t.wrap(engine, "step", "whole step")
    t.wrap(engine.scheduler, "schedule", "engine: schedule")
    t.wrap(runner, "prepare_inputs", "engine: prepare inputs")
    t.wrap(runner, "sampler", "engine: sample")  # (prompt logprobs are not asked for here)
    t.wrap(engine, "_update", "engine: outputs, detokenize, stop checks")
    t.wrap(model, "forward", "model forward (all layers)")
    t.wrap(model, "compute_logits", "lm_head", lambda hidden: nbytes(model.lm_head))
    layer_linears = {
        name: nbytes(getattr(model.layers[0], name))
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    }
    by_weight = {id(getattr(layer, n)): n for layer in model.layers for n in layer_linears}
    linear = dev.linear

    def timed_linear(x, w, b=None):
        start = time.perf_counter()
        out = linear(x, w, b)
        name = by_weight.get(id(w))
        if name is not None:
            label = f"linear {name}"
            t.seconds[label] += time.perf_counter() - start
            t.calls[label] += 1
            t.bytes[label] += layer_linears[name]
        return out

    dev.linear = timed_linear
    for op in HAL_OPS:
        t.wrap(dev, op, op)
    start = time.perf_counter()
    llm.generate(prompt, params, use_tqdm=False)
    total = time.perf_counter() - start
    bandwidth = read_bandwidth_gbs()

    steps = t.calls["whole step"]
    rows = {}
    print(f"{args.model}, INT4, lm_head {args.lm_head}, {dev.kernel_set} kernels, "
          f"{torch.get_num_threads()} threads; read bandwidth {bandwidth:.1f} GB/s")  # fmt: skip
    print(f"{NEW_TOKENS / total:.1f} tokens/s ({total / NEW_TOKENS * 1e3:.3f} ms per token)\n")
    print(f"{'part':<44} {'ms/token':>9} {'share':>6} {'MB/token':>9} {'GB/s':>6} {'of peak':>8}")
    for label in sorted(t.seconds, key=lambda k: -t.seconds[k]):
        ms = t.seconds[label] / NEW_TOKENS * 1e3
        row = {"ms_per_token": ms, "share": t.seconds[label] / total}
        line = f"{label:<44} {ms:9.3f} {row['share']:6.1%}"
        if t.bytes[label]:
            mb = t.bytes[label] / NEW_TOKENS / 1e6
            rate = t.bytes[label] / t.seconds[label] / 1e9
            row |= {"mb_per_token": mb, "gb_per_s": rate, "of_peak": rate / bandwidth}
            line += f" {mb:9.1f} {rate:6.1f} {rate / bandwidth:8.0%}"
        rows[label] = row
        print(line)
    write_result(
        f"profile_decode_{args.model}",
        {
            "model": args.model,
            "lm_head": args.lm_head,
            "kernels": dev.kernel_set,
            "threads": torch.get_num_threads(),
            "steps": steps,
            "tokens_per_s": NEW_TOKENS / total,
            "read_bandwidth_gbs": bandwidth,
            "parts": rows,
        },
    )


if __name__ == "__main__":
    main()
