"""pagedserve's GLM-4 chat templates against the published ones: the same conversations (with
tools, tool calls and tool results, in OpenAI's shapes for ours, mapped to GLM's own shapes as
THUDM's server maps them for the published ones, rendered by transformers) give the same text
and the same tokens. The demo model's template takes tools the same way."""

from __future__ import annotations

import copy

import pytest
import transformers

from pagedserve.models.chat_templates import (
    BUILTIN_CHAT_TEMPLATES,
    builtin_chat_template,
    load_chat_template,
    tool_template_for,
)
from pagedserve.models.tokenizer import Tokenizer
from pagedserve.presets import demo_model_dir
from tests.helpers.glm_formats import (
    CONVERSATIONS,
    GLM4_0414_PUBLISHED_RENDERING,
    GLM4_CHAT_PUBLISHED_RENDERING,
    LLAMA_CPP_CONVERSATION,
    PUBLISHED,
    TOOLS,
    WEATHER_SORTED,
    call,
    glm_shape,
    published_template,
    render_published,
)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """The demo model's tokenizer: GLM-4's special tokens, each one token."""
    return Tokenizer(demo_model_dir())


def _ours(tokenizer: Tokenizer, builtin: str, messages, tools, add_generation_prompt=True):
    tok = copy.copy(tokenizer)
    tok.chat_template = builtin_chat_template(builtin)
    return tok.apply_chat_template(
        copy.deepcopy(messages), add_generation_prompt=add_generation_prompt, tools=tools
    )


@pytest.mark.parametrize("published", list(PUBLISHED))
@pytest.mark.parametrize("name,messages,tools", CONVERSATIONS, ids=[c[0] for c in CONVERSATIONS])
def test_ours_renders_each_conversation_as_the_published_template_does(
    tokenizer, published, name, messages, tools
):
    builtin = PUBLISHED[published][1]
    for add_generation_prompt in (True, False):
        reference = render_published(published, messages, tools, add_generation_prompt)
        ours = _ours(tokenizer, builtin, messages, tools, add_generation_prompt)
        assert ours == reference
        assert tokenizer.encode(ours, add_special_tokens=False) == tokenizer.encode(
            reference, add_special_tokens=False
        )


@pytest.mark.parametrize("published", list(PUBLISHED))
def test_ours_renders_glms_own_message_shape_as_the_published_template_does(tokenizer, published):
    """A client that sends GLM's own shapes (``metadata``, ``observation``) gets the same."""
    builtin = PUBLISHED[published][1]
    name, messages, tools = CONVERSATIONS[4]
    glm_messages = glm_shape(messages, None, tools_on_a_message=False)
    ours = _ours(tokenizer, builtin, glm_messages, tools)
    assert ours == render_published(published, messages, tools)


def test_the_0414_reference_reproduces_the_published_rendering():
    """The GLM-4-0414 fixture (SOURCES.md says how it was made) gives transformers' published
    rendering of the shipped template, byte for byte."""
    messages = [{"role": "user", "content": "what is the weather in Paris?"}]
    assert render_published("GLM-4-9B-0414", messages, [WEATHER_SORTED]) == (
        GLM4_0414_PUBLISHED_RENDERING
    )


def test_ours_and_the_published_glm_4_9b_chat_template_give_its_published_rendering(tokenizer):
    """llama.cpp's test of GLM-4-9B-chat's template expects this text for its conversation: the
    fixture and pagedserve's glm4-chat give it, token for token."""
    published = render_published("glm-4-9b-chat", LLAMA_CPP_CONVERSATION)
    ours = _ours(tokenizer, "glm4-chat", LLAMA_CPP_CONVERSATION, None)
    assert published == ours == GLM4_CHAT_PUBLISHED_RENDERING
    assert tokenizer.encode(ours, add_special_tokens=False) == tokenizer.encode(
        GLM4_CHAT_PUBLISHED_RENDERING, add_special_tokens=False
    )


def test_a_tool_call_renders_as_the_model_writes_it(tokenizer):
    """The format the parsers read: the name right after <|assistant|>, a newline, the JSON
    arguments; the result comes back as an <|observation|> turn."""
    messages = [
        {"role": "user", "content": "Paris?"},
        {"role": "assistant", "tool_calls": [call("get_weather", '{"location": "Paris"}')]},
        {"role": "tool", "content": "21"},
    ]
    for builtin in ("glm4-chat", "glm4-0414"):
        text = _ours(tokenizer, builtin, messages, TOOLS)
        assert text.endswith(
            '<|user|>\nParis?<|assistant|>get_weather\n{"location": "Paris"}'
            "<|observation|>\n21<|assistant|>"
        )
        assert "## get_weather\n\n{\n" in text and "## get_time\n\n" in text


def test_arguments_sent_as_an_object_render_as_json(tokenizer):
    messages = [
        {"role": "user", "content": "Paris?"},
        {"role": "assistant", "tool_calls": [call("get_weather", {"location": "Paris"})]},
    ]
    text = _ours(tokenizer, "glm4-0414", messages, TOOLS, add_generation_prompt=False)
    assert text.endswith('<|assistant|>get_weather\n{"location": "Paris"}')


def test_an_unknown_role_is_an_error_not_a_silent_drop(tokenizer):
    with pytest.raises(Exception, match="unknown role function"):
        _ours(tokenizer, "glm4-0414", [{"role": "function", "content": "x"}], None)


def test_the_thinking_template_opens_think_and_shows_only_past_answers(tokenizer):
    messages = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "\nadd them\n</think>\n4"},
        {"role": "user", "content": "3+3?"},
    ]
    text = _ours(tokenizer, "glm-z1-0414", messages, None)
    assert text == "[gMASK]<sop><|user|>\n2+2?<|assistant|>\n4<|user|>\n3+3?<|assistant|>\n<think>"
    assert text == render_published("GLM-Z1-9B-0414", messages)


# ---- which template a checkpoint gets -------------------------------------------------------------
@pytest.mark.parametrize("published", list(PUBLISHED))
def test_a_published_glm_template_is_served_by_its_counterpart(published):
    assert tool_template_for(published_template(published)) == PUBLISHED[published][1]


def test_templates_that_take_openai_tool_calls_are_left_alone():
    for builtin in BUILTIN_CHAT_TEMPLATES:
        assert tool_template_for(builtin_chat_template(builtin)) is None
    assert tool_template_for(Tokenizer(demo_model_dir()).chat_template) is None
    assert tool_template_for("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert tool_template_for(None) is None
    # GLM-Z1-Rumination's template declares tools of its own (search, click, ...): not replaced
    own_tools = '<|system|>\n[{"name": "search", "parameters": {}}]' + published_template(
        "GLM-4-9B-0414"
    )
    assert tool_template_for(own_tools) is None


def test_chat_template_takes_a_name_or_a_file(tmp_path):
    assert load_chat_template("glm4-0414") == builtin_chat_template("glm4-0414")
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0].content }}")
    assert load_chat_template(str(path)) == "{{ messages[0].content }}"
    with pytest.raises(ValueError, match="glm4-chat, glm4-0414, glm-z1-0414"):
        load_chat_template("glm5")


# ---- the demo model ---------------------------------------------------------------------------------
def test_the_demo_template_takes_tools_calls_and_results_as_glm_4_0414_does(tokenizer):
    """The demo model's template: 0414's tools block and turns; its assistant turns open with a
    newline (it was trained so), a call too."""
    name, messages, tools = CONVERSATIONS[3]
    text = tokenizer.apply_chat_template(copy.deepcopy(messages), tools=tools)
    zero = render_published("GLM-4-9B-0414", messages, tools)
    assert text == zero.replace("<|assistant|>get_weather", "<|assistant|>\nget_weather") + "\n"
    assert text.endswith('<|observation|>\n{"temperature": 21}<|assistant|>\n')


def test_transformers_renders_the_demo_template_as_pagedserve_does(tokenizer):
    hf = transformers.AutoTokenizer.from_pretrained(demo_model_dir())
    for _, messages, tools in CONVERSATIONS:
        ours = tokenizer.apply_chat_template(copy.deepcopy(messages), tools=tools)
        theirs = hf.apply_chat_template(
            copy.deepcopy(messages), tools=tools, tokenize=False, add_generation_prompt=True
        )
        assert ours == theirs
