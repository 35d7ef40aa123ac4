"""AWQ / RTN quantization of tiny GLM-4 models, measured with the fp32 reference forward."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from pagedserve.entrypoints.cli.quantize import add_quantize_args, glm4_quantize_main, run_quantize
from pagedserve.hal.int4 import quantize_activations_int8
from pagedserve.models.config import load_config
from pagedserve.models.loader import load_state_dict
from pagedserve.quant.awq import LayerQuantizer, QuantizeSettings, resolve_skip_layers
from pagedserve.quant.calib import random_blocks
from pagedserve.quant.evaluate import distribution_metrics, load_reference_model, sample_blocks
from pagedserve.quant.forward import ReferenceGlm, layer_weights
from tests.helpers.models import build_tiny_hf_model, build_tiny_tokenizer

OUTLIERS = [3, 17, 40, 77]
CALIB = ["--calib-samples", "4", "--calib-seq-len", "64"]


def quantize(src, dst, *extra: str) -> Path:
    args = add_quantize_args(argparse.ArgumentParser()).parse_args(
        ["--model-path", str(src), "--output-path", str(dst), *CALIB, *extra]
    )
    assert run_quantize(args) == 0
    return Path(dst)


@pytest.fixture(scope="module")
def outlier_model(tmp_path_factory):
    """glm4 with a few input channels whose activations are 20x the rest, same function."""
    d = tmp_path_factory.mktemp("outlier")
    m = build_tiny_hf_model(d, "glm4", hidden_size=128, intermediate_size=256, head_dim=32)
    with torch.no_grad():
        m.lm_head.weight.mul_(20)  # sharper next-token distributions
        for layer in m.model.layers:
            layer.input_layernorm.weight[OUTLIERS] *= 20
            for p in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                p.weight[:, OUTLIERS] /= 20
            layer.post_attention_layernorm.weight[OUTLIERS] *= 20
            layer.mlp.gate_up_proj.weight[:, OUTLIERS] /= 20
    m.save_pretrained(d)
    return d


@pytest.mark.parametrize("architecture", ["glm", "glm4"])
def test_reference_forward_matches_transformers(tmp_path, architecture):
    model = build_tiny_hf_model(tmp_path, architecture)
    config = load_config(tmp_path)
    ids = torch.randint(0, config.vocab_size, (2, 24))
    ours = ReferenceGlm(config, load_state_dict(tmp_path, config, torch.float32)).forward(ids)
    with torch.no_grad():
        theirs = model(ids).logits
    assert torch.allclose(ours, theirs, atol=1e-5)


def test_scale_folding_preserves_the_layer_function_with_gqa(outlier_model):
    config = load_config(outlier_model)
    assert config.num_attention_heads != config.num_key_value_heads
    sd = load_state_dict(outlier_model, config, torch.float32)
    model = ReferenceGlm(config, sd)
    h = model.embed(random_blocks(config.vocab_size, 2, 32, 0))
    w = {k: v.clone() for k, v in layer_weights(sd, 0).items()}
    before = model.layer(0, w, h)
    lq = LayerQuantizer(config, QuantizeSettings("awq", 32), set())
    ratios = lq.search_and_fold(0, w, lq.capture_inputs(model, 0, w, h))
    assert any(r is not None for r in ratios.values())
    assert not torch.equal(w["input_layernorm.weight"], sd["model.layers.0.input_layernorm.weight"])
    assert torch.allclose(model.layer(0, w, h), before, atol=1e-4, rtol=1e-4)


def test_awq_beats_rtn_on_activation_outliers(outlier_model, tmp_path):
    reference = load_reference_model(outlier_model)
    held_out = sample_blocks(reference, 4, 64, seed=99)
    figures = {}
    for method in ("rtn", "awq"):
        candidate = load_reference_model(
            quantize(outlier_model, tmp_path / method, "--quant-method", method)
        )
        m = distribution_metrics(reference, candidate, held_out)
        figures[method] = (m["mean_kl"], m["ppl_candidate"] / m["ppl_reference"] - 1)
    assert figures["awq"][0] < figures["rtn"][0]
    assert 0 < figures["awq"][1] < figures["rtn"][1]


def test_output_directory_has_config_report_and_tokenizer(tmp_path):
    build_tiny_hf_model(tmp_path / "src", "glm")
    build_tiny_tokenizer(tmp_path / "src")
    dst = quantize(
        tmp_path / "src",
        tmp_path / "dst",
        "--abits",
        "8",
        "--skip-layers",
        "ln_1.weight,ln_1.bias,ln_2.weight,ln_2.bias,attn.softmax,*.down_proj",
    )
    qc = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "pagedserve-awq" and qc["abits"] == 8 and qc["bits"] == 4
    assert {"group_size", "zero_point", "skip_layers", "version"} <= qc.keys()
    assert (dst / "tokenizer.json").is_file() and (dst / "tokenizer_config.json").is_file()
    report = json.loads((dst / "quant_report.json").read_text())
    assert len(report["layers"]) == 2 and "qkv" in report["layers"][0]["scale_exponents"]
    sd = load_state_dict(dst, load_config(dst))
    assert "model.layers.0.mlp.down_proj.weight" in sd  # skipped: 16-bit
    assert "model.layers.0.mlp.down_proj.qweight" not in sd
    assert "model.layers.0.mlp.gate_up_proj.qweight" in sd


def test_autoawq_output_dequantizes_like_ours(tmp_path):
    build_tiny_hf_model(tmp_path / "src", "glm4")
    ours = load_reference_model(quantize(tmp_path / "src", tmp_path / "ours"))
    awq = load_reference_model(quantize(tmp_path / "src", tmp_path / "awq", "--format", "autoawq"))
    assert (
        json.loads((tmp_path / "awq" / "config.json").read_text())["quantization_config"]["version"]
        == "gemm"
    )
    for name, t in ours.sd.items():
        assert torch.allclose(awq.sd[name].float(), t.float(), atol=1e-6), name


def test_skip_layer_typo_is_an_error_naming_it(tmp_path):
    build_tiny_hf_model(tmp_path, "glm")
    with pytest.raises(ValueError, match="'model.layers.0.mlp.dwn_proj'"):
        resolve_skip_layers(["model.layers.0.mlp.dwn_proj"], load_config(tmp_path))


def test_glm4_quantize_accepts_the_seed_flags(tmp_path):
    build_tiny_hf_model(tmp_path / "src", "glm")
    rc = glm4_quantize_main(
        [
            "--model-path",
            str(tmp_path / "src"),
            "--output-path",
            str(tmp_path / "dst"),
            "--quant-method",
            "awq",
            "--group-size",
            "32",
            "--wbits",
            "4",
            "--abits",
            "8",
            "--skip-layers",
            "ln_1.weight,ln_1.bias,ln_2.weight,ln_2.bias,attn.softmax",
            *CALIB,
        ]
    )
    assert rc == 0 and (tmp_path / "dst" / "model.safetensors").is_file()
    assert (
        glm4_quantize_main(
            [
                "--model-path",
                str(tmp_path / "src"),
                "--output-path",
                str(tmp_path / "x"),
                "--wbits",
                "3",
                *CALIB,
            ]
        )
        == 2
    )


def test_int8_activation_quantization_is_per_block_of_32_and_within_half_a_step():
    # each row's two blocks of 32 on scales 100 times apart: each block takes its own step
    x = torch.randn(5, 64) * torch.tensor([1.0, 10.0, 0.1, 3.0, 100.0]).unsqueeze(1)
    x[:, 32:] /= 100
    xq = quantize_activations_int8(x)
    step = x.unflatten(-1, (2, 32)).abs().amax(-1, keepdim=True) / 127
    assert ((xq - x).unflatten(-1, (2, 32)).abs() <= step / 2 + 1e-6).all()
    assert torch.equal(quantize_activations_int8(x[2:3]), xq[2:3])
    assert torch.equal(quantize_activations_int8(x[:, 32:]), xq[:, 32:])
