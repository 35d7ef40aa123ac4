"""The golden standard: a quantized model against its 16-bit reference on the same held-out text
(the candidate's weights quantized, or its KV cache: ``kv_cache_dtype="int8"``).

Perplexity, top-1 agreement and KL come from full next-token distributions, so they are computed
with the fp32 reference forward (``quant/forward.py``) over each model's dequantized weights
(W4A8 emulated when the candidate's ``abits`` is 8). Greedy continuations (BLEU-4 / ROUGE-L of the
candidate's against the reference's) come from the same forward by default, or from pagedserve's
``LLM`` with ``generator="llm"``.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedserve.hal.int8 import quantize_int8
from pagedserve.models.config import load_config
from pagedserve.models.loader import load_state_dict
from pagedserve.models.quant_formats import dequantize, load_quantized_linears, quantize_rtn
from pagedserve.quant.forward import ReferenceGlm

DEFAULT_HELDOUT = Path(__file__).parent.parent / "data" / "demo_heldout.txt"


# ---- text-similarity metrics over token ids ------------------------------------------------------
def _ngrams(seq: list[int], n: int) -> Counter:
    return Counter(tuple(seq[i : i + n]) for i in range(len(seq) - n + 1))


def bleu(candidates: list[list[int]], references: list[list[int]], max_n: int = 4) -> float:
    """Corpus BLEU-max_n with brevity penalty; add-one smoothing for n > 1 (Lin & Och)."""
    matches, totals = [0] * max_n, [0] * max_n
    cand_len = ref_len = 0
    for cand, ref in zip(candidates, references, strict=True):
        cand_len, ref_len = cand_len + len(cand), ref_len + len(ref)
        for n in range(1, max_n + 1):
            c, r = _ngrams(cand, n), _ngrams(ref, n)
            matches[n - 1] += sum(min(k, r[g]) for g, k in c.items())
            totals[n - 1] += max(len(cand) - n + 1, 0)
    if cand_len == 0 or matches[0] == 0:
        return 0.0
    smooth = [0] + [1] * (max_n - 1)
    log_p = sum(
        math.log((m + s) / (t + s)) for m, t, s in zip(matches, totals, smooth, strict=True)
    )
    brevity = 1.0 if cand_len > ref_len else math.exp(1 - ref_len / cand_len)
    return brevity * math.exp(log_p / max_n)


def lcs_length(a: list[int], b: list[int]) -> int:
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l(candidates: list[list[int]], references: list[list[int]]) -> float:
    """Mean ROUGE-L F1 (LCS-based) over the pairs."""
    scores = []
    for cand, ref in zip(candidates, references, strict=True):
        lcs = lcs_length(cand, ref)
        if lcs == 0:
            scores.append(0.0)
            continue
        p, r = lcs / len(cand), lcs / len(ref)
        scores.append(2 * p * r / (p + r))
    return sum(scores) / max(len(scores), 1)


# ---- models ---------------------------------------------------------------------------------------
def load_reference_model(
    model_dir: str | Path,
    act_bits: int | None = None,
    lm_head: str | None = None,
    lm_head_group_size: int = 32,
    kv_cache_dtype: str = "auto",
) -> ReferenceGlm:
    """fp32 reference forward over a checkpoint, quantized linears dequantized; ``act_bits``
    defaults to the checkpoint's ``abits`` (16 when unquantized). ``lm_head`` ("int8", "int4")
    rounds lm_head as ``--quantize-lm-head`` does at load time; ``kv_cache_dtype`` "int8" rounds
    K and V as ``--kv-cache-dtype int8`` stores them."""
    config = load_config(model_dir)
    sd = load_state_dict(model_dir, config, torch.float32)
    qc = config.quantization_config
    quantized: set[str] = set()
    if qc:
        for prefix, layer in load_quantized_linears(sd, qc).items():
            sd[f"{prefix}.weight"] = dequantize(*layer)
            quantized.add(prefix.removeprefix("model.layers."))
    if lm_head not in (None, "none"):
        _round_trip_lm_head(sd, lm_head, lm_head_group_size)
        if lm_head == "int4":  # an INT4 lm_head takes its input as the decoder's INT4 linears do
            quantized.add("lm_head")
    if act_bits is None:
        act_bits = int(qc.get("abits", 16)) if qc else 16
    return ReferenceGlm(
        config, sd, act_bits=act_bits, quantized=quantized, kv_cache_dtype=kv_cache_dtype
    )


def _round_trip_lm_head(sd: dict[str, torch.Tensor], mode: str, group_size: int) -> None:
    weight = sd.get("lm_head.weight", sd["model.embed_tokens.weight"]).float()
    if mode == "int4":
        weight = dequantize(*quantize_rtn(weight, group_size), group_size)
    elif mode == "int8":
        codes, scales = quantize_int8(weight)
        weight = codes.float() * scales.unsqueeze(1)
    else:
        raise ValueError(f"--lm-head {mode!r}: use none, int8 or int4")
    sd["lm_head.weight"] = weight


@torch.no_grad()
def greedy_continuations(
    model: ReferenceGlm, prompts: torch.Tensor, max_tokens: int
) -> list[list[int]]:
    ids = prompts
    for _ in range(max_tokens):
        ids = torch.cat([ids, model.forward(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[:, prompts.shape[1] :].tolist()


@torch.no_grad()
def sample_blocks(model: ReferenceGlm, num_samples: int, seq_len: int, seed: int) -> torch.Tensor:
    """Held-out ids sampled from the reference model itself (temperature 1) for a model without a
    tokenizer: on uniformly random ids perplexity says nothing; on the model's own samples the
    expected perplexity increase of a candidate is its KL from the reference."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (num_samples, 1), generator=g)
    for _ in range(seq_len - 1):
        probs = torch.softmax(model.forward(ids)[:, -1], -1)
        ids = torch.cat([ids, torch.multinomial(probs, 1, generator=g)], dim=1)
    return ids


def llm_continuations(
    model_dir: str | Path,
    prompts: torch.Tensor,
    max_tokens: int,
    lm_head: str | None = None,
    kv_cache_dtype: str = "auto",
) -> list[list[int]]:
    from pagedserve.entrypoints.llm import LLM
    from pagedserve.sampling_params import SamplingParams

    llm = LLM(
        model=str(model_dir),
        dtype="float32",
        quantize_lm_head=lm_head,
        kv_cache_dtype=kv_cache_dtype,
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts.tolist()], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


# ---- the comparison -------------------------------------------------------------------------------
@dataclass
class EvalResult:
    ppl_reference: float
    ppl_candidate: float
    ppl_increase_pct: float
    top1_agreement: float
    mean_kl: float
    bleu: float
    rouge_l: float
    passed: bool
    max_loss_pct: float
    num_tokens: int
    act_bits: int
    kv_cache_dtype: str = "auto"

    def to_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def distribution_metrics(
    reference: ReferenceGlm, candidate: ReferenceGlm, blocks: torch.Tensor, batch_size: int = 4
) -> dict[str, float]:
    nll_r = nll_c = kl = agree = 0.0
    count = 0
    for start in range(0, blocks.shape[0], batch_size):
        ids = blocks[start : start + batch_size]
        lp_r = F.log_softmax(reference.forward(ids)[:, :-1], -1)
        lp_c = F.log_softmax(candidate.forward(ids)[:, :-1], -1)
        target = ids[:, 1:].unsqueeze(-1)
        nll_r -= lp_r.gather(-1, target).sum().item()
        nll_c -= lp_c.gather(-1, target).sum().item()
        kl += (lp_r.exp() * (lp_r - lp_c)).sum().item()
        agree += (lp_r.argmax(-1) == lp_c.argmax(-1)).sum().item()
        count += target.numel()
    return {
        "ppl_reference": math.exp(nll_r / count),
        "ppl_candidate": math.exp(nll_c / count),
        "mean_kl": kl / count,
        "top1_agreement": agree / count,
        "num_tokens": count,
    }


def evaluate(
    reference_dir: str | Path,
    candidate_dir: str | Path,
    blocks: torch.Tensor,
    max_loss_pct: float = 0.5,
    prompt_len: int = 32,
    max_tokens: int = 32,
    generator: str = "reference",
    act_bits: int | None = None,
    lm_head: str | None = None,
    kv_cache_dtype: str = "auto",
) -> EvalResult:
    reference = load_reference_model(reference_dir, act_bits=16)
    candidate = load_reference_model(
        candidate_dir, act_bits=act_bits, lm_head=lm_head, kv_cache_dtype=kv_cache_dtype
    )
    m = distribution_metrics(reference, candidate, blocks)
    prompts = blocks[:, : min(prompt_len, blocks.shape[1])]
    if generator == "llm":
        ref_out = llm_continuations(reference_dir, prompts, max_tokens)
        cand_out = llm_continuations(candidate_dir, prompts, max_tokens, lm_head, kv_cache_dtype)
    elif generator == "reference":
        ref_out = greedy_continuations(reference, prompts, max_tokens)
        cand_out = greedy_continuations(candidate, prompts, max_tokens)
    else:
        raise ValueError(f"generator {generator!r}: use 'reference' or 'llm'")
    increase = (m["ppl_candidate"] / m["ppl_reference"] - 1) * 100
    return EvalResult(
        ppl_reference=m["ppl_reference"],
        ppl_candidate=m["ppl_candidate"],
        ppl_increase_pct=increase,
        top1_agreement=m["top1_agreement"],
        mean_kl=m["mean_kl"],
        bleu=bleu(cand_out, ref_out),
        rouge_l=rouge_l(cand_out, ref_out),
        passed=increase <= max_loss_pct,
        max_loss_pct=max_loss_pct,
        num_tokens=int(m["num_tokens"]),
        act_bits=candidate.act_bits,
        kv_cache_dtype=kv_cache_dtype,
    )


def format_table(r: EvalResult) -> str:
    rows = [
        ("perplexity (reference)", f"{r.ppl_reference:.4f}"),
        ("perplexity (candidate)", f"{r.ppl_candidate:.4f}"),
        ("perplexity increase", f"{r.ppl_increase_pct:+.3f} %"),
        ("top-1 agreement", f"{r.top1_agreement * 100:.2f} %"),
        ("mean KL(ref || cand)", f"{r.mean_kl:.6f}"),
        ("BLEU-4 (greedy)", f"{r.bleu:.4f}"),
        ("ROUGE-L F1 (greedy)", f"{r.rouge_l:.4f}"),
        ("activations", f"{r.act_bits}-bit"),
        (
            "KV cache",
            "int8 + a scale per token and head" if r.kv_cache_dtype == "int8" else "16-bit",
        ),
        ("tokens scored", str(r.num_tokens)),
        ("verdict", f"{'PASS' if r.passed else 'FAIL'} (max loss {r.max_loss_pct} %)"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
