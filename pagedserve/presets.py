"""What ships in the package besides code: the device and model presets and the embedded demo
model, found through ``importlib.resources`` so that a wheel install finds them just as a source
checkout does. No torch here: ``tune`` and ``bench`` use it.

``demo`` names the embedded demo model everywhere: ``serve --model``, ``LLM(model=...)``, ``tune
--model`` (its preset), ``bench --tokenizer``, ``quantize --model-path``, ``eval-quant``.

The YAML files live in ``pagedserve/configs/{devices,models}/``; the top-level ``configs/`` of the
repository is a link to that directory.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

DEMO_MODEL = "demo"
DEMO_MODEL_PRESET = "glm4-demo"  # the demo model's shapes in configs/models
PRESET_KINDS = ("devices", "models")


def demo_model_dir() -> Path:
    return Path(str(files("pagedserve") / "demo_model"))


def demo_lora_dir() -> Path:
    """A random LoRA adapter of the demo model (tools/make_demo_lora.py), to try LoRA with."""
    return Path(str(files("pagedserve") / "demo_lora"))


def preset_names(kind: str) -> list[str]:
    """The preset names of ``kind`` ("devices" or "models") that ship with the package."""
    return sorted(
        entry.name.removesuffix(".yaml")
        for entry in _preset_dir(kind).iterdir()
        if entry.name.endswith(".yaml")
    )


def find_preset(kind: str, spec: str) -> Path | None:
    """The YAML file that ``spec`` names: a path to a YAML file as given, else the packaged
    preset of that name (``demo``: the demo model's); None when there is none."""
    path = Path(spec)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path
    if kind == "models" and spec == DEMO_MODEL:
        spec = DEMO_MODEL_PRESET
    entry = _preset_dir(kind) / f"{spec}.yaml"
    return Path(str(entry)) if entry.is_file() else None


def _preset_dir(kind: str):
    if kind not in PRESET_KINDS:
        raise ValueError(f"preset kind {kind!r}: use one of {', '.join(PRESET_KINDS)}")
    return files("pagedserve") / "configs" / kind


def parse_cards(value: int | str) -> int | None:
    """A device preset's ``cards``: a count, or ``per-process`` (the plain CPU: as many as there
    are processes), which is None."""
    if value == "per-process":
        return None
    if not isinstance(value, int) or value < 1:
        raise ValueError(
            f"device preset cards: {value!r}; write a count of 1 or more or per-process"
        )
    return value
