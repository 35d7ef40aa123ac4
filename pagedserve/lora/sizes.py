"""The device slots' shapes and bytes, without torch: the engine allocates by them
(``slots.py``) and ``pagedserve tune`` plans by them (``engine/memory_plan.py``)."""

from __future__ import annotations

from pagedserve.models.config import GlmConfig


def slot_rank(max_lora_rank: int) -> int:
    """A slot's rank: the maximum, rounded up to 8 (rows of 16 bytes, as grouped GEMMs ask)."""
    return -(-max_lora_rank // 8) * 8


def slot_shapes(config: GlmConfig, tp_size: int, max_lora_rank: int) -> dict:
    """target -> (in, r, [out of each part]) of one slot on one of ``tp_size`` ranks: ``lora_a``
    is [in, parts x r], each part's ``lora_b`` [r, out]; ``qkv_proj`` has three parts (q, k and
    v), so that none reads the others' weights."""
    c, D, r = config, config.head_dim, slot_rank(max_lora_rank)
    heads, kv_heads = c.num_attention_heads // tp_size, c.num_kv_heads_per_rank(tp_size)
    inter = c.intermediate_size // tp_size
    return {
        "qkv_proj": (c.hidden_size, r, [heads * D, kv_heads * D, kv_heads * D]),
        "o_proj": (heads * D, r, [c.hidden_size]),
        "gate_up_proj": (c.hidden_size, r, [2 * inter]),
        "down_proj": (inter, r, [c.hidden_size]),
    }


def slots_nbytes(
    config: GlmConfig, tp_size: int, max_loras: int, max_lora_rank: int, dtype_bytes: int
) -> int:
    """Bytes of every device slot on one card: ``lora_a`` and each part's ``lora_b`` of each
    target of each layer, ``max_loras`` times."""
    shapes = slot_shapes(config, tp_size, max_lora_rank).values()
    per_layer = sum((fan_in * len(outs) + sum(outs)) * r for fan_in, r, outs in shapes)
    return per_layer * config.num_hidden_layers * max_loras * dtype_bytes
