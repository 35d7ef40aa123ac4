"""The pagedserve Python SDK: ``Client`` and ``AsyncClient`` with the openai client's shape.

    client = Client("http://127.0.0.1:8000")
    out = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}])
    for chunk in client.completions.create(model="demo", prompt="Hello", stream=True): ...

Responses are the server's own pydantic schemas. 503s and connection errors are retried with
backoff. Importing this module does not import torch.

A request picks a LoRA adapter by ``model``; ``load_lora_adapter`` and ``unload_lora_adapter``
change a server's adapters at run time (where it allows it).

Every request field goes through as given: a chat request's ``tools``, ``tool_choice`` and
``parallel_tool_calls`` too, and the answer's ``message.tool_calls`` (streamed:
``delta.tool_calls``, each with its ``index``) come back typed.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx

from pagedserve.server.protocol import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChunk,
    CompletionResponse,
    ModelList,
)

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
RETRY_STATUSES = (503,)


class APIError(Exception):
    """An error response from the server, carrying its OpenAI-shaped error fields."""

    def __init__(
        self,
        status_code: int | None,
        message: str,
        type: str | None = None,
        param: str | None = None,
        code: str | int | None = None,
    ):
        super().__init__(f"{status_code}: {message}" if status_code else message)
        self.status_code, self.message = status_code, message
        self.type, self.param, self.code = type, param, code


class APIConnectionError(APIError):
    """The server could not be reached (after retries)."""


def _error_from(response: httpx.Response) -> APIError:
    try:
        info = response.json().get("error", {})
    except (ValueError, AttributeError):
        info = {}
    message = info.get("message") or response.text or response.reason_phrase
    return APIError(
        response.status_code, message, info.get("type"), info.get("param"), info.get("code")
    )


def _body(kwargs: dict[str, Any]) -> dict[str, Any]:
    extra = kwargs.pop("extra_body", None) or {}
    return {**{k: v for k, v in kwargs.items() if v is not None}, **extra}


def _backoff(attempt: int, response: httpx.Response | None) -> float:
    retry_after = response.headers.get("retry-after") if response is not None else None
    if retry_after and retry_after.replace(".", "", 1).isdigit():
        return min(float(retry_after), 30.0)
    return min(0.25 * 2**attempt, 8.0)


def _sse_payloads(lines: Iterator[str]) -> Iterator[dict]:
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        payload = json.loads(data)
        if "error" in payload:
            info = payload["error"]
            raise APIError(info.get("code"), info.get("message", ""), info.get("type"))
        yield payload


def _iter_sse(response: httpx.Response) -> Iterator[dict]:
    try:
        yield from _sse_payloads(response.iter_lines())
    finally:
        response.close()


async def _aiter_sse(response: httpx.Response) -> AsyncIterator[dict]:
    try:
        async for line in response.aiter_lines():
            if line.strip() == "data: [DONE]":
                return
            for payload in _sse_payloads(iter([line])):
                yield payload
    finally:
        await response.aclose()


class _Base:
    def __init__(self, base_url: str, api_key: str | None, timeout: float, max_retries: int):
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.api_key = api_key
        self.timeout = timeout
        self.max_retries = max_retries

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


# ---- sync ---------------------------------------------------------------------------------------
class Client(_Base):
    def __init__(
        self,
        base_url: str = DEFAULT_BASE_URL,
        api_key: str | None = None,
        timeout: float = 600.0,
        max_retries: int = 3,
    ):
        super().__init__(base_url, api_key, timeout, max_retries)
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout, headers=self.headers)
        self.completions = _Completions(self)
        self.chat = _Chat(_ChatCompletions(self))
        self.models = _Models(self)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

    def health(self) -> bool:
        try:
            return self._http.get("/health").status_code == 200
        except httpx.HTTPError:
            return False

    def request(self, method: str, path: str, body: dict | None = None) -> dict:
        response = self._send(method, path, body, stream=False)
        return response.json()

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> str:
        """vLLM's ``POST /v1/load_lora_adapter`` (on a server that allows it): the adapter at
        ``lora_path`` (a PEFT directory on the server's machine), served as model
        ``lora_name``; ``APIError`` saying why not."""
        body = {"lora_name": lora_name, "lora_path": lora_path}
        return self._send("POST", "/v1/load_lora_adapter", body, stream=False).text

    def unload_lora_adapter(self, lora_name: str) -> str:
        """vLLM's ``POST /v1/unload_lora_adapter``; ``APIError`` 409 while requests use it."""
        body = {"lora_name": lora_name}
        return self._send("POST", "/v1/unload_lora_adapter", body, stream=False).text

    def stream(self, path: str, body: dict) -> Iterator[dict]:
        """Send now (so errors raise here), then iterate the SSE payloads."""
        response = self._send("POST", path, body, stream=True)
        return _iter_sse(response)

    def _send(self, method: str, path: str, body: dict | None, stream: bool) -> httpx.Response:
        for attempt in range(self.max_retries + 1):
            last = attempt == self.max_retries
            try:
                request = self._http.build_request(method, path, json=body)
                response = self._http.send(request, stream=stream)
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError) as e:
                if last:
                    raise APIConnectionError(None, f"cannot reach {self.base_url}: {e}") from e
                time.sleep(_backoff(attempt, None))
                continue
            if response.status_code < 400:
                return response
            if stream:
                response.read()
                response.close()
            if response.status_code not in RETRY_STATUSES or last:
                raise _error_from(response)
            time.sleep(_backoff(attempt, response))
        raise AssertionError("unreachable")


class _Completions:
    def __init__(self, client: Client):
        self._client = client

    def create(self, **kwargs: Any) -> CompletionResponse | Iterator[CompletionChunk]:
        body = _body(kwargs)
        if body.get("stream"):
            return (CompletionChunk(**p) for p in self._client.stream("/v1/completions", body))
        return CompletionResponse(**self._client.request("POST", "/v1/completions", body))


class _ChatCompletions:
    def __init__(self, client: Client):
        self._client = client

    def create(self, **kwargs: Any) -> ChatCompletionResponse | Iterator[ChatCompletionChunk]:
        body = _body(kwargs)
        if body.get("stream"):
            path = "/v1/chat/completions"
            return (ChatCompletionChunk(**p) for p in self._client.stream(path, body))
        return ChatCompletionResponse(**self._client.request("POST", "/v1/chat/completions", body))


class _Chat:
    def __init__(self, completions):
        self.completions = completions


class _Models:
    def __init__(self, client: Client):
        self._client = client

    def list(self) -> ModelList:
        return ModelList(**self._client.request("GET", "/v1/models"))


# ---- async --------------------------------------------------------------------------------------
class AsyncClient(_Base):
    def __init__(
        self,
        base_url: str = DEFAULT_BASE_URL,
        api_key: str | None = None,
        timeout: float = 600.0,
        max_retries: int = 3,
    ):
        super().__init__(base_url, api_key, timeout, max_retries)
        self._http = httpx.AsyncClient(
            base_url=self.base_url, timeout=timeout, headers=self.headers
        )
        self.completions = _AsyncCompletions(self)
        self.chat = _Chat(_AsyncChatCompletions(self))
        self.models = _AsyncModels(self)

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *_: Any) -> None:
        await self.close()

    async def health(self) -> bool:
        try:
            return (await self._http.get("/health")).status_code == 200
        except httpx.HTTPError:
            return False

    async def request(self, method: str, path: str, body: dict | None = None) -> dict:
        response = await self._send(method, path, body, stream=False)
        return response.json()

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> str:
        """As ``Client.load_lora_adapter``."""
        body = {"lora_name": lora_name, "lora_path": lora_path}
        return (await self._send("POST", "/v1/load_lora_adapter", body, stream=False)).text

    async def unload_lora_adapter(self, lora_name: str) -> str:
        """As ``Client.unload_lora_adapter``."""
        body = {"lora_name": lora_name}
        return (await self._send("POST", "/v1/unload_lora_adapter", body, stream=False)).text

    async def stream(self, path: str, body: dict) -> AsyncIterator[dict]:
        """Send now (so errors raise here), then iterate the SSE payloads."""
        response = await self._send("POST", path, body, stream=True)
        return _aiter_sse(response)

    async def _send(
        self, method: str, path: str, body: dict | None, stream: bool
    ) -> httpx.Response:
        for attempt in range(self.max_retries + 1):
            last = attempt == self.max_retries
            try:
                request = self._http.build_request(method, path, json=body)
                response = await self._http.send(request, stream=stream)
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError) as e:
                if last:
                    raise APIConnectionError(None, f"cannot reach {self.base_url}: {e}") from e
                await asyncio.sleep(_backoff(attempt, None))
                continue
            if response.status_code < 400:
                return response
            if stream:
                await response.aread()
                await response.aclose()
            if response.status_code not in RETRY_STATUSES or last:
                raise _error_from(response)
            await asyncio.sleep(_backoff(attempt, response))
        raise AssertionError("unreachable")


class _AsyncCompletions:
    def __init__(self, client: AsyncClient):
        self._client = client

    async def create(self, **kwargs: Any) -> CompletionResponse | AsyncIterator[CompletionChunk]:
        body = _body(kwargs)
        if body.get("stream"):
            return _typed(await self._client.stream("/v1/completions", body), CompletionChunk)
        return CompletionResponse(**await self._client.request("POST", "/v1/completions", body))


class _AsyncChatCompletions:
    def __init__(self, client: AsyncClient):
        self._client = client

    async def create(
        self, **kwargs: Any
    ) -> ChatCompletionResponse | AsyncIterator[ChatCompletionChunk]:
        body = _body(kwargs)
        path = "/v1/chat/completions"
        if body.get("stream"):
            return _typed(await self._client.stream(path, body), ChatCompletionChunk)
        return ChatCompletionResponse(**await self._client.request("POST", path, body))


class _AsyncModels:
    def __init__(self, client: AsyncClient):
        self._client = client

    async def list(self) -> ModelList:
        return ModelList(**await self._client.request("GET", "/v1/models"))


async def _typed(payloads: AsyncIterator[dict], model: type) -> AsyncIterator[Any]:
    async for payload in payloads:
        yield model(**payload)


__all__ = ["APIConnectionError", "APIError", "AsyncClient", "Client"]
