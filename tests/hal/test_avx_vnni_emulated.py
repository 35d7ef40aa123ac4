"""The avx2 target's AVX-VNNI branch (vpdpwssd for W4A16, vpdpbusd for W4A8: what the kernels run
on Intel's Core CPUs since Alder Lake, which have AVX-VNNI and no AVX-512), run on a CPU without
AVX-VNNI: its two instructions emulated exactly (csrc/avx_vnni_emulation.h), the rest of the
code as compiled for such a CPU. Held bit-identical to the build without the branch, which the
other tests hold to the PyTorch reference: both sum the same integers and take the same float
steps. On a CPU with AVX-VNNI the other avx2 tests run the real branch (and
test_avx2_without_vnni.py the one without)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from pagedserve.hal import get_device, native
from pagedserve.models.quant_formats import quantize_rtn
from tests.helpers.tools import missing_tool

HERE = Path(__file__).resolve().parent / "csrc"
AVX2 = native.TARGETS["avx2"]

pytestmark = pytest.mark.skipif(
    bool(native.missing_flags(AVX2)) or "avx_vnni" in native.cpu_flags(),
    reason="runs where the CPU executes the avx2 target without AVX-VNNI (with it, the real "
    "branch is what the avx2 tests run)",
)

# (out_features, in_features, group size, rows): one-tile passes (under 8 rows) and two-tile ones,
# a last pass of fewer rows, out_features padded to whole tiles (13, 45), every group size the
# kernels know when compiled and one they read at run time (256)
CASES = [
    (8, 64, 32, 1),
    (13, 256, 64, 3),
    (45, 384, 128, 7),
    (24, 512, 256, 9),
    (40, 96, 32, 23),
    (64, 1024, 32, 64),
]


@pytest.fixture(scope="module")
def emulated():
    """int4.cpp and its binding built for avx2 with the emulation included first; cached beside
    the kernels' builds (not among them: those are one directory a target), keyed by every
    source."""
    if why := native._missing_tool():
        missing_tool(why)
    key = hashlib.sha256(native.build_key(AVX2).encode())
    for path in sorted(HERE.iterdir()):
        key.update(path.name.encode() + path.read_bytes())
    module = native.build_library(
        "pagedserve_avx2_emulated_vnni",
        [HERE / "avx_vnni_binding.cpp", native.CSRC / "int4.cpp"],
        [
            *native.target_cflags(AVX2),
            f"-I{native.CSRC}",
            "-include",
            str(HERE / "avx_vnni_emulation.h"),
        ],
        native.cache_dir().parent / "test-kernels" / f"avx2-vnni-{key.hexdigest()[:16]}",
    )
    assert module.AVX_VNNI  # the branch this test is for
    return module


@pytest.mark.parametrize("abits", [16, 8], ids=["w4a16", "w4a8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n,k,group,rows", CASES)
def test_the_avx_vnni_branch_gives_the_bits_of_the_avx2_kernels(
    emulated, abits, dtype, n, k, group, rows
):
    dev = get_device("cpu", kernels="avx2")
    assert not dev.native.AVX_VNNI
    g = torch.Generator().manual_seed(n * rows + abits)
    q, s, z = quantize_rtn(torch.randn(n, k, generator=g) * 0.05, group)
    layer = dev.prepare_int4(q, s, z, group, f"vnni-{n}-{k}-{rows}-{abits}", abits)
    assert layer.layout in ("tiles8", "tiles8_a8")  # the avx2 kernels', not PyTorch's
    x = (torch.randn(rows, k, generator=g) * 3).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    kernel = emulated.int4_int8_linear if abits == 8 else emulated.int4_linear
    for b in (None, bias):
        got = kernel(x, layer.packed, layer.scales_and_zeros, group, b, n)
        torch.testing.assert_close(got, dev.int4_linear(x, layer, b), rtol=0, atol=0)
