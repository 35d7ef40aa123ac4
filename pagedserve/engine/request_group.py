"""One user request in the engine: its ``n`` sequences (``Request``), their text so far, and the
``RequestOutput`` built from them, as vLLM v0 builds one from a SequenceGroup."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.engine.request import Request
from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.sampling_params import SamplingParams


@dataclass
class RequestGroup:
    """One user request: ``n`` sequences sampled from one prompt."""

    request_id: str
    prompt: str | None
    params: SamplingParams
    seqs: list[Request]
    detokenizers: list[IncrementalDetokenizer | None]
    texts: list[str]
    pending_forks: list[Request] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def finished(self) -> bool:
        return all(s.status.finished for s in self.seqs) and not self.pending_forks


def make_request_output(group: RequestGroup) -> RequestOutput:
    """The group as it stands: one ``CompletionOutput`` per sequence."""
    outputs = [
        CompletionOutput(
            index=i,
            text=group.texts[i],
            token_ids=list(seq.output_token_ids),
            cumulative_logprob=_cumulative(seq),
            logprobs=seq.logprobs if seq.sampling_params.logprobs is not None else None,
            finish_reason=seq.status.finish_reason,
            stop_reason=seq.stop_reason,
        )
        for i, seq in enumerate(group.seqs)
    ]
    first = group.seqs[0]
    return RequestOutput(
        request_id=group.request_id,
        prompt=group.prompt,
        prompt_token_ids=first.prompt_token_ids,
        outputs=outputs,
        finished=group.finished,
        prompt_logprobs=group.prompt_logprobs,
        num_cached_tokens=first.num_cached_tokens,
        metrics=_metrics(first),
    )


def _cumulative(seq: Request) -> float | None:
    return seq.cumulative_logprob if seq.sampling_params.logprobs is not None else None


def _metrics(seq: Request) -> dict[str, float]:
    m = {"arrival_time": seq.arrival_time}
    if seq.first_scheduled_time is not None:
        m["first_scheduled_time"] = seq.first_scheduled_time
    if seq.first_token_time is not None:
        m["first_token_time"] = seq.first_token_time
    return m
