"""Config parsing and checkpoint loading, checked against transformers' own models and configs."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve.models import GlmConfig, load_config, load_state_dict
from tests.helpers.models import build_tiny_hf_model, tiny_hf_config, write_chatglm_checkpoint

FIELDS_FROM_HF = [
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "attention_bias",
    "max_position_embeddings",
    "tie_word_embeddings",
    "pad_token_id",
]


def assert_state_dicts_equal(loaded: dict, expected: dict) -> None:
    assert sorted(loaded) == sorted(expected)
    for name, tensor in expected.items():
        assert loaded[name].dtype == tensor.dtype, name
        assert torch.equal(loaded[name], tensor), name


def assert_config_matches_hf(config: GlmConfig, hf_config) -> None:
    for name in FIELDS_FROM_HF:
        assert getattr(config, name) == getattr(hf_config, name), name
    rope = hf_config.rope_parameters
    assert config.rope_theta == rope["rope_theta"]
    assert config.partial_rotary_factor == rope["partial_rotary_factor"]
    assert config.eos_token_ids == list(hf_config.eos_token_id)


# --- config.json


@pytest.mark.parametrize("architecture", ["glm", "glm4"])
def test_config_from_saved_hf_checkpoint_matches_transformers(tmp_path, architecture):
    model = build_tiny_hf_model(tmp_path, architecture, rope_theta=25000.0, attention_bias=False)
    config = load_config(tmp_path)
    assert config.architecture == architecture
    assert_config_matches_hf(config, model.config)
    assert config.rotary_dim == 8
    assert config.torch_dtype == "float32"
    assert config.quantization_config is None


def test_config_accepts_rope_keys_at_top_level_or_in_rope_parameters():
    d = tiny_hf_config("glm4").to_dict()
    nested = GlmConfig.from_dict(d)
    rope = d.pop("rope_parameters")
    flat = GlmConfig.from_dict({**d, "rope_theta": 5e6, "partial_rotary_factor": 0.25})
    assert nested.rope_theta == rope["rope_theta"]
    assert (flat.rope_theta, flat.partial_rotary_factor, flat.rotary_dim) == (5e6, 0.25, 4)


def test_config_defaults_head_dim_and_accepts_a_single_eos_id():
    d = tiny_hf_config("glm").to_dict()
    del d["head_dim"]
    d["eos_token_id"] = 7
    config = GlmConfig.from_dict(d)
    assert config.head_dim == d["hidden_size"] // d["num_attention_heads"]
    assert config.eos_token_ids == [7]


def test_unknown_model_type_is_rejected_with_the_supported_list():
    d = {**tiny_hf_config("glm").to_dict(), "model_type": "llama"}
    with pytest.raises(ValueError, match=r"'llama'.*glm, glm4, chatglm"):
        GlmConfig.from_dict(d)


@pytest.mark.parametrize("filename", ["quant_config.json", "quantize_config.json"])
def test_quantization_config_is_read_from_a_side_file(tmp_path, filename):
    build_tiny_hf_model(tmp_path)
    quant = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True}
    (tmp_path / filename).write_text(json.dumps(quant))
    assert load_config(tmp_path).quantization_config == quant


def test_quantization_config_in_config_json_wins_over_a_side_file(tmp_path):
    build_tiny_hf_model(tmp_path)
    path = tmp_path / "config.json"
    inline = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False}
    path.write_text(json.dumps({**json.loads(path.read_text()), "quantization_config": inline}))
    (tmp_path / "quant_config.json").write_text(json.dumps({"quant_method": "awq"}))
    assert load_config(tmp_path).quantization_config == inline


def test_missing_config_json_names_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_config(tmp_path)


# --- HF safetensors


@pytest.mark.parametrize("architecture", ["glm", "glm4"])
def test_single_file_checkpoint_loads_every_tensor_exactly(tmp_path, architecture):
    model = build_tiny_hf_model(tmp_path, architecture)
    assert (tmp_path / "model.safetensors").is_file()
    state = load_state_dict(tmp_path, load_config(tmp_path))
    assert_state_dicts_equal(state, model.state_dict())


@pytest.mark.parametrize("architecture", ["glm", "glm4"])
def test_sharded_checkpoint_loads_every_tensor_exactly(tmp_path, architecture):
    model = build_tiny_hf_model(tmp_path, architecture, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    state = load_state_dict(tmp_path, load_config(tmp_path))
    assert_state_dicts_equal(state, model.state_dict())


def test_tensors_are_cast_to_the_requested_dtype(tmp_path):
    model = build_tiny_hf_model(tmp_path, "glm4")
    state = load_state_dict(tmp_path, load_config(tmp_path), dtype=torch.bfloat16)
    expected = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    assert_state_dicts_equal(state, expected)


def test_integer_tensors_of_a_quantized_checkpoint_keep_their_dtype(tmp_path):
    model = build_tiny_hf_model(tmp_path)
    state = model.state_dict()
    name = "model.layers.0.mlp.down_proj"
    del state[f"{name}.weight"]
    qweight = torch.randint(-(2**31), 2**31 - 1, (96, 64 // 8), dtype=torch.int32)
    state[f"{name}.qweight"] = qweight
    state[f"{name}.scales"] = torch.rand(96 // 32, 64, dtype=torch.float16)
    (tmp_path / "model.safetensors").unlink()
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))

    loaded = load_state_dict(tmp_path, load_config(tmp_path), dtype=torch.bfloat16)
    assert loaded[f"{name}.qweight"].dtype == torch.int32
    assert torch.equal(loaded[f"{name}.qweight"], qweight)
    assert loaded[f"{name}.scales"].dtype == torch.bfloat16


def test_tied_embeddings_fill_lm_head(tmp_path):
    model = build_tiny_hf_model(tmp_path, tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(str(tmp_path / "model.safetensors"))
    state = load_state_dict(tmp_path, load_config(tmp_path))
    assert torch.equal(state["lm_head.weight"], model.state_dict()["model.embed_tokens.weight"])


def test_pytorch_bin_checkpoint_is_a_fallback(tmp_path):
    model = build_tiny_hf_model(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    state = load_state_dict(tmp_path, load_config(tmp_path))
    assert_state_dicts_equal(state, model.state_dict())


def test_directory_without_weights_is_a_clear_error(tmp_path):
    build_tiny_hf_model(tmp_path)
    config = load_config(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no weights in .*model.safetensors"):
        load_state_dict(tmp_path, config)


def test_missing_shard_named_in_the_index_is_a_clear_error(tmp_path):
    build_tiny_hf_model(tmp_path, max_shard_size="40KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=shard.name):
        load_state_dict(tmp_path, load_config(tmp_path))


@pytest.mark.parametrize(
    "architecture, missing",
    [
        ("glm", "model.layers.1.self_attn.v_proj.bias"),
        ("glm4", "model.layers.0.post_mlp_layernorm.weight"),
        ("glm4", "lm_head.weight"),
    ],
)
def test_missing_tensor_is_named(tmp_path, architecture, missing):
    model = build_tiny_hf_model(tmp_path, architecture)
    state = {k: v for k, v in model.state_dict().items() if k != missing}
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=missing.replace(".", r"\.")):
        load_state_dict(tmp_path, load_config(tmp_path))


# --- original THUDM chatglm format


def test_chatglm_config_maps_to_glm_with_rope_theta_from_rope_ratio(tmp_path):
    model = build_tiny_hf_model(tmp_path / "hf")
    write_chatglm_checkpoint(model, tmp_path / "chatglm", rope_ratio=500.0)
    config = load_config(tmp_path / "chatglm")
    assert config.architecture == "glm"
    for name in FIELDS_FROM_HF:
        assert getattr(config, name) == getattr(model.config, name), name
    assert config.rope_theta == 10000.0 * 500.0
    assert config.partial_rotary_factor == 0.5
    assert config.eos_token_ids == list(model.config.eos_token_id)


@pytest.mark.parametrize("attention_bias", [True, False])
def test_chatglm_checkpoint_loads_as_hf_tensors(tmp_path, attention_bias):
    model = build_tiny_hf_model(tmp_path / "hf", attention_bias=attention_bias)
    write_chatglm_checkpoint(model, tmp_path / "chatglm")
    config = load_config(tmp_path / "chatglm")
    assert config.attention_bias == attention_bias
    state = load_state_dict(tmp_path / "chatglm", config)
    assert_state_dicts_equal(state, model.state_dict())


def test_chatglm_fused_qkv_with_wrong_rows_is_a_clear_error(tmp_path):
    model = build_tiny_hf_model(tmp_path / "hf")
    write_chatglm_checkpoint(model, tmp_path / "chatglm")
    path = tmp_path / "chatglm" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "multi_query_group_num": 4}))
    with pytest.raises(ValueError, match=r"query_key_value\.(weight|bias) has 128 rows.*needs 192"):
        load_state_dict(tmp_path / "chatglm", load_config(tmp_path / "chatglm"))
