"""Megatron-style sharding of GLM-4's tensors over tensor-parallel ranks (vLLM's layers' split).

- column-parallel (output rows split): q/k/v (by attention heads; KV heads replicated when there
  are fewer than ranks), gate_up (the gate half and the up half each split), lm_head and the
  embedding (by vocabulary: vocab-parallel, over the padded vocabulary below);
- row-parallel (input columns split): o_proj and down_proj, whose partial outputs one all-reduce
  sums;
- norms and the o/down outputs are whole on every rank.

The vocabulary is padded as vLLM's ``VocabParallelEmbedding`` pads it (``pad_vocab_size``, in
``config.py``): to a multiple of 64, then of the size, so that every rank holds as many rows and
the logits gather into one tensor whatever the checkpoint's vocabulary. The padding rows are
zeros at the end of the last ranks' shards; no token id reaches them in the embedding, and
``GlmForCausalLM.compute_logits`` cuts their logits off before anything samples from them.

A ``Shard`` says which rows or columns of the full tensor a rank keeps; the loader reads only those
from safetensors files, and the model slices what arrives whole (a dequantized layer, a chatglm
fused qkv). INT4 groups run along the input columns, so a row-parallel shard boundary must fall on
a group boundary: a size that would cut a group is refused with the reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from pagedserve.models.config import GlmConfig, pad_vocab_size

_LAYER = re.compile(r"^model\.layers\.\d+\.(.+)$")
VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")


@dataclass(frozen=True)
class Shard:
    dim: int  # 0: output rows; 1: input columns
    full: int  # the full tensor's size along ``dim``
    ranges: tuple[tuple[int, int], ...]  # the [start, stop) pieces this rank keeps, concatenated
    padding: int = 0  # zero rows appended after them: the padded vocabulary's share of this rank

    def pad(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (the pieces, concatenated) with this shard's padding appended along ``dim``."""
        if not self.padding:
            return t
        shape = list(t.shape)
        shape[self.dim] = self.padding
        return torch.cat([t, t.new_zeros(shape)], self.dim)


@dataclass(frozen=True)
class TensorParallel:
    """Rank ``rank`` of ``size`` on a model of ``config``'s shapes."""

    config: GlmConfig
    rank: int = 0
    size: int = 1

    # ---- per-rank shapes ----------------------------------------------------------------------
    @property
    def num_heads(self) -> int:
        return self.config.num_attention_heads // self.size

    @property
    def num_kv_heads(self) -> int:
        return self.config.num_kv_heads_per_rank(self.size)

    @property
    def padded_vocab_size(self) -> int:
        return pad_vocab_size(self.config.vocab_size, self.size)

    @property
    def vocab_range(self) -> tuple[int, int]:
        """This rank's rows of the padded vocabulary (those past ``vocab_size`` are padding)."""
        return self._range(self.padded_vocab_size // self.size)

    def check(self, int4_group_size: int | None, flag: str = "--tp-size") -> None:
        """Raise ``ValueError`` naming why ``size`` cannot split this model evenly, and the sizes
        that can (``GlmConfig.check_tensor_parallel``: checked before any rank starts)."""
        self.config.check_tensor_parallel(self.size, int4_group_size, flag)

    def problems(self, tp: int, int4_group_size: int | None) -> list[str]:
        """Why ``tp`` ranks cannot split this model evenly ([]: they can)."""
        return self.config.tensor_parallel_problems(tp, int4_group_size)

    # ---- which part of a tensor this rank keeps ----------------------------------------------
    def shard(self, name: str) -> Shard | None:
        """The shard of the HF-named tensor ``name`` (``.weight`` or ``.bias``), None: whole."""
        if self.size == 1 or not name.endswith((".weight", ".bias")):
            return None  # quantized tensors (qweight, scales ...) are cut in canonical form
        c, D = self.config, self.config.head_dim
        if name in VOCAB_TENSORS:
            start, stop = self.vocab_range
            real = (min(start, c.vocab_size), min(stop, c.vocab_size))
            return Shard(0, c.vocab_size, (real,), (stop - start) - (real[1] - real[0]))
        m = _LAYER.match(name)
        if m is None:
            return None
        part = m.group(1).rsplit(".", 1)[0]
        q_heads = self._range(self.num_heads)
        if part == "self_attn.q_proj":
            return Shard(0, c.num_attention_heads * D, (_scaled(q_heads, D),))
        if part in ("self_attn.k_proj", "self_attn.v_proj"):
            return Shard(0, c.num_key_value_heads * D, (_scaled(self._kv_heads(), D),))
        if part == "self_attn.o_proj":
            return Shard(1, c.num_attention_heads * D, (_scaled(q_heads, D),))
        inter = c.intermediate_size
        rows = self._range(inter // self.size)
        if part == "mlp.gate_up_proj":
            return Shard(0, 2 * inter, (rows, (inter + rows[0], inter + rows[1])))
        if part == "mlp.down_proj":
            return Shard(1, inter, (rows,))
        return None

    def take(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """This rank's part of ``t`` when ``t`` is whole; ``t`` itself when already a shard."""
        shard = self.shard(name)
        if shard is None or t.shape[shard.dim] != shard.full:
            return t
        return shard.pad(_cat(t, shard.dim, shard.ranges))

    def take_int4(
        self, prefix: str, q: torch.Tensor, s: torch.Tensor, z: torch.Tensor, group_size: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's part of a canonical INT4 layer: codes [N, K], scales and zeros [N, K/G]."""
        shard = self.shard(prefix + ".weight")
        if shard is None:
            return q, s, z
        if shard.dim == 0:
            return tuple(self.take(prefix + ".weight", t) for t in (q, s, z))
        assert all(a % group_size == 0 for r in shard.ranges for a in r), "cuts an INT4 group"
        groups = [(a // group_size, b // group_size) for a, b in shard.ranges]
        return self.take(prefix + ".weight", q), _cat(s, 1, groups), _cat(z, 1, groups)

    def _range(self, per_rank: int) -> tuple[int, int]:
        return self.rank * per_rank, (self.rank + 1) * per_rank

    def _kv_heads(self) -> tuple[int, int]:
        """Split when there are at least as many KV heads as ranks; else each rank keeps the one
        KV head its query heads use (GQA: KV head j serves query heads j*H/KV .. )."""
        kv = self.config.num_key_value_heads
        if kv >= self.size:
            return self._range(kv // self.size)
        head = self.rank * kv // self.size
        return head, head + 1


def _scaled(r: tuple[int, int], factor: int) -> tuple[int, int]:
    return r[0] * factor, r[1] * factor


def _cat(t: torch.Tensor, dim: int, ranges) -> torch.Tensor:
    pieces = [t.narrow(dim, a, b - a) for a, b in ranges]
    return pieces[0].contiguous() if len(pieces) == 1 else torch.cat(pieces, dim)
