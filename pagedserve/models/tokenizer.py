"""GLM-4 tokenizer: a `tokenizers` tokenizer.json plus the checkpoint's jinja2 chat template."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from jinja2 import Template
from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from pagedserve.models.model_dir import ModelDirError, read_json_object

# GLM-4's special tokens, in the order of their ids in GLM-4's vocabulary (151329..151338).
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
)
PROMPT_PREFIX = ("[gMASK]", "<sop>")
STOP_TOKENS = ("<|endoftext|>", "<|user|>", "<|observation|>")


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: a model directory needs a tokenizer.json")
        self.model_dir = model_dir
        try:
            self._tokenizer = HFTokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception
            raise ModelDirError(path, f"cannot be read as a tokenizer ({e})") from None
        self.tokenizer_config = _read_json(model_dir / "tokenizer_config.json")
        self.bos_token = _token_text(self.tokenizer_config.get("bos_token"))
        self.eos_token = _token_text(self.tokenizer_config.get("eos_token"))
        self.chat_template = _read_chat_template(model_dir, self.tokenizer_config)
        self.eos_token_ids = self._find_eos_token_ids()
        self.prompt_prefix_ids = self._find_prompt_prefix()

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def all_special_ids(self) -> list[int]:
        decoder = self._tokenizer.get_added_tokens_decoder()
        return sorted(i for i, token in decoder.items() if token.special)

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tokenizer.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        return self._with_prefix(ids) if add_special_tokens else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        if self.chat_template is None:
            raise ValueError(
                f"{self.model_dir} has no chat template (chat_template.jinja, or chat_template in "
                f"tokenizer_config.json); send a completion prompt, or add the model's "
                f"chat_template.jinja to the directory"
            )
        prompt = _compile(self.chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **kwargs,
        )
        if not tokenize:
            return prompt
        return self._with_prefix(self.encode(prompt, add_special_tokens=False))

    def _with_prefix(self, ids: list[int]) -> list[int]:
        prefix = self.prompt_prefix_ids
        if prefix and ids[: len(prefix)] != prefix:
            return prefix + ids
        return ids

    def _find_prompt_prefix(self) -> list[int]:
        prefix = [self.token_to_id(token) for token in PROMPT_PREFIX]
        return [] if None in prefix else prefix

    def _find_eos_token_ids(self) -> list[int]:
        ids = [self.token_to_id(t) for t in (*STOP_TOKENS, self.eos_token) if t is not None]
        for name in ("generation_config.json", "config.json"):
            ids += _id_list(_read_json(self.model_dir / name).get("eos_token_id"))
        return list(dict.fromkeys(i for i in ids if i is not None))


def _read_json(path: Path) -> dict[str, Any]:
    return read_json_object(path) if path.is_file() else {}


def _token_text(token: str | dict | None) -> str | None:
    return token.get("content") if isinstance(token, dict) else token


def _id_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


def _read_chat_template(model_dir: Path, tokenizer_config: dict[str, Any]) -> str | None:
    path = model_dir / "chat_template.jinja"
    if path.is_file():
        return path.read_text()
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    return template


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, sort_keys: bool = False
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=8)
def _compile(template: str) -> Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)
