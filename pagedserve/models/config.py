"""GLM-4 model configuration read from a checkpoint's config.json (HF `glm`/`glm4` or THUDM `chatglm`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedserve.config import KV_CACHE_DTYPES
from pagedserve.models.model_dir import ModelDirError, read_json_object

SUPPORTED_MODEL_TYPES = ("glm", "glm4", "chatglm")
# an INT8 KV cache stores each token's head as head_dim int8 codes and their fp32 scale
# (``hal.kernels.quantize_kv``; no torch here, so the width is repeated)
INT8_KV_SCALE_BYTES = 4  # hal.kernels.KV_SCALE_BYTES: the scale stored after each head's codes
VOCAB_PADDING = 64  # vLLM's DEFAULT_VOCAB_PADDING_SIZE
QUANT_CONFIG_FILES = ("quant_config.json", "quantize_config.json")


def pad_vocab_size(vocab_size: int, tp_size: int) -> int:
    """The vocabulary that ``tp_size`` ranks split evenly (``tensor_parallel.py``): the vocabulary
    itself on one rank; else rounded up to a multiple of 64 (vLLM's ``pad_vocab_size``), then of
    ``tp_size`` (where vLLM would refuse the size)."""
    if tp_size == 1:
        return vocab_size
    padded = -(-vocab_size // VOCAB_PADDING) * VOCAB_PADDING
    return -(-padded // tp_size) * tp_size


@dataclass
class GlmConfig:
    architecture: str  # "glm" (GlmForCausalLM, GLM-4-9B) or "glm4" (Glm4ForCausalLM, GLM-4-0414)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    partial_rotary_factor: float = 0.5
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1.5625e-07
    attention_bias: bool = True
    max_position_embeddings: int = 131072
    tie_word_embeddings: bool = False
    eos_token_ids: list[int] = field(default_factory=list)
    pad_token_id: int | None = None
    torch_dtype: str | None = None
    quantization_config: dict | None = None

    def __post_init__(self) -> None:
        self.verify()

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def num_kv_heads_per_rank(self, tp_size: int) -> int:
        """KV heads on each of ``tp_size`` tensor-parallel ranks: split evenly, or replicated when
        there are fewer than ranks (as vLLM does)."""
        return max(self.num_key_value_heads // tp_size, 1)

    def kv_bytes_per_token(
        self, num_kv_heads: int, dtype_bytes: int, kv_cache_dtype: str = "auto"
    ) -> int:
        """K and V of one token in every layer, on a card that holds ``num_kv_heads`` KV heads:
        ``head_dim`` values of ``dtype_bytes`` each per head, or with ``kv_cache_dtype="int8"``
        ``head_dim`` one-byte codes and a 4-byte scale. The engine sizes its KV pages by it,
        ``pagedserve tune`` plans by it."""
        return (
            2
            * self.num_hidden_layers
            * num_kv_heads
            * self.kv_row_bytes(dtype_bytes, kv_cache_dtype)
        )

    def kv_row_bytes(self, dtype_bytes: int, kv_cache_dtype: str = "auto") -> int:
        """One head of one token's K (or V) in the cache."""
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype {kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}"
            )
        if kv_cache_dtype == "int8":
            return self.head_dim + INT8_KV_SCALE_BYTES
        return self.head_dim * dtype_bytes

    def verify(self) -> None:
        if self.architecture not in ("glm", "glm4"):
            raise ValueError(f"architecture must be 'glm' or 'glm4', got {self.architecture!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(
                f"rotary_dim = head_dim ({self.head_dim}) * partial_rotary_factor "
                f"({self.partial_rotary_factor}) = {self.rotary_dim}; it must be even and in "
                f"(0, head_dim]"
            )

    def check_tensor_parallel(
        self, tp: int, int4_group_size: int | None, flag: str = "--tp-size"
    ) -> None:
        """Raise ``ValueError`` naming why ``tp`` ranks cannot split this model evenly, and the
        sizes that can (shapes only: checked before any rank is spawned)."""
        problems = self.tensor_parallel_problems(tp, int4_group_size)
        if problems:
            heads = self.num_attention_heads
            fits = [
                t
                for t in range(1, heads + 1)
                if not self.tensor_parallel_problems(t, int4_group_size)
            ]
            raise ValueError(
                f"{flag} {tp} cannot split this model: {'; '.join(problems)}; use a size "
                f"that splits it ({', '.join(map(str, fits))})"
            )

    def tensor_parallel_problems(self, tp: int, int4_group_size: int | None) -> list[str]:
        """Why ``tp`` ranks cannot split this model evenly ([]: they can). An INT4 layer's input
        split must not cut its groups; a layer whose input the group size does not divide stays
        16-bit (``GlmForCausalLM._linear``), and splits as one."""
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        problems = []
        if heads % tp:
            problems.append(f"it does not divide the {heads} attention heads")
        if kv % tp and tp % kv:
            problems.append(f"it and the {kv} KV heads do not divide one another")
        if self.intermediate_size % tp:
            problems.append(f"it does not divide intermediate_size {self.intermediate_size}")
        if int4_group_size and not problems:
            for name, columns in (
                ("o_proj", heads * self.head_dim),
                ("down_proj", self.intermediate_size),
            ):
                if columns % int4_group_size == 0 and (columns // tp) % int4_group_size:
                    problems.append(
                        f"it would cut the INT4 groups of {name}: {columns} input columns / {tp} "
                        f"= {columns // tp} per rank, not a multiple of the group size "
                        f"{int4_group_size}"
                    )
        return problems

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GlmConfig:
        model_type = d.get("model_type")
        if model_type in ("glm", "glm4"):
            return cls(**_hf_fields(d, model_type))
        if model_type == "chatglm":
            return cls(**_chatglm_fields(d))
        raise ValueError(
            f"unsupported model_type {model_type!r} in config.json; supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )


CONFIG_FIX = "fix it, or copy config.json again from the checkpoint"


def load_config(model_dir: str | Path) -> GlmConfig:
    """The checkpoint's config.json (and quantization config file); a ``ModelDirError`` naming
    the file and the field where one is damaged or incomplete."""
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: a model directory needs a config.json")
    d = read_json_object(path, CONFIG_FIX)
    if d.get("quantization_config") is None:
        d["quantization_config"] = _read_quant_config(model_dir)
    try:
        return GlmConfig.from_dict(d)
    except KeyError as e:
        model_type = d.get("model_type")
        raise ModelDirError(
            path,
            f"missing {e.args[0]!r}, which a {model_type!r} model needs",
            "add it from the checkpoint's original config.json",
        ) from None
    except (TypeError, ZeroDivisionError) as e:  # "32" heads, or 0 of them
        raise ModelDirError(path, f"a value has the wrong type or is 0 ({e})", CONFIG_FIX) from None


def int4_group_size(
    quantization_config: dict | None, quantization: str | None, quant_group_size: int
) -> int | None:
    """The INT4 group size the weights will have: the checkpoint's (its quantization config), or
    ``--quant-group-size`` where ``--quantization`` quantizes at load; None for 16-bit weights."""
    qc = quantization_config
    if qc:
        return int(qc.get("group_size", qc.get("q_group_size", quant_group_size)))
    return quant_group_size if quantization in ("int4", "w4a8") else None


def _read_quant_config(model_dir: Path) -> dict | None:
    for name in QUANT_CONFIG_FILES:
        path = model_dir / name
        if path.is_file():
            return read_json_object(path, f"fix it, or copy {name} again from the checkpoint")
    return None


def _eos_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _hf_fields(d: dict[str, Any], model_type: str) -> dict[str, Any]:
    rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in (None, "default"):
        raise ValueError(f"rope_type {rope_type!r} is not supported; only default RoPE is")
    heads = d["num_attention_heads"]
    return dict(
        architecture=model_type,
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"],
        num_hidden_layers=d["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or d["hidden_size"] // heads,
        partial_rotary_factor=_first(d, rope, "partial_rotary_factor", 0.5),
        rope_theta=float(_first(d, rope, "rope_theta", 10000.0)),
        rms_norm_eps=d.get("rms_norm_eps", 1.5625e-07),
        attention_bias=d.get("attention_bias", True),
        max_position_embeddings=d.get("max_position_embeddings", 131072),
        tie_word_embeddings=d.get("tie_word_embeddings", False),
        eos_token_ids=_eos_list(d.get("eos_token_id")),
        pad_token_id=d.get("pad_token_id"),
        torch_dtype=d.get("torch_dtype") or d.get("dtype"),
        quantization_config=d.get("quantization_config"),
    )


def _first(d: dict[str, Any], rope: dict[str, Any], key: str, default: Any) -> Any:
    if d.get(key) is not None:
        return d[key]
    return rope.get(key, default)


def _chatglm_fields(d: dict[str, Any]) -> dict[str, Any]:
    heads = d["num_attention_heads"]
    kv_heads = d.get("multi_query_group_num", 1) if d.get("multi_query_attention") else heads
    return dict(
        architecture="glm",
        vocab_size=d.get("padded_vocab_size") or d["vocab_size"],
        hidden_size=d["hidden_size"],
        intermediate_size=d["ffn_hidden_size"],
        num_hidden_layers=d["num_layers"],
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=d.get("kv_channels") or d["hidden_size"] // heads,
        partial_rotary_factor=0.5,
        rope_theta=10000.0 * d.get("rope_ratio", 1.0),
        rms_norm_eps=d.get("layernorm_epsilon", 1e-5),
        attention_bias=d.get("add_qkv_bias", False),
        max_position_embeddings=d.get("seq_length", 2048),
        tie_word_embeddings=d.get("tie_word_embeddings", False),
        eos_token_ids=_eos_list(d.get("eos_token_id")),
        pad_token_id=d.get("pad_token_id"),
        torch_dtype=d.get("torch_dtype") or d.get("dtype"),
        quantization_config=d.get("quantization_config"),
    )
