"""The sampler against references computed here: argmax, softmax, sorted nuclei, penalty formulas."""

from __future__ import annotations

import math

import pytest
import torch

from pagedserve.engine.sampler import (
    NUCLEUS_CANDIDATES,
    Sampler,
    SamplingMetadata,
    apply_grammar_bitmask,
    apply_logit_bias,
    apply_penalties,
)
from pagedserve.sampling_params import SamplingParams

VOCAB = 12


def make_meta(params, prompts=None, outputs=None, eos=frozenset({0})):
    n = len(params)
    return SamplingMetadata(
        params=params,
        prompt_token_ids=prompts or [[1, 2]] * n,
        output_token_ids=outputs or [[]] * n,
        generators=[
            None if p.seed is None else torch.Generator().manual_seed(p.seed) for p in params
        ],
        eos_token_ids=[eos] * n,
    )


def draw_many(logits_row: torch.Tensor, params: SamplingParams, num: int) -> torch.Tensor:
    torch.manual_seed(1234)
    logits = logits_row.expand(num, -1).clone()
    out = Sampler()(logits, make_meta([params] * num))
    return torch.tensor(out.sampled_token_ids)


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "drew a token whose probability is zero"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# chi-square critical value at p = 0.001 for VOCAB - 1 = 11 degrees of freedom
CHI2_CRITICAL = 31.26


@pytest.fixture
def logits() -> torch.Tensor:
    return torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0)) * 2


def test_greedy_is_argmax(logits):
    out = Sampler()(logits, make_meta([SamplingParams(temperature=0.0)] * 4))
    assert out.sampled_token_ids == logits.argmax(dim=-1).tolist()


def test_greedy_rows_stay_argmax_in_a_mixed_batch(logits):
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=2.0, top_k=5)] * 2
    for _ in range(10):
        out = Sampler()(logits, make_meta(params))
        assert out.sampled_token_ids[::2] == logits[::2].argmax(dim=-1).tolist()


def test_temperature_sampling_matches_softmax_over_temperature(logits):
    temperature = 0.7
    tokens = draw_many(logits[0], SamplingParams(temperature=temperature), 20_000)
    reference = torch.softmax(logits[0].double() / temperature, dim=-1)
    assert chi_square(tokens, reference) < CHI2_CRITICAL
    assert chi_square(tokens, torch.softmax(logits[0].double(), dim=-1)) > CHI2_CRITICAL


@pytest.mark.parametrize("vocab, block", [(13, 4), (12, 4), (12, 12), (3, 1024)])
def test_inverse_cdf_by_blocks_finds_the_first_index_past_u(vocab, block):
    """The two-level scan (blocks, then the entries of one) gives what one cumulative sum over
    the whole row gives, in float64: with a partial last block, with exact blocks, with one
    block; u = 0 takes the first token of positive weight, and zero weights are never taken."""
    from pagedserve.engine.sampler import inverse_cdf

    g = torch.Generator().manual_seed(vocab + block)
    weights = torch.rand(vocab, generator=g)
    weights[[0, 2]] = 0.0  # masked tokens: the first, and one inside the first block
    u = torch.cat([torch.tensor([0.0]), torch.rand(3000, generator=g)])
    found = inverse_cdf(weights.expand(len(u), -1).contiguous(), u, block=block)
    cdf = weights.double().cumsum(0) / weights.double().sum()
    expected = torch.searchsorted(cdf, u.double(), right=True)
    near = (cdf.unsqueeze(0) - u.double().unsqueeze(1)).abs().min(dim=1).values < 1e-6
    assert bool((found == expected)[~near].all())
    assert found[0] == 1 and not {0, 2} & set(found.tolist())  # u = 0: the first weighed token


def test_inverse_cdf_skips_blocks_that_weigh_nothing():
    """u = 0 (and any u) lands past whole blocks of zero weight, the first one included."""
    from pagedserve.engine.sampler import inverse_cdf

    weights = torch.rand(13, generator=torch.Generator().manual_seed(1)) + 0.1
    weights[:4] = weights[8:12] = 0.0  # blocks 0 and 2 of 4
    u = torch.cat(
        [torch.tensor([0.0]), torch.rand(500, generator=torch.Generator().manual_seed(2))]
    )
    found = inverse_cdf(weights.expand(len(u), -1).contiguous(), u, block=4)
    assert found[0] == 4
    assert set(found.tolist()) == {4, 5, 6, 7, 12}


def test_seeded_rows_draw_from_softmax_with_their_own_generators(logits):
    params = [SamplingParams(temperature=1.0, seed=s) for s in range(5_000)]
    out = Sampler()(logits[1].expand(len(params), -1).clone(), make_meta(params))
    reference = torch.softmax(logits[1].double(), dim=-1)
    assert chi_square(torch.tensor(out.sampled_token_ids), reference) < CHI2_CRITICAL


def test_top_k_only_yields_the_k_largest(logits):
    tokens = draw_many(logits[0], SamplingParams(temperature=1.5, top_k=3), 5_000)
    top3 = set(sorted(range(VOCAB), key=lambda i: -logits[0, i].item())[:3])
    assert set(tokens.tolist()) == top3


def nucleus(probs: torch.Tensor, top_p: float) -> set[int]:
    ranked = sorted(range(probs.numel()), key=lambda i: -probs[i].item())
    kept, mass = set(), 0.0
    for i in ranked:
        kept.add(i)
        mass += probs[i].item()
        if mass >= top_p:
            break
    return kept


def test_top_p_only_yields_from_the_nucleus(logits):
    probs = torch.softmax(logits[2], dim=-1)
    expected = nucleus(probs, 0.6)
    assert 1 < len(expected) < VOCAB
    tokens = draw_many(logits[2], SamplingParams(temperature=1.0, top_p=0.6), 5_000)
    assert set(tokens.tolist()) == expected


def test_top_p_renormalises_the_nucleus(logits):
    probs = torch.softmax(logits[2].double(), dim=-1)
    kept = torch.tensor(sorted(nucleus(probs, 0.8)))
    reference = torch.zeros_like(probs)
    reference[kept] = probs[kept] / probs[kept].sum()
    tokens = draw_many(logits[2], SamplingParams(temperature=1.0, top_p=0.8), 20_000)
    assert chi_square(tokens, reference) < CHI2_CRITICAL


def test_min_p_drops_tokens_below_min_p_times_the_top_probability(logits):
    probs = torch.softmax(logits[0], dim=-1)
    expected = {i for i in range(VOCAB) if probs[i] >= 0.2 * probs.max()}
    assert 1 < len(expected) < VOCAB
    tokens = draw_many(logits[0], SamplingParams(temperature=1.0, min_p=0.2), 5_000)
    assert set(tokens.tolist()) == expected


def run_steps(rows: list[SamplingParams], logits_rows: list[torch.Tensor], steps: int):
    meta = make_meta(rows)
    sampler = Sampler()
    logits = torch.stack(logits_rows)
    return [sampler(logits, meta).sampled_token_ids for _ in range(steps)]


def test_same_seed_gives_same_tokens_whatever_the_batch():
    flat = torch.zeros(50)  # uniform: every draw depends only on the random numbers
    seeded = SamplingParams(temperature=1.0, seed=42)
    other = SamplingParams(temperature=1.0, seed=7)
    free = SamplingParams(temperature=0.8)
    alone = [step[0] for step in run_steps([seeded], [flat], 8)]
    first = [step[0] for step in run_steps([seeded, other, free], [flat] * 3, 8)]
    last = [step[2] for step in run_steps([free, other, seeded], [flat] * 3, 8)]
    assert alone == first == last
    assert [step[1] for step in run_steps([seeded, other], [flat] * 2, 8)] != alone


def test_same_seed_gives_same_tokens_whatever_the_neighbours_filters():
    noisy = torch.randn(50, generator=torch.Generator().manual_seed(8)) * 0.3
    seeded = SamplingParams(temperature=1.0, top_k=20, seed=42)
    alone = [step[0] for step in run_steps([seeded], [noisy], 8)]
    wider_k = SamplingParams(temperature=1.0, top_k=40)
    full_sort = SamplingParams(temperature=1.0, top_p=0.9)
    for neighbour in (wider_k, full_sort):
        batched = run_steps([neighbour, seeded], [noisy, noisy], 8)
        assert [step[1] for step in batched] == alone


def test_penalties_follow_the_formulas():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(3)) * 3
    prompts, outputs = [[1, 2, 2, 5], [3]], [[5, 5, 7], []]
    params = [
        SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.25),
        SamplingParams(repetition_penalty=0.8, presence_penalty=1.0),
    ]
    expected = logits.clone()
    for row, p in enumerate(params):
        for tok in range(VOCAB):
            x = expected[row, tok].item()
            if tok in prompts[row] or tok in outputs[row]:
                x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
            count = outputs[row].count(tok)
            x -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
            expected[row, tok] = x
    actual = logits.clone()
    apply_penalties(actual, make_meta(params, prompts, outputs))
    torch.testing.assert_close(actual, expected)


def test_penalised_logits_reach_the_logprobs():
    logits = torch.zeros(1, VOCAB)
    params = SamplingParams(temperature=0.0, frequency_penalty=1.0, logprobs=VOCAB)
    out = Sampler()(logits, make_meta([params], outputs=[[4, 4]]))
    expected = logits.clone()
    expected[0, 4] -= 2.0
    reference = torch.log_softmax(expected, dim=-1)[0]
    assert out.logprobs[0][4] == pytest.approx(reference[4].item(), abs=1e-6)
    assert out.sampled_token_ids[0] != 4


def test_logit_bias_is_added():
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(logit_bias={3: 2.5, 8: -1.0}), SamplingParams()]
    biased = logits.clone()
    apply_logit_bias(biased, params)
    expected = logits.clone()
    expected[0, 3] += 2.5
    expected[0, 8] -= 1.0
    torch.testing.assert_close(biased, expected)


def test_logit_bias_steers_greedy():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(5))
    weakest = int(logits.argmin())
    params = SamplingParams(temperature=0.0, logit_bias={weakest: 100.0})
    assert Sampler()(logits, make_meta([params])).sampled_token_ids == [weakest]


def test_logit_bias_outside_the_vocabulary_is_rejected():
    params = SamplingParams(logit_bias={VOCAB: 1.0})
    with pytest.raises(ValueError, match=f"token id {VOCAB}.*vocabulary"):
        Sampler()(torch.zeros(1, VOCAB), make_meta([params]))


def test_min_tokens_blocks_eos_and_stop_token_ids():
    logits = torch.zeros(1, VOCAB)
    logits[0, 0], logits[0, 9], logits[0, 6] = 10.0, 9.0, 8.0  # eos=0, stop token 9, then 6
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[9])
    sample = lambda generated: Sampler()(logits, make_meta([params], outputs=[generated]))  # noqa: E731
    assert sample([1, 2]).sampled_token_ids == [6]
    assert sample([1, 2, 3]).sampled_token_ids == [0]


def test_min_tokens_blocks_the_whole_stop_set_under_sampling():
    logits = torch.zeros(2_000, VOCAB)
    params = SamplingParams(temperature=1.0, min_tokens=1, stop_token_ids=[9])
    out = Sampler()(logits, make_meta([params] * 2_000, eos=frozenset({0, 5})))
    assert {0, 5, 9}.isdisjoint(out.sampled_token_ids)
    assert len(set(out.sampled_token_ids)) == VOCAB - 3


def test_logprobs_hold_the_chosen_token_and_top_n(logits):
    params = [SamplingParams(temperature=5.0, logprobs=2), SamplingParams(temperature=0.0)]
    reference = torch.log_softmax(logits[:2], dim=-1)
    top2 = reference[0].topk(2).indices.tolist()
    for _ in range(20):
        out = Sampler()(logits[:2].clone(), make_meta(params))
        chosen = out.sampled_token_ids[0]
        assert set(out.logprobs[0]) == set(top2) | {chosen}
        for tok, value in out.logprobs[0].items():
            assert value == pytest.approx(reference[0, tok].item(), abs=1e-6)
        assert out.logprobs[1] is None


def test_logprobs_are_taken_before_temperature_and_top_k(logits):
    params = SamplingParams(temperature=0.5, top_k=2, logprobs=VOCAB)
    out = Sampler()(logits[:1].clone(), make_meta([params]))
    reference = torch.log_softmax(logits[0], dim=-1)
    assert len(out.logprobs[0]) == VOCAB
    for tok, value in out.logprobs[0].items():
        assert value == pytest.approx(reference[tok].item(), abs=1e-6)


def test_logprobs_zero_reports_only_the_chosen_token(logits):
    params = SamplingParams(temperature=0.0, logprobs=0)
    out = Sampler()(logits[:1].clone(), make_meta([params]))
    chosen = out.sampled_token_ids[0]
    reference = torch.log_softmax(logits[0], dim=-1)[chosen].item()
    assert out.logprobs == [{chosen: pytest.approx(reference, abs=1e-6)}]


def test_prompt_logprobs_match_log_softmax():
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(6))
    targets = [3, 0, 11, 3, 7]
    result = Sampler().compute_prompt_logprobs(logits, targets, top_n=1)
    reference = torch.log_softmax(logits.double(), dim=-1)
    for row, (target, lp) in enumerate(zip(targets, result, strict=True)):
        best = int(reference[row].argmax())
        assert set(lp) == {target, best}
        for tok, value in lp.items():
            assert math.isclose(value, reference[row, tok].item(), abs_tol=1e-5)


def test_logits_rows_must_match_the_metadata():
    with pytest.raises(ValueError, match=r"shape \(3, 12\).*\[2, vocab_size\]"):
        Sampler()(torch.zeros(3, VOCAB), make_meta([SamplingParams()] * 2))


def test_top_k_row_beside_an_unrestricted_row_keeps_its_own_k_largest():
    logits = torch.zeros(2, 100)
    logits[:, 90:] = 10.0  # all the mass on ids 90..99
    params = [SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=1.0)]
    meta = SamplingMetadata(params, [[1]] * 2, [[]] * 2, [None] * 2, [frozenset()] * 2)
    torch.manual_seed(0)
    draws = [Sampler()(logits, meta).sampled_token_ids for _ in range(200)]
    assert {row[0] for row in draws} <= set(range(90, 100))
    assert {row[1] for row in draws} <= set(range(90, 100))


@pytest.mark.parametrize("vocab", [3000, 200])  # nucleus within the bounded candidates, and not
def test_top_p_alone_draws_exactly_the_nucleus(vocab):
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(1, vocab, generator=g) * 4
    probs = torch.softmax(logits[0], -1)
    order = probs.argsort(descending=True)
    before = probs[order].cumsum(0) - probs[order]
    nucleus = set(order[before < 0.8].tolist())
    params = [SamplingParams(temperature=1.0, top_p=0.8)] * 64
    meta = SamplingMetadata(params, [[1]] * 64, [[]] * 64, [None] * 64, [frozenset()] * 64)
    torch.manual_seed(1)
    drawn = set()
    for _ in range(20):
        drawn |= set(Sampler()(logits.expand(64, -1), meta).sampled_token_ids)
    assert drawn <= nucleus
    assert len(drawn) >= min(len(nucleus), 5)


@pytest.mark.parametrize("top_p", [5e-324, 3.3e-231, 1e-50, 1e-8])
@pytest.mark.parametrize("top_k", [-1, 5])
def test_a_top_p_below_what_float32_holds_is_nearly_greedy(top_p, top_k):
    """The fuzzer's 500s: 5e-324 is 0 in float32, and the nucleus was empty (every candidate
    masked, then an index past the candidates). Any top_p in (0, 1] keeps the most likely."""
    logits = torch.randn(3, 3000, generator=torch.Generator().manual_seed(5)) * 3
    params = [SamplingParams(temperature=1.0, top_p=top_p, top_k=top_k)] * 3
    meta = SamplingMetadata(params, [[1]] * 3, [[]] * 3, [None] * 3, [frozenset()] * 3)
    out = Sampler()(logits, meta)
    assert out.sampled_token_ids == logits.argmax(dim=-1).tolist()


def test_flat_distribution_needs_the_full_sort_and_still_keeps_the_nucleus():
    logits = torch.zeros(1, 5000)  # uniform: the 0.5-nucleus holds 2,500 tokens
    params = [SamplingParams(temperature=1.0, top_p=0.5)] * 64
    meta = SamplingMetadata(params, [[1]] * 64, [[]] * 64, [None] * 64, [frozenset()] * 64)
    torch.manual_seed(2)
    drawn = set()
    for _ in range(40):
        drawn |= set(Sampler()(logits.expand(64, -1), meta).sampled_token_ids)
    # more distinct tokens than the bounded candidate set holds, and no more than the nucleus
    assert NUCLEUS_CANDIDATES < len(drawn) <= 2500


def test_prompt_logprobs_zero_reports_only_the_prompt_token_and_negative_is_refused():
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(7))
    result = Sampler().compute_prompt_logprobs(logits, [4, 0, 9], top_n=0)
    reference = torch.log_softmax(logits.double(), dim=-1)
    assert [list(d) for d in result] == [[4], [0], [9]]
    assert [d[t] for d, t in zip(result, [4, 0, 9])] == pytest.approx(
        [reference[0, 4].item(), reference[1, 0].item(), reference[2, 9].item()], abs=1e-5
    )
    with pytest.raises(ValueError, match=r"^prompt_logprobs=-1 must be >= 0$"):
        Sampler().compute_prompt_logprobs(logits, [4, 0, 9], top_n=-1)


def test_penalties_count_token_id_zero_and_refuse_ids_outside_the_vocabulary():
    logits = torch.full((1, VOCAB), 2.0)
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5)]
    penalised = logits.clone()
    apply_penalties(penalised, make_meta(params, prompts=[[0]], outputs=[[0, 3]]))
    assert penalised[0, :4].tolist() == [2.0 / 2 - 0.5, 2.0, 2.0, 2.0 / 2 - 0.5]
    for bad in (VOCAB, -1):
        with pytest.raises(
            ValueError,
            match=rf"^token id refers to token id {bad}, outside this model's "
            rf"vocabulary \[0, {VOCAB}\); use ids below {VOCAB}$",
        ):
            apply_penalties(logits.clone(), make_meta(params, outputs=[[1, bad]]))


def test_prompt_logprobs_of_no_positions_is_an_empty_list():
    assert Sampler().compute_prompt_logprobs(torch.zeros(0, VOCAB), [], top_n=2) == []


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(logit_bias={1: 1.0}),
        SamplingParams(min_tokens=2),
        SamplingParams(repetition_penalty=2.0),
        SamplingParams(presence_penalty=1.0),
        SamplingParams(frequency_penalty=1.0),
    ],
    ids=["logit_bias", "min_tokens", "repetition", "presence", "frequency"],
)
def test_the_callers_logits_stay_intact_whatever_the_row_changes(params):
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(9))
    before = logits.clone()
    Sampler()(logits, make_meta([params, params], outputs=[[1, 2], [1]]))
    assert torch.equal(logits, before)


def test_metadata_rows_must_match_the_params():
    p = SamplingParams()
    with pytest.raises(
        ValueError,
        match=r"^SamplingMetadata\.prompt_token_ids has 1 rows but params has 2; build every "
        r"field with one entry per sequence in the batch$",
    ):
        SamplingMetadata([p, p], [[1]], [[], []], [None, None], [frozenset()] * 2)


def test_token_ids_outside_the_vocabulary_are_named_by_what_carried_them():
    logits = torch.zeros(1, VOCAB)
    for params, what in (
        (SamplingParams(logit_bias={VOCAB: 1.0}), "logit_bias"),
        (SamplingParams(min_tokens=1, stop_token_ids=[VOCAB + 3]), "stop_token_ids"),
    ):
        with pytest.raises(
            ValueError, match=rf"^{what} refers to token id {VOCAB + 3 * (what != 'logit_bias')}"
        ):
            Sampler()(logits, make_meta([params]))


def test_repetition_penalty_divides_small_positive_logits_and_multiplies_negative_ones():
    logits = torch.tensor([[0.5, -0.5, 0.0, 0.5] + [0.0] * (VOCAB - 4)])
    params = [SamplingParams(repetition_penalty=2.0)]
    apply_penalties(logits, make_meta(params, prompts=[[0, 1, 2]], outputs=[[]]))
    assert logits[0, :4].tolist() == [0.25, -1.0, 0.0, 0.5]


def test_a_batch_with_as_many_greedy_rows_as_vocabulary_entries_still_samples_its_other_row():
    logits = torch.randn(VOCAB + 1, VOCAB, generator=torch.Generator().manual_seed(10))
    params = [SamplingParams(temperature=0.0)] * VOCAB + [SamplingParams(top_k=1)]
    out = Sampler()(logits, make_meta(params))
    assert out.sampled_token_ids == logits.argmax(dim=-1).tolist()


def test_logprobs_zero_reports_only_the_chosen_token_when_it_is_not_the_top():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(11)).expand(64, -1)
    params = [SamplingParams(temperature=5.0, logprobs=0)] * 64
    torch.manual_seed(3)
    out = Sampler()(logits.clone(), make_meta(params))
    assert len(set(out.sampled_token_ids)) > 1
    assert [list(d) for d in out.logprobs] == [[t] for t in out.sampled_token_ids]


# ---- grammar bitmasks (structured output)


def bitmask_of(allowed: list[set[int] | None], vocab: int) -> torch.Tensor:
    """llguidance's layout, built by hand: int32 words, bit t % 32 of word t // 32 allows token t;
    None is an unconstrained row (all ones)."""
    words = (vocab + 31) // 32
    mask = torch.full((len(allowed), words), -1, dtype=torch.int32)
    for i, tokens in enumerate(allowed):
        if tokens is None:
            continue
        bits = [0] * words
        for t in tokens:
            bits[t // 32] |= 1 << (t % 32)
        mask[i] = torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in bits])
    return mask


@pytest.mark.parametrize("vocab", [12, 40, 64, 70])
def test_grammar_bitmask_leaves_each_row_exactly_its_allowed_tokens(vocab):
    allowed = [{1, 3}, None, {vocab - 1}, {0, 31, 32, 33} & set(range(vocab))]
    logits = torch.randn(4, vocab)
    masked = apply_grammar_bitmask(logits.clone(), bitmask_of(allowed, vocab))
    for i, tokens in enumerate(allowed):
        finite = set(torch.isfinite(masked[i]).nonzero().flatten().tolist())
        assert finite == (tokens if tokens is not None else set(range(vocab))), i
        keep = sorted(finite)
        assert torch.equal(masked[i, keep], logits[i, keep])


def test_tokens_past_the_bitmasks_vocabulary_are_not_allowed():
    """A model whose lm_head is wider than the tokenizer's vocabulary (padding rows): the mask
    covers the tokenizer's tokens only, and the padding is never drawn."""
    logits = torch.zeros(1, 70)
    masked = apply_grammar_bitmask(logits, bitmask_of([{2, 5}], 40))
    assert set(torch.isfinite(masked[0]).nonzero().flatten().tolist()) == {2, 5}


def test_sampler_draws_and_reports_logprobs_within_each_rows_grammar():
    allowed = [{4, 7}, None, {9}]
    logits = torch.randn(3, VOCAB)
    params = [
        SamplingParams(temperature=1.0, seed=1, logprobs=2),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, seed=2),
    ]
    meta = make_meta(params)
    meta.grammar_bitmask = bitmask_of(allowed, VOCAB)
    draws = [Sampler()(logits.clone(), meta).sampled_token_ids for _ in range(20)]
    assert {d[0] for d in draws} <= {4, 7}
    assert all(d[1] == int(logits[1].argmax()) and d[2] == 9 for d in draws)
    out = Sampler()(logits.clone(), meta)
    expected = torch.log_softmax(logits[0, [4, 7]], dim=-1)
    assert set(out.logprobs[0]) >= {4, 7}
    for token, value in zip([4, 7], expected.tolist(), strict=True):
        assert math.isclose(out.logprobs[0][token], value, rel_tol=1e-5, abs_tol=1e-6)


def test_greedy_rows_without_logprobs_report_none_per_row():
    """The greedy fast path answers every row's logprobs, as None, like the general path."""
    params = [SamplingParams(temperature=0.0)] * 3
    out = Sampler()(torch.randn(3, VOCAB), make_meta(params))
    assert out.logprobs == [None, None, None]


# ---- speculative decoding: drafts verified by sampling


# chi-square critical value at p = 1e-4 for 2 * VOCAB - 2 = 22 degrees of freedom: a correct rule
# fails with probability 1e-4 for a random seed (the test's seed is fixed: it never flakes)
CHI2_CRITICAL_DRAFTS = 55.52


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=6),
        SamplingParams(temperature=1.3, top_p=0.8, min_p=0.02),
    ],
)
def test_drafts_verified_by_sampling_keep_the_target_distribution(logits, params):
    """One draft ``d`` after row 0: a sequence outputs ``x`` ~ p0 when ``x != d``, else ``d``
    then ``y`` ~ p1. The joint law of what it outputs must be that (the speculative-sampling
    rule for a one-token draft), over 2 V - 1 outcomes; accepting every draft, or drawing the
    second token from p0, must be rejected by the same test."""
    from pagedserve.engine.sampler import accept_drafts

    num, draft = 40_000, int(logits[0].argmax())
    torch.manual_seed(4321)
    rows = logits[:2].repeat(num, 1)  # row 0 then the draft's row, for each sequence
    out = Sampler()(rows, make_meta([params] * (2 * num)))
    results = accept_drafts(out, [[draft]] * num)
    p0, p1 = (_target_probs(logits[i], params) for i in (0, 1))
    expected = torch.cat([p0.clone().index_fill_(0, torch.tensor([draft]), 0), p0[draft] * p1])
    observed = torch.tensor([t[0] if t[0] != draft else VOCAB + t[1] for t, _ in results])
    assert all(len(t) == (2 if t[0] == draft else 1) for t, _ in results)
    assert chi_square(observed, expected) < CHI2_CRITICAL_DRAFTS
    # the test's power: a rule that always took the draft gives another law of the 2nd token
    always = torch.tensor([VOCAB + s for s in out.sampled_token_ids[1::2]])
    assert chi_square(always, torch.cat([torch.zeros(VOCAB), p1])) < CHI2_CRITICAL_DRAFTS
    assert chi_square(always[: len(observed)], expected) > CHI2_CRITICAL_DRAFTS


def _target_probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution the sampler draws from: temperature, then top-k, top-p and min-p (its
    documented order), over the whole row in float64."""
    probs = torch.softmax(row.double() / p.temperature, -1)
    order = probs.argsort(descending=True)
    keep = torch.zeros(VOCAB, dtype=torch.bool)
    top_k = p.top_k if p.top_k > 0 else VOCAB
    mass = 0.0
    for rank, i in enumerate(order.tolist()):
        if rank >= top_k or mass >= p.top_p:
            break
        keep[i] = True
        mass += float(probs[i])
    probs = torch.where(keep, probs, 0)
    probs /= probs.sum()
    if p.min_p:
        probs = torch.where(probs >= p.min_p * probs.max(), probs, 0)
    return probs / probs.sum()


def test_the_backends_draw_gets_exactly_the_rows_that_keep_every_candidate(logits):
    """A backend's one-call draw (``Sampler(categorical=...)``) is handed the random rows with no
    top-k, top-p or min-p, with 1 / temperature and one uniform number per row (a seeded row's
    from its own generator), and its tokens are theirs; filtered and greedy rows are not."""
    calls = []

    def categorical(rows, inv_temperature, u):
        calls.append((rows.clone(), inv_temperature.clone(), u.clone()))
        return torch.arange(100, 100 + len(rows))  # ids no other path could give

    params = [
        SamplingParams(temperature=0.5),  # keeps every candidate
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=2.0, seed=9),  # keeps every candidate, seeded
        SamplingParams(temperature=1.0, top_p=0.5),
        SamplingParams(temperature=1.0, min_p=0.3),
        SamplingParams(temperature=0.0),
    ]
    rows = torch.cat([logits, logits[:2]])
    out = Sampler(categorical=categorical)(rows, make_meta(params)).sampled_token_ids
    ((given, inv_temperature, u),) = calls
    assert torch.equal(given, rows[[0, 2]])
    assert torch.allclose(inv_temperature, torch.tensor([2.0, 0.5]))
    assert float(u[1]) == float(torch.rand(1, generator=torch.Generator().manual_seed(9)))
    assert 0 <= float(u[0]) < 1
    assert out[0] == 100 and out[2] == 101
    assert out[1] == int(logits[1].argmax()) and out[5] == int(logits[1].argmax())
    assert all(0 <= out[i] < VOCAB for i in (3, 4))


def test_the_backends_draw_at_u_0_takes_a_token_of_real_weight(monkeypatch):
    """torch.rand gives 0 once in 2^24 draws; the native draw's exp floors every finite logit's
    weight at about 1e-38, so at u = 0 it took token 0 however unlikely. The reference, PyTorch's
    draw, takes the first token whose weight is above 0 in float32."""
    from pagedserve.engine import sampler as sampler_module
    from pagedserve.hal import get_device

    logits = torch.full((2, 64), -1000.0)
    logits[:, 40], logits[:, 41] = 3.0, 2.0  # everything else weighs exactly 0 in float32
    monkeypatch.setattr(sampler_module, "uniforms", lambda gens, device: torch.zeros(len(gens)))
    params = [SamplingParams(temperature=0.5)] * 2
    reference = Sampler()(logits, make_meta(params)).sampled_token_ids
    backend = Sampler(categorical=get_device("cpu").categorical())
    assert reference == [40, 40]
    assert backend(logits, make_meta(params)).sampled_token_ids == reference


def test_verification_accepts_the_longest_prefix_of_drafts_equal_to_the_tokens_sampled():
    """``sampled[j]`` is the token drawn at draft ``j``'s position; a sequence outputs the
    matching drafts and then the first token that differs (or the bonus token after them all)."""
    from pagedserve.engine.sampler import SamplerOutput, accept_drafts, verify_drafts

    assert verify_drafts([5, 6, 7], [5, 6, 7, 8]) == 3
    assert verify_drafts([5, 6, 7], [5, 6, 9, 8]) == 2
    assert verify_drafts([5, 6, 7], [4, 6, 7, 8]) == 0
    assert verify_drafts([], [4]) == 0
    out = SamplerOutput([5, 6, 7, 8, 1, 9, 2], [None] * 7)  # two sequences: 3 drafts, then 2
    assert accept_drafts(out, [[5, 6, 7], [1, 3]]) == [([5, 6, 7, 8], None), ([1, 9], None)]
    logprobs = [{t: -0.5 * i} for i, t in enumerate(out.sampled_token_ids)]
    out = SamplerOutput(out.sampled_token_ids, logprobs)  # each output token keeps its own
    assert accept_drafts(out, [[5, 6, 7], [1, 3]]) == [
        ([5, 6, 7, 8], logprobs[:4]),
        ([1, 9], logprobs[4:6]),
    ]
