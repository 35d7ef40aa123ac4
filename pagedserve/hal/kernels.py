"""Reference kernels in plain PyTorch. Every backend override is tested against these."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """One flat batch: sequence i owns query rows ``query_start_loc[i]:query_start_loc[i+1]``.

    ``seq_lens[i]`` is the context length after this step (cached prefix + new tokens); the new tokens are
    the last ``query_len`` positions of that context. ``block_tables[i]`` maps logical blocks to pages.
    """

    slot_mapping: torch.Tensor  # [T] int64: page * block_size + offset for each new token
    query_start_loc: list[int]  # [B + 1]
    seq_lens: list[int]  # [B]
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0
    block_size: int
    # a backend's per-forward work that every layer shares (e.g. gather indices), built once
    scratch: dict = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def query_lens(self) -> list[int]:
        qs = self.query_start_loc
        return [qs[i + 1] - qs[i] for i in range(len(qs) - 1)]

    @property
    def max_query_len(self) -> int:
        qs = self.query_start_loc
        return max(qs[i + 1] - qs[i] for i in range(len(qs) - 1))

    @property
    def is_decode_only(self) -> bool:
        return self.query_start_loc[-1] == self.num_seqs


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2I] -> [..., I]: silu(gate) * up, gate first (GLM-4's fused gate_up_proj)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotary_cos_sin(rotary_dim: int, theta: float, max_position: int) -> torch.Tensor:
    """[max_position, rotary_dim] fp32: cos in the first half, sin in the second."""
    inv_freq = theta ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def rotary_at(cos_sin: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for each token, [T, 1, rotary_dim / 2] fp32: computed once per forward pass."""
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
    return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-J style (interleaved pairs) rotation of the first ``rotary_dim`` dims of each head.

    x: [T, heads, head_dim]; cos, sin: [T, 1, rotary_dim / 2] from ``rotary_at``.
    """
    rot = 2 * cos.shape[-1]
    x_rot = x[..., :rot].float()
    x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
    rotated = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    return torch.cat([rotated.to(x.dtype), x[..., rot:]], dim=-1)


# An INT8 KV cache keeps each token's head as head_dim int8 values and their fp32 scale in the
# same row (so that a page holds everything its tokens need: copies, swaps and gathers move rows
# as they are): [..., head_dim + KV_SCALE_BYTES] int8, ``value = code * scale``, the scale the
# head's largest magnitude / 127, per token and head.
KV_SCALE_BYTES = 4


def kv_row_width(head_dim: int, dtype: torch.dtype) -> int:
    """The last dimension of a KV cache of ``dtype``: head_dim, or head_dim + its int8 scale."""
    return head_dim + KV_SCALE_BYTES if dtype == torch.int8 else head_dim


def quantize_kv(x: torch.Tensor) -> torch.Tensor:
    """[..., head_dim] -> INT8 KV rows [..., head_dim + 4]: round(x / scale), and the fp32 scale."""
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True).clamp(min=1e-8) / 127.0
    codes = torch.round(xf / scale).to(torch.int8)  # |x| / scale <= 127 by the scale's choice
    return torch.cat([codes, scale.view(torch.int8)], dim=-1)


def dequantize_kv(rows: torch.Tensor) -> torch.Tensor:
    """INT8 KV rows [..., head_dim + 4] -> fp32 [..., head_dim]."""
    codes, scale = rows[..., :-KV_SCALE_BYTES], rows[..., -KV_SCALE_BYTES:]
    return codes.float() * scale.contiguous().view(torch.float32)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store each new token's K and V at its slot. Caches: [num_pages, block_size, kv_heads,
    kv_row_width(head_dim, dtype)]; an INT8 cache quantizes them per token and head."""
    for x, cache in ((k, k_cache), (v, v_cache)):
        rows = quantize_kv(x) if cache.dtype == torch.int8 else x.to(cache.dtype)
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slot_mapping, rows)


def gather_context(
    cache: torch.Tensor, block_table: torch.Tensor, context_len: int
) -> torch.Tensor:
    """The first ``context_len`` tokens of one sequence, [context_len, kv_heads, head_dim] (fp32
    from an INT8 cache)."""
    block_size = cache.shape[1]
    num_blocks = -(-context_len // block_size)
    rows = cache[block_table[:num_blocks]].flatten(0, 1)[:context_len]
    return dequantize_kv(rows) if cache.dtype == torch.int8 else rows


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its whole paged context.

    q: [T, heads, head_dim] -> [T, heads, head_dim]. Softmax in fp32; GQA by repeating KV heads.
    """
    out = torch.empty_like(q)
    qs = meta.query_start_loc
    for i, ctx in enumerate(meta.seq_lens):
        qi = q[qs[i] : qs[i + 1]].float()
        k = gather_context(k_cache, meta.block_tables[i], ctx).float()
        v = gather_context(v_cache, meta.block_tables[i], ctx).float()
        out[qs[i] : qs[i + 1]] = _causal_attention(qi, k, v, scale)  # cast to q's dtype
    return out


def _causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """q: [L, H, D] at the last L positions of a context of k, v: [C, KV, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("lhd,chd->hlc", q, k) * scale
    L, C = q.shape[0], k.shape[0]
    q_pos = torch.arange(C - L, C).unsqueeze(1)
    mask = torch.arange(C).unsqueeze(0) > q_pos  # [L, C]
    scores.masked_fill_(mask, float("-inf"))
    return torch.einsum("hlc,chd->lhd", scores.softmax(-1), v)


def copy_pages(kv_cache: torch.Tensor, copies: list[tuple[int, int]]) -> None:
    """Copy whole pages (all layers, K and V): kv_cache [layers, 2, num_pages, ...]."""
    if not copies:
        return
    src = torch.tensor([s for s, _ in copies])
    dst = torch.tensor([d for _, d in copies])
    kv_cache[:, :, dst] = kv_cache[:, :, src]


# The host tier's page frames are page-major, [num_frames, layers, 2, block_size, kv_heads, row]
# (SGLang HiCache's page_first layout): one frame is one contiguous block of memory, so a page
# goes to or from the host tier as one copy, whatever the number of layers. One copy_ per page:
# on the CPU 15-30 us a page of the 122M model, where a gather with index_put took 50-350 (a
# busy 2-core machine).
def swap_out_pages(
    kv_cache: torch.Tensor, host_cache: torch.Tensor, moves: list[tuple[int, int]]
) -> None:
    """Copy whole KV pages (all layers, K and V) into host frames: (device page, host frame)."""
    for page, frame in moves:
        host_cache[frame].copy_(kv_cache[:, :, page])


def swap_in_pages(
    kv_cache: torch.Tensor, host_cache: torch.Tensor, moves: list[tuple[int, int]]
) -> None:
    """Copy host frames back into KV pages: (host frame, device page)."""
    for frame, page in moves:
        kv_cache[:, :, page].copy_(host_cache[frame])
