"""The random GLM-4-0414 models every benchmark here runs, built with our own code and cached.

Random weights make the speed of a real model of that shape (the work per token depends only on
the shapes), and nothing needs downloading. Each directory is a Hugging Face checkpoint
(config.json, bf16 safetensors, a byte-level BPE tokenizer with GLM-4's special tokens) that
pagedserve, transformers, vLLM and llama.cpp's converter all load.

    python -m benchmarks.bench_models 122m [DIR]     # build one (default DIR: see model_dir)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from pagedserve.models.tokenizer import SPECIAL_TOKENS

SHAPES = {
    # ~122M: the model of the earlier offline and serving figures
    "122m": dict(
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=2048,
        vocab_size=32000,
    ),
    # ~1.0B: GLM-4-9B's head_dim and GQA ratio at a size this machine runs in seconds
    "1b": dict(
        hidden_size=2048,
        num_hidden_layers=20,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=128,
        intermediate_size=5632,
        vocab_size=32000,
    ),
}


def cache_root() -> Path:
    root = os.environ.get("PAGEDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pagedserve"
    return Path(root) / "bench"


def model_dir(name: str) -> Path:
    return cache_root() / f"glm4-{name}"


def num_parameters(name: str) -> int:
    s = SHAPES[name]
    h, layers, inter, vocab = (
        s["hidden_size"],
        s["num_hidden_layers"],
        s["intermediate_size"],
        s["vocab_size"],
    )
    q, kv = s["num_attention_heads"] * s["head_dim"], s["num_key_value_heads"] * s["head_dim"]
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * inter
    return 2 * vocab * h + layers * per_layer


def build_model(name: str, path: Path | None = None, seed: int = 0) -> Path:
    """The model directory, built once (a few seconds for 122m, a minute for 1b)."""
    path = path or model_dir(name)
    if (path / "model.safetensors").is_file():
        return path
    from safetensors.torch import save_file

    print(f"building the random {name} GLM-4-0414 model in {path} ...", file=sys.stderr, flush=True)
    path.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(path)
    config = {
        "architectures": ["Glm4ForCausalLM"],
        "model_type": "glm4",
        **SHAPES[name],
        "partial_rotary_factor": 0.5,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "attention_bias": True,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "eos_token_id": [0, 7, 9],
        "pad_token_id": 0,
        "torch_dtype": "bfloat16",
        "hidden_act": "silu",
    }
    (path / "config.json").write_text(json.dumps(config, indent=2))
    tmp = path / "model.safetensors.tmp"
    save_file(_random_weights(SHAPES[name], seed), str(tmp), metadata={"format": "pt"})
    tmp.rename(path / "model.safetensors")
    return path


def _write_tokenizer(path: Path) -> None:
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=8000,
        special_tokens=list(SPECIAL_TOKENS),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(list(topics.values()), trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
            }
        )
    )


def _random_weights(shape: dict, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    h, inter, vocab, d = (
        shape["hidden_size"],
        shape["intermediate_size"],
        shape["vocab_size"],
        shape["head_dim"],
    )
    q, kv = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d

    def rand(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=g) * 0.02).to(torch.bfloat16)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    sd = {
        "model.embed_tokens.weight": rand(vocab, h),
        "lm_head.weight": rand(vocab, h),
        "model.norm.weight": ones(h),
    }
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd |= {
            p + "self_attn.q_proj.weight": rand(q, h),
            p + "self_attn.q_proj.bias": rand(q),
            p + "self_attn.k_proj.weight": rand(kv, h),
            p + "self_attn.k_proj.bias": rand(kv),
            p + "self_attn.v_proj.weight": rand(kv, h),
            p + "self_attn.v_proj.bias": rand(kv),
            p + "self_attn.o_proj.weight": rand(h, q),
            p + "mlp.gate_up_proj.weight": rand(2 * inter, h),
            p + "mlp.down_proj.weight": rand(h, inter),
        }
        for norm in (
            "input_layernorm",
            "post_attention_layernorm",
            "post_self_attn_layernorm",
            "post_mlp_layernorm",
        ):
            sd[p + norm + ".weight"] = ones(h)
    return sd


if __name__ == "__main__":
    name = sys.argv[1] if len(sys.argv) > 1 else "122m"
    print(build_model(name, Path(sys.argv[2]) if len(sys.argv) > 2 else None))
