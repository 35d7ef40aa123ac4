"""`pagedserve bench`: a serving benchmark in the shape of vLLM's ``bench serve``.

Streams requests to any OpenAI-compatible server (``/v1/completions`` or ``/v1/chat/completions``)
and reports TTFT, TPOT, ITL and E2E latency and throughput under vLLM's JSON field names.

- Model: ``--model``, else the first model the server lists at ``/v1/models`` (as vLLM does).
- Prompt lengths are tokens as the server counts a prompt (its special tokens included, as vLLM's
  random dataset aims), measured with ``--tokenizer`` when given, else with the server's own
  ``/tokenize`` and ``/detokenize`` (pagedserve's and vLLM's), else with the model's tokenizer
  when ``--model`` is ``demo`` or a local directory; with none of them they are word counts, and
  the command says so.
- Lengths against ``max_model_len`` (from ``/v1/models``): the default random lengths shrink to
  fit it; lengths you set that cannot fit are refused before anything is sent.
- TTFT: request sent -> first chunk with non-empty text. ITL: gaps between content chunks.
- TPOT: ``(e2e - ttft) / (output_tokens - 1)`` per request with more than one output token.
- Token counts: the server's ``usage`` when it streams one (``stream_options.include_usage``),
  else the tokenizer's count of the text, else the number of content chunks (output) or the
  dataset's length (input).
- The result: a table on stdout and JSON under vLLM's field names, in ``--output-file`` or in the
  file vLLM would name; ``--plot`` draws the distributions (``bench_plot``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Protocol

import httpx
from tqdm import tqdm

from pagedserve.benchmarks.plot import require_matplotlib
from pagedserve.presets import DEMO_MODEL, demo_model_dir

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
PERCENTILES = (90, 99)
DEFAULT_RANDOM_INPUT_LEN = 1024
DEFAULT_RANDOM_OUTPUT_LEN = 128
MAX_LENGTH_ADJUSTMENTS = 8
WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force "
    "education river light green quick brown fox jumps over lazy dog paper model engine cache"
).split()


@dataclass(slots=True)
class SampleRequest:
    prompt: str
    prompt_len: int
    output_len: int


@dataclass(slots=True)
class RequestOutput:
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


# ---- tokenizers and datasets


class PromptTokenizer(Protocol):
    """What the datasets need of a tokenizer: pagedserve's ``Tokenizer`` and the server's."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class ServerTokenizer:
    """The server's ``POST /tokenize`` and ``POST /detokenize`` (pagedserve's and vLLM's)."""

    def __init__(self, http: httpx.Client, model: str) -> None:
        self.http, self.model = http, model

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        body = {"model": self.model, "prompt": text, "add_special_tokens": add_special_tokens}
        response = self.http.post("/tokenize", json=body)
        response.raise_for_status()
        return response.json()["tokens"]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        response = self.http.post("/detokenize", json={"model": self.model, "tokens": ids})
        response.raise_for_status()
        return response.json()["prompt"]

    def works(self) -> bool:
        try:
            return bool(self.encode("Hello", add_special_tokens=False))
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return False


def tokenizer_file(spec: str) -> Path:
    """The tokenizer.json that ``--tokenizer`` names: ``demo``, a model directory or the file."""
    path = demo_model_dir() if spec == DEMO_MODEL else Path(spec).expanduser()
    file = path / "tokenizer.json" if path.is_dir() else path
    if file.name != "tokenizer.json" or not file.is_file():
        raise ValueError(
            f"--tokenizer {spec!r}: no tokenizer.json there; give a model directory, the path "
            f"of its tokenizer.json, or {DEMO_MODEL} (the embedded demo model's)"
        )
    return file


def local_tokenizer(spec: str) -> PromptTokenizer:
    """A tokenizer on this machine, read as pagedserve's server reads it (GLM-4's prompt prefix
    included), so that its counts are the server's."""
    from pagedserve.models.tokenizer import Tokenizer

    return Tokenizer(tokenizer_file(spec).parent)


class PromptBuilder:
    """Token counts and random prompts of a given length, with a tokenizer or (estimates) without."""

    def __init__(self, tok: PromptTokenizer | None) -> None:
        self.tok = tok
        # what the server adds to a prompt (GLM-4: [gMASK]<sop>)
        self.num_special = self.count("x") - self.count("x", as_prompt=False) if tok else 0

    def count(self, text: str, as_prompt: bool = True) -> int | None:
        """Tokens of ``text``: as a prompt (the server's special tokens included) or bare."""
        return None if self.tok is None else len(self.tok.encode(text, as_prompt))

    def text(self, rng: random.Random, num_tokens: int, as_prompt: bool = True) -> tuple[str, int]:
        """(random words of ``num_tokens`` tokens, their real count). As vLLM's random dataset
        does: cut the words' token ids, decode, re-encode, adjust until the count is exact. The
        count is what the last try gave if no cut lands exactly; with no tokenizer, the words."""
        words = " ".join(rng.choice(WORDS) for _ in range(num_tokens))
        if self.tok is None:
            return words, num_tokens
        tok = self.tok
        extra = self.num_special if as_prompt else 0
        ids = tok.encode(words, add_special_tokens=False)[: max(1, num_tokens - extra)]
        for _ in range(MAX_LENGTH_ADJUSTMENTS):
            text = tok.decode(ids)
            got = self.count(text, as_prompt)
            if got == num_tokens:
                break
            ids = tok.encode(text, add_special_tokens=False)
            if got > num_tokens:
                ids = ids[: max(1, len(ids) - (got - num_tokens))]
            else:
                more = tok.encode(" " + rng.choice(WORDS), add_special_tokens=False)
                ids += more[: num_tokens - got]
        return text, got


def _lengths(rng: random.Random, mean: int, range_ratio: float) -> int:
    low, high = int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))
    return max(1, rng.randint(low, high))


def random_dataset(args: argparse.Namespace, prompts: PromptBuilder) -> list[SampleRequest]:
    rng = random.Random(args.seed)
    out = []
    for _ in range(args.num_prompts):
        n_in = _lengths(rng, args.random_input_len, args.random_range_ratio)
        n_out = _lengths(rng, args.random_output_len, args.random_range_ratio)
        prompt, n_in = prompts.text(rng, n_in)
        out.append(SampleRequest(prompt, n_in, n_out))
    return out


def prefix_repetition_dataset(
    args: argparse.Namespace, prompts: PromptBuilder
) -> list[SampleRequest]:
    rng = random.Random(args.seed)
    prefixes = [
        prompts.text(rng, args.prefix_repetition_prefix_len)[0]
        for _ in range(args.prefix_repetition_num_prefixes)
    ]
    out = []
    for i in range(args.num_prompts):
        suffix, _ = prompts.text(rng, args.prefix_repetition_suffix_len, as_prompt=False)
        prompt = prefixes[i % len(prefixes)] + " " + suffix
        n_in = prompts.count(prompt) or (
            args.prefix_repetition_prefix_len + args.prefix_repetition_suffix_len
        )
        out.append(SampleRequest(prompt, n_in, args.prefix_repetition_output_len))
    rng.shuffle(out)
    return out


def sharegpt_dataset(args: argparse.Namespace, prompts: PromptBuilder) -> list[SampleRequest]:
    if not args.dataset_path:
        raise ValueError(
            "--dataset sharegpt needs --dataset-path FILE.json (ShareGPT format: a list "
            'of {"conversations": [{"from": "human", "value": ...}, ...]})'
        )
    data = json.loads(Path(args.dataset_path).read_text())
    pairs = [
        (c["conversations"][0]["value"], c["conversations"][1]["value"])
        for c in data
        if len(c.get("conversations", [])) >= 2
    ]
    random.Random(args.seed).shuffle(pairs)
    max_len = min(2048, args.max_model_len or 2048)
    out = []
    for prompt, reply in pairs:
        n_in = prompts.count(prompt) or len(prompt.split())
        n_out = args.sharegpt_output_len or prompts.count(reply, False) or len(reply.split())
        if n_in >= 4 and n_out >= 4 and n_in <= 1024 and n_in + n_out <= max_len:
            out.append(SampleRequest(prompt, n_in, n_out))
        if len(out) == args.num_prompts:
            break
    if len(out) < args.num_prompts:
        raise ValueError(
            f"{args.dataset_path} gives {len(out)} usable conversations (prompt "
            f"4..1024 tokens, prompt+reply <= {max_len}); --num-prompts is "
            f"{args.num_prompts}: lower it or use a larger file"
        )
    return out


DATASETS = {
    "random": random_dataset,
    "sharegpt": sharegpt_dataset,
    "prefix-repetition": prefix_repetition_dataset,
}


# ---- one streamed request


def request_body(args: argparse.Namespace, sample: SampleRequest) -> dict:
    body = {
        "model": args.served_model_name or args.model,
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
) -> RequestOutput:
    """One streamed request, timed to its end (failed or not); ``output_tokens`` stays 0 when the server sends no usage
    (``count_output_tokens`` fills it in after the run, off the clock)."""
    out = RequestOutput(prompt_len=sample.prompt_len)
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


# ---- arrivals and the run


def arrival_gaps(num: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Gaps before each request: 0 at rate inf, else gamma(shape=burstiness, mean=1/rate)."""
    if request_rate == float("inf"):
        return [0.0] * num
    rng = random.Random(seed)
    theta = 1.0 / (request_rate * burstiness)
    return [rng.gammavariate(burstiness, theta) for _ in range(num)]


def count_output_tokens(outputs: list[RequestOutput], prompts: PromptBuilder) -> None:
    """Output tokens of the requests whose server sent no usage: the tokenizer's count of the
    text, else the number of content chunks."""
    for o in outputs:
        if o.success and not o.output_tokens:
            try:
                counted = prompts.count(o.generated_text, as_prompt=False)
            except httpx.HTTPError:  # the server's tokenizer is gone
                counted = None
            o.output_tokens = counted or o.num_chunks


async def run_benchmark(
    args: argparse.Namespace, samples: list[SampleRequest]
) -> tuple[list[RequestOutput], float]:
    url = args.base_url.rstrip("/") + ENDPOINTS[args.endpoint]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limit = args.max_concurrency or len(samples)
    semaphore = asyncio.Semaphore(limit)
    bar = tqdm(total=len(samples), disable=args.disable_tqdm, desc="requests")

    async def one(client: httpx.AsyncClient, sample: SampleRequest) -> RequestOutput:
        async with semaphore:
            result = await send_request(client, url, request_body(args, sample), sample)
        bar.update(1)
        return result

    gaps = arrival_gaps(len(samples), args.request_rate, args.burstiness, args.seed)
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(
        timeout=timeout, limits=limits, headers=headers, trust_env=False
    ) as client:
        start = time.perf_counter()
        tasks = []
        for gap, sample in zip(gaps, samples, strict=True):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(client, sample)))
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return list(outputs), duration


# ---- metrics


def _percentile(values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _stats(name: str, seconds: list[float]) -> dict[str, float]:
    ms = [s * 1000 for s in seconds]
    stats = {
        f"mean_{name}_ms": statistics.fmean(ms) if ms else 0.0,
        f"median_{name}_ms": statistics.median(ms) if ms else 0.0,
        f"std_{name}_ms": statistics.pstdev(ms) if ms else 0.0,
    }
    stats.update({f"p{p}_{name}_ms": _percentile(ms, p) for p in PERCENTILES})
    return stats


def compute_metrics(outputs: list[RequestOutput], duration: float) -> dict:
    done = [o for o in outputs if o.success]
    total_in = sum(o.prompt_len for o in done)
    total_out = sum(o.output_tokens for o in done)
    tpots = [(o.latency - o.ttft) / (o.output_tokens - 1) for o in done if o.output_tokens > 1]
    metrics = {
        "duration": duration,
        "completed": len(done),
        "failed": len(outputs) - len(done),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(done) / duration if duration else 0.0,
        "output_throughput": total_out / duration if duration else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration else 0.0,
    }
    metrics |= _stats("ttft", [o.ttft for o in done])
    metrics |= _stats("tpot", tpots)
    metrics |= _stats("itl", [gap for o in done for gap in o.itl])
    metrics |= _stats("e2el", [o.latency for o in done])
    metrics["max_output_tokens_per_s"] = max(throughput_series(outputs)[1], default=0.0)
    return metrics


def throughput_series(outputs: list[RequestOutput]) -> tuple[list[float], list[float]]:
    """Output tokens per second in one-second bins from the first request's start; a chunk
    counts as its request's tokens per chunk (1 when the server streams a token a chunk)."""
    if not outputs:
        return [], []
    t0 = min(o.start for o in outputs)
    weighted = [
        (t - t0, o.output_tokens / o.num_chunks if o.num_chunks and o.output_tokens else 1.0)
        for o in outputs
        if o.success
        for t in o.token_times
    ]
    bins = [0.0] * (int(max((t for t, _ in weighted), default=0.0)) + 1)
    for t, tokens in weighted:
        bins[int(t)] += tokens
    return [float(i) for i in range(len(bins))], bins


def format_table(metrics: dict) -> str:
    rows = [
        ("Successful requests:", metrics["completed"]),
        ("Failed requests:", metrics["failed"]),
        ("Benchmark duration (s):", metrics["duration"]),
        ("Total input tokens:", metrics["total_input_tokens"]),
        ("Total generated tokens:", metrics["total_output_tokens"]),
        ("Request throughput (req/s):", metrics["request_throughput"]),
        ("Output token throughput (tok/s):", metrics["output_throughput"]),
        ("Total token throughput (tok/s):", metrics["total_token_throughput"]),
    ]
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]
    lines += [f"{k:<40}{v:<10.2f}" if isinstance(v, float) else f"{k:<40}{v:<10}" for k, v in rows]
    titles = {
        "ttft": "Time to First Token",
        "tpot": "Time per Output Token (excl. 1st token)",
        "itl": "Inter-token Latency",
        "e2el": "End-to-end Latency",
    }
    for key, title in titles.items():
        lines.append("{s:{c}^50}".format(s=f" {title} ", c="-"))
        label = key.upper()
        lines.append(f"{f'Mean {label} (ms):':<40}{metrics[f'mean_{key}_ms']:<10.2f}")
        lines.append(f"{f'Median {label} (ms):':<40}{metrics[f'median_{key}_ms']:<10.2f}")
        lines += [
            f"{f'P{p} {label} (ms):':<40}{metrics[f'p{p}_{key}_ms']:<10.2f}" for p in PERCENTILES
        ]
    lines.append("=" * 50)
    return "\n".join(lines)


# ---- CLI


def _rate(value: str) -> float:
    rate = float(value)
    if rate <= 0:
        raise argparse.ArgumentTypeError(f"--request-rate {value} must be > 0 (or inf)")
    return rate


def add_bench_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server's URL")
    parser.add_argument("--endpoint", choices=list(ENDPOINTS), default="completions")
    parser.add_argument(
        "--model",
        default=None,
        help="model name sent in each request (default: the first of the server's /v1/models)",
    )
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument(
        "--api-key", default=None, help="the server's API key (default: $OPENAI_API_KEY)"
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="model directory, its tokenizer.json, or demo, for exact prompt lengths "
        "(default: the server's /tokenize, else --model's tokenizer when it is local)",
    )
    parser.add_argument(
        "--dataset",
        "--dataset-name",
        dest="dataset",
        choices=[*DATASETS, "agent"],
        default="random",
        help="random, sharegpt or agent (default %(default)s); agent runs multi-step programs "
        "(select, fork, constrained gen) through SGLang's native API: --num-prompts programs, "
        "--max-concurrency at once (default 8)",
    )
    parser.add_argument("--dataset-path", default=None, help="ShareGPT JSON file")
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument(
        "--request-rate",
        type=_rate,
        default=float("inf"),
        help="requests/s (Poisson when burstiness is 1); inf sends all at once",
    )
    parser.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of the arrival gaps: <1 burstier, >1 more uniform",
    )
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument(
        "--random-input-len",
        type=int,
        default=None,
        help=f"prompt tokens (default {DEFAULT_RANDOM_INPUT_LEN}, lowered to fit the server's "
        "max_model_len)",
    )
    parser.add_argument(
        "--random-output-len",
        type=int,
        default=None,
        help=f"max_tokens (default {DEFAULT_RANDOM_OUTPUT_LEN}, lowered with the input length)",
    )
    parser.add_argument("--random-range-ratio", type=float, default=0.0)
    parser.add_argument("--sharegpt-output-len", type=int, default=None)
    parser.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    parser.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    parser.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    parser.add_argument("--prefix-repetition-output-len", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=6 * 3600.0, help="seconds per request")
    parser.add_argument(
        "--output-file",
        default=None,
        help="write the result JSON here (default: a file in the current directory named as "
        "vLLM names it, openai-{rate}qps[-concurrency{n}]-{model}-{date}.json)",
    )
    parser.add_argument(
        "--save-detailed",
        action="store_true",
        help="keep per-request lists (ttfts, itls, ...) in the JSON",
    )
    parser.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png",
        help="draw TTFT, TPOT, ITL and E2E latency histograms, output tokens/s and requests in "
        "flight over time (needs matplotlib: pip install 'pagedserve[plot]')",
    )
    parser.add_argument("--disable-tqdm", action="store_true")
    parser.set_defaults(max_model_len=None)  # the server's, from /v1/models
    return parser


def _check(args: argparse.Namespace) -> None:
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts {args.num_prompts} must be at least 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency {args.max_concurrency} must be at least 1")
    if args.burstiness <= 0:
        raise ValueError(f"--burstiness {args.burstiness} must be > 0 (1 is Poisson)")
    if not 0.0 <= args.random_range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio {args.random_range_ratio} must be in [0, 1)")
    for flag in ("random_input_len", "random_output_len"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} {value} must be at least 1")
    if args.plot:
        require_matplotlib()


def _note(message: str) -> None:
    print(f"pagedserve bench: {message}", file=sys.stderr)


def _server_model(args: argparse.Namespace, http: httpx.Client) -> None:
    """Fill in ``--model`` (when not given) and the server's ``max_model_len`` from /v1/models."""
    try:
        response = http.get("/v1/models")
        response.raise_for_status()
        cards = response.json()["data"]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        if args.model is None:
            raise ValueError(
                f"--model is not given and {args.base_url}/v1/models does not list the served "
                f"models ({type(exc).__name__}: {exc}); pass --model"
            ) from None
        return
    if args.model is None:
        if not cards:
            raise ValueError(f"{args.base_url}/v1/models lists no model; pass --model")
        args.model = cards[0]["id"]
        _note(f"--model {args.model} (the first model of {args.base_url}/v1/models)")
    name = args.served_model_name or args.model
    card = next((c for c in cards if c.get("id") == name), None)
    args.max_model_len = card.get("max_model_len") if card else None


def _prompt_tokenizer(args: argparse.Namespace, http: httpx.Client) -> PromptTokenizer | None:
    if args.tokenizer:
        return local_tokenizer(args.tokenizer)
    server = ServerTokenizer(http, args.served_model_name or args.model)
    if server.works():
        _note(f"prompt lengths measured with {args.base_url}/tokenize")
        return server
    if args.model == DEMO_MODEL or (Path(args.model) / "tokenizer.json").is_file():
        _note(f"prompt lengths measured with the tokenizer of --model {args.model}")
        return local_tokenizer(args.model)
    _note(
        f"no tokenizer ({args.base_url}/tokenize does not answer and --model is not a local "
        "directory): prompt lengths are counted in words, not tokens; pass --tokenizer DIR"
    )
    return None


def _fit_lengths(args: argparse.Namespace) -> None:
    """Random lengths: the defaults shrink to fit the server's max_model_len; lengths that were
    set and cannot fit are refused, since every request would fail."""
    chosen = args.random_input_len is not None or args.random_output_len is not None
    n_in = args.random_input_len or DEFAULT_RANDOM_INPUT_LEN
    n_out = args.random_output_len or DEFAULT_RANDOM_OUTPUT_LEN
    args.random_input_len, args.random_output_len = n_in, n_out
    limit, ratio = args.max_model_len, args.random_range_ratio
    if limit is None:
        return
    if args.dataset == "prefix-repetition":
        longest = (
            args.prefix_repetition_prefix_len
            + args.prefix_repetition_suffix_len
            + args.prefix_repetition_output_len
        )
        if longest > limit:
            raise ValueError(
                f"prefix + suffix + output lengths are {longest} tokens, more than the server's "
                f"max_model_len {limit}: every request would fail; lower the "
                "--prefix-repetition-*-len flags"
            )
        return
    if args.dataset != "random":
        return
    longest = int(n_in * (1 + ratio)) + int(n_out * (1 + ratio))
    if longest <= limit:
        return
    if chosen:
        raise ValueError(
            f"--random-input-len {n_in} + --random-output-len {n_out} (up to {longest} tokens "
            f"with --random-range-ratio {ratio}) is more than the server's max_model_len "
            f"{limit}: every request would fail; lower them"
        )
    scale = limit / ((n_in + n_out) * (1 + ratio))
    args.random_input_len = max(1, int(n_in * scale))
    args.random_output_len = max(1, int(n_out * scale))
    _note(
        f"the server's max_model_len is {limit}: random requests are "
        f"{args.random_input_len} tokens in and {args.random_output_len} out "
        "(--random-input-len and --random-output-len set them)"
    )


def default_output_file(args: argparse.Namespace, date: str) -> str:
    """vLLM's ``bench serve`` name for a saved result; a model path keeps its last part."""
    rate = "inf" if args.request_rate == float("inf") else f"{args.request_rate:g}"
    concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
    model = Path(args.model.rstrip("/")).name or "model"
    return f"openai-{rate}qps{concurrency}-{model}-{date}.json"


def run_bench(args: argparse.Namespace) -> int:
    args.api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    if args.dataset == "agent":
        from pagedserve.benchmarks.agent import run_agent_bench

        if args.plot:
            _note("error: --plot draws single requests; --dataset agent times programs: drop it")
            return 2
        return run_agent_bench(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    http = httpx.Client(
        base_url=args.base_url.rstrip("/"), headers=headers, timeout=60.0, trust_env=False
    )
    with http:
        try:
            _check(args)
            _server_model(args, http)
            prompts = PromptBuilder(_prompt_tokenizer(args, http))
            _fit_lengths(args)
            samples = DATASETS[args.dataset](args, prompts)
        except (ValueError, OSError, httpx.HTTPError) as exc:
            print(f"pagedserve bench: error: {exc}", file=sys.stderr)
            return 2
        outputs, duration = asyncio.run(run_benchmark(args, samples))
        count_output_tokens(outputs, prompts)
    metrics = compute_metrics(outputs, duration)
    print(format_table(metrics))
    result = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai",
        "endpoint": ENDPOINTS[args.endpoint],
        "model_id": args.model,
        "dataset": args.dataset,
        "num_prompts": args.num_prompts,
        "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        **metrics,
        "errors": [o.error for o in outputs if not o.success],
    }
    if args.save_detailed:
        result |= {
            "input_lens": [o.prompt_len for o in outputs],
            "output_lens": [o.output_tokens for o in outputs],
            "ttfts": [o.ttft for o in outputs],
            "itls": [o.itl for o in outputs],
            "generated_texts": [o.generated_text for o in outputs],
        }
    output_file = args.output_file or default_output_file(args, result["date"])
    Path(output_file).write_text(json.dumps(result, indent=2))
    _note(f"result written to {output_file}")
    if args.plot:
        from pagedserve.benchmarks.plot import plot

        plot(outputs, args.plot, title=f"{args.model}, {args.num_prompts} requests")
        _note(f"plot drawn to {args.plot}")
    failed = metrics["failed"]
    if failed:
        print(
            f"{failed} of {len(outputs)} requests failed; first error: {result['errors'][0]}",
            file=sys.stderr,
        )
    return 0 if metrics["completed"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = add_bench_args(
        argparse.ArgumentParser(
            prog="pagedserve bench",
            description=__doc__,
            formatter_class=argparse.RawTextHelpFormatter,
        )
    )
    return run_bench(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
