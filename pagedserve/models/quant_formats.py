"""INT4 weight formats: the canonical quantized linear, and the checkpoint layouts that hold it.

Canonical form (what the HAL consumes), AWQ's asymmetric convention, per linear layer:
``qcodes`` uint8 [N, K] in 0..15, ``scales`` and ``zeros`` float [N, K/G];
``W[n, k] = (qcodes[n, k] - zeros[n, k // G]) * scales[n, k // G]``.

Checkpoint layouts read by ``load_quantized_linears`` (tensor names ``{prefix}.qweight`` etc.):

- ``pagedserve-awq`` (ours, ``version`` 1): ``qweight`` uint8 [N, K/2], input column 2j in the
  low nibble and 2j+1 in the high nibble of byte j; ``qzeros`` uint8 [N, K/G] (one zero point
  per byte); ``scales`` fp16 [N, K/G]. Rows are output channels, as in a dense ``weight``.
- AutoAWQ GEMM (``quant_method: awq``, ``version: gemm``): int32 ``qweight`` [K, N/8],
  ``qzeros`` [K/G, N/8], fp16 ``scales`` [K/G, N]; 8 output columns per int32, column
  ``AWQ_ORDER[i]`` in nibble i.
- GPTQ (``quant_method: gptq``): int32 ``qweight`` [K/8, N] packed along the input, ``qzeros``
  [K/G, N/8] (``checkpoint_format`` gptq = v1 stores zero - 1; gptq_v2 stores the zero),
  ``scales`` [K/G, N], ``g_idx`` [K]. When ``g_idx`` is not ``k // G`` (``desc_act`` reorder),
  groups are not contiguous input columns and the canonical form cannot hold the layer without
  moving input channels; such a layer is dequantized and put back into the state dict as a
  dense 16-bit ``{prefix}.weight`` (a warning names it).

The quantizer includes 0 in each group's [min, max] range, so the zero point always lies in
0..15, a constant group quantizes exactly and an all-zero group gets scale 1.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

logger = logging.getLogger(__name__)

OUR_METHOD = "pagedserve-awq"
OUR_VERSION = 1
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ GEMM: nibble i holds output column AWQ_ORDER[i]
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
    "generation_config.json",
)

QuantizedLinear = tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]


# ---- the quantizer ------------------------------------------------------------------------------
def quantize_rtn(
    w: torch.Tensor, group_size: int, scale_dtype: torch.dtype = torch.float16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group-wise asymmetric 4-bit round-to-nearest. Scales are rounded to ``scale_dtype`` (the
    dtype they are stored in) before the codes are computed, returned as fp32."""
    n, k = w.shape
    check_group_size(k, group_size, "weight")
    g = w.float().reshape(n, k // group_size, group_size)
    lo = g.amin(-1).clamp(max=0.0)
    hi = g.amax(-1).clamp(min=0.0)
    scales = ((hi - lo) / 15).to(scale_dtype).float()
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    zeros = torch.round(-lo / scales).clamp(0, 15)
    q = torch.round(g / scales.unsqueeze(-1)) + zeros.unsqueeze(-1)
    return q.clamp(0, 15).to(torch.uint8).reshape(n, k), scales, zeros


def dequantize(
    qcodes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """fp32 [N, K] from the canonical form."""
    n, k = qcodes.shape
    g = qcodes.float().reshape(n, k // group_size, group_size)
    w = (g - zeros.float().unsqueeze(-1)) * scales.float().unsqueeze(-1)
    return w.reshape(n, k)


def fake_quantize(w: torch.Tensor, group_size: int) -> torch.Tensor:
    return dequantize(*quantize_rtn(w, group_size), group_size)


def check_group_size(k: int, group_size: int, what: str) -> None:
    if group_size <= 0 or k % group_size:
        raise ValueError(
            f"{what} has {k} input features, not a multiple of group_size {group_size}; "
            f"choose a group size that divides it (32, 64 or 128 usually do)"
        )


# ---- nibble packing -----------------------------------------------------------------------------
def pack_int32(codes: torch.Tensor, order: list[int] | None = None) -> torch.Tensor:
    """Pack [R, C] codes 0..15 along the last dim, 8 per int32; nibble i holds column order[i]."""
    r, c = codes.shape
    order = order or list(range(8))
    grouped = codes.to(torch.int64).reshape(r, c // 8, 8)[..., order]
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    packed = (grouped << shifts).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_int32(packed: torch.Tensor, order: list[int] | None = None) -> torch.Tensor:
    """Inverse of ``pack_int32``: [R, C/8] int32 -> [R, C] uint8."""
    order = order or list(range(8))
    shifts = torch.arange(0, 32, 4, dtype=torch.int64)
    nibbles = (packed.to(torch.int64).unsqueeze(-1) >> shifts) & 0xF
    inverse = [order.index(j) for j in range(8)]
    return nibbles[..., inverse].reshape(packed.shape[0], -1).to(torch.uint8)


def pack_uint8(codes: torch.Tensor) -> torch.Tensor:
    """Our layout: [N, K] -> [N, K/2], even column in the low nibble."""
    c = codes.to(torch.uint8)
    return c[:, 0::2] | (c[:, 1::2] << 4)


def unpack_uint8(packed: torch.Tensor) -> torch.Tensor:
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack([lo, hi], dim=-1).reshape(packed.shape[0], -1)


# ---- checkpoint -> canonical --------------------------------------------------------------------
def load_quantized_linears(
    state_dict: dict[str, torch.Tensor], quantization_config: dict
) -> dict[str, QuantizedLinear]:
    """Canonical quantized linears by prefix (e.g. ``model.layers.0.self_attn.q_proj``).

    The quantized tensors (qweight, qzeros, scales, g_idx) are popped from ``state_dict``; a
    GPTQ layer with a reordered ``g_idx`` is put back as a dense ``{prefix}.weight`` instead.
    """
    method = str(quantization_config.get("quant_method", "")).lower()
    bits = int(quantization_config.get("bits", quantization_config.get("w_bit", 4)))
    if bits != 4:
        raise ValueError(f"quantization_config bits={bits}: only 4-bit weights are supported")
    prefixes = sorted(n[: -len(".qweight")] for n in state_dict if n.endswith(".qweight"))
    readers = {OUR_METHOD: _read_ours, "awq": _read_awq, "gptq": _read_gptq}
    if method not in readers:
        raise ValueError(
            f"quant_method {method!r} is not supported; supported: {', '.join(readers)}"
        )
    out: dict[str, QuantizedLinear] = {}
    for prefix in prefixes:
        layer = readers[method](state_dict, prefix, quantization_config)
        if layer is not None:
            out[prefix] = layer
    return out


def _pop(sd: dict[str, torch.Tensor], prefix: str, name: str) -> torch.Tensor:
    key = f"{prefix}.{name}"
    if key not in sd:
        raise ValueError(f"quantized layer {prefix} has a qweight but no {name}")
    return sd.pop(key)


def _group_size(qc: dict, k: int) -> int:
    g = int(qc.get("group_size", qc.get("q_group_size", 128)))
    return k if g == -1 else g


def _read_ours(sd: dict, prefix: str, qc: dict) -> QuantizedLinear:
    version = int(qc.get("version", OUR_VERSION))
    if version != OUR_VERSION:
        raise ValueError(f"{OUR_METHOD} version {version} is not supported (this is {OUR_VERSION})")
    q = unpack_uint8(_pop(sd, prefix, "qweight"))
    g = _group_size(qc, q.shape[1])
    return q, _pop(sd, prefix, "scales").float(), _pop(sd, prefix, "qzeros").float(), g


def _read_awq(sd: dict, prefix: str, qc: dict) -> QuantizedLinear:
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"AWQ version {version!r} is not supported; only 'gemm' is")
    if not qc.get("zero_point", True):
        raise ValueError("AWQ with zero_point=false is not supported")
    q = unpack_int32(_pop(sd, prefix, "qweight"), AWQ_ORDER).t().contiguous()
    z = unpack_int32(_pop(sd, prefix, "qzeros"), AWQ_ORDER).t().float()
    s = _pop(sd, prefix, "scales").t().float()
    return q, s.contiguous(), z.contiguous(), _group_size(qc, q.shape[1])


def _read_gptq(sd: dict, prefix: str, qc: dict) -> QuantizedLinear | None:
    fmt = str(qc.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported (gptq, gptq_v2)")
    q = unpack_int32(_pop(sd, prefix, "qweight").t().contiguous()).t()  # [K, N]
    k, n = q.shape
    g = _group_size(qc, k)
    z = unpack_int32(_pop(sd, prefix, "qzeros")).float()[:, :n]  # [K/G, N]
    if fmt == "gptq":
        z = z + 1
    s = _pop(sd, prefix, "scales").float()
    g_idx = sd.pop(f"{prefix}.g_idx", None)
    trivial = torch.arange(k) // g
    if g_idx is not None and not torch.equal(g_idx.to(torch.int64), trivial):
        w = (q.float() - z[g_idx.long()]) * s[g_idx.long()]
        sd[f"{prefix}.weight"] = w.t().contiguous().to(torch.float16)
        logger.warning("%s: GPTQ g_idx is reordered (desc_act); kept as a 16-bit weight", prefix)
        return None
    return q.t().contiguous(), s.t().contiguous(), z.t().contiguous(), g


# ---- canonical -> checkpoint --------------------------------------------------------------------
def to_ours(prefix: str, layer: QuantizedLinear) -> dict[str, torch.Tensor]:
    q, s, z, _ = layer
    return {
        f"{prefix}.qweight": pack_uint8(q).contiguous(),
        f"{prefix}.qzeros": z.to(torch.uint8).contiguous(),
        f"{prefix}.scales": s.to(torch.float16).contiguous(),
    }


def to_autoawq(prefix: str, layer: QuantizedLinear) -> dict[str, torch.Tensor]:
    q, s, z, _ = layer
    if q.shape[0] % 8:
        raise ValueError(f"{prefix}: AutoAWQ packs 8 output columns per int32; N={q.shape[0]}")
    return {
        f"{prefix}.qweight": pack_int32(q.t().contiguous(), AWQ_ORDER),
        f"{prefix}.qzeros": pack_int32(z.t().contiguous(), AWQ_ORDER),
        f"{prefix}.scales": s.t().contiguous().to(torch.float16),
    }


def quantization_config_for(
    fmt: str, group_size: int, abits: int, skip_layers: list[str], method: str
) -> dict:
    common = {"bits": 4, "group_size": group_size, "zero_point": True, "abits": abits}
    common |= {"skip_layers": skip_layers, "calibration": method}
    if fmt == "autoawq":
        return {"quant_method": "awq", "version": "gemm", **common}
    if fmt == "pagedserve":
        return {"quant_method": OUR_METHOD, "version": OUR_VERSION, **common}
    raise ValueError(f"unknown output format {fmt!r}; use 'pagedserve' or 'autoawq'")


def save_quantized(
    output_dir: str | Path,
    dense: dict[str, torch.Tensor],
    quantized: dict[str, QuantizedLinear],
    config: dict,
    quantization_config: dict,
    source_dir: str | Path | None = None,
) -> Path:
    """Write config.json (with ``quantization_config``), model.safetensors and the tokenizer files
    found in ``source_dir``. ``quantization_config['quant_method']`` picks the layout."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    writer = to_autoawq if quantization_config["quant_method"] == "awq" else to_ours
    tensors = {name: t.contiguous() for name, t in dense.items()}
    for prefix, layer in tqdm(quantized.items(), desc="Packing", unit="linear"):
        tensors.update(writer(prefix, layer))
    save_file(tensors, str(output_dir / "model.safetensors"), metadata={"format": "pt"})
    config = dict(config, quantization_config=quantization_config)
    (output_dir / "config.json").write_text(json.dumps(config, indent=2))
    if source_dir is not None:
        copy_tokenizer_files(source_dir, output_dir)
    return output_dir


def copy_tokenizer_files(source_dir: str | Path, output_dir: str | Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES:
        src = Path(source_dir) / name
        if src.is_file():
            shutil.copy2(src, Path(output_dir) / name)
            copied.append(name)
    return copied
