"""xgrammar against llguidance on our tokenizers: compile time and the per-token mask cost.

    python -m benchmarks.grammar_engines [--tokenizer DIR_OR_FILE ...]

For each tokenizer (default: the demo model's 4,096 tokens; pass a GLM-4-sized tokenizer.json
too) and each engine that imports here, the time to build the engine's view of the vocabulary,
to compile a nested JSON schema and a regex, and to fill one row's token bitmask at each step of a
valid answer (the answer's own tokens accepted in turn). xgrammar is not a dependency: run this
from a virtual environment that has it (README, "Structured output").
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from benchmarks.results import write_result
from pagedserve.models.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
}
ANSWER = (
    '{"name": "Ada Lovelace", "age": 36, "role": "admin", "tags": ["math", "poetry"], '
    '"address": {"city": "London", "zip": "W1"}}'
)
REGEX = r"\d{3}-\d{3}-\d{4}"
REGEX_ANSWER = "555-123-4567"


def _tokenizer_file(path: str) -> Path:
    p = Path(path)
    return p / "tokenizer.json" if p.is_dir() else p


def bench_llguidance(tok_file: Path, ids: list[int], regex_ids: list[int], vocab: int) -> dict:
    import llguidance
    import llguidance.numpy as lnp

    t0 = time.perf_counter()
    tok = llguidance.LLTokenizer(str(tok_file), n_vocab=vocab)
    vocab_s = time.perf_counter() - t0

    def compile_(grammar: str):
        t = time.perf_counter()
        m = llguidance.LLMatcher(tok, grammar, log_level=0)
        return m, time.perf_counter() - t

    opts = {"whitespace_pattern": r"[ ]?"}
    matcher, schema_s = compile_(
        llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, overrides=opts)
    )
    _, regex_s = compile_(llguidance.LLMatcher.grammar_from_regex(REGEX))
    mask = lnp.allocate_token_bitmask(1, vocab)
    times = []
    for token in ids:
        t = time.perf_counter()
        lnp.fill_next_token_bitmask(matcher, mask, 0)
        times.append(time.perf_counter() - t)
        assert matcher.consume_token(token), matcher.get_error()
    return _figures(vocab_s, schema_s, regex_s, times)


def bench_xgrammar(tok_file: Path, ids: list[int], regex_ids: list[int], vocab: int) -> dict:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    t0 = time.perf_counter()
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tok_file))
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    vocab_s = time.perf_counter() - t0
    t = time.perf_counter()
    compiled = compiler.compile_json_schema(
        json.dumps(SCHEMA), any_whitespace=True, max_whitespace_cnt=1
    )
    schema_s = time.perf_counter() - t
    t = time.perf_counter()
    compiler.compile_regex(REGEX)
    regex_s = time.perf_counter() - t
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, vocab)
    times = []
    for token in ids:
        t = time.perf_counter()
        matcher.fill_next_token_bitmask(mask, 0)
        times.append(time.perf_counter() - t)
        assert matcher.accept_token(token)
    return _figures(vocab_s, schema_s, regex_s, times)


def _figures(vocab_s: float, schema_s: float, regex_s: float, mask_times: list[float]) -> dict:
    return {
        "vocab_setup_ms": round(vocab_s * 1e3, 2),
        "compile_json_schema_ms": round(schema_s * 1e3, 2),
        "compile_regex_ms": round(regex_s * 1e3, 2),
        "mask_per_token_us": {
            "median": round(statistics.median(mask_times) * 1e6, 1),
            "mean": round(statistics.mean(mask_times) * 1e6, 1),
            "max": round(max(mask_times) * 1e6, 1),
            "tokens": len(mask_times),
        },
    }


ENGINES = {"llguidance": bench_llguidance, "xgrammar": bench_xgrammar}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    demo = str(Path(__file__).resolve().parents[1] / "pagedserve" / "demo_model")
    parser.add_argument("--tokenizer", action="append", help="tokenizer.json or its directory")
    parser.add_argument("--output", default="grammar_engines", help="results file name")
    args = parser.parse_args()
    results = {}
    for path in args.tokenizer or [demo]:
        tok_file = _tokenizer_file(path)
        tokenizer = Tokenizer(tok_file.parent)
        vocab = tokenizer.vocab_size
        ids = tokenizer.encode(ANSWER, add_special_tokens=False)
        regex_ids = tokenizer.encode(REGEX_ANSWER, add_special_tokens=False)
        entry = {"vocab_size": vocab, "answer_tokens": len(ids)}
        for name, bench in ENGINES.items():
            try:
                entry[name] = bench(tok_file, ids, regex_ids, vocab)
            except ImportError as e:
                entry[name] = f"not installed: {e}"
        results[f"vocab_{vocab}"] = entry
        print(json.dumps({f"vocab_{vocab}": entry}, indent=2))
    print(write_result(args.output, {"schema": SCHEMA, "results": results}))


if __name__ == "__main__":
    main()
