"""INT8 weight-only linear layers (symmetric, one scale per output channel), for lm_head.

``W[n, k] = qweight[n, k] * scales[n]``. The CPU backends run it through PyTorch's
``_weight_int8pack_mm``; the reference dequantizes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Int8Linear:
    out_features: int
    in_features: int
    qweight: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # [N], in the activations' dtype

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales))


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric round-to-nearest: (int8 codes [N, K], fp32 scales [N])."""
    wf = w.float()
    scales = (wf.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    codes = torch.round(wf / scales.unsqueeze(1)).clamp(-127, 127).to(torch.int8)
    return codes, scales


def int8_linear_reference(
    x: torch.Tensor, w: Int8Linear, bias: torch.Tensor | None = None
) -> torch.Tensor:
    out = torch.nn.functional.linear(x.float(), w.qweight.float() * w.scales.float().unsqueeze(1))
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
