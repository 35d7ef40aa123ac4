"""The HTTP process's half of a request, as vLLM v1's OutputProcessor.

The engine core sends token ids; here they become text (incremental detokenization), stop strings
end sequences (the core is told to abort them), and each request's consumer reads one
``RequestOutput`` when it is ready: outputs that arrive faster than the consumer reads them are
merged, not queued, so a slow or absent reader costs one output, built when it asks.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.engine.messages import EngineCoreOutput
from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; the server can no longer generate."""


class EngineStepError(RuntimeError):
    """An engine step failed while this request was in flight; it was aborted."""


@dataclass(slots=True)
class SequenceState:
    detokenizer: IncrementalDetokenizer | None
    logprobs: list[dict[int, float]] | None  # None: not asked for
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class RequestState:
    """One request in the HTTP process, and the place its consumer waits for outputs."""

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
        tokenizer,
    ):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.seqs = [
            SequenceState(
                IncrementalDetokenizer(tokenizer, prompt_token_ids, params) if tokenizer else None,
                [] if params.logprobs is not None else None,
            )
            for _ in range(params.n)
        ]
        self.num_unfinished = params.n
        self.prompt_logprobs: list[dict[int, float] | None] | None = None
        self.num_cached_tokens = 0
        self.metrics: dict[str, float] = {"arrival_time": arrival_time}
        self.updated = False
        self.error: BaseException | None = None
        self.ready = asyncio.Event()

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0

    async def get(self) -> RequestOutput:
        """The request as it stands, once something changed; raises the error that ended it."""
        while not self.updated and self.error is None:
            await self.ready.wait()
            self.ready.clear()
        if not self.updated:
            raise self.error
        self.updated = False
        return self.make_output()

    def notify(self) -> None:
        self.updated = True
        self.ready.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.ready.set()

    def set_first(self, first: list) -> None:
        prompt_logprobs, num_cached_tokens, first_scheduled_time, first_token_time = first
        self.prompt_logprobs = prompt_logprobs
        self.num_cached_tokens = num_cached_tokens
        if first_scheduled_time is not None:
            self.metrics["first_scheduled_time"] = first_scheduled_time
        if first_token_time is not None:
            self.metrics["first_token_time"] = first_token_time

    def make_output(self) -> RequestOutput:
        outputs = [
            CompletionOutput(
                index=i,
                text=seq.text,
                token_ids=list(seq.token_ids),
                cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            )
            for i, seq in enumerate(self.seqs)
        ]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=self.finished,
            prompt_logprobs=self.prompt_logprobs,
            num_cached_tokens=self.num_cached_tokens,
            metrics=dict(self.metrics),
        )


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float,
    ) -> RequestState:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        state = RequestState(
            request_id, prompt, prompt_token_ids, params, arrival_time, self.tokenizer
        )
        self.requests[request_id] = state
        return state

    def abort_request(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def fail(self, request_id: str, error: BaseException) -> None:
        state = self.requests.pop(request_id, None)
        if state is not None:
            state.fail(error)

    def fail_all(self, error: BaseException) -> None:
        for request_id in list(self.requests):
            self.fail(request_id, error)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> list[list]:
        """Apply one step's outputs; the [request_id, index] of sequences a stop string ended,
        which the engine core must abort."""
        to_abort = []
        for out in outputs:
            state = self.requests.get(out.request_id)
            if state is None:  # finished or aborted here already
                continue
            seq = state.seqs[out.index]
            if seq.finish_reason is not None:  # a token computed before the core saw the abort
                continue
            if out.first is not None:
                state.set_first(out.first)
            if self._append(seq, out):
                to_abort.append([out.request_id, out.index])
            if seq.finish_reason is not None:
                state.num_unfinished -= 1
                if state.finished:
                    del self.requests[out.request_id]
            state.notify()
        return to_abort

    def _append(self, seq: SequenceState, out: EngineCoreOutput) -> bool:
        """Add the new tokens; True when a stop string ended the sequence."""
        for i, token in enumerate(out.new_token_ids):
            seq.token_ids.append(token)
            if seq.logprobs is not None and out.new_logprobs is not None:
                logprobs = out.new_logprobs[i]
                seq.logprobs.append(logprobs)
                seq.cumulative_logprob += logprobs[token]
            if seq.detokenizer is None:
                continue
            delta, stop_str = seq.detokenizer.add_token(token)
            seq.text += delta
            if stop_str is not None:
                seq.finish_reason, seq.stop_reason = "stop", stop_str
                return True
        if out.finish_reason is not None:
            if seq.detokenizer is not None:
                seq.text += seq.detokenizer.flush()
            seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason
        return False
