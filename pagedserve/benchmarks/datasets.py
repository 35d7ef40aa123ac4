"""The serving benchmark's prompts, as vLLM's ``bench serve`` datasets: random words of an exact
token length, ShareGPT conversations, and prompts that share one of a few prefixes.

Prompt lengths are tokens as the server counts a prompt (its special tokens included, as vLLM's
random dataset aims), measured with a local tokenizer or the server's own ``/tokenize`` and
``/detokenize``; with neither they are word counts.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx

from pagedserve.presets import DEMO_MODEL, demo_model_dir

DEFAULT_RANDOM_INPUT_LEN = 1024
DEFAULT_RANDOM_OUTPUT_LEN = 128
MAX_LENGTH_ADJUSTMENTS = 8
WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force "
    "education river light green quick brown fox jumps over lazy dog paper model engine cache"
).split()


@dataclass(slots=True)
class SampleRequest:
    prompt: str
    prompt_len: int
    output_len: int


class PromptTokenizer(Protocol):
    """What the datasets need of a tokenizer: pagedserve's ``Tokenizer`` and the server's."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class ServerTokenizer:
    """The server's ``POST /tokenize`` and ``POST /detokenize`` (pagedserve's and vLLM's)."""

    def __init__(self, http: httpx.Client, model: str) -> None:
        self.http, self.model = http, model

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        body = {"model": self.model, "prompt": text, "add_special_tokens": add_special_tokens}
        response = self.http.post("/tokenize", json=body)
        response.raise_for_status()
        return response.json()["tokens"]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        response = self.http.post("/detokenize", json={"model": self.model, "tokens": ids})
        response.raise_for_status()
        return response.json()["prompt"]

    def works(self) -> bool:
        try:
            return bool(self.encode("Hello", add_special_tokens=False))
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return False


def tokenizer_file(spec: str) -> Path:
    """The tokenizer.json that ``--tokenizer`` names: ``demo``, a model directory or the file."""
    path = demo_model_dir() if spec == DEMO_MODEL else Path(spec).expanduser()
    file = path / "tokenizer.json" if path.is_dir() else path
    if file.name != "tokenizer.json" or not file.is_file():
        raise ValueError(
            f"--tokenizer {spec!r}: no tokenizer.json there; give a model directory, the path "
            f"of its tokenizer.json, or {DEMO_MODEL} (the embedded demo model's)"
        )
    return file


def local_tokenizer(spec: str) -> PromptTokenizer:
    """A tokenizer on this machine, read as pagedserve's server reads it (GLM-4's prompt prefix
    included), so that its counts are the server's."""
    from pagedserve.models.tokenizer import Tokenizer

    return Tokenizer(tokenizer_file(spec).parent)


class PromptBuilder:
    """Token counts and random prompts of a given length, with a tokenizer or (estimates) without."""

    def __init__(self, tok: PromptTokenizer | None) -> None:
        self.tok = tok
        # what the server adds to a prompt (GLM-4: [gMASK]<sop>)
        self.num_special = self.count("x") - self.count("x", as_prompt=False) if tok else 0

    def count(self, text: str, as_prompt: bool = True) -> int | None:
        """Tokens of ``text``: as a prompt (the server's special tokens included) or bare."""
        return None if self.tok is None else len(self.tok.encode(text, as_prompt))

    def text(self, rng: random.Random, num_tokens: int, as_prompt: bool = True) -> tuple[str, int]:
        """(random words of ``num_tokens`` tokens, their real count). As vLLM's random dataset
        does: cut the words' token ids, decode, re-encode, adjust until the count is exact. The
        count is what the last try gave if no cut lands exactly; with no tokenizer, the words."""
        words = " ".join(rng.choice(WORDS) for _ in range(num_tokens))
        if self.tok is None:
            return words, num_tokens
        tok = self.tok
        extra = self.num_special if as_prompt else 0
        ids = tok.encode(words, add_special_tokens=False)[: max(1, num_tokens - extra)]
        for _ in range(MAX_LENGTH_ADJUSTMENTS):
            text = tok.decode(ids)
            got = self.count(text, as_prompt)
            if got == num_tokens:
                break
            ids = tok.encode(text, add_special_tokens=False)
            if got > num_tokens:
                ids = ids[: max(1, len(ids) - (got - num_tokens))]
            else:
                more = tok.encode(" " + rng.choice(WORDS), add_special_tokens=False)
                ids += more[: num_tokens - got]
        return text, got


def _lengths(rng: random.Random, mean: int, range_ratio: float) -> int:
    low, high = int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))
    return max(1, rng.randint(low, high))


def random_dataset(args: argparse.Namespace, prompts: PromptBuilder) -> list[SampleRequest]:
    rng = random.Random(args.seed)
    out = []
    for _ in range(args.num_prompts):
        n_in = _lengths(rng, args.random_input_len, args.random_range_ratio)
        n_out = _lengths(rng, args.random_output_len, args.random_range_ratio)
        prompt, n_in = prompts.text(rng, n_in)
        out.append(SampleRequest(prompt, n_in, n_out))
    return out


def prefix_repetition_dataset(
    args: argparse.Namespace, prompts: PromptBuilder
) -> list[SampleRequest]:
    rng = random.Random(args.seed)
    prefixes = [
        prompts.text(rng, args.prefix_repetition_prefix_len)[0]
        for _ in range(args.prefix_repetition_num_prefixes)
    ]
    out = []
    for i in range(args.num_prompts):
        suffix, _ = prompts.text(rng, args.prefix_repetition_suffix_len, as_prompt=False)
        prompt = prefixes[i % len(prefixes)] + " " + suffix
        n_in = prompts.count(prompt) or (
            args.prefix_repetition_prefix_len + args.prefix_repetition_suffix_len
        )
        out.append(SampleRequest(prompt, n_in, args.prefix_repetition_output_len))
    rng.shuffle(out)
    return out


SHAREGPT_NEEDS_PATH = (
    "--dataset sharegpt needs --dataset-path FILE.json (ShareGPT format: a list "
    'of {"conversations": [{"from": "human", "value": ...}, ...]})'
)


def sharegpt_dataset(args: argparse.Namespace, prompts: PromptBuilder) -> list[SampleRequest]:
    if not args.dataset_path:
        raise ValueError(SHAREGPT_NEEDS_PATH)
    data = json.loads(Path(args.dataset_path).read_text())
    pairs = [
        (c["conversations"][0]["value"], c["conversations"][1]["value"])
        for c in data
        if len(c.get("conversations", [])) >= 2
    ]
    random.Random(args.seed).shuffle(pairs)
    max_len = min(2048, args.max_model_len or 2048)
    out = []
    for prompt, reply in pairs:
        n_in = prompts.count(prompt) or len(prompt.split())
        n_out = args.sharegpt_output_len or prompts.count(reply, False) or len(reply.split())
        if n_in >= 4 and n_out >= 4 and n_in <= 1024 and n_in + n_out <= max_len:
            out.append(SampleRequest(prompt, n_in, n_out))
        if len(out) == args.num_prompts:
            break
    if len(out) < args.num_prompts:
        raise ValueError(
            f"{args.dataset_path} gives {len(out)} usable conversations (prompt "
            f"4..1024 tokens, prompt+reply <= {max_len}); --num-prompts is "
            f"{args.num_prompts}: lower it or use a larger file"
        )
    return out


DATASETS = {
    "random": random_dataset,
    "sharegpt": sharegpt_dataset,
    "prefix-repetition": prefix_repetition_dataset,
}
