"""Request fields that constrain the output -> ``StructuredOutputsParams``, checked here so that a
bad schema, regex or grammar is a 400 naming the problem before the request is queued.

OpenAI's ``response_format`` (``json_object``, ``json_schema``), vLLM's ``guided_json``,
``guided_regex``, ``guided_choice``, ``guided_grammar`` and ``structured_outputs``, and SGLang's
``json_schema``, ``regex`` and ``ebnf`` sampling parameters (``sglang_api.py``).
"""

from __future__ import annotations

import json
from typing import Any

from pagedserve.engine.structured_output.backend_guidance import check_structured_outputs
from pagedserve.sampling_params import SamplingParams, StructuredOutputsParams
from pagedserve.server.errors import bad_request
from pagedserve.server.protocol import SamplingFields

MAX_SCHEMA_DEPTH = 64


def openai_structured_outputs(body: SamplingFields) -> tuple[str, StructuredOutputsParams] | None:
    """(the field it came from, the constraint) of an OpenAI / vLLM request, or None."""
    found: list[tuple[str, dict[str, Any]]] = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", {"json_object": True}))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise bad_request(
                "response_format of type json_schema needs json_schema.schema (the JSON schema "
                "the answer must follow)",
                "response_format",
            )
        found.append(("response_format", {"json": rf.json_schema.schema_}))
    for name, kind in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        if getattr(body, name) is not None:
            found.append((name, {kind: getattr(body, name)}))
    if body.structured_outputs is not None:
        fields = body.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        found.append(("structured_outputs", fields))
    if not found:
        return None
    if len(found) > 1:
        names = " and ".join(name for name, _ in found)
        raise bad_request(f"send one constraint on the output; got {names}", found[1][0])
    name, fields = found[0]
    return name, build(fields, name)


def build(fields: dict[str, Any], param: str) -> StructuredOutputsParams:
    """A checked constraint, or a 400 naming ``param`` and what is wrong."""
    try:
        if isinstance(fields.get("json"), str):
            fields = {**fields, "json": _parse_schema(fields["json"])}
        check_depth(fields.get("json"))
        params = StructuredOutputsParams(**fields)
        check_structured_outputs(params)
    except ValueError as e:
        raise bad_request(str(e), param, "invalid_structured_output") from e
    return params


def check_depth(schema: Any) -> None:
    """Schemas are compiled by recursion: one nested past ``MAX_SCHEMA_DEPTH`` levels is refused
    before it can exhaust the stack. Measured without recursion, for the same reason."""
    stack = [(schema, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"the JSON schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
        children = value.values() if isinstance(value, dict) else value
        if isinstance(value, dict | list):
            stack.extend((child, depth + 1) for child in children)


def _parse_schema(text: str) -> dict[str, Any]:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"the JSON schema is not valid JSON: {e}") from e
    if not isinstance(schema, dict):
        raise ValueError("the JSON schema must be a JSON object")
    return schema


def attach_structured_outputs(params: SamplingParams, body: SamplingFields, tokenizer) -> None:
    """Set ``params.structured_outputs`` from the request's fields (a 400 if they are bad)."""
    found = openai_structured_outputs(body)
    if found is None:
        return
    if tokenizer is None:
        raise bad_request("structured outputs need the model's tokenizer.json", found[0])
    params.structured_outputs = found[1]
