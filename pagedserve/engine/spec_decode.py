"""N-gram (prompt lookup) speculation: drafts from the sequence's own earlier tokens, and the
back-off that stops a request drafting while its drafts keep failing.

vLLM v1's ``NgramProposer`` rule: the longest suffix of the sequence, from ``prompt_lookup_max``
down to ``prompt_lookup_min`` tokens, that occurs earlier in it; its first occurrence; the (up
to) ``num_speculative_tokens`` tokens that followed it are the drafts. Verification
(``sampler.verify_drafts``) accepts a prefix of them, so a wrong draft costs a forward row, never
a wrong token. The lookup is kept incremental (``NgramIndex``): vLLM searches the whole sequence
with numpy at every step, which for a 10,000-token sequence took 0.4 ms a step (a quarter of a
demo-model step) even when nothing repeats; the index took 5 us.

The back-off is ours (vLLM has none for n-gram): a request whose last ``BACKOFF_AFTER`` drafting
steps accepted nothing drafts no more for ``cooldown`` steps, which doubles each time up to
``MAX_COOLDOWN`` and resets when a draft is accepted. A workload with no repetition thus pays at
most one draft row every so often, and the lookup itself (a few dictionary probes).
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.config import SpeculativeConfig

BACKOFF_AFTER = 2  # drafting steps in a row with nothing accepted before a request backs off
FIRST_COOLDOWN = 4  # steps without drafts, the first time
MAX_COOLDOWN = 64


@dataclass(slots=True)
class DraftState:
    """One request's speculation: its back-off and what its drafts achieved."""

    num_failed: int = 0  # drafting steps in a row that accepted nothing
    cooldown: int = FIRST_COOLDOWN  # the next back-off's length, in steps
    resume_at: int = 0  # the request's step count from which it drafts again
    num_steps: int = 0  # its decode steps so far (the back-off's clock)
    index: NgramIndex | None = None  # its n-grams (built at its first lookup)

    def observe(self, num_accepted: int) -> None:
        """One verification step's result: how many of its drafts were accepted."""
        if num_accepted:
            self.num_failed, self.cooldown = 0, FIRST_COOLDOWN
            return
        self.num_failed += 1
        if self.num_failed >= BACKOFF_AFTER:
            self.resume_at = self.num_steps + self.cooldown
            self.cooldown = min(self.cooldown * 2, MAX_COOLDOWN)
            self.num_failed = 0


class NgramIndex:
    """Where each n-gram of one sequence (``min_n`` to ``max_n`` tokens) first ended, kept up to
    date as the sequence grows (its tokens are only ever appended to).

    Its keys are the n-grams that end before the sequence's last token, so that each has a token
    after it to draft; ``drafts`` is the proposer's rule (above) read off it. It holds up to
    ``max_n - min_n + 1`` entries per token, built as the sequence is first looked up and then a
    few entries per step: for a 10,000-token prompt and n from 2 to 5, 6 MB and 60 ms once (n = 5
    alone: 1.4 MB, 16 ms; one core of the Zen 3 machine).
    """

    __slots__ = ("min_n", "max_n", "first_end", "num_indexed")

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self.first_end: dict[tuple[int, ...], int] = {}  # n-gram -> where it first ended
        self.num_indexed = 0  # the n-grams ending at or before this position are indexed

    def drafts(self, tokens: list[int], k: int) -> list[int]:
        """The (up to) ``k`` tokens that followed the first earlier occurrence of the longest
        suffix n-gram of ``tokens``; [] when none occurs."""
        size = len(tokens)
        first_end = self.first_end
        for end in range(self.num_indexed + 1, size):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                first_end.setdefault(tuple(tokens[end - n : end]), end)
        self.num_indexed = max(self.num_indexed, size - 1)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            end = first_end.get(tuple(tokens[size - n :]))
            if end is not None:
                return tokens[end : end + k]
        return []


class NgramProposer:
    def __init__(self, config: SpeculativeConfig):
        self.k = config.num_speculative_tokens
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, tokens: list[int], state: DraftState, max_drafts: int) -> list[int]:
        """Drafts for a request whose ``tokens`` are all known (its next step verifies them),
        at most ``max_drafts``; none while it backs off."""
        state.num_steps += 1
        limit = min(self.k, max_drafts)
        if limit <= 0 or state.num_steps < state.resume_at:
            return []
        if state.index is None:
            state.index = NgramIndex(self.min_n, self.max_n)
        return state.index.drafts(tokens, limit)


@dataclass(slots=True)
class SpecDecodeStats:
    """vLLM's spec-decode counters: verification steps that had drafts (``num_drafts``), the
    drafts, the accepted ones, and the accepted ones by position (position 0 accepted in every
    step that accepted any)."""

    num_speculative_tokens: int
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] | None = None

    def __post_init__(self) -> None:
        self.accepted_per_pos = [0] * self.num_speculative_tokens

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over proposed ones (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verification step outputs on average: 1 (the model's own) plus its accepted
        drafts, vLLM's "mean acceptance length" (0 before any draft)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def to_dict(self) -> dict:
        """``get_stats``'s entries (vLLM's counter names, and the two figures they give)."""
        return {
            "spec_decode_num_drafts_total": self.num_drafts,
            "spec_decode_num_draft_tokens_total": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens_total": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
            "spec_decode_draft_acceptance_rate": self.acceptance_rate,
            "spec_decode_mean_acceptance_length": self.mean_acceptance_length,
        }
