"""The plain-PyTorch reference kernels (``hal/kernels.py``) held to references of their own, not
to a backend that may share their code: torch's rms_norm and scaled-dot-product attention, HF
transformers' GLM rotary embedding, attention over a paged cache equal to attention over the
same context laid out whole, INT8 KV rows within half a step of their values, and pages copied
or swapped whole."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.hal import kernels


def _generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---- the layers' elementwise kernels ------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_torchs_computed_in_fp32(dtype):
    g = _generator()
    x = (3 * torch.randn(5, 64, generator=g)).to(dtype)
    weight = torch.randn(64, generator=g).to(dtype)
    expected = F.rms_norm(x.float(), (64,), eps=1e-5).to(dtype) * weight
    torch.testing.assert_close(kernels.rms_norm(x, weight, 1e-5), expected)
    # over the last dim of any shape: a batch of sequences' rows too
    x3 = x.view(5, 1, 64).expand(5, 2, 64)
    torch.testing.assert_close(
        kernels.rms_norm(x3, weight, 1e-5), expected[:, None].expand(5, 2, 64)
    )
    # eps is added to the mean square: a vector of zeros stays 0, a small one is scaled by it
    tiny = torch.full((1, 4), 1e-3)
    torch.testing.assert_close(
        kernels.rms_norm(tiny, torch.ones(4), 1e-6), tiny / (1e-6 + 1e-6) ** 0.5
    )


def test_linear_is_x_times_the_transposed_weight_plus_the_bias():
    g = _generator(4)
    x, w, b = torch.randn(3, 8, generator=g), torch.randn(5, 8, generator=g), torch.randn(5)
    torch.testing.assert_close(kernels.linear(x, w, b), x @ w.T + b)
    torch.testing.assert_close(kernels.linear(x, w), x @ w.T)


def test_silu_and_mul_gates_the_second_half_by_the_silu_of_the_first():
    x = torch.randn(3, 2, 10, generator=_generator(1))
    gate, up = x[..., :5], x[..., 5:]
    expected = gate * torch.sigmoid(gate) * up
    torch.testing.assert_close(kernels.silu_and_mul(x), expected)


@pytest.mark.parametrize("partial_rotary_factor", [0.5, 1.0])
def test_rotary_is_hf_transformers_glm_rotary(partial_rotary_factor):
    from transformers import GlmConfig
    from transformers.models.glm.modeling_glm import GlmRotaryEmbedding, apply_rotary_pos_emb

    head_dim, heads, theta = 16, 3, 500.0
    config = GlmConfig(
        hidden_size=48,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        head_dim=head_dim,
        partial_rotary_factor=partial_rotary_factor,
        rope_theta=theta,
        max_position_embeddings=64,
    )
    rotary_dim = int(head_dim * partial_rotary_factor)
    positions = torch.tensor([0, 1, 7, 63, 30])
    x = torch.randn(len(positions), heads, head_dim, generator=_generator(2))
    cos, sin = GlmRotaryEmbedding(config)(x, positions[None])
    expected, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos, sin)
    cos_sin = kernels.rotary_cos_sin(rotary_dim, theta, 64)
    assert cos_sin.shape == (64, rotary_dim) and cos_sin.dtype == torch.float32
    got = kernels.apply_rotary(x, *kernels.rotary_at(cos_sin, positions))
    torch.testing.assert_close(got, expected[0].transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_the_rotary_table_is_fp32_whatever_the_default_dtype():
    expected = kernels.rotary_cos_sin(8, 10000.0, 16)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        table = kernels.rotary_cos_sin(8, 10000.0, 16)
    finally:
        torch.set_default_dtype(before)
    assert table.dtype == torch.float32
    assert torch.equal(table, expected)


def test_rotary_keeps_the_dtype_and_passes_the_dims_past_rotary_dim_through():
    x = torch.randn(2, 1, 8, generator=_generator(3)).to(torch.bfloat16)
    cos_sin = kernels.rotary_cos_sin(4, 10000.0, 8)
    y = kernels.apply_rotary(x, *kernels.rotary_at(cos_sin, torch.tensor([0, 5])))
    assert y.dtype == torch.bfloat16
    assert torch.equal(y[0], x[0])  # position 0: no rotation
    assert torch.equal(y[:, :, 4:], x[:, :, 4:])


# ---- the batch's metadata -----------------------------------------------------------------------
def _meta(query_lens: list[int], seq_lens: list[int]) -> kernels.AttentionMetadata:
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    return kernels.AttentionMetadata(
        slot_mapping=torch.zeros(starts[-1], dtype=torch.long),
        query_start_loc=starts,
        seq_lens=seq_lens,
        block_tables=torch.zeros(len(seq_lens), 1, dtype=torch.long),
        block_size=4,
    )


def test_a_batchs_metadata_counts_its_sequences_and_their_new_tokens():
    mixed = _meta([1, 5, 2], [9, 5, 12])
    assert mixed.num_seqs == 3 and mixed.query_lens == [1, 5, 2] and mixed.max_query_len == 5
    assert not mixed.is_decode_only
    decode = _meta([1, 1], [3, 8])
    assert decode.query_lens == [1, 1] and decode.max_query_len == 1 and decode.is_decode_only
    assert _meta([4], [4]).max_query_len == 4 and not _meta([4], [4]).is_decode_only
    assert mixed.scratch == {} and mixed.scratch is not decode.scratch  # one per batch


# ---- attention over paged KV --------------------------------------------------------------------
def _paged(contexts: list[torch.Tensor], block_size: int, seed: int = 0):
    """A paged cache holding each context [C, kv_heads, D] on shuffled pages, with random values
    in the pages no context uses, and the block tables (padded with page 0)."""
    g = _generator(seed)
    blocks = [-(-len(c) // block_size) for c in contexts]
    num_pages = sum(blocks) + 2
    kv_heads, head_dim = contexts[0].shape[1:]
    cache = torch.randn(num_pages, block_size, kv_heads, head_dim, generator=g)
    pages = torch.randperm(num_pages, generator=g).tolist()
    tables = torch.zeros(len(contexts), max(blocks), dtype=torch.long)
    for i, context in enumerate(contexts):
        for b in range(blocks[i]):
            page = pages.pop()
            tables[i, b] = page
            rows = context[b * block_size : (b + 1) * block_size]
            cache[page, : len(rows)] = rows
    return cache, tables


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_attention_is_causal_sdpa_over_each_sequences_whole_context(block_size):
    """Each sequence's new queries are the last positions of its context; GQA shares each KV head
    among heads / kv_heads query heads."""
    g = _generator(4)
    heads, kv_heads, head_dim, scale = 4, 2, 8, 0.3
    seq_lens, query_lens = [9, 1, 17, 33, 5], [1, 1, 17, 6, 5]
    ks = [torch.randn(c, kv_heads, head_dim, generator=g) for c in seq_lens]
    vs = [torch.randn(c, kv_heads, head_dim, generator=g) for c in seq_lens]
    k_cache, tables = _paged(ks, block_size, seed=5)
    v_cache, _ = _paged(vs, block_size, seed=5)  # the same seed: the same pages
    meta = _meta(query_lens, seq_lens)
    meta.block_tables, meta.block_size = tables, block_size
    q = torch.randn(sum(query_lens), heads, head_dim, generator=g)
    got = kernels.paged_attention(q, k_cache, v_cache, meta, scale)
    start = 0
    for c, n, k, v in zip(seq_lens, query_lens, ks, vs, strict=True):
        # query i sits at position c - n + i and sees positions 0 .. c - n + i
        allowed = torch.arange(c)[None, :] <= torch.arange(c - n, c)[:, None]
        expected = F.scaled_dot_product_attention(
            q[start : start + n].transpose(0, 1),
            k.transpose(0, 1).repeat_interleave(heads // kv_heads, 0),
            v.transpose(0, 1).repeat_interleave(heads // kv_heads, 0),
            attn_mask=allowed,
            scale=scale,
        ).transpose(0, 1)
        torch.testing.assert_close(got[start : start + n], expected, atol=1e-5, rtol=1e-5)
        start += n


def test_paged_attention_keeps_the_querys_dtype():
    g = _generator(6)
    k = torch.randn(6, 1, 8, generator=g)
    cache, tables = _paged([k], 4)
    meta = _meta([2], [6])
    meta.block_tables = tables
    q = torch.randn(2, 2, 8, generator=g).to(torch.bfloat16)
    out = kernels.paged_attention(q, cache.bfloat16(), cache.bfloat16(), meta, 0.5)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape


def test_gather_context_reads_a_sequences_tokens_in_order_across_its_pages():
    context = torch.randn(10, 2, 4, generator=_generator(7))
    cache, tables = _paged([context], 4)
    torch.testing.assert_close(kernels.gather_context(cache, tables[0], 10), context)
    torch.testing.assert_close(kernels.gather_context(cache, tables[0], 7), context[:7])


# ---- INT8 KV rows -------------------------------------------------------------------------------
def test_int8_kv_rows_hold_codes_and_a_scale_that_give_each_value_within_half_a_step():
    x = 5 * torch.randn(3, 2, 16, generator=_generator(8))
    x[0, 0] = 0.0  # an all-zero head: its scale is not 0
    x[1, 1] *= 0.01  # a head of small values: its scale is its own, not a floor's
    rows = kernels.quantize_kv(x)
    assert rows.dtype == torch.int8 and rows.shape == (3, 2, 16 + kernels.KV_SCALE_BYTES)
    assert kernels.kv_row_width(16, torch.int8) == 20
    assert kernels.kv_row_width(16, torch.bfloat16) == 16
    scale = x.abs().amax(-1, keepdim=True) / 127
    codes = rows[..., :16]
    assert codes[0, 0].eq(0).all()
    assert (codes.abs().amax(-1) == 127).sum() == 3 * 2 - 1  # each other head's largest is 127
    back = kernels.dequantize_kv(rows)
    assert back.dtype == torch.float32 and back.shape == x.shape
    assert ((back - x).abs() <= scale / 2 + 1e-6).all()
    assert torch.equal(back[0, 0], torch.zeros(16))


def test_an_int8_cache_is_written_quantized_and_read_back_dequantized():
    k, v = torch.randn(2, 1, 8, generator=_generator(9)), torch.randn(2, 1, 8)
    k_cache = torch.zeros(3, 4, 1, kernels.kv_row_width(8, torch.int8), dtype=torch.int8)
    v_cache = torch.zeros_like(k_cache)
    kernels.write_kv(k, v, k_cache, v_cache, torch.tensor([5, 2]))  # page 1 offset 1, page 0 2
    assert torch.equal(k_cache[1, 1], kernels.quantize_kv(k[0]))
    assert torch.equal(v_cache[0, 2], kernels.quantize_kv(v[1]))
    table = torch.tensor([0, 1])
    read = kernels.gather_context(k_cache, table, 6)
    torch.testing.assert_close(read[5], kernels.dequantize_kv(kernels.quantize_kv(k[0])))
    assert read.dtype == torch.float32


def test_a_16_bit_cache_is_written_in_its_own_dtype():
    k = torch.randn(1, 1, 8, generator=_generator(10))
    cache = torch.zeros(2, 4, 1, 8, dtype=torch.bfloat16)
    kernels.write_kv(k, k, cache, cache.clone(), torch.tensor([6]))
    assert torch.equal(cache[1, 2], k[0].to(torch.bfloat16))


# ---- whole pages --------------------------------------------------------------------------------
def test_copy_pages_copies_every_layers_k_and_v_of_each_page_and_nothing_else():
    kv = torch.randn(3, 2, 5, 4, 1, 2, generator=_generator(11))  # [layers, K/V, pages, ...]
    before = kv.clone()
    kernels.copy_pages(kv, [(0, 3), (4, 1)])
    assert torch.equal(kv[:, :, 3], before[:, :, 0]) and torch.equal(kv[:, :, 1], before[:, :, 4])
    for page in (0, 2, 4):
        assert torch.equal(kv[:, :, page], before[:, :, page])
    kernels.copy_pages(kv, [])
    assert torch.equal(kv[:, :, 3], before[:, :, 0])


def test_pages_swapped_out_and_in_come_back_whole_on_the_pages_named():
    kv = torch.randn(3, 2, 4, 4, 1, 2, generator=_generator(12))
    host = torch.zeros(3, 3, 2, 4, 1, 2)  # frames: [frames, layers, K/V, ...], page-major
    kernels.swap_out_pages(kv, host, [(2, 0), (0, 2)])
    assert torch.equal(host[0], kv[:, :, 2]) and torch.equal(host[2], kv[:, :, 0])
    assert not host[1].any()
    restored = torch.zeros_like(kv)
    kernels.swap_in_pages(restored, host, [(0, 1), (2, 3)])
    assert torch.equal(restored[:, :, 1], kv[:, :, 2]) and torch.equal(
        restored[:, :, 3], kv[:, :, 0]
    )
    assert not restored[:, :, 0].any() and not restored[:, :, 2].any()
