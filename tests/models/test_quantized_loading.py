"""A directory written by ``pagedserve quantize`` (ours or AutoAWQ's layout, W4A16 or W4A8) loads in
``LLM`` and in ``pagedserve serve``, and computes what the fp32 reference on its dequantized weights
computes."""

from __future__ import annotations

import argparse

import httpx
import pytest
import torch

from pagedserve import LLM
from pagedserve.entrypoints.cli.quantize import add_quantize_args, run_quantize
from pagedserve.hal.native import choose_kernels
from pagedserve.quant.evaluate import load_reference_model
from pagedserve.testing import serve
from tests.helpers.models import assert_logprobs_close, build_tiny_model_dir, prompt_logprobs

PROMPT = [(5 * i) % 300 + 10 for i in range(20)]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("src")
    build_tiny_model_dir(path, "glm4")
    return path


def _quantize(src, dst, *extra: str):
    argv = [
        "--model-path",
        str(src),
        "--output-path",
        str(dst),
        "--calib-samples",
        "4",
        "--calib-seq-len",
        "32",
        *extra,
    ]
    assert run_quantize(add_quantize_args(argparse.ArgumentParser()).parse_args(argv)) == 0
    return dst


@pytest.mark.parametrize(
    "extra",
    [("--abits", "16"), ("--abits", "8"), ("--format", "autoawq", "--abits", "16")],
    ids=["ours-w4a16", "ours-w4a8", "autoawq"],
)
def test_quantized_directory_matches_its_dequantized_reference(source, tmp_path, extra):
    dst = _quantize(source, tmp_path / "q", "--quant-method", "awq", *extra)
    llm = LLM(model=str(dst), dtype="bfloat16", num_kv_pages=64)
    assert all(
        not isinstance(layer.down_proj, torch.Tensor) for layer in llm.llm_engine.model.layers
    )
    got = prompt_logprobs(llm, PROMPT)
    with torch.no_grad():
        ref_logits = load_reference_model(dst).forward(torch.tensor([PROMPT]))[0, :-1]
    # measured at most 0.015 and a KL of 9e-6 (W4A8); zeroing one layer's down_proj moves these
    # tiny models' log-probs by 0.07 or more
    assert_logprobs_close(got, torch.log_softmax(ref_logits, -1), atol=0.03, max_kl=3e-5)


def test_skipped_layers_stay_16_bit(source, tmp_path):
    dst = _quantize(source, tmp_path / "q", "--quant-method", "rtn", "--skip-layers", "*.down_proj")
    model = LLM(model=str(dst), dtype="bfloat16", num_kv_pages=16).llm_engine.model
    assert all(isinstance(layer.down_proj, torch.Tensor) for layer in model.layers)
    assert all(not isinstance(layer.gate_up_proj, torch.Tensor) for layer in model.layers)


def test_serve_loads_a_quantized_directory_and_completes(source, tmp_path):
    dst = _quantize(source, tmp_path / "q", "--quant-method", "rtn")
    flags = [
        "--model",
        str(dst),
        "--num-kv-pages",
        "32",
        "--max-model-len",
        "128",
        "--served-model-name",
        "tiny-int4",
    ]
    with serve(*flags) as (_, url):
        r = httpx.post(
            url + "/v1/completions",
            timeout=60,
            json={"model": "tiny-int4", "prompt": PROMPT, "max_tokens": 5, "ignore_eos": True},
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 5


@pytest.mark.skipif(
    not hasattr(choose_kernels().module, "int4_linear"), reason="no native INT4 kernel on this CPU"
)
@pytest.mark.parametrize("lm_head", ["none", "int4"])
def test_load_time_w4a8_equals_an_rtn_w4a8_directory(source, tmp_path, lm_head):
    # --quantization w4a8 is RTN at load with int8 activations: the same numbers as quantizing the
    # directory with `quantize --quant-method rtn --abits 8`, judged by its fp32 reference (which
    # rounds lm_head's input to int8 too when lm_head is INT4). The native kernel's integer
    # products make it exact to fp32 rounding; W4A16 differs from it by about 0.01 here.
    dst = _quantize(source, tmp_path / "q", "--quant-method", "rtn", "--abits", "8")
    llm = LLM(
        model=str(source),
        dtype="float32",
        quantization="w4a8",
        quantize_lm_head=lm_head,
        num_kv_pages=64,
    )
    assert all(layer.down_proj.abits == 8 for layer in llm.llm_engine.model.layers)
    got = prompt_logprobs(llm, PROMPT)
    with torch.no_grad():
        ref = load_reference_model(dst, lm_head=lm_head).forward(torch.tensor([PROMPT]))[0, :-1]
    torch.testing.assert_close(got, torch.log_softmax(ref, -1), atol=1e-3, rtol=0.0)
