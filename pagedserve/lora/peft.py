"""PEFT's LoRA adapter directories: ``adapter_config.json`` and ``adapter_model.safetensors`` (or
the older ``adapter_model.bin``), read, checked against the base model and cut for one
tensor-parallel rank.

Target modules come under either GLM-4 naming and land on the engine's fused layers:

| engine layer   | Hugging Face (GLM-4, GLM-4-0414)    | original chatglm checkpoint   |
|----------------|-------------------------------------|-------------------------------|
| ``qkv_proj``   | ``q_proj``, ``k_proj``, ``v_proj``  | ``query_key_value``           |
| ``o_proj``     | ``o_proj``                          | ``dense``                     |
| ``gate_up_proj`` | ``gate_up_proj``                  | ``dense_h_to_4h``             |
| ``down_proj``  | ``down_proj``                       | ``dense_4h_to_h``             |

Each layer's adapter is kept as ``x @ a @ b`` takes it: ``a`` [in, r] and ``b`` [r, out], with the
scale (``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` for rsLoRA) folded into ``b``. The three HF
attention projections of one layer are stacked: ``a`` [in, 3r] (a part per projection, zeros for
one that is not targeted) and ``b`` block-diagonal [3r, q + k + v]; chatglm's fused projection
shares one ``a``. Tensor parallelism cuts each part as its layer is cut: ``b`` by output rows for
the column-parallel layers (q, k, v, gate_up), ``a`` by input columns for the row-parallel ones
(o_proj, down_proj, whose partial outputs the layer's all-reduce sums).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from pagedserve.models.config import GlmConfig
from pagedserve.models.tensor_parallel import TensorParallel

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
TARGETS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")  # the engine's linear layers
QKV_PARTS = ("q", "k", "v")
# PEFT's target module names on a GLM-4-0414 checkpoint (HF's naming)
HF_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj")

# PEFT module (after the layer prefix) -> (engine layer, part of qkv or None)
_MODULES = {
    "self_attn.q_proj": ("qkv_proj", "q"),
    "self_attn.k_proj": ("qkv_proj", "k"),
    "self_attn.v_proj": ("qkv_proj", "v"),
    "self_attn.o_proj": ("o_proj", None),
    "mlp.gate_up_proj": ("gate_up_proj", None),
    "mlp.down_proj": ("down_proj", None),
    "self_attention.query_key_value": ("qkv_proj", "qkv"),
    "self_attention.dense": ("o_proj", None),
    "mlp.dense_h_to_4h": ("gate_up_proj", None),
    "mlp.dense_4h_to_h": ("down_proj", None),
}
_TENSOR = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.layers|transformer\.encoder\.layers)\.(\d+)\."
    r"(.+)\.lora_([AB])(?:\.default)?\.weight$"
)
_NOT_SUPPORTED = ("embed_tokens", "word_embeddings", "lm_head", "output_layer")


class LoRAAdapterError(ValueError):
    """An adapter directory that cannot serve on this base model; the message says why."""


@dataclass
class LoRALayerWeights:
    a: torch.Tensor  # [in, r]
    b: torch.Tensor  # [r, out], scaled
    parts: int = 1  # 3: HF's q, k and v stacked, r / 3 columns of ``a`` each


@dataclass
class LoRAAdapter:
    """One adapter's weights on one rank, in host memory."""

    name: str
    lora_int_id: int
    path: str
    rank: int  # the largest rank of its modules
    target_modules: list[str]  # as the adapter names them
    layers: dict[tuple[int, str], LoRALayerWeights] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for w in self.layers.values() for t in (w.a, w.b))


@dataclass
class _Module:
    """One PEFT module's tensors, whole (before the rank's cut)."""

    layer: int
    target: str
    part: str | None
    name: str  # as in the file, without the prefix
    a: torch.Tensor | None = None
    b: torch.Tensor | None = None


def load_peft_adapter(
    path: str | Path,
    config: GlmConfig,
    name: str,
    lora_int_id: int,
    max_rank: int,
    dtype: torch.dtype,
    tp: TensorParallel | None = None,
    max_rank_setting: str = "--max-lora-rank",
) -> LoRAAdapter:
    """The adapter at ``path`` for this rank of ``tp``, in ``dtype``; ``LoRAAdapterError``
    names the file and what does not fit (``max_rank_setting``: how the user raises the rank)."""
    tp = tp or TensorParallel(config)
    directory = Path(path).expanduser()
    peft = _read_config(directory)
    modules = _read_modules(directory, config)
    adapter = LoRAAdapter(name, lora_int_id, str(directory), 0, _target_names(peft, modules))
    parts: dict[tuple[int, str], list[_Module]] = {}
    for m in modules.values():
        r = _check_shapes(m, config, directory)
        if r > max_rank:
            raise LoRAAdapterError(
                f"{directory}: {m.name} has rank {r}, more than this engine's maximum LoRA rank "
                f"{max_rank}; raise it ({max_rank_setting} {_rank_setting(r)}) or use an adapter "
                f"of rank <= {max_rank}"
            )
        adapter.rank = max(adapter.rank, r)
        m.b = m.b * _scale(peft, m.name, r)
        parts.setdefault((m.layer, m.target), []).append(m)
    for key, ms in parts.items():
        adapter.layers[key] = _layer_weights(ms, config, tp, dtype)
    return adapter


def _rank_setting(rank: int) -> int:
    """The smallest of vLLM's allowed --max-lora-rank values that holds ``rank``."""
    return next((v for v in (8, 16, 32, 64, 128, 256, 320, 512) if v >= rank), rank)


def _read_config(directory: Path) -> dict:
    file = directory / CONFIG_FILE
    if not directory.is_dir():
        raise LoRAAdapterError(
            f"{directory} is not a directory; a LoRA adapter is a PEFT directory with "
            f"{CONFIG_FILE} and {WEIGHT_FILES[0]}"
        )
    if not file.is_file():
        raise LoRAAdapterError(
            f"no {CONFIG_FILE} in {directory}; a LoRA adapter is a PEFT directory with "
            f"{CONFIG_FILE} and {WEIGHT_FILES[0]} (PeftModel.save_pretrained writes both)"
        )
    try:
        peft = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LoRAAdapterError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(peft, dict):
        raise LoRAAdapterError(f"{file}: expected a JSON object")
    _check_config(peft, file)
    return peft


def _check_config(peft: dict, file: Path) -> None:
    problems = []
    if str(peft.get("peft_type", "LORA")).upper() != "LORA":
        problems.append(f"peft_type is {peft.get('peft_type')!r}; only LORA adapters serve")
    if peft.get("use_dora"):
        problems.append("use_dora is true; DoRA adapters are not supported (merge them first)")
    if peft.get("bias", "none") != "none" or peft.get("lora_bias"):
        problems.append("the adapter trains biases (bias / lora_bias); only bias 'none' serves")
    if peft.get("fan_in_fan_out"):
        problems.append("fan_in_fan_out is true, which GLM-4's linear layers never are")
    if peft.get("modules_to_save"):
        problems.append(
            f"modules_to_save {peft['modules_to_save']} replaces whole base layers, which a "
            "shared base cannot do; train the adapter without modules_to_save"
        )
    if peft.get("layer_replication"):
        problems.append("layer_replication changes the base model's layers")
    for key in ("r", "lora_alpha"):
        value = peft.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            problems.append(f"{key} must be a positive number, got {value!r}")
    if problems:
        raise LoRAAdapterError(f"{file}: {'; '.join(problems)}")


def _read_modules(directory: Path, config: GlmConfig) -> dict[str, _Module]:
    file = next((directory / f for f in WEIGHT_FILES if (directory / f).is_file()), None)
    if file is None:
        raise LoRAAdapterError(f"no {' or '.join(WEIGHT_FILES)} in {directory}")
    modules: dict[str, _Module] = {}
    for key, tensor in _read_tensors(file):
        m = _TENSOR.match(key)
        if m is None:
            raise LoRAAdapterError(_unsupported_tensor(file, key))
        layer, module, side = int(m.group(1)), m.group(2), m.group(3)
        if module not in _MODULES:
            raise LoRAAdapterError(
                f"{file}: {key} adapts {module!r}, which is not a GLM-4 linear layer; targets "
                f"are {', '.join(sorted(_MODULES))}"
            )
        if layer >= config.num_hidden_layers:
            raise LoRAAdapterError(
                f"{file}: {key} adapts layer {layer}, but the base model has "
                f"{config.num_hidden_layers} layers; is this adapter for another model?"
            )
        target, part = _MODULES[module]
        name = f"layers.{layer}.{module}"
        entry = modules.setdefault(name, _Module(layer, target, part, name))
        setattr(entry, side.lower(), tensor.float())
    if not modules:
        raise LoRAAdapterError(f"{file} holds no LoRA weights (no *.lora_A.weight tensors)")
    for entry in modules.values():
        if entry.a is None or entry.b is None:
            side = "lora_A" if entry.a is None else "lora_B"
            raise LoRAAdapterError(f"{file}: {entry.name} has no {side}.weight")
    return modules


def _read_tensors(file: Path):
    try:
        if file.suffix == ".safetensors":
            with safe_open(str(file), framework="pt") as f:
                return [(k, f.get_tensor(k)) for k in f.keys()]
        return list(torch.load(file, map_location="cpu", weights_only=True).items())
    except Exception as e:  # noqa: BLE001 - a damaged file, whatever the library raised
        raise LoRAAdapterError(f"{file} cannot be read: {e}") from None


def _unsupported_tensor(file: Path, key: str) -> str:
    if any(n in key for n in _NOT_SUPPORTED):
        return (
            f"{file}: {key}: LoRA on the embeddings and lm_head is not supported; train the "
            "adapter on the decoder's linear layers only"
        )
    return f"{file}: {key} is not a LoRA weight of a GLM-4 decoder layer"


def _target_names(peft: dict, modules: dict[str, _Module]) -> list[str]:
    targets = peft.get("target_modules")
    if isinstance(targets, list):
        return sorted(str(t) for t in targets)
    return sorted({m.name.rsplit(".", 1)[-1] for m in modules.values()})


def _expected_shapes(m: _Module, config: GlmConfig) -> tuple[int, int]:
    """(in, out) of the base layer a module adapts, whole."""
    c, D = config, config.head_dim
    q, kv = c.num_attention_heads * D, c.num_key_value_heads * D
    return {
        ("qkv_proj", "q"): (c.hidden_size, q),
        ("qkv_proj", "k"): (c.hidden_size, kv),
        ("qkv_proj", "v"): (c.hidden_size, kv),
        ("qkv_proj", "qkv"): (c.hidden_size, q + 2 * kv),
        ("o_proj", None): (q, c.hidden_size),
        ("gate_up_proj", None): (c.hidden_size, 2 * c.intermediate_size),
        ("down_proj", None): (c.intermediate_size, c.hidden_size),
    }[(m.target, m.part)]


def _check_shapes(m: _Module, config: GlmConfig, directory: Path) -> int:
    """The module's rank, once its shapes fit the base layer."""
    fan_in, fan_out = _expected_shapes(m, config)
    r = m.a.shape[0]
    if m.a.dim() != 2 or m.b.dim() != 2 or m.b.shape[1] != r:
        raise LoRAAdapterError(
            f"{directory}: {m.name}: lora_A {list(m.a.shape)} and lora_B {list(m.b.shape)} "
            "are not [r, in] and [out, r] of one rank r"
        )
    if m.a.shape[1] != fan_in or m.b.shape[0] != fan_out:
        raise LoRAAdapterError(
            f"{directory}: {m.name}: lora_A {list(m.a.shape)} and lora_B {list(m.b.shape)} do "
            f"not fit the base layer ({fan_in} inputs, {fan_out} outputs: lora_A [{r}, "
            f"{fan_in}], lora_B [{fan_out}, {r}]); is this adapter for another model?"
        )
    return r


def _scale(peft: dict, module: str, r: int) -> float:
    """PEFT's scaling: ``lora_alpha / r``, or ``/ sqrt(r)`` with ``use_rslora``; ``alpha_pattern``
    overrides alpha for the modules it matches (PEFT's rule: the key matches the name's end)."""
    alpha = peft["lora_alpha"]
    for key, value in (peft.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            alpha = value
            break
    return alpha / (math.sqrt(r) if peft.get("use_rslora") else r)


def _layer_weights(
    ms: list[_Module], config: GlmConfig, tp: TensorParallel, dtype: torch.dtype
) -> LoRALayerWeights:
    """One engine layer's ``a`` and ``b`` on this rank (see the module docstring)."""
    target, layer = ms[0].target, ms[0].layer
    prefix = f"model.layers.{layer}."
    if target != "qkv_proj":
        m = ms[0]
        hf = {"o_proj": "self_attn.o_proj", "gate_up_proj": "mlp.gate_up_proj"}
        hf_name = prefix + hf.get(target, "mlp.down_proj") + ".weight"
        a, b = m.a, m.b
        if target in ("o_proj", "down_proj"):
            a = tp.take(hf_name, a)  # row-parallel: the rank's input columns
        else:
            b = tp.take(hf_name, b)  # column-parallel: the rank's output rows
        return LoRALayerWeights(a.t().to(dtype).contiguous(), b.t().to(dtype).contiguous())
    by_part = {m.part: m for m in ms}
    if "qkv" in by_part and len(by_part) > 1:
        raise LoRAAdapterError(
            f"layer {layer} adapts query_key_value and q/k/v_proj at once; use one naming"
        )
    if "qkv" in by_part:
        return _fused_qkv(by_part["qkv"], config, tp, dtype, prefix)
    return _split_qkv(by_part, config, tp, dtype, prefix)


def _qkv_sizes(config: GlmConfig) -> list[int]:
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    return [q, kv, kv]


def _fused_qkv(m: _Module, config, tp, dtype, prefix: str) -> LoRALayerWeights:
    """chatglm's ``query_key_value``: one ``a``, ``b``'s rows cut as q, k and v each are."""
    pieces = m.b.split(_qkv_sizes(config))
    b = torch.cat(
        [tp.take(f"{prefix}self_attn.{p}_proj.weight", t) for p, t in zip(QKV_PARTS, pieces)]
    )
    return LoRALayerWeights(m.a.t().to(dtype).contiguous(), b.t().to(dtype).contiguous())


def _rows_on_rank(tp: TensorParallel, name: str, full: int) -> int:
    shard = tp.shard(name)
    return full if shard is None else sum(b - a for a, b in shard.ranges) + shard.padding


def _split_qkv(by_part: dict, config, tp, dtype, prefix: str) -> LoRALayerWeights:
    """HF's q/k/v_proj: the parts' ``a`` side by side, ``b`` block-diagonal (zeros for a part
    that is not adapted, so every layer has the same layout)."""
    r = max(m.a.shape[0] for m in by_part.values())
    full = dict(zip(QKV_PARTS, _qkv_sizes(config)))
    outs = {p: _rows_on_rank(tp, f"{prefix}self_attn.{p}_proj.weight", full[p]) for p in QKV_PARTS}
    a = torch.zeros(config.hidden_size, 3 * r)
    b = torch.zeros(3 * r, sum(outs.values()))
    row = 0
    for i, p in enumerate(QKV_PARTS):
        m = by_part.get(p)
        if m is not None:
            rank = m.a.shape[0]
            a[:, i * r : i * r + rank] = m.a.t()
            b_part = tp.take(f"{prefix}self_attn.{p}_proj.weight", m.b)
            b[i * r : i * r + rank, row : row + outs[p]] = b_part.t()
        row += outs[p]
    return LoRALayerWeights(a.to(dtype), b.to(dtype), parts=3)


def random_adapter_tensors(
    config: dict,
    rank: int,
    generator: torch.Generator,
    b_std: float,
    targets: tuple[str, ...] = HF_TARGETS,
) -> dict[str, torch.Tensor]:
    """PEFT's tensors (bf16, HF's GLM-4-0414 names) of a random rank-``rank`` adapter on the
    ``targets`` of every layer of a model with ``config`` (config.json's fields): A ~ N(0, 1/in),
    B ~ N(0, b_std^2), drawn module by module in HF's order. It teaches the model nothing: the
    demo adapter (``tools/make_demo_lora.py``) and the benchmarks' adapters; the tests build
    theirs with PEFT itself."""
    h, inter, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    shapes = {
        "self_attn.q_proj": (h, q),
        "self_attn.k_proj": (h, kv),
        "self_attn.v_proj": (h, kv),
        "self_attn.o_proj": (q, h),
        "mlp.gate_up_proj": (h, 2 * inter),
        "mlp.down_proj": (inter, h),
    }
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (fan_in, fan_out) in shapes.items():
            if module.rsplit(".", 1)[1] not in targets:
                continue
            name = f"base_model.model.model.layers.{layer}.{module}"
            a = torch.randn(rank, fan_in, generator=generator) / fan_in**0.5
            b = torch.randn(fan_out, rank, generator=generator) * b_std
            tensors[f"{name}.lora_A.weight"] = a.to(torch.bfloat16)
            tensors[f"{name}.lora_B.weight"] = b.to(torch.bfloat16)
    return tensors
