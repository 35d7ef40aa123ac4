"""Builders for kernel tests: a flat batch over a random paged KV cache."""

from __future__ import annotations

import pytest
import torch

from pagedserve.hal import kernels, native


def target_param(name: str):
    """A native target as a test parameter, skipped (naming the flags the CPU lacks) where this
    CPU cannot execute it."""
    missing = native.missing_flags(native.TARGETS[name])
    reason = f"this CPU cannot execute the {name} kernels: it lacks {' '.join(missing)}"
    return pytest.param(name, marks=pytest.mark.skipif(bool(missing), reason=reason))


TARGETS = [target_param(name) for name in native.TARGETS]
KERNEL_SETS = [*TARGETS, "eager"]  # every native target, and plain PyTorch


def paged_batch(
    seq_lens,
    query_lens,
    block_size=4,
    heads=4,
    kv_heads=2,
    head_dim=8,
    dtype=torch.float32,
    seed=0,
    cache_dtype=None,
):
    """q [T, heads, D] for the flat batch, K and V caches with random pages (in ``cache_dtype``,
    default q's; ``torch.int8``: INT8 KV rows), and its metadata."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-s // block_size) for s in seq_lens)
    num_pages = max_blocks * len(seq_lens) + 3
    kc, vc = (
        torch.randn(num_pages, block_size, kv_heads, head_dim, generator=g).to(dtype)
        for _ in range(2)
    )
    if cache_dtype == torch.int8:
        kc, vc = kernels.quantize_kv(kc), kernels.quantize_kv(vc)
    pages = torch.randperm(num_pages, generator=g)[: max_blocks * len(seq_lens)]
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    meta = kernels.AttentionMetadata(
        slot_mapping=torch.zeros(qsl[-1], dtype=torch.long),
        query_start_loc=qsl,
        seq_lens=list(seq_lens),
        block_tables=pages.view(len(seq_lens), max_blocks),
        block_size=block_size,
    )
    q = torch.randn(qsl[-1], heads, head_dim, generator=g).to(dtype)
    return q, kc, vc, meta
