"""Structured output, as vLLM v1's StructuredOutputManager: grammars compiled off the engine loop
and cached by key, one matcher per constrained sequence, one token bitmask row per sampled row.

The grammar engine is llguidance (benchmarks/grammar_engines.py and the README say why). A
request's constraint (``StructuredOutputsParams``) becomes an llguidance grammar here; the HTTP
process calls ``check_structured_outputs`` to turn a bad schema into a 400 before the request is
queued. In the engine core, ``StructuredOutputManager`` compiles on a worker thread: a request
waits in the scheduler's queue until its grammar is ready while the others keep stepping. A
compiled grammar is a matcher in its start state, which every sequence with the same constraint
copies. A sequence's matcher follows its output tokens; a preempted sequence drops it and
rebuilds it by replaying its output tokens when it runs again.

No torch here: the bitmask is a numpy int32 array [rows, ceil(vocab / 32)], bit ``t`` of a row set
when token ``t`` is allowed; the sampler applies it.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
from collections import OrderedDict
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import llguidance
import numpy as np

from pagedserve.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from pagedserve.engine.request import Request

logger = logging.getLogger(__name__)

# Between JSON tokens at most one space: a weak model cannot spend its max_tokens on whitespace,
# and ", " / ": " (json.dumps' own separators) stay possible.
JSON_WHITESPACE = r"[ ]?"
JSON_OPTIONS = {"whitespace_pattern": JSON_WHITESPACE}
GRAMMAR_CACHE_SIZE = 256
_OPEN_OBJECT_KEYS = ("additionalProperties", "unevaluatedProperties", "patternProperties")


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
        what = {"json": "JSON schema", "json_object": "JSON object", "choice": "choice list"}
        raise ValueError(f"the {what.get(kind, kind)} cannot be used for decoding: {error}")


def allocate_token_bitmask(num_rows: int, vocab_size: int) -> np.ndarray:
    """All tokens allowed in every row."""
    return np.full((num_rows, (vocab_size + 31) // 32), -1, dtype=np.int32)


class StructuredOutputRequest:
    """One sequence's constraint: the compiled grammar (a future while it compiles) and the
    matcher that follows the sequence's output tokens."""

    def __init__(self, params: StructuredOutputsParams, grammar: concurrent.futures.Future):
        self.params = params
        self.grammar = grammar
        self.matcher: llguidance.LLMatcher | None = None

    @property
    def ready(self) -> bool:
        return self.grammar.done()

    @property
    def error(self) -> str | None:
        if not self.grammar.done():
            return None
        error = self.grammar.exception()
        return None if error is None else str(error)

    def matcher_for(self, output_token_ids: list[int]) -> llguidance.LLMatcher:
        """The matcher, rebuilt by replaying the output tokens if it was released."""
        if self.matcher is None:
            matcher = self.grammar.result().deep_copy()
            if output_token_ids and not matcher.consume_tokens(output_token_ids):
                logger.warning("replaying a constrained sequence failed: %s", matcher.get_error())
            self.matcher = matcher
        return self.matcher

    def fork(self, parent: StructuredOutputRequest) -> None:
        """A sibling of an ``n > 1`` request starts from its parent's matcher."""
        if parent.matcher is not None:
            self.matcher = parent.matcher.deep_copy()

    def release(self) -> None:
        self.matcher = None


class StructuredOutputManager:
    """Compiles constraints on one worker thread and keeps the last ``GRAMMAR_CACHE_SIZE``."""

    def __init__(self, tokenizer_file: Path | None, vocab_size: int, eos_token_ids: list[int]):
        self.tokenizer_file = tokenizer_file
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_lock = threading.Lock()
        self.cache: OrderedDict[tuple[str, str], concurrent.futures.Future] = OrderedDict()
        self.num_compiled = 0
        if tokenizer_file is not None:  # the vocabulary's byte trie, built once, off the loop
            self.executor.submit(self._llg_tokenizer)

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(
                    str(self.tokenizer_file), n_vocab=self.vocab_size, eos_token=self.eos_token_ids
                )
            return self._tokenizer

    def check(self, params: StructuredOutputsParams) -> None:
        if self.tokenizer_file is None:
            raise ValueError(
                "structured outputs need the model's tokenizer.json, and this model has none"
            )
        check_structured_outputs(params)

    def request(self, params: StructuredOutputsParams) -> StructuredOutputRequest:
        """A sequence's constraint; its grammar compiles now unless it is cached."""
        key = params.key
        future = self.cache.get(key)
        if future is None or (future.done() and future.exception() is not None):
            future = self.executor.submit(self._compile, params)
        self.cache[key] = future
        self.cache.move_to_end(key)
        while len(self.cache) > GRAMMAR_CACHE_SIZE:
            self.cache.popitem(last=False)
        return StructuredOutputRequest(params, future)

    def _compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar_for(*params.key), log_level=0)
        if matcher.is_error():
            raise ValueError(f"the constraint cannot be compiled: {matcher.get_error()}")
        self.num_compiled += 1
        return matcher

    def wait_for_any(self, requests: list[Request], timeout: float) -> None:
        """Block until one of these requests' grammars is ready, at most ``timeout`` seconds."""
        pending = [r.structured_output.grammar for r in requests if not r.structured_output.ready]
        if pending:
            concurrent.futures.wait(
                pending, timeout, return_when=concurrent.futures.FIRST_COMPLETED
            )

    def grammar_bitmask(self, requests: list[Request]) -> np.ndarray | None:
        """One row per request about to sample (None: no constrained row)."""
        rows = [i for i, r in enumerate(requests) if r.structured_output is not None]
        if not rows:
            return None
        bitmask = allocate_token_bitmask(len(requests), self.vocab_size)
        for i in rows:
            req = requests[i]
            matcher = req.structured_output.matcher_for(req.output_token_ids)
            row = bitmask[i]
            matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        return bitmask

    @staticmethod
    def accept_token(req: Request, token: int) -> bool:
        """Advance the sequence's matcher by its new token; True when the grammar is complete
        (nothing but the end of the sequence may follow) or the token broke it."""
        so = req.structured_output
        matcher = (
            so.matcher if so.matcher is not None else so.matcher_for(req.output_token_ids[:-1])
        )
        if not matcher.consume_token(token):
            logger.warning(
                "%s: token %d broke its grammar: %s", req.request_id, token, matcher.get_error()
            )
            return True
        return matcher.is_stopped()

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
