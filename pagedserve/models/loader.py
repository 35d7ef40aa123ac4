"""Read a GLM-4 checkpoint directory into a state dict with Hugging Face tensor names."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from pagedserve.models.config import GlmConfig
from pagedserve.models.model_dir import (  # noqa: F401 - resolve_model_path: its old home
    check_safetensors,
    resolve_model_path,
    weight_files,
)
from pagedserve.models.tensor_parallel import Shard, TensorParallel
from pagedserve.presets import demo_model_dir

_CHATGLM_RENAMES = [
    (r"^transformer\.embedding\.word_embeddings\.", "model.embed_tokens."),
    (r"^transformer\.encoder\.final_layernorm\.", "model.norm."),
    (r"^transformer\.output_layer\.", "lm_head."),
    (r"^transformer\.encoder\.layers\.", "model.layers."),
    (r"\.self_attention\.dense\.", ".self_attn.o_proj."),
    (r"\.mlp\.dense_h_to_4h\.", ".mlp.gate_up_proj."),
    (r"\.mlp\.dense_4h_to_h\.", ".mlp.down_proj."),
]
_DROPPED = re.compile(r"(^transformer\.rotary_pos_emb\.|\.rotary_emb\.)inv_freq$")
_LAYER = re.compile(r"\blayers\.(\d+)\.")
_FUSED_QKV = re.compile(r"^(.*)\.self_attention\.query_key_value\.(weight|bias)$")


DEMO_MODEL_DIR = demo_model_dir()


def load_state_dict(
    model_dir: str | Path,
    config: GlmConfig,
    dtype: torch.dtype | None = None,
    tp: TensorParallel | None = None,
    only: Callable[[str], bool] | None = None,
) -> dict[str, torch.Tensor]:
    """Floating tensors are cast to ``dtype`` (None keeps the checkpoint's); integer ones stay.

    With ``tp``, each tensor is this rank's shard: read alone from a safetensors file under its
    Hugging Face name, cut from the whole tensor otherwise (chatglm names, ``.bin`` files).

    ``only``: read just the checkpoint tensors whose names it accepts (a part of the model, as
    a weight page's restoration needs it); the completeness check is then skipped.
    """
    tp = tp or TensorParallel(config)
    files = weight_files(model_dir)
    state: dict[str, torch.Tensor] = {}
    disable = True if len(files) == 1 or only is not None else None
    for path in tqdm(files, desc="Loading weight shards", unit="shard", disable=disable):
        for name, tensor in _read_file(path, tp, only):
            for hf_name, t in _to_hf_names(name, tensor, config):
                state[hf_name] = _cast(tp.take(hf_name, t), dtype)
    if config.tie_word_embeddings and "lm_head.weight" not in state:
        state["lm_head.weight"] = state.get("model.embed_tokens.weight")
    if only is None:
        _check_complete(state, config, Path(model_dir))
    return state


def layer_of(name: str) -> int | None:
    """The decoder layer a tensor belongs to, in either naming (HF's or chatglm's); None for
    the embedding, the final norm and lm_head."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


def _read_file(
    path: Path, tp: TensorParallel, only: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    if path.suffix == ".safetensors":
        check_safetensors(path)  # a file cut short says so, naming it, before any tensor is read
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if only is not None and not only(name):
                    continue
                shard = tp.shard(name)
                if shard is None:
                    yield name, f.get_tensor(name)
                else:
                    yield name, _read_shard(f.get_slice(name), shard)
    else:
        tensors = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        yield from ((n, t) for n, t in tensors.items() if only is None or only(n))


def _read_shard(tensor_slice, shard: Shard) -> torch.Tensor:
    """Only the rows (dim 0) or columns (dim 1) of ``shard`` from the file (and its padding)."""
    if tensor_slice.get_shape()[shard.dim] != shard.full:  # not the shape the config implies
        return tensor_slice[:]
    pieces = [
        tensor_slice[a:b] if shard.dim == 0 else tensor_slice[:, a:b] for a, b in shard.ranges
    ]
    return shard.pad(torch.cat(pieces, shard.dim))


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    if dtype is None or not t.is_floating_point():
        return t
    return t.to(dtype)


def _to_hf_names(
    name: str, t: torch.Tensor, config: GlmConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    if _DROPPED.search(name):
        return
    if not name.startswith("transformer."):
        yield name, t
        return
    fused = _FUSED_QKV.match(name)
    if fused:
        yield from _split_qkv(fused.group(1), fused.group(2), t, config)
        return
    if "query_key_value" in name:
        raise ValueError(
            f"cannot convert {name}: quantized chatglm-format checkpoints are not supported; "
            f"quantize the 16-bit checkpoint instead"
        )
    for pattern, replacement in _CHATGLM_RENAMES:
        name = re.sub(pattern, replacement, name)
    yield name, t


def _split_qkv(
    layer: str, suffix: str, t: torch.Tensor, config: GlmConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    if t.shape[0] != q_size + 2 * kv_size:
        raise ValueError(
            f"{layer}.self_attention.query_key_value.{suffix} has {t.shape[0]} rows; the config "
            f"(heads {config.num_attention_heads}, kv heads {config.num_key_value_heads}, "
            f"head_dim {config.head_dim}) needs {q_size + 2 * kv_size}"
        )
    q, k, v = t.split([q_size, kv_size, kv_size], dim=0)
    prefix = layer.replace("transformer.encoder.layers.", "model.layers.")
    for proj, part in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
        yield f"{prefix}.self_attn.{proj}.{suffix}", part


def _check_complete(state: dict[str, torch.Tensor], config: GlmConfig, model_dir: Path) -> None:
    missing = [name for name in _required_names(config) if not _present(state, name)]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(
            f"checkpoint in {model_dir} is missing tensor {missing[0]}{more}; a "
            f"{config.architecture!r} model with {config.num_hidden_layers} layers needs it"
        )


def _present(state: dict[str, torch.Tensor], name: str) -> bool:
    if name.endswith(".weight") and name[: -len("weight")] + "qweight" in state:
        return True
    return state.get(name) is not None


def _required_names(config: GlmConfig) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    norms = ["input_layernorm", "post_attention_layernorm"]
    if config.architecture == "glm4":
        norms += ["post_self_attn_layernorm", "post_mlp_layernorm"]
    linears = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]
    linears += ["mlp.gate_up_proj", "mlp.down_proj"]
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}"
        names += [f"{layer}.{m}.weight" for m in norms + linears]
        if config.attention_bias:
            names += [f"{layer}.self_attn.{p}_proj.bias" for p in "qkv"]
    return names
