"""One streamed request to an OpenAI-compatible server, timed as vLLM's benchmark client times it:
TTFT from the request to the first chunk with non-empty text, ITL between content chunks."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx

from pagedserve.benchmarks.datasets import SampleRequest

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


def unreachable(base_url: str, exc: Exception) -> ValueError:
    """What to say when nothing answers at ``--base-url``: no request could succeed."""
    return ValueError(
        f"cannot reach a server at {base_url} ({type(exc).__name__}: {exc}); is it running? "
        "Start one with `pagedserve serve`, or give its address with --base-url"
    )


def check_reachable(base_url: str) -> None:
    """``unreachable`` unless something answers HTTP at ``base_url`` (any status will do)."""
    try:
        httpx.get(base_url.rstrip("/") + "/v1/models", timeout=10.0, trust_env=False)
    except httpx.TransportError as exc:
        raise unreachable(base_url, exc) from None


@dataclass(slots=True)
class RequestFuncOutput:
    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    generated_text: str = ""
    start: float = 0.0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)
    num_chunks: int = 0
    error: str = ""


def request_body(args: argparse.Namespace, sample: SampleRequest, model: str | None = None) -> dict:
    """``model``: a LoRA adapter's name for this request (``--lora-modules``), else the model's."""
    body = {
        "model": model or args.served_model_name or args.model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": args.temperature,
        "max_tokens": sample.output_len,
    }
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": sample.prompt}]
        body["max_completion_tokens"] = sample.output_len
    else:
        body["prompt"] = sample.prompt
    if args.ignore_eos:
        body["ignore_eos"] = True
    return body


def chunk_text(chunk: dict) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


async def _sse_events(response: httpx.Response) -> AsyncIterator[dict | None]:
    async for line in response.aiter_lines():
        line = line.strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            yield None
            return
        yield json.loads(data)


async def send_request(
    client: httpx.AsyncClient, url: str, body: dict, sample: SampleRequest
) -> RequestFuncOutput:
    """One streamed request, timed to its end (failed or not); ``output_tokens`` stays 0 when the server sends no usage
    (``count_output_tokens`` fills it in after the run, off the clock)."""
    out = RequestFuncOutput(prompt_len=sample.prompt_len)
    usage, chunks, text = None, 0, []
    out.start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                out.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return out
            async for event in _sse_events(response):
                if event is None:
                    out.success = True
                    break
                if "error" in event:
                    out.error = str(event["error"])[:200]
                    return out
                usage = event.get("usage") or usage
                piece = chunk_text(event)
                if not piece:
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    out.ttft = now - out.start
                else:
                    out.itl.append(now - last)
                out.token_times.append(now)
                last, chunks = now, chunks + 1
                text.append(piece)
        if not out.success:
            out.error = "stream ended without data: [DONE]"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, TypeError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
        return out
    finally:  # a failed request's end too: the plot's requests in flight need it
        out.latency = time.perf_counter() - out.start
    out.generated_text = "".join(text)
    out.output_tokens = (usage or {}).get("completion_tokens") or 0
    out.num_chunks = chunks
    out.prompt_len = (usage or {}).get("prompt_tokens") or sample.prompt_len
    return out
