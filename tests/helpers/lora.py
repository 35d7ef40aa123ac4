"""Random LoRA adapters for the tiny GLM-4 models, built with PEFT (the reference)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import save_file

HF_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"]


def build_peft_adapter(
    hf_model,
    out_dir: str | Path,
    seed: int,
    r: int = 8,
    lora_alpha: float = 16,
    target_modules: list[str] = HF_TARGETS,
    use_rslora: bool = False,
    strength: float = 2.0,
):
    """Save a random PEFT LoRA adapter of ``hf_model`` to ``out_dir``; returns the PEFT model
    (a copy of the base with the adapter, fp32, eval). Both A and B are random (B is zeros at
    PEFT's default init), scaled by ``strength`` so that greedy tokens differ from the base's."""
    torch.manual_seed(seed)
    config = LoraConfig(
        r=r,
        lora_alpha=lora_alpha,
        target_modules=target_modules,
        use_rslora=use_rslora,
        init_lora_weights=False,
        lora_dropout=0.0,
    )
    model = get_peft_model(copy.deepcopy(hf_model), config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(strength)
    model.save_pretrained(str(out_dir))
    return model


def write_adapter(out_dir: str | Path, tensors: dict[str, torch.Tensor], **config) -> Path:
    """An adapter directory of the given tensors (PEFT's names) and adapter_config.json fields."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.clone().contiguous() for k, v in tensors.items()},
        str(out_dir / "adapter_model.safetensors"),
    )
    fields = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "bias": "none", **config}
    (out_dir / "adapter_config.json").write_text(json.dumps(fields))
    return out_dir
