"""The HTTP process's OutputProcessor on hand-made engine-core outputs: detokenized text, stop
strings (the sequence ends, its later tokens are dropped, the core is told to abort it), finish
reasons per sequence, outputs merged for a slow reader, and failures handed to the consumer."""

from __future__ import annotations

import asyncio

import pytest

from pagedserve.engine.messages import EngineCoreOutput
from pagedserve.engine.output_processor import OutputProcessor
from pagedserve.sampling_params import SamplingParams

PIECES = ["<p>", " one", " two", " three", " STOP", " four", " five"]
PROMPT = [0]


class WordTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return "".join(PIECES[i] for i in ids)


def out(token: int, index: int = 0, finish: str | None = None, **kw) -> EngineCoreOutput:
    return EngineCoreOutput("r", index, [token], kw.pop("logprobs", None), finish, None, **kw)


def get(state):
    return asyncio.run(state.get())


@pytest.fixture
def processor() -> OutputProcessor:
    return OutputProcessor(WordTokenizer())


def test_text_is_the_decoded_tokens_and_the_request_leaves_when_finished(processor):
    state = processor.add_request("r", "p", PROMPT, SamplingParams(max_tokens=3), 1.0)
    assert processor.process_outputs([out(1), out(2)]) == []
    first = get(state)
    assert (first.outputs[0].text, first.outputs[0].token_ids, first.finished) == (
        " one two",
        [1, 2],
        False,
    )
    processor.process_outputs([out(3, finish="length")])
    last = get(state)
    assert last.outputs[0].text == " one two three" and last.finished
    assert last.outputs[0].finish_reason == "length" and "r" not in processor.requests
    assert last.metrics == {"arrival_time": 1.0} and last.prompt == "p"


def test_a_stop_string_ends_the_sequence_drops_later_tokens_and_asks_for_an_abort(processor):
    state = processor.add_request("r", None, PROMPT, SamplingParams(stop=["STOP"]), 0.0)
    processor.process_outputs([out(1)])
    both = EngineCoreOutput("r", 0, [4, 5], None, None, None)  # the stop, then one more token
    assert processor.process_outputs([both]) == [["r", 0]]
    # a token the core computed before it saw the abort
    assert processor.process_outputs([out(6)]) == []
    done = get(state)
    assert done.outputs[0].text == " one " and done.outputs[0].token_ids == [1, 4]
    assert (done.outputs[0].finish_reason, done.outputs[0].stop_reason) == ("stop", "STOP")
    assert done.finished and "r" not in processor.requests


def test_each_of_n_sequences_finishes_on_its_own(processor):
    params = SamplingParams(n=2, stop=["STOP"], logprobs=0)
    state = processor.add_request("r", None, PROMPT, params, 0.0)
    lp = {1: -0.5, 4: -1.0, 2: -0.25}
    assert processor.process_outputs([out(1, 0, logprobs=[lp]), out(4, 1, logprobs=[lp])]) == [
        ["r", 1]
    ]
    mid = get(state)
    assert [o.finish_reason for o in mid.outputs] == [None, "stop"] and not mid.finished
    processor.process_outputs([out(2, 0, "length", logprobs=[lp])])
    done = get(state)
    assert [o.text for o in done.outputs] == [" one two", " "]
    assert done.outputs[0].cumulative_logprob == pytest.approx(-0.75)
    assert done.outputs[0].logprobs == [lp, lp] and done.finished


def test_a_slow_reader_gets_one_merged_output(processor):
    state = processor.add_request("r", None, PROMPT, SamplingParams(), 0.0)
    for token in (1, 2, 3):
        processor.process_outputs([out(token)])
    assert get(state).outputs[0].token_ids == [1, 2, 3]
    assert not state.updated  # nothing new since: the next read waits


def test_first_token_info_sets_prompt_logprobs_cached_tokens_and_times(processor):
    state = processor.add_request("r", None, PROMPT, SamplingParams(), 5.0)
    processor.process_outputs([out(1, first=[[None], 16, 6.0, 7.0])])
    o = get(state)
    assert (o.prompt_logprobs, o.num_cached_tokens) == ([None], 16)
    assert o.metrics == {"arrival_time": 5.0, "first_scheduled_time": 6.0, "first_token_time": 7.0}


def test_outputs_of_unknown_or_aborted_requests_are_ignored(processor):
    processor.add_request("r", None, PROMPT, SamplingParams(), 0.0)
    processor.abort_request("r")
    assert processor.process_outputs([out(1)]) == [] and processor.requests == {}
    processor.abort_request("never-added")  # no error


def test_a_request_id_in_use_is_refused(processor):
    processor.add_request("r", None, PROMPT, SamplingParams(), 0.0)
    with pytest.raises(ValueError, match="request id 'r' is already in use"):
        processor.add_request("r", None, PROMPT, SamplingParams(), 0.0)


def test_a_failure_reaches_the_waiting_consumer_and_the_request_leaves(processor):
    state = processor.add_request("r", None, PROMPT, SamplingParams(), 0.0)
    other = processor.add_request("s", None, PROMPT, SamplingParams(), 0.0)
    processor.fail("r", RuntimeError("step failed"))
    with pytest.raises(RuntimeError, match="step failed"):
        get(state)
    assert list(processor.requests) == ["s"]
    processor.fail_all(ValueError("engine dead"))
    with pytest.raises(ValueError, match="engine dead"):
        get(other)
    assert processor.requests == {}


def test_a_pending_output_is_read_before_the_error_that_followed_it(processor):
    state = processor.add_request("r", None, PROMPT, SamplingParams(), 0.0)
    processor.process_outputs([out(1)])
    processor.fail("r", RuntimeError("later"))
    assert get(state).outputs[0].token_ids == [1]
    with pytest.raises(RuntimeError, match="later"):
        get(state)


def test_without_a_tokenizer_only_token_ids_come_back():
    processor = OutputProcessor(None)
    state = processor.add_request("r", None, PROMPT, SamplingParams(stop=["STOP"]), 0.0)
    processor.process_outputs([out(4), out(5, finish="length")])
    o = get(state)
    assert o.outputs[0].token_ids == [4, 5] and o.outputs[0].text == ""
    assert o.outputs[0].finish_reason == "length"


def test_outputs_name_their_request_sequence_and_prompt(processor):
    state = processor.add_request("r", None, PROMPT, SamplingParams(n=2), 0.0)
    processor.process_outputs([out(1, 0), out(2, 1)])
    o = get(state)
    assert (o.request_id, o.prompt_token_ids) == ("r", PROMPT)
    assert [c.index for c in o.outputs] == [0, 1]
    # nothing asked: no logprobs, no prompt info yet
    assert [(c.logprobs, c.cumulative_logprob) for c in o.outputs] == [(None, None)] * 2
    assert (o.prompt_logprobs, o.num_cached_tokens) == (None, 0)


def test_logprobs_are_kept_only_where_asked_and_sent(processor):
    lp = {1: -0.5, 2: -0.25}
    plain = processor.add_request("plain", None, PROMPT, SamplingParams(), 0.0)
    asked = processor.add_request("asked", None, PROMPT, SamplingParams(logprobs=1), 0.0)
    outputs = [
        EngineCoreOutput("plain", 0, [1], [lp], None, None),  # sent though not asked
        EngineCoreOutput("asked", 0, [1], None, None, None),  # asked, but none this step
        EngineCoreOutput("asked", 0, [2], [lp], None, None),
    ]
    processor.process_outputs(outputs)
    assert get(plain).outputs[0].logprobs is None
    o = get(asked).outputs[0]
    assert o.logprobs == [lp] and o.cumulative_logprob == -0.25 and o.token_ids == [1, 2]


def test_every_token_of_an_output_counts_without_a_tokenizer():
    processor = OutputProcessor(None)
    state = processor.add_request("r", None, PROMPT, SamplingParams(), 0.0)
    processor.process_outputs([EngineCoreOutput("r", 0, [4, 5, 6], None, None, None)])
    assert get(state).outputs[0].token_ids == [4, 5, 6]


def test_one_stale_output_in_a_step_leaves_the_others_of_that_step(processor):
    ended = processor.add_request("ended", None, PROMPT, SamplingParams(stop=["STOP"]), 0.0)
    live = processor.add_request("live", None, PROMPT, SamplingParams(), 0.0)
    processor.process_outputs([EngineCoreOutput("ended", 0, [4], None, None, None)])
    get(ended)
    step = [
        EngineCoreOutput("gone", 0, [1], None, None, None),  # never added (or aborted)
        EngineCoreOutput("ended", 0, [5], None, None, None),  # after its stop string
        EngineCoreOutput("live", 0, [1], None, None, None),
    ]
    assert processor.process_outputs(step) == []
    assert get(live).outputs[0].token_ids == [1]


def test_a_late_token_of_a_stopped_sequence_leaves_its_siblings_in_that_step(processor):
    state = processor.add_request("r", None, PROMPT, SamplingParams(n=2, stop=["STOP"]), 0.0)
    assert processor.process_outputs([out(4, 1)]) == [["r", 1]]  # sequence 1 stops; 0 runs on
    # sequence 1's token computed before the core saw the abort, then sequence 0's
    assert processor.process_outputs([out(5, 1), out(1, 0)]) == []
    o = get(state)
    assert [c.token_ids for c in o.outputs] == [[1], [4]] and not o.finished


def test_failing_a_request_that_is_gone_is_nothing(processor):
    processor.fail("never-added", RuntimeError("late"))
    assert processor.requests == {}


def test_a_read_before_any_output_waits_for_one(processor):
    state = processor.add_request("r", None, PROMPT, SamplingParams(), 0.0)

    async def main():
        reader = asyncio.ensure_future(state.get())
        await asyncio.sleep(0.05)
        assert not reader.done()  # nothing yet: it waits
        processor.process_outputs([out(1)])
        return await reader

    assert asyncio.run(main()).outputs[0].token_ids == [1]
