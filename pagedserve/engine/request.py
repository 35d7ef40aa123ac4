"""A request as the scheduler sees it: token ids, progress counters and a status."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedserve.engine.spec_decode import DraftState
    from pagedserve.engine.structured_output.request import StructuredOutputRequest
    from pagedserve.lora.request import LoRARequest


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # its pages freed: it recomputes them when it runs again
    SWAPPED = "swapped"  # preempted with its pages in the host tier: they come back by copy
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    REJECTED = "rejected"

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.finished else None


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.REJECTED,
}


@dataclass(eq=False)
class Request:
    """One sequence to generate. ``n > 1`` requests are forked into several of these."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    num_preemptions: int = 0
    num_lost_tokens: int = 0  # the most tokens computed before a preemption freed them
    logprobs: list[dict[int, float]] = field(default_factory=list)  # per output token, if asked
    cumulative_logprob: float = 0.0  # sum of the chosen tokens' logprobs, if asked
    stop_reason: int | str | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    structured_output: StructuredOutputRequest | None = None  # its grammar and matcher
    # speculative decoding: the drafts its next step verifies (none: a plain decode step), and
    # its back-off (``spec_decode.DraftState``; None: this engine does not speculate)
    spec_token_ids: list[int] = field(default_factory=list)
    draft_state: DraftState | None = None
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def waiting_for_grammar(self) -> bool:
        """vLLM's WAITING_FOR_FSM: not schedulable until its grammar has compiled."""
        return self.structured_output is not None and not self.structured_output.ready

    def release_matcher(self) -> None:
        """Drop the grammar matcher of a sequence that stops running (preempted or finished); a
        preempted one rebuilds it from its output tokens when it runs again."""
        if self.structured_output is not None:
            self.structured_output.release()

    @property
    def lora_int_id(self) -> int:
        """Its adapter's id; 0 for the base model (vLLM's convention)."""
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        """vLLM v1's rule: what the scheduler catches ``num_computed_tokens`` up to, its drafts
        included (they are computed, and verified, with its next token)."""
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
