"""INT4 weight-only linear layers: the canonical form, the reference kernel and W4A8 emulation.

Canonical form (AWQ's asymmetric convention), per layer: ``qcodes`` uint8 [N, K] in 0..15 and
``scales``, ``zeros`` [N, K/G], with ``W[n, k] = (qcodes[n, k] - zeros[n, k//G]) * scales[n, k//G]``.
A backend turns it into whatever its kernel wants (``Device.prepare_int4``); the packed layout of
PyTorch's CPU int4 kernel is opaque and may change between torch versions, so it is made at load
time and never stored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Int4Linear:
    out_features: int
    in_features: int
    group_size: int
    abits: int = 16  # 8: each input row is quantized to int8 on the fly (W4A8)
    # the reference form (base Device)
    qcodes: torch.Tensor | None = None
    scales: torch.Tensor | None = None
    zeros: torch.Tensor | None = None
    # PyTorch's CPU int4 kernel form
    packed: torch.Tensor | None = None  # uint8 [N, K/2], opaque
    scales_and_zeros: torch.Tensor | None = None  # bf16 [K/G, N, 2]

    @property
    def nbytes(self) -> int:
        tensors = (self.qcodes, self.scales, self.zeros, self.packed, self.scales_and_zeros)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def dequantize(w: Int4Linear) -> torch.Tensor:
    """fp32 [N, K] from the reference form."""
    n, k, g = w.out_features, w.in_features, w.group_size
    codes = w.qcodes.float().view(n, k // g, g)
    return ((codes - w.zeros.float().unsqueeze(-1)) * w.scales.float().unsqueeze(-1)).view(n, k)


def quantize_activations_int8(x: torch.Tensor) -> torch.Tensor:
    """W4A8: dynamic per-token symmetric int8, returned dequantized (an exact emulation)."""
    xf = x.float()
    scale = xf.abs().amax(-1, keepdim=True).clamp(min=1e-8) / 127.0
    return (torch.round(xf / scale).clamp(-127, 127) * scale).to(x.dtype)


def int4_linear_reference(
    x: torch.Tensor, w: Int4Linear, bias: torch.Tensor | None = None
) -> torch.Tensor:
    if w.abits == 8:
        x = quantize_activations_int8(x)
    out = torch.nn.functional.linear(x.float(), dequantize(w))
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def cpu_int4_scales_and_zeros(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """[K/G, N, 2] bf16 for ``_weight_int4pack_mm_for_cpu``, whose weight is ``(q - 8) * s + z_f``.

    From the AWQ zero point ``z``: ``(q - z) * s = (q - 8) * s + (8 - z) * s``.
    """
    zero_f = (8.0 - zeros.float()) * scales.float()
    return (
        torch.stack([scales.float(), zero_f], dim=-1)
        .transpose(0, 1)
        .contiguous()
        .to(torch.bfloat16)
    )
