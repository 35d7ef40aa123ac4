"""Every op of every kernel set takes any shape a GLM-4 model can bring: drawn shapes (sizes that
are and are not multiples of 8, 16, 32 and 64; head dims 16 to 256; GQA ratios 1 to 16; block
sizes 1 to 64; 1 to 64 rows), each op held to its PyTorch reference on every target this CPU
executes and on eager. Where a native kernel cannot take a shape, its own statement says so, the
device runs the reference instead, and the kernel refuses that shape with the same words."""

from __future__ import annotations

import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.hal import get_device, kernels, native
from pagedserve.hal.int4 import Int4Linear, dequantize, quantize_activations_int8
from pagedserve.hal.int8 import Int8Linear, int8_linear_reference, quantize_int8
from pagedserve.models.quant_formats import quantize_rtn
from tests.helpers.kernels import KERNEL_SETS, TARGETS, paged_batch

DTYPES = st.sampled_from([torch.float32, torch.bfloat16])
SIZES = st.one_of(  # multiples of 64, 32, 16 and 8 and odd ones, as pruned models have them
    st.integers(1, 6).map(lambda n: 64 * n),
    st.integers(1, 12).map(lambda n: 16 * n + 8),
    st.integers(1, 300),
)
HEAD_DIMS = st.sampled_from([16, 64, 72, 80, 96, 112, 128, 160, 192, 200, 256])
GQA = st.sampled_from([1, 2, 4, 8, 16])
EXAMPLES = settings(max_examples=12)


def _device(kernel_set: str):
    return get_device("cpu", kernels=kernel_set)


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    if expected.dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    else:  # one rounding of the output to bf16 (8 significant bits)
        torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("kernel_set", KERNEL_SETS)
@EXAMPLES
@given(rows=st.integers(1, 64), hidden=SIZES, dtype=DTYPES, seed=st.integers(0, 2**16))
def test_norms_and_silu_take_rows_of_any_length(kernel_set, rows, hidden, dtype, seed):
    dev = _device(kernel_set)
    g = torch.Generator().manual_seed(seed)
    x, r = (torch.randn(rows, hidden, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(hidden, generator=g).to(dtype)
    _close(dev.rms_norm(x, w, 1e-5), kernels.rms_norm(x, w, 1e-5))
    y, residual = dev.add_rms_norm(x, r.clone(), w, 1e-5)
    _close(residual, x + r)
    _close(y, kernels.rms_norm(x + r, w, 1e-5))
    gate_up = torch.randn(rows, 2 * hidden, generator=g).to(dtype)
    _close(dev.silu_and_mul(gate_up), kernels.silu_and_mul(gate_up))


@pytest.mark.parametrize("kernel_set", KERNEL_SETS)
@EXAMPLES
@given(
    rows=st.integers(1, 64),
    head_dim=HEAD_DIMS,
    kv_heads=st.integers(1, 3),
    group=GQA,
    block_size=st.sampled_from([1, 3, 16, 64]),
    int8_cache=st.booleans(),
    dtype=DTYPES,
)
def test_rotary_and_the_kv_write_take_any_head(
    kernel_set, rows, head_dim, kv_heads, group, block_size, int8_cache, dtype
):
    dev = _device(kernel_set)
    heads = kv_heads * group
    g = torch.Generator().manual_seed(rows + head_dim)
    qkv = torch.randn(rows, heads + 2 * kv_heads, head_dim, generator=g).to(dtype)
    cos_sin = kernels.rotary_cos_sin(head_dim // 2, 10000.0, 256)
    positions = torch.randint(0, 256, (rows,), generator=g)
    pages = -(-rows // block_size) + 1
    width = kernels.kv_row_width(head_dim, torch.int8 if int8_cache else dtype)
    cache_dtype = torch.int8 if int8_cache else dtype
    caches = [torch.zeros(pages, block_size, kv_heads, width, dtype=cache_dtype) for _ in range(4)]
    slots = torch.randperm(pages * block_size, generator=g)[:rows]
    got_q = dev.rotary_and_write_kv(
        qkv.clone(), heads, dev.rotary_at(cos_sin, positions), caches[0], caches[1], slots
    )
    rotated = kernels.apply_rotary(
        qkv[:, : heads + kv_heads], *kernels.rotary_at(cos_sin, positions)
    )
    _close(got_q, rotated[:, :heads])
    kernels.write_kv(rotated[:, heads:], qkv[:, heads + kv_heads :], caches[2], caches[3], slots)
    for got, expected in zip(caches[:2], caches[2:]):
        if int8_cache:  # codes one apart at most, where a value sits on a rounding boundary
            assert (got.float() - expected.float())[..., :head_dim].abs().max() <= 1
        else:
            _close(got, expected)


@pytest.mark.parametrize("kernel_set", KERNEL_SETS)
@EXAMPLES
@given(
    seqs=st.lists(
        st.tuples(st.integers(1, 150), st.sampled_from([1, 1, 2, 8, 20, 70])),
        min_size=1,
        max_size=5,
    ),
    head_dim=HEAD_DIMS,
    kv_heads=st.integers(1, 2),
    group=GQA,
    block_size=st.sampled_from([1, 4, 16, 64]),
    int8_cache=st.booleans(),
    dtype=DTYPES,
    seed=st.integers(0, 2**16),
)
def test_paged_attention_takes_any_head_dim_gqa_and_block_size(
    kernel_set, seqs, head_dim, kv_heads, group, block_size, int8_cache, dtype, seed
):
    # decode rows (1), drafts (2, 8) and prefill chunks (20, 70: several blocks of queries and
    # of keys) of contexts up to 150 tokens, over caches in q's dtype or INT8
    seq_lens = [max(ctx, q) for ctx, q in seqs]
    query_lens = [q for _, q in seqs]
    cache_dtype = torch.int8 if int8_cache else None
    q, kc, vc, meta = paged_batch(
        seq_lens, query_lens, block_size, kv_heads * group, kv_heads, head_dim, dtype, seed,
        cache_dtype,
    )  # fmt: skip
    got = _device(kernel_set).paged_attention(q, kc, vc, meta, head_dim**-0.5)
    expected = kernels.paged_attention(q.float(), kc, vc, meta, head_dim**-0.5)
    _close(got, expected.to(dtype))


@pytest.mark.parametrize("kernel_set", KERNEL_SETS)
@EXAMPLES
@given(
    rows=st.integers(1, 64),
    out_features=SIZES,
    groups=st.integers(1, 6),
    group_size=st.sampled_from([32, 64, 128]),
    abits=st.sampled_from([16, 8]),
    dtype=DTYPES,
    seed=st.integers(0, 2**16),
)
def test_int4_layers_of_any_output_size_equal_the_dequantized_weights(
    kernel_set, rows, out_features, groups, group_size, abits, dtype, seed
):
    g = torch.Generator().manual_seed(seed)
    in_features = groups * group_size
    w = torch.randn(out_features, in_features, generator=g) * 0.05
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    q, s, z = quantize_rtn(w, group_size)
    dev = _device(kernel_set)
    layer = dev.prepare_int4(q, s, z, group_size, f"w{seed}", abits)
    reference = Int4Linear(
        out_features, in_features, group_size, abits, qcodes=q, scales=s, zeros=z
    )
    xr = x.to(torch.bfloat16).float() if abits == 16 else quantize_activations_int8(x.float())
    expected = xr @ dequantize(reference).T
    got = dev.linear(x, layer)
    assert got.shape == (rows, out_features) and got.dtype == dtype
    scale = expected.abs().max().item()
    torch.testing.assert_close(got.float(), expected, atol=0.01 * scale, rtol=0.01)


@pytest.mark.parametrize("kernel_set", KERNEL_SETS)
@EXAMPLES
@given(rows=st.integers(1, 64), n=SIZES, k=SIZES, dtype=DTYPES, seed=st.integers(0, 2**16))
def test_int8_layers_of_any_shape_equal_their_reference(kernel_set, rows, n, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    codes, scales = quantize_int8(torch.randn(n, k, generator=g))
    dev = _device(kernel_set)
    layer = dev.prepare_int8(codes, scales, dtype, f"i8-{seed}")
    x = torch.randn(rows, k, generator=g).to(dtype)
    reference = Int8Linear(n, k, codes.to(torch.int8), scales.to(dtype))
    _close(dev.linear(x, layer), int8_linear_reference(x, reference))


# ---- the one statement: what the dispatch asks is what the kernel checks ---------------------
NATIVE = [p for p in TARGETS]


@pytest.mark.parametrize("kernel_set", NATIVE)
@settings(max_examples=20)
@given(head_dim=st.integers(1, 300).map(lambda d: 2 * d), dtype=DTYPES)
def test_decode_attention_refuses_exactly_the_head_dims_its_statement_refuses(
    kernel_set, head_dim, dtype
):
    lib = native.load_target(kernel_set)
    why = lib.paged_attention_decode_rejects(head_dim, dtype)
    q, kc, vc, meta = paged_batch([5], [1], 4, 2, 1, head_dim, dtype)
    plan = torch.tensor(meta.seq_lens), torch.tensor(meta.query_start_loc)
    call = lambda: lib.paged_attention_decode(q, kc, vc, meta.block_tables, *plan, 0.1)  # noqa: E731
    if why:
        with pytest.raises(RuntimeError, match=re.escape(f"paged_attention_decode: {why}")):
            call()
    else:
        call()


@pytest.mark.parametrize("kernel_set", [p for p in TARGETS if p.values[0] != "portable"])
@pytest.mark.parametrize("group_size", [16, 48, 32, 64])
def test_int4_kernels_refuse_exactly_the_groups_their_statement_refuses(kernel_set, group_size):
    lib = native.load_target(kernel_set)
    rows, k = lib.INT4_TILE_ROWS, 192
    why = lib.int4_linear_rejects(k, group_size)
    assert bool(why) == (group_size % 32 != 0)
    q, s, z = quantize_rtn(torch.randn(rows, k), 32)  # packed for groups of 32, asked for others
    layer = _device(kernel_set).prepare_int4(q, s, z, 32, f"g{group_size}")
    x = torch.randn(2, k)
    packed, sz = layer.packed, layer.scales_and_zeros
    call = lambda: lib.int4_linear(x, packed, sz, group_size, None, rows)  # noqa: E731
    if why:
        with pytest.raises(RuntimeError, match=re.escape(f"int4_linear: {why}")):
            call()
    else:
        call()


@pytest.mark.parametrize("kernel_set", NATIVE)
def test_the_row_kernels_refuse_what_their_statement_refuses(kernel_set):
    lib = native.load_target(kernel_set)
    assert lib.rows_rejects(torch.float32) == lib.rows_rejects(torch.bfloat16) == ""
    why = lib.rows_rejects(torch.float64)
    assert "float64" in why
    with pytest.raises(RuntimeError, match=re.escape(f"rms_norm: {why}")):
        lib.rms_norm(
            torch.randn(2, 8, dtype=torch.float64), torch.ones(8, dtype=torch.float64), 1e-5
        )
