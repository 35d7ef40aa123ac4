"""``pagedserve bench``: the serving benchmark (``pagedserve.benchmarks``) against a running
OpenAI-compatible server, or multi-step agent programs with ``--dataset agent``."""

from __future__ import annotations

import argparse
import os
import sys

from pagedserve.benchmarks.datasets import (
    DATASETS,
    DEFAULT_RANDOM_INPUT_LEN,
    DEFAULT_RANDOM_OUTPUT_LEN,
)
from pagedserve.benchmarks.request import ENDPOINTS


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
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME",
        help="LoRA adapters the server serves (its --lora-modules names): each request takes "
        "one at random as its model, as vLLM's bench does (default: none, the base model)",
    )
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
        "(--agent-program) through SGLang's native API: --num-prompts programs, "
        "--max-concurrency at once (default 8)",
    )
    parser.add_argument(
        "--agent-program",
        choices=["select", "tools"],
        default="select",
        help="--dataset agent's program: select (select a tool, fork two thoughts, a "
        "JSON-schema answer) or tools (call a function in the model's tool-call format, read "
        "its result, answer) (default %(default)s)",
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


def run_bench(args: argparse.Namespace) -> int:
    args.api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    if args.dataset != "agent":
        from pagedserve.benchmarks.serve import main

        return main(args)
    if args.plot:
        print(
            "pagedserve bench: error: --plot draws single requests; --dataset agent times "
            "programs: drop it",
            file=sys.stderr,
        )
        return 2
    from pagedserve.benchmarks.agent import run_agent_bench

    return run_agent_bench(args)
