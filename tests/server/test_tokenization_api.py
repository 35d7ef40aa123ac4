"""``POST /tokenize`` and ``/detokenize`` in this process on the demo model (FastAPI's TestClient,
no socket, no engine loop: neither route reaches the engine core): the ids and the prompt are the
tokenizer's and its chat template's own, with or without the generation prompt, the tools and the
special tokens; an id is refused only outside [0, vocab). Each test builds its own app (the
router is made with the app), fast enough for mutation testing of tokenization.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers.apps import AUTH, demo_engine, served

CHAT = [{"role": "user", "content": "Hi"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


@pytest.fixture(scope="module")
def engine():
    return demo_engine()


@pytest.fixture
def client(engine) -> Iterator:
    with served(engine, started=False) as c:
        yield c


@pytest.fixture
def tokenizer(engine):
    return engine.tokenizer


def tokenize(client, **body) -> dict:
    r = client.post("/tokenize", json=body, headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_messages_are_rendered_as_the_chat_template_renders_them(
    client, tokenizer, add_generation_prompt
):
    body = tokenize(client, messages=CHAT, add_generation_prompt=add_generation_prompt)
    text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=add_generation_prompt)
    assert body["prompt"] == text
    assert body["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert body["prompt"].endswith("<|assistant|>\n") == add_generation_prompt


def test_messages_are_rendered_with_the_generation_prompt_by_default(client, tokenizer):
    body = tokenize(client, messages=CHAT)
    assert body["prompt"] == tokenizer.apply_chat_template(CHAT, add_generation_prompt=True)


def test_the_tools_sent_are_in_the_prompt_the_template_makes(client, tokenizer):
    body = tokenize(client, messages=CHAT, tools=TOOLS)
    text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tools=TOOLS)
    assert "get_weather" in body["prompt"]
    assert body["prompt"] == text
    assert body["tokens"] == tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_a_prompt_gets_the_special_prefix_only_when_asked(client, tokenizer, add_special_tokens):
    body = tokenize(client, prompt="Hello world", add_special_tokens=add_special_tokens)
    assert body["tokens"] == tokenizer.encode("Hello world", add_special_tokens)
    prefix = tokenizer.prompt_prefix_ids
    assert (body["tokens"][: len(prefix)] == prefix) == add_special_tokens
    assert body["count"] == len(body["tokens"]) and body["prompt"] is None


def test_every_id_of_the_vocabulary_from_0_is_detokenized(client, engine, tokenizer):
    vocab = engine.model_config.vocab_size
    r = client.post("/detokenize", json={"tokens": [0, vocab - 1]}, headers=AUTH)
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": tokenizer.decode([0, vocab - 1])}
