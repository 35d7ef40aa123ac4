"""Soak: many mixed requests against `pagedserve serve` on the demo model, then the invariants.

    taskset -c 1 nice -n 10 python -m benchmarks.reliability.soak [--requests 10000]

Starts the server (demo model, a 4,096-page KV pool, --max-num-seqs 16) on 127.0.0.1 and sends
REQUESTS requests from CONCURRENCY clients: completions and chat completions, streaming or not,
n from 1 to 4, prompts that share one of a few long prefixes, and 20% of clients that go away at
a random moment (mid-stream, or before a non-streaming answer). Afterwards: kv_cache_usage_perc
0, nothing running or waiting, the allocator's own invariant check (GET /device/invariants)
passes, zero 5xx; and the resident memory of the server's processes (HTTP process and engine
core), sampled after a warm-up of 40% of the requests and again after the next 40%: the growth
is the figure (target: under 32 MB). Writes benchmarks/results/soak.json. The figures are about
correctness and memory, not speed (the run shares one core with its own clients).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from collections import Counter

from benchmarks.reliability.processes import logged_errors, process_tree, rss_by_process
from pagedserve.testing import serve

PREFIXES = [
    "You are a careful assistant. Answer in one short sentence, plainly, without lists. ",
    "The following is a story about a small town by the sea, told by an old fisherman. ",
    "Translate the next line into French, keeping the names as they are written here. ",
    "Here is a log of the server's day, one event per line, oldest first, then a summary. ",
]
WORDS = "river stone lamp winter paper orange quiet engine garden letter window bridge".split()
WARMUP, MEASURED = 0.4, 0.4  # shares of the requests: warm-up, then the measured stretch


def _request(
    rng: random.Random, prefix_copies: int, models: list[str] | None = None
) -> tuple[str, dict, bool]:
    """One request of the mix: (path, body, whether this client goes away early); ``models``:
    the names it picks its ``model`` from (LoRA adapters among them), else none sent."""
    prefix = rng.choice(PREFIXES) * prefix_copies
    prompt = prefix + " ".join(rng.choices(WORDS, k=rng.randint(1, 12)))
    body = {
        "max_tokens": rng.randint(1, 24),
        "n": rng.choice([1, 1, 2, 4]),
        "stream": rng.random() < 0.5,
        "temperature": rng.choice([0.0, 0.8]),
    }
    if models:
        body["model"] = rng.choice(models)
    if rng.random() < 0.5:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt}]
    else:
        path, body["prompt"] = "/v1/completions", prompt
    return path, body, rng.random() < 0.2


async def _send(http, url: str, path: str, body: dict, leave: bool, rng, outcomes: Counter):
    """Send one request; a leaving client closes its connection at a random moment."""
    try:
        if body["stream"]:
            async with http.stream("POST", url + path, json=body) as r:
                if r.status_code != 200:
                    outcomes[f"status_{r.status_code}"] += 1
                    return
                chunks_before_leaving = rng.randint(0, 6) if leave else None
                async for i, _ in _enumerate(r.aiter_lines()):
                    if i == chunks_before_leaving:
                        outcomes["disconnected"] += 1
                        return  # closing the stream drops the connection
            outcomes["completed"] += 1
            return
        request = http.post(url + path, json=body)
        if leave:
            try:
                await asyncio.wait_for(request, timeout=rng.uniform(0.001, 0.3))
            except asyncio.TimeoutError:
                outcomes["disconnected"] += 1
                return
            outcomes["completed"] += 1  # it finished before the client left
            return
        r = await request
        outcomes["completed" if r.status_code == 200 else f"status_{r.status_code}"] += 1
    except Exception as e:  # noqa: BLE001 - counted: the soak goes on and reports it
        outcomes[f"error_{type(e).__name__}"] += 1


async def _enumerate(lines):
    i = 0
    async for line in lines:
        if line.startswith("data: "):
            yield i, line
            i += 1


async def _drive(
    url: str,
    num_requests: int,
    concurrency: int,
    memory_pids,
    seed: int,
    prefix_copies: int,
    models: list[str] | None = None,
) -> dict:
    import httpx

    rng = random.Random(seed)
    outcomes: Counter = Counter()
    rss: dict[int, dict[str, int]] = {}  # per tenth of the run: per process
    tenths = {num_requests * k // 10: k * 10 for k in range(1, 10)}
    todo = iter(range(num_requests))

    async def client(http) -> None:
        for i in todo:
            if i in tenths and memory_pids:
                rss[tenths[i]] = rss_by_process(memory_pids)
            await _send(http, url, *_request(rng, prefix_copies, models), rng, outcomes)

    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(120)) as http:
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
    return {"outcomes": dict(outcomes), "rss": rss}


def _end_state(url: str, timeout: float = 60) -> dict:
    """The engine's invariants once it has finished (aborts reach it a step or two late)."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        state = httpx.get(url + "/device/invariants", timeout=30).json()
        idle = not (state["num_requests_running"] or state["num_requests_waiting"])
        if (idle and not state["num_groups"]) or time.monotonic() > deadline:
            return state
        time.sleep(0.1)


def run_soak(
    url: str,
    num_requests: int,
    concurrency: int,
    memory_pids: list[int],
    seed: int = 0,
    prefix_copies: int = 4,
    models: list[str] | None = None,
) -> dict:
    """The soak against a running server; its figures (``memory_pids``: whose RSS to sample;
    ``prefix_copies``: how many times the shared prefix sentence repeats, 4: about 80 tokens
    of the demo model's; ``models``: the model names the requests spread over)."""
    assert url.startswith(("http://127.", "http://localhost", "http://[::1]")), url
    start = time.monotonic()
    driven = asyncio.run(
        _drive(url, num_requests, concurrency, memory_pids, seed, prefix_copies, models)
    )
    outcomes = driven["outcomes"]
    end = _end_state(url)
    figures = {
        "requests": num_requests,
        "concurrency": concurrency,
        "seconds": round(time.monotonic() - start, 1),
        "completed": outcomes.get("completed", 0),
        "disconnected": outcomes.get("disconnected", 0),
        "status_5xx": sum(v for k, v in outcomes.items() if k.startswith("status_5")),
        "other_errors": sum(v for k, v in outcomes.items() if k.startswith(("error_", "status_4"))),
        "outcomes": outcomes,
        "end_state": end,
        "leaked_pages": end["num_kv_pages_in_use"],
    }
    if memory_pids:
        rss = driven["rss"] | {100: rss_by_process(memory_pids)}
        figures["rss_mb_by_percent_done"] = {
            pct: {name: round(v / 2**20, 1) for name, v in by_process.items()}
            for pct, by_process in sorted(rss.items())
        }
        warm, measured = round(WARMUP * 100), round((WARMUP + MEASURED) * 100)
        figures["rss_growth_mb"] = {
            name: round((rss[measured][name] - rss[warm][name]) / 2**20, 1) for name in rss[warm]
        }
        figures["rss_growth_mb"]["total"] = round(sum(figures["rss_growth_mb"].values()), 1)
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--num-kv-pages", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0, help="the request mix's random generator")
    args = ap.parse_args()
    from benchmarks.results import write_result

    flags = ["--max-num-seqs", str(args.max_num_seqs), "--num-kv-pages", str(args.num_kv_pages)]
    with tempfile.TemporaryFile("w+") as log:
        with serve(*flags, log=log, log_level="warning", timeout=300) as (server, url):
            pids = process_tree(server.pid)
            figures = run_soak(url, args.requests, args.concurrency, pids, args.seed)
        log.seek(0)
        errors = logged_errors(log.read())
    figures |= {
        "server_errors_logged": len(errors),
        "first_server_errors": errors[:5],
        "max_num_seqs": args.max_num_seqs,
        "num_kv_pages": args.num_kv_pages,
        "note": "correctness and memory, not speed: pinned to one busy core with its clients",
    }
    end = figures["end_state"]
    print(
        f"soak: {figures['requests']} requests in {figures['seconds']} s: "
        f"{figures['completed']} completed, {figures['disconnected']} clients gone early, "
        f"{figures['status_5xx']} 5xx, {figures['other_errors']} other errors, "
        f"{figures['server_errors_logged']} errors in the server's log; after: "
        f"kv_cache_usage_perc {end['kv_cache_usage_perc']}, running "
        f"{end['num_requests_running']}, waiting {end['num_requests_waiting']}, invariant "
        f"problems {end['problems'] or 'none'}; resident memory (MB) by % done "
        f"{figures['rss_mb_by_percent_done']}; growth over the measured {MEASURED:.0%}: "
        f"{figures['rss_growth_mb']} MB"
    )
    write_result("soak", figures)


if __name__ == "__main__":
    main()
