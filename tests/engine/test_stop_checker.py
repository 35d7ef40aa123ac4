"""The stop rule (vLLM's stop checker) on hand-made sequences: a stop string, a finished grammar,
EOS and stop token ids once min_tokens are out, max_tokens and max_model_len, in that order."""

from __future__ import annotations

import pytest

from pagedserve.engine.request import Request, RequestStatus
from pagedserve.engine.stop_checker import check_stop
from pagedserve.sampling_params import SamplingParams

EOS = 2
STOPPED, LENGTH = RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH


def seq(outputs: list[int], prompt_len: int = 3, **params) -> Request:
    params = {"max_tokens": 10, **params}
    req = Request("r", list(range(10, 10 + prompt_len)), SamplingParams(**params), frozenset({EOS}))
    for token in outputs:
        req.append_output_token(token)
    return req


def test_an_ordinary_token_goes_on():
    assert check_stop(seq([5]), 5, max_model_len=100) is None


def test_a_matched_stop_string_stops_and_is_the_stop_reason():
    s = seq([5])
    assert check_stop(s, 5, 100, stop_str="END") is STOPPED and s.stop_reason == "END"


def test_a_finished_grammar_stops_without_a_stop_reason():
    s = seq([5])
    assert check_stop(s, 5, 100, grammar_done=True) is STOPPED and s.stop_reason is None


def test_eos_stops_unless_ignored():
    assert check_stop(seq([EOS]), EOS, 100) is STOPPED
    assert check_stop(seq([EOS], ignore_eos=True), EOS, 100) is None


def test_a_stop_token_id_stops_and_is_the_stop_reason():
    s = seq([7], stop_token_ids=[7])
    assert check_stop(s, 7, 100) is STOPPED and s.stop_reason == 7


@pytest.mark.parametrize("num_outputs,stops", [(1, False), (2, True), (3, True)])
def test_eos_and_stop_token_ids_count_only_once_min_tokens_are_out(num_outputs, stops):
    for token, extra in ((EOS, {}), (7, {"stop_token_ids": [7]})):
        s = seq([5] * (num_outputs - 1) + [token], min_tokens=2, **extra)
        assert (check_stop(s, token, 100) is STOPPED) == stops


def test_max_tokens_ends_at_exactly_that_many():
    assert check_stop(seq([5] * 3, max_tokens=4), 5, 100) is None
    assert check_stop(seq([5] * 4, max_tokens=4), 5, 100) is LENGTH


def test_max_model_len_ends_at_exactly_that_many_tokens():
    assert check_stop(seq([5] * 2, prompt_len=3), 5, max_model_len=6) is None
    assert check_stop(seq([5] * 3, prompt_len=3), 5, max_model_len=6) is LENGTH


def test_a_stop_string_wins_over_length():
    s = seq([5] * 4, max_tokens=4)
    assert check_stop(s, 5, 100, stop_str="END") is STOPPED and s.stop_reason == "END"
