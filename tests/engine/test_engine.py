"""Engine invariants: every request ends finished, aborted or rejected; every page returns to the pool."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.engine.limits import EngineLimits
from pagedserve.engine.llm_engine import RequestRejectedError
from tests.helpers.models import build_tiny_model_dir


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    build_tiny_model_dir(path, "glm4", max_position_embeddings=128)
    return path


@pytest.fixture(scope="module")
def tiny_llm(tiny_dir):
    return LLM(
        model=str(tiny_dir), dtype="float32", block_size=4, num_kv_pages=16, max_model_len=100
    )


def _drained(llm: LLM) -> bool:
    e = llm.llm_engine
    return not e.has_unfinished_requests() and e.block_manager.num_free_pages == e.num_kv_pages


def _rejection(llm: LLM, prompt_len: int, max_tokens: int, n: int = 1) -> str:
    """The error of a prompt that LLM.generate rejects (after checking the output's shape)."""
    params = SamplingParams(max_tokens=max_tokens, n=n)
    (out,) = llm.generate({"prompt_token_ids": [5] * prompt_len}, params, use_tqdm=False)
    assert out.finished and [o.finish_reason for o in out.outputs] == ["rejected"] * n
    assert all(o.token_ids == [] and o.text == "" for o in out.outputs)
    assert _drained(llm)
    return out.error


def test_request_longer_than_max_model_len_is_rejected_with_both_numbers(tiny_llm):
    error = _rejection(tiny_llm, 90, 20)
    assert "needs 110 tokens" in error and "max_model_len is 100" in error
    # offline, the way out is LLM's keyword, not a server flag
    assert "create the LLM with a larger max_model_len" in error
    assert "server" not in error and "--" not in error


def test_request_larger_than_the_whole_pool_is_rejected_with_the_pool_size(tiny_llm):
    # 16 pages x 4 tokens = 64 tokens in the whole cache
    error = _rejection(tiny_llm, 60, 20, n=2)
    assert "needs 80 tokens" in error and "holds 64 tokens" in error
    assert "gpu_memory_utilization" in error and "num_kv_pages" in error
    assert "server" not in error and "--" not in error


def test_generate_serves_every_prompt_that_fits_beside_one_that_never_can(tiny_llm, caplog):
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    fits = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [9, 8]}]
    alone = [tiny_llm.generate(p, greedy, use_tqdm=False)[0] for p in fits]
    too_long = {"prompt_token_ids": [5] * 99}
    with caplog.at_level("WARNING", logger="pagedserve.entrypoints.llm"):
        outs = tiny_llm.generate([fits[0], too_long, fits[1]], greedy, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "rejected", "length"]
    assert outs[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert outs[2].outputs[0].token_ids == alone[1].outputs[0].token_ids
    assert outs[0].error is None and outs[2].error is None
    assert "needs 105 tokens" in outs[1].error
    assert "prompt 1 rejected" in caplog.text and "needs 105 tokens" in caplog.text
    assert _drained(tiny_llm)


def test_server_engine_names_server_flags_in_its_messages(tiny_dir):
    from pagedserve.config import EngineConfig
    from pagedserve.engine.llm_engine import LLMEngine

    config = EngineConfig.from_kwargs(
        model=str(tiny_dir), dtype="float32", block_size=4, num_kv_pages=16, max_model_len=100
    )
    engine = LLMEngine(config)
    with pytest.raises(
        RequestRejectedError, match="start the server with a larger --max-model-len"
    ):
        engine.add_request("long", [5] * 90, SamplingParams(max_tokens=20))
    with pytest.raises(RequestRejectedError, match="--gpu-memory-utilization, more --num-kv-pages"):
        engine.add_request("big", [5] * 60, SamplingParams(max_tokens=20))


def test_min_tokens_beyond_the_room_a_prompt_leaves_is_rejected_naming_min_tokens(tiny_dir):
    # max_tokens left out is the room the prompt leaves (vLLM's rule); a min_tokens above it can
    # never be met, which is the client's error (400), not SamplingParams' (500)
    from pagedserve.config import EngineConfig
    from pagedserve.engine.llm_engine import LLMEngine

    config = EngineConfig.from_kwargs(
        model=str(tiny_dir), dtype="float32", block_size=4, num_kv_pages=32, max_model_len=100
    )
    engine = LLMEngine(config)
    with pytest.raises(RequestRejectedError, match="leave room for 10 in max_model_len 100") as e:
        engine.add_request("a", [5] * 90, SamplingParams(max_tokens=None, min_tokens=11))
    assert (e.value.param, e.value.too_long) == ("min_tokens", True)
    outputs = _run_to_the_end(engine, "b", [5] * 90, SamplingParams(max_tokens=None, min_tokens=10))
    assert len(outputs[-1].outputs[0].token_ids) == 10 and outputs[-1].finished  # all the room


def test_rejection_leaves_the_engine_serving_others(tiny_llm):
    engine = tiny_llm.llm_engine
    engine.add_request("ok-1", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    with pytest.raises(RequestRejectedError):
        engine.add_request("too-long", [5] * 99, SamplingParams(max_tokens=4))
    engine.add_request("ok-2", [8, 9], SamplingParams(max_tokens=4, ignore_eos=True))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert sorted(finished) == ["ok-1", "ok-2"]
    assert all(len(o.outputs[0].token_ids) == 4 for o in finished.values())
    assert _drained(tiny_llm)


def test_empty_prompt_and_out_of_vocab_ids_are_rejected(tiny_llm):
    with pytest.raises(RequestRejectedError, match="empty"):
        tiny_llm.llm_engine.add_request("e", [], SamplingParams())
    with pytest.raises(RequestRejectedError, match=r"token id 9999 is outside the vocabulary"):
        tiny_llm.llm_engine.add_request("v", [1, 9999], SamplingParams())
    assert _drained(tiny_llm)


def test_token_ids_at_both_ends_of_the_vocabulary_are_accepted_and_one_past_them_rejected(
    tiny_llm,
):
    engine = tiny_llm.llm_engine
    vocab = engine.limits.vocab_size
    engine.check_request([0, vocab - 1], SamplingParams(stop_token_ids=[0, vocab - 1]))
    for bad in (-1, vocab):
        with pytest.raises(RequestRejectedError, match=rf"prompt token id {bad} is outside"):
            engine.check_request([5, bad], SamplingParams())
        with pytest.raises(RequestRejectedError, match=rf"stop_token_ids {bad} is outside"):
            engine.check_request([5], SamplingParams(stop_token_ids=[bad]))


def test_a_request_that_fills_max_model_len_or_the_kv_cache_exactly_fits(tiny_llm):
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    whole_cache = 16 * 4 - 4  # prompt + max_tokens fill all 16 pages of 4
    (out,) = tiny_llm.generate({"prompt_token_ids": [5] * whole_cache}, greedy, use_tqdm=False)
    assert out.error is None and len(out.outputs[0].token_ids) == 4
    assert "needs 65 tokens" in _rejection(tiny_llm, whole_cache + 1, 4)
    roomy = dataclasses.replace(tiny_llm.llm_engine.limits, num_kv_pages=64)  # 256 tokens
    roomy.check_request([5] * 96, greedy)  # exactly max_model_len (100)
    with pytest.raises(RequestRejectedError, match="needs 101 tokens"):
        roomy.check_request([5] * 97, greedy)


def test_without_max_tokens_a_request_may_run_to_max_model_len(tiny_llm):
    limits = tiny_llm.llm_engine.limits
    roomy = dataclasses.replace(limits, num_kv_pages=64)  # 256 tokens: more than max_model_len
    asked = SamplingParams(max_tokens=None)
    assert roomy.check_request([5] * 30, asked).max_tokens == limits.max_model_len - 30
    assert asked.max_tokens is None  # the caller's params are left as they were
    # a prompt that fills max_model_len leaves no room: it would need one token more
    with pytest.raises(RequestRejectedError, match=r"needs 101 tokens \(100 in the prompt"):
        roomy.check_request([5] * limits.max_model_len, asked)


def test_a_rejection_names_the_request_field_at_fault_and_whether_it_is_too_long(tiny_llm):
    engine = tiny_llm.llm_engine
    vocab, max_num_seqs = engine.limits.vocab_size, engine.limits.max_num_seqs
    cases = [
        ([], SamplingParams(), "prompt", False),
        ([vocab], SamplingParams(), "prompt", False),
        ([5], SamplingParams(stop_token_ids=[vocab]), "stop_token_ids", False),
        ([5], SamplingParams(n=max_num_seqs + 1), "n", False),
        ([5] * 90, SamplingParams(max_tokens=20), "prompt", True),  # past max_model_len
        ([5] * 60, SamplingParams(max_tokens=20), "prompt", True),  # past the KV cache
    ]
    for prompt, params, param, too_long in cases:
        with pytest.raises(RequestRejectedError) as error:
            engine.check_request(prompt, params)
        assert (error.value.param, error.value.too_long) == (param, too_long), str(error.value)


def test_rejection_messages_say_what_was_asked_the_limit_and_the_way_out(tiny_llm):
    engine = tiny_llm.llm_engine
    max_num_seqs, vocab = engine.limits.max_num_seqs, engine.limits.vocab_size
    expected = [
        ([], SamplingParams(), "the prompt is empty; send at least one token"),
        (
            [5],
            SamplingParams(n=max_num_seqs + 1),
            f"n={max_num_seqs + 1} sequences cannot run at once with max_num_seqs "
            f"{max_num_seqs}; lower n or create the LLM with a larger max_num_seqs",
        ),
        (
            [5, vocab],
            SamplingParams(),
            f"prompt token id {vocab} is outside the vocabulary [0, {vocab})",
        ),
        (
            [5] * 90,
            SamplingParams(max_tokens=20),
            "this request needs 110 tokens (90 in the prompt + max_tokens 20), but max_model_len "
            "is 100; shorten the prompt, lower max_tokens, or create the LLM with a larger "
            "max_model_len",
        ),
        (
            [5] * 60,
            SamplingParams(max_tokens=20),
            "this request needs 80 tokens (60 in the prompt + max_tokens 20), but the whole KV "
            "cache holds 64 tokens (16 pages of 4); lower max_tokens or create the LLM with more "
            "KV cache (a higher gpu_memory_utilization, more num_kv_pages or a larger device)",
        ),
    ]
    for prompt, params, message in expected:
        with pytest.raises(RequestRejectedError) as error:
            engine.check_request(prompt, params)
        assert str(error.value) == message


def test_the_limits_cross_the_process_boundary_as_plain_data(tiny_llm):
    limits = tiny_llm.llm_engine.limits
    wire = json.loads(json.dumps(limits.to_dict()))  # what the HTTP process receives
    assert wire["usage_context"] == "LLM" and wire["max_model_len"] == limits.max_model_len
    assert EngineLimits.from_dict(wire) == limits


def _run_to_the_end(engine, request_id, prompt_ids, params, **kw):
    engine.add_request(request_id, prompt_ids, params, **kw)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == request_id]
    return outputs


def test_an_output_names_its_request_prompt_and_sequences_and_times_its_first_token(tiny_llm):
    engine = tiny_llm.llm_engine
    engine.block_manager.reset_prefix_cache()
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=3, ignore_eos=True)
    outputs = _run_to_the_end(engine, "named", [5, 6, 7], params, prompt="p", arrival_time=1.0)
    last = outputs[-1]
    assert (last.request_id, last.prompt, last.prompt_token_ids) == ("named", "p", [5, 6, 7])
    assert [c.index for c in last.outputs] == [0, 1] and last.finished
    assert not any(o.finished for o in outputs[:-1])
    # nothing asked: no logprobs, no prompt logprobs
    assert [(c.logprobs, c.cumulative_logprob) for c in last.outputs] == [(None, None)] * 2
    assert last.prompt_logprobs is None
    m = last.metrics
    assert 1.0 == m["arrival_time"] <= m["first_scheduled_time"] <= m["first_token_time"]
    # the same prompt again: its full block comes from the prefix cache
    (again,) = tiny_llm.generate({"prompt_token_ids": [5, 6, 7, 8, 9]}, params, use_tqdm=False)
    (cached,) = tiny_llm.generate({"prompt_token_ids": [5, 6, 7, 8, 9]}, params, use_tqdm=False)
    assert (again.num_cached_tokens, cached.num_cached_tokens) == (0, engine.block_size)
    assert _drained(tiny_llm)


def test_a_sequence_has_no_finish_reason_until_it_finishes_and_then_says_why(tiny_llm):
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    outputs = _run_to_the_end(tiny_llm.llm_engine, "why", [5, 6, 7], params)
    assert [o.outputs[0].finish_reason for o in outputs] == [None, None, "length"]
    assert [o.finished for o in outputs] == [False, False, True]


def test_logprobs_are_returned_where_asked_and_sum_to_the_cumulative_logprob(tiny_llm):
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=4, ignore_eos=True, logprobs=2)
    asked = SamplingParams(**{**vars(params), "prompt_logprobs": 1})
    (out,) = tiny_llm.generate({"prompt_token_ids": [5, 6, 7]}, asked, use_tqdm=False)
    c = out.outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == 4
    assert all(t in lp for t, lp in zip(c.token_ids, c.logprobs, strict=True))
    assert c.cumulative_logprob == pytest.approx(
        sum(lp[t] for t, lp in zip(c.token_ids, c.logprobs, strict=True))
    )
    # one entry per prompt token; the first has no context to be predicted from
    assert len(out.prompt_logprobs) == 3 and out.prompt_logprobs[0] is None
    assert 6 in out.prompt_logprobs[1] and 7 in out.prompt_logprobs[2]  # each token itself


def test_a_stop_token_id_ends_the_sequence_and_is_its_stop_reason(tiny_llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    (free,) = tiny_llm.generate({"prompt_token_ids": [5, 6, 7]}, greedy, use_tqdm=False)
    stop = free.outputs[0].token_ids[2]
    first = free.outputs[0].token_ids.index(stop)
    params = SamplingParams(**{**vars(greedy), "stop_token_ids": [stop]})
    (out,) = tiny_llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)
    c = out.outputs[0]
    assert (c.finish_reason, c.stop_reason) == ("stop", stop)
    assert c.token_ids == free.outputs[0].token_ids[: first + 1]
    assert free.outputs[0].stop_reason is None


def test_abort_frees_pages_and_reports_abort(tiny_llm):
    engine = tiny_llm.llm_engine
    engine.add_request("a", [5, 6, 7, 8, 9], SamplingParams(max_tokens=30, ignore_eos=True))
    engine.step()
    assert engine.block_manager.num_free_pages < engine.num_kv_pages
    engine.abort_request("a")
    assert _drained(tiny_llm)


def test_n_greater_than_one_shares_prompt_pages_and_each_sequence_finishes(tiny_llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    out = tiny_llm.generate({"prompt_token_ids": [5, 6, 7, 8, 9, 10]}, params, use_tqdm=False)[0]
    assert [len(c.token_ids) for c in out.outputs] == [6, 6, 6]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1  # different seeds per sequence
    assert _drained(tiny_llm)


def test_seeded_sampling_is_reproducible_whatever_else_is_in_the_batch(tiny_llm):
    params = SamplingParams(temperature=1.0, seed=123, max_tokens=8, ignore_eos=True)
    alone = tiny_llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)[0]
    others = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    batch = tiny_llm.generate(
        [{"prompt_token_ids": [9, 9]}, {"prompt_token_ids": [5, 6, 7]}],
        [others, params],
        use_tqdm=False,
    )
    assert batch[1].outputs[0].token_ids == alone.outputs[0].token_ids
    # a prefill among 20 other prompt rows, then decode steps of 6 rows: past the 8 rows where
    # oneDNN once took over from the GEMV on AVX-512 without AMX, and its rounding with it
    crowd = [{"prompt_token_ids": [9, 10 + i, 11, 12]} for i in range(5)]
    batch = tiny_llm.generate(
        [*crowd, {"prompt_token_ids": [5, 6, 7]}], [others] * 5 + [params], use_tqdm=False
    )
    assert batch[-1].outputs[0].token_ids == alone.outputs[0].token_ids


def test_string_prompts_and_chat_produce_text(tiny_llm):
    tok = tiny_llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    (out,) = tiny_llm.generate("Hello world", params, use_tqdm=False)
    assert out.prompt_token_ids == tok.encode("Hello world")
    assert out.prompt_token_ids[:2] == [2, 4]  # [gMASK]<sop> prepended
    assert len(out.outputs[0].token_ids) == 5
    assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids)
    messages = [{"role": "user", "content": "hi"}]
    (chat,) = tiny_llm.chat(messages, params, use_tqdm=False)
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert rendered.endswith("<|assistant|>") or rendered.endswith("<|assistant|>\n")
    assert chat.prompt_token_ids == tok.encode(rendered, add_special_tokens=False)
    assert chat.outputs[0].text == tok.decode(chat.outputs[0].token_ids)
    assert chat.outputs[0].finish_reason == "length"
    assert _drained(tiny_llm)


def test_chat_sends_the_tools_to_the_chat_template(tiny_llm):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    messages = [{"role": "user", "content": "hi"}]
    params = SamplingParams(max_tokens=1)
    (plain,) = tiny_llm.chat(messages, params, use_tqdm=False)
    (with_tools,) = tiny_llm.chat(messages, params, use_tqdm=False, tools=tools)
    tok = tiny_llm.llm_engine.tokenizer
    prompt = tok.decode(with_tools.prompt_token_ids, skip_special_tokens=False)
    assert "get_weather" in prompt and "get_weather" not in tok.decode(plain.prompt_token_ids)


def _generate_with_fault(llm: LLM, prompt: list[int], params: SamplingParams) -> list[int]:
    """Prefill and one decode step, then flip a bit in the request's first page, then finish."""
    engine = llm.llm_engine
    engine.block_manager.reset_prefix_cache()
    engine.add_request("faulty", prompt, params)
    outputs = engine.step() + engine.step()
    engine.device.inject_fault(engine.block_manager.get_block_table("faulty")[0])
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return next(o for o in outputs if o.finished).outputs[0].token_ids


FAULT_PROMPT = [5, 6, 7, 8, 9, 10, 11]
GREEDY_8 = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.mark.faults
def test_a_detected_kv_page_fault_is_recovered_by_recompute(tiny_llm):
    engine = tiny_llm.llm_engine
    clean = tiny_llm.generate({"prompt_token_ids": FAULT_PROMPT}, GREEDY_8, use_tqdm=False)[0]
    faults, preemptions = engine.device.num_faults_detected, engine.scheduler.num_preemptions
    assert _generate_with_fault(tiny_llm, FAULT_PROMPT, GREEDY_8) == clean.outputs[0].token_ids
    assert engine.device.num_faults_detected == faults + 1
    assert engine.scheduler.num_preemptions == preemptions + 1
    assert _drained(tiny_llm)


def test_an_unrecovered_kv_page_fault_would_corrupt_the_output(tiny_llm, monkeypatch):
    clean = tiny_llm.generate({"prompt_token_ids": FAULT_PROMPT}, GREEDY_8, use_tqdm=False)[0]
    faults = tiny_llm.llm_engine.device.faults
    before = faults.to_dict()["kv_page"]
    monkeypatch.setattr(tiny_llm.llm_engine.fault_recovery, "enabled", False)  # recovery off
    assert _generate_with_fault(tiny_llm, FAULT_PROMPT, GREEDY_8) != clean.outputs[0].token_ids
    after = faults.to_dict()["kv_page"]
    assert {k: after[k] - before[k] for k in after} == {
        "injected": 1,
        "detected": 1,
        "recovered": 0,
    }
    assert _drained(tiny_llm)


def test_stop_token_ids_outside_the_vocabulary_are_rejected(tiny_llm):
    with pytest.raises(
        RequestRejectedError, match=r"stop_token_ids 5000 is outside the vocabulary"
    ):
        tiny_llm.llm_engine.add_request("s", [1, 2], SamplingParams(stop_token_ids=[3, 5000]))
    assert _drained(tiny_llm)


def test_invalid_engine_settings_name_the_flag():
    from pagedserve.config import EngineConfig

    with pytest.raises(
        ValueError, match=r"--block-size 0: Input should be greater than or equal to 1"
    ):
        EngineConfig.from_kwargs(block_size=0)
    with pytest.raises(ValueError, match=r"--gpu-memory-utilization 1.5"):
        EngineConfig.from_kwargs(gpu_memory_utilization=1.5)


def test_invalid_llm_settings_name_the_keyword():
    with pytest.raises(ValueError, match=r"block_size=0: Input should be greater than or equal"):
        LLM(model="demo", block_size=0)
    with pytest.raises(ValueError, match=r"max_model_len=4096 exceeds .* use max_model_len=2048"):
        LLM(model="demo", max_model_len=4096, num_kv_pages=16)


def test_n_more_than_max_num_seqs_is_rejected_with_both_numbers(tiny_llm):
    limit = tiny_llm.llm_engine.config.scheduler.max_num_seqs
    with pytest.raises(RequestRejectedError, match=rf"n={limit + 1} .*max.num.seqs {limit}"):
        tiny_llm.llm_engine.add_request("n", [1, 2], SamplingParams(n=limit + 1))
    assert _drained(tiny_llm)


def test_forked_siblings_never_push_the_batch_past_max_num_seqs(tmp_path):
    build_tiny_model_dir(tmp_path, "glm4", max_position_embeddings=128)
    llm = LLM(model=str(tmp_path), dtype="float32", block_size=4, num_kv_pages=32, max_num_seqs=3)
    scheduler = llm.llm_engine.scheduler
    schedule, batch_sizes = scheduler.schedule, []

    def recorded():
        out = schedule()
        batch_sizes.append(max(len(scheduler.running), len(out.scheduled)))
        return out

    scheduler.schedule = recorded
    params = [
        SamplingParams(max_tokens=4, ignore_eos=True),
        SamplingParams(n=3, temperature=1.0, max_tokens=4, ignore_eos=True),
    ]
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 2, params, use_tqdm=False)
    assert [len(c.token_ids) for o in outs for c in o.outputs] == [4, 4, 4, 4]
    assert max(batch_sizes) == 3
    assert _drained(llm)
