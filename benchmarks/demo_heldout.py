"""Held-out bits per character of the demo model, measured through the server (echo + logprobs).

    python -m benchmarks.demo_heldout [--base-url URL] [--chars N]

Without --base-url it starts `pagedserve serve` on the embedded demo model on a free port. The
text is pagedserve/data/demo_heldout.txt: the start of every CPython document (help topic or
standard-library module) that tools/train_demo.py held out by name and never trained on. It goes
to /v1/completions as token-id prompts with `echo` and `logprobs`, cut into the same blocks as
tools/train_demo.py's measure (257 tokens, each opening on the previous block's last token, the
first on <|endoftext|>), so the server's figure and metrics.json's are the same quantity; the
prompt tokens' logprobs, summed, give the bits per character.
"""

from __future__ import annotations

import argparse
import contextlib
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
DEMO_DIR = ROOT / "pagedserve" / "demo_model"
HELDOUT_FILE = ROOT / "pagedserve" / "data" / "demo_heldout.txt"
BLOCK = 256


def heldout_blocks(tokenizer, text: str, block: int = BLOCK) -> list[list[int]]:
    """Token-id blocks of block + 1 tokens; every token of `text` is predicted exactly once."""
    ids = [tokenizer.token_to_id("<|endoftext|>")] + tokenizer.encode(text).ids
    return [ids[start : start + block + 1] for start in range(0, len(ids) - 1, block)]


def block_nll(client: httpx.Client, url: str, block: list[int]) -> float:
    """Nats the server's model spends on block[1:], read from the echoed prompt logprobs."""
    body = {"prompt": block, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True}
    response = client.post(url + "/v1/completions", json=body, timeout=600)
    response.raise_for_status()
    logprobs = response.json()["choices"][0]["logprobs"]["token_logprobs"][: len(block)]
    assert logprobs[0] is None and None not in logprobs[1:], "the server sent no prompt logprobs"
    return -sum(logprobs[1:])


def server_bits_per_char(url: str, text: str, concurrency: int = 4) -> dict:
    """Bits per character of the served demo model on `text`, with the token and character counts."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(DEMO_DIR / "tokenizer.json"))
    blocks = heldout_blocks(tokenizer, text)
    with httpx.Client() as client, ThreadPoolExecutor(concurrency) as pool:
        nll = sum(pool.map(lambda b: block_nll(client, url, b), blocks))
    tokens = sum(len(b) - 1 for b in blocks)
    return {
        "heldout_chars": len(text),
        "heldout_tokens": tokens,
        "heldout_bits_per_char": nll / math.log(2) / len(text),
        "heldout_perplexity_per_token": math.exp(nll / tokens),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--base-url", help="a running server on the demo model (default: start one)")
    ap.add_argument("--chars", type=int, default=None, help="only the first N characters")
    args = ap.parse_args()
    from benchmarks.results import write_result
    from pagedserve.testing import serve

    text = HELDOUT_FILE.read_text(encoding="utf-8")[: args.chars]
    with contextlib.ExitStack() as stack:
        url = (
            args.base_url
            or stack.enter_context(serve("--num-kv-pages", "512", log_level="warning"))[1]
        )
        figures = server_bits_per_char(url, text)
    print(
        f"held-out bits/char through the server: {figures['heldout_bits_per_char']:.4f} "
        f"({figures['heldout_chars']} chars, {figures['heldout_tokens']} tokens)"
    )
    write_result("demo_heldout", figures)


if __name__ == "__main__":
    main()
