"""The structured-output manager on its own, without an engine: its token bitmask against what the
tokenizer's vocabulary allows, its cache of compiled grammars, its one compiling thread, and the
matcher each sequence advances or rebuilds."""

from __future__ import annotations

import concurrent.futures
import re
import threading
import time

import numpy as np
import pytest

from pagedserve.engine.request import Request
from pagedserve.engine.structured_output import manager as structured
from pagedserve.engine.structured_output.manager import (
    StructuredOutputManager,
    allocate_token_bitmask,
)
from pagedserve.models import DEMO_MODEL_DIR, Tokenizer
from pagedserve.sampling_params import SamplingParams, StructuredOutputsParams

VOCAB = 4096  # the demo tokenizer's
PADDED_VOCAB = VOCAB + 32  # a model's vocabulary is often padded past its tokenizer's
EOS = [4093, 4086]  # two of the demo model's end tokens, not in order
YES_NO = StructuredOutputsParams(choice=["yes", "no"])


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(DEMO_MODEL_DIR)


@pytest.fixture
def manager():
    manager = StructuredOutputManager(DEMO_MODEL_DIR / "tokenizer.json", PADDED_VOCAB, EOS)
    yield manager
    manager.shutdown()


@pytest.fixture
def slow_compiles(manager):
    """The manager's compiles wait for ``release`` (set at teardown); they return a stand-in."""
    release = threading.Event()
    started = []

    def compile_(params):
        started.append(params.key)
        release.wait(30)
        return object()

    manager._compile = compile_
    yield release, started
    release.set()


def _request(so, output_token_ids=()) -> Request:
    return Request("r", [1], SamplingParams(), output_token_ids=list(output_token_ids),
                   structured_output=so)  # fmt: skip


def _allowed(row: np.ndarray) -> set[int]:
    """The tokens a bitmask row allows: bit t % 32 of word t // 32."""
    return {int(t) for t in np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))}


def _in_background(fn) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("vocab_size", [1, 32, 33, VOCAB, PADDED_VOCAB])
def test_a_fresh_bitmask_has_a_word_per_32_tokens_and_allows_every_token(vocab_size):
    bitmask = allocate_token_bitmask(3, vocab_size)
    assert bitmask.dtype == np.int32 and bitmask.shape == (3, -(-vocab_size // 32))
    assert all(_allowed(row) == set(range(32 * bitmask.shape[1])) for row in bitmask)


def test_a_constrained_row_allows_the_tokens_that_start_an_answer_and_the_others_allow_all(
    manager, tok
):
    so = manager.request(YES_NO)
    so.grammar.result(timeout=30)
    plain = _request(None)
    bitmask = manager.grammar_bitmask([plain, _request(so), plain])
    assert bitmask.shape == (3, PADDED_VOCAB // 32)
    # the reference: every token whose text is a prefix of an answer; no padding token past the
    # tokenizer's vocabulary, no end token before the answer
    starts = {t for t in range(VOCAB) if (s := tok.decode([t])) and any(
        a.startswith(s) for a in YES_NO.choice)}  # fmt: skip
    assert _allowed(bitmask[1]) == starts
    assert _allowed(bitmask[0]) == _allowed(bitmask[2]) == set(range(PADDED_VOCAB))


def test_a_batch_without_a_constrained_row_has_no_bitmask(manager):
    assert manager.grammar_bitmask([_request(None), _request(None)]) is None


def test_a_finished_answer_allows_only_the_end_tokens_it_was_given(manager, tok):
    seq = _request(manager.request(YES_NO))
    answer = tok.encode("yes", False)
    for i, t in enumerate(answer):
        seq.append_output_token(t)
        assert manager.accept_token(seq, t) == (i == len(answer) - 1)  # True: the grammar is done
    assert _allowed(manager.grammar_bitmask([seq])[0]) == set(EOS)


def test_a_token_that_breaks_the_grammar_ends_the_sequence_and_is_logged_not_printed(
    manager, tok, caplog, capfd
):
    """The engine's log says which request broke its grammar; llguidance's own warning (printed on
    stderr at its default level) is silenced."""
    seq = _request(manager.request(YES_NO))
    (maybe, *_) = tok.encode("maybe", False)
    seq.append_output_token(maybe)
    assert manager.accept_token(seq, maybe)
    assert f"r: token {maybe} broke its grammar" in caplog.text
    assert capfd.readouterr().err == ""


def test_a_released_matcher_is_rebuilt_from_the_tokens_before_the_new_one(manager, tok):
    """A preempted sequence's next token advances a matcher replayed from its earlier output: the
    same state as the live sequence's."""
    so = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    answer = tok.encode('{"a": 12', False)
    live, resumed = _request(manager.request(so)), _request(manager.request(so))
    for t in answer:
        live.append_output_token(t)
        assert not manager.accept_token(live, t)
    for t in answer[:-1]:
        resumed.append_output_token(t)
        manager.accept_token(resumed, t)
    resumed.release_matcher()
    resumed.append_output_token(answer[-1])
    assert not manager.accept_token(resumed, answer[-1])
    assert (manager.grammar_bitmask([live]) == manager.grammar_bitmask([resumed])).all()


def test_a_constraint_compiles_once_and_its_sequences_share_the_grammar(manager):
    first = manager.request(YES_NO)
    again = manager.request(StructuredOutputsParams(choice=["yes", "no"]))
    other = manager.request(StructuredOutputsParams(choice=["no", "yes"]))
    assert first.grammar is again.grammar and other.grammar is not first.grammar
    assert first.matcher_for([]) is not again.matcher_for([])  # each sequence its own matcher


def test_a_constraint_whose_compile_failed_is_compiled_again(manager):
    """A compile that failed (not a bad constraint: those fail the check) is not cached."""
    compile_ = manager._compile
    failures = iter([RuntimeError("out of memory")])

    def fail_once(params):
        for error in failures:
            raise error
        return compile_(params)

    manager._compile = fail_once
    failed = manager.request(YES_NO)
    assert "out of memory" in str(failed.grammar.exception(timeout=30))
    retried = manager.request(YES_NO)
    assert retried.grammar.result(timeout=30) is not None


def test_a_grammar_the_tokenizer_cannot_match_fails_naming_the_reason(manager, monkeypatch):
    monkeypatch.setattr(structured, "grammar_for", lambda kind, spec: "start: undefined_rule")
    so = manager.request(StructuredOutputsParams(grammar="start: undefined_rule"))
    so.grammar.exception(timeout=30)
    assert so.error.startswith("the constraint cannot be compiled: ")
    assert "undefined_rule" in so.error


def test_the_cache_keeps_the_last_used_constraints(manager, monkeypatch):
    monkeypatch.setattr(structured, "GRAMMAR_CACHE_SIZE", 2)
    manager._compile = lambda params: object()
    a, b, c = (StructuredOutputsParams(choice=[x]) for x in "abc")
    grammar_a, grammar_b = manager.request(a).grammar, manager.request(b).grammar
    assert manager.request(a).grammar is grammar_a  # a, then b: both kept; a used last
    manager.request(c)  # evicts b, the least recently used
    assert manager.request(a).grammar is grammar_a
    assert manager.request(b).grammar is not grammar_b


def test_the_tokenizer_is_built_at_start_before_any_constraint(manager):
    manager.executor.submit(lambda: None).result(timeout=60)  # after the work queued at start
    assert manager._tokenizer is not None


def test_without_a_tokenizer_a_constraint_is_refused_saying_the_model_has_none():
    manager = StructuredOutputManager(None, VOCAB, EOS)
    message = "structured outputs need the model's tokenizer.json, and this model has none"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        manager.check(YES_NO)
    manager.shutdown()


def test_the_check_refuses_a_constraint_that_cannot_compile_naming_its_kind(manager):
    manager.check(YES_NO)
    with pytest.raises(ValueError, match="^the regex cannot be used for decoding: "):
        manager.check(StructuredOutputsParams(regex="[0-9"))


def test_grammars_compile_one_at_a_time_and_a_request_does_not_wait_for_one(manager, slow_compiles):
    release, started = slow_compiles
    first, second = manager.request(YES_NO), manager.request(StructuredOutputsParams(regex="a"))
    asked = _in_background(lambda: manager.request(YES_NO))  # the same, while it compiles
    asked.join(10)
    assert not asked.is_alive()
    time.sleep(0.5)
    assert started == [YES_NO.key] and not second.ready  # the second waits for the first
    release.set()
    second.grammar.result(timeout=30)
    assert first.ready and len(started) == 2


def test_waiting_for_grammars_returns_when_one_is_ready(manager):
    gates = {"a": threading.Event(), "b": threading.Event()}

    def compile_(params):
        gates[params.regex].wait(30)
        return object()

    manager._compile = compile_
    a, b = (_request(manager.request(StructuredOutputsParams(regex=x))) for x in "ab")
    threading.Timer(0.3, gates["a"].set).start()
    waiting = _in_background(lambda: manager.wait_for_any([b, a], timeout=30))
    waiting.join(20)
    gates["b"].set()
    assert not waiting.is_alive() and a.structured_output.ready


def test_waiting_for_grammars_gives_up_after_its_timeout(manager, slow_compiles):
    seq = _request(manager.request(YES_NO))
    start = time.monotonic()
    waiting = _in_background(lambda: manager.wait_for_any([seq], timeout=0.2))
    waiting.join(20)
    assert not waiting.is_alive() and time.monotonic() - start >= 0.15
    assert not seq.structured_output.ready


def test_shutdown_cancels_the_queued_compiles_without_waiting_for_the_running_one(
    manager, slow_compiles
):
    release, started = slow_compiles
    running = manager.request(YES_NO)
    while not started:
        time.sleep(0.01)
    queued = manager.request(StructuredOutputsParams(regex="a"))
    closing = _in_background(manager.shutdown)
    closing.join(10)
    assert not closing.is_alive() and queued.grammar.cancelled() and not running.ready
    release.set()
    running.grammar.result(timeout=30)
    with pytest.raises(concurrent.futures.CancelledError):
        queued.grammar.result(timeout=30)
