"""Every CPU kernel set (each native target this machine can execute, and eager PyTorch) equals the
plain-PyTorch references, over the shapes and dtypes the models use; the whole engine gives the
same greedy tokens with each. A target the CPU cannot execute is skipped, naming what it lacks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve import LLM, SamplingParams
from pagedserve.hal import get_device, kernels, native
from pagedserve.hal.int4 import (
    Int4Linear,
    dequantize,
    quantize_activations_int8,
    quantize_activations_int16,
)
from pagedserve.models.quant_formats import quantize_rtn
from tests.helpers.kernels import KERNEL_SETS, TARGETS, paged_batch

DTYPES = [torch.float32, torch.bfloat16]
INT4_LAYOUTS = {  # each target's own packed INT4 layouts (portable: PyTorch's)
    "avx512": {16: "tiles16", 8: "tiles16_a8"},
    "avx2": {16: "tiles8", 8: "tiles8_a8"},
    "portable": {16: "aten", 8: "aten"},
    "eager": {16: "aten", 8: "aten"},
}


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"], autouse=True)
def threads(request):
    """Every kernel runs single-threaded and across two threads (the work split between them)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _device(kernel_set: str):
    dev = get_device("cpu", kernels=kernel_set)
    assert dev.kernel_set == kernel_set
    return dev


def _tol(dtype: torch.dtype) -> dict:
    # fp32: summation order only; bf16: one rounding of the output (8 significant bits)
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 1e-2}


def _unit_param(kernel_set: str, tiles: bool):
    """A kernel set with its vector kernels alone, or (avx512 on an AMX CPU) with the tile unit's
    (the few-rows GEMVs, decode attention), which the target takes by default where the CPU has
    it."""
    if not tiles:
        return pytest.param((kernel_set, False), id=f"{kernel_set}-vectors")
    missing = sorted(native.AMX_FLAGS - native.cpu_flags())
    reason = f"this CPU has no AMX tile unit: it lacks {' '.join(missing)}"
    return pytest.param(
        (kernel_set, True),
        id=f"{kernel_set}-amx",
        marks=pytest.mark.skipif(bool(missing), reason=reason),
    )


AVX512_UNITS = [_unit_param("avx512", True), _unit_param("avx512", False)]
UNITS = [*AVX512_UNITS, _unit_param("avx2", False)]


@pytest.fixture
def unit(request):
    """The device of (kernel set, tiles): the AMX unit switched on or off for the test alone."""
    kernel_set, tiles = request.param
    if native.missing_flags(native.TARGETS[kernel_set]):
        pytest.skip(f"this CPU cannot execute the {kernel_set} kernels")
    dev = _device(kernel_set)
    switch = getattr(dev.native, "amx_enable", None)
    before = dev.native.amx_enabled() if switch else False
    if switch:
        assert switch(tiles) == tiles
    yield dev
    if switch:
        switch(before)


@pytest.mark.parametrize("kernel_set", KERNEL_SETS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_and_residual_add_equal_reference(kernel_set, dtype):
    dev = _device(kernel_set)
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(5, 64, generator=g).to(dtype) for _ in range(2))
    w = (1 + 0.1 * torch.randn(64, generator=g)).to(dtype)
    torch.testing.assert_close(
        dev.rms_norm(x, w, 1e-5), kernels.rms_norm(x, w, 1e-5), **_tol(dtype)
    )
    expected_residual = r + x
    y, residual = dev.add_rms_norm(x, r.clone(), w, 1e-5)
    torch.testing.assert_close(residual, expected_residual, **_tol(dtype))
    torch.testing.assert_close(y, kernels.rms_norm(expected_residual, w, 1e-5), **_tol(dtype))
    y0, residual0 = dev.add_rms_norm(x, None, w, 1e-5)  # the first layer: no residual yet
    torch.testing.assert_close(residual0, x)
    torch.testing.assert_close(y0, kernels.rms_norm(x, w, 1e-5), **_tol(dtype))


@pytest.mark.parametrize("kernel_set", KERNEL_SETS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_equals_reference(kernel_set, dtype):
    x = torch.randn(3, 2 * 96, generator=torch.Generator().manual_seed(1)).to(dtype) * 4
    got = _device(kernel_set).silu_and_mul(x)
    torch.testing.assert_close(got, F.silu(x[:, :96]) * x[:, 96:], **_tol(dtype))


@pytest.mark.parametrize("kernel_set", KERNEL_SETS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,rotary_dim", [(4, 2, 16, 8), (12, 2, 64, 32), (4, 2, 32, 24)]
)
def test_rotary_and_kv_write_equal_reference(
    kernel_set, dtype, heads, kv_heads, head_dim, rotary_dim
):
    # the kernel rotates whole vectors of pairs and the rest one pair at a time: 8 and 24 dims
    # leave a tail on avx512 (16 lanes), 8 and 32 none on avx2
    dev = _device(kernel_set)
    g = torch.Generator().manual_seed(2)
    cos_sin = kernels.rotary_cos_sin(rotary_dim, 10000.0, 256)
    positions = torch.tensor([0, 7, 200, 31])
    slots = torch.tensor([5, 0, 63, 17])
    qkv = torch.randn(4, heads + 2 * kv_heads, head_dim, generator=g).to(dtype)
    caches = [torch.zeros(4, 16, kv_heads, head_dim, dtype=dtype) for _ in range(4)]

    q = dev.rotary_and_write_kv(
        qkv.clone(), heads, dev.rotary_at(cos_sin, positions), caches[0], caches[1], slots
    )
    ref = qkv.clone()
    rotated = kernels.apply_rotary(
        ref[:, : heads + kv_heads], *kernels.rotary_at(cos_sin, positions)
    )
    kernels.write_kv(rotated[:, heads:], ref[:, heads + kv_heads :], caches[2], caches[3], slots)
    torch.testing.assert_close(q, rotated[:, :heads], **_tol(dtype))
    torch.testing.assert_close(caches[0], caches[2], **_tol(dtype))
    torch.testing.assert_close(caches[1], caches[3])


@pytest.mark.parametrize("kernel_set", KERNEL_SETS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim", [(4, 2, 16), (12, 2, 64), (32, 2, 128), (8, 8, 32)]
)
def test_paged_attention_equals_reference(kernel_set, dtype, block_size, heads, kv_heads, head_dim):
    # decode rows with contexts across page boundaries (and past 16 tokens: the native kernel scores
    # keys 16 at a time), a full prefill, and a chunk over a cached prefix, in one flat batch
    lens, query_lens = [9, 1, 17, 33, 70], [1, 1, 17, 6, 1]
    q, kc, vc, meta = paged_batch(lens, query_lens, block_size, heads, kv_heads, head_dim, dtype)
    ref = kernels.paged_attention(q, kc, vc, meta, scale=head_dim**-0.5)
    meta.scratch.clear()
    got = _device(kernel_set).paged_attention(q, kc, vc, meta, scale=head_dim**-0.5)
    torch.testing.assert_close(got, ref, **_tol(dtype))
    # all rows decoding: the batched decode path alone
    dq, dkc, dvc, dmeta = paged_batch(
        lens, [1] * 5, block_size, heads, kv_heads, head_dim, dtype, seed=1
    )
    ref = kernels.paged_attention(dq, dkc, dvc, dmeta, scale=0.2)
    dmeta.scratch.clear()
    torch.testing.assert_close(
        _device(kernel_set).paged_attention(dq, dkc, dvc, dmeta, scale=0.2), ref, **_tol(dtype)
    )


@pytest.mark.parametrize("kernel_set", KERNEL_SETS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim,rotary_dim", [(4, 2, 16, 8), (12, 2, 64, 32)])
def test_rotary_and_a_write_into_an_int8_kv_cache_equal_reference(
    kernel_set, dtype, heads, kv_heads, head_dim, rotary_dim
):
    # INT8 KV rows: each token and head's codes and their fp32 scale, as kernels.quantize_kv
    dev = _device(kernel_set)
    g = torch.Generator().manual_seed(4)
    cos_sin = kernels.rotary_cos_sin(rotary_dim, 10000.0, 256)
    positions, slots = torch.tensor([3, 90, 200]), torch.tensor([9, 0, 30])
    qkv = torch.randn(3, heads + 2 * kv_heads, head_dim, generator=g).to(dtype) * 3
    width = kernels.kv_row_width(head_dim, torch.int8)
    assert width == head_dim + 4
    caches = [torch.zeros(2, 16, kv_heads, width, dtype=torch.int8) for _ in range(4)]
    dev.rotary_and_write_kv(
        qkv.clone(), heads, dev.rotary_at(cos_sin, positions), caches[0], caches[1], slots
    )
    ref = qkv.clone()
    rotated = kernels.apply_rotary(
        ref[:, : heads + kv_heads], *kernels.rotary_at(cos_sin, positions)
    )
    kernels.write_kv(rotated[:, heads:], ref[:, heads + kv_heads :], caches[2], caches[3], slots)
    for got, expected in ((caches[0], caches[2]), (caches[1], caches[3])):
        codes, ref_codes = got[..., :head_dim].int(), expected[..., :head_dim].int()
        assert (codes - ref_codes).abs().max() <= (1 if dtype == torch.float32 else 2)
        flat = got.view(-1, kv_heads, width)[slots]
        torch.testing.assert_close(
            kernels.dequantize_kv(flat),
            kernels.dequantize_kv(expected.view(-1, kv_heads, width)[slots]),
            atol=0.05,
            rtol=0.02,
        )


@pytest.mark.parametrize("kernel_set", TARGETS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cache_dtype", [None, torch.int8])
def test_prefill_attention_run_in_rounds_of_packed_blocks_gets_the_same_bits(
    kernel_set, dtype, cache_dtype
):
    # a call packs its sequences' keys (and values) once for all their tasks; where that would
    # take more than its budget it runs them in rounds (a budget of 1 byte: each sequence alone),
    # and every row must come out the same
    lens, query_lens = [70, 130, 17, 95], [70, 40, 17, 20]
    q, kc, vc, meta = paged_batch(
        lens, query_lens, 16, 8, 2, 64, dtype, seed=5, cache_dtype=cache_dtype
    )
    args = (
        q, kc, vc, meta.block_tables, torch.tensor(lens), torch.tensor(meta.query_start_loc), 0.125
    )  # fmt: skip
    prefill = _device(kernel_set).native.paged_attention_prefill
    whole = prefill(*args)
    assert torch.equal(prefill(*args, pack_bytes=1), whole)
    if cache_dtype is None:
        torch.testing.assert_close(
            whole, kernels.paged_attention(q, kc, vc, meta, scale=0.125), **_tol(dtype)
        )


@pytest.mark.parametrize("kernel_set", KERNEL_SETS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (12, 2, 64), (32, 2, 128)])
def test_paged_attention_over_an_int8_kv_cache_equals_reference(
    kernel_set, dtype, heads, kv_heads, head_dim
):
    # decode rows, drafts and a prefill read INT8 rows: the native kernels straight from the pages
    lens, query_lens = [9, 1, 17, 33, 70], [1, 1, 17, 6, 1]
    q, kc, vc, meta = paged_batch(
        lens, query_lens, 4, heads, kv_heads, head_dim, dtype, seed=5, cache_dtype=torch.int8
    )
    ref = kernels.paged_attention(q, kc, vc, meta, scale=head_dim**-0.5)  # on the dequantized rows
    got = _device(kernel_set).paged_attention(q, kc, vc, meta, scale=head_dim**-0.5)
    assert got.dtype == dtype
    torch.testing.assert_close(got, ref, **_tol(dtype))


@pytest.mark.parametrize("kernel_set", KERNEL_SETS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (32, 2, 128)])
def test_paged_attention_over_a_few_query_rows_per_sequence_equals_reference(
    kernel_set, dtype, heads, kv_heads, head_dim
):
    # a decode row with its draft tokens: each sequence's last rows attend causally, on the native
    # targets in the decode kernel itself (up to its FEW_QUERY_ROWS), beside a long prefill
    lens, query_lens = [9, 4, 40, 23, 61], [2, 4, 8, 1, 30]
    q, kc, vc, meta = paged_batch(lens, query_lens, 4, heads, kv_heads, head_dim, dtype, seed=3)
    ref = kernels.paged_attention(q, kc, vc, meta, scale=head_dim**-0.5)
    dev = _device(kernel_set)
    torch.testing.assert_close(
        dev.paged_attention(q, kc, vc, meta, head_dim**-0.5), ref, **_tol(dtype)
    )
    few = [n for n in query_lens if n <= dev.fused_layer_max_query_rows]
    assert (dev.fused_layer_max_query_rows == 8) == (kernel_set != "eager") and len(few) >= 1


@pytest.mark.parametrize("unit", UNITS, indirect=True)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 64), (32, 2, 128), (8, 8, 32)])
def test_decode_attention_of_draft_rows_equals_reference_with_vectors_and_with_amx(
    unit, heads, kv_heads, head_dim
):
    # bf16 in pages of 16 keys: on an AMX CPU the tile unit scores the keys and weighs the values
    # (32 query heads of 2 rows: more query vectors than a tile's 16), else the vector kernel
    lens, query_lens = [9, 40, 23, 61, 16], [2, 8, 1, 5, 3]
    q, kc, vc, meta = paged_batch(
        lens, query_lens, 16, heads, kv_heads, head_dim, torch.bfloat16, seed=7
    )
    ref = kernels.paged_attention(q, kc, vc, meta, scale=head_dim**-0.5)
    got = unit.paged_attention(q, kc, vc, meta, head_dim**-0.5)
    torch.testing.assert_close(got, ref, **_tol(torch.bfloat16))


@pytest.mark.parametrize("unit", UNITS, indirect=True)
def test_a_query_rows_attention_does_not_depend_on_the_rows_verified_with_it(unit):
    # greedy output with drafts equals that without only if a position's row gets the same bits
    # whether it is decoded alone or verified beside draft rows: each row of a verification
    # equals, bit for bit, the same position decoded as the sequence's only row
    rows, seq_len, head_dim = 7, 45, 64
    q, kc, vc, meta = paged_batch([seq_len], [rows], 16, 4, 2, head_dim, torch.bfloat16, seed=11)
    together = unit.paged_attention(q, kc, vc, meta, head_dim**-0.5)
    for i in range(rows):
        alone = kernels.AttentionMetadata(
            slot_mapping=torch.zeros(1, dtype=torch.long),
            query_start_loc=[0, 1],
            seq_lens=[seq_len - rows + 1 + i],
            block_tables=meta.block_tables,
            block_size=16,
        )
        assert torch.equal(
            unit.paged_attention(q[i : i + 1], kc, vc, alone, head_dim**-0.5), together[i : i + 1]
        ), f"row {i}"


@pytest.mark.parametrize("kernel_set", KERNEL_SETS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group_size", [32, 64, 128, 256])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 20])
@pytest.mark.parametrize("abits", [16, 8])
def test_int4_linear_equals_dequantized_reference(kernel_set, dtype, group_size, rows, abits):
    # rows past 8 take several passes over each tile of the native kernel; abits 8 is W4A8;
    # avx512's W4A16 tiles know 32, 64 and 128 when compiled and read other sizes at run time
    g = torch.Generator().manual_seed(group_size + rows)
    w = torch.randn(48, 256, generator=g) * 0.05
    x = torch.randn(rows, 256, generator=g).to(dtype)
    bias = torch.randn(48, generator=g).to(dtype)
    q, s, z = quantize_rtn(w, group_size)
    dev = _device(kernel_set)
    layer = dev.prepare_int4(q, s, z, group_size, "w", abits)
    assert layer.layout == INT4_LAYOUTS[kernel_set][abits]
    reference = Int4Linear(48, 256, group_size, abits, qcodes=q, scales=s, zeros=z)
    # W4A16: the activations enter as bf16; W4A8: as int8 per row, in fp32
    xr = x.to(torch.bfloat16).float() if abits == 16 else quantize_activations_int8(x.float())
    expected = xr @ dequantize(reference).T + bias.float()
    got = dev.linear(x, layer, bias)
    assert got.dtype == dtype and got.shape == (rows, 48)
    scale = expected.abs().max().item()
    torch.testing.assert_close(got.float(), expected, atol=0.01 * scale, rtol=0.01)


INT4_TARGETS = [p for p in TARGETS if p.values[0] in ("avx512", "avx2")]


@pytest.mark.parametrize("unit", AVX512_UNITS, indirect=True)
@pytest.mark.parametrize("group_size", [32, 64])
@pytest.mark.parametrize("rows", [1, 2, 6, 16])
def test_int4_few_rows_equal_the_dequantized_weights_with_vectors_and_with_amx(
    unit, group_size, rows
):
    # W4A16 of 1 to 16 rows on avx512: on an AMX CPU the tile unit's pass, which multiplies bf16
    # exactly, else the vector one, whose int16 activations int4.quantize_activations_int16
    # emulates; both sum in fp32, so they equal the dequantized weights up to summation order
    g = torch.Generator().manual_seed(rows)
    q, s, z = quantize_rtn(torch.randn(64, 192, generator=g), group_size)
    x = torch.randn(rows, 192, generator=g)
    layer = unit.prepare_int4(q, s, z, group_size, f"w{group_size}-{rows}")
    reference = Int4Linear(64, 192, group_size, qcodes=q, scales=s, zeros=z)
    amx = unit.native.amx_enabled()
    xr = x.to(torch.bfloat16).float() if amx else quantize_activations_int16(x, group_size)
    expected = xr @ dequantize(reference).T
    torch.testing.assert_close(unit.linear(x, layer), expected, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("unit", AVX512_UNITS, indirect=True)
@pytest.mark.parametrize("rows", [17, 40, 180])
def test_int4_prompt_rows_equal_the_dequantized_weights_with_vectors_and_with_amx(unit, rows):
    # past 16 rows AMX takes them 16 at a time, over panels of 128 rows and 4 output tiles at a
    # time (N = 96: six tiles, three a thread), the vector passes 8 at a time; 17 and 40 rows end
    # in a partial block
    g = torch.Generator().manual_seed(rows)
    q, s, z = quantize_rtn(torch.randn(96, 192, generator=g), 32)
    x = torch.randn(rows, 192, generator=g)
    layer = unit.prepare_int4(q, s, z, 32, f"w-prompt-{rows}")
    reference = Int4Linear(96, 192, 32, qcodes=q, scales=s, zeros=z)
    amx = unit.native.amx_enabled()
    xr = x.to(torch.bfloat16).float() if amx else quantize_activations_int16(x, 32)
    expected = xr @ dequantize(reference).T
    torch.testing.assert_close(unit.linear(x, layer), expected, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("unit", UNITS, indirect=True)
@pytest.mark.parametrize("abits", [16, 8])
@pytest.mark.parametrize("group_size", [32, 128])
def test_an_int4_rows_result_does_not_depend_on_the_rows_beside_it(unit, abits, group_size):
    # each kernel sums a row alike for any count of rows in a pass (the tile unit's, the vector
    # passes' fp32 chains, the integer sums of W4A8) and whether its pass takes one tile or two
    # (avx512's W4A16 from 64 rows, avx2's W4A16 and W4A8 from 8; 144 outputs: 9 tiles, so a
    # thread ends on a single one), so that drafts leave greedy INT4 output as it was and a
    # seeded request's tokens do not change with the batch
    g = torch.Generator().manual_seed(5)
    q, s, z = quantize_rtn(torch.randn(144, 4096, generator=g), group_size)
    x = torch.randn(150, 4096, generator=g).to(torch.bfloat16)  # a prompt's rows among them
    layer = unit.prepare_int4(q, s, z, group_size, f"w-rows-{abits}-{group_size}", abits)
    together = unit.linear(x, layer)
    for m in (0, 5, 15, 16, 100, 149):
        assert torch.equal(unit.linear(x[m : m + 1], layer), together[m : m + 1]), f"row {m}"
        assert torch.equal(unit.linear(x[m : m + 6], layer)[:1], together[m : m + 1])
        assert torch.equal(unit.linear(x[: m + 1], layer), together[: m + 1]), f"rows to {m}"


@pytest.mark.parametrize("kernel_set", INT4_TARGETS)
def test_native_w4a8_equals_its_fp32_emulation_to_rounding(kernel_set):
    # integer products are exact: in fp32 the kernel equals the emulation up to summation order
    g = torch.Generator().manual_seed(11)
    q, s, z = quantize_rtn(torch.randn(32, 256, generator=g), 32)
    x = torch.randn(5, 256, generator=g) * 3
    dev = _device(kernel_set)
    layer = dev.prepare_int4(q, s, z, 32, "w", abits=8)
    reference = Int4Linear(32, 256, 32, 8, qcodes=q, scales=s, zeros=z)
    expected = quantize_activations_int8(x) @ dequantize(reference).T
    torch.testing.assert_close(dev.linear(x, layer), expected, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("kernel_set", INT4_TARGETS)
def test_native_int4_keeps_fp16_scales_exactly(kernel_set):
    # AWQ/GPTQ checkpoints store fp16 scales: the native layouts keep them, so in fp32 the kernel
    # equals the dequantized weights up to summation order
    g = torch.Generator().manual_seed(5)
    q, s, z = quantize_rtn(torch.randn(32, 128, generator=g), 32)
    x = torch.randn(2, 128, generator=g).to(torch.bfloat16).float()
    dev = _device(kernel_set)
    layer = dev.prepare_int4(q, s, z, 32, "w")
    expected = x @ dequantize(Int4Linear(32, 128, 32, qcodes=q, scales=s, zeros=z)).T
    torch.testing.assert_close(dev.linear(x, layer), expected, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("kernel_set", KERNEL_SETS)
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 7, 8, 9, 16, 17, 64, 65])
def test_bf16_dense_linear_equals_reference(kernel_set, rows):
    # up to few_rows_max() rows (64, or 16 with AMX) the native backend streams the weight with
    # its own GEMV, in passes of 4 rows and blocks of up to 16 outputs (N = 100
    # leaves a tail of single outputs; AMX takes whole blocks of 16); more rows go to oneDNN (AMX's
    # GEMM takes whole blocks of 16 outputs only: the next tests)
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(100, 96, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
    b = torch.randn(100, generator=g).to(torch.bfloat16)
    got = _device(kernel_set).linear(x, w, b)
    torch.testing.assert_close(got, F.linear(x, w, b), **_tol(torch.bfloat16))


@pytest.mark.parametrize("unit", UNITS, indirect=True)
@pytest.mark.parametrize(
    "rows,outputs",
    [(1, 200), (3, 200), (6, 200), (8, 200), (16, 200), (17, 208), (40, 208), (180, 208)],
)
def test_bf16_rows_through_the_gemv_and_the_gemm_equal_reference_with_vectors_and_with_amx(
    unit, rows, outputs
):
    # 1 to 16 rows: the few-rows GEMV (N = 200: twelve blocks of 16 and a tail of 8). Past 16
    # rows AMX runs a GEMM of 2 x 2 tiles (csrc/amx.h: bf16_gemm; N = 208: thirteen blocks of 16,
    # an odd one left over; 17 and 40 rows leave a partial block of rows, 180 crosses a panel of
    # 128); elsewhere the GEMV takes up to 64 rows and oneDNN more. K = 352: eleven steps of 32 along K
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(outputs, 352, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, 352, generator=g).to(torch.bfloat16)
    b = torch.randn(outputs, generator=g).to(torch.bfloat16)
    torch.testing.assert_close(unit.linear(x, w, b), F.linear(x, w, b), **_tol(torch.bfloat16))
    torch.testing.assert_close(unit.linear(x, w), F.linear(x, w), **_tol(torch.bfloat16))


@pytest.mark.parametrize("unit", AVX512_UNITS[:1], indirect=True)
def test_a_prompts_row_on_amx_gets_the_bits_of_a_decode_step(unit):
    """The GEMM of a prompt's rows and the GEMV of a decode step run the same tile products in
    the same order, so a position computed in a prefill and recomputed alone (after preemption,
    or beside drafts) give the same bits."""
    g = torch.Generator().manual_seed(9)
    w = torch.randn(1408, 256, generator=g).to(torch.bfloat16)
    b = torch.randn(1408, generator=g).to(torch.bfloat16)
    x = torch.randn(150, 256, generator=g).to(torch.bfloat16)
    together = unit.linear(x, w, b)
    for m in (0, 15, 16, 31, 100, 149):
        assert torch.equal(unit.linear(x[m : m + 1], w, b), together[m : m + 1]), f"row {m}"
        assert torch.equal(unit.linear(x[m : m + 6], w, b)[:1], together[m : m + 1]), f"row {m}"


@pytest.mark.parametrize("unit", UNITS, indirect=True)
def test_a_rows_gemv_result_does_not_depend_on_the_rows_beside_it(unit):
    """The bits of a row are the same alone and among as many others as the GEMV takes (64, or
    16 on AMX and then its GEMM): a seeded request samples the same tokens whatever else is in
    its decode step, and a verification of drafts gives its first row what a plain decode step
    gives it. K = 4096 makes the weight blocks that stay in cache between passes of rows shorter
    than a thread's share of the 1408 outputs."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(1408, 4096, generator=g).to(torch.bfloat16)
    rows = 16 if native.uses_amx(unit.native) else 64
    assert unit.native.few_rows_max() == rows
    x = torch.randn(rows, 4096, generator=g).to(torch.bfloat16)
    together = unit.linear(x, w)
    torch.testing.assert_close(together, F.linear(x, w), **_tol(torch.bfloat16))
    for m in range(rows):
        assert torch.equal(unit.linear(x[m : m + 1], w), together[m : m + 1]), f"row {m}"
    for count in (2, 5, 9, rows - 1):
        assert torch.equal(unit.linear(x[:count], w), together[:count]), f"{count} rows"


@pytest.mark.parametrize("kernel_set", KERNEL_SETS)
def test_argmax_takes_the_first_maximum_as_torch_does(kernel_set):
    x = torch.randn(4, 1000, generator=torch.Generator().manual_seed(7))
    x[1, 3] = x[1, 900] = 50.0  # a tie: the first wins
    x[2, 999] = 60.0  # in the tail past the last full vector
    x[3, 10] = float("nan")  # torch.argmax reports the NaN
    assert (
        _device(kernel_set).argmax(x).tolist()
        == x.argmax(-1).tolist()
        == [
            int(x[0].argmax()),
            3,
            999,
            10,
        ]
    )


def _inverse_cdf_reference(row: torch.Tensor, temperature: float, u: torch.Tensor):
    """In float64: the first index whose cumulative softmax(row / t) exceeds u, and how far u
    lies from the nearest boundary of the CDF (where float32 rounding may pick the neighbour)."""
    cdf = torch.softmax(row.double() / temperature, -1).cumsum(-1)
    index = torch.searchsorted(cdf, u.double(), right=True)
    margin = (cdf.unsqueeze(0) - u.double().unsqueeze(1)).abs().min(dim=1).values
    return index, margin


@pytest.mark.parametrize("kernel_set", TARGETS)
@pytest.mark.parametrize("vocab", [1003, 16, 5])  # a tail past the last full vector; one; none
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_categorical_draw_is_the_inverse_cdf_of_softmax_over_temperature(
    kernel_set, vocab, temperature
):
    g = torch.Generator().manual_seed(vocab)
    row = torch.randn(vocab, generator=g) * 3
    u = torch.cat([torch.rand(2000, generator=g), torch.tensor([0.0, 1 - 2**-24])])
    drawn = _device(kernel_set).categorical()(
        row.expand(len(u), -1).contiguous(), torch.full((len(u),), 1 / temperature), u
    )
    expected, margin = _inverse_cdf_reference(row, temperature, u)
    expected = expected.clamp(max=vocab - 1)  # u * total rounding up to the total: the last token
    differ = drawn != expected
    assert bool((margin[differ] < 1e-5).all()), "a draw off the CDF away from any boundary"
    assert int(differ.sum()) <= 2
    assert drawn[-2] == 0  # u = 0: the first token


@pytest.mark.parametrize("kernel_set", TARGETS)
def test_categorical_draw_never_takes_a_masked_token(kernel_set):
    """-inf logits (a grammar's mask, min_tokens' stop tokens) weigh exactly 0, at the edges of
    the CDF too: u = 0 takes the first allowed token, u just under 1 the last."""
    row = torch.full((1003,), -torch.inf)
    allowed = [0, 17, 500, 1001]  # the first token, mid-vector, and in the tail
    row[allowed] = torch.tensor([0.0, 1.0, 2.0, 0.5])
    u = torch.cat([torch.tensor([0.0, 1 - 2**-24]), torch.rand(500)])
    drawn = _device(kernel_set).categorical()(
        row.expand(len(u), -1).contiguous(), torch.ones(len(u)), u
    )
    assert set(drawn.tolist()) <= set(allowed)
    assert drawn[0] == 0 and drawn[1] == 1001
    assert {17, 500} <= set(drawn.tolist())


@pytest.mark.parametrize("kernel_set", TARGETS)
def test_categorical_draw_of_a_row_with_nan_or_nothing_allowed_is_its_argmax(kernel_set):
    rows = torch.randn(2, 100)
    rows[0, 40] = float("nan")
    rows[1] = -torch.inf
    drawn = _device(kernel_set).categorical()(rows, torch.ones(2), torch.full((2,), 0.5))
    assert drawn.tolist() == rows.argmax(-1).tolist() == [40, 0]


@pytest.mark.parametrize("kernel_set", KERNEL_SETS)
def test_sampler_with_the_devices_draw_samples_softmax_over_temperature(kernel_set):
    """Through the sampler, as the engine builds it: the draw's law is softmax(logits / t) (a
    chi-square test), rows with top-k keep theirs, and a seeded row's tokens do not depend on
    its batch."""
    from pagedserve.engine.sampler import Sampler, SamplingMetadata

    dev = _device(kernel_set)
    sampler = Sampler(argmax=dev.argmax, categorical=dev.categorical())
    vocab, num = 40, 20_000
    row = torch.randn(vocab, generator=torch.Generator().manual_seed(3)) * 2
    plain, top_k = SamplingParams(temperature=0.8), SamplingParams(temperature=0.8, top_k=3)

    def meta(params, seeds=None):
        gens = [None if s is None else torch.Generator().manual_seed(s) for s in seeds or []]
        gens += [None] * (len(params) - len(gens))
        n = len(params)
        return SamplingMetadata(params, [[1]] * n, [[]] * n, gens, [frozenset()] * n)

    torch.manual_seed(11)
    params = [plain, top_k] * (num // 2)
    out = torch.tensor(sampler(row.expand(num, -1).clone(), meta(params)).sampled_token_ids)
    probs = torch.softmax(row.double() / 0.8, -1)
    counts = torch.bincount(out[0::2], minlength=vocab).double()
    expected = probs * (num // 2)
    assert float(((counts - expected) ** 2 / expected).sum()) < 72.05  # p = 1e-4, 39 dof
    assert set(out[1::2].tolist()) <= set(row.topk(3).indices.tolist())
    seeded = SamplingParams(temperature=0.8, seed=5)
    alone = sampler(row.unsqueeze(0).clone(), meta([seeded], [5])).sampled_token_ids
    beside = sampler(row.expand(3, -1).clone(), meta([plain, seeded, top_k], [None, 5]))
    assert beside.sampled_token_ids[1] == alone[0]


@pytest.mark.parametrize("kernel_set", TARGETS)
def test_native_and_eager_engines_give_the_same_greedy_tokens(tiny_glm4, kernel_set):
    # (INT4 differs by design: PyTorch's kernel rounds scales to bf16; see test_int4.py)
    model_dir, _ = tiny_glm4
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 19, 40)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = {}
    for kernel_choice in (kernel_set, "eager"):
        llm = LLM(
            model=str(model_dir),
            dtype="float32",
            device="cpu",
            kernels=kernel_choice,
            num_kv_pages=64,
        )
        assert llm.llm_engine.device.kernel_set == kernel_choice
        outs[kernel_choice] = [
            o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)
        ]
    assert outs[kernel_set] == outs["eager"]


def _counted(fn, calls: list):
    def counted(*args):
        calls.append(1)
        return fn(*args)

    return counted


@pytest.mark.parametrize("kernel_set", TARGETS)
@pytest.mark.parametrize("arch", ["glm", "glm4"])
@pytest.mark.parametrize(
    "dtype,quantization,kv_cache_dtype",
    [
        ("float32", None, "auto"),
        ("bfloat16", None, "auto"),
        ("bfloat16", "int4", "auto"),
        ("float32", "w4a8", "auto"),
        ("float32", None, "int8"),  # INT8 KV rows: codes and a scale per token and head
        ("bfloat16", "int4", "int8"),
    ],
)
def test_fused_decoder_layer_equals_the_op_by_op_layer_bit_for_bit(
    tmp_path, kernel_set, arch, dtype, quantization, kv_cache_dtype
):
    from tests.helpers.models import build_tiny_hf_model

    build_tiny_hf_model(tmp_path, arch)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 17, 30)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    results = []
    for fused in (True, False):
        llm = LLM(
            model=str(tmp_path),
            dtype=dtype,
            device="cpu",
            kernels=kernel_set,
            quantization=quantization,
            num_kv_pages=64,
            kv_cache_dtype=kv_cache_dtype,
        )
        assert (llm.llm_engine.runner.kv_cache.dtype == torch.int8) == (kv_cache_dtype == "int8")
        model = llm.llm_engine.model
        calls = []
        if fused:
            assert all(f is not None for f in model.fused_layers)
            model.fused_layers = [_counted(f, calls) for f in model.fused_layers]
        else:
            model.fused_layers = [None] * len(model.fused_layers)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
        assert bool(calls) == fused  # decode steps took the fused kernel when it was there
    assert results[0] == results[1]  # token ids and every logprob, exactly
