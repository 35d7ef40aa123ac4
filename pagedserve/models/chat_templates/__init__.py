"""Chat templates written for pagedserve from GLM-4's published formats, for checkpoints whose own
template cannot render OpenAI's tool messages.

GLM-4-9B-chat's and the GLM-4-0414 models' published templates render a tool call only in GLM's
own message shape (an assistant message whose ``metadata`` is the function's name and whose
``content`` is its arguments; a result as role ``observation``). These render the same turns
from OpenAI's shapes as well (``tools``, an assistant message's ``tool_calls``, ``role: "tool"``),
and every conversation the published template renders, token for token
(tests/models/test_chat_templates.py). ``pagedserve serve --chat-template NAME`` picks one; a
checkpoint whose template is one of the published ones gets its counterpart by itself.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

BUILTIN_CHAT_TEMPLATES = {
    "glm4-chat": "glm4_chat.jinja",  # GLM-4-9B-chat, -chat-hf, -chat-1m
    "glm4-0414": "glm4_0414.jinja",  # GLM-4-9B-0414, GLM-4-32B-0414
    "glm-z1-0414": "glm_z1_0414.jinja",  # GLM-Z1-9B-0414, GLM-Z1-32B-0414 (thinking)
}

# what a published template says, by family, and that it does not take OpenAI's tool_calls
_GLM4_CHAT_MARKS = ("item['tools'] is defined", "<|{{ item['role'] }}|>{{ item['metadata'] }}")
_GLM4_0414_MARKS = ("for tool in tools", 'message.get("metadata"', "<|assistant|>{{ meta }}")
_FIXED_TOOLS = '"name": "'  # a template with tools of its own (GLM-Z1-Rumination's): left alone


def builtin_chat_template(name: str) -> str:
    path = files(__package__) / BUILTIN_CHAT_TEMPLATES[name]
    return path.read_text(encoding="utf-8")


def load_chat_template(value: str) -> str:
    """``--chat-template``: a built-in's name or a jinja file; ``ValueError`` says which exist."""
    if value in BUILTIN_CHAT_TEMPLATES:
        return builtin_chat_template(value)
    path = Path(value)
    if path.is_file():
        return path.read_text(encoding="utf-8")
    raise ValueError(
        f"--chat-template {value}: not a file, nor a built-in template "
        f"({', '.join(BUILTIN_CHAT_TEMPLATES)})"
    )


def tool_template_for(template: str | None) -> str | None:
    """The built-in that stands in for ``template`` when it is one of GLM-4's published templates,
    which render tool calls only in GLM's own message shape; None for any other template."""
    if not template or "tool_calls" in template or _FIXED_TOOLS in template:
        return None
    if all(mark in template for mark in _GLM4_CHAT_MARKS):
        return "glm4-chat"
    if all(mark in template for mark in _GLM4_0414_MARKS) and "<|observation|>" in template:
        return "glm-z1-0414" if "<think>" in template else "glm4-0414"
    return None
