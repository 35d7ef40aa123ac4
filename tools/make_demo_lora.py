"""Write the random LoRA adapter of the demo model that ships in pagedserve/demo_lora/, so that the
README's LoRA examples run with nothing but the package:

    python tools/make_demo_lora.py   # writes pagedserve/demo_lora/ (the same bytes every time)

A PEFT directory (adapter_config.json + adapter_model.safetensors, bf16) of rank 8 on all six
linear modules of every layer, with random A and B: it changes the demo model's answers and
teaches it nothing. A real adapter comes from fine-tuning (PEFT's ``save_pretrained``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
RANK, ALPHA, SEED = 8, 16, 0


def main() -> None:
    config = json.loads((ROOT / "pagedserve" / "demo_model" / "config.json").read_text())
    h, inter, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    modules = {
        "self_attn.q_proj": (h, q),
        "self_attn.k_proj": (h, kv),
        "self_attn.v_proj": (h, kv),
        "self_attn.o_proj": (q, h),
        "mlp.gate_up_proj": (h, 2 * inter),
        "mlp.down_proj": (inter, h),
    }
    g = torch.Generator().manual_seed(SEED)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (fan_in, fan_out) in modules.items():
            name = f"base_model.model.model.layers.{layer}.{module}"
            a = torch.randn(RANK, fan_in, generator=g) / fan_in**0.5
            b = torch.randn(fan_out, RANK, generator=g) * 0.05
            tensors[f"{name}.lora_A.weight"] = a.to(torch.bfloat16)
            tensors[f"{name}.lora_B.weight"] = b.to(torch.bfloat16)
    out = ROOT / "pagedserve" / "demo_lora"
    out.mkdir(exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "base_model_name_or_path": "demo",
        "r": RANK,
        "lora_alpha": ALPHA,
        "target_modules": sorted(m.rsplit(".", 1)[1] for m in modules),
        "bias": "none",
        "lora_dropout": 0.0,
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
