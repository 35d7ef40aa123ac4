"""The engine across its memory tiers: swapped-out sequences and a host prefix cache (their
figures, a fault in a host frame recovered by recompute, settings that cannot work, the multi-turn
benchmark's workload at a tiny size), the auto preemption mode's choice by measured cost, and the
INT8 KV cache (its page size, its greedy tokens against a 16-bit cache)."""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.engine.request import RequestStatus
from pagedserve.engine.swap_policy import MIN_PREFILL_TOKENS, PreemptionCosts, should_swap
from tests.helpers.models import build_tiny_hf_model, drain, host_tier_gib

BLOCK = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# two requests of 30 + 12 tokens (11 pages each) in 16 pages: the second is preempted
PROMPTS = [[(5 * i + k) % 300 + 10 for i in range(30)] for k in (1, 2)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiers")
    build_tiny_hf_model(path, "glm4", max_position_embeddings=256)
    return path


def _llm(tiny_dir, device="kunlun-emu", swap=32, cache=0, **kwargs) -> LLM:
    return LLM(
        model=str(tiny_dir),
        dtype="float32",
        device=device,
        block_size=BLOCK,
        num_kv_pages=16,
        swap_space=host_tier_gib(tiny_dir, swap, BLOCK),
        host_prefix_cache=host_tier_gib(tiny_dir, cache, BLOCK),
        **kwargs,
    )


@pytest.fixture(scope="module")
def swapping(tiny_dir):
    return _llm(tiny_dir, preemption_mode="swap", cache=8)


@pytest.fixture(scope="module")
def clean(tiny_dir):
    """Each prompt's greedy tokens alone, in a pool that never preempts."""
    llm = LLM(model=str(tiny_dir), dtype="float32", device="cpu", num_kv_pages=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _drained(llm: LLM) -> bool:
    e = llm.llm_engine
    host = e.block_manager.host
    return (
        not e.has_unfinished_requests()
        and e.check_invariants() == []
        and e.block_manager.usage == 0
        and (host is None or not host.block_tables)
    )


def _run_until_swapped(llm: LLM) -> tuple[list, object]:
    """Add both prompts and step until one of them is swapped out; the outputs so far and it."""
    engine = llm.llm_engine
    engine.block_manager.reset_prefix_cache()
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, GREEDY)
    outputs = []
    for _ in range(100):
        outputs += engine.step()
        if engine.scheduler.swapped:
            return outputs, engine.scheduler.swapped[0]
    raise AssertionError("nothing was swapped out")


def _finish(llm: LLM, outputs: list) -> list[list[int]]:
    """Each prompt's tokens, once the engine has drained."""
    last = drain(llm.llm_engine, outputs)
    return [last[f"r{i}"].outputs[0].token_ids for i in range(len(PROMPTS))]


# ---- swap and the host prefix cache ----------------------------------------------------------
def test_a_swapped_out_request_resumes_by_copy_and_answers_as_if_alone(swapping, clean):
    engine = swapping.llm_engine
    outputs, victim = _run_until_swapped(swapping)
    assert victim.status is RequestStatus.SWAPPED and victim.num_computed_tokens > 0
    stats = engine.get_stats()
    assert stats["num_requests_swapped"] == 1 and stats["num_swapped_pages"] > 0
    host = engine.get_device_stats()["host_pages"]
    assert host["swapped"] == stats["num_swapped_pages"] and host["total"] == 40
    assert engine.get_page_map()["host"]["counts"]["swapped"] == host["swapped"]
    recomputed = stats["recomputed_tokens_total"]
    assert _finish(swapping, outputs) == clean
    after = engine.get_stats()
    assert after["recomputed_tokens_total"] == recomputed  # nothing recomputed
    assert after["swapped_in_pages_total"] == after["swapped_out_pages_total"] > 0
    assert after["num_requests_swapped"] == after["num_swapped_pages"] == 0
    assert _drained(swapping)


@pytest.mark.faults
def test_a_fault_in_a_swapped_out_page_is_detected_and_its_request_recomputes(swapping, clean):
    engine = swapping.llm_engine
    faults = engine.device.faults.to_dict()["kv_page"]
    outputs, victim = _run_until_swapped(swapping)
    frame = engine.block_manager.host.block_tables[victim.request_id][0]
    assert engine.inject_fault("host_page") == {"kind": "host_page", "page": frame}
    outputs += engine.step()  # detected before anything is scheduled
    assert victim.status is not RequestStatus.SWAPPED and victim.num_lost_tokens > 0
    assert not engine.block_manager.is_swapped(victim)  # it recomputes (prefix hits may help)
    assert _finish(swapping, outputs) == clean  # no wrong answer
    after = engine.device.faults.to_dict()["kv_page"]
    assert {k: after[k] - faults[k] for k in after} == {
        "injected": 1,
        "detected": 1,
        "recovered": 1,
    }
    assert _drained(swapping)


def test_the_same_host_fault_unrecovered_would_corrupt_the_answer(swapping, clean, monkeypatch):
    engine = swapping.llm_engine
    monkeypatch.setattr(engine.fault_recovery, "enabled", False)  # recovery off
    faults = engine.device.faults.to_dict()["kv_page"]
    outputs, _ = _run_until_swapped(swapping)
    engine.inject_fault("host_page")
    assert _finish(swapping, outputs) != clean
    after = engine.device.faults.to_dict()["kv_page"]
    assert {k: after[k] - faults[k] for k in after} == {
        "injected": 1,
        "detected": 1,
        "recovered": 0,
    }
    assert _drained(swapping)


@pytest.mark.faults
def test_a_host_fault_injected_with_nothing_there_hits_frame_0_and_is_recovered(swapping):
    engine = swapping.llm_engine
    engine.block_manager.reset_prefix_cache()  # the host tier's too
    before = engine.device.faults.to_dict()["kv_page"]
    assert engine.inject_fault("host_page") == {"kind": "host_page", "page": 0}
    assert engine.step() == []  # found; nothing holds the frame any more
    after = engine.device.faults.to_dict()["kv_page"]
    assert {k: after[k] - before[k] for k in after} == {
        "injected": 1,
        "detected": 1,
        "recovered": 1,
    }
    assert _drained(swapping)


def test_a_host_fault_injection_outside_the_host_tier_names_its_frames(swapping):
    num_frames = swapping.llm_engine.block_manager.host.num_frames
    for frame in (-1, num_frames):
        with pytest.raises(ValueError, match=rf"frames are 0\.\.{num_frames - 1}, not {frame}$"):
            swapping.llm_engine.inject_fault("host_page", page=frame)


@pytest.mark.faults
def test_a_step_whose_swap_out_fails_recomputes_its_victim(tiny_dir, clean, monkeypatch):
    """A failed step's page moves may not have run: the victim it swapped out recomputes rather
    than come back from frames nobody wrote (here the swap-out itself fails)."""
    from pagedserve.hal.faults import DeviceKernelError

    llm = _llm(tiny_dir, device="cpu", preemption_mode="swap")
    engine = llm.llm_engine
    swap_out = engine.device.swap_out

    def fail_once(moves):
        if not moves:  # every step calls it; the first one that copies fails
            return swap_out(moves)
        monkeypatch.setattr(engine.device, "swap_out", swap_out)
        raise DeviceKernelError("the copy to the host tier failed")

    monkeypatch.setattr(engine.device, "swap_out", fail_once)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, GREEDY)
    last = drain(engine)
    (failed,) = engine.take_failed()
    assert failed[0] == "r0" and "the copy to the host tier failed" in failed[1]
    (done,) = [o for o in last.values() if o.finished]
    assert done.request_id == "r1" and done.outputs[0].token_ids == clean[1]
    assert engine.scheduler.num_swapped_preemptions == 1 and _drained(llm)
    # a failed copy is no fault of the KV pages: nothing counted as one
    assert engine.device.faults.to_dict()["kv_page"] == dict.fromkeys(
        ("injected", "detected", "recovered"), 0
    )


def test_a_later_turn_finds_its_history_in_the_host_tier(tiny_dir, clean):
    """A conversation's blocks, evicted from the KV tier by another one, come back by copy."""
    llm = _llm(tiny_dir, swap=0, cache=32)
    engine = llm.llm_engine
    first = llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False)[0]
    # 42 tokens: 10 full blocks cached; the next request's 11 pages evict the last 5 of them
    llm.generate({"prompt_token_ids": PROMPTS[1]}, GREEDY, use_tqdm=False)
    before = engine.get_stats()
    assert before["host_prefix_cache_hits_total"] == 0
    turn = PROMPTS[0] + first.outputs[0].token_ids + [7, 8, 9]
    again = llm.generate({"prompt_token_ids": turn}, GREEDY, use_tqdm=False)[0]
    stats = engine.get_stats()
    assert again.num_cached_tokens == 40  # every full block of the first turn
    assert stats["prefix_cache_hits_total"] - before["prefix_cache_hits_total"] == 40
    assert stats["host_prefix_cache_hits_total"] == 20  # 5 of them copied back from the host
    assert stats["host_prefix_cache_queries_total"] - before["host_prefix_cache_queries_total"] == (
        len(turn) - 20
    )  # the turn's tokens that the KV tier did not have
    alone = LLM(model=str(tiny_dir), dtype="float32", device="cpu", num_kv_pages=64)
    reference = alone.generate({"prompt_token_ids": turn}, GREEDY, use_tqdm=False)[0]
    assert again.outputs[0].token_ids == reference.outputs[0].token_ids
    assert _drained(llm)


def test_without_a_host_tier_every_server_still_exports_its_figures(tiny_dir):
    llm = LLM(model=str(tiny_dir), dtype="float32", device="cpu", num_kv_pages=16)
    stats = llm.llm_engine.get_stats()
    assert stats["num_swapped_pages"] == stats["swapped_out_pages_total"] == 0
    assert "host_pages" not in llm.llm_engine.get_device_stats()
    assert "host" not in llm.llm_engine.get_page_map()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(preemption_mode="swap"), r"preemption_mode='swap' needs .* swap_space="),
        (
            dict(host_prefix_cache=0.001, enable_prefix_caching=False),
            r"host_prefix_cache keeps prefix blocks .*\(enable_prefix_caching=True\)",
        ),
        (
            dict(preemption_mode="sometimes"),
            r"preemption_mode='sometimes': .*recompute, swap, auto",
        ),
        (dict(kv_cache_dtype="fp8"), r"kv_cache_dtype='fp8': .*auto, int8"),
        (dict(swap_space=-1), r"swap_space=-1: Input should be greater than or equal to 0"),
    ],
)
def test_settings_that_cannot_work_name_the_keyword(tiny_dir, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(model=str(tiny_dir), dtype="float32", device="cpu", num_kv_pages=16, **kwargs)


def test_more_host_memory_than_the_host_tier_has_is_refused_naming_both_flags(tiny_dir):
    with pytest.raises(
        ValueError,
        match=r"swap_space 3 GiB and host_prefix_cache 0.5 GiB \(3.50 GiB\) do not fit the host "
        r"tier of kunlun-emu-small: 2.00 GiB free of 2.00 GiB",
    ):
        LLM(
            model=str(tiny_dir),
            dtype="float32",
            device="kunlun-emu-small",
            swap_space=3,
            host_prefix_cache=0.5,
        )


def test_the_server_names_its_flags(capsys):
    from pagedserve.entrypoints.cli.main import main

    assert main(["serve", "--preemption-mode", "swap", "--num-kv-pages", "16"]) == 2
    err = capsys.readouterr().err
    assert "--preemption-mode 'swap' needs host memory to swap to" in err
    assert "start the server with --swap-space GiB as well" in err


def test_the_multi_turn_benchmark_answers_alike_in_every_mode_and_recomputes_less(tiny_dir):
    """benchmarks/kv_tiers.py's workload at a tiny size, in float32: every mode gives every turn
    the same greedy answer; swap recomputes nothing a preemption freed, and a host prefix cache
    gives the later turns their histories back by copy."""
    import argparse

    from benchmarks import kv_tiers

    args = argparse.Namespace(
        conversations=4, turns=3, user_tokens=20, max_tokens=8, fast_tier=0.34,
        dtype="float32", quantization="none", device="cpu", seed=0,
    )  # fmt: skip
    messages = kv_tiers.user_messages(args, vocab_size=320)
    modes = ("recompute", "swap", "swap+host-cache")  # the benchmark's default
    results = {mode: kv_tiers.run_mode(args, mode, str(tiny_dir), messages) for mode in modes}
    kv_tiers.compare_answers(results)
    assert {m: r["parted_turns_tokens_in_common"] for m, r in results.items()} == {
        m: {} for m in modes
    }
    recompute, swap, host = (results[m] for m in modes)
    assert all(r["turns"] == 12 for r in results.values())
    assert recompute["preemption_tokens_recomputed"] > 0 and recompute["swapped_preemptions"] == 0
    assert swap["swapped_preemptions"] == swap["preemptions"] > 0
    assert swap["preemption_tokens_recomputed"] == 0
    assert host["host_prefix_cache_hit_tokens"] > 0
    assert host["recomputed_tokens"] < swap["recomputed_tokens"] < recompute["recomputed_tokens"]


# ---- auto: by measured cost ------------------------------------------------------------------
def test_auto_swaps_while_the_copy_is_cheaper_and_recomputes_when_it_is_not():
    costs = PreemptionCosts()
    assert should_swap("auto", costs, 10, 40)  # nothing measured yet: a page copy is the guess
    costs.observe_copies(8, 8e-4)  # 0.1 ms a page
    costs.observe_forward(MIN_PREFILL_TOKENS - 1, 1.0)  # a decode-sized step: not a prefill rate
    assert costs.seconds_per_prefill_token is None
    costs.observe_forward(100, 1e-3)  # 10 us a token
    assert should_swap("auto", costs, 10, 400)  # 2 ms of copies against 4 ms of prefill
    assert not should_swap("auto", costs, 10, 40)  # against 0.4 ms
    assert should_swap("swap", costs, 10, 40) and not should_swap("recompute", costs, 10, 400)


def test_auto_charges_a_swap_two_copies_and_a_recompute_a_prefill_of_its_tokens():
    costs = PreemptionCosts()
    costs.observe_copies(4, 4e-4)  # 0.1 ms a page, one way
    costs.observe_forward(200, 2e-3)  # 10 us a token
    # 10 pages: 1 ms one way, 2 ms out and back in
    assert not should_swap("auto", costs, 10, 150)  # against 1.5 ms of prefill
    assert should_swap("auto", costs, 10, 250)  # against 2.5 ms


def test_auto_swaps_only_when_the_copy_is_strictly_cheaper():
    costs = PreemptionCosts(seconds_per_page_copy=1e-4, seconds_per_prefill_token=1e-4)
    assert not should_swap("auto", costs, 1, 2)  # two copies of a page: a prefill of 2 tokens
    assert should_swap("auto", costs, 1, 3)


def test_auto_swaps_while_either_rate_is_unmeasured():
    copies_only = PreemptionCosts(seconds_per_page_copy=1.0)  # a copy dearer than any prefill
    prefill_only = PreemptionCosts(seconds_per_prefill_token=1e-9)
    assert should_swap("auto", copies_only, 10, 1) and should_swap("auto", prefill_only, 10, 1)


def test_a_prefill_of_min_prefill_tokens_is_measured_and_a_step_without_copies_is_not():
    costs = PreemptionCosts()
    costs.observe_copies(0, 1e-3)  # a step that moved no page
    costs.observe_forward(MIN_PREFILL_TOKENS, 1e-3)
    assert costs.seconds_per_page_copy is None
    assert costs.seconds_per_prefill_token == pytest.approx(1e-3 / MIN_PREFILL_TOKENS)


def test_each_rate_moves_part_way_toward_each_new_measurement_and_settles_on_a_steady_one():
    costs = PreemptionCosts()
    costs.observe_copies(1, 1e-3)  # the first measurement is the rate
    costs.observe_forward(100, 1e-1)  # 1 ms a token
    assert costs.seconds_per_page_copy == pytest.approx(1e-3)
    costs.observe_copies(1, 2e-3)
    costs.observe_forward(100, 2e-1)
    assert 1e-3 < costs.seconds_per_page_copy < 2e-3
    assert 1e-3 < costs.seconds_per_prefill_token < 2e-3
    for _ in range(200):
        costs.observe_copies(2, 4e-3)
        costs.observe_forward(50, 1e-1)
    assert costs.seconds_per_page_copy == pytest.approx(2e-3)
    assert costs.seconds_per_prefill_token == pytest.approx(2e-3)


def test_auto_recomputes_when_the_swap_space_is_full(tiny_dir, clean):
    llm = _llm(tiny_dir, swap=2, preemption_mode="auto")  # 2 frames: no sequence fits
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == clean
    scheduler = llm.llm_engine.scheduler
    assert scheduler.num_preemptions > 0 and scheduler.num_swapped_preemptions == 0
    assert _drained(llm)


def test_auto_measures_both_rates_from_the_steps_it_runs(swapping):
    costs = swapping.llm_engine.scheduler.costs  # after the tests above: swaps and prefills ran
    assert costs.seconds_per_page_copy > 0 and costs.seconds_per_prefill_token > 0


# ---- INT8 KV ---------------------------------------------------------------------------------
def test_an_int8_kv_cache_holds_nearly_twice_the_pages_of_a_16_bit_one(tiny_dir):
    pages = {}
    for kv_cache_dtype in ("auto", "int8"):
        llm = LLM(
            model=str(tiny_dir),
            dtype="bfloat16",
            device="kunlun-emu-small",
            gpu_memory_utilization=0.5,
            kv_cache_dtype=kv_cache_dtype,
        )
        engine = llm.llm_engine
        pages[kv_cache_dtype] = engine.num_kv_pages
        head_dim, heads, layers = 16, 2, 2
        row = head_dim + 4 if kv_cache_dtype == "int8" else 2 * head_dim
        assert engine.kv_bytes_per_token() == 2 * layers * heads * row
        assert engine.runner.kv_cache.shape[-1] == (20 if kv_cache_dtype == "int8" else 16)
        assert "int8 + a scale per token and head" in engine.describe() or kv_cache_dtype == "auto"
        kv_pages = engine.get_device_stats()["kv_pages"]
        assert kv_pages["kv_cache_dtype"] == ("int8" if kv_cache_dtype == "int8" else "bfloat16")
    # head_dim 16: 20 bytes a head against 32
    assert pages["int8"] == pytest.approx(pages["auto"] * 32 / 20, rel=1e-3)


@pytest.mark.parametrize("kernels", ["auto", "eager"])
def test_int8_kv_greedy_tokens_stay_close_to_a_16_bit_cache(tiny_dir, kernels):
    prompts = [{"prompt_token_ids": p} for p in PROMPTS + [list(range(20, 60))]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1)
    runs = {}
    for kv_cache_dtype in ("auto", "int8"):
        llm = LLM(
            model=str(tiny_dir),
            dtype="float32",
            device="cpu",
            kernels=kernels,
            num_kv_pages=64,
            kv_cache_dtype=kv_cache_dtype,
        )
        runs[kv_cache_dtype] = llm.generate(prompts, params, use_tqdm=False)
    agree = total = 0
    for ref, got in zip(runs["auto"], runs["int8"]):
        ref_ids, got_ids = ref.outputs[0].token_ids, got.outputs[0].token_ids
        same = next((i for i, (a, b) in enumerate(zip(ref_ids, got_ids)) if a != b), len(ref_ids))
        agree, total = agree + same, total + len(ref_ids)
        for i in range(min(same, 8)):  # where the contexts agree, the chosen token's logprob too
            lp_ref = ref.outputs[0].logprobs[i][ref_ids[i]]
            lp_got = got.outputs[0].logprobs[i][got_ids[i]]
            assert abs(lp_ref - lp_got) < 0.05
    assert agree / total >= 0.75


def test_int8_kv_and_swap_give_the_same_tokens_as_int8_kv_alone(tiny_dir):
    """An INT8 page moves to the host tier and back as it is: codes and scales."""
    outs = {}
    for mode in ("recompute", "swap"):
        llm = _llm(tiny_dir, device="cpu", preemption_mode=mode, kv_cache_dtype="int8")
        got = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        outs[mode] = [o.outputs[0].token_ids for o in got]
        assert (llm.llm_engine.scheduler.num_swapped_preemptions > 0) == (mode == "swap")
        assert _drained(llm)
    assert outs["recompute"] == outs["swap"]
