"""Held-out bits per character of the demo model, measured through the server (echo + logprobs),
as lm-eval measures a served model.

    python -m benchmarks.demo_heldout [--base-url URL] [--chars N]

Without --base-url it starts `pagedserve serve` on the embedded demo model on a free port. Four
held-out sets from pagedserve/data, none of them trained on (tools/demo_corpus.py builds them):
- cpython (demo_heldout.txt): the start of every CPython document (help topic or standard-library
  module) held out by name: the model's own domain;
- prose (demo_heldout_prose.txt): the English prose paragraphs of the documentation pages held
  out by name (the manuals of Python, Django, PostgreSQL, SQLite, Sphinx, docutils, requests);
- dictionaries (demo_heldout_dictionaries.txt): the same of the held-out entries of the Devil's
  Dictionary and the Jargon File (literary and slang English);
- chat (demo_heldout_chat.jsonl): held-out chat turns, scored on the answer given the question
  in the chat template.
A text goes to /v1/completions as token-id prompts with `echo` and `logprobs`, cut into the same
blocks as tools/train_demo.py's measure (257 tokens, each opening on the previous block's last
token, the first on <|endoftext|>), so the server's figure and metrics.json's are the same
quantity; the prompt tokens' logprobs, summed, give the bits per character.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
DEMO_DIR = ROOT / "pagedserve" / "demo_model"
DATA = ROOT / "pagedserve" / "data"
HELDOUT_FILE = DATA / "demo_heldout.txt"
PROSE_FILE = DATA / "demo_heldout_prose.txt"
DICTIONARIES_FILE = DATA / "demo_heldout_dictionaries.txt"
CHAT_FILE = DATA / "demo_heldout_chat.jsonl"
TEXT_FILES = {"cpython": HELDOUT_FILE, "prose": PROSE_FILE, "dictionaries": DICTIONARIES_FILE}
CHAT_PROMPT = "[gMASK]<sop><|user|>\n{question}<|assistant|>\n"  # the chat template's turn
BLOCK = 256


def heldout_blocks(tokenizer, text: str, block: int = BLOCK) -> list[list[int]]:
    """Token-id blocks of block + 1 tokens; every token of `text` is predicted exactly once."""
    ids = [tokenizer.token_to_id("<|endoftext|>")] + tokenizer.encode(text).ids
    return [ids[start : start + block + 1] for start in range(0, len(ids) - 1, block)]


def block_nll(client: httpx.Client, url: str, block: list[int], scored_from: int = 1) -> float:
    """Nats the server's model spends on block[scored_from:], read from the echoed prompt
    logprobs."""
    body = {"prompt": block, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True}
    response = client.post(url + "/v1/completions", json=body, timeout=600)
    response.raise_for_status()
    logprobs = response.json()["choices"][0]["logprobs"]["token_logprobs"][: len(block)]
    assert logprobs[0] is None and None not in logprobs[1:], "the server sent no prompt logprobs"
    return -sum(logprobs[scored_from:])


def _tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(DEMO_DIR / "tokenizer.json"))


def _figures(nll: float, tokens: int, chars: int) -> dict:
    return {
        "heldout_chars": chars,
        "heldout_tokens": tokens,
        "heldout_bits_per_char": nll / math.log(2) / chars,
        "heldout_perplexity_per_token": math.exp(nll / tokens),
    }


def server_bits_per_char(url: str, text: str, concurrency: int = 4) -> dict:
    """Bits per character of the served demo model on `text`, with the token and character counts."""
    blocks = heldout_blocks(_tokenizer(), text)
    with httpx.Client() as client, ThreadPoolExecutor(concurrency) as pool:
        nll = sum(pool.map(lambda b: block_nll(client, url, b), blocks))
    return _figures(nll, sum(len(b) - 1 for b in blocks), len(text))


def chat_turns(path: Path = CHAT_FILE) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def server_chat_bits_per_char(url: str, turns: list[dict], concurrency: int = 4) -> dict:
    """Bits per character of the answers of `turns` ({"question", "answer"}), each answer scored
    after its question in the chat template, as tools/train_demo.py's chat figure."""
    tokenizer = _tokenizer()
    prompts = [tokenizer.encode(CHAT_PROMPT.format(question=t["question"])).ids for t in turns]
    answers = [tokenizer.encode(t["answer"]).ids for t in turns]

    def nll(i: int) -> float:
        return block_nll(client, url, prompts[i] + answers[i], scored_from=len(prompts[i]))

    with httpx.Client() as client, ThreadPoolExecutor(concurrency) as pool:
        total = sum(pool.map(nll, range(len(turns))))
    return _figures(total, sum(map(len, answers)), sum(len(t["answer"]) for t in turns))


def measure_all(url: str, chars: int | None = None) -> dict:
    """Every held-out set, by name."""
    figures = {
        name: server_bits_per_char(url, path.read_text("utf-8")[:chars])
        for name, path in TEXT_FILES.items()
    }
    figures["chat"] = server_chat_bits_per_char(url, chat_turns())
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--base-url", help="a running server on the demo model (default: start one)")
    ap.add_argument("--chars", type=int, default=None, help="only the first N characters")
    args = ap.parse_args()
    from benchmarks.results import write_result
    from pagedserve.testing import serve

    with contextlib.ExitStack() as stack:
        url = (
            args.base_url
            or stack.enter_context(serve("--num-kv-pages", "512", log_level="warning"))[1]
        )
        figures = measure_all(url, args.chars)
    for name, row in figures.items():
        print(
            f"{name}: held-out bits/char through the server {row['heldout_bits_per_char']:.4f} "
            f"({row['heldout_chars']} chars, {row['heldout_tokens']} tokens)"
        )
    write_result("demo_heldout", figures)


if __name__ == "__main__":
    main()
