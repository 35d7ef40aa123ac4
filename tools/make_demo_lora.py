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

from pagedserve.lora.peft import HF_TARGETS, random_adapter_tensors

ROOT = Path(__file__).resolve().parents[1]
RANK, ALPHA, SEED = 8, 16, 0


def main() -> None:
    config = json.loads((ROOT / "pagedserve" / "demo_model" / "config.json").read_text())
    tensors = random_adapter_tensors(config, RANK, torch.Generator().manual_seed(SEED), 0.05)
    out = ROOT / "pagedserve" / "demo_lora"
    out.mkdir(exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "base_model_name_or_path": "demo",
        "r": RANK,
        "lora_alpha": ALPHA,
        "target_modules": sorted(HF_TARGETS),
        "bias": "none",
        "lora_dropout": 0.0,
    }
    (out / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
