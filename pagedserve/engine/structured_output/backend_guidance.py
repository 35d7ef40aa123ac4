"""The llguidance grammars of request constraints, and the check that turns a bad one into a
message before the request is queued (the HTTP process calls ``check_structured_outputs``).

The grammar engine is llguidance (benchmarks/grammar_engines.py and the README say why).
"""

from __future__ import annotations

import json
from functools import lru_cache

import llguidance
import tokenizers

from pagedserve.sampling_params import StructuredOutputsParams

# Between JSON tokens at most one space: a weak model cannot spend its max_tokens on whitespace,
# and ", " / ": " (json.dumps' own separators) stay possible.
JSON_WHITESPACE = r"[ ]?"
JSON_OPTIONS = {"whitespace_pattern": JSON_WHITESPACE}
GRAMMAR_CACHE_SIZE = 256
_OPEN_OBJECT_KEYS = ("additionalProperties", "unevaluatedProperties", "patternProperties")


def text_tokenizer(tokenizer_file, vocab_size: int, eos_token_ids: list[int]):
    """The vocabulary as llguidance sees it, built once per engine.

    Loaded by llguidance from tokenizer.json, its tokenization of text turns a special token's
    text into the special token, and it tokenizes the bytes a grammar forces: a regex holding the
    literal text ``<|assistant|>`` was offered token 4094, which its grammar then refused. Here
    text is tokenized with special tokens' text left as text; a special token is still what a
    grammar names as ``<|assistant|>`` (tool calls do)."""
    hf = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    hf.encode_special_tokens = True
    added = hf.get_added_tokens_decoder()
    loaded = llguidance.LLTokenizer(str(tokenizer_file))

    def token_bytes(i: int) -> bytes:
        if i in added:
            return added[i].content.encode()
        if hf.id_to_token(i) is None:  # the model's padding past the tokenizer: no text
            return b""
        return loaded.decode_bytes([i])

    class Vocabulary:  # what llguidance.TokenizerWrapper reads
        eos_token_id = eos_token_ids[0]
        bos_token_id = None
        special_token_ids = sorted(i for i, t in added.items() if t.special)
        tokens = [token_bytes(i) for i in range(vocab_size)]

        def __call__(self, text: bytes) -> list[int]:
            return hf.encode(text.decode(), add_special_tokens=False).ids

    wrapper = llguidance.TokenizerWrapper(Vocabulary())
    return llguidance.LLTokenizer(wrapper, eos_token=eos_token_ids)  # vocab_size: len(tokens)


def strict_schema(schema):
    """Objects that list their properties take no others unless the schema says so (xgrammar's
    strict mode, which vLLM and SGLang use by default): what is generated still validates against
    the schema as written, and a model cannot wander off into made-up keys."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_schema(v) for k, v in schema.items()}
    if "properties" in out and not any(k in out for k in _OPEN_OBJECT_KEYS):
        out["additionalProperties"] = False
    return out


def grammar_for(kind: str, spec: str) -> str:
    """The llguidance grammar of a constraint's ``key`` (not yet checked)."""
    if kind == "json":
        schema = strict_schema(json.loads(spec))
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, overrides=JSON_OPTIONS
        )
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        alternatives = " | ".join(json.dumps(c) for c in json.loads(spec))
        return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
    return llguidance.grammar_from("grammar", spec)  # Lark, or GBNF/EBNF (``root ::= ...``)


@lru_cache(maxsize=GRAMMAR_CACHE_SIZE)
def _check(kind: str, spec: str) -> str:
    try:
        grammar = grammar_for(kind, spec)
    except ValueError as e:
        return str(e)
    return llguidance.LLMatcher.validate_grammar(grammar)


def check_structured_outputs(params: StructuredOutputsParams) -> None:
    """Raise ``ValueError`` saying what is wrong with the constraint (unsupported keywords by
    name, regex syntax errors with their position, unknown grammar rules)."""
    kind, spec = params.key
    error = _check(kind, spec)
    if error:
        # the kinds named as users know them (json_object never fails: its grammar is fixed)
        what = {"json": "JSON schema", "choice": "choice list"}
        raise ValueError(f"the {what.get(kind, kind)} cannot be used for decoding: {error}")
