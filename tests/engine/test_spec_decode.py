"""Speculative decoding with n-gram drafts: greedy output identical to transformers' (so to
decoding without speculation) across the numerics tests' models, whatever the paging, budget or
preemption; batches mixing drafting and non-drafting requests; stops, max_tokens and logprobs
exact; every page returned."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve import LLM, SamplingParams
from pagedserve.config import EngineConfig, SpeculativeConfig, UsageContext
from pagedserve.engine.spec_decode import (
    BACKOFF_AFTER,
    FIRST_COOLDOWN,
    MAX_COOLDOWN,
    DraftState,
    NgramIndex,
    NgramProposer,
    SpecDecodeStats,
)
from tests.engine.test_engine_numerics import PROMPTS, _assert_pool_drained, _tier_kwargs
from tests.helpers.models import build_tiny_hf_model, hf_greedy

MAX_TOKENS = 24
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
LOOP = [(7 * i + 3) % 50 + 10 for i in range(12)]
# prompts that repeat themselves (drafts found at once) beside the numerics tests' ones (drafts
# only where the generation repeats)
SPEC_PROMPTS = [LOOP * 3, LOOP * 2 + [5, 6], *PROMPTS[:4]]


# ---- the proposer and its back-off


def scanned_drafts(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """vLLM's rule by a plain scan: for n from max_n down to min_n, the first i whose n tokens
    equal the suffix's, with i + n before the end; the k tokens after it."""
    size = len(tokens)
    for n in range(min(max_n, size - 1), min_n - 1, -1):
        for i in range(size - n):
            if tokens[i : i + n] == tokens[size - n :]:
                return tokens[i + n : i + n + k]
    return []


def find_ngram_drafts(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    return NgramIndex(min_n, max_n).drafts(tokens, k)


def test_drafts_follow_the_first_occurrence_of_the_longest_suffix_ngram():
    tokens = [1, 2, 3, 9, 2, 3, 8, 7, 1, 2, 3]
    assert find_ngram_drafts(tokens, 1, 3, 2) == [9, 2]  # [1, 2, 3] at 0, not [2, 3] at 4
    assert find_ngram_drafts(tokens, 1, 2, 3) == [9, 2, 3]  # [2, 3] first at 1
    assert find_ngram_drafts([5, 6, 7, 5, 6], 1, 2, 9) == [7, 5, 6]  # what there is
    assert find_ngram_drafts([5, 6, 7, 8], 1, 3, 4) == []  # nothing repeats
    assert find_ngram_drafts([4, 5, 4], 2, 3, 2) == []  # only a 1-gram repeats
    assert find_ngram_drafts([4, 4], 1, 1, 3) == [4]  # the suffix itself is not a match


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), min_size=1, max_size=60),
    bounds=st.tuples(st.integers(1, 4), st.integers(0, 3)),
    k=st.integers(1, 6),
    lookups=st.lists(st.integers(1, 60), max_size=12),
)
def test_the_index_a_sequence_grows_finds_what_a_scan_of_it_finds(tokens, bounds, k, lookups):
    # one index per sequence, looked up at lengths that grow by uneven steps (the back-off skips
    # lookups; a verification step appends several tokens), as a scan of the whole finds
    min_n, max_n = bounds[0], bounds[0] + bounds[1]
    index = NgramIndex(min_n, max_n)
    for size in sorted({min(n, len(tokens)) for n in lookups} | {len(tokens)}):
        assert index.drafts(tokens[:size], k) == scanned_drafts(tokens[:size], min_n, max_n, k)


class _CountingDict(dict):
    """A dict that counts its ``setdefault`` calls: an index's work."""

    def __init__(self):
        super().__init__()
        self.num_probes = 0

    def setdefault(self, key, default=None):
        self.num_probes += 1
        return super().setdefault(key, default)


def test_a_growing_index_indexes_each_new_token_once_and_only_the_n_grams_it_looks_up():
    # its point is its cost: a step indexes only the n-grams (min_n to max_n tokens) that end at
    # the token appended since the last lookup, so it holds at most max_n - min_n + 1 per token
    min_n, max_n = 2, 4
    index = NgramIndex(min_n, max_n)
    index.first_end = probes = _CountingDict()
    tokens = LOOP * 2
    for size in range(1, len(tokens) + 1):
        before = probes.num_probes
        index.drafts(tokens[:size], 3)
        end = size - 1  # the n-grams ending before the last token, newly: at end
        assert probes.num_probes - before == max(min(max_n, end) - min_n + 1, 0)
    assert all(min_n <= len(ngram) <= max_n for ngram in index.first_end)


def test_a_request_whose_drafts_keep_failing_backs_off_then_drafts_again():
    state = DraftState()
    drafting = []
    for _ in range(40):
        state.num_steps += 1
        may = state.num_steps >= state.resume_at
        drafting.append(may)
        if may:
            state.observe(0)
    assert all(drafting[:BACKOFF_AFTER])
    assert not any(drafting[BACKOFF_AFTER : BACKOFF_AFTER + FIRST_COOLDOWN - 1])
    assert sum(drafting) < 15  # the cooldown doubles
    state.observe(2)  # an accepted draft resets it
    assert state.num_failed == 0 and state.cooldown == FIRST_COOLDOWN


def _drafting_steps(proposer: NgramProposer, accepts: list[int], num_steps: int) -> list[int]:
    """The steps (from 1) at which a request whose sequence always repeats got drafts from
    ``proposer``; its i-th drafting step accepts ``accepts[i]`` (0 past the list's end)."""
    state, tokens, steps = DraftState(), LOOP * 2, []
    for step in range(1, num_steps + 1):
        drafts = proposer.propose(tokens, state, max_drafts=8)
        if drafts:
            state.observe(accepts[len(steps)] if len(steps) < len(accepts) else 0)
            steps.append(step)
    return steps


def _backoff_steps(num_steps: int, start: int = 1, cooldown: int = FIRST_COOLDOWN) -> list[int]:
    """The rule, step by step: BACKOFF_AFTER drafting steps in a row that accept nothing, then
    the next drafting step ``cooldown`` steps after the last of them; the cooldown doubles each
    time, up to MAX_COOLDOWN."""
    steps, step = [], start
    while step <= num_steps:
        run = list(range(step, step + BACKOFF_AFTER))
        steps += [s for s in run if s <= num_steps]
        step = run[-1] + cooldown
        cooldown = min(2 * cooldown, MAX_COOLDOWN)
    return steps


def test_failing_drafts_back_off_for_a_cooldown_that_doubles_up_to_its_bound():
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3))
    assert _drafting_steps(proposer, [], 600) == _backoff_steps(600)


def test_an_accepted_draft_resets_the_failures_and_the_cooldown():
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3))
    # fail into two back-offs, then one failure short of a third, then an accepted draft
    fails = 2 * BACKOFF_AFTER + BACKOFF_AFTER - 1
    steps = _drafting_steps(proposer, [0] * fails + [1], 300)
    before = _backoff_steps(300)[:fails]
    assert steps[:fails] == before
    accepted_at = before[-1] + 1  # no back-off yet: it drafts the next step too
    assert steps[fails:] == [accepted_at, *_backoff_steps(300, start=accepted_at + 1)]


def test_the_proposer_drafts_up_to_its_k_and_the_room_left_by_the_longest_suffix_match():
    config = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=3)
    proposer = NgramProposer(config)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 7, 1, 2, 3]
    for room in range(-1, 7):
        state = DraftState()
        expected = scanned_drafts(tokens, 2, 3, min(4, room)) if room > 0 else []
        assert proposer.propose(tokens, state, room) == expected
        assert state.num_steps == 1
        assert (state.index is None) == (room <= 0)  # no room: not even a lookup
    # a 1-gram repeats ([3]), but lookups start at prompt_lookup_min = 2
    assert proposer.propose([5, 3, 6, 3], DraftState(), 4) == []


def test_spec_decode_stats_count_steps_drafts_and_acceptances_by_position():
    steps = [(4, 0), (4, 2), (3, 3), (2, 1), (4, 4)]  # (drafts, accepted) per verification step
    stats = SpecDecodeStats(num_speculative_tokens=4)
    for num_drafts, num_accepted in steps:
        stats.observe(num_drafts, num_accepted)
    drafts, accepted = sum(d for d, _ in steps), sum(a for _, a in steps)
    per_pos = [sum(1 for _, a in steps if a > i) for i in range(4)]
    assert stats.to_dict() == {
        "spec_decode_num_drafts_total": len(steps),
        "spec_decode_num_draft_tokens_total": drafts,
        "spec_decode_num_accepted_tokens_total": accepted,
        "spec_decode_num_accepted_tokens_per_pos": per_pos,
        "spec_decode_draft_acceptance_rate": pytest.approx(accepted / drafts),
        "spec_decode_mean_acceptance_length": pytest.approx(1 + accepted / len(steps)),
    }


def test_spec_decode_stats_before_any_draft_are_zero():
    stats = SpecDecodeStats(num_speculative_tokens=3)
    assert stats.acceptance_rate == 0.0 and stats.mean_acceptance_length == 0.0
    assert stats.to_dict()["spec_decode_num_accepted_tokens_per_pos"] == [0, 0, 0]


@pytest.mark.parametrize(
    "value, message",
    [
        ("{bad", "not valid JSON"),
        ('{"method": "eagle", "num_speculative_tokens": 2}', "method 'eagle' is not supported"),
        ('{"num_speculative_tokens": 8}', "use 1 to 7"),
        ('{"num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2}', "min"),
        ('{"num_speculative_tokens": 2, "lookahead": 1}', "lookahead"),
        ("[4]", "expected a JSON object"),
    ],
)
def test_a_bad_speculative_config_says_what_is_wrong_by_its_name(value, message):
    with pytest.raises(ValueError, match="speculative_config") as e:
        EngineConfig.from_kwargs(UsageContext.LLM_CLASS, speculative_config=value)
    assert message in str(e.value)


def test_speculative_config_takes_a_mapping_or_json_with_vllms_defaults():
    config = EngineConfig.from_kwargs(speculative_config={"num_speculative_tokens": 3})
    spec = config.speculative
    assert (spec.method, spec.prompt_lookup_min, spec.prompt_lookup_max) == ("ngram", 5, 5)
    spec = EngineConfig.from_kwargs(
        speculative_config='{"num_speculative_tokens": 2, "prompt_lookup_max": 4}'
    ).speculative
    assert (spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max) == (
        2,
        4,
        4,
    )


# ---- greedy output unchanged


@pytest.fixture(scope="module", params=["glm", "glm4"])
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = build_tiny_hf_model(path, request.param, max_position_embeddings=256)
    refs = [hf_greedy(hf, p, MAX_TOKENS) for p in SPEC_PROMPTS]
    return path, refs


def _generate(path, params=None, prompts=SPEC_PROMPTS, **engine_kwargs):
    llm = LLM(model=str(path), dtype="float32", **engine_kwargs)
    params = params or SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, [o.outputs[0] for o in outs]


def _assert_drafts_both_ways(llm: LLM) -> None:
    """The run verified drafts, and both accepted and rejected some (so both paths ran)."""
    stats = llm.llm_engine.get_stats()
    accepted = stats["spec_decode_num_accepted_tokens_total"]
    assert 0 < accepted < stats["spec_decode_num_draft_tokens_total"], stats


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_greedy_with_drafts_matches_transformers_for_every_block_size(model, block_size):
    path, refs = model
    llm, outs = _generate(
        path, block_size=block_size, num_kv_pages=2048 // block_size, speculative_config=NGRAM
    )
    assert [o.token_ids for o in outs] == refs
    _assert_drafts_both_ways(llm)
    _assert_pool_drained(llm)


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_greedy_with_drafts_matches_transformers_under_preemption_and_a_tight_budget(
    model, preemption
):
    path, refs = model
    llm, outs = _generate(
        path,
        block_size=4,
        num_kv_pages=28,
        max_num_batched_tokens=10,  # drafts cut short by the budget too
        max_num_seqs=4,
        speculative_config=NGRAM,
        **_tier_kwargs(path, preemption),
    )
    assert [o.token_ids for o in outs] == refs
    assert llm.llm_engine.scheduler.num_preemptions > 0
    _assert_drafts_both_ways(llm)
    _assert_pool_drained(llm)


def test_a_batch_mixing_greedy_and_sampled_requests_gives_each_its_own_output(model):
    """Greedy requests (logprobs, penalties) output what they output without speculation, one
    token at a time; sampled ones draft too (their law is the sampler tests'), and finish."""
    path, _ = model
    kinds = [
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.8, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True),
        SamplingParams(
            temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.3
        ),
    ]
    params = [kinds[i % len(kinds)] for i in range(len(SPEC_PROMPTS))]
    kwargs = dict(block_size=4, num_kv_pages=512)
    _, plain = _generate(path, params, **kwargs)
    llm, spec = _generate(path, params, speculative_config=NGRAM, **kwargs)
    for p, a, b in zip(params, plain, spec):
        assert len(b.token_ids) == MAX_TOKENS and b.finish_reason == "length"
        if not p.greedy:
            continue
        assert a.token_ids == b.token_ids
        assert (a.logprobs is None) == (b.logprobs is None)
        if a.logprobs is not None:
            assert [d.keys() for d in a.logprobs] == [d.keys() for d in b.logprobs]
            for x, y in zip(a.logprobs, b.logprobs):
                assert list(x.values()) == pytest.approx(list(y.values()), abs=1e-5)
    assert llm.llm_engine.get_stats()["spec_decode_num_accepted_tokens_total"] > 0
    _assert_pool_drained(llm)


def test_sampled_requests_draft_and_are_reproducible_with_a_seed(model):
    path, _ = model
    params = SamplingParams(temperature=0.2, top_k=3, seed=11, max_tokens=MAX_TOKENS)
    runs = []
    for _ in range(2):
        spec = {**NGRAM, "prompt_lookup_min": 1}  # drafts after any token seen before
        llm, outs = _generate(path, params, num_kv_pages=512, speculative_config=spec)
        runs.append([o.token_ids for o in outs])
        # (the tiny models' top tokens are near ties: a sampled one rarely matches a draft)
        assert llm.llm_engine.get_stats()["spec_decode_num_drafts_total"] > 0
        _assert_pool_drained(llm)
    assert runs[0] == runs[1]


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 13])
def test_max_tokens_and_stop_tokens_end_exactly_where_they_would_without_drafts(model, max_tokens):
    path, refs = model
    ref = refs[0]
    stop = ref[max_tokens + 2]  # a token the drafts run past
    params = [
        SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[stop]),
    ]
    llm, outs = _generate(
        path, params, [SPEC_PROMPTS[0]] * 2, num_kv_pages=256, speculative_config=NGRAM
    )
    assert outs[0].token_ids == ref[:max_tokens] and outs[0].finish_reason == "length"
    assert outs[1].token_ids == ref[: ref.index(stop) + 1] and outs[1].finish_reason == "stop"
    _assert_pool_drained(llm)


def test_drafts_stop_at_the_context_length(model):
    """No max_tokens: the context length ends the sequence, its drafts never past it."""
    path, refs = model
    prompt = SPEC_PROMPTS[0]
    limit = len(prompt) + 9
    llm, outs = _generate(
        path,
        SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True),
        [prompt],
        num_kv_pages=256,
        max_model_len=limit,
        speculative_config=NGRAM,
    )
    assert outs[0].token_ids == refs[0][:9] and outs[0].finish_reason == "length"
    _assert_pool_drained(llm)


def test_constrained_requests_do_not_draft_and_keep_their_grammar(tiny_glm4):
    """Drafts are not grammar-checked yet: a request under a grammar does not speculate, beside
    ones that do, and answers as it would without speculation."""
    import re

    from pagedserve.sampling_params import StructuredOutputsParams

    path = tiny_glm4[0]
    phone = r"\d{3}-\d{4}"
    text = "call 555-1234 or 555-1234 or 555-"
    constrained = SamplingParams(
        temperature=0.0, max_tokens=20, structured_outputs=StructuredOutputsParams(regex=phone)
    )
    free = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    outs = {}
    for spec in (None, {**NGRAM, "prompt_lookup_min": 1}):
        llm = LLM(model=str(path), dtype="float32", num_kv_pages=256, speculative_config=spec)
        got = llm.generate([text, text], [constrained, free], use_tqdm=False)
        outs[spec is None] = [o.outputs[0].text for o in got]
        assert re.fullmatch(phone, outs[spec is None][0])
        _assert_pool_drained(llm)
    assert outs[True] == outs[False]
    assert llm.llm_engine.get_stats()["spec_decode_num_drafts_total"] > 0
