"""The step loop of ``LLMEngine`` in this process, on a tiny GLM-4 on the plain CPU: what it
checks at start-up, what it says about itself, how requests enter, fork, stop, abort and fail, and
the figures it reports. Fast enough to run per mutant of llm_engine.py (test_engine.py drives the
same engine through ``LLM`` and covers its limits).

Every test leaves the engine it shares drained: every request ended, every page back in the pool."""

from __future__ import annotations

import pytest
import torch

from pagedserve import SamplingParams
from pagedserve.config import EngineConfig, UsageContext
from pagedserve.engine import llm_engine as le
from pagedserve.engine.llm_engine import GRAMMAR_WAIT_S, LLMEngine
from pagedserve.engine.request import RequestStatus
from pagedserve.hal.faults import DeviceKernelError, UnrecoverableFaultError
from pagedserve.sampling_params import StructuredOutputsParams
from tests.helpers.models import build_tiny_model_dir, drain, host_tier_gib, tiny_engine

BLOCK = 4
PROMPT = [5, 6, 7, 8, 9]
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
SETTINGS = dict(block_size=BLOCK, num_kv_pages=32, max_model_len=64, max_num_seqs=4)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(model directory, HF reference model)."""
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("tiny-glm4")
    return path, build_tiny_model_dir(path, "glm4", max_position_embeddings=128)


@pytest.fixture(scope="module")
def shared(model):
    engine = tiny_engine(model[0], **SETTINGS)
    yield engine
    engine.shutdown()


@pytest.fixture
def engine(shared):
    shared.block_manager.reset_prefix_cache()
    shared.take_failed()
    shared.take_step_error()
    shared.take_rejected()
    yield shared
    left = list(shared.groups)
    shared.abort_request(left)  # a failed test leaves the next one a drained engine
    assert left == []
    assert shared.check_invariants() == [] and shared.block_manager.usage == 0
    assert shared.runner.generators == {}  # an ended sequence's seeded sampler goes too


def _reference_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, -1)


# ---- start-up -------------------------------------------------------------------------------------
def test_max_model_len_defaults_to_the_models_context_and_may_not_exceed_it(model, tmp_path):
    build_tiny_model_dir(tmp_path, "glm4", max_position_embeddings=96)
    engine = tiny_engine(tmp_path, block_size=BLOCK, num_kv_pages=8)
    assert engine.max_model_len == 96
    engine.shutdown()
    engine = tiny_engine(tmp_path, block_size=BLOCK, num_kv_pages=8, max_model_len=96)
    assert engine.max_model_len == 96  # exactly the context fits
    engine.shutdown()
    with pytest.raises(ValueError) as e:
        tiny_engine(tmp_path, block_size=BLOCK, num_kv_pages=8, max_model_len=97)
    assert str(e.value) == (
        "--max-model-len 97 exceeds the model's context of 96 tokens "
        "(max_position_embeddings); use --max-model-len 96 or less"
    )


def test_conflicting_host_tier_settings_are_refused_naming_the_flags(model):
    with pytest.raises(ValueError) as e:
        tiny_engine(model[0], **SETTINGS, preemption_mode="swap")
    assert str(e.value) == (
        "--preemption-mode 'swap' needs host memory to swap to: start the server with "
        "--swap-space GiB as well (e.g. --swap-space 4), or use preemption mode auto or recompute"
    )
    with pytest.raises(ValueError) as e:
        tiny_engine(model[0], **SETTINGS, host_prefix_cache=0.001, enable_prefix_caching=False)
    assert str(e.value) == (
        "--host-prefix-cache keeps prefix blocks the KV tier evicts, but prefix caching is off; "
        "turn it on (--enable-prefix-caching True) or drop --host-prefix-cache"
    )
    gib = host_tier_gib(model[0], 4, BLOCK)
    engine = tiny_engine(model[0], **SETTINGS, preemption_mode="swap", swap_space=gib)
    assert engine.block_manager.host.num_frames == 4
    engine.shutdown()


def test_a_model_without_a_tokenizer_takes_token_ids_only(model, tmp_path):
    build_tiny_model_dir(tmp_path, "glm4")
    (tmp_path / "tokenizer.json").unlink()
    engine = tiny_engine(tmp_path, block_size=BLOCK, num_kv_pages=8, max_model_len=32)
    assert engine.tokenizer is None
    assert engine.eos_token_ids == frozenset(engine.model_config.eos_token_ids)
    assert engine.structured_output_manager.tokenizer_file is None
    engine.add_request("a", PROMPT, GREEDY)
    out = drain(engine)["a"]
    assert out.outputs[0].text == "" and len(out.outputs[0].token_ids) == 4
    engine.shutdown()


def test_a_tokenizer_path_of_its_own_is_loaded(model, tmp_path):
    build_tiny_model_dir(tmp_path, "glm4")
    (tmp_path / "tokenizer.json").unlink()
    engine = tiny_engine(
        tmp_path, block_size=BLOCK, num_kv_pages=8, max_model_len=32, tokenizer=str(model[0])
    )
    assert engine.tokenizer.model_dir == model[0]
    engine.shutdown()


def test_the_eos_ids_are_the_models_and_the_tokenizers(tmp_path):
    build_tiny_model_dir(tmp_path, "glm4", eos_token_id=0)  # the tokenizer's: 0, 7 and 9
    engine = tiny_engine(tmp_path, block_size=BLOCK, num_kv_pages=8, max_model_len=32)
    assert engine.model_config.eos_token_ids == [0]
    assert engine.eos_token_ids == frozenset({0, 7, 9})
    manager = engine.structured_output_manager
    assert manager.eos_token_ids == [0, 7, 9] and manager.vocab_size == 320
    assert manager.tokenizer_file == tmp_path / "tokenizer.json"
    assert engine.runner.structured_output_manager is manager
    engine.shutdown()


def test_a_fresh_single_card_engine_wires_its_parts_and_starts_empty(model):
    shared = tiny_engine(model[0], **SETTINGS)
    assert shared.runner.patrol_scrub == shared.fault_recovery.patrol_scrub
    assert shared.num_kv_pages == 32 and shared.block_size == BLOCK
    assert shared.limits.max_num_seqs == 4 and shared.limits.num_kv_pages == 32
    assert shared.proposer is None and shared.spec_stats.num_speculative_tokens == 0
    assert shared.detokenize is True
    assert shared.stats == {"prompt_tokens_total": 0, "generation_tokens_total": 0}
    assert shared.take_rejected() == [] and shared.take_failed() == []
    with pytest.raises(le.RequestRejectedError) as e:  # the server's flags, its usage context
        shared.add_request("x", list(range(70)), SamplingParams())
    assert str(e.value).endswith("or start the server with a larger --max-model-len")
    shared.shutdown()


def test_a_start_that_fails_part_way_stops_its_ranks_and_raises_its_error(model, monkeypatch):
    from pagedserve.engine.executor import Executor

    stopped = []

    def fail(self):
        raise RuntimeError("no card")

    monkeypatch.setattr(LLMEngine, "_load", fail)
    monkeypatch.setattr(Executor, "shutdown", lambda self: stopped.append(self))
    with pytest.raises(RuntimeError, match="no card"):  # not a shutdown's error
        tiny_engine(model[0], **SETTINGS)
    assert len(stopped) == 1


def test_describe_names_device_model_pages_and_concurrency(shared, model):
    name = model[0].name
    assert shared.describe() == (
        f"device {shared.device.describe()}; model {name} (glm4, torch.float32); KV cache 32 "
        "pages x 4 tokens (float32: 512 B per token); max_model_len 64; max concurrency at "
        "max_model_len 2.00x"
    )


def test_describe_names_an_int8_cache(model):
    engine = tiny_engine(
        model[0], block_size=BLOCK, num_kv_pages=24, max_model_len=64, kv_cache_dtype="int8"
    )
    assert engine.describe().endswith(
        "KV cache 24 pages x 4 tokens (int8 + a scale per token and head: 160 B per token); "
        "max_model_len 64; max concurrency at max_model_len 1.50x"
    )
    assert engine.get_device_stats()["kv_pages"]["kv_cache_dtype"] == "int8"
    engine.shutdown()


# ---- requests -------------------------------------------------------------------------------------
def test_greedy_tokens_and_logprobs_match_transformers(engine, model):
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=0)
    params.prompt_logprobs = 0
    engine.add_request("a", PROMPT, params, prompt="the prompt")
    out = drain(engine)["a"]
    assert out.finished and out.prompt == "the prompt" and out.prompt_token_ids == PROMPT
    seq = out.outputs[0]
    ids = PROMPT + seq.token_ids
    ref = _reference_logprobs(model[1], ids)
    for i, token in enumerate(seq.token_ids):
        row = ref[len(PROMPT) - 1 + i]
        assert row[token].item() >= row.max().item() - 1e-4  # greedy, up to near-ties
        assert seq.logprobs[i] == {token: pytest.approx(row[token].item(), abs=1e-4)}
    assert seq.cumulative_logprob == pytest.approx(
        sum(lp[t] for lp, t in zip(seq.logprobs, seq.token_ids)), abs=1e-5
    )
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPT)
    for i in range(1, len(PROMPT)):
        want = ref[i - 1][PROMPT[i]].item()
        assert out.prompt_logprobs[i] == {PROMPT[i]: pytest.approx(want, abs=1e-4)}
    assert seq.finish_reason == "length"


def test_step_reports_each_group_once_with_the_tokens_it_got(engine):
    engine.add_request("a", PROMPT, GREEDY)
    engine.add_request("b", [11, 12, 13], SamplingParams(temperature=0.0, max_tokens=2))
    assert engine.get_num_unfinished_requests() == 2 and engine.has_unfinished_requests()
    outs = engine.step()
    assert [o.request_id for o in outs] == ["a", "b"]
    seq = engine.groups["a"].seqs[0]
    assert seq.num_computed_tokens == 5 and seq.num_tokens == 6  # the new token is not yet
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 1]
    advanced = engine.execute_step()
    assert [(g.request_id, i, n) for g, i, n in advanced] == [("a", 0, 1), ("b", 0, 1)]
    assert seq.num_computed_tokens == 6 and seq.num_tokens == 7
    assert engine.get_num_unfinished_requests() == 1 and list(engine.groups) == ["a"]
    drain(engine)
    assert engine.get_num_unfinished_requests() == 0 and not engine.has_unfinished_requests()
    assert engine.step() == [] and engine.execute_step() == []


def test_a_request_id_in_use_is_refused(engine):
    engine.add_request("a", PROMPT, GREEDY)
    with pytest.raises(ValueError, match="request id 'a' is already in use"):
        engine.add_request("a", PROMPT, GREEDY)
    assert len(engine.scheduler.waiting) == 1
    engine.abort_request("a")


def test_a_shut_down_engine_takes_no_request(model):
    engine = tiny_engine(model[0], **SETTINGS)
    engine.shutdown()
    assert engine.structured_output_manager.executor._shutdown  # the grammar thread stops
    engine.shutdown()  # idempotent
    with pytest.raises(RuntimeError) as e:
        engine.add_request("a", PROMPT, GREEDY)
    assert str(e.value) == "this engine has been shut down; start a new one"


def test_a_request_that_can_never_run_is_rejected_before_queueing(engine):
    with pytest.raises(le.RequestRejectedError):
        engine.add_request("a", list(range(70)), GREEDY)
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(unclosed"))
    with pytest.raises(le.RequestRejectedError) as e:
        engine.add_request("b", PROMPT, bad)
    assert str(e.value) == str(e.value.__cause__) and "(unclosed" in str(e.value)
    assert engine.groups == {} and engine.stats["prompt_tokens_total"] >= 0
    assert len(engine.scheduler.waiting) == 0


def test_check_request_fills_in_max_tokens_and_changes_nothing(engine):
    params = SamplingParams(max_tokens=None)
    assert engine.check_request(PROMPT, params).max_tokens == 64 - len(PROMPT)
    assert params.max_tokens is None and engine.groups == {}


def test_prompt_and_generated_tokens_are_counted(engine):
    before = dict(engine.stats)
    engine.add_request("a", PROMPT, GREEDY)
    assert engine.stats["prompt_tokens_total"] == before["prompt_tokens_total"] + 5
    engine.add_request("b", [3, 4], SamplingParams(n=2, temperature=0.0, max_tokens=3))
    assert engine.stats["prompt_tokens_total"] == before["prompt_tokens_total"] + 7
    drain(engine)
    assert engine.stats["generation_tokens_total"] == before["generation_tokens_total"] + 10
    stats = engine.get_stats()
    assert stats["prompt_tokens_total"] == engine.stats["prompt_tokens_total"]
    assert stats["generation_tokens_total"] == engine.stats["generation_tokens_total"]


def test_n_sequences_fork_once_the_prompt_is_computed_with_seeds_one_apart(engine):
    params = SamplingParams(n=3, temperature=1.0, seed=40, max_tokens=3, ignore_eos=True)
    engine.add_request("a", PROMPT, params)
    group = engine.groups["a"]
    assert [s.request_id for s in group.seqs] == ["a", "a#1", "a#2"]
    assert [s.sampling_params.seed for s in group.seqs] == [40, 41, 42]
    assert group.pending_forks == group.seqs[1:] and group.texts == ["", "", ""]
    assert [r.request_id for r in engine.scheduler.waiting] == ["a"]
    assert all(s.arrival_time > 0 for s in group.seqs)
    advanced = engine.execute_step()  # the prompt, then its siblings fork off its pages
    assert [(i, n) for _, i, n in advanced] == [(0, 1), (1, 1), (2, 1)]
    assert group.pending_forks == []
    assert [s.num_computed_tokens for s in group.seqs] == [5, 5, 5]
    assert {r.request_id for r in engine.scheduler.running} == {"a", "a#1", "a#2"}
    out = drain(engine)["a"]
    assert [len(c.token_ids) for c in out.outputs] == [3, 3, 3]
    # each sibling samples as a lone request with its own seed would
    for index, seed in enumerate([40, 41, 42]):
        engine.add_request("s", PROMPT, SamplingParams(temperature=1.0, seed=seed, max_tokens=3))
        alone = drain(engine)["s"].outputs[0].token_ids
        assert out.outputs[index].token_ids[:1] == alone[:1]


def test_an_unseeded_n_request_keeps_no_seed(engine):
    engine.add_request("a", PROMPT, SamplingParams(n=2, max_tokens=1))
    assert [s.sampling_params.seed for s in engine.groups["a"].seqs] == [None, None]
    assert engine.groups["a"].seqs[1].sampling_params.max_tokens == 1
    engine.abort_request("a")


def test_an_arrival_time_given_is_kept(engine):
    engine.add_request("a", PROMPT, GREEDY, arrival_time=12.5)
    assert engine.groups["a"].seqs[0].arrival_time == 12.5
    engine.abort_request(["a"])


def test_a_stop_string_ends_the_text_before_it(engine):
    prompt = [20, 21, 22, 23]  # greedy: "F\x1c\x1cmpmpal..."
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=6, stop=["mp"]))
    seq = drain(engine)["r"].outputs[0]
    assert seq.text == "F\x1c\x1c" and seq.stop_reason == "mp" and seq.finish_reason == "stop"
    assert len(seq.token_ids) == 4


def test_a_sequence_that_ends_without_a_stop_string_flushes_its_held_back_text(engine):
    engine.add_request("r", PROMPT, GREEDY)
    seq = drain(engine)["r"].outputs[0]
    assert seq.token_ids == [70, 151, 246, 246]
    assert seq.text == engine.tokenizer.decode(seq.token_ids) == "]\u044e\ufffd"


def test_without_detokenizing_text_stays_empty_and_stop_ids_still_end(model):
    engine = tiny_engine(model[0], **SETTINGS)
    engine.detokenize = False
    engine.add_request("a", PROMPT, GREEDY)
    first = drain(engine)["a"].outputs[0]
    assert first.text == "" and engine.groups == {}
    stop = first.token_ids[1]
    engine.add_request("b", PROMPT, SamplingParams(temperature=0.0, stop_token_ids=[stop]))
    seq = drain(engine)["b"].outputs[0]
    assert seq.token_ids == first.token_ids[:2] and seq.stop_reason == stop
    engine.shutdown()


def test_the_first_token_time_is_set_once(engine):
    engine.add_request("a", PROMPT, GREEDY)
    engine.step()
    seq = engine.groups["a"].seqs[0]
    first = seq.first_token_time
    assert first is not None
    engine.step()
    assert seq.first_token_time == first
    engine.abort_request("a")


# ---- aborts ---------------------------------------------------------------------------------------
def test_abort_takes_one_id_or_several_and_skips_unknown_ones(engine):
    for rid in ["req-a", "b", "c"]:
        engine.add_request(rid, PROMPT, GREEDY)
    engine.step()
    engine.abort_request("req-a")
    assert list(engine.groups) == ["b", "c"]
    engine.abort_request(["zz", "b", "c"])
    assert engine.groups == {}
    assert engine.scheduler.running == [] and len(engine.scheduler.waiting) == 0


def test_abort_of_a_request_ends_its_unforked_siblings_too(engine):
    engine.add_request("a", PROMPT, SamplingParams(n=3, max_tokens=3))
    seqs = engine.groups["a"].seqs
    engine.abort_request("a")
    assert seqs[0].status == RequestStatus.FINISHED_ABORTED
    assert engine.execute_step() == []  # no sibling forks off an aborted prompt


def test_abort_sequence_ends_one_sibling_and_the_group_with_the_last(engine):
    engine.add_request("a", PROMPT, SamplingParams(n=3, max_tokens=8, ignore_eos=True))
    group = engine.groups["a"]
    engine.abort_sequence("a", 2)  # not forked yet
    assert group.seqs[2].status == RequestStatus.FINISHED_ABORTED
    assert group.pending_forks == [group.seqs[1]]
    engine.abort_sequence("zz", 0)  # unknown: nothing
    engine.step()
    assert group.seqs[1].status == RequestStatus.RUNNING
    engine.abort_sequence("a", 0)
    assert group.seqs[0].status == RequestStatus.FINISHED_ABORTED and "a" in engine.groups
    engine.abort_sequence("a", 0)  # already ended: nothing
    assert group.seqs[0].status == RequestStatus.FINISHED_ABORTED and "a" in engine.groups
    engine.abort_sequence("a", 1)
    assert group.seqs[1].status == RequestStatus.FINISHED_ABORTED and engine.groups == {}


def test_abort_of_a_grammar_request_releases_its_matcher(engine):
    so = StructuredOutputsParams(regex="[a-z]+")
    engine.add_request("a", PROMPT, SamplingParams(structured_outputs=so, max_tokens=2))
    seq = engine.groups["a"].seqs[0]
    assert seq.structured_output is not None
    engine.abort_request("a")
    assert seq.structured_output.matcher is None


# ---- structured output ----------------------------------------------------------------------------
def test_a_grammar_that_fails_to_compile_rejects_its_request(engine, monkeypatch):
    so = StructuredOutputsParams(regex="[a-z]+")
    engine.add_request("a", PROMPT, SamplingParams(n=2, structured_outputs=so, max_tokens=2))
    engine.add_request("b", PROMPT, GREEDY)
    assert all(s.structured_output is not None for s in engine.groups["a"].seqs)
    assert engine.groups["b"].seqs[0].structured_output is None
    broken = engine.groups["a"].seqs[0].structured_output
    so_type = type(broken)
    monkeypatch.setattr(
        so_type, "error", property(lambda self: "bad grammar" if self is broken else None)
    )
    engine.step()
    assert engine.take_rejected() == [("a", "bad grammar")] and engine.take_rejected() == []
    assert list(engine.groups) == ["b"]
    drain(engine)


def test_a_grammar_constrains_and_ends_its_output(engine):
    so = StructuredOutputsParams(choice=["yes", "no"])
    engine.add_request("a", PROMPT, SamplingParams(structured_outputs=so, max_tokens=20))
    out = drain(engine)["a"].outputs[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
    assert not set(out.token_ids) & engine.eos_token_ids  # the grammar's end ends it, no EOS


def test_an_idle_step_waits_for_a_compiling_grammar(engine, monkeypatch):
    waits = []
    manager = engine.structured_output_manager
    monkeypatch.setattr(manager, "wait_for_any", lambda reqs, t: waits.append((reqs, t)))
    engine.step()
    assert waits == []  # nothing waiting: no wait
    so = StructuredOutputsParams(regex="[a-z]+")
    engine.add_request("a", PROMPT, SamplingParams(structured_outputs=so, max_tokens=2))
    seq = engine.groups["a"].seqs[0]
    monkeypatch.setattr(type(seq), "waiting_for_grammar", property(lambda self: True))
    assert engine.execute_step() == []
    assert waits == [([seq], GRAMMAR_WAIT_S)] and GRAMMAR_WAIT_S == 0.01
    monkeypatch.undo()
    engine.abort_request("a")


# ---- failures -------------------------------------------------------------------------------------
def test_a_failed_step_ends_its_requests_and_the_engine_goes_on(engine, monkeypatch):
    engine.add_request("a", PROMPT, GREEDY)
    moves = []
    monkeypatch.setattr(engine.block_manager, "moves_done", lambda: moves.append(1))

    def boom(sched, forks):
        raise RuntimeError("kernel")

    monkeypatch.setattr(engine.executor, "execute_model", boom)
    assert engine.execute_step() == [] and moves == [1, 1]  # the scheduler's, then the step's
    failed = engine.take_failed()
    assert [rid for rid, _ in failed] == ["a"] and "RuntimeError('kernel')" in failed[0][1]
    assert engine.take_failed() == [] and engine.groups == {}
    engine.add_request("b", PROMPT, GREEDY)
    engine.execute_step()
    engine.add_request("c", PROMPT, GREEDY)
    engine.execute_step()
    assert [rid for rid, _ in engine.take_failed()] == ["b", "c"]  # kept until taken
    monkeypatch.undo()
    engine.add_request("d", PROMPT, GREEDY)
    assert len(drain(engine)["d"].outputs[0].token_ids) == 4


def test_an_unrecoverable_fault_or_a_lost_rank_stops_the_engine(engine, monkeypatch):
    engine.add_request("a", PROMPT, GREEDY)

    def fault(sched, forks):
        raise UnrecoverableFaultError("gone")

    monkeypatch.setattr(engine.executor, "execute_model", fault)
    with pytest.raises(UnrecoverableFaultError):
        engine.execute_step()
    assert engine.take_failed() == []

    def boom(sched, forks):
        raise RuntimeError("rank")

    monkeypatch.setattr(engine.executor, "execute_model", boom)
    monkeypatch.setattr(engine.executor, "failed", "rank 1 is gone", raising=False)
    with pytest.raises(RuntimeError, match="rank"):
        engine.execute_step()
    assert engine.take_failed() == []
    monkeypatch.undo()
    engine.abort_request("a")
    engine.block_manager.moves_done()
    drain(engine)


def test_check_invariants_names_a_sequence_that_holds_pages_but_is_not_running(engine):
    engine.add_request("a", PROMPT, GREEDY)
    engine.step()
    seq = engine.scheduler.running.pop()
    try:
        assert engine.check_invariants() == ["sequences that are not running hold pages: ['a']"]
    finally:
        engine.scheduler.running.append(seq)
    engine.abort_request("a")


def test_faults_and_health_pass_through_to_recovery_and_executor(engine, monkeypatch):
    calls = []
    fr = engine.fault_recovery
    monkeypatch.setattr(fr, "scrub_weights", lambda n: calls.append(("scrub", n)) or 3)
    monkeypatch.setattr(fr, "inject_fault", lambda k, t, p: calls.append((k, t, p)) or {"k": k})
    monkeypatch.setattr(engine.executor, "check_health", lambda: calls.append("health"))
    assert engine.scrub_weights(2) == 3 and engine.scrub_weights() == 3
    assert engine.inject_fault("kv_page", "x", 5) == {"k": "kv_page"}
    assert engine.inject_fault("step") == {"k": "step"}
    engine.check_health()
    assert calls == [
        ("scrub", 2),
        ("scrub", None),
        ("kv_page", "x", 5),
        ("step", None, None),
        "health",
    ]


# ---- statistics -----------------------------------------------------------------------------------
def test_stats_while_running_count_requests_pages_and_tokens(engine):
    engine.add_request("a", PROMPT, GREEDY)
    engine.add_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9], GREEDY)
    engine.step()
    stats = engine.get_stats()
    used = engine.block_manager.num_pages - engine.block_manager.num_free_pages
    assert used == 2 + 3
    assert {k: stats[k] for k in list(stats)[:9]} == {
        "num_requests_running": 2,
        "num_requests_waiting": 0,
        "kv_cache_usage_perc": engine.block_manager.usage,
        "num_kv_pages": 32,
        "num_free_kv_pages": 27,
        "prefix_cache_queries_total": engine.block_manager.prefix_cache_queries,
        "prefix_cache_hits_total": engine.block_manager.prefix_cache_hits,
        "num_preemptions_total": 0,
        "recomputed_tokens_total": 0,
    }
    assert stats["num_requests_swapped"] == 0 and stats["num_swapped_pages"] == 0
    assert stats["host_kv_cache_usage_perc"] == 0.0
    assert stats["device_faults_total"] == dict(engine.device.faults.detected)
    assert stats["device_faults_total"] is not engine.device.faults.detected
    assert stats["collective_bytes_sent_total"] == 0
    assert stats["spec_decode_num_drafts_total"] == 0
    device = engine.get_device_stats()
    assert device["kv_pages"] == {
        "total": 32,
        "in_use": 5,
        "cached": 0,
        "free": 27,
        "block_size": 4,
        "memory_attr": "cached",
        "kv_cache_dtype": "float32",
        "bytes_per_token": 512,
    }
    assert device["requests"] == {"running": 2, "waiting": 0}
    assert device["generation_tokens_total"] == engine.stats["generation_tokens_total"]
    assert "host_pages" not in device and "speculative" not in device
    assert device["weight_pages"] == {
        "total": engine.device.num_weight_pages,
        "scrubbed_total": engine.device.scrubber.num_pages_scrubbed,
        "scrub_pages_per_step": 2,
    }
    assert device["faults_detected"] == engine.device.num_faults_detected
    assert device["faults"] == engine.device.faults.to_dict()
    assert device["name"] == "cpu"
    page_map = engine.get_page_map()
    assert page_map["total"] == 32 and page_map["block_size"] == 4 and "host" not in page_map
    assert page_map["counts"]["used"] == 5
    drain(engine)
    done = engine.get_device_stats()["kv_pages"]
    assert done["in_use"] == 0 and done["cached"] + done["free"] == 32 and done["cached"] == 5


@pytest.mark.parametrize(
    "error,device_fault",
    [(DeviceKernelError("xpu"), True), (RuntimeError("kernel"), False), (IndexError("i"), False)],
)
def test_a_failed_step_counts_as_a_device_fault_only_when_the_device_raised_it(
    engine, monkeypatch, error, device_fault
):
    engine.add_request("a", PROMPT, GREEDY)

    def boom(sched, forks):
        raise error

    monkeypatch.setattr(engine.executor, "execute_model", boom)
    before = engine.get_stats()
    engine.execute_step()
    monkeypatch.undo()
    ((rid, why),) = engine.take_failed()
    assert rid == "a" and repr(error) in why
    after = engine.get_stats()
    faults = after["device_faults_total"]["step"] - before["device_faults_total"]["step"]
    bugs = after["engine_step_errors_total"] - before["engine_step_errors_total"]
    assert (faults, bugs) == ((1, 0) if device_fault else (0, 1))
    assert (
        engine.get_device_stats()["faults"]["step"]["detected"]
        == after["device_faults_total"]["step"]
    )
    # a bug's exception waits for LLM.generate to raise it, once; a device fault's does not
    assert engine.take_step_error() is (None if device_fault else error)
    assert engine.take_step_error() is None
    assert ("send the request again" in why) == device_fault


def test_the_host_tier_is_reported_in_stats_device_stats_and_page_map(model):
    gib = host_tier_gib(model[0], 4, BLOCK)
    engine = tiny_engine(
        model[0],
        block_size=BLOCK,
        num_kv_pages=6,
        max_model_len=32,
        max_num_seqs=4,
        swap_space=gib,
        host_prefix_cache=gib,
        enable_prefix_caching=True,
        preemption_mode="swap",
    )
    for rid in "abc":
        engine.add_request(rid, PROMPT, SamplingParams(temperature=0.0, max_tokens=8))
    swapped = None
    for _ in range(100):
        engine.step()
        if engine.scheduler.swapped:
            swapped = (engine.get_stats(), engine.get_device_stats(), engine.get_page_map())
            assert engine.check_invariants() == []
            break
    assert swapped is not None
    stats, device, page_map = swapped
    host = engine.block_manager.host
    assert stats["num_requests_swapped"] == len(engine.scheduler.swapped) >= 1
    assert stats["num_swapped_pages"] == host.num_swapped_frames >= 1
    assert stats["host_kv_cache_usage_perc"] == host.usage > 0
    assert stats["num_swapped_preemptions_total"] == engine.scheduler.num_swapped_preemptions >= 1
    assert stats["swapped_out_pages_total"] == engine.block_manager.num_swapped_out_pages >= 1
    assert stats["swapped_in_pages_total"] == engine.block_manager.num_swapped_in_pages
    cached = len(host.frame_to_cached_block)
    assert device["host_pages"] == {
        "total": 8,
        "swapped": host.num_swapped_frames,
        "cached": cached,
        "free": 8 - host.num_swapped_frames - cached,
        "swap_share": 4,
        "cache_share": 4,
    }
    assert page_map["host"] == engine.block_manager.host_page_map()
    assert "; host tier 8 page frames (4 swap space, 4 prefix cache); preemption swap; " in (
        engine.describe()
    )
    frames = engine.block_manager.host.block_tables
    out = sorted(r.request_id for r in engine.scheduler.swapped)
    frames["ghost"] = []
    assert engine.check_invariants() == [
        f"host frames are held by {sorted(frames)}, but the swapped-out sequences are {out}"
    ]
    del frames["ghost"]
    drain(engine)
    cached = len(host.frame_to_cached_block)
    assert cached > 0  # prefix blocks the KV tier evicted
    assert engine.get_device_stats()["host_pages"] == {
        "total": 8,
        "swapped": 0,
        "cached": cached,
        "free": 8 - cached,
        "swap_share": 4,
        "cache_share": 4,
    }
    stats = engine.get_stats()
    assert (
        stats["host_prefix_cache_queries_total"] == engine.block_manager.host_prefix_cache_queries
    )
    assert stats["host_prefix_cache_hits_total"] == engine.block_manager.host_prefix_cache_hits
    assert engine.check_invariants() == [] and engine.block_manager.usage == 0
    engine.shutdown()


def test_drafts_are_verified_counted_and_their_rejected_pages_trimmed(model):
    spec = {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 2,
        "prompt_lookup_min": 1,
    }
    engine = tiny_engine(model[0], **SETTINGS, speculative_config=spec)
    plain = tiny_engine(model[0], **SETTINGS)
    prompt = PROMPT  # greedy repeats tokens: its drafts are partly accepted
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    plain.add_request("a", prompt, params)
    want = drain(plain)["a"].outputs[0].token_ids
    engine.add_request("a", prompt, params)
    assert engine.groups["a"].seqs[0].draft_state is not None
    so = StructuredOutputsParams(regex="[a-z]+")
    engine.add_request("g", prompt, SamplingParams(structured_outputs=so, max_tokens=2))
    assert engine.groups["g"].seqs[0].draft_state is None  # no drafts under a grammar
    engine.abort_request("g")
    group = engine.groups["a"]
    counts = []
    while engine.has_unfinished_requests():
        counts += [n for _, _, n in engine.execute_step()]
        assert engine.check_invariants() == []
        seq = group.seqs[0]
        if not seq.status.finished:  # no page past its tokens: a rejected draft's goes back
            assert seq.num_computed_tokens == seq.num_tokens - 1  # all but the newest token
            assert len(engine.block_manager.block_tables["a"]) <= -(-seq.num_tokens // BLOCK)
    assert group.seqs[0].output_token_ids == want
    assert group.seqs[0].spec_token_ids == []  # it ended on verified drafts, and holds none
    assert sum(counts) == 20 and max(counts) > 1  # an accepted draft is one more token a step
    s = engine.spec_stats  # this model's drafts: 6 of 11 tokens, some rejected
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (6, 11, 8)
    assert s.accepted_per_pos == [5, 2, 1]
    assert engine.get_device_stats()["speculative"] == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "draft_tokens": s.num_draft_tokens,
        "accepted_tokens": s.num_accepted_tokens,
        "acceptance_rate": s.acceptance_rate,
        "mean_acceptance_length": s.mean_acceptance_length,
    }
    assert engine.get_stats()["spec_decode_num_draft_tokens_total"] == s.num_draft_tokens
    assert engine.check_invariants() == [] and engine.block_manager.usage == 0
    engine.shutdown()
    plain.shutdown()


def test_describe_names_rank_0_of_a_tensor_parallel_engine(shared, monkeypatch):
    monkeypatch.setattr(shared.config.parallel, "tensor_parallel_size", 2)
    assert shared.describe().startswith(
        f"device {shared.device.describe()} (rank 0 of tensor-parallel size 2); model "
    )


def test_prefix_caching_off_without_a_host_cache_starts(model):
    engine = tiny_engine(model[0], **SETTINGS, enable_prefix_caching=False)
    assert engine.block_manager.host is None and engine.get_page_map().get("host") is None
    engine.shutdown()


def test_a_chunked_prompt_gets_every_prompt_logprob_and_forks_once_it_is_computed(model):
    engine = tiny_engine(model[0], **SETTINGS, max_num_batched_tokens=4)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    params = SamplingParams(n=2, temperature=0.0, max_tokens=3, ignore_eos=True)
    params.prompt_logprobs = 0
    engine.add_request("a", prompt, params)
    group = engine.groups["a"]
    steps = []
    while group.pending_forks:
        steps.append(engine.execute_step())
        assert group.pending_forks == [] or group.seqs[1].num_computed_tokens == 0
    assert [[(i, n) for _, i, n in adv] for adv in steps] == [[], [], [(0, 1), (1, 1)]]
    assert group.seqs[1].num_computed_tokens == len(prompt)
    out = drain(engine)["a"]
    ref = _reference_logprobs(model[1], prompt)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for i in range(1, len(prompt)):
        want = ref[i - 1][prompt[i]].item()
        assert out.prompt_logprobs[i] == {prompt[i]: pytest.approx(want, abs=1e-4)}
    assert out.outputs[0].token_ids == out.outputs[1].token_ids
    assert engine.check_invariants() == [] and engine.block_manager.usage == 0
    engine.shutdown()


def test_device_stats_of_a_card_without_a_memory_attr_or_scrubber(engine, monkeypatch):
    monkeypatch.setattr(engine.device, "kv_memory_attr", None)
    monkeypatch.setattr(engine.device, "scrubber", None)
    stats = engine.get_device_stats()
    assert stats["kv_pages"]["memory_attr"] is None
    assert stats["weight_pages"]["scrubbed_total"] == 0


def test_device_stats_at_tensor_parallel_size_2_are_one_record_per_card(engine, monkeypatch):
    monkeypatch.setattr(engine.executor, "device_stats", lambda: [{"rank": 0}, {"rank": 1}])
    cards = engine.get_device_stats()
    assert [card["rank"] for card in cards] == [0, 1]
    assert cards[0]["kv_pages"] == cards[1]["kv_pages"] and cards[1]["kv_pages"]["total"] == 32


def test_each_step_teaches_the_scheduler_its_forward_and_copy_costs(engine, monkeypatch):
    seen = []

    class Costs:
        def observe_copies(self, num_pages, seconds):
            seen.append(("copies", num_pages, seconds))

        def observe_forward(self, num_tokens, seconds):
            seen.append(("forward", num_tokens, seconds))

    monkeypatch.setattr(engine.scheduler, "costs", Costs())
    timings = []
    run = engine.executor.execute_model

    def timed(sched, forks):
        result = run(sched, forks)
        timings.append(result.timing)
        return result

    monkeypatch.setattr(engine.executor, "execute_model", timed)
    engine.add_request("a", PROMPT, GREEDY)
    engine.step()
    t = timings[0]
    assert t.num_tokens == 5 and t.forward_seconds > 0
    assert seen == [
        ("copies", t.num_pages_moved, t.move_seconds),
        ("forward", 5, t.forward_seconds),
    ]
    monkeypatch.undo()
    engine.abort_request("a")


def test_an_eos_token_ends_a_sequence_unless_it_ignores_eos(engine):
    eos = min(engine.eos_token_ids)
    forced = dict(temperature=0.0, max_tokens=3, logit_bias={eos: 100.0})
    engine.add_request("a", PROMPT, SamplingParams(**forced))
    engine.add_request("b", PROMPT, SamplingParams(**forced, ignore_eos=True))
    out = drain(engine)
    assert out["a"].outputs[0].token_ids == [eos] and out["a"].outputs[0].finish_reason == "stop"
    assert out["b"].outputs[0].token_ids == [eos] * 3


def test_a_group_keeps_the_params_its_request_runs_with(engine):
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=None))
    assert engine.groups["a"].params.max_tokens == 64 - len(PROMPT)
    engine.abort_request("a")


def test_a_preempted_sibling_whose_grammar_failed_rejects_its_whole_request(engine, monkeypatch):
    so = StructuredOutputsParams(regex="[a-z]+")
    engine.add_request("a", PROMPT, SamplingParams(n=2, structured_outputs=so, max_tokens=8))
    group = engine.groups["a"]
    while group.pending_forks:  # its grammar compiles, then the sibling forks off
        engine.step()
    sibling = group.seqs[1]
    engine.scheduler.preempt(sibling)  # back to the queue, as a fault's recovery does
    broken = sibling.structured_output
    monkeypatch.setattr(
        type(broken), "error", property(lambda self: "bad grammar" if self is broken else None)
    )
    engine.step()
    assert engine.take_rejected() == [("a", "bad grammar")] and engine.groups == {}


def test_faults_on_an_emulated_card_are_recovered_and_the_output_unchanged(model):
    config = EngineConfig.from_kwargs(
        model=str(model[0]), dtype="float32", device="kunlun-emu", weight_scrub_pages=0, **SETTINGS
    )
    engine = LLMEngine(config)
    engine.add_request("clean", PROMPT, GREEDY)
    clean = drain(engine)["clean"].outputs[0].token_ids
    engine.block_manager.reset_prefix_cache()
    engine.add_request("a", PROMPT, GREEDY)
    engine.step()
    engine.step()
    engine.inject_fault("kv_page", page=engine.block_manager.get_block_table("a")[0])
    assert engine.inject_fault("weight_page", "model.norm.weight", 0)["page"] == 0
    assert engine.scrub_weights() == 1  # restored from the checkpoint on disk
    assert drain(engine)["a"].outputs[0].token_ids == clean
    assert engine.device.faults.to_dict()["kv_page"]["recovered"] == 1
    assert engine.check_invariants() == [] and engine.block_manager.usage == 0
    engine.shutdown()


def test_an_llm_class_engine_names_keywords_in_its_rejections(model):
    config = EngineConfig.from_kwargs(
        model=str(model[0]), dtype="float32", device="cpu", **SETTINGS
    )
    engine = LLMEngine(config, UsageContext.LLM_CLASS)
    with pytest.raises(le.RequestRejectedError) as e:
        engine.add_request("x", list(range(70)), SamplingParams())
    assert str(e.value).endswith("or create the LLM with a larger max_model_len")
    engine.shutdown()
