"""When a sequence ends: the stop rule applied to every sampled token (vLLM's stop checker)."""

from __future__ import annotations

from pagedserve.engine.request import Request, RequestStatus


def check_stop(
    seq: Request,
    token: int,
    max_model_len: int,
    stop_str: str | None = None,
    grammar_done: bool = False,
) -> RequestStatus | None:
    """Whether ``token``, just appended, ends ``seq``: the status it ends with, or None. In this
    order: a stop string the detokenizer matched, a complete grammar, EOS and stop token ids (once
    ``min_tokens`` are out), ``max_tokens`` and ``max_model_len``."""
    p = seq.sampling_params
    if stop_str is not None:
        seq.stop_reason = stop_str
        return RequestStatus.FINISHED_STOPPED
    if grammar_done:  # the constraint is complete: nothing may follow
        return RequestStatus.FINISHED_STOPPED
    if seq.num_output_tokens >= p.min_tokens:
        if not p.ignore_eos and token in seq.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token in p.stop_token_ids:
            seq.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
    if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH
    return None
