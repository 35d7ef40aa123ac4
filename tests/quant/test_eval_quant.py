"""eval-quant: the metrics against hand computations and brute force, and the command end to end."""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random

import pytest

from pagedserve.entrypoints.cli.quantize import (
    add_eval_quant_args,
    add_quantize_args,
    run_eval_quant,
    run_quantize,
)
from pagedserve.quant.evaluate import bleu, lcs_length, rouge_l
from tests.helpers.models import build_tiny_hf_model, build_tiny_tokenizer

KEYS = {
    "ppl_reference",
    "ppl_candidate",
    "ppl_increase_pct",
    "top1_agreement",
    "mean_kl",
    "bleu",
    "rouge_l",
    "passed",
}


def brute_force_lcs(a, b):
    for n in range(min(len(a), len(b)), 0, -1):
        subs = set(itertools.combinations(b, n))
        if any(c in subs for c in itertools.combinations(a, n)):
            return n
    return 0


def test_lcs_matches_brute_force():
    rng = random.Random(0)
    for _ in range(200):
        a = [rng.randrange(4) for _ in range(rng.randrange(0, 8))]
        b = [rng.randrange(4) for _ in range(rng.randrange(0, 8))]
        assert lcs_length(a, b) == brute_force_lcs(a, b), (a, b)


def test_rouge_l_f1_by_hand():
    assert rouge_l([[1, 2, 3, 4]], [[1, 2, 3, 4]]) == 1.0
    assert rouge_l([[5, 6]], [[1, 2]]) == 0.0
    # LCS([1,2,9,3], [1,2,3,4,5]) = 3: P = 3/4, R = 3/5
    assert rouge_l([[1, 2, 9, 3]], [[1, 2, 3, 4, 5]]) == pytest.approx(2 * 0.75 * 0.6 / 1.35)


def test_bleu_by_hand():
    assert bleu([[1, 2, 3, 4, 5]], [[1, 2, 3, 4, 5]]) == pytest.approx(1.0)
    assert bleu([[7, 8, 9]], [[1, 2, 3]]) == 0.0
    # cand 1 2 3 4 vs ref 1 2 3 5 6: p1 3/4; p2 (2+1)/(3+1); p3 (1+1)/(2+1); p4 (0+1)/(1+1)
    p = [3 / 4, 3 / 4, 2 / 3, 1 / 2]
    expected = math.exp(1 - 5 / 4) * math.exp(sum(map(math.log, p)) / 4)
    assert bleu([[1, 2, 3, 4]], [[1, 2, 3, 5, 6]]) == pytest.approx(expected)


def eval_args(ref, cand, tmp_path, *extra):
    return add_eval_quant_args(argparse.ArgumentParser()).parse_args(
        [
            "--reference",
            str(ref),
            "--candidate",
            str(cand),
            "--num-samples",
            "3",
            "--seq-len",
            "48",
            "--max-tokens",
            "8",
            "--prompt-len",
            "8",
            "--json",
            str(tmp_path / "e.json"),
            *extra,
        ]
    )


@pytest.fixture(scope="module")
def quantized_models(tmp_path_factory):
    d = tmp_path_factory.mktemp("eval")
    build_tiny_hf_model(d / "ref", "glm4")
    build_tiny_tokenizer(d / "ref")
    for abits in ("16", "8"):
        run_quantize(
            add_quantize_args(argparse.ArgumentParser()).parse_args(
                [
                    "--model",
                    str(d / "ref"),
                    "--output",
                    str(d / f"w4a{abits}"),
                    "--abits",
                    abits,
                    "--calib-samples",
                    "4",
                    "--calib-seq-len",
                    "64",
                ]
            )
        )
    return d


def test_a_model_against_itself_is_perfect(quantized_models, tmp_path, capsys):
    assert (
        run_eval_quant(eval_args(quantized_models / "ref", quantized_models / "ref", tmp_path)) == 0
    )
    r = json.loads((tmp_path / "e.json").read_text())
    assert KEYS <= r.keys()
    assert r["ppl_increase_pct"] == pytest.approx(0.0, abs=1e-9)
    assert r["mean_kl"] == pytest.approx(0.0, abs=1e-9)
    assert r["top1_agreement"] == 1.0 and r["bleu"] == pytest.approx(1.0) and r["rouge_l"] == 1.0
    assert r["passed"] and "PASS" in capsys.readouterr().out


def test_quantized_candidate_differs_and_the_threshold_decides(quantized_models, tmp_path):
    args = eval_args(
        quantized_models / "ref", quantized_models / "w4a16", tmp_path, "--max-loss-pct", "-100"
    )
    assert run_eval_quant(args) == 1
    r = json.loads((tmp_path / "e.json").read_text())
    assert r["mean_kl"] > 0 and not r["passed"]
    assert r["act_bits"] == 16


def test_w4a8_is_read_from_the_config_and_costs_more_kl(quantized_models, tmp_path):
    run_eval_quant(eval_args(quantized_models / "ref", quantized_models / "w4a8", tmp_path))
    a8 = json.loads((tmp_path / "e.json").read_text())
    run_eval_quant(
        eval_args(quantized_models / "ref", quantized_models / "w4a8", tmp_path, "--abits", "16")
    )
    a16 = json.loads((tmp_path / "e.json").read_text())
    assert a8["act_bits"] == 8 and a16["act_bits"] == 16
    assert a8["mean_kl"] > a16["mean_kl"]


def test_text_data_needs_a_tokenizer(tmp_path):
    build_tiny_hf_model(tmp_path / "m", "glm")
    (tmp_path / "t.txt").write_text("hello " * 200)
    with pytest.raises(ValueError, match="no tokenizer.json"):
        run_eval_quant(
            eval_args(tmp_path / "m", tmp_path / "m", tmp_path, "--data", str(tmp_path / "t.txt"))
        )


def test_llm_generator_gives_the_same_continuations_as_the_reference_forward(
    quantized_models, tmp_path
):
    """pagedserve's engine (INT4 kernel, bf16 activations) and the fp32 reference forward on the
    same dequantized weights agree on greedy continuations, so BLEU/ROUGE do not depend on it."""
    run_eval_quant(
        eval_args(
            quantized_models / "ref", quantized_models / "w4a16", tmp_path, "--generator", "llm"
        )
    )
    via_llm = json.loads((tmp_path / "e.json").read_text())
    run_eval_quant(eval_args(quantized_models / "ref", quantized_models / "w4a16", tmp_path))
    via_reference = json.loads((tmp_path / "e.json").read_text())
    assert via_llm["mean_kl"] == via_reference["mean_kl"]  # distributions: always the reference
    assert via_llm["rouge_l"] == pytest.approx(via_reference["rouge_l"], abs=0.25)
    assert via_llm["rouge_l"] > 0.3


def test_an_int8_kv_cache_is_judged_against_the_16_bit_cache_of_the_same_model(
    quantized_models, tmp_path
):
    """The KV row: the candidate is the reference itself, its keys and values rounded to INT8
    as the cache stores them; it differs a little and the bar decides."""
    ref = quantized_models / "ref"
    run_eval_quant(eval_args(ref, ref, tmp_path, "--kv-cache-dtype", "int8"))
    kv = json.loads((tmp_path / "e.json").read_text())
    assert kv["kv_cache_dtype"] == "int8" and 0 < kv["mean_kl"] < 1e-2
    assert kv["top1_agreement"] > 0.9
    run_eval_quant(eval_args(ref, ref, tmp_path, "--kv-cache-dtype", "int8", "--generator", "llm"))
    via_llm = json.loads((tmp_path / "e.json").read_text())
    assert via_llm["mean_kl"] == kv["mean_kl"] and via_llm["rouge_l"] > 0.3
