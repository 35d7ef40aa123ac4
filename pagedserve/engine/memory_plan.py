"""The memory plan behind ``pagedserve tune``: the weights, the KV cache and the batch limits of a
model on a device, worked out before anything is loaded, by the rules ``pagedserve serve`` then
sizes itself by. The model's shapes are read by the engine's own parser (``models/config.py``), the
device's cards and memory by the HAL's (``hal/device_preset.py``), a token's KV bytes come from the
formula the engine sizes its pages by (``GlmConfig.kv_bytes_per_token``), and the pool from the
rule the HAL allocates it by (``kv_pool_limits``). No torch here.

All figures are per tensor-parallel rank, in bytes:

- weights: every parameter counted, as the weight tier holds them. Embeddings, lm_head, norms and
  biases stay 16-bit. With ``--quantization int4`` every q/k/v/o, gate_up and down projection
  costs 0.5 byte per weight plus one 16-bit scale and one zero point per group of
  ``--quant-group-size`` inputs per output. The zero point takes what the device's kernels pack:
  one byte in the avx512 and avx2 CPU kernels' tiles, which a device in host memory runs on a CPU
  that has them (``hal/cpu_targets.py``, by the CPU's flags); two elsewhere (PyTorch's layout,
  as a checkpoint stores them): 0.594 or 0.625 byte per weight at group 32. Tensor parallelism
  splits q/o and the MLP by ``tp``, k/v by kv head (replicated when ``tp`` exceeds the kv heads,
  as vLLM does), and the vocabulary of embed_tokens and lm_head (vocab-parallel, padded as
  ``models/tensor_parallel.py`` pads it); norms are replicated. They must fit the card's weight
  tier.
- KV cache per token: ``2 x layers x kv_heads_per_rank x head_dim x kv_dtype_bytes``. GLM-4-9B in
  bf16: 40 KiB, so a 131072-token sequence needs 5.00 GiB (the Kunlun XPU deployment guide's
  KV-cache formula gave about 4.6 GB; that figure is too low). With ``--kv-cache-dtype int8`` a
  head costs ``head_dim + 4`` bytes (its int8 codes and an fp32 scale): GLM-4-9B 20.6 KiB a token.
- LoRA (``--enable-lora``): ``--max-loras`` device slots in the weight tier beside the weights,
  each ``(in + out) x rank`` per target and layer in the 16-bit dtype (``lora/sizes.py``, the
  rule the engine allocates them by; q/k/v stack three ranks); the pool is planned after them.
- the KV pool: the least of the KV tier, ``memory x gpu_memory_utilization - weights`` on a card
  whose tiers share one HBM (``memory_bytes``), and, on a device in host memory (``cpu``,
  ``kunlun-emu``), half this machine's free RAM. Activations are not budgeted: the engine does not
  take them from the device's tiers.
- KV pages: ``floor(pool / (block_size x kv_bytes_per_token))``; the concurrency they allow at
  ``max_model_len`` is ``pages x block_size / max_model_len`` (what ``serve`` logs at start-up),
  and ``max_num_seqs = min(256, max_num_batched_tokens, pages // ceil(max_model_len /
  block_size))``.
- ``max_num_batched_tokens`` defaults to 2048 (vLLM v1's API-server default, with chunked prefill);
  ``max_num_seqs`` never exceeds it, so every running sequence can decode in one step.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import dataclass
from pathlib import Path

import yaml

from pagedserve.config import KV_CACHE_DTYPES, DeviceConfig, SchedulerConfig
from pagedserve.hal.cpu_targets import int4_zero_point_bytes as cpu_int4_zero_point_bytes
from pagedserve.hal.device_preset import (
    DevicePreset,
    host_memory_limit,
    kv_pool_limits,
    load_device_preset,
)
from pagedserve.hal.memory import format_bytes
from pagedserve.lora.sizes import slots_nbytes
from pagedserve.models.config import GlmConfig, load_config, pad_vocab_size
from pagedserve.presets import DEMO_MODEL, DEMO_MODEL_PRESET, find_preset, preset_names

MAX_NUM_SEQS_CAP = 256
DEFAULT_MAX_NUM_BATCHED_TOKENS = SchedulerConfig.model_fields["max_num_batched_tokens"].default
DEFAULT_DEVICE = DeviceConfig.model_fields["device"].default  # serve's --device
KV_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
SERVE_DTYPE = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


class TuneError(ValueError):
    """A setting that cannot work, with the reason and the way out."""


@dataclass(slots=True)
class TuneResult:
    model: str
    model_arg: str
    served_model_name: str
    device: str
    device_arg: str
    tensor_parallel_size: int
    quantization: str
    quant_group_size: int
    quant_zero_point_bytes: int  # a row's zero point per INT4 group, as the kernels pack it
    kv_dtype: str
    kv_cache_dtype: str
    block_size: int
    max_model_len: int
    gpu_memory_utilization: float
    memory_bytes: int
    weight_bytes: int
    weight_bytes_16bit: int
    weight_bytes_linear: int
    kv_bytes_per_token: int
    kv_bytes_per_seq: int
    kv_pool_limits: dict[str, int]  # each bound on the pool's bytes ("kv tier", ...)
    kv_pool_bound: str  # the one that sets the pool
    kv_pool_bytes: int
    num_kv_pages: int
    max_concurrency: float  # max_model_len sequences the pages hold, as serve logs it
    pages_per_seq: int
    max_num_seqs: int
    max_num_batched_tokens: int
    # LoRA: the device slots' bytes per card (0: LoRA off), beside the weights in their tier
    max_loras: int = 0
    max_lora_rank: int = 0
    lora_bytes: int = 0  # included in weight_bytes: the slots sit in the weight tier
    launch_script: str = ""


def load_model(spec: str) -> tuple[str, GlmConfig]:
    """(name, shapes) of a model preset name, a preset YAML file, or a checkpoint directory with
    config.json, read by the engine's own config parser."""
    path = Path(spec)
    try:
        if (path / "config.json").is_file():
            return path.name, load_config(path)
        preset = find_preset("models", spec)
        if preset is None:
            raise TuneError(
                f"--model {spec!r} is neither a directory with config.json nor a preset; "
                f"presets: {', '.join(preset_names('models'))}"
            )
        fields = yaml.safe_load(preset.read_text())
        config = GlmConfig.from_dict({**fields, "model_type": fields["architecture"]})
    except TuneError:
        raise
    except ValueError as e:
        raise TuneError(f"--model {spec}: {e}") from None
    return fields.get("name", preset.stem), config


def load_device(spec: str) -> DevicePreset:
    """The HAL's own preset of ``--device``."""
    try:
        return load_device_preset(spec)
    except ValueError as e:
        raise TuneError(str(e)) from None


def card_memory_bytes(device: DevicePreset) -> int:
    """One card's memory: the HBM its kv and weight tiers share, else the two tiers together."""
    return device.memory_bytes or device.tiers["kv"] + device.tiers["weight"]


# ---- tensor-parallel shapes


def check_tensor_parallel(name: str, model: GlmConfig, tp: int) -> None:
    heads, kv = model.num_attention_heads, model.num_key_value_heads
    if tp < 1:
        raise TuneError(f"--tensor-parallel-size {tp} must be at least 1")
    if heads % tp:
        raise TuneError(
            f"--tensor-parallel-size {tp} does not divide the {heads} attention heads "
            f"of {name}; use a divisor of {heads}"
        )
    if kv % tp and tp % kv:
        raise TuneError(
            f"--tensor-parallel-size {tp} and the {kv} kv heads of {name} "
            "neither divide the other; kv heads cannot be split or replicated evenly"
        )
    if model.intermediate_size % tp:
        raise TuneError(
            f"--tensor-parallel-size {tp} does not divide intermediate_size "
            f"{model.intermediate_size} of {name}"
        )


def linear_shapes(model: GlmConfig, tp: int) -> list[tuple[int, int]]:
    """(in_features, out_features) per rank of one layer's q, k, v, o, gate_up and down."""
    hidden, inter = model.hidden_size, model.intermediate_size // tp
    q_out = model.num_attention_heads * model.head_dim // tp
    kv_out = model.num_kv_heads_per_rank(tp) * model.head_dim
    return [
        (hidden, q_out),
        (hidden, kv_out),
        (hidden, kv_out),
        (q_out, hidden),
        (hidden, 2 * inter),
        (inter, hidden),
    ]


# ---- the three sizes


def int4_zero_point_bytes(device: DevicePreset) -> int:
    """A row's INT4 zero point per group on ``device``: what this machine's CPU kernels pack for a
    device in host memory (``cpu``, the ``kunlun-emu`` cards), 16 bits elsewhere (as a checkpoint
    stores it)."""
    return cpu_int4_zero_point_bytes() if device.in_host_memory else 2


def linear_bytes(
    in_features: int,
    out_features: int,
    quantization: str,
    group_size: int,
    dtype_bytes: int,
    zero_point_bytes: int = 2,
) -> int:
    if quantization == "none":
        return in_features * out_features * dtype_bytes
    if in_features % group_size:
        raise TuneError(
            f"a projection with {in_features} inputs per rank is not a multiple of "
            f"--quant-group-size {group_size}; pick a group size that divides it "
            "(32, 64 or 128) or another --tensor-parallel-size"
        )
    per_group = 2 + zero_point_bytes  # a 16-bit scale and the zero point, per output
    return in_features * out_features // 2 + (in_features // group_size) * out_features * per_group


def weight_bytes(
    model: GlmConfig,
    tp: int,
    quantization: str,
    group_size: int,
    dtype_bytes: int = 2,
    zero_point_bytes: int = 2,
) -> tuple[int, int]:
    """(16-bit bytes: embeddings, lm_head, norms, biases; linear bytes) per rank."""
    hidden, vocab_rank = model.hidden_size, pad_vocab_size(model.vocab_size, tp) // tp
    norms_per_layer = 4 if model.architecture == "glm4" else 2
    shapes = linear_shapes(model, tp)
    bias = sum(out for _, out in shapes[:3]) if model.attention_bias else 0
    per_layer_16 = norms_per_layer * hidden + bias
    embeddings = vocab_rank * hidden * (1 if model.tie_word_embeddings else 2)
    params_16 = embeddings + hidden + model.num_hidden_layers * per_layer_16
    per_layer_linear = sum(
        linear_bytes(k, n, quantization, group_size, dtype_bytes, zero_point_bytes)
        for k, n in shapes
    )
    return params_16 * dtype_bytes, model.num_hidden_layers * per_layer_linear


# ---- the tuner


def _smallest_fitting_tp(
    model: GlmConfig,
    device: DevicePreset,
    quantization: str,
    group_size: int,
    dtype_bytes: int,
    zero_point_bytes: int,
) -> int | None:
    """The fewest cards (within the node) whose share of the weights each card holds."""
    for tp in range(2, (device.cards or 64) + 1):
        try:
            check_tensor_parallel("", model, tp)
            weights = sum(
                weight_bytes(model, tp, quantization, group_size, dtype_bytes, zero_point_bytes)
            )
        except TuneError:
            continue
        if _weights_fit(device, weights, 1.0):
            return tp
    return None


def _weights_fit(device: DevicePreset, weights: int, utilization: float) -> bool:
    """Whether the weight tier holds them and the card keeps room for KV pages after them."""
    tier = device.tiers["weight"]
    room = kv_pool_limits(device, weights, utilization)
    return (not tier or weights <= tier) and min(room.values()) > 0


def _host_limit(device: DevicePreset, given: float | None) -> float:
    if not device.in_host_memory:
        return float("inf")
    return host_memory_limit() if given is None else given


def tune(
    model_arg: str,
    device_arg: str = DEFAULT_DEVICE,
    tensor_parallel_size: int = 1,
    max_model_len: int | None = None,
    gpu_memory_utilization: float = 0.9,
    quantization: str = "int4",
    kv_dtype: str = "bf16",
    block_size: int = 16,
    quant_group_size: int = 32,
    max_num_batched_tokens: int | None = None,
    kv_cache_dtype: str = "auto",
    host_limit: float | None = None,
    max_loras: int = 0,
    max_lora_rank: int = 16,
) -> TuneResult:
    """The plan ``serve`` would start with. ``host_limit``: the bytes an emulated pool may take
    from this machine (default: half its free RAM, as ``serve`` reads it); ``max_loras`` > 0:
    with ``--enable-lora``, that many adapter slots of ``max_lora_rank``."""
    (name, model), device = load_model(model_arg), load_device(device_arg)
    tp = tensor_parallel_size
    check_tensor_parallel(name, model, tp)
    if device.cards is not None and tp > device.cards:
        raise TuneError(
            f"--tensor-parallel-size {tp} asks for more cards than {device.name} has: "
            f"{device.cards} per node; use {device.cards} or less"
        )
    max_model_len = max_model_len or model.max_position_embeddings
    if max_model_len > model.max_position_embeddings:
        raise TuneError(
            f"--max-model-len {max_model_len} is beyond {name}'s context of "
            f"{model.max_position_embeddings} tokens; use at most that"
        )
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise TuneError(f"--gpu-memory-utilization {gpu_memory_utilization} must be in (0, 1]")
    if block_size < 1 or max_model_len < 1:
        raise TuneError("--block-size and --max-model-len must be positive")
    if quantization not in ("int4", "none") or kv_dtype not in KV_DTYPE_BYTES:
        raise TuneError(
            f"--quantization must be int4 or none; --kv-dtype one of {', '.join(KV_DTYPE_BYTES)}"
        )
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise TuneError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}")
    dtype_bytes = KV_DTYPE_BYTES[kv_dtype]
    batched = max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
    zero_bytes = int4_zero_point_bytes(device)
    w16, wlin = weight_bytes(model, tp, quantization, quant_group_size, dtype_bytes, zero_bytes)
    if max_loras < 0 or max_lora_rank < 1:
        raise TuneError("--max-loras and --max-lora-rank must be positive")
    lora = slots_nbytes(model, tp, max_loras, max_lora_rank, dtype_bytes) if max_loras else 0
    weights = w16 + wlin + lora
    if not _weights_fit(device, weights, gpu_memory_utilization):
        fewest = _smallest_fitting_tp(
            model, device, quantization, quant_group_size, dtype_bytes, zero_bytes
        )
        raise _weights_do_not_fit(name, device, weights, gpu_memory_utilization, tp, fewest)
    per_token = model.kv_bytes_per_token(
        model.num_kv_heads_per_rank(tp), dtype_bytes, kv_cache_dtype
    )
    limits = kv_pool_limits(
        device, weights, gpu_memory_utilization, host_limit=_host_limit(device, host_limit)
    )
    bound = min(limits, key=limits.__getitem__)
    pool = int(limits[bound])
    num_pages = pool // (block_size * per_token)
    pages_per_seq = math.ceil(max_model_len / block_size)
    max_num_seqs = min(MAX_NUM_SEQS_CAP, batched, num_pages // pages_per_seq)
    if max_num_seqs == 0:
        needed = pages_per_seq * block_size * per_token
        advice = (
            "free memory on this machine, whose RAM holds the emulated pool, or lower "
            "--max-model-len"
            if bound == "host memory"
            else "lower --max-model-len, raise --gpu-memory-utilization or --tensor-parallel-size"
        )
        raise TuneError(
            f"not even one sequence of --max-model-len {max_model_len} fits: it needs "
            f"{format_bytes(needed)} of KV cache, the pool gets {format_bytes(pool)} (set by "
            f"the {bound}; {format_bytes(needed - pool)} missing); {advice}"
        )
    result = TuneResult(
        model=name,
        model_arg=model_arg,
        served_model_name=_served_name(model_arg, name),
        device=device.name,
        device_arg=device_arg,
        tensor_parallel_size=tp,
        quantization=quantization,
        quant_group_size=quant_group_size,
        quant_zero_point_bytes=zero_bytes,
        kv_dtype=kv_dtype,
        kv_cache_dtype=kv_cache_dtype,
        block_size=block_size,
        max_model_len=max_model_len,
        gpu_memory_utilization=gpu_memory_utilization,
        memory_bytes=card_memory_bytes(device),
        weight_bytes=weights,
        weight_bytes_16bit=w16,
        weight_bytes_linear=wlin,
        kv_bytes_per_token=per_token,
        kv_bytes_per_seq=per_token * max_model_len,
        kv_pool_limits={k: int(v) for k, v in limits.items()},
        kv_pool_bound=bound,
        kv_pool_bytes=pool,
        num_kv_pages=num_pages,
        max_concurrency=num_pages * block_size / max_model_len,
        pages_per_seq=pages_per_seq,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=batched,
        max_loras=max_loras,
        max_lora_rank=max_lora_rank if max_loras else 0,
        lora_bytes=lora,
    )
    result.launch_script = launch_script(result)
    return result


def _weights_do_not_fit(
    name: str, device: DevicePreset, weights: int, utilization: float, tp: int, fewest: int | None
) -> TuneError:
    advice = f"use --tensor-parallel-size {fewest}" if fewest else "raise --tensor-parallel-size"
    tier = device.tiers["weight"] or math.inf
    room = min(tier, device.memory_bytes * utilization or math.inf)
    return TuneError(
        f"the weights do not fit: {name} needs {format_bytes(weights)} of weights per rank at "
        f"--tensor-parallel-size {tp}, and one card of {device.name} holds "
        f"{format_bytes(int(room))} of weights with KV pages beside them; {advice}, use "
        "--quantization int4, or pick a larger device"
    )


def _served_name(model_arg: str, name: str) -> str:
    """The model name the launch script serves: ``demo`` for the demo model, as the README's
    requests send it; the directory's or the preset's name otherwise."""
    return DEMO_MODEL if model_arg in (DEMO_MODEL, DEMO_MODEL_PRESET) else name


# ---- output


def _serve_model(result: TuneResult) -> str:
    """What the launch script passes to ``serve --model``."""
    if result.model_arg in (DEMO_MODEL, DEMO_MODEL_PRESET):
        return DEMO_MODEL  # built in
    if Path(result.model_arg).is_dir():
        return str(Path(result.model_arg).resolve())
    return "${MODEL_DIR:?set MODEL_DIR}"


def _serve_device(result: TuneResult) -> str:
    """What the launch script passes to ``serve --device``: the preset's name, or its file."""
    path = Path(result.device_arg)
    return str(path.resolve()) if path.is_file() else result.device


def serve_args(result: TuneResult) -> list[str]:
    model = _serve_model(result)
    args = [
        "--model",
        model,
        "--served-model-name",
        result.served_model_name,
        "--device",
        _serve_device(result),
        "--dtype",
        SERVE_DTYPE[result.kv_dtype],
        "--tensor-parallel-size",
        str(result.tensor_parallel_size),
        "--max-model-len",
        str(result.max_model_len),
        "--gpu-memory-utilization",
        str(result.gpu_memory_utilization),
        "--block-size",
        str(result.block_size),
        "--max-num-seqs",
        str(result.max_num_seqs),
        "--max-num-batched-tokens",
        str(result.max_num_batched_tokens),
    ]
    if result.quantization == "int4":
        args += ["--quantization", "int4"]
    if result.kv_cache_dtype != "auto":
        args += ["--kv-cache-dtype", result.kv_cache_dtype]
    if result.max_loras:
        args += ["--enable-lora", "--max-loras", str(result.max_loras)]
        args += ["--max-lora-rank", str(result.max_lora_rank)]
    return args


def launch_script(result: TuneResult) -> str:
    quoted = [a if a.startswith("${") else shlex.quote(a) for a in serve_args(result)]
    quoted = [f'"{a}"' if a.startswith("${") else a for a in quoted]
    lines = [
        "#!/usr/bin/env bash",
        f"# pagedserve tune: {result.model} on {result.device}, "
        f"tp={result.tensor_parallel_size}, {result.quantization} weights, "
        f"{result.num_kv_pages} KV pages",
        "set -euo pipefail",
    ]
    if _serve_model(result).startswith("${"):
        lines.append(f"# MODEL_DIR: the local checkpoint directory of {result.model}")
    lines.append(
        "exec pagedserve serve \\\n  " + " \\\n  ".join(_flag_lines(quoted)) + ' \\\n  "$@"'
    )
    return "\n".join(lines) + "\n"


def _flag_lines(args: list[str]) -> list[str]:
    """A flag and its value on one line; a flag without one (``--enable-lora``) alone."""
    lines: list[str] = []
    for arg in args:
        if lines and not arg.startswith("--") and " " not in lines[-1]:
            lines[-1] += " " + arg
        else:
            lines.append(arg)
    return lines


POOL_BOUNDS = {
    "kv tier": "the preset's kv tier",
    "memory budget": "memory x gpu_memory_utilization - weights",
    "host memory": "half this machine's free RAM (the device lives in host memory)",
}


def _kv_formula(r: TuneResult) -> str:
    if r.kv_cache_dtype == "int8":
        return "2 x layers x kv_heads/rank x (head_dim + 4) B (int8 codes + an fp32 scale)"
    return f"2 x layers x kv_heads/rank x head_dim x {KV_DTYPE_BYTES[r.kv_dtype]} B ({r.kv_dtype})"


def explain(result: TuneResult) -> str:
    r, size = result, format_bytes
    linear = (
        f"0.5 B/weight + a 2 B scale and a {r.quant_zero_point_bytes} B zero point per group "
        f"of {r.quant_group_size}"
        if r.quantization == "int4"
        else "16-bit"
    )
    rows = [
        ("device memory", size(r.memory_bytes), f"{r.device}: one card's memory"),
        (
            "weights (16-bit part)",
            size(r.weight_bytes_16bit),
            "embed_tokens + lm_head (vocab-parallel), norms, qkv bias",
        ),
        (
            "weights (linear part)",
            size(r.weight_bytes_linear),
            f"q/k/v/o, gate_up, down split over tp={r.tensor_parallel_size}: {linear}",
        ),
        *(
            [
                (
                    "LoRA device slots",
                    size(r.lora_bytes),
                    f"{r.max_loras} adapters of rank <= {r.max_lora_rank}: (in + out) x rank "
                    "per target and layer, 16-bit",
                )
            ]
            if r.max_loras
            else []
        ),
        (
            "weights + LoRA slots" if r.max_loras else "weights per rank",
            size(r.weight_bytes),
            f"{r.weight_bytes} bytes"
            + (" per rank, the weight tier's share" if r.max_loras else ""),
        ),
        ("KV bytes per token", f"{r.kv_bytes_per_token} B", _kv_formula(r)),
        (
            "KV per max-model-len seq",
            size(r.kv_bytes_per_seq),
            f"{r.max_model_len} tokens x KV bytes per token",
        ),
        *(
            (
                f"KV pool bound: {name}",
                size(limit),
                POOL_BOUNDS[name] + (" <- the pool" if name == r.kv_pool_bound else ""),
            )
            for name, limit in r.kv_pool_limits.items()
        ),
        (
            "num KV pages",
            str(r.num_kv_pages),
            f"floor(pool / ({r.block_size} x KV bytes per token))",
        ),
        (
            "max concurrency",
            f"{r.max_concurrency:.2f}x",
            "pages x block_size / max_model_len: full-length sequences at once",
        ),
        ("pages per sequence", str(r.pages_per_seq), "ceil(max_model_len / block_size)"),
        ("--max-num-seqs", str(r.max_num_seqs), "min(256, batched tokens, pages // pages per seq)"),
        (
            "--max-num-batched-tokens",
            str(r.max_num_batched_tokens),
            "2048 unless given (chunked prefill); >= max_num_seqs",
        ),
    ]
    width = [max(len(row[i]) for row in rows) for i in range(2)]
    kv = "int8" if r.kv_cache_dtype == "int8" else r.kv_dtype
    head = (
        f"{r.model} on {r.device}: tp={r.tensor_parallel_size}, {r.quantization}, "
        f"kv {kv}, block {r.block_size}, max_model_len {r.max_model_len}"
    )
    body = [f"{a:<{width[0]}}  {b:>{width[1]}}  {c}" for a, b, c in rows]
    return "\n".join([head, "-" * len(head), *body, _fits_line(r)])


def _fits_line(r: TuneResult) -> str:
    cards = f"{r.tensor_parallel_size} cards" if r.tensor_parallel_size > 1 else "one card"
    line = (
        f"fits on {cards} of {r.device}: {format_bytes(r.weight_bytes)} of weights and "
        f"{r.num_kv_pages} KV pages on each"
    )
    if r.kv_pool_bound == "host memory":
        card = min(v for k, v in r.kv_pool_limits.items() if k != "host memory")
        pages = card // (r.block_size * r.kv_bytes_per_token)
        line += f"; this machine's RAM sets the pool: the card alone would hold {pages} pages"
    return line
