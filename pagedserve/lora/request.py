"""``LoRARequest`` as vLLM's (``vllm.lora.request``), and ``--lora-modules``' forms. No torch here:
the top-level package and the SDK may import it."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """One adapter a request runs with: ``lora_name`` (what a server's clients send as ``model``),
    ``lora_int_id`` (unique and > 0: the engine's key for it, in device slots, in the host cache
    and in the prefix cache's block hashes) and ``lora_path`` (a PEFT directory:
    ``adapter_config.json`` + ``adapter_model.safetensors``)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None  # the parent /v1/models names (default: the base model)

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer > 0, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")

    # vLLM's aliases
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


@dataclass(frozen=True)
class LoRAModulePath:
    """One ``--lora-modules`` entry: ``name=path`` or vLLM's JSON object."""

    name: str
    path: str
    base_model_name: str | None = None

    @classmethod
    def parse(cls, text: str) -> LoRAModulePath:
        """``name=path`` or ``{"name": ..., "path": ..., "base_model_name": ...}``; raises
        ``ValueError`` saying what is wrong."""
        text = text.strip()
        if text.startswith("{"):
            return cls._from_json(text)
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise ValueError(
                f"{text!r} is neither name=path nor a JSON object; write e.g. "
                'sql-lora=/adapters/sql or \'{"name": "sql-lora", "path": "/adapters/sql", '
                '"base_model_name": "glm-4"}\''
            )
        return cls(name, path)

    @classmethod
    def _from_json(cls, text: str) -> LoRAModulePath:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"not valid JSON ({e.msg} at character {e.pos}): {text!r}") from None
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object with name and path, got {text!r}")
        unknown = set(data) - {"name", "path", "base_model_name"}
        missing = [k for k in ("name", "path") if not isinstance(data.get(k), str) or not data[k]]
        if unknown or missing:
            problem = f"unknown keys {sorted(unknown)}" if unknown else f"missing {missing}"
            raise ValueError(
                f"{problem} in {text!r}; the keys are name, path and (optional) base_model_name"
            )
        return cls(data["name"], data["path"], data.get("base_model_name"))
