"""Builders for tiny GLM-4 model directories: HF checkpoints, chatglm checkpoints, a tokenizer."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

# transformers' GLM models, imported with this module rather than by the first model built: a
# test module that imports this one builds models, and a runner that forks a process per run
# after collecting the tests (mutmut's fork server) then imports them once, not once a run (most
# of a run's time on this 2-core machine: some 10 s)
from transformers import Glm4Config, Glm4ForCausalLM, GlmConfig, GlmForCausalLM

from pagedserve.models.tokenizer import SPECIAL_TOKENS as GLM4_SPECIAL_TOKENS

SPECIAL_TOKENS = list(GLM4_SPECIAL_TOKENS)
SPECIAL_IDS = {token: i for i, token in enumerate(SPECIAL_TOKENS)}  # the trainer puts them first
STOP_IDS = [SPECIAL_IDS[t] for t in ("<|endoftext|>", "<|user|>", "<|observation|>")]

TINY_VOCAB = 320  # the model's vocabulary; the tiny tokenizer uses at most 300 of it

GLM4_CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{% if tools %}<|system|>\n{{ tools | tojson }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'observation'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_TRAINING_TEXT = """\
The quick brown fox jumps over the lazy dog. A paged attention engine stores keys and values
in fixed-size blocks. Hello world! The scheduler batches requests; the model runner samples the
next token. 你好，世界。 Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.
"""


def build_tiny_tokenizer(
    model_dir: str | Path,
    chat_template: str | None = GLM4_CHAT_TEMPLATE,
    prefix_in_post_processor: bool = False,
    vocab_size: int = 300,
    special_tokens: tuple[str, ...] = SPECIAL_TOKENS,
) -> Path:
    """Write tokenizer.json and tokenizer_config.json: byte-level BPE with GLM-4's special tokens
    (or the ``special_tokens`` given: none, for a tokenizer that has no special tokens)."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([_TRAINING_TEXT], trainer)
    if prefix_in_post_processor:
        tokenizer.post_processor = processors.TemplateProcessing(
            single="[gMASK] <sop> $A",
            pair="[gMASK] <sop> $A $B",
            special_tokens=[(t, SPECIAL_IDS[t]) for t in ("[gMASK]", "<sop>")],
        )
    tokenizer.save(str(model_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return model_dir


def tiny_hf_config(architecture: str = "glm", **overrides):
    """A transformers GlmConfig / Glm4Config with tiny dimensions."""
    kwargs = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        pad_token_id=SPECIAL_IDS["<|endoftext|>"],
        eos_token_id=STOP_IDS,
    )
    kwargs.update(overrides)
    return {"glm": GlmConfig, "glm4": Glm4Config}[architecture](**kwargs)


def build_tiny_hf_model(
    model_dir: str | Path,
    architecture: str = "glm",
    seed: int = 0,
    max_shard_size: str | None = None,
    **overrides,
):
    """Save a random GlmForCausalLM / Glm4ForCausalLM to model_dir and return it (fp32, eval)."""
    torch.manual_seed(seed)
    config = tiny_hf_config(architecture, **overrides)
    model_cls = {"glm": GlmForCausalLM, "glm4": Glm4ForCausalLM}[architecture]
    model = model_cls(config).eval()
    _randomize_norms_and_biases(model)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(str(model_dir), safe_serialization=True, **kwargs)
    return model


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of ``prompt``: exactly ``n`` token ids."""
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def build_tiny_model_dir(model_dir: str | Path, architecture: str = "glm", **overrides):
    """A complete tiny model directory (weights, config, tokenizer); returns the HF model."""
    build_tiny_tokenizer(model_dir)
    return build_tiny_hf_model(model_dir, architecture, **overrides)


def _randomize_norms_and_biases(model: torch.nn.Module) -> None:
    # HF initialises norms to 1 and biases to 0; random values catch swapped tensors.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.05 * torch.randn_like(param))


_HF_TO_CHATGLM = [
    (r"^model\.embed_tokens\.", "transformer.embedding.word_embeddings."),
    (r"^model\.norm\.", "transformer.encoder.final_layernorm."),
    (r"^lm_head\.", "transformer.output_layer."),
    (r"^model\.layers\.", "transformer.encoder.layers."),
    (r"\.self_attn\.o_proj\.", ".self_attention.dense."),
    (r"\.mlp\.gate_up_proj\.", ".mlp.dense_h_to_4h."),
    (r"\.mlp\.down_proj\.", ".mlp.dense_4h_to_h."),
]


def hf_to_chatglm_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename a GlmForCausalLM state dict to THUDM chatglm names, fusing q/k/v."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        qkv = re.match(r"^(.*)\.self_attn\.q_proj\.(weight|bias)$", name)
        if qkv:
            layer, suffix = qkv.groups()
            parts = [state[f"{layer}.self_attn.{p}_proj.{suffix}"] for p in "qkv"]
            name, tensor = f"{layer}.self_attention.query_key_value.{suffix}", torch.cat(parts)
        elif re.search(r"\.self_attn\.[kv]_proj\.", name):
            continue
        for pattern, replacement in _HF_TO_CHATGLM:
            name = re.sub(pattern, replacement, name)
        out[name] = tensor.clone().contiguous()
    return out


def chatglm_config_dict(hf_config, rope_ratio: float = 500.0) -> dict:
    """The THUDM config.json for a model with hf_config's dimensions."""
    return {
        "model_type": "chatglm",
        "architectures": ["ChatGLMModel"],
        "add_bias_linear": False,
        "add_qkv_bias": hf_config.attention_bias,
        "apply_residual_connection_post_layernorm": False,
        "ffn_hidden_size": hf_config.intermediate_size,
        "hidden_size": hf_config.hidden_size,
        "kv_channels": hf_config.head_dim,
        "layernorm_epsilon": hf_config.rms_norm_eps,
        "multi_query_attention": True,
        "multi_query_group_num": hf_config.num_key_value_heads,
        "num_attention_heads": hf_config.num_attention_heads,
        "num_layers": hf_config.num_hidden_layers,
        "original_rope": True,
        "padded_vocab_size": hf_config.vocab_size,
        "post_layer_norm": True,
        "rmsnorm": True,
        "rope_ratio": rope_ratio,
        "seq_length": hf_config.max_position_embeddings,
        "eos_token_id": hf_config.eos_token_id,
        "pad_token_id": hf_config.pad_token_id,
        "torch_dtype": "float32",
        "tie_word_embeddings": False,
    }


def write_chatglm_checkpoint(model, model_dir: str | Path, rope_ratio: float = 500.0) -> Path:
    """Save a GlmForCausalLM in the original THUDM chatglm format (config.json + safetensors)."""
    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    state = hf_to_chatglm_state_dict(model.state_dict())
    rot = int(model.config.head_dim * 0.5)
    state["transformer.rotary_pos_emb.inv_freq"] = 1.0 / (
        (10000.0 * rope_ratio) ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot)
    )
    save_file(state, str(model_dir / "model.safetensors"))
    config = chatglm_config_dict(model.config, rope_ratio)
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))
    return model_dir


def prompt_logprobs(llm, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: pagedserve's log-probabilities of every vocabulary entry at each
    prompt position after the first (its prompt_logprobs with top-N = the whole vocabulary)."""
    from pagedserve import SamplingParams

    vocab = llm.llm_engine.model_config.vocab_size
    out = llm.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(max_tokens=1, prompt_logprobs=vocab, temperature=0.0),
        use_tqdm=False,
    )[0]
    assert out.prompt_logprobs[0] is None
    return torch.tensor([[lp[t] for t in range(vocab)] for lp in out.prompt_logprobs[1:]])


def assert_logprobs_close(got: torch.Tensor, ref: torch.Tensor, atol: float, max_kl: float):
    """Log-probabilities [positions, vocab] as close to the reference as the dtype allows: each
    entry within ``atol``, and each position's distribution within ``max_kl`` of the reference's
    (KL(ref || got)). The tiny models' distributions are nearly flat (the top two tokens within
    0.002 nats), so the top token is no test; a wrong layer moves the KL by 10x or more."""
    torch.testing.assert_close(got, ref, atol=atol, rtol=0.0)
    kl = torch.nn.functional.kl_div(got, ref, log_target=True, reduction="none").sum(-1)
    assert kl.max().item() <= max_kl, f"KL divergence {kl.max().item():.2e} > {max_kl:.0e}"


def tiny_engine(model_dir, **settings):
    """An ``LLMEngine`` over a tiny model directory, in fp32 on the plain CPU (the suite's
    servers' engine); ``settings`` size its pool and limits."""
    from pagedserve.config import EngineConfig
    from pagedserve.engine.llm_engine import LLMEngine

    config = EngineConfig.from_kwargs(
        model=str(model_dir), dtype="float32", device="cpu", **settings
    )
    return LLMEngine(config)


def drain(engine, outputs=(), max_steps: int = 500) -> dict:
    """Step an ``LLMEngine`` until no request is unfinished: each request id's last output,
    ``outputs`` (those of earlier steps) included. An engine still busy after ``max_steps`` steps
    fails the test at once, rather than when pytest's timeout runs out."""
    last = {o.request_id: o for o in outputs}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return last
        last.update((o.request_id, o) for o in engine.step())
    raise AssertionError(f"the engine still has unfinished requests after {max_steps} steps")


def host_tier_gib(model_dir, num_frames: int, block_size: int, dtype_bytes: int = 4) -> float:
    """The GiB that make ``num_frames`` host-tier frames of a model's KV pages (for
    ``swap_space`` and ``host_prefix_cache``, which are set in GiB)."""
    from pagedserve.models import load_config

    config = load_config(model_dir)
    page_bytes = block_size * config.kv_bytes_per_token(config.num_key_value_heads, dtype_bytes)
    return num_frames * page_bytes / 2**30
