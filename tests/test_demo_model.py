"""The shipped demo model: a real (tiny) GLM-4-0414 checkpoint that transformers loads and that
models held-out Python help text better than a fixed bar (a regression guard on the shipped weights).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import sys
from pathlib import Path

import jinja2
import pytest
import torch
from tokenizers import Tokenizer

from pagedserve.models.tokenizer import SPECIAL_TOKENS, STOP_TOKENS
from pagedserve.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
DEMO_DIR = ROOT / "pagedserve" / "demo_model"
SPECIALS = list(SPECIAL_TOKENS)
STOPS = list(STOP_TOKENS)

# tools/train_demo.py measured 1.4549 bits/char on this slice with the shipped bf16 weights
# (metrics.json "test_slice_bits_per_char"); the bar adds a margin of 0.045. For scale: on the whole
# held-out text the model scores 1.73 and an add-one unigram over the same tokens 2.94.
HELDOUT_SLICE_CHARS = 4000
MAX_HELDOUT_BITS_PER_CHAR = 1.50


@functools.cache
def _train_demo():
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
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(DEMO_DIR / "tokenizer.json"))


def _hf_greedy(model, prompt_ids: list[int], max_tokens: int) -> list[int]:
    ids = list(prompt_ids)
    with torch.inference_mode():
        for _ in range(max_tokens):
            logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt_ids) :]


def test_demo_model_is_a_small_glm4_checkpoint_with_glm4_stop_tokens(tokenizer):
    config = json.loads((DEMO_DIR / "config.json").read_text())
    vocab = tokenizer.get_vocab_size()
    assert config["model_type"] == "glm4"
    assert config["vocab_size"] == vocab
    assert config["eos_token_id"] == [tokenizer.token_to_id(t) for t in STOPS]
    assert config["pad_token_id"] == tokenizer.token_to_id("<|endoftext|>")
    total = sum(f.stat().st_size for f in DEMO_DIR.iterdir())
    assert total < 20 * 2**20, f"demo model directory is {total} bytes; the limit is 20 MiB"


def test_demo_model_beats_the_recorded_heldout_bits_per_char(hf_model, tokenizer):
    train_demo = _train_demo()
    text = train_demo.heldout_text()
    assert len(text) >= HELDOUT_SLICE_CHARS
    bpc = train_demo.bits_per_char(hf_model, tokenizer, text, HELDOUT_SLICE_CHARS)
    assert bpc < MAX_HELDOUT_BITS_PER_CHAR, (
        f"held-out bits/char {bpc:.4f} exceeds {MAX_HELDOUT_BITS_PER_CHAR}"
    )


def test_heldout_bits_per_char_matches_a_direct_cross_entropy(hf_model, tokenizer):
    text = "def add(a, b):\n    return a + b\n"
    eos = tokenizer.token_to_id("<|endoftext|>")
    ids = torch.tensor([[eos] + tokenizer.encode(text).ids])
    with torch.inference_mode():
        logits = hf_model(input_ids=ids[:, :-1]).logits[0]
    nats = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum").item()
    expected = nats / torch.log(torch.tensor(2.0)).item() / len(text)
    assert _train_demo().bits_per_char(hf_model, tokenizer, text) == pytest.approx(
        expected, rel=1e-4
    )


def test_tokenizer_round_trips_text_and_adds_no_special_tokens(tokenizer):
    text = "def f(x):\n    return {'π': x ** 2}  # naïve — ok\n\tlambda: None\n"
    ids = tokenizer.encode(text).ids
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    assert not set(ids) & {tokenizer.token_to_id(t) for t in SPECIALS}


def test_special_tokens_are_single_ids_at_the_end_of_the_vocabulary(tokenizer):
    vocab = tokenizer.get_vocab_size()
    ids = [tokenizer.token_to_id(t) for t in SPECIALS]
    assert ids == list(range(vocab - len(SPECIALS), vocab))
    assert tokenizer.encode("[gMASK]<sop><|user|>\nhi").ids[:3] == [ids[2], ids[4], ids[7]]


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


def test_pagedserve_greedy_generation_matches_transformers(hf_model, tokenizer):
    try:
        from pagedserve import LLM
    except ImportError as e:
        pytest.skip(f"pagedserve.LLM is not importable yet: {e}")
    llm = LLM(model=str(DEMO_DIR), dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [
        "def ",
        "[gMASK]<sop><|user|>\nWhat does the return statement do?<|assistant|>\n",
    ]
    for prompt, output in zip(prompts, llm.generate(prompts, params), strict=True):
        prompt_ids = list(output.prompt_token_ids)
        assert prompt_ids[-len(tokenizer.encode(prompt).ids) :] == tokenizer.encode(prompt).ids
        expected = _hf_greedy(hf_model, prompt_ids, 16)
        assert list(output.outputs[0].token_ids) == expected, prompt
