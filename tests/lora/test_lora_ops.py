"""The LoRA ops against the per-row reference, on every path they take, for rows sorted by slot
(as the engine sorts a step) and not: the grouped PyTorch ops (grouped GEMMs for uneven runs,
padded bmm for even runs with contiguous or scattered slots, matmuls for one adapter and strides
the grouped GEMM refuses) and each native target's kernel (``csrc/lora.h``); fp32 exactly, bf16
within its rounding."""

from __future__ import annotations

import pytest
import torch

from pagedserve.hal import get_device
from pagedserve.hal.cpu import LORA_NATIVE_MAX_ROWS
from pagedserve.lora.ops import LoRABatch, add_lora, add_lora_reference
from tests.helpers.kernels import TARGETS

SLOTS = 4


def _weights(dtype, fan_in=64, r=16, fan_out=96):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(SLOTS, fan_in, r, generator=g).to(dtype)
    b = torch.randn(SLOTS, r, fan_out, generator=g).to(dtype) * 0.1
    return a, b


CASES = {
    # token slots -> the path LoRABatch chooses; sorted by slot (as the engine sorts a step),
    # the adapter rows are one span of the batch and the ops take views of it
    "sorted, uneven runs: grouped GEMM on views": ([-1, -1, 0, 0, 0, 1], "grouped"),
    "sorted, one adapter: matmuls on views": ([-1, 2, 2, 2], "grouped"),
    "sorted, equal runs: padded bmm on views": ([-1, 1, 1, 2, 2, 3, 3], "padded"),
    "sorted, equal runs, scattered slots: padded bmm on views": ([0, 0, 3, 3], "padded"),
    "unsorted, uneven runs: grouped GEMM": ([0, 0, 0, 0, 0, 0, 2, -1, 0, 0], "grouped"),
    "unsorted, one adapter: matmuls": ([3, -1, 3, 3], "grouped"),
    "unsorted, even runs, contiguous slots: padded bmm": ([1, 2, 1, 2, -1, 2, 1], "padded"),
    "unsorted, even runs, scattered slots: padded bmm": ([0, 3, 3, 0, -1, 0, 3], "padded"),
    "unsorted, nearly even runs: padded bmm": ([0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1], "padded"),
}


def _parts(dtype, outs=(64, 16, 16), fan_in=64, r=16):
    """A fused layer's slots: ``a`` [slots, in, 3r], and q, k and v's own ``b``."""
    g = torch.Generator().manual_seed(1)
    a = torch.randn(SLOTS, fan_in, r * len(outs), generator=g).to(dtype)
    return a, [(torch.randn(SLOTS, r, n, generator=g) * 0.1).to(dtype) for n in outs]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", [False, True], ids=["one part", "q k v parts"])
@pytest.mark.parametrize("case", CASES)
def test_grouped_ops_add_what_the_reference_adds_row_by_row(case, fused, dtype):
    token_slots, path = CASES[case]
    batch = LoRABatch.build(token_slots, SLOTS)
    assert (batch.padded is not None) == (path == "padded")
    a, b = _parts(dtype) if fused else _weights(dtype)
    width = sum(p.shape[2] for p in b) if fused else b.shape[2]
    x = torch.randn(len(token_slots), a.shape[1]).to(dtype)
    y = torch.randn(len(token_slots), width).to(dtype)
    got = add_lora(y.clone(), x, a, b, batch)
    as_double = [p.double() for p in b] if fused else b.double()
    want = add_lora_reference(y.double(), x.double(), a.double(), as_double, token_slots)
    tol = {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.1, "rtol": 0.02}
    torch.testing.assert_close(got.double(), want, **tol)
    base_rows = [t for t, s in enumerate(token_slots) if s < 0]
    assert torch.equal(got[base_rows], y[base_rows])  # a base row is left exactly as it was


def test_a_rank_whose_rows_the_grouped_gemm_refuses_takes_the_loop_of_matmuls():
    token_slots = [0, 0, 0, 1]  # uneven: not padded
    a, b = _weights(torch.float32, r=3)  # 12-byte rows: the grouped GEMM refuses them
    x, y = torch.randn(4, 64), torch.zeros(4, 96)
    got = add_lora(y.clone(), x, a, b, LoRABatch.build(token_slots, SLOTS))
    torch.testing.assert_close(got, add_lora_reference(y, x, a, b, token_slots))


@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("token_slots", [[-1, 0, 0, 0, 2], [1, 0, 1, 0], [0, 0, 1, 1]])
def test_either_path_forced_adds_what_the_reference_adds(token_slots, padded):
    """The benchmark forces each path on the same rows: each gives the reference's sums."""
    batch = LoRABatch.build(token_slots, SLOTS, padded)
    assert (batch.padded is not None) == padded
    a, b = _weights(torch.float32)
    x, y = torch.randn(len(token_slots), 64), torch.randn(len(token_slots), 96)
    got = add_lora(y.clone(), x, a, b, batch)
    torch.testing.assert_close(got, add_lora_reference(y.clone(), x, a, b, token_slots))


def test_a_batch_of_base_rows_only_has_no_lora_at_all():
    assert LoRABatch.build([-1, -1, -1], SLOTS) is None


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fused", [False, True], ids=["one part", "q k v parts"])
@pytest.mark.parametrize("case", CASES)
def test_each_native_target_adds_what_the_reference_adds_row_by_row(case, fused, dtype, target):
    token_slots, _ = CASES[case]
    device = get_device("cpu", kernels=target)
    a, b = _parts(dtype) if fused else _weights(dtype)
    width = sum(p.shape[2] for p in b) if fused else b.shape[2]
    x = torch.randn(len(token_slots), a.shape[1]).to(dtype)
    y = torch.randn(len(token_slots), width).to(dtype)
    got = device.lora_add(y.clone(), x, a, b, LoRABatch.build(token_slots, SLOTS))
    assert device.native_ops()["lora_add"] == "native"  # the kernel ran, not the grouped ops
    as_double = [p.double() for p in b] if fused else b.double()
    want = add_lora_reference(y.double(), x.double(), a.double(), as_double, token_slots)
    # fp32 sums in another order; 16-bit: one rounding of each output
    tol = {"atol": 1e-4, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.05, "rtol": 0.01}
    torch.testing.assert_close(got.double(), want, **tol)
    base_rows = [t for t, s in enumerate(token_slots) if s < 0]
    assert torch.equal(got[base_rows], y[base_rows])


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("rank", [1, 3, 8, 24, 64])
@pytest.mark.parametrize("fan_in, fan_out", [(7, 5), (64, 96), (200, 333)])
def test_the_native_kernel_takes_any_rank_and_width(target, rank, fan_in, fan_out):
    """Ranks and widths that are not whole vectors (tails on every target), a row per slot and
    rows of one slot across both threads."""
    token_slots = [3, 0, -1, 0, 0, 2, 2, 1, 1, 1, 3]
    device = get_device("cpu", kernels=target)
    g = torch.Generator().manual_seed(rank + fan_in)
    a = torch.randn(SLOTS, fan_in, rank, generator=g)
    b = torch.randn(SLOTS, rank, fan_out, generator=g)
    x = torch.randn(len(token_slots), fan_in, generator=g)
    y = torch.randn(len(token_slots), fan_out, generator=g)
    got = device.lora_add(y.clone(), x, a, b, LoRABatch.build(token_slots, SLOTS))
    want = add_lora_reference(y.double(), x.double(), a.double(), b.double(), token_slots)
    # fp32 sums in any order stay within the classic bound for two dot products of n_1 and n_2
    # terms and one addition: (n_1 + n_2 + 1) u (|x| |a| |b| + |y|), u the unit roundoff
    magnitude = add_lora_reference(
        y.double().abs(), x.double().abs(), a.double().abs(), b.double().abs(), token_slots
    )
    bound = (fan_in + rank + 1) * 2.0**-24 * magnitude
    assert ((got.double() - want).abs() <= bound).all()


def test_a_rank_past_the_kernels_limit_is_left_to_the_grouped_ops_and_says_why():
    device = get_device("cpu")
    if device.native is None:
        pytest.skip("no native kernels on this machine")
    a, b = torch.randn(SLOTS, 8, 3 * 600), [torch.randn(SLOTS, 600, 4) for _ in range(3)]
    batch = LoRABatch.build([0, 1], SLOTS)
    assert device.lora_add(torch.zeros(2, 12), torch.randn(2, 8), a, b, batch) is None
    assert device.native_ops()["lora_add"] == (
        "parts x rank 1800 exceeds 1536; the grouped PyTorch ops"
    )


def test_a_prompts_many_rows_are_left_to_the_grouped_ops():
    device = get_device("cpu")
    a, b = _weights(torch.float32)
    rows = LORA_NATIVE_MAX_ROWS + 1  # the grouped GEMMs reuse each weight across rows
    batch = LoRABatch.build([r % SLOTS for r in range(rows)], SLOTS)
    assert device.lora_add(torch.zeros(rows, 96), torch.randn(rows, 64), a, b, batch) is None
