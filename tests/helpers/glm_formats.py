"""GLM-4's published chat formats, for the tests: the published templates (fixtures, rendered by
transformers' own renderer), THUDM's mapping of OpenAI's tool messages onto them, and the
conversations and model outputs the template and parser tests share."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parents[1] / "models" / "fixtures" / "chat_templates"

# published template -> (its file, the built-in pagedserve template that must render alike)
PUBLISHED = {
    "glm-4-9b-chat": ("glm-4-9b-chat.jinja", "glm4-chat"),
    "GLM-4-9B-0414": ("GLM-4-9B-0414.jinja", "glm4-0414"),
    "GLM-Z1-9B-0414": ("GLM-Z1-9B-0414.jinja", "glm-z1-0414"),
}

# transformers' rendering of GLM-4-9B-0414's shipped template for WEATHER_SORTED and one user
# message, byte for byte (SOURCES.md says where it was published)
GLM4_0414_PUBLISHED_RENDERING = (
    "[gMASK]<sop><|system|>\n# 可用工具\n\n## get_weather\n\n{\n"
    '    "description": "Get the weather",\n    "name": "get_weather",\n'
    '    "parameters": {\n        "properties": {\n            "city": {\n'
    '                "type": "string"\n            }\n        },\n'
    '        "type": "object"\n    }\n}\n'
    "在调用上述函数时，请使用 Json 格式表示调用的参数。<|user|>\nwhat is the weather in Paris?<|assistant|>"
)
# llama.cpp's tests/test-chat-template.cpp ("ChatGLM4"): its conversation, and the published
# GLM-4-9B-chat template's rendering of it, as that test expects it (SOURCES.md)
LLAMA_CPP_CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant"},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hi there"},
    {"role": "user", "content": "Who are you"},
    {"role": "assistant", "content": "   I am an assistant   "},
    {"role": "user", "content": "Another question"},
]
GLM4_CHAT_PUBLISHED_RENDERING = (
    "[gMASK]<sop><|system|>\nYou are a helpful assistant<|user|>\nHello<|assistant|>\nHi there"
    "<|user|>\nWho are you<|assistant|>\n   I am an assistant   <|user|>\nAnother question"
    "<|assistant|>"
)
WEATHER_SORTED = {
    "type": "function",
    "function": {
        "description": "Get the weather",
        "name": "get_weather",
        "parameters": {"properties": {"city": {"type": "string"}}, "type": "object"},
    },
}

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city — in °C",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "city, e.g. Paris"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["location"],
        },
    },
}
CLOCK = {  # a function of no arguments
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time now",
        "parameters": {"type": "object", "properties": {}},
    },
}
TOOLS = [WEATHER, CLOCK]


def call(name: str, arguments: str, call_id: str = "call_1") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# (name, messages, tools) in OpenAI's shapes
CONVERSATIONS = [
    (
        "plain",
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hello"},
            {"role": "assistant", "content": "Hi there"},
            {"role": "user", "content": "Who are you?"},
        ],
        None,
    ),
    ("tools", [{"role": "user", "content": "Weather in Paris?"}], TOOLS),
    (
        "tools and a system prompt",
        [{"role": "system", "content": "You help."}, {"role": "user", "content": "Paris?"}],
        TOOLS,
    ),
    (
        "a call and its result",
        [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [call("get_weather", '{"location": "Paris"}')],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
        ],
        TOOLS,
    ),
    (
        "two calls in one turn",
        [
            {"role": "user", "content": "Weather in Paris and the time?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    call("get_weather", '{"location": "Paris", "unit": "celsius"}', "call_1"),
                    call("get_time", "{}", "call_2"),
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "21"},
            {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
            {"role": "assistant", "content": "21 °C at noon."},
            {"role": "user", "content": "Thanks"},
        ],
        TOOLS,
    ),
    (
        "text before a call",
        [
            {"role": "user", "content": "Time?"},
            {
                "role": "assistant",
                "content": "Let me look.",
                "tool_calls": [call("get_time", "{}")],
            },
            {"role": "tool", "content": "12:00"},
        ],
        TOOLS,
    ),
]


def glm_shape(messages: list[dict], tools: list[dict] | None, tools_on_a_message: bool):
    """OpenAI's messages as GLM's published templates take them, as THUDM's OpenAI server makes
    them: a call is an assistant message with ``metadata`` = the function's name and ``content``
    = its arguments, a result an ``observation`` message. ``tools_on_a_message``: GLM-4-9B-chat
    reads the tools from a (leading system) message, the 0414 templates from ``tools``."""
    out: list[dict] = []
    if tools and tools_on_a_message:
        out.append({"role": "system", "content": "", "tools": copy.deepcopy(tools)})
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "observation", "content": m["content"]})
        elif m["role"] == "assistant" and m.get("tool_calls"):
            if m.get("content"):
                out.append({"role": "assistant", "content": m["content"]})
            for c in m["tool_calls"]:
                f = c["function"]
                out.append({"role": "assistant", "metadata": f["name"], "content": f["arguments"]})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return out


def published_template(name: str) -> str:
    return (FIXTURES / PUBLISHED[name][0]).read_text()


def render_published(name: str, messages, tools=None, add_generation_prompt=True) -> str:
    """The published template's rendering of an OpenAI-shaped conversation, by transformers."""
    from transformers.utils.chat_template_utils import render_jinja_template

    on_message = name == "glm-4-9b-chat"
    rendered, _ = render_jinja_template(
        conversations=[glm_shape(messages, tools, on_message)],
        tools=None if on_message else copy.deepcopy(tools),
        chat_template=published_template(name),
        add_generation_prompt=add_generation_prompt,
    )
    return rendered[0] if isinstance(rendered, list) else rendered


def arguments(call_text: str) -> dict:
    return json.loads(call_text)
