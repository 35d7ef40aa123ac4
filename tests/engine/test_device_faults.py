"""Device faults on kunlun-emu, one test per kind: a flipped bit in a weight page (found by the
patrol scrub or on demand, restored from the checkpoint, the step recomputed: output identical to
a fault-free run) and a kernel that fails mid-step (only that step's requests fail, the next one
is served); the KV page kind is in test_engine.py. Each is counted per kind."""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.hal.faults import UnrecoverableFaultError, checksum, page_bytes
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


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_corrupted_weight_page_is_restored_and_its_step_recomputed(kunlun_llm, params):
    faults = kunlun_llm.llm_engine.device.faults
    before = dict(faults.detected), dict(faults.recovered)
    assert _generate_with_weight_fault(kunlun_llm, params) == _clean(kunlun_llm, params)
    assert faults.detected["weight_page"] == before[0]["weight_page"] + 1
    assert faults.recovered["weight_page"] == before[1]["weight_page"] + 1
    scrubber = kunlun_llm.llm_engine.device.scrubber
    assert all(scrubber.verified(p) for p in scrubber.pages)
    assert _drained(kunlun_llm)


def test_without_the_patrol_the_same_fault_corrupts_the_output(kunlun_llm, monkeypatch):
    clean = _clean(kunlun_llm, GREEDY)
    monkeypatch.setattr(kunlun_llm.llm_engine.config.device, "weight_scrub_pages", 0)
    assert _generate_with_weight_fault(kunlun_llm, GREEDY) != clean
    assert kunlun_llm.llm_engine.scrub_weights() == 1  # found on demand, and restored
    assert _clean(kunlun_llm, GREEDY) == clean
    assert _drained(kunlun_llm)


def test_a_scrub_on_demand_restores_a_layer_page_bit_for_bit_from_the_checkpoint(
    kunlun_llm, monkeypatch
):
    engine = kunlun_llm.llm_engine
    monkeypatch.setattr(engine.config.device, "weight_scrub_pages", 0)
    tag = next(t for t in engine.device.weight_tensors if t.startswith("model.layers.1."))
    pristine = page_bytes(engine.device.weight_tensors[tag], 0).clone()
    engine.inject_fault("weight_page", tag, 0)
    assert not torch.equal(page_bytes(engine.device.weight_tensors[tag], 0), pristine)
    assert engine.scrub_weights() == 1 and engine.scrub_weights() == 0
    assert torch.equal(page_bytes(engine.device.weight_tensors[tag], 0), pristine)


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


def test_offline_generate_reports_a_failed_step_as_an_error_output(kunlun_llm):
    kunlun_llm.llm_engine.inject_fault("step")
    out, after = kunlun_llm.generate(
        [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False
    )
    assert out.outputs[0].finish_reason == "error" and "kernel fault" in out.error
    assert after.outputs[0].token_ids == _clean(kunlun_llm, GREEDY)
    assert _drained(kunlun_llm)


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
    with pytest.raises(ValueError, match=r"KV pages are 0\.\.31, not 99"):
        engine.inject_fault("kv_page", page=99)


@pytest.mark.parametrize("nbytes", [4096, 4093], ids=["words", "unaligned-bytes"])
def test_the_weight_checksum_sees_every_single_bit_flip(nbytes):
    page = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.manual_seed(0))
    reference = checksum(page)
    for bit in range(0, nbytes * 8, 7):
        flipped = page.clone()
        flipped[bit // 8 : bit // 8 + 1].bitwise_xor_(1 << (bit % 8))
        assert checksum(flipped) != reference, bit
