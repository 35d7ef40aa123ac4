"""`logprobs.text_offset` of /v1/completions: each token's start in the returned text (prompt +
completion with `echo`), never going back, so that `text[offset[i]:offset[i + 1]]` is token i's
text, as lm-eval-style clients read it."""

from __future__ import annotations

import json

import httpx
import pytest

NON_ASCII = "naïve café: 日本語のテキスト 🙂 ok"


def _complete(live_server, **body) -> dict:
    body = {"model": live_server.model, "temperature": 0, "logprobs": 1, **body}
    r = httpx.post(
        live_server.url + "/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {live_server.api_key}"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _tokenize(live_server, text: str) -> list[int]:
    r = httpx.post(
        live_server.url + "/tokenize",
        json={"prompt": text},
        headers={"Authorization": f"Bearer {live_server.api_key}"},
    )
    return r.json()["tokens"]


def _slices(text: str, offsets: list[int]) -> list[str]:
    assert offsets == sorted(offsets), f"offsets go back: {offsets}"
    assert 0 <= offsets[0] and offsets[-1] <= len(text)
    return [text[a:b] for a, b in zip(offsets, [*offsets[1:], len(text)], strict=True)]


def test_echoed_text_prompt_offsets_point_at_each_tokens_text(live_server):
    prompt = "def fibonacci(n):"
    choice = _complete(live_server, prompt=prompt, max_tokens=6, echo=True, ignore_eos=True)
    text, lp = choice["text"], choice["logprobs"]
    n_prompt = len(_tokenize(live_server, prompt))
    assert text.startswith(prompt) and len(lp["tokens"]) == n_prompt + 6
    slices = _slices(text, lp["text_offset"])
    assert "".join(slices) == text
    # the [gMASK]<sop> that the tokenizer puts before a text prompt is not in the echoed text
    assert lp["tokens"][:2] == ["[gMASK]", "<sop>"] and slices[:2] == ["", ""]
    assert slices[2:] == lp["tokens"][2:]
    assert lp["text_offset"][n_prompt] == len(prompt)  # where the completion starts


def test_echoed_token_id_prompt_offsets_cover_its_decoded_text(live_server):
    ids = _tokenize(live_server, "import os\nprint(os.getcwd())")
    choice = _complete(live_server, prompt=ids, max_tokens=4, echo=True, ignore_eos=True)
    text, lp = choice["text"], choice["logprobs"]
    assert text.startswith("[gMASK]<sop>import os")
    assert _slices(text, lp["text_offset"]) == lp["tokens"]


def test_offsets_over_multibyte_characters_never_go_back(live_server):
    choice = _complete(live_server, prompt=NON_ASCII, max_tokens=5, echo=True, ignore_eos=True)
    text, lp = choice["text"], choice["logprobs"]
    n_prompt = len(_tokenize(live_server, NON_ASCII))
    slices = _slices(text, lp["text_offset"])
    assert "".join(slices) == text and "".join(slices[:n_prompt]) == NON_ASCII
    # A token that is only part of a UTF-8 character decodes alone to U+FFFD and takes no room;
    # the one that completes the character takes all of it. Every other token is where it says.
    pairs = list(zip(slices[2:n_prompt], lp["tokens"][2:n_prompt], strict=True))
    partial = [s for s, t in pairs if "\ufffd" in t]
    assert partial and all(s == t for s, t in pairs if "\ufffd" not in t)
    assert "".join(partial) == "".join(c for c in NON_ASCII if not c.isascii())


@pytest.mark.parametrize("prompt", ["def fibonacci(n):", NON_ASCII])
def test_streamed_offsets_point_into_the_streamed_text(live_server, prompt):
    body = {
        "model": live_server.model,
        "prompt": prompt,
        "max_tokens": 12,
        "logprobs": 1,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
    }
    headers = {"Authorization": f"Bearer {live_server.api_key}"}
    text, tokens, offsets = "", [], []
    with httpx.stream("POST", live_server.url + "/v1/completions", json=body, headers=headers) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice["text"]
                tokens += choice["logprobs"]["tokens"]
                offsets += choice["logprobs"]["text_offset"]
    full = _complete(live_server, prompt=prompt, max_tokens=12, ignore_eos=True)
    assert text == full["text"] and tokens == full["logprobs"]["tokens"]
    assert offsets == full["logprobs"]["text_offset"]
    assert "".join(_slices(text, offsets)) == text
