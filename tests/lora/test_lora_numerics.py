"""LoRA adapters against transformers + PEFT on the same weights: greedy fp32 tokens equal per
adapter, on GLM-4 and GLM-4-0414; a batch that mixes base rows and three adapters gives each row
what it gets alone; adapters beyond the device slots wait (never fail) and come back from host
memory or disk; the prefix cache never hands one adapter's KV to another; an INT4 base with an
adapter stays within eval-quant's bound of the 16-bit base with the same adapter."""

from __future__ import annotations

import math

import pytest
import torch

from pagedserve import LLM, LoRARequest, SamplingParams
from tests.helpers.lora import build_peft_adapter
from tests.helpers.models import build_tiny_hf_model, hf_greedy, prompt_logprobs

MAX_TOKENS = 8
PROMPTS = [[11, 12, 13], [(5 * i) % 300 + 10 for i in range(21)], [99, 98]]
# (seed, rank, alpha, targets, rsLoRA): all six HF modules; q and v only (the qkv layer's k part
# empty) with rsLoRA scaling; the MLP and o_proj at the engine's largest rank
ADAPTERS = {
    "all": (1, 8, 16, None, False),
    "qv-rslora": (2, 4, 8, ["q_proj", "v_proj"], True),
    "mlp": (3, 16, 8, ["o_proj", "gate_up_proj", "down_proj"], False),
}
MAX_EVAL_QUANT_LOSS_PCT = 0.5  # `pagedserve eval-quant`'s default --max-loss-pct


def _build(path, architecture: str):
    hf = build_tiny_hf_model(path / "base", architecture, max_position_embeddings=256)
    loras, refs = {}, {None: [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]}
    for lora_id, (name, (seed, r, alpha, targets, rslora)) in enumerate(ADAPTERS.items(), 1):
        kwargs = {"target_modules": targets} if targets else {}
        peft = build_peft_adapter(hf, path / name, seed, r, alpha, use_rslora=rslora, **kwargs)
        loras[name] = LoRARequest(name, lora_id, str(path / name))
        refs[name] = [hf_greedy(peft, p, MAX_TOKENS) for p in PROMPTS]
    return path / "base", loras, refs


@pytest.fixture(scope="module", params=["glm", "glm4"])
def models(request, tmp_path_factory):
    torch.set_num_threads(1)
    return _build(tmp_path_factory.mktemp(request.param), request.param)


def _llm(base, **kwargs) -> LLM:
    settings = dict(dtype="float32", device="cpu", enable_lora=True, max_lora_rank=16)
    return LLM(model=str(base), **{**settings, **kwargs})


def _generate(llm: LLM, prompts, loras) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras
    )
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return [o.outputs[0].token_ids for o in outs]


def _assert_drained(llm: LLM) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_pages == engine.num_kv_pages
    assert engine.check_invariants() == []


def test_each_adapter_gives_transformers_and_peft_greedy_tokens(models):
    base, loras, refs = models
    assert len({tuple(refs[n][0]) for n in refs}) == len(refs), "the adapters change nothing"
    llm = _llm(base, max_loras=3)
    for name, lora in loras.items():
        assert _generate(llm, PROMPTS, lora) == refs[name], name
    assert _generate(llm, PROMPTS, None) == refs[None]
    _assert_drained(llm)


def test_one_batch_of_base_rows_and_three_adapters_gives_each_row_its_own_tokens(models):
    base, loras, refs = models
    llm = _llm(base, max_loras=3, max_num_batched_tokens=64)
    names = [None, *loras]
    prompts = [p for p in PROMPTS for _ in names]
    rows = [loras.get(n) for _ in PROMPTS for n in names]
    got = _generate(llm, prompts, rows)
    assert got == [refs[n][i] for i in range(len(PROMPTS)) for n in names]
    _assert_drained(llm)


def test_adapters_beyond_the_slots_wait_and_move_through_host_memory_and_disk(models):
    """One device slot and one adapter in host memory for three adapters: every request is
    served, its adapter moved into the slot as its turn comes (read from disk again once the
    host cache has dropped it), and nothing is refused."""
    base, loras, refs = models
    llm = _llm(base, max_loras=1, max_cpu_loras=1)
    names = [*loras, None]
    prompts = [p for p in PROMPTS for _ in names]
    rows = [loras.get(n) for _ in PROMPTS for n in names]
    assert _generate(llm, prompts, rows) == [refs[n][i] for i in range(len(PROMPTS)) for n in names]
    engine = llm.llm_engine
    slots = engine.executor.worker.lora
    assert engine.lora_registry.num_swap_ins >= len(loras)
    assert slots.num_disk_loads >= 1 and len(slots.host) == 1
    assert engine.get_stats()["lora"]["requests_total"] == {n: len(PROMPTS) for n in loras}
    _assert_drained(llm)


def test_a_prefix_cached_under_one_adapter_is_never_reused_under_another(models):
    base, loras, refs = models
    llm = _llm(base, max_loras=2, block_size=4)
    engine = llm.llm_engine
    long = [PROMPTS[1]]
    assert _generate(llm, long, None) == [refs[None][1]]
    queried = engine.block_manager.prefix_cache_hits
    assert _generate(llm, long, loras["all"]) == [refs["all"][1]]
    assert engine.block_manager.prefix_cache_hits == queried  # the base's blocks: not hits
    assert _generate(llm, long, loras["all"]) == [refs["all"][1]]
    assert engine.block_manager.prefix_cache_hits > queried  # its own blocks: hits
    assert _generate(llm, long, loras["mlp"]) == [refs["mlp"][1]]
    _assert_drained(llm)


@pytest.mark.parametrize("models", ["glm4"], indirect=True)  # one architecture: INT4's the same
def test_an_int4_base_with_an_adapter_stays_within_eval_quants_bound(models):
    """Perplexity of held-out token blocks under INT4 base + adapter against 16-bit base + the
    same adapter: within eval-quant's 0.5 %, and much closer to it than the base alone is (the
    adapter still acts on an INT4 base)."""
    base, loras, _ = models
    generator = torch.Generator().manual_seed(7)
    blocks = [torch.randint(10, 300, (48,), generator=generator).tolist() for _ in range(3)]
    lora = loras["all"]
    reference = _logprobs(_llm(base), blocks, lora)
    quantized = _logprobs(_llm(base, quantization="int4", quant_group_size=32), blocks, lora)
    base_only = _logprobs(_llm(base), blocks, None)
    increase = (_perplexity(quantized, blocks) / _perplexity(reference, blocks) - 1) * 100
    assert increase <= MAX_EVAL_QUANT_LOSS_PCT
    kl_quant, kl_base = _kl(reference, quantized), _kl(reference, base_only)
    assert kl_quant < kl_base / 10, (kl_quant, kl_base)


def _logprobs(llm: LLM, blocks, lora) -> list[torch.Tensor]:
    out = []
    for block in blocks:
        llm.llm_engine.block_manager.reset_prefix_cache()
        out.append(_prompt_logprobs(llm, block, lora))
    return out


def _prompt_logprobs(llm: LLM, prompt: list[int], lora) -> torch.Tensor:
    if lora is None:
        return prompt_logprobs(llm, prompt)
    vocab = llm.llm_engine.model_config.vocab_size
    params = SamplingParams(max_tokens=1, prompt_logprobs=vocab, temperature=0.0)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False, lora_request=lora)
    return torch.tensor([[lp[t] for t in range(vocab)] for lp in out[0].prompt_logprobs[1:]])


def _perplexity(logprobs: list[torch.Tensor], blocks) -> float:
    nll = [-lp[range(len(b) - 1), b[1:]].sum().item() for lp, b in zip(logprobs, blocks)]
    return math.exp(sum(nll) / sum(len(b) - 1 for b in blocks))


def _kl(reference: list[torch.Tensor], candidate: list[torch.Tensor]) -> float:
    ref, cand = torch.cat(reference), torch.cat(candidate)
    return (ref.exp() * (ref - cand)).sum(-1).mean().item()
