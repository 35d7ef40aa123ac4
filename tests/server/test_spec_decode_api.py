"""`pagedserve serve --speculative-config`: completions (text, stop strings, logprobs, streaming)
as without speculation; the drafts' acceptance in /metrics under vLLM's names, in /device and in
`pagedserve smi`; a bad JSON is a CLI error naming the flag."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.entrypoints.cli.main import main
from tests.helpers.metrics import read_metrics

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
# an "edit this" prompt: the answer repeats it, so the drafts are accepted
PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef add("
STOP = " +"


@pytest.fixture(scope="module")
def spec_server(tiny_glm4):
    from pagedserve.testing import serve

    path = tiny_glm4[0]
    flags = [
        "--model", str(path), "--served-model-name", "tiny", "--dtype", "float32",
        "--block-size", "4", "--num-kv-pages", "256", "--max-model-len", "256",
        "--speculative-config", json.dumps(SPEC), "--log-level", "warning",
    ]  # fmt: skip
    with serve(*flags) as (_, url):
        yield url


@pytest.fixture(scope="module")
def reference(tiny_glm4):
    """The same model without speculation, in process."""
    return LLM(model=str(tiny_glm4[0]), dtype="float32", block_size=4, num_kv_pages=256)


def complete(url: str, **body) -> dict:
    body = {"model": "tiny", "prompt": PROMPT, "temperature": 0, **body}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_completions_with_drafts_equal_those_without(spec_server, reference):
    for body, params in [
        (dict(max_tokens=24, ignore_eos=True), dict(max_tokens=24, ignore_eos=True)),
        (dict(max_tokens=24, stop=[STOP]), dict(max_tokens=24, stop=[STOP])),
        (dict(max_tokens=9, logprobs=2), dict(max_tokens=9, logprobs=2)),
    ]:
        got = complete(spec_server, **body)
        want = reference.generate(PROMPT, SamplingParams(temperature=0, **params), use_tqdm=False)
        assert got["text"] == want[0].outputs[0].text, body
        assert got["finish_reason"] == want[0].outputs[0].finish_reason
        if "logprobs" in body:
            wanted = [
                lp[t] for lp, t in zip(want[0].outputs[0].logprobs, want[0].outputs[0].token_ids)
            ]
            assert got["logprobs"]["token_logprobs"] == pytest.approx(wanted, abs=1e-4)


def test_streamed_text_with_drafts_is_the_whole_text(spec_server):
    whole = complete(spec_server, max_tokens=24, ignore_eos=True)["text"]
    body = {"model": "tiny", "prompt": PROMPT, "temperature": 0, "max_tokens": 24}
    body |= {"ignore_eos": True, "stream": True}
    text = ""
    with httpx.stream("POST", spec_server + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    assert text == whole


def test_acceptance_shows_in_metrics_device_and_smi(spec_server, capsys):
    complete(spec_server, max_tokens=24, ignore_eos=True)
    m = read_metrics(spec_server)
    drafts = m["pagedserve:spec_decode_num_draft_tokens_total"]
    accepted = m["pagedserve:spec_decode_num_accepted_tokens_total"]
    steps = m["pagedserve:spec_decode_num_drafts_total"]
    assert 0 < accepted <= drafts and 0 < steps <= drafts
    per_pos = [
        m[f'pagedserve:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}']
        for i in range(4)
    ]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    assert m["pagedserve:spec_decode_draft_acceptance_rate"] == pytest.approx(accepted / drafts)
    assert m["pagedserve:spec_decode_mean_acceptance_length"] == pytest.approx(1 + accepted / steps)
    spec = httpx.get(spec_server + "/device", timeout=10).json()["speculative"]
    assert spec["method"] == "ngram" and spec["num_speculative_tokens"] == 4
    assert main(["smi", "--url", spec_server]) == 0
    assert "speculative ngram x4   acceptance " in capsys.readouterr().out


def test_a_bad_speculative_config_is_a_cli_error_naming_the_flag():
    cmd = [sys.executable, "-m", "pagedserve", "serve", "--speculative-config"]
    for value, message in [
        ("{nope", "not valid JSON"),
        ('{"num_speculative_tokens": 0}', "greater than or equal to 1"),
    ]:
        r = subprocess.run([*cmd, value], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2
        assert "argument --speculative-config:" in r.stderr and message in r.stderr, r.stderr
