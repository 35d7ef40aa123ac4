"""INT4 weight-only inference: the backend kernel equals the dequantized reference; the whole model's
logits stay close to dense fp32 on the same int4 weights; greedy tokens do not depend on the batch."""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.hal import get_device
from pagedserve.hal.cpu_targets import int4_zero_point_bytes
from pagedserve.hal.device import Device
from pagedserve.hal.int4 import dequantize, quantize_activations_int8
from pagedserve.hal.native import choose_kernels
from pagedserve.models.quant_formats import dequantize as dequantize_canonical
from pagedserve.models.quant_formats import quantize_rtn
from tests.helpers.kernels import TARGETS
from tests.helpers.models import assert_logprobs_close, build_tiny_hf_model, prompt_logprobs


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_cpu_int4_kernel_equals_dequantized_reference(group_size, rows):
    g = torch.Generator().manual_seed(group_size + rows)
    w = torch.randn(96, 256, generator=g)
    x = torch.randn(rows, 256, generator=g).to(torch.bfloat16)
    q, s, z = quantize_rtn(w, group_size)
    cpu = get_device("cpu")
    packed = cpu.prepare_int4(q, s, z, group_size, "w")
    assert packed.packed is not None  # the kernel path, not the fallback
    ref = Device(cpu.preset).prepare_int4(q, s, z, group_size, "w")
    expected = x.float() @ dequantize(ref).T
    got = cpu.linear(x, packed).float()
    # bf16 scales and a bf16 output: about 3 significant digits
    torch.testing.assert_close(got, expected, atol=0.05 * expected.abs().max().item(), rtol=0.02)


@pytest.mark.parametrize("kernel_set", [*TARGETS, "eager"])
@pytest.mark.parametrize("abits", [16, 8])
def test_int4_weights_cost_what_the_memory_plan_counts(kernel_set, abits):
    """Half a byte a weight, and per group of 32 a 2-byte scale and the zero point: one byte in
    the avx512 and avx2 tiles (19 bytes, Q4_1's 20 less one), two in PyTorch's layout (20). The
    memory plan counts the zero point by the CPU's flags alone (``cpu_targets``), before anything
    is built: it must be what the device packs."""
    w = torch.randn(1024, 4096)
    dev = get_device("cpu", kernels=kernel_set)
    layer = dev.prepare_int4(*quantize_rtn(w, 32), 32, "w", abits)
    assert layer.layout != "reference"
    zero_point = int4_zero_point_bytes(kernel_set)
    assert zero_point == (1 if layer.layout.startswith("tiles") else 2)
    assert layer.nbytes == w.numel() // 2 + w.numel() // 32 * (2 + zero_point)


def test_w4a8_quantizes_each_token_to_int8_symmetrically():
    x = torch.tensor([[0.5, -1.0, 0.25], [100.0, 1.0, -3.0]])
    y = quantize_activations_int8(x)
    for row, out in zip(x, y):
        step = row.abs().max() / 127
        torch.testing.assert_close(out, torch.round(row / step) * step)


def _dequantized_copy(hf, group_size: int):
    """The same model with every decoder linear replaced by its RTN int4 round trip."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if ".layers." in name and name.endswith("proj.weight"):
                p.copy_(dequantize_canonical(*quantize_rtn(p, group_size), group_size))
    return hf


@pytest.mark.parametrize("arch", ["glm", "glm4"])
@pytest.mark.parametrize(
    "dtype,enforce_eager,atol,max_kl",
    [
        # PyTorch's int4 kernel: bf16 scales and zero points; measured at most 0.03 and a KL of
        # 3e-5 on these models, where zeroing one layer's down_proj moves them by 0.1 and 4e-4
        ("bfloat16", True, 0.05, 1e-4),
        ("bfloat16", False, 0.05, 1e-4),
        pytest.param(  # native: fp16 scales kept exactly, only the activations are bf16
            "float32",
            False,
            0.01,
            3e-5,
            marks=pytest.mark.skipif(
                not hasattr(choose_kernels().module, "int4_linear"),
                reason="no native INT4 kernel on this CPU",
            ),
        ),
    ],
)
def test_int4_logprobs_close_to_dense_fp32_on_the_same_int4_weights(
    arch, dtype, enforce_eager, atol, max_kl, tmp_path
):
    hf = build_tiny_hf_model(tmp_path, arch)
    prompt = [(7 * i) % 300 + 10 for i in range(24)]
    reference = _dequantized_copy(hf, 32)
    with torch.no_grad():
        ref = torch.log_softmax(reference(torch.tensor([prompt])).logits[0], -1)[:-1]
    llm = LLM(
        model=str(tmp_path),
        dtype=dtype,
        quantization="int4",
        num_kv_pages=64,
        enforce_eager=enforce_eager,
    )
    assert_logprobs_close(prompt_logprobs(llm, prompt), ref, atol, max_kl)


def test_int4_greedy_tokens_do_not_depend_on_batch_composition(tmp_path):
    # on the native kernels to the bit: the logprobs of each token too (README, SamplingParams)
    build_tiny_hf_model(tmp_path, "glm4")
    llm = LLM(model=str(tmp_path), dtype="bfloat16", quantization="int4", num_kv_pages=256)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    target = {"prompt_token_ids": [11, 42, 99, 7, 3]}

    def tokens(output):
        seq = output.outputs[0]
        logprobs = [lp[t] for t, lp in zip(seq.token_ids, seq.logprobs)]
        return seq.token_ids, logprobs if llm.llm_engine.device.kernel_set != "eager" else None

    alone = tokens(llm.generate(target, params, use_tqdm=False)[0])
    others = [
        {"prompt_token_ids": [(i * 13 + j) % 300 + 10 for j in range(3 + i)]} for i in range(7)
    ]
    for batch in ([target, *others], [*others[:3], target, *others[3:]]):
        outs = llm.generate(batch, params, use_tqdm=False)
        assert tokens(next(o for o, p in zip(outs, batch) if p is target)) == alone
