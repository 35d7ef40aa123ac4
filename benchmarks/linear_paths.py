"""Which path each linear layer should take on this CPU, by batch rows M: PyTorch's int4 kernel
(``_weight_int4pack_mm_for_cpu``, bf16 activations), dense bf16 ``F.linear``, and ``torch.mv`` for a
single row. Shapes of the 120M benchmark model (hidden 768) plus its lm_head.

    python benchmarks/linear_paths.py [--rows 1 8 32 128] [--threads 2]

The figures behind the choices in ``pagedserve/hal/cpu.py`` and the README come from this script.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

GROUP = 32
SHAPES = [
    ("qkv", 1024, 768),
    ("o_proj", 768, 768),
    ("gate_up", 4096, 768),
    ("down", 768, 2048),
    ("lm_head", 32000, 768),
]


def per_call_us(fn: Callable[[], torch.Tensor], iters: int) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters * 1e6


def measure(n: int, k: int, m: int, iters: int) -> dict[str, float]:
    codes = torch.randint(0, 16, (n, k), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    scales_zeros = torch.randn(k // GROUP, n, 2, dtype=torch.bfloat16)
    w = torch.randn(n, k, dtype=torch.bfloat16)
    x = torch.randn(m, k, dtype=torch.bfloat16)
    out = {
        "int4": per_call_us(
            lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scales_zeros),
            iters,
        ),
        "bf16": per_call_us(lambda: F.linear(x, w), iters),
    }
    if m == 1:
        out["bf16 mv"] = per_call_us(lambda: torch.mv(w, x[0]), iters)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{args.threads} threads; microseconds per call (GFLOP/s)")
    print(f"{'layer':8s} {'M':>4s} {'int4':>16s} {'bf16':>16s} {'bf16 mv':>16s}")
    for name, n, k in SHAPES:
        for m in args.rows:
            t = measure(n, k, m, args.iters)
            cells = [
                f"{t[p]:8.0f} ({2 * m * n * k / t[p] / 1e3:4.0f})" if p in t else f"{'-':>16s}"
                for p in ("int4", "bf16", "bf16 mv")
            ]
            print(f"{name:8s} {m:4d} " + " ".join(f"{c:>16s}" for c in cells))


if __name__ == "__main__":
    main()
