"""Data-parallel routing on Ray Serve: prefix-aware against Ray Serve's power-of-two-choices, over
two replicas, on multi-turn conversations that share system prompts.

    python -m benchmarks.ray_serve [--model demo|122m] [--conversations 48] [--concurrency 12]
                                   [--turns 3] [--runs 3]

For each KV pool size and each setting it starts ``pagedserve serve --data-parallel-backend ray``
(a Ray instance of its own on this machine, one CPU per replica) on the model: ``demo``, the
embedded demo model (~5M parameters, whose prefill costs little next to the serving around it),
or ``122m``, the random ~122M GLM-4-0414 of ``benchmarks.bench_models`` in INT4 (W4A16), on
which a prompt that misses the cache costs its prefill, as a real model's does:

- ``single``: one replica with the pages of both, whose prefix cache sees every turn (the hit
  rate to match);
- ``prefix-aware``: two replicas, ``--request-router prefix-aware`` (the default);
- ``power-of-two``: two replicas, ``--request-router power-of-two`` (Ray Serve's default).

The pool sizes are the replicas' pages as a share of the workload's working set (the full
histories of the conversations that run at once, in blocks): ``tight`` (0.65: a replica holds
about half of them, not all; one with the pages of both holds them all) and ``ample`` (1.5: each
replica could hold every one).

Each conversation is a chat over a document: one of the shared system prompts, a first turn
that brings a passage of prose (the document) and a question, then short follow-up questions.
Every turn sends the whole history so far (streamed chat completions, greedy, a fixed number of
tokens per answer), each turn a pause after the last one's answer (the user reads it: seconds
drawn from an exponential of mean ``--think-time``, the same in every setting); a number of
conversations run at once, and a new one starts as soon as one ends. Without the pause, a next
turn would arrive just as its replica finished the last, with the shortest queue, and
power-of-two would keep conversations in place by accident of a closed loop.

Measured per setting: the prefix-cache hit rate (the servers' own counters, from ``/metrics``:
prompt tokens found in the cache over those looked up), the time to the first token (client
side, at the first chunk that carries a token; also its median per turn) and the throughput.
The targets: a hit rate within 10% of the single replica's, and a median time to first token at
least 1.5x better than power-of-two's. With ``--runs N`` every setting runs N times (in turn, run after run); the tables
take each figure's median, and the results keep every run and the range of the two ratios.

Writes benchmarks/results/ray_serve.json (``ray_serve_122m.json`` for ``--model 122m``, with
``_c4`` added for ``--concurrency 4``) with the machine and its load (the load averages before
and after): server and client share the machine, so the times depend on how busy it is.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import statistics
import time
from pathlib import Path

import httpx

from benchmarks.results import spread, write_result
from pagedserve.testing import serve

PACKAGE = Path(__file__).resolve().parents[1] / "pagedserve"
PROSE = PACKAGE / "data" / "demo_heldout_prose.txt"
SETTINGS = {
    "single": ["--data-parallel-size", "1"],
    "prefix-aware": ["--data-parallel-size", "2", "--request-router", "prefix-aware"],
    "power-of-two": ["--data-parallel-size", "2", "--request-router", "power-of-two"],
}
SERVER_FLAGS = [
    *("--data-parallel-backend", "ray", "--num-cpus-per-replica", "1"),
    *("--max-model-len", "2048", "--max-num-seqs", "16"),
]
CHAT_0414 = ["--chat-template", "glm4-0414"]  # the bench models ship no template of their own
POOLS = {"tight": 0.65, "ample": 1.5}  # a replica's pages, as a share of the working set
BLOCK_SIZE = 16
TEMPLATE_TOKENS = 8  # a chat message's role markers, about
TARGET_HIT_RATE_SHARE = 0.9  # of the single replica's
TARGET_TTFT_SPEEDUP = 1.5  # over power-of-two
DEFAULT_CONCURRENCY = 12
REPORT_WAIT_S = 3.0  # the replicas report their counters every second


def passages(rng: random.Random, count: int, chars: int) -> list[str]:
    text = re.sub(r"\s+", " ", PROSE.read_text())
    starts = [rng.randrange(len(text) - chars) for _ in range(count)]
    return [text[s : s + chars] for s in starts]


def conversations(args: argparse.Namespace) -> list[tuple[str, list[str], list[float]]]:
    """(system prompt, the user's turns, the user's pauses before each turn after the first, in
    seconds) per conversation: the same for every setting."""
    rng = random.Random(0)
    systems = [
        f"You are assistant number {i}. Follow the house style below in every answer. " + p
        for i, p in enumerate(passages(rng, args.system_prompts, args.system_chars))
    ]
    out = []
    for c in range(args.conversations):
        (document,) = passages(rng, 1, args.document_chars)
        questions = passages(rng, args.turns, args.question_chars)
        turns = [f"Here is a document: {document}\n\nWhat does it say about: {questions[0]}"]
        turns += [f"And what about: {q}" for q in questions[1:]]
        pauses = [rng.expovariate(1 / args.think_time) if args.think_time else 0.0 for _ in turns]
        out.append((systems[c % len(systems)], turns, pauses[1:]))
    return out


async def talk(
    http: httpx.AsyncClient,
    system: str,
    turns: list[str],
    pauses: list[float],
    max_tokens: int,
    ttfts: list[tuple[int, float]],
) -> int:
    """One conversation, turn after turn; the tokens generated."""
    history = [{"role": "system", "content": system}]
    generated = 0
    for turn, user in enumerate(turns):
        if turn:
            await asyncio.sleep(pauses[turn - 1])  # the user reads the answer
        history.append({"role": "user", "content": user})
        body = {
            "messages": history,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        answer, first = "", None
        start = time.perf_counter()
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = httpx.Response(200, content=line[6:]).json()
                for choice in chunk["choices"]:
                    delta = choice.get("delta") or {}
                    # every chunk after the role's carries a token, though a random model's
                    # tokens may decode to no text yet
                    if first is None and not delta.get("role"):
                        first = time.perf_counter() - start
                    answer += delta.get("content") or ""
                if chunk.get("usage"):
                    generated += chunk["usage"]["completion_tokens"]
        ttfts.append((turn, first))
        history.append({"role": "assistant", "content": answer})
    return generated


def prefix_counters(url: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    found = re.search(r"^pagedserve:prefix_cache_hits_total (\S+)$", text, re.M)
    looked = re.search(r"^pagedserve:prefix_cache_queries_total (\S+)$", text, re.M)
    return float(found.group(1)), float(looked.group(1))


async def workload(url: str, args: argparse.Namespace) -> dict:
    ttfts: list[tuple[int, float]] = []  # (turn, seconds)
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    sessions = asyncio.Semaphore(args.concurrency)

    async def one(system: str, turns: list[str], pauses: list[float]) -> int:
        async with sessions:  # a new conversation starts as soon as one ends
            return await talk(http, system, turns, pauses, args.max_tokens, ttfts)

    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as http:
        start = time.perf_counter()
        generated = await asyncio.gather(*(one(*c) for c in conversations(args)))
        elapsed = time.perf_counter() - start
    times = [t for _, t in ttfts]
    by_turn = [statistics.median(t for k, t in ttfts if k == turn) for turn in range(args.turns)]
    return {
        "requests": len(ttfts),
        "ttft_median_ms": statistics.median(times) * 1000,
        "ttft_p90_ms": statistics.quantiles(times, n=10)[-1] * 1000,
        "ttft_median_ms_by_turn": [round(t * 1000, 1) for t in by_turn],
        "requests_per_s": len(times) / elapsed,
        "output_tokens_per_s": sum(generated) / elapsed,
        "duration_s": elapsed,
    }


def model_path(model: str) -> Path:
    if model == "demo":
        return PACKAGE / "demo_model"
    from benchmarks.bench_models import build_model

    return build_model(model)


def model_flags(model: str) -> list[str]:
    """The served model: the demo model (the server's default) or a bench model in INT4."""
    if model == "demo":
        return []
    return [*("--model", str(model_path(model)), "--quantization", "int4"), *CHAT_0414]


def working_set_blocks(args: argparse.Namespace) -> int:
    """The KV blocks of the full histories of the conversations that run at once, a shared
    system prompt's once (the model's tokenizer; each answer ``max_tokens`` long)."""
    from pagedserve.models.tokenizer import Tokenizer

    tok = Tokenizer(model_path(args.model))

    def blocks(texts: list[str], extra_tokens: int = 0) -> int:
        tokens = sum(len(tok.encode(t, add_special_tokens=False)) + TEMPLATE_TOKENS for t in texts)
        return -(-(tokens + extra_tokens) // BLOCK_SIZE)

    talks = conversations(args)[: args.concurrency]
    shared = sum(blocks([system]) for system in {system for system, _, _ in talks})
    answers = args.turns * (args.max_tokens + TEMPLATE_TOKENS)
    return shared + sum(blocks(turns, answers) for _, turns, _ in talks)


def run_setting(name: str, args: argparse.Namespace, pages: int) -> dict:
    pages = 2 * pages if name == "single" else pages  # the pages of both replicas in one
    flags = [*model_flags(args.model), *SERVER_FLAGS, "--num-kv-pages", str(pages), *SETTINGS[name]]
    print(f"{name}: starting pagedserve serve {' '.join(flags)}", flush=True)
    with serve(*flags, log_level="warning", timeout=600) as (_, url):
        wait_for_replicas(url, 1 if name == "single" else 2)
        asyncio.run(warm_up(url))
        time.sleep(REPORT_WAIT_S)
        hits0, queries0 = prefix_counters(url)
        figures = asyncio.run(workload(url, args))
        time.sleep(REPORT_WAIT_S)
        hits1, queries1 = prefix_counters(url)
        replicas = httpx.get(url + "/health", timeout=30).json()["replicas"]
    figures["prefix_cache_hit_rate"] = (hits1 - hits0) / max(queries1 - queries0, 1)
    figures["requests_per_replica"] = sorted(r["num_routed"] for r in replicas)
    figures["kv_pages_per_replica"] = pages
    print(f"{name}: {figures}", flush=True)
    return figures


async def warm_up(url: str) -> None:
    """One short request per replica first (unrelated prompts), so that no setting pays a
    replica's first steps inside the measurement."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        for i in range(4):
            body = {"prompt": f"warm up {i}", "max_tokens": 2, "temperature": 0}
            (await http.post("/v1/completions", json=body)).raise_for_status()


def wait_for_replicas(url: str, count: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        replicas = httpx.get(url + "/health", timeout=30).json()["replicas"]
        if sum(r["engine"] == "alive" for r in replicas) == count:
            return
        time.sleep(0.5)
    raise RuntimeError(f"{count} replicas did not report within {timeout:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", choices=["demo", "122m"], default="demo", help="the served model (see above)"
    )
    parser.add_argument("--conversations", type=int, default=48, help="conversations in all")
    parser.add_argument(
        "--concurrency", type=int, default=DEFAULT_CONCURRENCY, help="conversations at once"
    )
    parser.add_argument("--turns", type=int, default=3, help="turns per conversation")
    parser.add_argument("--system-prompts", type=int, default=2, help="shared system prompts")
    parser.add_argument("--system-chars", type=int, default=1200, help="system prompt length")
    parser.add_argument(
        "--document-chars", type=int, default=3000, help="the document of a first turn"
    )
    parser.add_argument("--question-chars", type=int, default=80, help="a question's length")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per answer")
    parser.add_argument(
        "--think-time",
        type=float,
        default=1.0,
        help="the user's mean pause before a next turn, in seconds (exponential; 0: none)",
    )
    parser.add_argument(
        "--pools", nargs="+", choices=list(POOLS), default=list(POOLS), help="KV pool sizes to run"
    )
    parser.add_argument(
        "--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS), help="to run"
    )
    parser.add_argument(
        "--runs", type=int, default=1, help="repeat every setting; report medians and ranges"
    )
    args = parser.parse_args()
    load_before = os.getloadavg()
    working_set = working_set_blocks(args)
    pools = {}
    for pool in args.pools:
        pages = round(POOLS[pool] * working_set)
        runs = []
        for run in range(args.runs):
            print(f"=== {pool} pools, run {run + 1} of {args.runs}", flush=True)
            runs.append({name: run_setting(name, args, pages) for name in args.settings})
        results = {name: median_figures([r[name] for r in runs]) for name in args.settings}
        pools[pool] = {"kv_pages_per_replica": pages, "settings": results, **compare(results)}
        if args.runs > 1:
            pools[pool]["runs"] = runs
            per_run = [compare(r) for r in runs]
            for key in ("hit_rate_share_of_single", "ttft_speedup_over_power_of_two"):
                if per_run and key in per_run[0]:
                    pools[pool][key + "_by_run"] = spread([c[key] for c in per_run])
    summary = {
        "model": args.model,
        "workload": {
            k: getattr(args, k)
            for k in (
                "conversations",
                "concurrency",
                "turns",
                "system_prompts",
                "system_chars",
                "document_chars",
                "question_chars",
                "max_tokens",
                "think_time",
            )
        },  # fmt: skip
        "working_set_blocks": working_set,
        "server_flags": " ".join(SERVER_FLAGS),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "pools": pools,
    }
    name = "ray_serve" + ("" if args.model == "demo" else f"_{args.model}")
    name += "" if args.concurrency == DEFAULT_CONCURRENCY else f"_c{args.concurrency}"
    print(write_result(name, summary))


def median_figures(runs: list[dict]) -> dict:
    """A setting's figures over runs: the median of each number (per turn for the per-turn
    medians), the other fields as the first run had them."""
    if len(runs) == 1:
        return runs[0]
    out = dict(runs[0])
    for key, value in runs[0].items():
        if isinstance(value, (int, float)):
            out[key] = statistics.median(r[key] for r in runs)
        elif key == "ttft_median_ms_by_turn":
            out[key] = [
                round(statistics.median(turns), 1) for turns in zip(*(r[key] for r in runs))
            ]
    return out


def compare(results: dict) -> dict:
    """Prefix-aware against the targets: the single replica's hit rate, power-of-two's TTFT."""
    if not {"single", "prefix-aware", "power-of-two"} <= results.keys():
        return {}
    single, prefix, p2c = results["single"], results["prefix-aware"], results["power-of-two"]
    share = prefix["prefix_cache_hit_rate"] / single["prefix_cache_hit_rate"]
    speedup = p2c["ttft_median_ms"] / prefix["ttft_median_ms"]
    out = {
        "hit_rate_share_of_single": share,
        "ttft_speedup_over_power_of_two": speedup,
        "targets_met": {
            "hit_rate_within_10_percent_of_single": share >= TARGET_HIT_RATE_SHARE,
            "ttft_1.5x_better_than_power_of_two": speedup >= TARGET_TTFT_SPEEDUP,
        },
    }
    print(out, flush=True)
    return out


if __name__ == "__main__":
    main()
