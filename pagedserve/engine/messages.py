"""What the HTTP process and the engine core say to each other: msgpack arrays over ZeroMQ.

Plain data only (no pickles, no tensors). The HTTP process sends requests, aborts, utility calls
and shutdown on the input socket; the engine core answers on the output socket with one message
per loop iteration (one per step while it has work, a heartbeat while it waits), which carries
every sequence's new token ids, the replies to utility calls and the engine's statistics.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgpack

from pagedserve.sampling_params import SamplingParams

# HTTP process -> engine core
# [ADD, request_id, prompt_token_ids, sampling params (dict), arrival_time, LoRA adapter name
# or None]
ADD = "add"
ABORT = "abort"  # [ABORT, [[request_id, sequence index or None (all)], ...]]
UTILITY = "utility"  # [UTILITY, call_id, method name, [args]]
SHUTDOWN = "shutdown"  # [SHUTDOWN]

# engine core -> HTTP process
READY = "ready"  # [READY, info]: the engine loaded; its limits and description
FAILED = "failed"  # [FAILED, message]: the engine could not start
OUTPUTS = "outputs"  # [OUTPUTS, EngineCoreOutputs]
DEAD = "dead"  # [DEAD, message]: the engine loop died; the process exits


class EngineCoreOutput(NamedTuple):
    """One sequence's progress in one step (token ids only: the HTTP process detokenizes)."""

    request_id: str
    index: int  # which of the request's n sequences
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None  # one dict per new token, where asked
    finish_reason: str | None  # "stop" | "length" | None (running)
    stop_reason: int | None  # the stop token id that ended it
    # only with a request's first token: [prompt_logprobs, num_cached_tokens,
    # first_scheduled_time, first_token_time]
    first: list | None = None


class EngineCoreOutputs(NamedTuple):
    step: int  # steps run so far: the HTTP process tells a live engine from a stuck one
    outputs: list[EngineCoreOutput]
    stats: dict[str, Any]  # engine statistics after this iteration (``EngineCore.stats``)
    utility_results: list[list]  # [call_id, ok, result or error message]
    errors: list[list]  # [request_id, kind ("rejected" | "step_failed"), message]


def encode(message: list | tuple) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def decode(data: bytes) -> list:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def params_to_wire(params: SamplingParams) -> dict:
    fields = vars(params)
    if params.structured_outputs is not None:
        fields = {**fields, "structured_outputs": vars(params.structured_outputs)}
    return fields


def params_from_wire(fields: dict) -> SamplingParams:
    return SamplingParams(**fields)  # logit_bias keeps its int keys: decode's strict_map_key


def outputs_from_wire(payload: list) -> EngineCoreOutputs:
    step, outputs, stats, utility_results, errors = payload
    return EngineCoreOutputs(
        step, [EngineCoreOutput(*o) for o in outputs], stats, utility_results, errors
    )
