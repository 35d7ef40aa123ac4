"""Each row of one mixed batch is drawn from its own exact distribution.

Rows with different temperature, top_k, top_p, min_p, penalties, logit_bias, min_tokens and seeds
sit side by side in one ``Sampler`` call, many times over. For every row kind a reference written
here, one token at a time in float64, gives the exact target distribution in vLLM's order
(logit_bias -> min_tokens -> repetition / frequency / presence penalties -> temperature -> top_k
-> top_p -> min_p), and a chi-square goodness-of-fit test and a per-token binomial bound compare the
draws with it. The bounds are set so that a correct sampler fails them with probability about 1e-5
per row, whatever the random numbers; and the random numbers are fixed, so the test is
deterministic.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from pagedserve.engine.sampler import Sampler, SamplingMetadata
from pagedserve.sampling_params import SamplingParams

EOS = 1
Z_1E5 = 4.2649  # standard normal upper quantile at 1e-5
Z_TOKEN = 6.0  # per-token bound: under 1e-8 a token, so under 1e-5 a row even at 1,500 tokens
DRAWS_PER_ROW = 2_000
REPLICAS_PER_CALL = 250  # copies of each row kind in one batch, interleaved with the others


def chi2_critical(df: int) -> float:
    """Upper 1e-5 quantile of chi-square(df), Wilson-Hilferty (conservative for small df)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + Z_1E5 * math.sqrt(a)) ** 3


# ---- the reference: one row, one rule at a time, in float64


def reference_distribution(
    logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]
) -> torch.Tensor:
    x = logits.double().clone()
    vocab = x.numel()
    for token, bias in (p.logit_bias or {}).items():
        x[token] += bias
    if len(output) < p.min_tokens:
        for token in set(p.stop_token_ids) | (set() if p.ignore_eos else {EOS}):
            x[token] = -math.inf
    for token in range(vocab):
        if token in prompt or token in output:
            v = x[token]
            x[token] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        count = output.count(token)
        x[token] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    if p.temperature < 1e-5:
        return torch.nn.functional.one_hot(x.argmax(), vocab).double()
    probs = torch.softmax(x / p.temperature, dim=0)
    ranked = sorted(range(vocab), key=lambda t: -probs[t].item())
    if p.top_k > 0:
        ranked = ranked[: p.top_k]
    kept, mass_before, total = [], 0.0, sum(probs[t].item() for t in ranked)
    for token in ranked:  # the smallest head of the ranking whose mass reaches top_p
        if p.top_p < 1.0 and mass_before >= p.top_p:
            break
        kept.append(token)
        mass_before += probs[token].item() / total
    top = max(probs[t].item() for t in kept)
    kept = [t for t in kept if probs[t].item() >= p.min_p * top]
    target = torch.zeros(vocab, dtype=torch.float64)
    target[kept] = probs[kept] / probs[kept].sum()
    return target


def max_token_deviation(draws: list[int], target: torch.Tensor) -> float:
    """The largest |z| of one token's count against its binomial law (tokens expected >= 5
    times): sharper than chi-square when a single token's probability is wrong."""
    counts = torch.bincount(torch.tensor(draws), minlength=target.numel()).double()
    n = len(draws)
    cells = (target * n >= 5) & (target < 1)
    if not bool(cells.any()):
        return 0.0
    p = target[cells]
    z = (counts[cells] - n * p) / torch.sqrt(n * p * (1 - p))
    return z.abs().max().item()


def chi_square(draws: list[int], target: torch.Tensor) -> tuple[float, int]:
    """(statistic, degrees of freedom); cells expected below 5 draws are pooled into one."""
    counts = torch.bincount(torch.tensor(draws), minlength=target.numel()).double()
    expected = target * len(draws)
    outside = counts[target == 0].sum().item()
    assert outside == 0, f"{int(outside)} draws of tokens the row must never yield"
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big & (target > 0)].sum().view(1)])
    wanted = torch.cat([expected[big], expected[~big & (target > 0)].sum().view(1)])
    if wanted[-1] == 0:
        observed, wanted = observed[:-1], wanted[:-1]
    statistic = ((observed - wanted) ** 2 / wanted).sum().item()
    return statistic, max(len(wanted) - 1, 1)


# ---- the batch


ROW_KINDS = {
    "temperature": SamplingParams(temperature=0.8),
    "top_k=1": SamplingParams(temperature=1.5, top_k=1),
    "top_k=1 with top_p": SamplingParams(temperature=1.5, top_k=1, top_p=0.5),
    "top_k=3": SamplingParams(temperature=1.2, top_k=3),
    "top_k=25": SamplingParams(temperature=1.3, top_k=25),
    "top_p=0.7": SamplingParams(top_p=0.7),
    "min_p=0.1": SamplingParams(temperature=1.0, min_p=0.1),
    "top_k+top_p+min_p": SamplingParams(temperature=1.5, top_k=12, top_p=0.85, min_p=0.05),
    "repetition_penalty": SamplingParams(repetition_penalty=1.8),
    "presence_penalty": SamplingParams(presence_penalty=1.2),
    "frequency_penalty": SamplingParams(frequency_penalty=1.2),
    "negative penalties": SamplingParams(repetition_penalty=0.7, presence_penalty=-0.8),
    "penalties": SamplingParams(
        temperature=1.1,
        repetition_penalty=1.6,
        frequency_penalty=0.7,
        presence_penalty=0.4,
        top_k=30,
    ),
    "logit_bias": SamplingParams(logit_bias={7: 4.0, 0: -100.0, 9: 2.5}),
    "min_tokens": SamplingParams(min_tokens=10, stop_token_ids=[3, 4]),
    "min_tokens with ignore_eos": SamplingParams(
        min_tokens=10, ignore_eos=True, stop_token_ids=[3]
    ),
    "min_p=1": SamplingParams(temperature=1.5, min_p=1.0),
    "seeded top_p": SamplingParams(temperature=0.7, top_p=0.9, seed=0),
    "greedy with penalties": SamplingParams(temperature=0.0, min_tokens=10, repetition_penalty=3.0),
}
PROMPT = [2, 5, 6, 6, 8]
OUTPUT = [5, 11, 11, 11, 12, 2]


# tokens a row kind's rule acts on, made likely in that row so that the rule moves much mass;
# the repetition row is shifted below zero, where the penalty multiplies instead of divides
SHIFT = {"repetition_penalty": -3.0}
FOCUS = {
    "repetition_penalty": {6: 2.0, 8: 2.0},
    "presence_penalty": {12: 2.0, 2: 1.5},
    "frequency_penalty": {11: 4.0},
    "negative penalties": {5: -1.0, 8: 1.0},
    "min_tokens": {EOS: 2.0, 3: 1.5, 4: 1.5},
    "min_tokens with ignore_eos": {EOS: 2.0, 3: 3.0},
}


def row_logits(vocab: int, scale: float) -> dict[str, torch.Tensor]:
    """Each row kind its own logits, with EOS, the stop tokens and the penalised and biased
    tokens among the likely ones so that every rule changes the distribution."""
    rows = {}
    for kind in ROW_KINDS:  # each kind its own stream: adding a kind changes no other row
        g = torch.Generator().manual_seed(vocab * 2**32 + zlib.crc32(kind.encode()))
        logits = torch.randn(vocab, generator=g) * scale + SHIFT.get(kind, 0.0)
        logits[[EOS, 3, 4, 5, 6, 11, 12, 2]] += scale * torch.tensor(
            [1.0, 1, 1, 0.8, 0.5, 1, 0.5, 0.5]
        )
        for token, boost in FOCUS.get(kind, {}).items():
            logits[token] += boost
        rows[kind] = logits
    return rows


def draw_mixed_batches(vocab: int, scale: float) -> dict[str, list[int]]:
    kinds = list(ROW_KINDS)
    logits = row_logits(vocab, scale)
    batch = torch.stack([logits[k] for k in kinds] * REPLICAS_PER_CALL)
    draws: dict[str, list[int]] = {k: [] for k in kinds}
    torch.manual_seed(2024)
    sampler = Sampler()
    for call in range(DRAWS_PER_ROW // REPLICAS_PER_CALL):
        params, generators = [], []
        for replica in range(REPLICAS_PER_CALL):
            for kind in kinds:
                p = ROW_KINDS[kind]
                params.append(p)
                seed = None if p.seed is None else call * REPLICAS_PER_CALL + replica
                generators.append(None if seed is None else torch.Generator().manual_seed(seed))
        n = len(params)
        meta = SamplingMetadata(
            params=params,
            prompt_token_ids=[PROMPT] * n,
            output_token_ids=[OUTPUT] * n,
            generators=generators,
            eos_token_ids=[frozenset({EOS})] * n,
        )
        tokens = sampler(batch, meta).sampled_token_ids
        for i, token in enumerate(tokens):
            draws[kinds[i % len(kinds)]].append(token)
    return draws


@pytest.fixture(scope="module", params=[(64, 1.0), (1500, 2.0)], ids=["vocab64", "vocab1500"])
def mixed(request):
    vocab, scale = request.param
    return row_logits(vocab, scale), draw_mixed_batches(vocab, scale)


def test_each_row_of_a_mixed_batch_follows_its_own_distribution(mixed):
    """All row kinds checked in one test: the batch is drawn once, and a bug in any row fails."""
    logits, draws = mixed
    failures = []
    for kind, params in ROW_KINDS.items():
        target = reference_distribution(logits[kind], params, PROMPT, OUTPUT)
        try:
            statistic, df = chi_square(draws[kind], target)
        except AssertionError as e:
            failures.append(f"{kind}: {e}")
            continue
        if statistic >= chi2_critical(df):
            failures.append(
                f"{kind}: chi-square {statistic:.1f} over {df} degrees of freedom "
                f"(bound {chi2_critical(df):.1f})"
            )
        z = max_token_deviation(draws[kind], target)
        if z >= Z_TOKEN:
            failures.append(f"{kind}: one token's count is {z:.1f} standard deviations off")
    assert not failures, "\n".join(failures)


def test_the_reference_rules_each_change_the_distribution():
    """Guards the test itself: each row kind differs from plain sampling of its logits."""
    logits = row_logits(64, 1.0)
    for kind, p in ROW_KINDS.items():
        if kind == "temperature":
            continue
        plain = SamplingParams(temperature=p.temperature)
        target = reference_distribution(logits[kind], p, PROMPT, OUTPUT)
        baseline = reference_distribution(logits[kind], plain, PROMPT, OUTPUT)
        assert (target - baseline).abs().sum() > 0.1, kind
