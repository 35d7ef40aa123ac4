"""Which linear path is fastest per batch size M on this CPU: PyTorch's int4 kernel, dense bf16, or
dequantize-then-bf16-GEMM. Shapes of the 120M benchmark model (hidden 768) and of GLM-4-9B.

    python benchmarks/int4_kernel.py [--shapes 120m|9b]
"""

from __future__ import annotations

import argparse
import time

import torch


def timeit(fn, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) / iters * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", choices=["120m", "9b"], default="120m")
    args = ap.parse_args()
    shapes = {
        "120m": [("qkv", 1024, 768), ("o", 768, 768), ("gate_up", 4096, 768), ("down", 768, 2048)],
        "9b": [("gate_up", 27392, 4096), ("down", 4096, 13696)],
    }[args.shapes]
    G = 32
    print(f"{'layer':8s} {'M':>4s} {'int4 ms':>8s} {'bf16 ms':>8s} {'deq+bf16':>8s}")
    for name, N, K in shapes:
        w = torch.randn(N, K, dtype=torch.bfloat16)
        q = torch.randint(0, 16, (N, K), dtype=torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        sz = torch.randn(K // G, N, 2, dtype=torch.bfloat16)
        qu8 = q.to(torch.uint8)
        s = torch.randn(N, K // G, dtype=torch.bfloat16)
        z = torch.randn(N, K // G, dtype=torch.bfloat16)

        def dequant_mm(x):
            wd = (qu8.view(N, K // G, G).to(torch.bfloat16) - 8) * s[..., None] + z[..., None]
            return x @ wd.view(N, K).T

        for M in (1, 4, 8, 16, 32, 64, 128, 512):
            x = torch.randn(M, K, dtype=torch.bfloat16)
            t4 = timeit(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, G, sz))
            tb = timeit(lambda: x @ w.T)
            td = timeit(lambda: dequant_mm(x), iters=5)
            print(f"{name:8s} {M:4d} {t4:8.3f} {tb:8.3f} {td:8.3f}")


if __name__ == "__main__":
    main()
