"""Device faults on kunlun-emu, one test per kind: a flipped bit in a weight page (found by the
patrol scrub or on demand, restored from the checkpoint, the step recomputed: output identical to
a fault-free run) and a kernel that fails mid-step (only that step's requests fail, the next one
is served); the KV page kind is in test_engine.py. Each is counted per kind: detected when the
device's check found it, recovered when the check that recovery worked passed.

Negative controls: every test marked ``faults`` fails with recovery off
(``PAGEDSERVE_FAULT_RECOVERY=off pytest -m faults``), and the tests named "without ..." show the
damage an unrecovered fault does."""

from __future__ import annotations

import sys

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.config import DeviceConfig
from pagedserve.hal.faults import (
    DeviceKernelError,
    UnrecoverableFaultError,
    WeightScrubber,
    checksum,
    page_bytes,
)
from tests.helpers.models import build_tiny_model_dir

PROMPT = [5, 6, 7, 8, 9, 10, 11]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)
NORM = "model.norm.weight"  # read by every forward pass: a flipped exponent shows at once


@pytest.fixture(scope="module")
def kunlun_llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    build_tiny_model_dir(path, "glm4", max_position_embeddings=128)
    return LLM(
        model=str(path),
        dtype="float32",
        device="kunlun-emu",
        block_size=4,
        num_kv_pages=32,
        max_model_len=100,
        max_num_seqs=1,
        weight_scrub_pages=10**6,  # the patrol verifies every page in every step
    )


def _drained(llm: LLM) -> bool:
    e = llm.llm_engine
    return (
        not e.has_unfinished_requests()
        and e.check_invariants() == []
        and e.block_manager.usage == 0
    )


def _generate_with_weight_fault(llm: LLM, params: SamplingParams, tag: str = NORM) -> list[int]:
    """Prefill and one decode step, then flip a bit in page 0 of ``tag``, then finish."""
    engine = llm.llm_engine
    engine.block_manager.reset_prefix_cache()
    engine.add_request("faulty", PROMPT, params)
    outputs = engine.step() + engine.step()
    engine.inject_fault("weight_page", tag, 0)
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return next(o for o in outputs if o.finished).outputs[0].token_ids


def _clean(llm: LLM, params: SamplingParams) -> list[int]:
    llm.llm_engine.block_manager.reset_prefix_cache()
    return (
        llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0].outputs[0].token_ids
    )


@pytest.mark.faults
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_corrupted_weight_page_is_restored_and_its_step_recomputed(kunlun_llm, params):
    faults = kunlun_llm.llm_engine.device.faults
    clean = _clean(kunlun_llm, params)
    before = dict(faults.detected), dict(faults.recovered)
    assert _generate_with_weight_fault(kunlun_llm, params) == clean
    assert faults.detected["weight_page"] == before[0]["weight_page"] + 1
    assert faults.recovered["weight_page"] == before[1]["weight_page"] + 1
    scrubber = kunlun_llm.llm_engine.device.scrubber
    assert all(scrubber.verified(p) for p in scrubber.pages)
    assert _drained(kunlun_llm)


@pytest.mark.faults
def test_without_the_patrol_the_same_fault_corrupts_the_output(kunlun_llm, monkeypatch):
    clean = _clean(kunlun_llm, GREEDY)
    monkeypatch.setattr(kunlun_llm.llm_engine.config.device, "weight_scrub_pages", 0)
    assert _generate_with_weight_fault(kunlun_llm, GREEDY) != clean
    assert kunlun_llm.llm_engine.scrub_weights() == 1  # found on demand, and restored
    assert _clean(kunlun_llm, GREEDY) == clean
    assert _drained(kunlun_llm)


@pytest.mark.faults
def test_a_scrub_on_demand_restores_a_layer_page_bit_for_bit_from_the_checkpoint(
    kunlun_llm, monkeypatch
):
    engine = kunlun_llm.llm_engine
    monkeypatch.setattr(engine.config.device, "weight_scrub_pages", 0)
    tag = next(t for t in engine.device.weight_tensors if t.startswith("model.layers.1."))
    pristine = page_bytes(engine.device.weight_tensors[tag], 0).clone()
    assert engine.inject_fault("weight_page", tag, 0) == {
        "kind": "weight_page",
        "tag": tag,
        "page": 0,
    }
    assert not torch.equal(page_bytes(engine.device.weight_tensors[tag], 0), pristine)
    assert engine.scrub_weights() == 1 and engine.scrub_weights() == 0
    assert torch.equal(page_bytes(engine.device.weight_tensors[tag], 0), pristine)


@pytest.mark.faults
def test_a_weight_page_that_cannot_be_restored_stops_the_engine(kunlun_llm, monkeypatch):
    engine = kunlun_llm.llm_engine

    def gone(*_):
        raise FileNotFoundError("model.safetensors")

    monkeypatch.setattr(engine.model, "rebuild_weights", gone)
    engine.inject_fault("weight_page", NORM, 0)
    engine.add_request("doomed", PROMPT, GREEDY)
    with pytest.raises(UnrecoverableFaultError, match=r"cannot be restored from .*restart"):
        engine.step()
    monkeypatch.undo()
    assert engine.scrub_weights() == 1
    engine.abort_request("doomed")
    assert _drained(kunlun_llm)


@pytest.mark.faults
def test_a_failed_step_ends_only_its_requests_and_the_next_is_served(kunlun_llm):
    engine = kunlun_llm.llm_engine
    clean = _clean(kunlun_llm, GREEDY)
    faults = engine.device.faults
    detected = faults.detected["step"]
    engine.add_request("running", PROMPT, GREEDY)
    engine.add_request("waiting", PROMPT, GREEDY)  # max_num_seqs 1: not in the failing batch
    engine.step()
    engine.inject_fault("step")
    assert engine.step() == []
    (failed,) = engine.take_failed()
    assert failed[0] == "running" and "DeviceKernelError" in failed[1]
    assert "send the request again" in failed[1]
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    (done,) = [o for o in outputs if o.finished]
    assert done.request_id == "waiting" and done.outputs[0].token_ids == clean
    assert faults.detected["step"] == faults.recovered["step"] == detected + 1
    assert _drained(kunlun_llm)


def test_without_recovery_a_failed_step_leaves_the_engine(kunlun_llm, monkeypatch):
    engine = kunlun_llm.llm_engine
    monkeypatch.setattr(engine.fault_recovery, "enabled", False)
    faults = engine.device.faults.to_dict()["step"]
    engine.add_request("running", PROMPT, GREEDY)
    engine.inject_fault("step")
    with pytest.raises(DeviceKernelError):
        engine.step()
    after = engine.device.faults.to_dict()["step"]
    assert {k: after[k] - faults[k] for k in after} == {
        "injected": 1,
        "detected": 1,
        "recovered": 0,
    }
    engine.abort_request("running")
    assert _drained(kunlun_llm)


@pytest.mark.faults
def test_offline_generate_reports_a_failed_step_as_an_error_output(kunlun_llm):
    assert kunlun_llm.llm_engine.inject_fault("step") == {"kind": "step"}
    out, after = kunlun_llm.generate(
        [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False
    )
    assert out.outputs[0].finish_reason == "error" and "kernel fault" in out.error
    assert after.outputs[0].token_ids == _clean(kunlun_llm, GREEDY)
    assert _drained(kunlun_llm)


@pytest.mark.faults
def test_a_kv_page_fault_is_counted_detected_and_recovered(kunlun_llm):
    engine = kunlun_llm.llm_engine
    clean = _clean(kunlun_llm, GREEDY)
    faults = engine.device.faults
    before = faults.to_dict()["kv_page"]
    engine.block_manager.reset_prefix_cache()
    engine.add_request("kv", PROMPT, GREEDY)
    outputs = engine.step() + engine.step()
    assert engine.inject_fault("kv_page") == {
        "kind": "kv_page",
        "page": engine.block_manager.get_block_table("kv")[0],
    }
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert next(o for o in outputs if o.finished).outputs[0].token_ids == clean
    after = faults.to_dict()["kv_page"]
    assert {k: after[k] - before[k] for k in after} == {
        "injected": 1,
        "detected": 1,
        "recovered": 1,
    }
    assert engine.get_stats()["device_faults_total"]["kv_page"] == after["detected"]
    assert _drained(kunlun_llm)


def test_fault_injection_names_what_it_cannot_do(kunlun_llm):
    engine = kunlun_llm.llm_engine
    with pytest.raises(ValueError, match="unknown fault kind 'disk'"):
        engine.inject_fault("disk")
    with pytest.raises(ValueError, match="no weight tensor 'nope'"):
        engine.inject_fault("weight_page", "nope")
    for page in (-1, 32, 99):
        with pytest.raises(ValueError, match=rf"KV pages are 0\.\.31, not {page}$"):
            engine.inject_fault("kv_page", page=page)
    with pytest.raises(ValueError, match="no host tier: start with --swap-space or --host-prefix"):
        engine.inject_fault("host_page")


@pytest.mark.faults
def test_a_kv_fault_injected_with_nothing_running_hits_page_0_and_is_recovered(kunlun_llm):
    engine = kunlun_llm.llm_engine
    before = engine.device.faults.to_dict()["kv_page"]
    assert engine.inject_fault("kv_page") == {"kind": "kv_page", "page": 0}
    assert engine.inject_fault("kv_page", page=31) == {"kind": "kv_page", "page": 31}
    assert engine.step() == []  # found; no cache or request holds the pages any more
    assert 0 not in engine.block_manager.page_to_cached_block
    after = engine.device.faults.to_dict()["kv_page"]
    assert {k: after[k] - before[k] for k in after} == {
        "injected": 2,
        "detected": 2,
        "recovered": 2,
    }
    assert _drained(kunlun_llm)


@pytest.mark.parametrize("nbytes", [4096, 4093], ids=["words", "unaligned-bytes"])
def test_the_weight_checksum_sees_every_single_bit_flip(nbytes):
    page = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.manual_seed(0))
    reference = checksum(page)
    for bit in range(0, nbytes * 8, 7):
        flipped = page.clone()
        flipped[bit // 8 : bit // 8 + 1].bitwise_xor_(1 << (bit % 8))
        assert checksum(flipped) != reference, bit


def test_the_checksum_of_an_aligned_page_is_the_wrapping_sum_of_its_64_bit_words():
    data = torch.randint(0, 256, (2 * 64 + 13,), dtype=torch.uint8, generator=torch.manual_seed(1))

    def wrapped(total: int) -> int:
        return (total + 2**63) % 2**64 - 2**63

    for index in (0, 1):  # at byte offsets 0 and 64
        raw = bytes(page_bytes(data, index, 64).tolist())
        words = [
            int.from_bytes(raw[i : i + 8], sys.byteorder, signed=True) for i in range(0, 64, 8)
        ]
        assert checksum(page_bytes(data, index, 64)) == wrapped(sum(words))
    tail = page_bytes(data, 2, 64)  # 13 bytes: no whole words, summed byte by byte
    assert checksum(tail) == sum(tail.tolist())


def test_a_restored_page_of_a_small_page_scrubber_is_that_page_of_the_source():
    pristine = torch.arange(4 * 8, dtype=torch.int64)
    scrubber = WeightScrubber({"w": pristine.clone()}, size=64)  # 4 pages of 8 words
    page_bytes(scrubber.tensors["w"], 2, 64)[0] ^= 1
    assert scrubber.scrub(4) == [scrubber.pages[2]]
    assert scrubber.restore(scrubber.pages[2], pristine)
    assert torch.equal(scrubber.tensors["w"], pristine)


@pytest.mark.faults
def test_the_default_patrol_finds_a_fault_within_one_round_of_the_weight_pages(
    kunlun_llm, monkeypatch
):
    """2 pages a step (the default), the cursor wrapping: a page corrupted behind the cursor is
    found within one round of every page, and restored."""
    engine, default = kunlun_llm.llm_engine, DeviceConfig().weight_scrub_pages
    assert default == 2
    monkeypatch.setattr(engine.config.device, "weight_scrub_pages", default)
    scrubber, faults = engine.device.scrubber, engine.device.faults
    num_pages, before = len(scrubber.pages), dict(faults.recovered)
    behind = scrubber.pages[(scrubber.cursor - 1) % num_pages]  # the last page it will reach
    engine.inject_fault("weight_page", behind.tag, behind.index)
    scrubbed, steps = scrubber.num_pages_scrubbed, 0
    engine.add_request("patrolled", PROMPT, SamplingParams(max_tokens=90, ignore_eos=True))
    while faults.recovered["weight_page"] == before["weight_page"]:
        assert engine.has_unfinished_requests(), "the patrol never found the fault"
        engine.step()
        steps += 1
    assert scrubber.verified(behind)
    # the page was the round's last: found after every other page was verified once
    assert scrubber.num_pages_scrubbed - scrubbed >= num_pages
    assert steps <= -(-num_pages // default) + 1  # +1: the step recomputed after the restore
    engine.abort_request("patrolled")
    assert _drained(kunlun_llm)


def test_the_patrol_cursor_wraps_and_verifies_each_page_once_a_round():
    tensors = {
        "a": torch.zeros(5 * 8, dtype=torch.int64),
        "b": torch.ones(3 * 8, dtype=torch.int64),
    }
    scrubber = WeightScrubber(tensors, size=64)  # 64-byte pages: a has 5, b has 3
    assert [(p.tag, p.index) for p in scrubber.pages] == [("a", i) for i in range(5)] + [
        ("b", i) for i in range(3)
    ]
    page_bytes(tensors["b"], 1, 64)[3] ^= 1
    found = [scrubber.scrub(3) for _ in range(8)]  # 24 pages: three rounds of 8
    assert [len(f) for f in found] == [0, 0, 1, 0, 1, 0, 0, 1]
    assert all(f == [scrubber.pages[6]] for f in found if f)
    assert scrubber.cursor == 0 and scrubber.num_pages_scrubbed == 24
    assert scrubber.scrub(100) == [scrubber.pages[6]] and scrubber.num_pages_scrubbed == 32
