"""The pagedserve SDK against the live server (conftest), sync and async, streaming included."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from pagedserve.client import APIConnectionError, APIError, AsyncClient, Client
from pagedserve.server.protocol import ChatCompletionChunk, CompletionChunk, CompletionResponse

PROMPT = "Hello world"
CHAT = [{"role": "user", "content": "Hello world!"}]


@pytest.fixture(scope="module")
def sdk_client(live_server):
    with Client(live_server.url, api_key=live_server.api_key, timeout=60) as c:
        yield c


def test_importing_the_client_does_not_import_torch():
    code = "import pagedserve.client, sys; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_sync_completion_chat_models_and_health(sdk_client, live_server):
    assert sdk_client.health()
    assert [m.id for m in sdk_client.models.list().data] == [live_server.model]
    out = sdk_client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, ignore_eos=True
    )
    assert isinstance(out, CompletionResponse) and out.usage.completion_tokens == 5
    chat = sdk_client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=3, temperature=0, ignore_eos=True
    )
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 3


def test_sync_streaming_yields_typed_chunks_that_add_up(sdk_client):
    kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, ignore_eos=True)
    whole = sdk_client.completions.create(**kwargs).choices[0].text
    chunks = list(sdk_client.completions.create(stream=True, **kwargs))
    assert all(isinstance(c, CompletionChunk) for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == whole


TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["unit"],
        },
    },
}


def test_tools_pass_through_and_calls_come_back_typed(sdk_client):
    kwargs = dict(model="tiny", messages=CHAT, tools=[TOOL], tool_choice="required", max_tokens=32)
    (call,) = (
        sdk_client.chat.completions.create(temperature=0, **kwargs).choices[0].message.tool_calls
    )
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments)["unit"] in ("celsius", "fahrenheit")
    chunks = list(sdk_client.chat.completions.create(stream=True, temperature=0, **kwargs))
    deltas = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_errors_carry_the_server_message(sdk_client, live_server):
    with pytest.raises(APIError) as e:
        sdk_client.completions.create(model="nope", prompt=PROMPT)
    assert e.value.status_code == 404 and "nope" in e.value.message
    with pytest.raises(APIError) as e:
        sdk_client.completions.create(model="tiny", prompt=PROMPT, stream=True, max_tokens=0)
    assert e.value.status_code == 400 and e.value.param == "max_tokens"
    with (
        Client(live_server.url, api_key="wrong", max_retries=0) as bad,
        pytest.raises(APIError) as e,
    ):
        bad.models.list()
    assert e.value.status_code == 401


def test_503_is_retried_until_the_server_admits(sdk_client, live_server):
    engine = live_server.serving.engine
    statuses = []

    def admit_after_the_first_refusal(response):
        statuses.append(response.status_code)
        engine.max_queue_len = 64

    engine.max_queue_len = 0  # the first request is refused with 503 ...
    sdk_client._http.event_hooks["response"].append(admit_after_the_first_refusal)
    try:
        out = sdk_client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=2, ignore_eos=True
        )
    finally:
        sdk_client._http.event_hooks["response"].remove(admit_after_the_first_refusal)
        engine.max_queue_len = 64
    assert statuses == [503, 200]  # ... and its retry is served
    assert out.usage.completion_tokens == 2


def test_unreachable_server_raises_a_connection_error():
    from pagedserve.testing import free_port

    with Client(f"http://127.0.0.1:{free_port()}", max_retries=1) as c:
        with pytest.raises(APIConnectionError):
            c.models.list()
        assert not c.health()


def test_async_client_completion_chat_and_streaming(live_server):
    async def run():
        async with AsyncClient(live_server.url, api_key=live_server.api_key) as c:
            assert await c.health()
            assert (await c.models.list()).data[0].id == live_server.model
            out = await c.completions.create(
                model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, ignore_eos=True
            )
            stream = await c.chat.completions.create(
                model="tiny",
                messages=CHAT,
                max_tokens=4,
                temperature=0,
                ignore_eos=True,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [chunk async for chunk in stream]
            cstream = await c.completions.create(
                model="tiny",
                prompt=PROMPT,
                max_tokens=4,
                temperature=0,
                ignore_eos=True,
                stream=True,
            )
            text = "".join([ch.choices[0].text async for ch in cstream])
            with pytest.raises(APIError):
                await c.chat.completions.create(model="nope", messages=CHAT)
            return out, chunks, text

    out, chunks, text = asyncio.run(run())
    assert text == out.choices[0].text
    assert all(isinstance(c, ChatCompletionChunk) for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == 4
