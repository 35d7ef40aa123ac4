"""One constrained sequence: its compiled grammar and the matcher that follows its output
tokens. A preempted sequence drops its matcher and rebuilds it by replaying its output tokens when
it runs again; so does a sibling of an ``n > 1`` request, forked before any output."""

from __future__ import annotations

import concurrent.futures
import logging

import llguidance

logger = logging.getLogger(__name__)


class StructuredOutputRequest:
    """One sequence's constraint: the compiled grammar (a future while it compiles) and the
    matcher that follows the sequence's output tokens."""

    def __init__(self, grammar: concurrent.futures.Future):
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

    def release(self) -> None:
        self.matcher = None
