"""Structured output, as vLLM v1's StructuredOutputManager: grammars compiled off the engine loop
and cached by key, one matcher per constrained sequence, one token bitmask row per sampled row.

A request's constraint (``StructuredOutputsParams``) becomes an llguidance grammar
(``backend_guidance.py``). ``StructuredOutputManager`` compiles on a worker thread: a request waits
in the scheduler's queue until its grammar is ready while the others keep stepping. A compiled
grammar is a matcher in its start state, which every sequence with the same constraint copies
(``request.py``).

No torch here: the bitmask is a numpy int32 array [rows, ceil(vocab / 32)], bit ``t`` of a row set
when token ``t`` is allowed; the sampler applies it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING

import llguidance
import numpy as np

from pagedserve.engine.structured_output.backend_guidance import (
    GRAMMAR_CACHE_SIZE,
    check_structured_outputs,
    grammar_for,
    text_tokenizer,
)
from pagedserve.engine.structured_output.request import StructuredOutputRequest
from pagedserve.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from pagedserve.engine.request import Request

logger = logging.getLogger(__name__)


def allocate_token_bitmask(num_rows: int, vocab_size: int) -> np.ndarray:
    """All tokens allowed in every row."""
    return np.full((num_rows, (vocab_size + 31) // 32), -1, dtype=np.int32)


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
        if tokenizer_file is not None:  # the vocabulary's byte trie, built once, off the loop
            self.executor.submit(self._llg_tokenizer)

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = text_tokenizer(
                    self.tokenizer_file, self.vocab_size, self.eos_token_ids
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
        return StructuredOutputRequest(future)

    def _compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar_for(*params.key), log_level=0)
        if matcher.is_error():
            raise ValueError(f"the constraint cannot be compiled: {matcher.get_error()}")
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
