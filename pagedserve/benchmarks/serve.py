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
  file vLLM would name; ``--plot`` draws the distributions (``plot.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from datetime import datetime
from pathlib import Path

import httpx
from tqdm import tqdm

from pagedserve.benchmarks.datasets import (
    DATASETS,
    DEFAULT_RANDOM_INPUT_LEN,
    DEFAULT_RANDOM_OUTPUT_LEN,
    SHAREGPT_NEEDS_PATH,
    PromptBuilder,
    PromptTokenizer,
    SampleRequest,
    ServerTokenizer,
    local_tokenizer,
)
from pagedserve.benchmarks.metrics import compute_metrics, format_table
from pagedserve.benchmarks.plot import require_matplotlib
from pagedserve.benchmarks.request import (
    ENDPOINTS,
    RequestFuncOutput,
    request_body,
    send_request,
    unreachable,
)
from pagedserve.presets import DEMO_MODEL


def arrival_gaps(num: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Gaps before each request: 0 at rate inf, else gamma(shape=burstiness, mean=1/rate)."""
    if request_rate == float("inf"):
        return [0.0] * num
    rng = random.Random(seed)
    theta = 1.0 / (request_rate * burstiness)
    return [rng.gammavariate(burstiness, theta) for _ in range(num)]


def count_output_tokens(outputs: list[RequestFuncOutput], prompts: PromptBuilder) -> None:
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
) -> tuple[list[RequestFuncOutput], float]:
    url = args.base_url.rstrip("/") + ENDPOINTS[args.endpoint]
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limit = args.max_concurrency or len(samples)
    semaphore = asyncio.Semaphore(limit)
    bar = tqdm(total=len(samples), disable=args.disable_tqdm, desc="requests")

    models = lora_models(args, len(samples))

    async def one(client: httpx.AsyncClient, sample: SampleRequest, model) -> RequestFuncOutput:
        async with semaphore:
            result = await send_request(client, url, request_body(args, sample, model), sample)
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
        for gap, sample, model in zip(gaps, samples, models, strict=True):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(client, sample, model)))
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    bar.close()
    return list(outputs), duration


def lora_models(args: argparse.Namespace, num: int) -> list[str | None]:
    """Each request's model: one of ``--lora-modules`` at random (seeded), as vLLM's bench
    spreads requests over adapters; None (the base model) without them."""
    modules = getattr(args, "lora_modules", None)
    if not modules:
        return [None] * num
    rng = random.Random(args.seed)
    return [rng.choice(modules) for _ in range(num)]


def check_args(args: argparse.Namespace) -> None:
    """What can be refused before the server is asked anything."""
    if args.dataset == "sharegpt" and not args.dataset_path:
        raise ValueError(SHAREGPT_NEEDS_PATH)
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


def note(message: str) -> None:
    print(f"pagedserve bench: {message}", file=sys.stderr)


def server_model(args: argparse.Namespace, http: httpx.Client) -> None:
    """Fill in ``--model`` (when not given) and the server's ``max_model_len`` from /v1/models."""
    try:
        response = http.get("/v1/models")
    except httpx.TransportError as exc:
        raise unreachable(args.base_url, exc) from None
    try:
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
        note(f"--model {args.model} (the first model of {args.base_url}/v1/models)")
    name = args.served_model_name or args.model
    card = next((c for c in cards if c.get("id") == name), None)
    args.max_model_len = card.get("max_model_len") if card else None
    served = [c.get("id") for c in cards]
    missing = [m for m in getattr(args, "lora_modules", None) or [] if m not in served]
    if missing:
        raise ValueError(
            f"--lora-modules {' '.join(missing)}: {args.base_url} does not serve "
            f"{'it' if len(missing) == 1 else 'them'} (its /v1/models: {', '.join(served)}); "
            "load the adapters first (serve --lora-modules, or POST /v1/load_lora_adapter)"
        )


def prompt_tokenizer(args: argparse.Namespace, http: httpx.Client) -> PromptTokenizer | None:
    """The server's own tokenizer, else --model's when it is local (``--tokenizer`` is read
    before the server is asked)."""
    server = ServerTokenizer(http, args.served_model_name or args.model)
    if server.works():
        note(f"prompt lengths measured with {args.base_url}/tokenize")
        return server
    if args.model == DEMO_MODEL or (Path(args.model) / "tokenizer.json").is_file():
        note(f"prompt lengths measured with the tokenizer of --model {args.model}")
        return local_tokenizer(args.model)
    note(
        f"no tokenizer ({args.base_url}/tokenize does not answer and --model is not a local "
        "directory): prompt lengths are counted in words, not tokens; pass --tokenizer DIR"
    )
    return None


def fit_lengths(args: argparse.Namespace) -> None:
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
    note(
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


def main(args: argparse.Namespace) -> int:
    """The whole benchmark against ``args.base_url``: 0 when a request succeeded, 2 on a setting
    that cannot work (said on stderr before any request is sent)."""
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    http = httpx.Client(
        base_url=args.base_url.rstrip("/"), headers=headers, timeout=60.0, trust_env=False
    )
    with http:
        try:
            check_args(args)
            given = local_tokenizer(args.tokenizer) if args.tokenizer else None
            server_model(args, http)
            prompts = PromptBuilder(given if given is not None else prompt_tokenizer(args, http))
            fit_lengths(args)
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
    note(f"result written to {output_file}")
    if args.plot:
        from pagedserve.benchmarks.plot import plot

        plot(outputs, args.plot, title=f"{args.model}, {args.num_prompts} requests")
        note(f"plot drawn to {args.plot}")
    failed = metrics["failed"]
    if failed:
        print(
            f"{failed} of {len(outputs)} requests failed; first error: {result['errors'][0]}",
            file=sys.stderr,
        )
    return 0 if metrics["completed"] else 1
