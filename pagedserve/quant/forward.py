"""A self-contained GLM-4 / GLM-4-0414 forward over a plain HF-named state dict, for calibration
and evaluation: fp32, full causal attention over a [B, T] batch, no paging, layer by layer.

``act_bits=8`` emulates W4A8: each quantized linear's input is quantized to symmetric int8 per block
of 32 values, as the kernels do (``hal.int4.quantize_activations_int8``).
``kv_cache_dtype="int8"`` emulates an INT8 KV cache: every key (after its rotation, as the cache
holds it) and value is rounded to int8 codes and a scale per token and head and read back, by the
HAL's own ``quantize_kv`` / ``dequantize_kv``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedserve.hal.int4 import quantize_activations_int8
from pagedserve.hal.kernels import (
    apply_rotary,
    dequantize_kv,
    quantize_kv,
    rotary_at,
    rotary_cos_sin,
)
from pagedserve.models.config import GlmConfig

LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_up_proj",
    "mlp.down_proj",
)
Capture = Callable[[str, torch.Tensor], None]


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def layer_weights(sd: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
    """Layer i's tensors as fp32, keyed without the ``model.layers.{i}.`` prefix."""
    p = f"model.layers.{i}."
    return {k[len(p) :]: v.float() for k, v in sd.items() if k.startswith(p)}


class ReferenceGlm:
    def __init__(
        self,
        config: GlmConfig,
        state_dict: dict[str, torch.Tensor],
        act_bits: int = 16,
        quantized: set[str] | None = None,
        kv_cache_dtype: str = "auto",
    ):
        self.config = config
        self.sd = state_dict
        self.act_bits = act_bits
        self.kv_cache_dtype = kv_cache_dtype
        self.quantized = (
            quantized or set()
        )  # layer-relative linear names per layer: "0.mlp.down_proj"
        c = config
        self.cos_sin = rotary_cos_sin(c.rotary_dim, c.rope_theta, c.max_position_embeddings)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.sd["model.embed_tokens.weight"][input_ids].float()

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        h = rms_norm(h, self.sd["model.norm.weight"].float(), self.config.rms_norm_eps)
        if self.act_bits == 8 and "lm_head" in self.quantized:  # an INT4 lm_head under W4A8
            h = quantize_activations_int8(h)
        return h @ self.sd["lm_head.weight"].float().T

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, vocab] for input_ids [B, T]."""
        h = self.embed(input_ids)
        for i in range(self.config.num_hidden_layers):
            h = self.layer(i, layer_weights(self.sd, i), h)
        return self.logits(h)

    def layer(
        self, i: int, w: dict[str, torch.Tensor], h: torch.Tensor, capture: Capture | None = None
    ) -> torch.Tensor:
        """One decoder layer; ``capture(name, x)`` sees each linear's input (name as in LINEARS)."""
        eps, sandwich = self.config.rms_norm_eps, self.config.architecture == "glm4"

        def linear(name: str, x: torch.Tensor) -> torch.Tensor:
            if capture is not None:
                capture(name, x)
            if self.act_bits == 8 and f"{i}.{name}" in self.quantized:
                x = quantize_activations_int8(x)
            return F.linear(x, w[f"{name}.weight"], w.get(f"{name}.bias"))

        attn = self.attention(w, rms_norm(h, w["input_layernorm.weight"], eps), linear)
        if sandwich:
            attn = rms_norm(attn, w["post_self_attn_layernorm.weight"], eps)
        h = h + attn
        gate, up = linear(
            "mlp.gate_up_proj", rms_norm(h, w["post_attention_layernorm.weight"], eps)
        ).chunk(2, -1)
        mlp = linear("mlp.down_proj", F.silu(gate) * up)
        if sandwich:
            mlp = rms_norm(mlp, w["post_mlp_layernorm.weight"], eps)
        return h + mlp

    def attention(self, w: dict, x: torch.Tensor, linear: Callable) -> torch.Tensor:
        c = self.config
        b, t, _ = x.shape
        q = linear("self_attn.q_proj", x).view(b, t, c.num_attention_heads, c.head_dim)
        k = linear("self_attn.k_proj", x).view(b, t, c.num_key_value_heads, c.head_dim)
        v = linear("self_attn.v_proj", x).view(b, t, c.num_key_value_heads, c.head_dim)
        q, k = self.rotate(q), self.rotate(k)
        if self.kv_cache_dtype == "int8":  # what an INT8 cache gives attention back
            k, v = dequantize_kv(quantize_kv(k)), dequantize_kv(quantize_kv(v))
        rep = c.num_attention_heads // c.num_key_value_heads
        k, v = (z.repeat_interleave(rep, dim=2).transpose(1, 2) for z in (k, v))
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k, v, is_causal=True, scale=c.head_dim**-0.5
        )
        return linear("self_attn.o_proj", o.transpose(1, 2).reshape(b, t, -1))

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, heads, head_dim] at positions 0..T-1: the HAL's reference rotary."""
        return apply_rotary(x, *rotary_at(self.cos_sin, torch.arange(x.shape[1])))
