"""The avx2 target built without AVX-VNNI (as on a Zen 3: vpmaddubsw summed in int16, then
vpmaddwd; vpmaddwd + vpaddd for W4A16), on a CPU that has AVX-VNNI: the avx2 tests elsewhere run
the VNNI build there, so this runs the other one, in a process that sees the CPU's flags without
AVX-VNNI and AVX-512 ($PAGEDSERVE_CPU_FLAGS), against the exact emulations of both modes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve.hal import native

ROOT = Path(__file__).resolve().parents[2]

CHECK = """
import json, torch
from pagedserve.hal import get_device
from pagedserve.hal.int4 import (Int4Linear, dequantize, quantize_activations_int8,
                                 quantize_activations_int16)
from pagedserve.models.quant_formats import quantize_rtn
dev = get_device("cpu", kernels="avx2")
errors = []
for n, k, group, rows in [(8, 64, 32, 1), (40, 256, 64, 5), (72, 384, 128, 13), (16, 96, 32, 64)]:
    g = torch.Generator().manual_seed(n + rows)
    q, s, z = quantize_rtn(torch.randn(n, k, generator=g) * 0.05, group)
    x = torch.randn(rows, k, generator=g)
    w = Int4Linear(n, k, group, qcodes=q, scales=s, zeros=z)
    for abits, emulate in ((16, lambda t: quantize_activations_int16(t, group)),
                           (8, quantize_activations_int8)):
        layer = dev.prepare_int4(q, s, z, group, f"w{n}-{rows}-{abits}", abits)
        expected = emulate(x) @ dequantize(w).T
        got = dev.linear(x, layer)
        errors.append((got - expected).abs().max().item() / expected.abs().max().item())
print(json.dumps({"vnni": dev.native.AVX_VNNI, "errors": errors}))
"""


@pytest.mark.skipif(
    bool(native.missing_flags(native.TARGETS["avx2"])) or "avx_vnni" not in native.cpu_flags(),
    reason="this CPU has no AVX-VNNI: the avx2 tests run the build without it already",
)
def test_avx2_int4_kernels_without_vnni_equal_their_emulations():
    flags = sorted(f for f in native.cpu_flags() if not f.startswith(("avx512", "avx_vnni", "amx")))
    env = {**os.environ, "PAGEDSERVE_CPU_FLAGS": " ".join(flags), "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["vnni"] is False  # the build this test is for
    assert max(result["errors"]) < 1e-5, result["errors"]  # fp32 rounding of exact integer sums
