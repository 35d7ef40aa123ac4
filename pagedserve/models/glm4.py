"""GLM-4 (``GlmForCausalLM``) and GLM-4-0414 (``Glm4ForCausalLM``) over HAL ops and a paged KV cache.

One forward pass takes the flat batch of every scheduled token (no padding). The two architectures
differ only in GLM-4-0414's sandwich norms after attention and after the MLP.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from pagedserve.hal import AttentionMetadata, Device
from pagedserve.hal.int4 import Int4Linear
from pagedserve.hal.int8 import Int8Linear, quantize_int8
from pagedserve.hal.kernels import rotary_cos_sin
from pagedserve.models.config import GlmConfig
from pagedserve.models.loader import layer_of, load_state_dict
from pagedserve.models.quant_formats import dequantize, load_quantized_linears, quantize_rtn
from pagedserve.models.tensor_parallel import TensorParallel

logger = logging.getLogger(__name__)

Linear = torch.Tensor | Int4Linear | Int8Linear
LM_HEAD_QUANTIZATIONS = ("none", "int8", "int4")
CanonicalInt4 = tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]


class LoRAHook(Protocol):
    """What a step with adapter rows adds after each target linear (``lora.slots.LoRAStep``):
    ``y`` plus each row's ``scale * B (A x)``, for ``target`` in qkv_proj, o_proj, gate_up_proj
    and down_proj of decoder layer ``layer``."""

    def apply(self, layer: int, target: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor: ...


@dataclass
class DecoderLayerWeights:
    input_layernorm: torch.Tensor
    qkv_proj: Linear  # q, k, v stacked along the output dim
    qkv_bias: torch.Tensor | None
    o_proj: Linear
    post_attention_layernorm: torch.Tensor  # the norm before the MLP (HF's name)
    gate_up_proj: Linear
    down_proj: Linear
    post_self_attn_layernorm: torch.Tensor | None = None  # glm4 sandwich norms
    post_mlp_layernorm: torch.Tensor | None = None


class GlmForCausalLM:
    """Both architectures: ``config.architecture`` is ``"glm"`` or ``"glm4"``.

    Linear layers are INT4 when the checkpoint is quantized (``quantization_config``) or when
    ``quantization="int4"`` asks for load-time round-to-nearest quantization (``"w4a8"``: the same,
    with each linear's input rounded to int8 per block of 32 values, as W4A8 checkpoints ask); embeddings, norms and
    biases stay 16-bit. lm_head is as the checkpoint has it unless ``quantize_lm_head`` says
    ``none``, ``int8`` (per-channel) or ``int4`` (group-wise, the decoder's group size).

    With ``tp`` (``tensor_parallel.py``) the model is one rank's shard: its heads, its part of the
    MLP and of the vocabulary; the row-parallel o_proj and down_proj and the embedding all-reduce,
    the logits are all-gathered, through the device's collectives.
    """

    def __init__(
        self,
        config: GlmConfig,
        device: Device,
        dtype: torch.dtype,
        quantization: str | None = None,
        quant_group_size: int = 32,
        quantize_lm_head: str | None = None,
        tp: TensorParallel | None = None,
    ):
        if quantize_lm_head not in (None, *LM_HEAD_QUANTIZATIONS):
            raise ValueError(
                f"--quantize-lm-head {quantize_lm_head!r}: use one of {', '.join(LM_HEAD_QUANTIZATIONS)}"
            )
        self.quantize_lm_head = quantize_lm_head
        self.quantization = quantization
        self.config = config
        self.device = device
        self.dtype = dtype
        self.quantize_at_load = quantization in ("int4", "w4a8") and not config.quantization_config
        self.quant_group_size = quant_group_size
        self.abits = int((config.quantization_config or {}).get("abits", 16))
        if self.quantize_at_load and quantization == "w4a8":
            self.abits = 8  # each linear's input rounded to int8 per block of 32, on the fly
        self.tp = tp or TensorParallel(config)
        self.num_heads = self.tp.num_heads  # this rank's heads
        self.num_kv_heads = self.tp.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.sandwich = config.architecture == "glm4"
        self.cos_sin = rotary_cos_sin(
            config.rotary_dim, config.rope_theta, config.max_position_embeddings
        ).to(device.torch_device)
        self.layers: list[DecoderLayerWeights] = []
        self.fused_layers: list = []
        self.kept_16bit: set[str] = (
            set()
        )  # layers quantized at load that stay 16-bit, by kind  # per layer: the device's one-call kernel, or None

    # ---- weights ------------------------------------------------------------------------------
    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Take HF-named tensors (see GLM4.md); q/k/v are fused here into one projection."""
        sd = state_dict
        self.device.plan_kernels(self.dtype, self.head_dim)
        self._take_quantized(sd)
        self._load_outer(sd)
        self.layers = [self._load_layer(sd, i) for i in range(self.config.num_hidden_layers)]
        self.fused_layers = [self._fused_layer(w) for w in self.layers]

    def _fused_layer(self, w: DecoderLayerWeights):
        """The device's one-call layer kernel; none at tp > 1, whose layers all-reduce mid-way."""
        if self.tp.size > 1:
            return None
        c = self.config
        return self.device.fused_decoder_layer(
            w, self.num_heads, self.num_kv_heads, self.head_dim, c.rms_norm_eps
        )

    def rebuild_weights(self, model_dir: str | Path, layer: int | None) -> dict[str, torch.Tensor]:
        """Decoder layer ``layer`` (None: the embedding, final norm and lm_head) read again from
        the checkpoint on disk and placed as ``load_weights`` placed it, on a twin of the device:
        the bytes a corrupted weight page must hold, by device tag."""
        twin = self.device.twin()
        model = GlmForCausalLM(
            self.config,
            twin,
            self.dtype,
            self.quantization,
            self.quant_group_size,
            self.quantize_lm_head,
            self.tp,
        )
        sd = load_state_dict(
            model_dir, self.config, self.dtype, self.tp, only=lambda n: layer_of(n) == layer
        )
        model._take_quantized(sd)
        if layer is None:
            model._load_outer(sd)
        else:
            model._load_layer(sd, layer)
        return twin.weight_tensors

    def _take_quantized(self, sd: dict[str, torch.Tensor]) -> None:
        qc = self.config.quantization_config
        self.int4_layers: dict[str, CanonicalInt4] = load_quantized_linears(sd, qc) if qc else {}

    def _load_outer(self, sd: dict[str, torch.Tensor]) -> None:
        """The embedding, the final norm and lm_head (everything outside the decoder layers),
        this rank's share of the vocabulary."""
        put, take = self._place, self.tp.take
        embed = take("model.embed_tokens.weight", sd.pop("model.embed_tokens.weight"))
        lm_head = sd.pop("lm_head.weight", None)
        lm_head = None if lm_head is None else take("lm_head.weight", lm_head)
        self.embed_tokens = put(embed, "model.embed_tokens.weight")
        self.norm = put(sd.pop("model.norm.weight"), "model.norm.weight")
        self.lm_head = self._load_lm_head(sd, lm_head, embed)

    def _load_layer(self, sd: dict[str, torch.Tensor], i: int) -> DecoderLayerWeights:
        p = f"model.layers.{i}."
        names = [f"{p}self_attn.{n}_proj.bias" for n in "qkv"]
        biases = [sd.pop(n, None) for n in names]
        biases = [b if b is None else self.tp.take(n, b) for n, b in zip(names, biases)]
        qkv_bias = torch.cat(biases) if biases[0] is not None else None
        sandwich = {
            name: self._place(sd.pop(p + name + ".weight"), p + name)
            for name in ("post_self_attn_layernorm", "post_mlp_layernorm")
            if self.sandwich
        }
        return DecoderLayerWeights(
            input_layernorm=self._place(
                sd.pop(p + "input_layernorm.weight"), p + "input_layernorm"
            ),
            qkv_proj=self._linear(sd, [f"{p}self_attn.{n}_proj" for n in "qkv"]),
            qkv_bias=None if qkv_bias is None else self._place(qkv_bias, p + "self_attn.qkv_bias"),
            o_proj=self._linear(sd, [p + "self_attn.o_proj"]),
            post_attention_layernorm=self._place(
                sd.pop(p + "post_attention_layernorm.weight"), p + "post_attention_layernorm"
            ),
            gate_up_proj=self._linear(sd, [p + "mlp.gate_up_proj"]),
            down_proj=self._linear(sd, [p + "mlp.down_proj"]),
            **sandwich,
        )

    def _load_lm_head(
        self, sd: dict[str, torch.Tensor], weight: torch.Tensor | None, embed: torch.Tensor
    ) -> Linear:
        mode = self.quantize_lm_head
        if "lm_head" in self.int4_layers and mode in (None, "int4"):
            return self._linear(sd, ["lm_head"])  # quantized in the checkpoint
        if "lm_head" in self.int4_layers:
            weight = self._dense_weight(sd, "lm_head")
        tied = self.config.tie_word_embeddings and (weight is None or weight is embed)
        if tied and mode in (None, "none"):
            return self.embed_tokens  # one copy on the device
        if weight is None:
            assert tied, "checkpoint has no lm_head.weight"
            weight = embed
        if mode == "int4" and self._quantizable("lm_head", weight):  # (W4A8: int8 activations)
            q, s, z = quantize_rtn(weight, self.quant_group_size)
            return self.device.prepare_int4(q, s, z, self.quant_group_size, "lm_head", self.abits)
        if mode == "int8":
            codes, scales = quantize_int8(weight)
            return self.device.prepare_int8(codes, scales, self.dtype, "lm_head")
        return self._place(weight, "lm_head.weight")

    def _linear(self, sd: dict[str, torch.Tensor], prefixes: list[str]) -> Linear:
        """One linear layer from one or more checkpoint layers stacked along the output dim.

        INT4 when every part is INT4 in the checkpoint, or when quantizing at load; a mix of INT4
        and 16-bit parts (a skip-list) is kept 16-bit.
        """
        tag = prefixes[0] if len(prefixes) == 1 else prefixes[0].rsplit(".", 1)[0] + ".qkv_proj"
        if all(p in self.int4_layers for p in prefixes):
            parts = [(p, self.int4_layers.pop(p)) for p in prefixes]
            parts = [(*self.tp.take_int4(p, *part), part[3]) for p, part in parts]
            q, s, z = (torch.cat([part[i] for part in parts]) for i in range(3))
            return self.device.prepare_int4(q, s, z, parts[0][3], tag, self.abits)
        dense = torch.cat(
            [self.tp.take(p + ".weight", self._dense_weight(sd, p)) for p in prefixes]
        )
        if self.quantize_at_load and self._quantizable(tag, dense):
            q, s, z = quantize_rtn(dense, self.quant_group_size)
            return self.device.prepare_int4(q, s, z, self.quant_group_size, tag, self.abits)
        return self._place(dense, tag)

    def _quantizable(self, tag: str, weight: torch.Tensor) -> bool:
        """Whether a layer quantized at load splits into whole groups along its input; one that
        does not stays 16-bit, as llama.cpp's quantizer keeps such tensors (said once per kind of
        layer)."""
        in_features, group = weight.shape[1], self.quant_group_size
        if in_features % group == 0:
            return True
        kind = re.sub(r"\.\d+\.", ".*.", tag)
        if kind not in self.kept_16bit:
            self.kept_16bit.add(kind)
            logger.warning(
                "%s: in_features %d is not a multiple of the INT4 group size %d; kept in 16-bit",
                kind,
                in_features,
                group,
            )
        return False

    def _dense_weight(self, sd: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
        if prefix in self.int4_layers:
            q, s, z, g = self.int4_layers.pop(prefix)
            return dequantize(q, s, z, g)
        return sd.pop(prefix + ".weight")

    def weight_bytes(self) -> int:
        return self.device.tiers["weight"].used

    def _place(self, t: torch.Tensor, name: str) -> torch.Tensor:
        return self.device.to_device(t.to(self.dtype), "weight", name)

    # ---- forward ------------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
        lora: LoRAHook | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for every token of the flat batch.

        The residual stream is vLLM's: each layer returns its last output and the running sum
        separately, and the next norm adds them (one fused op on backends that have it).

        ``lora``: the step's adapter rows (None: every row is the base model's). The backend's
        fused decoder layer knows no adapters, so a step with any adapter row runs op by op.
        """
        dev = self.device
        h = self._embed(input_ids)
        rope = dev.rotary_at(self.cos_sin, positions)  # the same for every layer
        residual = None
        fusable = meta.max_query_len <= dev.fused_layer_max_query_rows  # decode (and drafts)
        fusable = fusable and lora is None
        for i, layer in enumerate(self.layers):
            fused = self.fused_layers[i] if fusable else None
            if fused is not None:  # the backend's one-call kernel for the same computation
                h, residual = fused(h, residual, rope, meta, kv_cache[i])
            else:
                h, residual = self._decoder_layer(
                    layer, h, residual, rope, meta, kv_cache[i], (i, lora)
                )
        return dev.add_rms_norm(h, residual, self.norm, self.config.rms_norm_eps)[0]

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel: each rank looks up the ids in its part of the padded vocabulary (zeros
        for the others) and one all-reduce sums the rows. No id reaches a padding row: the
        engine refuses ids outside the real vocabulary."""
        if self.tp.size == 1:
            return self.embed_tokens[input_ids]
        start, stop = self.tp.vocab_range
        mine = (input_ids >= start) & (input_ids < stop)
        h = self.embed_tokens[(input_ids - start).clamp(0, stop - start - 1)]
        return self.device.all_reduce(h * mine.unsqueeze(-1).to(h.dtype))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] fp32, exactly the real vocabulary; at tp > 1 each rank's slice of the
        padded vocabulary, all-gathered, and the padding's columns (zero logits, which could
        outrank every real token) cut off before sampling, logprobs or grammar masks see them."""
        logits = self.device.all_gather(self.device.linear(hidden, self.lm_head).float(), dim=-1)
        vocab_size = self.config.vocab_size
        if logits.shape[-1] == vocab_size:
            return logits
        return logits[:, :vocab_size].contiguous()

    def _decoder_layer(
        self,
        w: DecoderLayerWeights,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        rope: object,
        meta: AttentionMetadata,
        kv: torch.Tensor,
        lora: tuple[int, LoRAHook | None] = (0, None),
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dev, eps = self.device, self.config.rms_norm_eps
        x, residual = dev.add_rms_norm(h, residual, w.input_layernorm, eps)
        attn = self._attention(w, x, rope, meta, kv, lora)
        if self.sandwich:
            attn = dev.rms_norm(attn, w.post_self_attn_layernorm, eps)
        x, residual = dev.add_rms_norm(attn, residual, w.post_attention_layernorm, eps)
        mlp = self._mlp(w, x, lora)
        if self.sandwich:
            mlp = dev.rms_norm(mlp, w.post_mlp_layernorm, eps)
        return mlp, residual

    def _attention(
        self,
        w: DecoderLayerWeights,
        x: torch.Tensor,
        rope: object,
        meta: AttentionMetadata,
        kv: torch.Tensor,
        lora: tuple[int, LoRAHook | None] = (0, None),
    ) -> torch.Tensor:
        dev, T, D = self.device, x.shape[0], self.head_dim
        H, KV = self.num_heads, self.num_kv_heads
        qkv = _with_lora(lora, "qkv_proj", x, dev.linear(x, w.qkv_proj, w.qkv_bias))
        q = dev.rotary_and_write_kv(
            qkv.view(T, H + 2 * KV, D), H, rope, kv[0], kv[1], meta.slot_mapping
        )
        o = dev.paged_attention(q, kv[0], kv[1], meta, self.scale).reshape(T, H * D)
        return dev.all_reduce(
            _with_lora(lora, "o_proj", o, dev.linear(o, w.o_proj))
        )  # row-parallel

    def _mlp(
        self, w: DecoderLayerWeights, x: torch.Tensor, lora: tuple[int, LoRAHook | None] = (0, None)
    ) -> torch.Tensor:
        dev = self.device
        gate_up = _with_lora(lora, "gate_up_proj", x, dev.linear(x, w.gate_up_proj))
        act = dev.silu_and_mul(gate_up)
        down = _with_lora(lora, "down_proj", act, dev.linear(act, w.down_proj))
        return dev.all_reduce(down)  # row-parallel


def _with_lora(
    lora: tuple[int, LoRAHook | None], target: str, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    """``y`` (the base layer's output for input ``x``) with the adapter rows' share added."""
    layer, hook = lora
    return y if hook is None else hook.apply(layer, target, x, y)
