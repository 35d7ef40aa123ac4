"""Every path a linear layer can take on this CPU, by batch rows M, on real layer shapes:

- native int4: the kernel target's W4A16 (``hal/csrc/int4_<target>.h``): weights stay INT4 in
  memory, each packed tile's codes are unpacked once per pass of rows (avx512: 8 rows, vpdpwssd
  on int16 activations; avx2: 4 rows, vpmaddwd), through the driver of ``csrc/int4_gemm.h``;
- native w4a8: the same weights with activations rounded to int8 per block of 32 (``--quantization
  w4a8``), multiplied with vpdpbusd (avx512, and avx2 where the CPU has AVX-VNNI) or vpmaddubsw +
  vpmaddwd (avx2);
- aten int4: PyTorch's ``_weight_int4pack_mm_for_cpu`` (what ``--kernels eager`` runs);
- bf16 F.linear: oneDNN on 16-bit weights (what INT4 saves memory against);
- native bf16 GEMV (up to the target's few_rows_max(): 64, or 16 with AMX)
  and torch.mv (1 row): the dense few-row paths.

    python -m benchmarks.linear_paths [--model 122m|1b] [--kernels auto|avx512|avx2] [--isa avx2]
        [--rows 1 2 4 8 16 32 64 128 512] [--group-size 32|64|128] [--huge-pages on|off]
        [--output NAME]

``--isa avx2`` measures as on a Zen 3, on any x86 CPU: pagedserve sees this CPU's flags without
AVX-512, AVX-VNNI and AMX, and PyTorch's and oneDNN's kernels are held to AVX2 (compare.py's
``--isa avx2``; the script restarts itself in that environment).

Each call reads a different copy of the layer, with 64 MB of copies in all, so that the weights
come from memory as in a decode step of a whole model, not from the last-level cache. Prints
microseconds per call and GFLOP/s, and for the native INT4 paths their multiply-adds a cycle a
core against the int8 peak of the target's instructions (``benchmarks.cpu_clock``: the clock
measured here, the peak from the microarchitecture), and writes them all to
benchmarks/results/NAME.json (default
linear_paths_MODEL_KERNELS, and _gG at a group size G other than 32; give a run of other rows its
own NAME, so that it does not replace the full run the README quotes)."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from benchmarks.bench_models import SHAPES
from benchmarks.cpu_clock import clock_ghz, int8_peak_macs_per_cycle, microarchitecture
from benchmarks.results import write_result
from pagedserve.hal import get_device
from pagedserve.hal.int4 import cpu_int4_scales_and_zeros
from pagedserve.models.quant_formats import quantize_rtn

GROUP_SIZES = (32, 64, 128)  # what the quantizers write (--quant-group-size)
PATHS = [
    "native int4",
    "native w4a8",
    "aten int4",
    "bf16 F.linear",
    "native bf16 GEMV",
    "torch.mv",
]


def layer_shapes(model: str) -> list[tuple[str, int, int]]:
    s = SHAPES[model]
    h, d = s["hidden_size"], s["head_dim"]
    q, kv = s["num_attention_heads"] * d, s["num_key_value_heads"] * d
    return [
        ("qkv", q + 2 * kv, h),
        ("o_proj", h, q),
        ("gate_up", 2 * s["intermediate_size"], h),
        ("down", h, s["intermediate_size"]),
        ("lm_head", s["vocab_size"], h),
    ]


COPIES_BYTES = 64 * 2**20  # more than a last-level cache holds


def per_call_us(fns: list[Callable[[], torch.Tensor]], min_seconds: float = 0.2) -> float:
    """Mean microseconds of a call, cycling through ``fns`` (one per copy of the weights)."""
    for fn in fns[:2]:
        fn()
    iters, start = 0, time.perf_counter()
    while time.perf_counter() - start < min_seconds or iters < len(fns):
        fns[iters % len(fns)]()
        iters += 1
    return (time.perf_counter() - start) / iters * 1e6


def measure(
    n: int, k: int, rows: list[int], kernels: str, group: int
) -> dict[int, dict[str, float]]:
    native = get_device("cpu", kernels=kernels)
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16)
    q, s, z = quantize_rtn(w.float(), group)
    copies = range(max(1, COPIES_BYTES // (n * k // 2)))
    dense_copies = [w.clone() for _ in range(max(1, COPIES_BYTES // (2 * n * k)))]
    has_int4 = native.native is not None and hasattr(native.native, "int4_linear")
    layers = [native.prepare_int4(q, s, z, group, f"w{i}") for i in copies] if has_int4 else []
    layers_a8 = (
        [native.prepare_int4(q, s, z, group, f"a{i}", 8) for i in copies] if has_int4 else []
    )
    aten = [
        torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1) for _ in copies
    ]
    aten_sz = cpu_int4_scales_and_zeros(s, z)

    def paths(x: torch.Tensor) -> dict[str, float]:
        m = x.shape[0]
        mm = torch.ops.aten._weight_int4pack_mm_for_cpu
        t = {
            "aten int4": per_call_us([lambda a=a: mm(x, a, group, aten_sz) for a in aten]),
            "bf16 F.linear": per_call_us([lambda d=d: F.linear(x, d) for d in dense_copies]),
        }
        if has_int4:
            t["native int4"] = per_call_us([lambda la=la: native.linear(x, la) for la in layers])
            t["native w4a8"] = per_call_us([lambda la=la: native.linear(x, la) for la in layers_a8])
        if hasattr(native.native, "bf16_linear_few_rows") and m <= native.native.few_rows_max():
            gemv = native.native.bf16_linear_few_rows
            t["native bf16 GEMV"] = per_call_us(
                [lambda d=d: gemv(x, d, None) for d in dense_copies]
            )
        if m == 1:
            t["torch.mv"] = per_call_us([lambda d=d: torch.mv(d, x[0]) for d in dense_copies])
        return t

    return {m: paths(torch.randn(m, k, generator=g).to(torch.bfloat16)) for m in rows}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="122m", choices=sorted(SHAPES))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 512])
    ap.add_argument(
        "--kernels", default="auto", help="the kernel target (default: this CPU's best)"
    )
    ap.add_argument(
        "--isa",
        choices=["native", "avx2"],
        default="native",
        help="avx2: as on a Zen 3 (this CPU's newer flags hidden, PyTorch held to AVX2)",
    )
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument(
        "--group-size",
        type=int,
        default=32,
        choices=GROUP_SIZES,
        help="values a weight scale and zero point cover (default 32, --quant-group-size's)",
    )
    ap.add_argument(
        "--huge-pages",
        choices=["on", "off"],
        default="on",
        help="INT4 weights on transparent huge pages where the OS has them (hal/huge_pages.py); "
        "off: on 4 KiB pages, to measure what they bring",
    )
    ap.add_argument(
        "--output", default=None, help="results file name (default linear_paths_MODEL_KERNELS[_gG])"
    )
    args = ap.parse_args()
    os.environ["PAGEDSERVE_HUGE_PAGES"] = args.huge_pages
    if args.isa == "avx2" and "PAGEDSERVE_CPU_FLAGS" not in os.environ:
        from benchmarks.compare import worker_env

        # (PyTorch reads its capability when it loads: start again in the AVX2 environment)
        argv = [sys.executable, "-m", "benchmarks.linear_paths", *sys.argv[1:]]
        os.execve(sys.executable, argv, worker_env("avx2"))
    torch.set_num_threads(args.threads)
    kernels = get_device("cpu", kernels=args.kernels).kernel_set
    from pagedserve.hal.native import cpu_flags

    vnni = kernels == "avx512" or (kernels == "avx2" and "avx_vnni" in cpu_flags())
    ghz, peak = clock_ghz(), int8_peak_macs_per_cycle(kernels)
    print(f"{kernels} kernels ({'with' if vnni else 'without'} VNNI), {args.threads} threads, "
          f"{microarchitecture()} at {ghz:.2f} GHz "
          f"(int8 peak {peak} MACs a cycle a core); microseconds per call (GFLOP/s)")  # fmt: skip
    print(f"{'layer':8s} {'M':>4s} " + " ".join(f"{p:>20s}" for p in PATHS))
    # (a run at another group size gets a file of its own, not the default one the README quotes)
    group_suffix = "" if args.group_size == 32 else f"_g{args.group_size}"
    table = {}
    for name, n, k in layer_shapes(args.model):
        table[name] = {"n": n, "k": k, "rows": {}, "gflops": {}, "macs_per_cycle_per_core": {}}
        for m, t in measure(n, k, args.rows, kernels, args.group_size).items():
            gflops = {p: round(2 * m * n * k / us / 1e3, 1) for p, us in t.items()}
            table[name]["rows"][m] = {p: round(us, 1) for p, us in t.items()}
            table[name]["gflops"][m] = gflops
            cells = [f"{t[p]:9.0f} ({gflops[p]:5.0f})" if p in t else "-" for p in PATHS]
            per_cycle = {
                p: round(m * n * k / (t[p] * 1e3 * ghz * args.threads), 2)
                for p in ("native int4", "native w4a8")
                if p in t
            }
            table[name]["macs_per_cycle_per_core"][m] = per_cycle
            of_peak = "  ".join(f"{p[7:]} {v:.1f} ({100 * v / peak:.0f}%)" for p, v in
                                per_cycle.items()) if peak else ""  # fmt: skip
            print(f"{name:8s} {m:4d} " + " ".join(f"{c:>20s}" for c in cells) + f"  {of_peak}",
                  flush=True)  # fmt: skip
    path = write_result(
        args.output or f"linear_paths_{args.model}_{kernels}{group_suffix}",
        {
            "model": args.model,
            "kernels": kernels,
            "isa": args.isa,
            "vnni": vnni,
            "threads": args.threads,
            "microarchitecture": microarchitecture(),
            "clock_ghz": round(ghz, 3),
            "int8_peak_macs_per_cycle_per_core": peak,
            "group_size": args.group_size,
            "huge_pages": args.huge_pages,
            "us_per_call": table,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
