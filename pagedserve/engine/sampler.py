"""Turn one step's logits [B, V] into one next token per row, vLLM's order of operations.

grammar bitmask -> logit_bias -> min_tokens -> repetition / frequency / presence penalties
-> logprobs -> greedy argmax, or temperature -> top_k -> top_p -> min_p -> draw.

A constrained row (structured output) first loses every token its grammar does not allow, as in
vLLM, so its logprobs are those of the allowed tokens.

Logprobs are vLLM's default "raw" logprobs of the processed logits: log_softmax of the logits after
bias, min_tokens and penalties, before temperature, top_k, top_p and min_p. They therefore do not
depend on how the token was drawn, and a greedy and a sampled request report the same values.

The draw is by inverse CDF: one uniform number per row, looked up in the cumulative probabilities
of the row's candidates. One random number a row instead of one per vocabulary entry: drawing
32 x 151552 uniforms alone took 26-40 ms here, more than all the rest of a step's sampling. A row
whose request has a seed takes its number from its own ``torch.Generator``, and its candidates
depend only on its own logits and parameters, so its tokens do not depend on the other rows.
A row without top-k, top-p or min-p goes to the backend's ``categorical`` draw where it has one
(the native CPU kernels: the same inverse CDF in one call); the PyTorch draw is a dozen small ops,
and at batch 1 their dispatch, not their arithmetic, cost a third of a decode step.

Candidates: the whole row in token-id order when neither top_k nor top_p is set; the row's
``max(top_k)`` largest when top_k is set (``topk``, not a sort); for top_p alone the
``NUCLEUS_CANDIDATES`` largest plus one column standing for the rest of the mass, which is exact
whenever the nucleus lies within them (it does unless the distribution is very flat), else a full
sort for that row (a sort of [32, 151552] took 287 ms here, the bounded ``topk`` 15 ms).
benchmarks/sampler_speed.py measures the whole sampler.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedserve.sampling_params import SamplingParams


@dataclass
class SamplingMetadata:
    """Built by the model runner for one step; row ``i`` describes row ``i`` of the logits."""

    params: list[SamplingParams]
    prompt_token_ids: list[list[int]]
    output_token_ids: list[list[int]]  # generated so far, before this step
    generators: list[torch.Generator | None]  # per-request, seeded from params.seed; None: global
    eos_token_ids: list[frozenset[int]]
    # int32 [B, ceil(V / 32)]: bit t of row i set when token t is allowed; None: no constraint
    grammar_bitmask: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n = len(self.params)
        for name in ("prompt_token_ids", "output_token_ids", "generators", "eos_token_ids"):
            if len(getattr(self, name)) != n:
                raise ValueError(
                    f"SamplingMetadata.{name} has {len(getattr(self, name))} rows but params has "
                    f"{n}; build every field with one entry per sequence in the batch"
                )


@dataclass
class SamplerOutput:
    sampled_token_ids: list[int]
    logprobs: list[dict[int, float] | None]  # chosen token + top-N, where params.logprobs is set


def _row_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


# a backend's draw for rows without top-k, top-p or min-p: (float32 logits [R, V], 1 / temperature
# [R], uniform numbers u [R]) -> token ids [R], ``draw``'s inverse CDF for u
Categorical = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Sampler:
    """``argmax`` may be a backend's faster row-wise argmax (same ties: the first maximum), and
    ``categorical`` its draw of a whole row in one call (``Categorical``); None: ``draw``, a dozen
    PyTorch ops, which cost about 0.4 ms a row here, a third of a decode step."""

    def __init__(
        self,
        argmax: Callable[[torch.Tensor], torch.Tensor] = _row_argmax,
        categorical: Categorical | None = None,
    ):
        self.argmax = argmax
        self.categorical = categorical

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        _check_logits(logits, len(meta.params))
        logits = logits.float()
        if meta.grammar_bitmask is not None:
            logits = apply_grammar_bitmask(logits.clone(), meta.grammar_bitmask)
        if all(p.greedy and p.logprobs is None and not _modifies_logits(p) for p in meta.params):
            return SamplerOutput(self.argmax(logits).tolist(), [None] * len(meta.params))
        if any(_modifies_logits(p) for p in meta.params):
            logits = logits.clone()  # the steps below work in place; the caller's stay intact
        apply_logit_bias(logits, meta.params)
        apply_min_tokens(logits, meta)
        apply_penalties(logits, meta)
        logprobs = gather_logprobs(logits, meta.params)
        token_ids = sample(logits, meta.params, meta.generators, self.argmax, self.categorical)
        return SamplerOutput(
            sampled_token_ids=token_ids.tolist(),
            logprobs=build_logprob_dicts(logprobs, token_ids, meta.params),
        )

    def compute_prompt_logprobs(
        self, logits: torch.Tensor, target_ids: list[int], top_n: int
    ) -> list[dict[int, float]]:
        """Row ``i`` of ``logits`` predicts ``target_ids[i]`` (the prompt token after position i).

        The first prompt token has no prediction; the caller reports ``None`` for it, as vLLM does.
        """
        _check_logits(logits, len(target_ids))
        if top_n < 0:
            raise ValueError(f"prompt_logprobs={top_n} must be >= 0")
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        targets = torch.tensor(target_ids, dtype=torch.long, device=logits.device)
        return _logprob_dicts(logprobs, targets, [top_n] * len(target_ids))


def _modifies_logits(p: SamplingParams) -> bool:
    return bool(
        p.logit_bias
        or p.min_tokens
        or p.repetition_penalty != 1.0
        or p.presence_penalty
        or p.frequency_penalty
    )


def _check_logits(logits: torch.Tensor, num_rows: int) -> None:
    if logits.dim() != 2 or logits.shape[0] != num_rows:
        raise ValueError(
            f"logits have shape {tuple(logits.shape)}; expected [{num_rows}, vocab_size], "
            f"one row per sequence in the sampling metadata"
        )


# ---- logits processors (in place) ----


def apply_grammar_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """-inf for every token a constrained row's bitmask leaves out (rows of all ones: untouched)."""
    rows = (bitmask != -1).any(dim=1).nonzero().squeeze(1)
    if len(rows) == 0:
        return logits
    shifts = torch.arange(32, dtype=torch.int32)
    bits = (bitmask[rows].unsqueeze(-1) >> shifts) & 1  # [R, W, 32], token t at (t // 32, t % 32)
    allowed = bits.view(len(rows), -1)[:, : logits.shape[1]].bool().to(logits.device)
    if allowed.shape[1] < logits.shape[1]:  # tokens past the mask's vocabulary
        pad = torch.zeros(len(rows), logits.shape[1] - allowed.shape[1], dtype=torch.bool)
        allowed = torch.cat([allowed, pad.to(logits.device)], dim=1)
    rows = rows.to(logits.device)
    logits[rows] = logits[rows].masked_fill(~allowed, -torch.inf)
    return logits


def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    rows, cols, vals = [], [], []
    for i, p in enumerate(params):
        for token_id, bias in (p.logit_bias or {}).items():
            rows.append(i)
            cols.append(int(token_id))
            vals.append(float(bias))
    if not rows:
        return
    _check_token_ids(cols, logits.shape[1], "logit_bias")
    index = (_long(rows, logits), _long(cols, logits))
    logits.index_put_(index, torch.tensor(vals, device=logits.device), accumulate=True)


def apply_min_tokens(logits: torch.Tensor, meta: SamplingMetadata) -> None:
    """While fewer than ``min_tokens`` are generated, no stop token may be drawn."""
    rows, cols = [], []
    for i, p in enumerate(meta.params):
        if len(meta.output_token_ids[i]) >= p.min_tokens:
            continue
        blocked = set(p.stop_token_ids) | (set() if p.ignore_eos else set(meta.eos_token_ids[i]))
        rows.extend([i] * len(blocked))
        cols.extend(blocked)
    if rows:
        _check_token_ids(cols, logits.shape[1], "stop_token_ids")
        logits[_long(rows, logits), _long(cols, logits)] = float("-inf")


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> None:
    """Repetition over prompt + output (positive logits divided, negative multiplied);
    frequency and presence over output only, subtracted (OpenAI's formula)."""
    params = meta.params
    # decided in Python, so that a step without penalties (most) builds no tensor for them
    use_rep = any(p.repetition_penalty != 1.0 for p in params)
    use_freq_pres = any(p.frequency_penalty or p.presence_penalty for p in params)
    if not (use_rep or use_freq_pres):
        return
    vocab_size = logits.shape[1]
    output_counts = token_counts(meta.output_token_ids, vocab_size, logits.device)
    if use_rep:
        prompt_counts = token_counts(meta.prompt_token_ids, vocab_size, logits.device)
        seen = (prompt_counts + output_counts) > 0
        rep = _row_values(params, "repetition_penalty", logits).unsqueeze(1)
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits.copy_(torch.where(seen, penalized, logits))
    if use_freq_pres:
        freq = _row_values(params, "frequency_penalty", logits).unsqueeze(1)
        pres = _row_values(params, "presence_penalty", logits).unsqueeze(1)
        logits -= freq * output_counts
        logits -= pres * (output_counts > 0).float()


def token_counts(token_ids: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[B, V] occurrence counts, via scatter_add over a padded [B, L] id tensor (pad = V, dropped)."""
    lengths = torch.tensor([len(ids) for ids in token_ids], dtype=torch.long)
    max_len = max((len(ids) for ids in token_ids), default=0)
    padded = torch.full((len(token_ids), max_len), vocab_size, dtype=torch.long)
    for i, ids in enumerate(token_ids):
        padded[i, : len(ids)] = torch.as_tensor(ids, dtype=torch.long)
    real = torch.arange(padded.shape[1]) < lengths.unsqueeze(1)
    _check_token_ids(
        padded[real & ((padded < 0) | (padded >= vocab_size))].tolist(), vocab_size, "token id"
    )
    padded = padded.to(device)
    counts = torch.zeros(len(token_ids), vocab_size + 1, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab_size]


# ---- logprobs ----


def gather_logprobs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor | None:
    if all(p.logprobs is None for p in params):
        return None
    return torch.log_softmax(logits, dim=-1)


def build_logprob_dicts(
    logprobs: torch.Tensor | None, token_ids: torch.Tensor, params: list[SamplingParams]
) -> list[dict[int, float] | None]:
    if logprobs is None:
        return [None] * len(params)
    top_n = [p.logprobs or 0 for p in params]
    dicts = _logprob_dicts(logprobs, token_ids, top_n)
    return [d if p.logprobs is not None else None for d, p in zip(dicts, params, strict=True)]


def _logprob_dicts(
    logprobs: torch.Tensor, token_ids: torch.Tensor, top_n: list[int]
) -> list[dict[int, float]]:
    """The chosen token's logprob plus the top-N of each row (N per row, one topk for all)."""
    k = min(max(top_n, default=0), logprobs.shape[1])
    top_vals, top_ids = logprobs.topk(k, dim=-1)
    chosen = logprobs.gather(1, token_ids.view(-1, 1)).squeeze(1)
    chosen_ids, chosen_vals = token_ids.tolist(), chosen.tolist()
    top_ids, top_vals = top_ids.tolist(), top_vals.tolist()
    dicts = []
    for i, n in enumerate(top_n):
        d = {chosen_ids[i]: chosen_vals[i]}
        d.update(zip(top_ids[i][:n], top_vals[i][:n], strict=True))
        dicts.append(d)
    return dicts


# ---- speculative decoding ----


def verify_drafts(drafts: list[int], sampled: list[int]) -> int:
    """How many drafts a sequence accepts: the longest prefix of ``drafts`` equal to the tokens
    sampled at the rows before them (``sampled[j]`` was drawn at draft ``j``'s position, as if the
    drafts before it were output). The sequence then outputs ``sampled[: accepted + 1]``.

    Greedy: exactly the tokens one-at-a-time decoding gives, each the argmax after the same
    tokens. Sampled: this is the speculative-sampling rule (Leviathan et al.; vLLM's rejection
    sampler) for a draft that is one token with probability 1, as an n-gram draft is. That rule
    accepts draft ``d`` with probability ``min(1, p(d) / q(d)) = p(d)`` and otherwise draws from
    the residual ``max(p - q, 0)``, i.e. ``p`` without ``d``; so every token is emitted with
    probability ``p(token)``, which is what drawing from ``p`` and comparing with ``d`` does.
    The output is distributed as without speculation, each row's processing (temperature,
    top-k/p, min-p, penalties) included; its random draws are not the same ones, so a seeded
    request's tokens differ from its non-speculative ones (as in vLLM)."""
    num_accepted = 0
    for draft, token in zip(drafts, sampled):
        if draft != token:
            break
        num_accepted += 1
    return num_accepted


def accept_drafts(
    out: SamplerOutput, drafts: list[list[int]]
) -> list[tuple[list[int], list[dict[int, float]] | None]]:
    """Per sequence, the tokens it outputs and their logprobs: ``out`` has ``1 + len(d)`` rows
    for each sequence's drafts ``d``, in order (``verify_drafts``)."""
    results, at = [], 0
    for d in drafts:
        end = at + len(d) + 1
        sampled = out.sampled_token_ids[at:end]
        n = verify_drafts(d, sampled) + 1
        logprobs = out.logprobs[at : at + n]
        results.append((sampled[:n], None if logprobs[0] is None else logprobs))
        at = end
    return results


# ---- sampling ----


NUCLEUS_CANDIDATES = 1024


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    argmax: Callable[[torch.Tensor], torch.Tensor] = _row_argmax,
    categorical: Categorical | None = None,
) -> torch.Tensor:
    token_ids = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    if greedy_rows:
        token_ids[_long(greedy_rows, logits)] = argmax(_select_rows(logits, greedy_rows))
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if categorical is not None:  # the backend draws the rows that keep every candidate
        whole = [i for i in random_rows if _keeps_every_candidate(params[i])]
        if whole:
            # u = 0 (torch.rand gives it once in 2^24) would take the first token whose weight
            # is not exactly 0, and the native draw's exp gives every finite logit at least 1e-38:
            # half rand's smallest step above 0 still lands on the first token of real weight
            u = uniforms([generators[i] for i in whole], logits.device).clamp_(min=2**-25)
            temperature = _row_values([params[i] for i in whole], "temperature", logits)
            chosen = categorical(_select_rows(logits, whole), 1.0 / temperature, u)
            token_ids[_long(whole, logits)] = chosen
            random_rows = sorted(set(random_rows) - set(whole))
    if random_rows:
        scaled = _select_rows(logits, random_rows) / _row_values(
            [params[i] for i in random_rows], "temperature", logits
        ).unsqueeze(1)
        for rows, candidates, ids in candidate_groups(scaled, [params[i] for i in random_rows]):
            group = [random_rows[r] for r in rows]
            chosen = draw(candidates, [params[i] for i in group], [generators[i] for i in group])
            if ids is not None:
                chosen = ids.gather(1, chosen.unsqueeze(1)).squeeze(1)
            token_ids[_long(group, logits)] = chosen
    return token_ids


def _keeps_every_candidate(p: SamplingParams) -> bool:
    return p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0


def candidate_groups(
    logits: torch.Tensor, params: list[SamplingParams]
) -> list[tuple[list[int], torch.Tensor, torch.Tensor | None]]:
    """(rows, candidate logits, their token ids or None for id order), rows grouped by how their
    candidates are formed; top_k / top_p already applied (masked to -inf)."""
    plain = [i for i, p in enumerate(params) if p.top_k <= 0 and p.top_p >= 1.0]
    top_k = [i for i, p in enumerate(params) if p.top_k > 0]
    nucleus = [i for i, p in enumerate(params) if p.top_k <= 0 and p.top_p < 1.0]
    groups = []
    if plain:
        groups.append((plain, _select_rows(logits, plain), None))
    if top_k:
        rows = _select_rows(logits, top_k)
        k = min(max(params[i].top_k for i in top_k), logits.shape[1])
        values, ids = rows.topk(k, dim=-1)
        groups.append((top_k, apply_top_k_top_p(values, [params[i] for i in top_k]), ids))
    if nucleus:
        groups.extend(_nucleus_groups(logits, params, nucleus))
    return groups


def _nucleus_groups(logits: torch.Tensor, params: list[SamplingParams], rows: list[int]):
    """top_p without top_k: the largest candidates plus a column for the remaining mass, or a full
    sort for the rows whose nucleus reaches past them."""
    sub = _select_rows(logits, rows)
    row_params = [params[i] for i in rows]
    k = min(NUCLEUS_CANDIDATES, logits.shape[1])
    values, ids = sub.topk(k, dim=-1)
    log_mass = torch.logsumexp(values, -1) - torch.logsumexp(sub, -1)  # log P(top k)
    top_p = _row_values(row_params, "top_p", sub)
    fits = (log_mass.exp() >= top_p) & (k < logits.shape[1])
    groups = []
    fast = [j for j in range(len(rows)) if bool(fits[j])]
    if fast:
        f = _long(fast, sub)
        rest = torch.logsumexp(sub[f], -1) + torch.log1p(-log_mass[f].exp().clamp(max=1 - 1e-7))
        cands = torch.cat([values[f], rest.unsqueeze(1)], dim=1)
        cand_ids = torch.cat([ids[f], ids[f, :1]], dim=1)  # the rest column is never drawn
        masked = apply_top_k_top_p(cands, [row_params[j] for j in fast])
        groups.append(([rows[j] for j in fast], masked, cand_ids))
    slow = [j for j in range(len(rows)) if not bool(fits[j])]
    if slow:
        values, ids = sub[_long(slow, sub)].sort(dim=-1, descending=True)
        masked = apply_top_k_top_p(values, [row_params[j] for j in slow])
        groups.append(([rows[j] for j in slow], masked, ids))
    return groups


def apply_top_k_top_p(sorted_logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask (to -inf) everything outside the k largest and outside the top-p nucleus.

    Rows are sorted in descending order; the nucleus is taken over the top-k survivors, and the
    most likely token always stays: a top_p too small for the logits' dtype (5e-324 is 0 in
    float32) means "nearly greedy", not "nothing".
    """
    num_candidates = sorted_logits.shape[1]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else num_candidates for p in params])
    top_p = torch.tensor([p.top_p for p in params], dtype=sorted_logits.dtype)
    if bool((top_k >= num_candidates).all()) and bool((top_p >= 1.0).all()):
        return sorted_logits
    rank = torch.arange(num_candidates, device=sorted_logits.device)
    top_k = top_k.to(sorted_logits.device).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(rank >= top_k, -torch.inf)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    top_p = torch.where(top_p >= 1.0, torch.inf, top_p).to(sorted_logits.device).unsqueeze(1)
    return sorted_logits.masked_fill((mass_before >= top_p) & (rank > 0), -torch.inf)


def apply_min_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the most likely token's."""
    if not any(p.min_p > 0 for p in params):
        return logits
    min_p = _row_values(params, "min_p", logits)
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, -torch.inf)


def draw(
    candidates: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """One candidate index per row with P(j) = softmax(candidates)[j], by inverse CDF."""
    logits = apply_min_p(candidates, params)
    weights = (logits - logits.amax(dim=-1, keepdim=True)).exp_()  # softmax before its division
    index = inverse_cdf(weights, uniforms(generators, weights.device))
    # the index found has weight > 0; in the rare row where rounding at the very top of a block's
    # range lands past its last token, take the row's most likely candidate
    missed = weights.gather(1, index.unsqueeze(1)).squeeze(1) == 0
    if bool(missed.any()):
        index = torch.where(missed, weights.argmax(dim=-1), index)
    return index


def uniforms(generators: list[torch.Generator | None], device: torch.device) -> torch.Tensor:
    """One number uniform in [0, 1) per row, from the row's own generator where it has one."""
    u = torch.rand(len(generators), device=device)
    for i, g in enumerate(generators):
        if g is not None:  # into the row: an assignment would cost a copy
            torch.rand(1, generator=g, out=u[i : i + 1])
    return u


CDF_BLOCK = 1024


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor, block: int = CDF_BLOCK) -> torch.Tensor:
    """Per row, the first index whose cumulative weight exceeds ``u`` times the row's total.

    In two short scans instead of one over the whole row: the cumulative sums of blocks of
    ``block`` weights find the block, then a cumulative sum within that block finds the index.
    A cumulative sum is a serial scan (151552 floats took 175-270 us here) where a block sum is
    vectorized (20 us for the same row), and the blocks' sums also round less than one long scan.
    """
    rows, n = weights.shape
    block = min(block, n)
    full = n // block * block
    sums = weights[:, :full].reshape(rows, -1, block).sum(dim=-1)
    if full < n:
        sums = torch.cat([sums, weights[:, full:].sum(dim=-1, keepdim=True)], dim=1)
    block_cdf = sums.cumsum(dim=-1)
    target = u.unsqueeze(1) * block_cdf[:, -1:]
    chosen = torch.searchsorted(block_cdf, target, right=True).clamp_(max=sums.shape[1] - 1)
    before = torch.where(chosen > 0, block_cdf.gather(1, (chosen - 1).clamp(min=0)), 0.0)
    cols = chosen * block + torch.arange(block, device=weights.device)  # the chosen block's
    segment = weights.gather(1, cols.clamp(max=n - 1)).masked_fill_(cols >= n, 0.0)
    within = torch.searchsorted(segment.cumsum(dim=-1), target - before, right=True)
    # within a last block shorter than ``block`` (a row of NaN weights finds no crossing): its end
    return (cols[:, :1] + within.clamp_(max=block - 1)).clamp_(max=n - 1).squeeze(1)


# ---- helpers ----


def _row_values(params: list[SamplingParams], name: str, like: torch.Tensor) -> torch.Tensor:
    values = [float(getattr(p, name)) for p in params]
    return torch.tensor(values, dtype=like.dtype, device=like.device)


def _select_rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    if len(rows) == logits.shape[0]:
        return logits
    return logits[_long(rows, logits)]


def _long(values: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=like.device)


def _check_token_ids(token_ids: list[int], vocab_size: int, what: str) -> None:
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"{what} refers to token id {bad[0]}, outside this model's vocabulary "
            f"[0, {vocab_size}); use ids below {vocab_size}"
        )
