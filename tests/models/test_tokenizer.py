"""The GLM-4 tokenizer wrapper, checked against transformers' tokenizer on the same files."""

from __future__ import annotations

import json

import pytest
from jinja2.exceptions import TemplateError

from pagedserve.models import Tokenizer
from tests.helpers.models import GLM4_CHAT_TEMPLATE, SPECIAL_TOKENS, build_tiny_tokenizer

TEXTS = [
    "Hello world!",
    "The quick brown fox.",
    "你好，世界。 emoji 🙂 and tabs\tand\nnewlines",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "\nBlue."},
        {"role": "user", "content": "Another?"},
    ],
    [{"role": "user", "content": "weather?"}, {"role": "observation", "content": '{"t": 21}'}],
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def hf_tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def test_special_tokens_are_single_ids_marked_special(tokenizer_dir, hf_tokenizer):
    tokenizer = Tokenizer(tokenizer_dir)
    ids = [tokenizer.token_to_id(token) for token in SPECIAL_TOKENS]
    assert ids == hf_tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS)
    assert sorted(ids) == tokenizer.all_special_ids
    assert [tokenizer.id_to_token(i) for i in ids] == SPECIAL_TOKENS
    assert tokenizer.vocab_size == len(hf_tokenizer)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers_and_decode_round_trips(tokenizer_dir, hf_tokenizer, text):
    tokenizer = Tokenizer(tokenizer_dir)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids == hf_tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text


def test_completion_prompt_gets_gmask_sop_prefix_when_the_post_processor_lacks_it(
    tokenizer_dir, hf_tokenizer
):
    tokenizer = Tokenizer(tokenizer_dir)
    prefix = hf_tokenizer.convert_tokens_to_ids(["[gMASK]", "<sop>"])
    body = hf_tokenizer.encode("Hello world!", add_special_tokens=False)
    assert hf_tokenizer.encode("Hello world!")[:2] != prefix
    assert tokenizer.encode("Hello world!") == prefix + body
    assert tokenizer.encode("[gMASK]<sop>Hello world!") == prefix + body


def test_prefix_is_not_doubled_when_the_post_processor_adds_it(tmp_path):
    from transformers import AutoTokenizer

    build_tiny_tokenizer(tmp_path, prefix_in_post_processor=True)
    hf_tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    tokenizer = Tokenizer(tmp_path)
    expected = hf_tokenizer.encode("Hello world!")
    assert expected[:2] == hf_tokenizer.convert_tokens_to_ids(["[gMASK]", "<sop>"])
    assert tokenizer.encode("Hello world!") == expected


def test_no_prefix_when_the_vocabulary_lacks_the_tokens(tmp_path):
    build_tiny_tokenizer(tmp_path)
    path = tmp_path / "tokenizer.json"
    data = json.loads(path.read_text())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] != "<sop>"]
    del data["model"]["vocab"]["<sop>"]
    path.write_text(json.dumps(data))
    tokenizer = Tokenizer(tmp_path)
    assert tokenizer.token_to_id("<sop>") is None
    assert tokenizer.encode("Hi") == tokenizer.encode("Hi", add_special_tokens=False)


def test_decode_skips_special_tokens_unless_asked(tokenizer_dir):
    tokenizer = Tokenizer(tokenizer_dir)
    ids = tokenizer.encode("Hello") + [tokenizer.token_to_id("<|user|>")]
    assert tokenizer.decode(ids) == "Hello"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "[gMASK]<sop>Hello<|user|>"


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_renders_like_transformers(
    tokenizer_dir, hf_tokenizer, messages, add_generation_prompt
):
    tokenizer = Tokenizer(tokenizer_dir)
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert prompt == hf_tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=False
    )


def test_chat_prompt_has_the_glm4_layout(tokenizer_dir):
    tokenizer = Tokenizer(tokenizer_dir)
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert (
        tokenizer.apply_chat_template(messages)
        == "[gMASK]<sop><|system|>\nS<|user|>\nU<|assistant|>"
    )


def test_chat_template_tools_use_tojson_like_transformers(tokenizer_dir, hf_tokenizer):
    tokenizer = Tokenizer(tokenizer_dir)
    tools = [
        {"type": "function", "function": {"name": "f", "description": "天气", "parameters": {}}}
    ]
    messages = CONVERSATIONS[0]
    prompt = tokenizer.apply_chat_template(messages, tools=tools)
    assert json.dumps(tools, ensure_ascii=False) in prompt
    assert prompt == hf_tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False
    )


def test_tokenized_chat_has_one_prefix_and_matches_transformers(tokenizer_dir, hf_tokenizer):
    tokenizer = Tokenizer(tokenizer_dir)
    messages = CONVERSATIONS[1]
    ids = tokenizer.apply_chat_template(messages, tokenize=True)
    expected = hf_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert ids == list(expected)
    assert ids[:3] == [tokenizer.token_to_id(t) for t in ("[gMASK]", "<sop>", "<|system|>")]
    assert ids[-1] == tokenizer.token_to_id("<|assistant|>")


def test_template_without_prefix_still_gets_it_when_tokenized(tmp_path):
    build_tiny_tokenizer(tmp_path, chat_template=GLM4_CHAT_TEMPLATE.removeprefix("[gMASK]<sop>"))
    tokenizer = Tokenizer(tmp_path)
    ids = tokenizer.apply_chat_template(CONVERSATIONS[0], tokenize=True)
    rendered = tokenizer.apply_chat_template(CONVERSATIONS[0])
    assert not rendered.startswith("[gMASK]")
    assert ids == tokenizer.prompt_prefix_ids + tokenizer.encode(rendered, add_special_tokens=False)


def test_chat_template_can_raise_exception(tokenizer_dir):
    tokenizer = Tokenizer(tokenizer_dir)
    with pytest.raises(TemplateError, match="unknown role: robot"):
        tokenizer.apply_chat_template([{"role": "robot", "content": "beep"}])


def test_chat_template_file_is_preferred(tmp_path):
    build_tiny_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{{ messages | length }} messages")
    assert Tokenizer(tmp_path).apply_chat_template(CONVERSATIONS[1]) == "4 messages"


def test_chat_without_template_is_a_clear_error(tmp_path):
    build_tiny_tokenizer(tmp_path, chat_template=None)
    tokenizer = Tokenizer(tmp_path)
    assert tokenizer.encode("Hi")  # completion prompts still work
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.apply_chat_template(CONVERSATIONS[0])


def test_eos_ids_are_glm4_stop_tokens_plus_configured_ones(tmp_path, hf_tokenizer):
    build_tiny_tokenizer(tmp_path)
    stops = hf_tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|user|>", "<|observation|>"])
    assert Tokenizer(tmp_path).eos_token_ids == stops
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [stops[0], 5]}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 6}))
    assert sorted(Tokenizer(tmp_path).eos_token_ids) == sorted(stops + [5, 6])


def test_missing_tokenizer_json_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer(tmp_path)


def test_tokenizer_json_without_tokenizer_config_loads(tmp_path, hf_tokenizer):
    build_tiny_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").unlink()  # no eos_token named anywhere
    stops = hf_tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|user|>", "<|observation|>"])
    assert Tokenizer(tmp_path).eos_token_ids == stops
