"""When a preempted sequence swaps its pages to the host tier and when it recomputes them.

``--preemption-mode recompute`` always recomputes (vLLM v1); ``swap`` swaps whenever the host
tier's swap share has room (vLLM v0); ``auto`` swaps when the copy costs less than the recompute
it saves, by the rates this device has shown: the engine times every step's page moves and its
forward pass and feeds them here. A swap costs two copies of the pages (out now, in later); a
recompute costs a prefill of the tokens they hold. Until both rates are measured, ``auto`` swaps:
a copy of a page is a memcpy, its recompute a pass through every layer. Either way, a sequence
recomputes when the host tier is full.
"""

from __future__ import annotations

from dataclasses import dataclass

# forward passes of fewer tokens than this are decode-bound: their time per token says nothing
# of what a recompute (a prefill) costs
MIN_PREFILL_TOKENS = 32
SMOOTHING = 0.2  # weight of the newest measurement in each rate's moving average


@dataclass(slots=True)
class PreemptionCosts:
    """Measured rates: seconds per page copied one way, seconds per token of a prefill."""

    seconds_per_page_copy: float | None = None
    seconds_per_prefill_token: float | None = None

    def observe_copies(self, num_pages: int, seconds: float) -> None:
        if num_pages > 0:
            self.seconds_per_page_copy = _average(self.seconds_per_page_copy, seconds / num_pages)

    def observe_forward(self, num_tokens: int, seconds: float) -> None:
        if num_tokens >= MIN_PREFILL_TOKENS:
            self.seconds_per_prefill_token = _average(
                self.seconds_per_prefill_token, seconds / num_tokens
            )

    def swap_seconds(self, num_pages: int) -> float | None:
        """Out and back in."""
        if self.seconds_per_page_copy is None:
            return None
        return 2 * num_pages * self.seconds_per_page_copy

    def recompute_seconds(self, num_tokens: int) -> float | None:
        if self.seconds_per_prefill_token is None:
            return None
        return num_tokens * self.seconds_per_prefill_token

    def swap_is_cheaper(self, num_pages: int, num_tokens: int) -> bool:
        swap, recompute = self.swap_seconds(num_pages), self.recompute_seconds(num_tokens)
        return swap is None or recompute is None or swap < recompute


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new


def should_swap(mode: str, costs: PreemptionCosts, num_pages: int, num_tokens: int) -> bool:
    """Whether a victim with ``num_pages`` computed pages (``num_tokens`` tokens) swaps, given
    that the host tier has room for it."""
    if mode == "recompute":
        return False
    return mode == "swap" or costs.swap_is_cheaper(num_pages, num_tokens)
