"""Calibration and evaluation token blocks: from a text or JSONL file, the shipped corpus, or
seeded random ids for a model directory without a tokenizer."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

DEFAULT_CORPUS = Path(__file__).parent / "data" / "calib.txt"
CORPUS_BYTES = 300_000


def read_texts(path: str | Path) -> list[str]:
    """Plain text (one document) or JSONL with a "text" field per line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"calibration/evaluation data {path} not found")
    if path.suffix in (".jsonl", ".json"):
        texts = []
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if line.strip():
                record = json.loads(line)
                if "text" not in record:
                    raise ValueError(f'{path} line {n}: a JSONL record needs a "text" field')
                texts.append(record["text"])
        return texts
    return [path.read_text(encoding="utf-8")]


def token_blocks(ids: list[int], num_samples: int, seq_len: int, what: str) -> torch.Tensor:
    """Up to ``num_samples`` consecutive blocks of ``seq_len`` ids, [B, seq_len] int64."""
    available = len(ids) // seq_len
    if available == 0:
        raise ValueError(
            f"{what}: {len(ids)} tokens is fewer than one block of {seq_len}; give more text or "
            f"a smaller sequence length"
        )
    if available < num_samples:
        logger.warning(
            "%s: only %d blocks of %d tokens (asked for %d)", what, available, seq_len, num_samples
        )
    n = min(available, num_samples)
    return torch.tensor(ids[: n * seq_len], dtype=torch.int64).view(n, seq_len)


def encode_texts(tokenizer, texts: list[str], max_tokens: int, chunk: int = 8192) -> list[int]:
    """Token ids of the texts in order, stopping once ``max_tokens`` are reached."""
    ids: list[int] = []
    for text in texts:
        for start in range(0, len(text), chunk):
            ids += tokenizer.encode(text[start : start + chunk], add_special_tokens=False)
            if len(ids) >= max_tokens:
                return ids
    return ids


def random_blocks(vocab_size: int, num_samples: int, seq_len: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (num_samples, seq_len), generator=g)


def load_blocks(
    tokenizer,
    data: str | Path | None,
    vocab_size: int,
    num_samples: int,
    seq_len: int,
    seed: int,
    default: Path,
    what: str,
) -> torch.Tensor:
    """Token blocks from ``data`` (else ``default``) when a tokenizer exists, else random ids."""
    if tokenizer is None:
        if data is not None:
            raise ValueError(
                f"{what}: the model directory has no tokenizer.json, so text in {data} cannot be "
                f"tokenized; drop the data option (random token ids are used) or add a tokenizer"
            )
        logger.info("%s: no tokenizer; using seeded random token ids", what)
        return random_blocks(vocab_size, num_samples, seq_len, seed)
    ids = encode_texts(tokenizer, read_texts(data or default), num_samples * seq_len)
    return token_blocks(ids, num_samples, seq_len, what)


def build_default_corpus(path: str | Path = DEFAULT_CORPUS, size: int = CORPUS_BYTES) -> Path:
    """The shipped calibration text: the first ``size`` bytes of CPython's pydoc topics."""
    from pydoc_data.topics import topics

    text, parts = "", []
    for name in sorted(topics):
        parts.append(topics[name].strip() + "\n\n")
        text = "".join(parts)
        if len(text.encode()) >= size:
            break
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text, encoding="utf-8")
    return Path(path)
