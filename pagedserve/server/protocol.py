"""The OpenAI-compatible wire schemas, shared by the server and the SDK (so: no torch here).

Field names are OpenAI's; the extras after them are vLLM's.

Every number a request carries is range-checked here, so that no value reaches torch that it
cannot hold: integers fit where they go (an int64 generator state, int32 counts and token ids),
floats are finite and in their sampling range, and lists are bounded. A value outside is a 400
naming the field (``errors.py``). Limits that depend on the server (``n`` against
``--max-num-seqs``, ``logprobs`` against ``--max-logprobs``, token ids against the vocabulary,
``max_tokens`` against ``--max-model-len``) are checked in ``sampling.py`` and the engine's limits.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

from pagedserve.sampling_params import INT32_MAX, INT64_MAX, INT64_MIN

MAX_STOP = 64  # stop strings per request: each is searched for after every token
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
MAX_PROMPTS = 256  # prompts in one batched completions or /generate request
MAX_TOOLS = 128  # tools in one request, as OpenAI's API allows
MAX_TOOL_CALLS = 128  # tool calls in one assistant message

TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
Count = Annotated[int, Field(ge=0, le=INT32_MAX)]
PositiveCount = Annotated[int, Field(ge=1, le=INT32_MAX)]
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
Probability = Annotated[float, Field(ge=0.0, le=1.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
TopK = Annotated[int, Field(ge=-1, le=INT32_MAX)]
Temperature = Annotated[float, Field(ge=0.0)]
RepetitionPenalty = Annotated[float, Field(gt=0.0)]
StopStrings = str | Annotated[list[str], Field(max_length=MAX_STOP)]
StopTokenIds = Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)]
LogitBias = Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS)]


logger = logging.getLogger(__name__)


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIModel(BaseModel):
    """A request schema. Values are strict, as OpenAI's API takes them: a number is a JSON number
    (``"0.5"`` is refused), an integer has no fractional part, a boolean is true or false; NaN
    and infinity are refused. Unknown fields are ignored and logged, as vLLM does (a typo such as
    ``max_token`` shows in the server's log; vLLM clients send extras we do not implement)."""

    model_config = ConfigDict(
        extra="ignore", protected_namespaces=(), allow_inf_nan=False, strict=True
    )

    @model_validator(mode="wrap")
    @classmethod
    def _log_ignored_fields(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        result = handler(data)
        if isinstance(data, dict) and cls.model_config.get("extra") == "ignore":
            ignored = sorted(str(k) for k in data if k not in _field_names(cls))
            if ignored:  # names as repr, cut: a client's key may hold a newline or a megabyte
                shown = ", ".join(repr(k[:40]) for k in ignored[:MAX_IGNORED_SHOWN])
                more = len(ignored) - MAX_IGNORED_SHOWN
                logger.warning(
                    "%s: these fields were in the request but are not used: %s%s",
                    cls.__name__,
                    shown,
                    f" and {more} more" if more > 0 else "",
                )
        return result


def _field_names(model: type[BaseModel]) -> frozenset[str]:
    """The names a request may use for ``model``'s fields: each name and its alias."""
    names = _FIELD_NAMES.get(model)
    if names is None:
        fields = model.model_fields.items()
        names = frozenset(n for name, f in fields for n in (name, f.alias) if n)
        _FIELD_NAMES[model] = names
    return names


_FIELD_NAMES: dict[type[BaseModel], frozenset[str]] = {}
MAX_IGNORED_SHOWN = 10  # ignored field names a log line shows


class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=())


# ---- errors -----------------------------------------------------------------------------------
class ErrorInfo(ResponseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(ResponseModel):
    error: ErrorInfo


# ---- requests ---------------------------------------------------------------------------------
class StreamOptions(OpenAIModel):
    include_usage: bool = False


class JsonSchemaFormat(OpenAIModel):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    """OpenAI's ``response_format``: plain text, any JSON object, or JSON for a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsFields(OpenAIModel):
    """vLLM's ``structured_outputs``: exactly one constraint."""

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


# ---- tools ------------------------------------------------------------------------------------
class FunctionDefinition(OpenAIModel):
    """A function the model may call. Extra keys are kept: the chat template shows the model the
    definition as the client wrote it."""

    model_config = ConfigDict(extra="allow")
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionToolsParam(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ToolChoiceFunction(OpenAIModel):
    name: str


class ChatCompletionNamedToolChoiceParam(OpenAIModel):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: call this function."""

    type: Literal["function"] = "function"
    function: ToolChoiceFunction


ToolChoice = Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam


class FunctionCall(ResponseModel):
    name: str
    arguments: str | dict[str, Any] = "{}"  # a JSON string (a client may send the object)


class ToolCall(ResponseModel):
    id: str = Field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    type: Literal["function"] = "function"
    function: FunctionCall


class SamplingFields(OpenAIModel):
    """Fields both completions and chat completions accept."""

    model: str | None = None
    n: PositiveCount = 1
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopStrings | None = None
    seed: Int64 | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: LogitBias | None = None
    user: str | None = None
    # vLLM's extras
    top_k: TopK | None = None
    min_p: Probability | None = None
    repetition_penalty: RepetitionPenalty | None = None
    stop_token_ids: StopTokenIds | None = None
    ignore_eos: bool = False
    min_tokens: Count = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # structured output: OpenAI's response_format, vLLM's guided_* and structured_outputs
    response_format: ResponseFormat | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsFields | None = None


class CompletionRequest(SamplingFields):
    prompt: (
        str
        | Annotated[list[str], Field(max_length=MAX_PROMPTS)]
        | list[TokenId]
        | Annotated[list[list[TokenId]], Field(max_length=MAX_PROMPTS)]
    )
    max_tokens: PositiveCount | None = 16
    logprobs: Count | None = None
    echo: bool = False
    suffix: str | None = None


class ContentPart(OpenAIModel):
    type: str = "text"
    text: str | None = None


class ChatMessage(OpenAIModel):
    """A message of the conversation. An assistant message may carry the ``tool_calls`` it made,
    a ``role: "tool"`` message the result of one (``tool_call_id``)."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOL_CALLS)] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @field_validator("role")
    @classmethod
    def _names_a_speaker(cls, role: str) -> str:
        if not role.strip():
            raise ValueError(
                "a message's role must name who speaks: system, user, assistant or tool"
            )
        return role


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: PositiveCount | None = None
    max_completion_tokens: PositiveCount | None = None
    logprobs: bool = False
    top_logprobs: Count | None = None
    add_generation_prompt: bool = True
    tools: Annotated[list[ChatCompletionToolsParam], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = True
    include_reasoning: bool = True  # vLLM's: with --reasoning-parser, send the thinking


class TokenizeRequest(OpenAIModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: Annotated[list[ChatCompletionToolsParam], Field(max_length=MAX_TOOLS)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[TokenId]


# ---- responses --------------------------------------------------------------------------------
class UsageInfo(ResponseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(ResponseModel):
    """OpenAI's legacy completions shape: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(ResponseModel):
    id: str  # the request's: its engine requests are named after it
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(ResponseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(ResponseModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)
    reasoning_content: str | None = None  # --reasoning-parser: the thinking (DeepSeek's name)
    reasoning: str | None = None  # the same, by vLLM's newer name


class ChatCompletionChoice(ResponseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(ResponseModel):
    id: str  # the request's: its engine request is named after it
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class _OnlyWhatIsSent(ResponseModel):
    """A streamed piece that carries only the fields it sets: the openai SDK's stream helpers
    merge pieces field by field, and a ``"type": null`` would overwrite the call's type."""

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_OnlyWhatIsSent):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_OnlyWhatIsSent):
    """One streamed piece of call ``index``: its id, type and name first, then its arguments
    in fragments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(ResponseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatCompletionStreamChoice(ResponseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class CompletionChunk(ResponseModel):
    """A streamed completions chunk; OpenAI keeps ``object`` as ``text_completion``."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedserve"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field)
    max_model_len: int | None = None


class LoadLoRAAdapterRequest(OpenAIModel):
    """vLLM's ``POST /v1/load_lora_adapter`` body."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(OpenAIModel):
    """vLLM's ``POST /v1/unload_lora_adapter`` body (``lora_int_id`` is accepted and unused, as
    vLLM's is)."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    prompt: str | None = None  # messages: the text the chat template made of them


class DetokenizeResponse(ResponseModel):
    prompt: str


class VersionResponse(ResponseModel):
    version: str


class FaultRequest(OpenAIModel):
    """``POST /device/faults``: which device fault to inject (kunlun-emu)."""

    kind: Literal["kv_page", "host_page", "weight_page", "step"]
    tag: str | None = Field(None, max_length=512, description="weight_page: the tensor's tag")
    page: int | None = Field(
        None, ge=0, le=2**31, description="the page number (host_page: the host-tier frame)"
    )


class DeviceStatsResponse(ResponseModel):
    """``engine.get_device_stats()`` plus ``tokens_per_second`` and the server's model name."""

    name: str
    backend: str
    tiers: dict[str, Any]
    kv_pages: dict[str, Any]
    host_pages: dict[str, int] | None = None  # the host tier's KV frames, when it has any
    requests: dict[str, int]
    faults_detected: int = 0
    faults: dict[str, dict[str, int]] = {}  # per kind: injected, detected, recovered
    weight_pages: dict[str, int] = {}  # total, scrubbed_total, scrub_pages_per_step
    tokens_per_second: float = 0.0
