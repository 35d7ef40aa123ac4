"""Incremental detokenization with stop strings, vLLM's prefix/read offset scheme.

Each step decodes only a short window of recent tokens: ``ids[prefix_offset:read_offset]`` (text
already emitted, kept as context) and ``ids[prefix_offset:]``; the new text is the difference. While
the window's text ends in U+FFFD (a token that is only part of a UTF-8 character) the offsets stay
put and nothing is emitted. Cost per token is bounded by the window, not the sequence length.

Stop strings: text that could still become a stop string (a suffix of the text that is a proper
prefix of some stop string) is held back until the next tokens settle it. On a match the output is
cut before the stop string, or after it with ``include_stop_str_in_output``. As in vLLM, stop
strings are looked for only once ``min_tokens`` tokens are out: one in the text of the first
``min_tokens`` tokens never ends the sequence (one that ends in a later token's text does).
"""

from __future__ import annotations

from typing import Protocol

from pagedserve.sampling_params import SamplingParams

# Prompt tokens decoded as context for the first generated token (vLLM uses the same window).
INITIAL_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class Tokenizer(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.params = params
        self.stop = [s for s in params.stop if s]
        self.token_ids = list(prompt_token_ids[-INITIAL_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self._text = ""
        self._num_emitted = 0  # chars of _text already returned
        self.num_output_tokens = 0
        self.stop_reason: str | None = None

    @property
    def output_text(self) -> str:
        return self._text

    def add_token(self, token_id: int) -> tuple[str, str | None]:
        """Return (text delta, matched stop string or None) after one generated token."""
        if self.stop_reason is not None:
            raise RuntimeError(
                f"add_token after the stop string {self.stop_reason!r} matched; "
                "the request is finished and takes no more tokens"
            )
        self.token_ids.append(token_id)
        self.num_output_tokens += 1
        new_text = self._decode_new_text(final=False)
        self._text += new_text
        if self.num_output_tokens > self.params.min_tokens:
            self.stop_reason = self._find_stop(len(new_text))
        held = 0 if self.stop_reason is not None else self._num_held_back()
        return self._emit(len(self._text) - held), self.stop_reason

    def flush(self) -> str:
        """Everything still held back, for a request that ends without a stop string."""
        if self.stop_reason is None:
            self._text += self._decode_new_text(final=True)
        return self._emit(len(self._text))

    # ---- decoding ----

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)

    def _decode_new_text(self, final: bool) -> str:
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        if len(full_text) <= len(prefix_text) or (
            full_text.endswith(REPLACEMENT_CHAR) and not final
        ):
            return ""
        self._advance_window()
        return full_text[len(prefix_text) :]

    def _advance_window(self) -> None:
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        # Drop tokens that have left the window so the list stays short.
        del self.token_ids[: self.prefix_offset]
        self.read_offset -= self.prefix_offset
        self.prefix_offset = 0

    # ---- stop strings ----

    def _find_stop(self, num_new_chars: int) -> str | None:
        """Earliest stop string that ends inside the new text; truncates ``_text`` at it."""
        if not self.stop or num_new_chars == 0:
            return None
        max_len = max(len(s) for s in self.stop)
        start = max(0, len(self._text) - num_new_chars - max_len + 1)
        matches = [(i, s) for s in self.stop if (i := self._text.find(s, start)) >= 0]
        if not matches:
            return None
        index, stop = min(matches, key=lambda m: (m[0], -len(m[1])))
        end = index + len(stop) if self.params.include_stop_str_in_output else index
        self._text = self._text[:end]
        return stop

    def _num_held_back(self) -> int:
        """Length of the longest suffix of the text that a stop string could still start with."""
        if not self.stop or self.params.include_stop_str_in_output:
            return 0
        pending = len(self._text) - self._num_emitted
        for n in range(min(max(len(s) for s in self.stop) - 1, pending), 0, -1):
            suffix = self._text[-n:]
            if any(s.startswith(suffix) for s in self.stop):
                return n
        return 0

    def _emit(self, end: int) -> str:
        delta = self._text[self._num_emitted : end]
        self._num_emitted = max(self._num_emitted, end)
        return delta
