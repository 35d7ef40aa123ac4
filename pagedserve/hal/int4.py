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
    abits: int = 16  # 8: each input is quantized to int8 on the fly, per block of 32 (W4A8)
    # the reference form (base Device)
    qcodes: torch.Tensor | None = None
    scales: torch.Tensor | None = None
    zeros: torch.Tensor | None = None
    # a backend kernel's packed form: which kernel, its codes, and its scales and zeros
    # "aten": _weight_int4pack_mm_for_cpu; one of PACKERS: a native target's (tiles16* for
    # avx512, tiles8* for avx2; *_a8: int8 activations, W4A8)
    layout: str = "reference"
    packed: torch.Tensor | None = None  # aten: uint8 [N, K/2], opaque; tiles<R>*: [N/R, K/8, 4R]
    scales_and_zeros: torch.Tensor | None = None  # aten: bf16 [K/G, N, 2]; tiles: bytes (below)

    @property
    def nbytes(self) -> int:
        tensors = (self.qcodes, self.scales, self.zeros, self.packed, self.scales_and_zeros)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def dequantize(w: Int4Linear) -> torch.Tensor:
    """fp32 [N, K] from the reference form."""
    n, k, g = w.out_features, w.in_features, w.group_size
    codes = w.qcodes.float().view(n, k // g, g)
    return ((codes - w.zeros.float().unsqueeze(-1)) * w.scales.float().unsqueeze(-1)).view(n, k)


# W4A8's activations are int8 in blocks of this many values of a row, each with its own scale
# (llama.cpp's Q8_0): a group of the weights is one or more whole blocks.
ACTIVATION_BLOCK = 32


def quantize_activations_int8(x: torch.Tensor) -> torch.Tensor:
    """W4A8: dynamic symmetric int8 per block of ``ACTIVATION_BLOCK`` values of each row
    (``round(x / scale)``, ``scale = max(|x|, 1e-8) / 127`` over the block), returned
    dequantized (an exact emulation of what the kernels multiply). A last block shorter than the
    others takes its own scale."""
    xf = x.float()
    k = xf.shape[-1]
    pad = -k % ACTIVATION_BLOCK
    blocks = torch.nn.functional.pad(xf, (0, pad)).unflatten(-1, (-1, ACTIVATION_BLOCK))
    scale = blocks.abs().amax(-1, keepdim=True).clamp(min=1e-8) / 127.0
    codes = torch.round(blocks / scale).clamp(-127, 127)
    return (codes * scale).flatten(-2)[..., :k].to(x.dtype)


def quantize_activations_int16(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """The native targets' W4A16 activations (``csrc/int4_<target>.h``): each group of a row
    rounded to int16 with a power-of-two scale, ``2^(e - 15)`` for a group whose largest magnitude
    is below ``2^e``; returned dequantized (an exact emulation). A bf16 value within 2^7 of its
    group's largest is kept exactly; smaller ones are rounded at 2^-16 of that largest."""
    groups = x.float().unflatten(-1, (-1, group_size))
    exponent = torch.frexp(groups.abs().amax(-1, keepdim=True))[1]
    scale = torch.ldexp(torch.ones_like(groups[..., :1]), exponent - 15)
    return (torch.round(groups / scale).clamp(-32767, 32767) * scale).flatten(-2).to(x.dtype)


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


def pack_tiles16(
    qcodes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The avx512 target's W4A16 layout (``csrc/int4_avx512.h``): tiles of 16 output rows.

    codes: uint8 [N/16, K/8, 64]; chunk c holds k = 8c .. 8c+7 of the tile's rows as four k-pairs
    (pair p: k = 8c + 2p + e, e in {0, 1}). Byte b, with lane = b // 16 and i = b % 16, holds
    row 4 * lane + (i % 8) // 2, element e = i % 2: bytes with i < 8 carry pair 0 in the low nibble
    and pair 2 in the high one; bytes with i >= 8, pairs 1 and 3. (Unpacking the low and high
    nibbles of a chunk with the kernel's byte interleave yields each pair for all 16 rows.)
    """
    n, k = qcodes.shape
    codes = qcodes.to(torch.uint8).view(n // 16, 16, k // 8, 4, 2)  # tile, row, chunk, pair, e
    b = torch.arange(64)
    lane, i = b // 16, b % 16
    row, e = 4 * lane + (i % 8) // 2, i % 2
    low_pair = (i >= 8).long()
    low = codes[:, row, :, low_pair, e]  # [64, tiles, chunks]: advanced indices come first
    high = codes[:, row, :, low_pair + 2, e]
    packed = (low | (high << 4)).permute(1, 2, 0).contiguous()
    return packed, _tile_scales_and_zeros(scales, zeros, group_size, 16)


def pack_tiles8(
    qcodes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The avx2 target's W4A16 layout (``csrc/int4_avx2.h``): tiles of 8 output rows.

    codes: uint8 [N/8, K/8, 32]; chunk c holds k = 8c .. 8c+7 of the tile's 8 rows. Byte b of the
    chunk, with half = b // 16, e = (b % 16) // 8, w = b % 8, holds row 4 * half + w // 2 and
    k = 8c + 2e + w % 2 in its low nibble, k + 4 in its high one: the kernel's byte interleave with
    zeros (per 128-bit half, bytes 8e .. 8e+7 into int16 words) leaves 32-bit lane r of each vector
    holding row r at two adjacent k, one vpmaddwd operand.
    """
    n, k = qcodes.shape
    codes = qcodes.to(torch.uint8).view(n // 8, 8, k // 8, 2, 2, 2)  # tile, row, chunk, nib, e, par
    b = torch.arange(32)
    half, e, w = b // 16, (b % 16) // 8, b % 8
    row, par = 4 * half + w // 2, w % 2
    low = codes[:, row, :, 0, e, par]  # [32, tiles, chunks]
    high = codes[:, row, :, 1, e, par]
    packed = (low | (high << 4)).permute(1, 2, 0).contiguous()
    return packed, _tile_scales_and_zeros(scales, zeros, group_size, 8)


def _pack_tiles_a8(
    qcodes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int, rows: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The W4A8 layouts: as the W4A16 ones but byte 4r + j of chunk c holds row r of the tile,
    k = 8c + j in the low nibble and k = 8c + 4 + j in the high one, so that each 32-bit lane of
    an integer dot product (vpdpbusd, vpmaddubsw + vpmaddwd) sums four products of one row."""
    n, k = qcodes.shape
    codes = qcodes.to(torch.uint8).view(n // rows, rows, k // 8, 2, 4)  # tile, row, chunk, half, j
    packed = (codes[..., 0, :] | (codes[..., 1, :] << 4)).transpose(1, 2)  # tile, chunk, row, j
    return packed.reshape(n // rows, k // 8, 4 * rows).contiguous(), _tile_scales_and_zeros(
        scales, zeros, group_size, rows
    )


def pack_tiles16_a8(qcodes, scales, zeros, group_size) -> tuple[torch.Tensor, torch.Tensor]:
    """The avx512 target's W4A8 layout (``_pack_tiles_a8``, tiles of 16 rows)."""
    return _pack_tiles_a8(qcodes, scales, zeros, group_size, 16)


def pack_tiles8_a8(qcodes, scales, zeros, group_size) -> tuple[torch.Tensor, torch.Tensor]:
    """The avx2 target's W4A8 layout (``_pack_tiles_a8``, tiles of 8 rows)."""
    return _pack_tiles_a8(qcodes, scales, zeros, group_size, 8)


def pad_rows(
    qcodes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's canonical form with zero rows (codes, scales and zero points 0) after its own, up
    to a whole number of tiles of ``rows``: the kernels compute the padding's outputs (zeros) and
    cut them off."""
    pad = -qcodes.shape[0] % rows
    if not pad:
        return qcodes, scales, zeros
    return tuple(torch.cat([t, t.new_zeros(pad, t.shape[1])]) for t in (qcodes, scales, zeros))


def _tile_scales_and_zeros(
    scales: torch.Tensor, zeros: torch.Tensor, group_size: int, rows: int
) -> torch.Tensor:
    """uint8 [N/rows, K/G, 3 * rows]: per tile and group, the tile's ``rows`` scales in fp16 (which
    keeps the scales of AWQ and GPTQ checkpoints exactly), then its ``rows`` zero points in one
    byte each (every 4-bit format's zero points are integers: 0..15, GPTQ v1's up to 16). A
    group of 32 then streams 19 bytes a row at batch 1, not the 20 of an fp16 zero point."""
    n, num_groups = scales.shape
    z = zeros.float()
    if not torch.equal(z, z.round()) or z.min() < 0 or z.max() > 255:
        raise ValueError("INT4 zero points must be integers in 0..255 for the native layouts")

    def per_tile(t: torch.Tensor) -> torch.Tensor:  # [N, K/G] -> [N/rows, K/G, rows]
        return t.view(n // rows, rows, num_groups).transpose(1, 2)

    scale_bytes = per_tile(scales.to(torch.float16)).contiguous().view(torch.uint8)
    return torch.cat([scale_bytes, per_tile(z.to(torch.uint8))], dim=-1).contiguous()


# The native targets' INT4 layouts and their packers, by Int4Linear.layout (the targets name
# theirs in csrc/int4_<target>.h).
PACKERS = {
    "tiles16": pack_tiles16,
    "tiles16_a8": pack_tiles16_a8,
    "tiles8": pack_tiles8,
    "tiles8_a8": pack_tiles8_a8,
}
