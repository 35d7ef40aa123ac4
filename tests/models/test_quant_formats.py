"""INT4 formats: the RTN quantizer, and every checkpoint layout loaded back to the canonical form.

Each layout is packed here by hand, from its description (GLM4.md), independently of models/quant_formats.py.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.models.config import load_config
from pagedserve.models.loader import load_state_dict
from pagedserve.models.quant_formats import (
    dequantize,
    load_quantized_linears,
    quantization_config_for,
    quantize_rtn,
    save_quantized,
)

PREFIX = "model.layers.0.mlp.down_proj"
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def to_int32(v: int) -> int:
    return v - 2**32 if v >= 2**31 else v


def random_canonical(n: int, k: int, g: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=gen)
    z = torch.randint(0, 16, (n, k // g), generator=gen)
    s = (torch.rand(n, k // g, generator=gen) * 0.1 + 0.01).half().float()
    w = torch.empty(n, k)
    for r in range(n):
        for c in range(k):
            w[r, c] = (q[r, c] - z[r, c // g]) * s[r, c // g]
    return q, s, z, w


# ---- the quantizer --------------------------------------------------------------------------------
def test_rtn_matches_a_hand_computed_group():
    w = torch.tensor([[-1.5, 0.0, 0.6, 3.0]])
    q, s, z = quantize_rtn(w, 4)
    assert q.tolist() == [[0, 5, 7, 15]]
    assert z.tolist() == [[5.0]]
    assert s.item() == pytest.approx(0.3, rel=1e-3)
    assert torch.allclose(dequantize(q, s, z, 4), w, atol=1e-3)


def test_rtn_error_is_at_most_half_a_step_and_codes_fit_four_bits():
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(0))
    q, s, z = quantize_rtn(w, 32)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15
    assert torch.equal(z, z.round()) and z.min() >= 0 and z.max() <= 15
    err = (dequantize(q, s, z, 32) - w).abs().reshape(48, 4, 32)
    # scales are rounded to fp16: the extreme codes may miss by up to 15 * 2^-11 of a step
    assert (err <= s.unsqueeze(-1) * (0.5 + 15 * 2**-11) + 1e-6).all()


@pytest.mark.parametrize("value", [0.0, 0.7, -2.5])
def test_rtn_is_exact_on_constant_groups(value):
    w = torch.full((2, 32), value)
    assert torch.allclose(dequantize(*quantize_rtn(w, 32), 32), w, atol=1e-3)


def test_group_size_that_does_not_divide_is_rejected():
    with pytest.raises(ValueError, match="group_size 32"):
        quantize_rtn(torch.randn(4, 48), 32)


# ---- layouts packed by hand -----------------------------------------------------------------------
def pack_ours_by_hand(q, s, z):
    n, k = q.shape
    packed = torch.zeros(n, k // 2, dtype=torch.uint8)
    for r in range(n):
        for j in range(k // 2):
            packed[r, j] = int(q[r, 2 * j]) | (int(q[r, 2 * j + 1]) << 4)
    return {
        f"{PREFIX}.qweight": packed,
        f"{PREFIX}.qzeros": z.to(torch.uint8),
        f"{PREFIX}.scales": s.half(),
    }


def pack_awq_by_hand(q, s, z):
    def pack(codes_t):  # [rows, out] -> [rows, out/8], column order AWQ_ORDER
        rows, cols = codes_t.shape
        out = torch.zeros(rows, cols // 8, dtype=torch.int32)
        for r in range(rows):
            for c in range(cols // 8):
                v = sum(int(codes_t[r, 8 * c + AWQ_ORDER[i]]) << (4 * i) for i in range(8))
                out[r, c] = to_int32(v)
        return out

    return {
        f"{PREFIX}.qweight": pack(q.t()),
        f"{PREFIX}.qzeros": pack(z.t()),
        f"{PREFIX}.scales": s.t().half(),
    }


def pack_gptq_by_hand(q_t, s_g, z_g, g_idx, v1: bool):
    """q_t [K, N]; s_g, z_g [num_groups, N]; qweight packs 8 input rows per int32."""
    k, n = q_t.shape
    qweight = torch.zeros(k // 8, n, dtype=torch.int32)
    for r in range(k // 8):
        for c in range(n):
            qweight[r, c] = to_int32(sum(int(q_t[8 * r + i, c]) << (4 * i) for i in range(8)))
    stored = [[(int(z) - 1) & 0xF if v1 else int(z) for z in row] for row in z_g]
    qzeros = torch.zeros(len(stored), n // 8, dtype=torch.int32)
    for gi, row in enumerate(stored):
        for c in range(n // 8):
            qzeros[gi, c] = to_int32(sum(row[8 * c + i] << (4 * i) for i in range(8)))
    return {
        f"{PREFIX}.qweight": qweight,
        f"{PREFIX}.qzeros": qzeros,
        f"{PREFIX}.scales": s_g.half(),
        f"{PREFIX}.g_idx": g_idx.to(torch.int32),
    }


def dense_of(layers):
    return dequantize(*layers[PREFIX])


def test_our_layout_loads_back_to_the_weight():
    q, s, z, w = random_canonical(16, 64, 32)
    sd = pack_ours_by_hand(q, s, z)
    layers = load_quantized_linears(sd, quantization_config_for("pagedserve", 32, 16, [], "rtn"))
    assert torch.allclose(dense_of(layers), w, atol=1e-6)
    assert sd == {}  # the quantized tensors were consumed


def test_autoawq_gemm_layout_loads_back_to_the_weight():
    q, s, z, w = random_canonical(24, 64, 32, seed=1)
    sd = pack_awq_by_hand(q, s, z)
    qc = {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": 32, "zero_point": True}
    layers = load_quantized_linears(sd, qc)
    assert torch.equal(layers[PREFIX][0], q.to(torch.uint8))
    assert torch.allclose(dense_of(layers), w, atol=1e-6)


@pytest.mark.parametrize("v1", [True, False])
@pytest.mark.parametrize("sym", [True, False])
def test_gptq_layout_loads_back_to_the_weight(v1, sym):
    k, n, g = 64, 16, 32
    q, s, z, w = random_canonical(n, k, g, seed=2)
    if sym:
        z = torch.full_like(z, 8)
        w = dequantize(q, s, z, g)
    if v1 and not sym:
        z = z.clamp(min=1)  # v1 stores zero - 1: a zero point of 0 does not survive it
        w = dequantize(q, s, z, g)
    sd = pack_gptq_by_hand(q.t(), s.t(), z.t(), torch.arange(k) // g, v1)
    qc = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": g,
        "sym": sym,
        "desc_act": False,
        "checkpoint_format": "gptq" if v1 else "gptq_v2",
    }
    assert torch.allclose(dense_of(load_quantized_linears(sd, qc)), w, atol=1e-6)


def test_gptq_desc_act_with_reordered_groups_falls_back_to_a_dense_weight():
    k, n, g = 64, 16, 32
    gen = torch.Generator().manual_seed(3)
    q_t = torch.randint(0, 16, (k, n), generator=gen)
    s_g = (torch.rand(k // g, n, generator=gen) * 0.1 + 0.01).half().float()
    z_g = torch.randint(0, 16, (k // g, n), generator=gen)
    g_idx = (torch.arange(k) // g)[torch.randperm(k, generator=gen)]
    expected = torch.empty(n, k)
    for kk in range(k):
        for nn in range(n):
            expected[nn, kk] = s_g[g_idx[kk], nn] * (q_t[kk, nn] - z_g[g_idx[kk], nn])
    sd = pack_gptq_by_hand(q_t, s_g, z_g, g_idx, v1=False)
    qc = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": g,
        "desc_act": True,
        "checkpoint_format": "gptq_v2",
    }
    assert load_quantized_linears(sd, qc) == {}
    assert torch.allclose(sd[f"{PREFIX}.weight"].float(), expected, atol=1e-3)


def test_unsupported_configs_are_rejected_by_name():
    with pytest.raises(ValueError, match="quant_method 'bitsandbytes'"):
        load_quantized_linears({}, {"quant_method": "bitsandbytes", "bits": 4})
    with pytest.raises(ValueError, match="bits=8"):
        load_quantized_linears({}, {"quant_method": "awq", "bits": 8})


# ---- writers round-trip through the model loader --------------------------------------------------
@pytest.mark.parametrize("fmt", ["pagedserve", "autoawq"])
def test_saved_checkpoint_loads_back_through_the_model_loader(tmp_path, fmt):
    from tests.helpers.models import build_tiny_hf_model

    src = tmp_path / "src"
    model = build_tiny_hf_model(src, "glm4")
    config = load_config(src)
    sd = load_state_dict(src, config)
    linears = {
        k[: -len(".weight")]: v
        for k, v in sd.items()
        if k.endswith("_proj.weight") and k.startswith("model.layers.")
    }
    quantized = {p: (*quantize_rtn(w, 32), 32) for p, w in linears.items()}
    dense = {k: v for k, v in sd.items() if k[: -len(".weight")] not in quantized}
    qc = quantization_config_for(fmt, 32, 8, [], "rtn")
    save_quantized(tmp_path / "dst", dense, quantized, model.config.to_dict(), qc, src)
    config2 = load_config(tmp_path / "dst")
    assert config2.quantization_config["abits"] == 8
    loaded = load_quantized_linears(
        load_state_dict(tmp_path / "dst", config2), config2.quantization_config
    )
    assert loaded.keys() == quantized.keys()
    for p, (q, s, z, g) in quantized.items():
        assert torch.allclose(dequantize(*loaded[p]), dequantize(q, s, z, g), atol=1e-6), p
