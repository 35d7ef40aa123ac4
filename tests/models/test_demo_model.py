"""The shipped demo model: a real (tiny) GLM-4-0414 checkpoint that transformers loads, that models
held-out CPython text and English prose as well as its training run recorded (metrics.json) and
within the bars set for it, that fits the package's budget, and whose INT4 variant passes the
golden standard against it.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import sys
from pathlib import Path

import jinja2
import pytest
import torch
from tokenizers import Tokenizer

from pagedserve.models.tokenizer import SPECIAL_TOKENS, STOP_TOKENS
from pagedserve.sampling_params import SamplingParams
from tests.helpers.tools import require_module

transformers = require_module("transformers", "a test extra: pip install -e '.[test]'")

ROOT = Path(__file__).resolve().parents[2]
DEMO_DIR = ROOT / "pagedserve" / "demo_model"
PROSE_FILE = ROOT / "pagedserve" / "data" / "demo_heldout_prose.txt"
SPECIALS = list(SPECIAL_TOKENS)
STOPS = list(STOP_TOKENS)

METRICS = json.loads((DEMO_DIR / "metrics.json").read_text())
# tools/train_demo.py measured the shipped bf16 weights on this slice of the held-out text
# (metrics.json "test_slice_bits_per_char"); loading them again must give the same figure.
HELDOUT_SLICE_CHARS = METRICS["test_slice_chars"]
BITS_PER_CHAR_TOLERANCE = 0.002
PACKAGE_BUDGET_BYTES = 25 * 10**6
# the bars it must meet on text it never saw: its own domain (CPython), and English prose
CPYTHON_BITS_PER_CHAR_BOUND = 1.35
PROSE_BITS_PER_CHAR_BOUND = 1.45


@functools.cache
def _train_demo():
    sys.path.insert(0, str(ROOT / "tools"))  # as `python tools/train_demo.py` has: demo_corpus
    spec = importlib.util.spec_from_file_location("train_demo", ROOT / "tools" / "train_demo.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def hf_model():
    torch.set_num_threads(1)
    return transformers.Glm4ForCausalLM.from_pretrained(DEMO_DIR, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def demo_tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(DEMO_DIR / "tokenizer.json"))


def _hf_greedy(model, prompt_ids: list[int], max_tokens: int) -> list[int]:
    ids = list(prompt_ids)
    with torch.inference_mode():
        for _ in range(max_tokens):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt_ids) :]


def test_demo_model_is_a_small_glm4_checkpoint_with_glm4_stop_tokens(demo_tokenizer):
    config = json.loads((DEMO_DIR / "config.json").read_text())
    vocab = demo_tokenizer.get_vocab_size()
    assert config["model_type"] == "glm4"
    assert config["vocab_size"] == vocab
    assert config["eos_token_id"] == [demo_tokenizer.token_to_id(t) for t in STOPS]
    assert config["pad_token_id"] == demo_tokenizer.token_to_id("<|endoftext|>")


def test_demo_model_and_its_heldout_text_fit_the_package_budget():
    shipped = [*DEMO_DIR.iterdir(), *_train_demo().HELDOUT_FILES.values()]
    total = sum(f.stat().st_size for f in shipped)
    assert total < PACKAGE_BUDGET_BYTES, f"the demo model ships {total} bytes; the budget is 25 MB"


@pytest.mark.parametrize(
    "name,recorded",
    [("cpython", "test_slice_bits_per_char"), ("prose", "test_prose_slice_bits_per_char")],
)
def test_demo_model_scores_the_recorded_heldout_bits_per_char(
    hf_model, demo_tokenizer, name, recorded
):
    train_demo = _train_demo()
    text = train_demo.heldout_text(train_demo.HELDOUT_FILES[name])
    assert len(text) >= HELDOUT_SLICE_CHARS
    bpc = train_demo.bits_per_char(hf_model, demo_tokenizer, text, HELDOUT_SLICE_CHARS)
    assert bpc == pytest.approx(METRICS[recorded], abs=BITS_PER_CHAR_TOLERANCE)


def test_the_recorded_heldout_figures_meet_their_bars():
    assert METRICS["heldout_bits_per_char"] < METRICS["unigram_bits_per_char"]
    assert METRICS["heldout_bits_per_char"] <= CPYTHON_BITS_PER_CHAR_BOUND
    assert METRICS["heldout_prose_bits_per_char"] <= PROSE_BITS_PER_CHAR_BOUND
    assert METRICS["heldout_prose_chars"] == len(_train_demo().heldout_text(PROSE_FILE))


def test_chat_bits_per_char_scores_the_answer_given_its_question(hf_model, demo_tokenizer):
    row = {"question": "What is a list?", "answer": "A mutable sequence."}
    prompt = demo_tokenizer.encode(f"[gMASK]<sop><|user|>\n{row['question']}<|assistant|>\n").ids
    answer = demo_tokenizer.encode(row["answer"]).ids
    ids = torch.tensor([prompt + answer])
    with torch.inference_mode():
        logits = hf_model(input_ids=ids[:, :-1]).logits[0, len(prompt) - 1 :]
    nats = torch.nn.functional.cross_entropy(logits, ids[0, len(prompt) :], reduction="sum")
    expected = nats.item() / math.log(2) / len(row["answer"])
    assert _train_demo().chat_bits_per_char(hf_model, demo_tokenizer, [row]) == pytest.approx(
        expected, rel=1e-4
    )


def test_heldout_bits_per_char_matches_a_direct_cross_entropy(hf_model, demo_tokenizer):
    text = "def add(a, b):\n    return a + b\n"
    eos = demo_tokenizer.token_to_id("<|endoftext|>")
    ids = torch.tensor([[eos] + demo_tokenizer.encode(text).ids])
    with torch.inference_mode():
        logits = hf_model(input_ids=ids[:, :-1]).logits[0]
    nats = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
    expected = nats / torch.log(torch.tensor(2.0)).item() / len(text)
    assert _train_demo().bits_per_char(hf_model, demo_tokenizer, text) == pytest.approx(
        expected, rel=1e-4
    )


def test_tokenizer_round_trips_text_and_adds_no_special_tokens(demo_tokenizer):
    text = "def f(x):\n    return {'π': x ** 2}  # naïve — ok\n\tlambda: None\n"
    ids = demo_tokenizer.encode(text).ids
    assert demo_tokenizer.decode(ids, skip_special_tokens=False) == text
    assert not set(ids) & {demo_tokenizer.token_to_id(t) for t in SPECIALS}


def test_special_tokens_are_single_ids_at_the_end_of_the_vocabulary(demo_tokenizer):
    vocab = demo_tokenizer.get_vocab_size()
    ids = [demo_tokenizer.token_to_id(t) for t in SPECIALS]
    assert ids == list(range(vocab - len(SPECIALS), vocab))
    assert demo_tokenizer.encode("[gMASK]<sop><|user|>\nhi").ids[:3] == [ids[2], ids[4], ids[7]]


def test_chat_template_starts_with_gmask_sop_and_opens_the_assistant_turn():
    hf_tok = transformers.AutoTokenizer.from_pretrained(DEMO_DIR)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What does the return statement do?"},
    ]
    text = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = (
        "[gMASK]<sop><|system|>\nBe brief.<|user|>\nWhat does the return statement do?"
        "<|assistant|>\n"
    )
    assert text == expected
    template = json.loads((DEMO_DIR / "tokenizer_config.json").read_text())["chat_template"]
    plain = jinja2.Environment().from_string(template)
    assert plain.render(messages=messages, add_generation_prompt=True) == expected
    assert plain.render(messages=messages, add_generation_prompt=False) == expected.removesuffix(
        "<|assistant|>\n"
    )
    assert _train_demo().CHAT_TEMPLATE == template  # a retraining writes the same template


def test_pagedserve_greedy_generation_matches_transformers(hf_model, demo_tokenizer):
    from pagedserve import LLM

    llm = LLM(model=str(DEMO_DIR), dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [
        "def ",
        "[gMASK]<sop><|user|>\nWhat does the return statement do?<|assistant|>\n",
    ]
    for prompt, output in zip(prompts, llm.generate(prompts, params), strict=True):
        prompt_ids = list(output.prompt_token_ids)
        assert (
            prompt_ids[-len(demo_tokenizer.encode(prompt).ids) :]
            == demo_tokenizer.encode(prompt).ids
        )
        expected = _hf_greedy(hf_model, prompt_ids, 16)
        assert list(output.outputs[0].token_ids) == expected, prompt


def test_the_int4_variant_passes_the_golden_standard_against_the_demo_model(tmp_path):
    """`--quantization int4` rounds every linear to nearest in groups of 32 at load;
    `pagedserve quantize --quant-method rtn` writes those weights, and eval-quant compares them with
    the 16-bit model on the held-out text: PASS is a perplexity at most 0.5 % higher."""
    from pagedserve.entrypoints.cli.quantize import (
        add_eval_quant_args,
        add_quantize_args,
        run_eval_quant,
        run_quantize,
    )

    candidate, report = tmp_path / "int4", tmp_path / "eval.json"
    quantize = ["--model-path", "demo", "--output-path", str(candidate), "--quant-method", "rtn"]
    quantize += ["--calib-samples", "2", "--calib-seq-len", "64"]  # RTN uses them for its report
    assert run_quantize(add_quantize_args(argparse.ArgumentParser()).parse_args(quantize)) == 0
    evaluate = ["--reference", "demo", "--candidate", str(candidate), "--json", str(report)]
    verdict = run_eval_quant(add_eval_quant_args(argparse.ArgumentParser()).parse_args(evaluate))
    result = json.loads(report.read_text())
    assert verdict == 0 and result["passed"], result
    assert result["mean_kl"] > 0 and result["max_loss_pct"] == 0.5  # it differs, within the bar


def test_the_schedule_warms_up_holds_the_peak_then_decays_linearly_to_zero():
    schedule = _train_demo().Schedule.for_steps(1e-3, warmup=10, steps=100, decay_steps=20)
    assert schedule.lr(0) == pytest.approx(1e-4) and schedule.lr(9) == pytest.approx(1e-3)
    assert schedule.lr(50) == schedule.lr(80) == 1e-3
    assert schedule.lr(90) == pytest.approx(0.5e-3) and schedule.lr(100) == 0


def test_a_minutes_budget_gives_the_decay_the_rest_of_the_budget_at_the_measured_pace():
    train_demo = _train_demo()
    schedule = train_demo.Schedule(1e-3, warmup=10)
    assert schedule.lr(500) == 1e-3  # no end yet: the stable phase lasts
    train_demo._start_decay(schedule, train_demo.Progress(step=80, seconds=40.0), 50.0, 0.2)
    assert (schedule.decay_start, schedule.total) == (80, 100)  # 10 s left at 0.5 s a step


def test_a_resumed_run_has_the_model_optimizer_and_batches_it_was_saved_with(tmp_path):
    from tokenizers import models

    train_demo = _train_demo()
    path = tmp_path / "ck.pt"

    def run():
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        return model, torch.optim.AdamW(model.parameters()), torch.Generator().manual_seed(1)

    model, optimizer, gen = run()
    model(torch.randn(2, 4, generator=gen)).sum().backward()
    optimizer.step()
    schedule = train_demo.Schedule(1e-3, 10, total=100, decay_start=80)
    progress = train_demo.Progress(step=1, seconds=2.0, ema=3.0)
    train_demo.save_checkpoint(
        path, model, optimizer, gen, schedule, progress, Tokenizer(models.BPE())
    )
    expected_batch = torch.randn(2, 4, generator=gen)

    resumed, resumed_optimizer, resumed_gen = run()
    fresh = train_demo.Schedule(1e-3, 10)
    assert (
        train_demo.load_checkpoint(path, resumed, resumed_optimizer, resumed_gen, fresh) == progress
    )
    assert (fresh.total, fresh.decay_start) == (100, 80)
    assert torch.equal(resumed.weight, model.weight)
    assert resumed_optimizer.state_dict()["state"][0]["step"] == 1
    assert torch.equal(torch.randn(2, 4, generator=resumed_gen), expected_batch)


def test_a_continued_run_records_every_earlier_run_in_order_writing_where_the_next_read(tmp_path):
    train_demo = _train_demo()
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    run_1 = "python tools/train_demo.py --output pagedserve/demo_model --steps 10"
    run_2 = f"python tools/train_demo.py --output pagedserve/demo_model --init-from {first}"
    (first / "metrics.json").write_text(json.dumps({"command": run_1, "init_from": None}))
    # an older model recorded the run before it as one string
    (second / "metrics.json").write_text(json.dumps({"command": run_2, "init_from": run_1}))
    chain = train_demo._init_commands(second)
    assert chain == [run_1, run_2.replace("--output pagedserve/demo_model", f"--output {second}")]
    assert train_demo._init_commands(first) == [run_1.replace("pagedserve/demo_model", str(first))]
    lines = train_demo._init_lines({"init_from": chain})
    assert [line.strip() for line in lines if "train_demo.py" in line] == chain
    assert train_demo._init_lines({"init_from": []}) == []


def test_quantization_aware_training_computes_with_int4_and_ships_the_int4_grid(demo_tokenizer):
    """--qat: the decoder's linears compute with the weights `--quantization int4` would serve
    (bf16, then RTN in groups of 32), gradients reach the latent weights straight through, and
    the model written at the end carries those INT4 weights, so RTN at load gives them back."""
    from pagedserve.models.quant_formats import fake_quantize

    train_demo = _train_demo()
    torch.manual_seed(0)
    shape = train_demo.ModelShape(hidden_size=64, num_hidden_layers=1, intermediate_size=96)
    model = train_demo.build_model(shape, demo_tokenizer)
    linears = train_demo.decoder_linears(model)
    assert len(linears) == 6 and model.lm_head not in linears  # q k v o gate_up down
    served = [fake_quantize(m.weight.detach().to(torch.bfloat16), 32) for m in linears]
    ids = torch.randint(0, 4000, (2, 16))

    train_demo.set_quantization_aware(model, 32)
    for m, w in zip(linears, served, strict=True):
        assert torch.equal(m.weight, w)  # what the forward pass computes with
    model(input_ids=ids).logits.sum().backward()
    latent = [m.parametrizations.weight.original for m in linears]
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in latent)

    train_demo.set_quantization_aware(model, None)
    for m, w in zip(linears, served, strict=True):
        assert not hasattr(m, "parametrizations") and torch.equal(m.weight, w)
    # what --quantization int4 serves from the weights as write_model_files stores them (bf16):
    # the trained INT4 weights within bf16's rounding, but for groups whose zero point falls on a
    # tie, where RTN (not idempotent there) shifts the grid by up to half a step
    back = [fake_quantize(m.weight.detach().to(torch.bfloat16), 32) for m in linears]
    close = sum(torch.isclose(b, w, rtol=2**-7, atol=0).sum().item() for b, w in zip(back, served))
    assert close / sum(w.numel() for w in served) > 0.98


def test_an_int8_kv_cache_passes_the_golden_standard_against_the_demo_model(tmp_path):
    """`--kv-cache-dtype int8` keeps each key and value as int8 codes and a scale per token and
    head; eval-quant's KV row reads them back so in the reference forward and compares with the
    16-bit cache on the held-out text (half of its blocks, to spare the suite): the same bar."""
    from pagedserve.entrypoints.cli.quantize import add_eval_quant_args, run_eval_quant

    report = tmp_path / "eval.json"
    evaluate = ["--reference", "demo", "--candidate", "demo", "--kv-cache-dtype", "int8"]
    evaluate += ["--num-samples", "8", "--json", str(report)]
    verdict = run_eval_quant(add_eval_quant_args(argparse.ArgumentParser()).parse_args(evaluate))
    result = json.loads(report.read_text())
    assert verdict == 0 and result["passed"] and result["kv_cache_dtype"] == "int8", result
    assert result["mean_kl"] > 0 and result["ppl_increase_pct"] <= 0.5
