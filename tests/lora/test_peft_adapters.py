"""PEFT adapter directories: both GLM-4 namings land on the same fused layers, the scale is
PEFT's (plain and rsLoRA), tensor-parallel ranks cut adapters as their layers are cut, and an
adapter that does not fit the base is refused with the reason."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pagedserve.lora.peft import LoRAAdapterError, load_peft_adapter, random_adapter_tensors
from pagedserve.models.config import GlmConfig
from pagedserve.models.tensor_parallel import TensorParallel
from tests.helpers.lora import write_adapter

CONFIG = GlmConfig(
    architecture="glm",
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)
Q, KV, H, INTER = 64, 32, 64, 96  # q rows, k (and v) rows, hidden, intermediate
R = 4
HF = "base_model.model.model.layers.{}.{}.lora_{}.weight"
CHATGLM = "base_model.model.transformer.encoder.layers.{}.{}.lora_{}.weight"


def _random(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed + sum(shape)))


def _hf_tensors(layers=(0, 1), r=R):
    """Every HF target of the given layers: q, k and v share one A (so that chatglm's fused
    query_key_value can say the same)."""
    out = {}
    for i in layers:
        a_qkv, b_qkv = _random(r, H, seed=i), _random(Q + 2 * KV, r, seed=i)
        for part, rows in zip("qkv", b_qkv.split([Q, KV, KV])):
            out[HF.format(i, f"self_attn.{part}_proj", "A")] = a_qkv
            out[HF.format(i, f"self_attn.{part}_proj", "B")] = rows
        for module, fan_in, fan_out in (
            ("self_attn.o_proj", Q, H),
            ("mlp.gate_up_proj", H, 2 * INTER),
            ("mlp.down_proj", INTER, H),
        ):
            out[HF.format(i, module, "A")] = _random(r, fan_in, seed=i + 1)
            out[HF.format(i, module, "B")] = _random(fan_out, r, seed=i + 2)
    return out


def _chatglm_tensors(hf: dict) -> dict:
    """The same adapter under the original checkpoint's names."""
    out = {}
    names = {"self_attn.o_proj": "self_attention.dense", "mlp.gate_up_proj": "mlp.dense_h_to_4h"}
    names["mlp.down_proj"] = "mlp.dense_4h_to_h"
    for i in (0, 1):
        out[CHATGLM.format(i, "self_attention.query_key_value", "A")] = hf[
            HF.format(i, "self_attn.q_proj", "A")
        ]
        b = [hf[HF.format(i, f"self_attn.{p}_proj", "B")] for p in "qkv"]
        out[CHATGLM.format(i, "self_attention.query_key_value", "B")] = torch.cat(b)
        for hf_name, glm_name in names.items():
            for side in "AB":
                out[CHATGLM.format(i, glm_name, side)] = hf[HF.format(i, hf_name, side)]
    return out


def _load(path, tp=None, max_rank=16):
    return load_peft_adapter(path, CONFIG, "a", 1, max_rank, torch.float32, tp)


def _delta(adapter, layer, target):
    """The adapter's change to the layer's weight, [in, out]: a @ b."""
    w = adapter.layers[(layer, target)]
    return w.a @ w.b


def test_chatglm_names_land_on_the_same_fused_layers_as_hf_names(tmp_path):
    hf = _hf_tensors()
    by_hf = _load(write_adapter(tmp_path / "hf", hf, r=R, lora_alpha=8))
    by_glm = _load(write_adapter(tmp_path / "glm", _chatglm_tensors(hf), r=R, lora_alpha=8))
    assert (
        set(by_hf.layers)
        == set(by_glm.layers)
        == {(i, t) for i in (0, 1) for t in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}
    )
    for key in by_hf.layers:
        torch.testing.assert_close(_delta(by_hf, *key), _delta(by_glm, *key))
    # the fused qkv delta is B A stacked as q, k, v rows, scaled by alpha / r
    qkv = torch.cat([hf[HF.format(0, f"self_attn.{p}_proj", "B")] for p in "qkv"])
    want = (qkv @ hf[HF.format(0, "self_attn.q_proj", "A")]).t() * (8 / R)
    torch.testing.assert_close(_delta(by_hf, 0, "qkv_proj"), want)


@pytest.mark.parametrize("rslora", [False, True])
def test_the_scale_is_alpha_over_r_or_over_its_root_with_rslora(tmp_path, rslora):
    hf = _hf_tensors()
    adapter = _load(write_adapter(tmp_path, hf, r=R, lora_alpha=8, use_rslora=rslora))
    a, b = (hf[HF.format(1, "mlp.down_proj", s)] for s in "AB")
    scale = 8 / math.sqrt(R) if rslora else 8 / R
    torch.testing.assert_close(_delta(adapter, 1, "down_proj"), (b @ a).t() * scale)


def test_tensor_parallel_ranks_cut_b_by_output_for_column_layers_and_a_by_input_for_row_layers(
    tmp_path,
):
    path = write_adapter(tmp_path, _hf_tensors(), r=R)
    whole = _load(path)
    ranks = [_load(path, TensorParallel(CONFIG, rank, 2)) for rank in (0, 1)]
    for target in ("o_proj", "down_proj"):  # row-parallel: the partial deltas stack by input rows
        torch.testing.assert_close(
            torch.cat([_delta(r, 0, target) for r in ranks]), _delta(whole, 0, target)
        )
        assert all(
            r.layers[(0, target)].b.shape == whole.layers[(0, target)].b.shape for r in ranks
        )
    for target, pieces in (
        (
            "gate_up_proj",
            lambda d: d.split([INTER // 2] * 2, 1),
        ),  # each rank: its gate and up halves
        ("qkv_proj", lambda d: d.split([Q // 2, KV // 2, KV // 2], 1)),  # its q, k and v heads
    ):
        halves = [pieces(_delta(r, 0, target)) for r in ranks]
        stacked = torch.cat(
            [torch.cat([h[j] for h in halves], 1) for j in range(len(halves[0]))], 1
        )
        torch.testing.assert_close(stacked, _delta(whole, 0, target))


def _refusal(tmp_path, mutate) -> str:
    tensors, config = _hf_tensors(), {"r": R}
    mutate(tensors, config)
    path = write_adapter(tmp_path, tensors, **config)
    with pytest.raises(LoRAAdapterError) as e:
        _load(path, max_rank=8)
    return str(e.value)


REFUSALS = {
    "a rank above the maximum": (
        lambda t, c: t.update(_hf_tensors(layers=(0,), r=12)),
        ["rank 12", "maximum LoRA rank 8", "--max-lora-rank 16"],
    ),
    "an adapter of another model's width": (
        lambda t, c: t.update({HF.format(0, "mlp.down_proj", "A"): torch.zeros(R, 128)}),
        ["layers.0.mlp.down_proj", "96 inputs", "another model"],
    ),
    "a layer the base does not have": (
        lambda t, c: t.update({HF.format(5, "mlp.down_proj", s): t[HF.format(0, "mlp.down_proj", s)] for s in "AB"}),
        ["layer 5", "2 layers"],
    ),
    "LoRA on lm_head": (
        lambda t, c: t.update({"base_model.model.lm_head.lora_A.weight": torch.zeros(R, H)}),
        ["lm_head", "not supported"],
    ),
    "a lora_A without its lora_B": (
        lambda t, c: t.pop(HF.format(1, "mlp.down_proj", "B")),
        ["layers.1.mlp.down_proj", "no lora_B"],
    ),
    "DoRA": (lambda t, c: c.update(use_dora=True), ["use_dora", "DoRA"]),
    "modules_to_save": (lambda t, c: c.update(modules_to_save=["lm_head"]), ["modules_to_save"]),
    "another PEFT method": (lambda t, c: c.update(peft_type="IA3"), ["peft_type", "LORA"]),
}  # fmt: skip


@pytest.mark.parametrize("case", REFUSALS)
def test_an_adapter_that_does_not_fit_the_base_is_refused_with_the_reason(tmp_path, case):
    mutate, words = REFUSALS[case]
    message = _refusal(tmp_path, mutate)
    assert all(w in message for w in words), message


def test_a_directory_that_is_no_peft_adapter_is_refused_naming_what_is_missing(tmp_path):
    with pytest.raises(LoRAAdapterError, match="is not a directory"):
        _load(tmp_path / "nowhere")
    with pytest.raises(LoRAAdapterError, match="no adapter_config.json in"):
        _load(tmp_path)
    (tmp_path / "adapter_config.json").write_text("{not json")
    with pytest.raises(LoRAAdapterError, match="is not valid JSON"):
        _load(tmp_path)
    (tmp_path / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16}))
    with pytest.raises(LoRAAdapterError, match="no adapter_model.safetensors or adapter_model"):
        _load(tmp_path)
    (tmp_path / "adapter_model.safetensors").write_bytes(b"garbage")
    with pytest.raises(LoRAAdapterError, match="cannot be read"):
        _load(tmp_path)


def test_the_shipped_demo_adapter_is_what_its_tool_draws():
    """tools/make_demo_lora.py writes the same bytes every time: the shipped tensors are the
    random adapter it draws from the demo model's config."""
    package = Path(__file__).resolve().parents[2] / "pagedserve"
    config = json.loads((package / "demo_model" / "config.json").read_text())
    shipped = load_file(str(package / "demo_lora" / "adapter_model.safetensors"))
    peft = json.loads((package / "demo_lora" / "adapter_config.json").read_text())
    drawn = random_adapter_tensors(config, peft["r"], torch.Generator().manual_seed(0), 0.05)
    assert drawn.keys() == shipped.keys()
    assert all(torch.equal(drawn[k], shipped[k]) for k in drawn)
