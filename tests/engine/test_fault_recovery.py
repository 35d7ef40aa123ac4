"""Fault recovery with several requests in the batch: a fault touches only the requests that hold
it, a failed step ends only the requests it computed (a request's siblings once), and what it
did not write stays cached; each fault counted by the check that found it and the one that
showed it recovered."""

from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.engine.output_processor import EngineStepError
from pagedserve.hal.faults import WEIGHT_PAGE_BYTES, DeviceKernelError
from tests.helpers.models import build_tiny_model_dir, drain, host_tier_gib

BLOCK = 4
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13]  # 2 full blocks and one token
OTHER = [21, 22, 23, 24, 25, 26, 27]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    build_tiny_model_dir(path, "glm4", max_position_embeddings=128)
    return LLM(
        model=str(path),
        dtype="float32",
        device="kunlun-emu",
        block_size=BLOCK,
        num_kv_pages=32,
        max_model_len=64,
        max_num_seqs=4,
        weight_scrub_pages=0,  # no patrol: these tests scrub on demand
    )


@pytest.fixture(autouse=True)
def drained(llm):
    """Each test starts with an empty cache and leaves every page back in the pool."""
    engine = llm.llm_engine
    engine.block_manager.reset_prefix_cache()
    engine.take_failed()
    yield
    assert not engine.has_unfinished_requests()
    assert engine.check_invariants() == [] and engine.block_manager.usage == 0


def _clean(llm: LLM, prompt: list[int]) -> list[int]:
    llm.llm_engine.block_manager.reset_prefix_cache()
    out = llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False)[0]
    llm.llm_engine.block_manager.reset_prefix_cache()
    return out.outputs[0].token_ids


def _finish(engine, outputs: list) -> dict[str, list[int]]:
    """Each finished request's tokens, once the engine has drained."""
    return {rid: o.outputs[0].token_ids for rid, o in drain(engine, outputs).items() if o.finished}


@pytest.mark.faults
def test_a_kv_fault_preempts_only_the_request_that_holds_the_page(llm):
    engine = llm.llm_engine
    clean = {"a": _clean(llm, PROMPT), "b": _clean(llm, OTHER)}
    engine.add_request("a", PROMPT, GREEDY)
    engine.add_request("b", OTHER, GREEDY)
    outputs = engine.step() + engine.step()
    a, b = (next(r for r in engine.scheduler.running if r.request_id == i) for i in "ab")
    before = engine.device.faults.to_dict()["kv_page"]
    engine.inject_fault("kv_page", page=engine.block_manager.get_block_table("b")[1])
    recovery = engine.fault_recovery
    assert recovery.recover_kv_pages() == [b]
    assert engine.scheduler.running == [a] and b.num_computed_tokens == 0
    after = engine.device.faults.to_dict()["kv_page"]
    assert {k: after[k] - before[k] for k in after} == {
        "injected": 1,
        "detected": 1,
        "recovered": 1,
    }
    engine.inject_fault("kv_page", page=engine.block_manager.get_block_table("a")[0])
    assert recovery.recover_kv_pages() == [a] and engine.scheduler.running == []
    after = engine.device.faults.to_dict()["kv_page"]
    assert {k: after[k] - before[k] for k in after} == {
        "injected": 2,
        "detected": 2,
        "recovered": 2,
    }
    assert _finish(engine, outputs) == clean


@pytest.mark.faults
def test_a_failed_step_ends_a_request_and_its_siblings_once_saying_why(llm):
    engine = llm.llm_engine
    params = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    engine.add_request("pair", PROMPT, params)
    engine.step()
    engine.inject_fault("step")
    assert engine.step() == []
    assert engine.take_failed() == [
        (
            "pair",
            "the engine step computing this request failed (DeviceKernelError('kunlun-emu: "
            "injected kernel fault (an XPU exception mid-step)')); the engine goes on serving: "
            "send the request again",
        )
    ]


@pytest.mark.faults
def test_a_failed_step_uncaches_the_blocks_it_wrote_and_keeps_the_prefix_it_found(llm):
    engine = llm.llm_engine
    bm = engine.block_manager
    engine.add_request("first", PROMPT, GREEDY)
    drain(engine)
    cached = set(bm.cached_block_hash_to_page)  # the first's full blocks: 15 tokens, 3 blocks
    assert len(cached) == 3
    # the first 2 blocks come from the cache; the step writes the third (cached as it is
    # allocated, before the forward pass) and a partial fourth
    engine.add_request("second", PROMPT[:8] + OTHER, GREEDY)
    engine.inject_fault("step")
    assert engine.step() == []
    assert [rid for rid, _ in engine.take_failed()] == ["second"]
    assert set(bm.cached_block_hash_to_page) == cached


@pytest.mark.faults
def test_each_failed_step_counts_until_a_step_runs(llm):
    engine = llm.llm_engine
    faults = engine.device.faults
    engine.add_request("w", PROMPT, GREEDY)  # a step that runs: earlier failures recovered
    drain(engine)
    before = faults.to_dict()["step"]
    for rid in ("x", "y"):  # two steps fail in a row: both recovered by the next that runs
        engine.add_request(rid, PROMPT, GREEDY)
        engine.inject_fault("step")
        assert engine.step() == []
    assert [rid for rid, _ in engine.take_failed()] == ["x", "y"]
    assert faults.to_dict()["step"]["recovered"] == before["recovered"]
    engine.add_request("z", PROMPT, GREEDY)
    drain(engine)
    after = faults.to_dict()["step"]
    assert {k: after[k] - before[k] for k in after} == {
        "injected": 2,
        "detected": 2,
        "recovered": 2,
    }


def test_a_step_whose_patrol_finds_nothing_runs_its_forward_pass_once(llm, monkeypatch):
    engine = llm.llm_engine
    runner = engine.runner
    forward, passes = runner.forward, []

    def counted(inp):
        passes.append(len(inp.input_ids))
        return forward(inp)

    monkeypatch.setattr(runner, "forward", counted)
    monkeypatch.setattr(engine.config.device, "weight_scrub_pages", 2)
    scrubbed = engine.device.scrubber.num_pages_scrubbed
    engine.add_request("once", PROMPT, SamplingParams(max_tokens=2, ignore_eos=True))
    drain(engine)
    assert passes == [len(PROMPT), 1]  # the prefill, one decode: no pass twice
    assert engine.device.scrubber.num_pages_scrubbed == scrubbed + 2 * 2  # 2 pages a step


@pytest.mark.faults
def test_with_recovery_off_a_scrub_counts_a_corrupted_page_and_restores_nothing(llm, monkeypatch):
    engine = llm.llm_engine
    monkeypatch.setattr(engine.fault_recovery, "enabled", False)
    faults = engine.device.faults
    before = faults.to_dict()["weight_page"]
    injected = engine.inject_fault("weight_page", "model.norm.weight", 0)
    assert engine.scrub_weights() == 0
    after = faults.to_dict()["weight_page"]
    assert {k: after[k] - before[k] for k in after} == {
        "injected": 1,
        "detected": 1,
        "recovered": 0,
    }
    monkeypatch.undo()
    assert engine.scrub_weights() == 1  # still there: restored now
    assert injected == {"kind": "weight_page", "tag": "model.norm.weight", "page": 0}


def test_a_new_recovery_has_no_failed_step_to_count_recovered():
    from types import SimpleNamespace

    from pagedserve.engine.fault_recovery import FaultRecovery
    from pagedserve.hal.faults import FaultCounts

    device = SimpleNamespace(faults=FaultCounts())
    FaultRecovery(device, None, None, None, None, None).step_done()
    assert device.faults.to_dict()["step"] == {"injected": 0, "detected": 0, "recovered": 0}


def test_fault_recovery_is_on_unless_its_variable_says_off(monkeypatch):
    from pagedserve.engine.fault_recovery import FaultRecovery

    def enabled() -> bool:
        return FaultRecovery(None, None, None, None, None, None).enabled

    monkeypatch.delenv("PAGEDSERVE_FAULT_RECOVERY", raising=False)
    assert enabled()
    monkeypatch.setenv("PAGEDSERVE_FAULT_RECOVERY", "on")
    assert enabled()
    monkeypatch.setenv("PAGEDSERVE_FAULT_RECOVERY", "off")
    assert not enabled()


def test_fault_injection_says_what_it_needs_and_what_it_takes(llm):
    from types import SimpleNamespace

    from pagedserve.engine.fault_recovery import FaultRecovery

    cpu = FaultRecovery(SimpleNamespace(name="cpu"), None, None, None, None, None)
    with pytest.raises(ValueError) as e:
        cpu.inject_fault("step")
    assert str(e.value) == "fault injection needs --device kunlun-emu, not cpu"
    engine = llm.llm_engine
    with pytest.raises(ValueError) as e:
        engine.inject_fault("disk")
    assert str(e.value) == "unknown fault kind 'disk'; use kv_page, host_page, weight_page or step"
    with pytest.raises(ValueError) as e:
        engine.inject_fault("host_page")
    assert str(e.value) == "no host tier: start with --swap-space or --host-prefix-cache GiB"
    # a named page of a tensor of several: that one each time, never one drawn at random
    tag = "model.embed_tokens.weight"
    embed = engine.device.weight_tensors[tag]
    last = -(-embed.numel() * embed.element_size() // WEIGHT_PAGE_BYTES) - 1
    assert last >= 1
    for _ in range(8):
        assert engine.inject_fault("weight_page", tag, last) == {
            "kind": "weight_page",
            "tag": tag,
            "page": last,
        }
        assert engine.scrub_weights() == 1


@pytest.mark.faults
def test_a_step_whose_swap_in_fails_uncaches_the_pages_it_was_copying_into(tmp_path, monkeypatch):
    """The copies back from the host tier may not have run: the pages they were filling leave
    the prefix cache (they were cached as the swap-in was scheduled), and their request ends."""
    engine = _host_tier_engine(tmp_path, 32, device="cpu", preemption_mode="swap")
    swap_in, copied_into = engine.device.swap_in, []

    def fail_once(moves):
        if not moves:  # every step calls it; the first one that copies fails
            return swap_in(moves)
        monkeypatch.setattr(engine.device, "swap_in", swap_in)
        copied_into.extend(page for _, page in moves)
        raise DeviceKernelError("the copy back from the host tier failed")

    monkeypatch.setattr(engine.device, "swap_in", fail_once)
    prompts = [[(5 * i + k) % 300 + 10 for i in range(30)] for k in (1, 2)]  # 11 pages each
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    while not copied_into:
        engine.step()
    (failed,) = engine.take_failed()
    assert failed[0] == "r1" and "the copy back from the host tier failed" in failed[1]
    assert len(copied_into) >= 2
    assert not set(copied_into) & set(engine.block_manager.page_to_cached_block)
    drain(engine)
    assert engine.check_invariants() == [] and engine.block_manager.usage == 0


def _host_tier_engine(tmp_path, num_frames: int = 8, **settings):
    """An engine of 16 KV pages with a host tier of ``num_frames`` frames, on kunlun-emu unless
    ``settings`` say otherwise."""
    build_tiny_model_dir(tmp_path, "glm4", max_position_embeddings=128)
    settings = {"device": "kunlun-emu", **settings}
    swap_space = host_tier_gib(tmp_path, num_frames, BLOCK)
    llm = LLM(
        model=str(tmp_path), dtype="float32", block_size=BLOCK, num_kv_pages=16,
        swap_space=swap_space, **settings,
    )  # fmt: skip
    return llm.llm_engine


@pytest.mark.faults
def test_each_host_frame_fault_is_counted_recovered_once_nothing_holds_the_frame(tmp_path):
    engine = _host_tier_engine(tmp_path)
    for frame in (0, 5):  # one a step, in frames nothing holds
        assert engine.inject_fault("host_page", page=frame) == {"kind": "host_page", "page": frame}
        assert engine.step() == []
    counts = engine.device.faults.to_dict()["kv_page"]
    assert counts == {"injected": 2, "detected": 2, "recovered": 2}


def test_a_host_fault_injected_by_default_hits_the_first_frame_a_swapped_request_holds(tmp_path):
    engine = _host_tier_engine(tmp_path)
    host = engine.block_manager.host
    first = host.hold("first", 2)  # frames as two swapped-out requests would hold them
    second = host.hold("second", 2)
    host.release("first")
    assert second[0] != 0
    assert engine.inject_fault("host_page") == {"kind": "host_page", "page": second[0]}
    host.release("second")
    assert engine.step() == [] and first[0] == 0
    assert engine.device.faults.to_dict()["kv_page"]["recovered"] == 1


def test_a_forward_pass_that_raises_for_another_cause_makes_generate_raise_naming_it(
    llm, monkeypatch
):
    # not a device fault but a bug: no output of that call can be trusted, so generate raises,
    # naming the requests the failing step computed and the cause, once the others are aborted;
    # the engine serves the next call
    model = llm.llm_engine.model
    forward, calls = model.forward, []
    boom = IndexError("index 2047 is out of bounds for dimension 1 with size 1025")

    def second_step_raises(*args):
        calls.append(1)
        if len(calls) == 2:
            raise boom
        return forward(*args)

    monkeypatch.setattr(model, "forward", second_step_raises)
    prompts = [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": OTHER}]
    with pytest.raises(EngineStepError) as raised:
        llm.generate(prompts, GREEDY, use_tqdm=False)
    assert raised.value.__cause__ is boom
    n = llm._counter
    assert str(raised.value) == (
        f"the engine failed computing request(s) {n - 2}, {n - 1}: {boom!r} (a bug in "
        "pagedserve: its traceback is logged above); the other requests of this call were aborted"
    )
    monkeypatch.undo()
    assert llm.llm_engine.get_stats()["engine_step_errors_total"] >= 1
    (out,) = llm.generate({"prompt_token_ids": PROMPT}, GREEDY, use_tqdm=False)
    assert out.outputs[0].finish_reason == "length"


def test_a_device_fault_under_generate_ends_its_requests_with_an_error_and_no_raise(llm):
    # the device's kernel error is a fault the engine recovers from: the call returns, the
    # requests of the failed step say why, the others are served
    engine = llm.llm_engine
    engine.inject_fault("step")
    outs = llm.generate(
        [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": OTHER}], GREEDY, use_tqdm=False
    )
    assert [o.outputs[0].finish_reason for o in outs] == ["error", "error"]
    assert all("injected kernel fault" in o.error for o in outs)
