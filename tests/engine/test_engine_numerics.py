"""pagedserve's greedy tokens equal transformers' ``generate`` in fp32, whatever the paging, chunking,
preemption or prefix caching; bf16 logits stay close to transformers' bf16 logits."""

from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams
from tests.helpers.models import (
    assert_logprobs_close,
    build_tiny_hf_model,
    hf_greedy,
    host_tier_gib,
    prompt_logprobs,
)

MAX_TOKENS = 10
# Mixed lengths: shorter and longer than a block, and two prompts sharing a 40-token prefix.
SHARED = [(7 * i + 3) % 300 + 10 for i in range(40)]
PROMPTS = [
    [11, 12, 13],
    [(5 * i) % 300 + 10 for i in range(29)],
    SHARED + [21, 22, 23],
    SHARED + [31, 32],
    [99],
    [(3 * i + 1) % 300 + 10 for i in range(70)],
]


@pytest.fixture(scope="module", params=["glm", "glm4"])
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = build_tiny_hf_model(path, request.param, max_position_embeddings=256)
    refs = [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]
    return path, hf, refs


def _generate(path, **engine_kwargs) -> tuple[LLM, list[list[int]]]:
    llm = LLM(model=str(path), dtype="float32", **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


def _assert_pool_drained(llm: LLM) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.usage == 0.0
    assert engine.block_manager.num_free_pages == engine.num_kv_pages
    host = engine.block_manager.host
    assert host is None or (host.usage == 0.0 and not host.block_tables)
    assert engine.check_invariants() == []


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_greedy_matches_transformers_for_every_block_size(model, block_size):
    path, _, refs = model
    llm, got = _generate(path, block_size=block_size, num_kv_pages=4096 // block_size)
    assert got == refs
    _assert_pool_drained(llm)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_greedy_matches_transformers_with_prefix_caching_on_and_off(model, prefix_caching):
    path, _, refs = model
    llm, got = _generate(path, block_size=4, num_kv_pages=512, enable_prefix_caching=prefix_caching)
    assert got == refs
    # Run again: with caching on, the second pass hits the pages the first one left behind.
    _, again = _generate_on(llm)
    assert again == refs
    hits = llm.llm_engine.block_manager.prefix_cache_hits
    assert (hits > 0) == prefix_caching
    _assert_pool_drained(llm)


def _generate_on(llm: LLM):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


def test_greedy_matches_transformers_with_chunked_prefill(model):
    path, _, refs = model
    llm, got = _generate(path, block_size=4, num_kv_pages=512, max_num_batched_tokens=8)
    assert got == refs
    _assert_pool_drained(llm)


# How a preempted sequence's pages are kept: freed and recomputed, swapped to the host tier and
# back, swapped with a host prefix cache beside (evicted prefix blocks spill there), or by cost.
PREEMPTION = {
    "recompute": dict(preemption_mode="recompute"),
    "swap": dict(preemption_mode="swap", swap_frames=64),
    "swap+host-cache": dict(preemption_mode="swap", swap_frames=64, host_cache_frames=64),
    "auto": dict(preemption_mode="auto", swap_frames=64),
}


def _tier_kwargs(path, preemption: str, block_size: int = 4) -> dict:
    kwargs = dict(PREEMPTION[preemption])
    for key, flag in (("swap_frames", "swap_space"), ("host_cache_frames", "host_prefix_cache")):
        if key in kwargs:
            kwargs[flag] = host_tier_gib(path, kwargs.pop(key), block_size)
    return kwargs


def _assert_tiers_used(llm: LLM, preemption: str) -> None:
    scheduler = llm.llm_engine.scheduler
    assert scheduler.num_preemptions > 0
    if preemption.startswith("swap"):
        assert scheduler.num_swapped_preemptions == scheduler.num_preemptions
        assert scheduler.num_recomputed_tokens == 0
    if preemption == "recompute":
        assert scheduler.num_swapped_preemptions == 0 and scheduler.num_recomputed_tokens > 0
    assert llm.llm_engine.check_invariants() == []


@pytest.mark.parametrize("preemption", PREEMPTION)
def test_greedy_matches_transformers_under_preemption(model, preemption):
    path, _, refs = model
    # 70 + 10 tokens need 20 pages of 4; 24 pages cannot hold all six prompts at once.
    llm, got = _generate(path, block_size=4, num_kv_pages=24, **_tier_kwargs(path, preemption))
    assert got == refs
    _assert_tiers_used(llm, preemption)
    _assert_pool_drained(llm)
    if preemption == "swap+host-cache":  # the pages the second pass needs spilled to the host
        _, again = _generate_on(llm)
        assert again == refs
        assert llm.llm_engine.block_manager.host_prefix_cache_hits > 0
        _assert_pool_drained(llm)


@pytest.mark.parametrize("preemption", PREEMPTION)
def test_greedy_matches_transformers_with_everything_at_once(model, preemption):
    path, _, refs = model
    llm, got = _generate(
        path,
        block_size=4,
        num_kv_pages=26,
        max_num_batched_tokens=12,
        max_num_seqs=3,
        **_tier_kwargs(path, preemption),
    )
    assert got == refs
    _assert_pool_drained(llm)


@pytest.mark.parametrize("arch", ["glm", "glm4"])
def test_bf16_logprobs_close_to_transformers_bf16(arch, tmp_path):
    hf = build_tiny_hf_model(tmp_path, arch).to(torch.bfloat16)
    prompt = PROMPTS[1]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    llm = LLM(model=str(tmp_path), dtype="bfloat16", num_kv_pages=64)
    got = prompt_logprobs(llm, prompt)
    # measured: at most 0.008 apart, a KL of 3e-6, the same top token everywhere; bf16 against
    # fp32 moves them as much, a zeroed down_proj by 0.07 or more
    assert_logprobs_close(got, ref[:-1], atol=0.02, max_kl=1e-5)
    assert (got.argmax(-1) == ref[:-1].argmax(-1)).float().mean() > 0.9


def test_tied_embeddings_match_transformers_and_stay_one_copy(tmp_path):
    hf = build_tiny_hf_model(tmp_path, "glm4", tie_word_embeddings=True)
    llm = LLM(model=str(tmp_path), dtype="float32", num_kv_pages=64)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    got = llm.generate({"prompt_token_ids": PROMPTS[1]}, params, use_tqdm=False)[0]
    assert got.outputs[0].token_ids == hf_greedy(hf, PROMPTS[1], MAX_TOKENS)
    allocations = llm.llm_engine.device.memory_stats()["weight"]["allocations"]
    assert "model.embed_tokens.weight" in allocations and "lm_head.weight" not in allocations
