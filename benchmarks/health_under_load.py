"""/health latency while the server runs at 20x what it admits.

    python -m benchmarks.health_under_load [--clients 240] [--duration 20]

Starts `pagedserve serve` on the demo model with --max-num-seqs 4 --max-queue-len 8 (12 requests
admitted) on 127.0.0.1, then drives it with CLIENTS concurrent clients (240: 20x) for DURATION
seconds: each sends a streaming completion, reads it to the end (or takes its 503 and waits the
Retry-After it names, as the OpenAI SDK does), and sends the next. Meanwhile a prober in a process
of its own (so that the load clients' event loop does not delay it) asks GET /health every 50 ms. Prints the /health median and p99
latency and what became of the requests (200, 503 with Retry-After, anything else); writes
benchmarks/results/health_under_load.json. Targets: median < 20 ms, p99 < 100 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from collections import Counter

HEALTH_INTERVAL_S = 0.05


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _client(
    http, url: str, body: dict, stop_at: float, outcomes: Counter, ttfts: list[float]
) -> None:
    """Send, read to the end (keeping the time to the first token), send the next; a 503 waits
    the Retry-After it names, as the OpenAI SDK does; a request past its timeout counts."""
    import httpx

    while time.monotonic() < stop_at:
        sent = time.perf_counter()
        try:
            async with http.stream("POST", url + "/v1/completions", json=body) as r:
                if r.status_code == 503:
                    retry_after = r.headers.get("retry-after")
                    outcomes["503 with Retry-After" if retry_after else "503"] += 1
                    await r.aread()
                    await asyncio.sleep(float(retry_after or 1))
                    continue
                first = True
                async for line in r.aiter_lines():
                    if first and line.startswith("data: "):
                        ttfts.append((time.perf_counter() - sent) * 1e3)
                        first = False
                outcomes[str(r.status_code)] += 1
        except httpx.TimeoutException:
            outcomes["timed out"] += 1
        except Exception as e:  # noqa: BLE001 - counted, not fatal: the load goes on
            outcomes[type(e).__name__] += 1


def probe(url: str, duration: float, path: str = "/health") -> tuple[list[float], Counter]:
    """GET ``path`` every HEALTH_INTERVAL_S for ``duration``: latencies (ms) and status codes."""
    import httpx

    latencies: list[float] = []
    codes: Counter = Counter()
    stop_at = time.monotonic() + duration
    with httpx.Client(timeout=duration + 60) as http:
        while time.monotonic() < stop_at:
            start = time.perf_counter()
            try:
                codes[str(http.get(url + path).status_code)] += 1
            except httpx.HTTPError as e:
                codes[type(e).__name__] += 1
            latencies.append((time.perf_counter() - start) * 1e3)
            time.sleep(HEALTH_INTERVAL_S)
    return latencies, codes


async def drive(
    url: str,
    clients: int,
    duration: float,
    body: dict,
    request_timeout: float | None = None,
    probe_paths: tuple[str, ...] = ("/health",),
) -> dict:
    """CLIENTS looping clients plus one prober process per path in ``probe_paths``, for DURATION
    seconds (loopback only). ``request_timeout``: how long one request may take (default: the
    whole run and a minute)."""
    import httpx

    assert url.startswith(("http://127.", "http://localhost", "http://[::1]")), url
    outcomes: Counter = Counter()
    ttfts: list[float] = []
    probers = {
        path: subprocess.Popen(
            [sys.executable, __file__, "--probe", url, "--path", path, "--duration", str(duration)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for path in probe_paths
    }
    stop_at = time.monotonic() + duration
    limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
    timeout = httpx.Timeout(request_timeout or duration + 60)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as load:
        await asyncio.gather(
            *(_client(load, url, body, stop_at, outcomes, ttfts) for _ in range(clients))
        )
    figures = {
        "clients": clients,
        "duration_s": duration,
        "requests": dict(outcomes),
        "ttft_p50_ms": percentile(ttfts, 0.5) if ttfts else None,
        "ttft_p99_ms": percentile(ttfts, 0.99) if ttfts else None,
    }
    for path, prober in probers.items():
        out, _ = prober.communicate(timeout=duration + 60)
        probed = json.loads(out)
        latencies, name = probed["latencies_ms"], path.strip("/")
        figures |= {
            f"{name}_codes": probed["codes"],
            f"{name}_probes": len(latencies),
            f"{name}_median_ms": statistics.median(latencies),
            f"{name}_p99_ms": percentile(latencies, 0.99),
            f"{name}_max_ms": max(latencies),
        }
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--clients", type=int, default=240)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--max-queue-len", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--probe", metavar="URL", help=argparse.SUPPRESS)  # a prober process
    ap.add_argument("--path", default="/health", help=argparse.SUPPRESS)  # what it probes
    args = ap.parse_args()
    if args.probe:
        latencies, codes = probe(args.probe, args.duration, args.path)
        print(json.dumps({"latencies_ms": latencies, "codes": codes}))
        return
    from benchmarks.results import write_result
    from pagedserve.testing import serve

    flags = ["--max-num-seqs", str(args.max_num_seqs), "--max-queue-len", str(args.max_queue_len)]
    with serve(*flags, log=None, log_level="warning", timeout=300) as (_, url):
        body = {"prompt": "The quick brown fox", "max_tokens": args.max_tokens, "stream": True}
        body["ignore_eos"] = True
        figures = asyncio.run(drive(url, args.clients, args.duration, body))
    figures |= {"max_num_seqs": args.max_num_seqs, "max_queue_len": args.max_queue_len}
    print(
        f"/health under {args.clients} clients (admitting {args.max_num_seqs} running + "
        f"{args.max_queue_len} queued): median {figures['health_median_ms']:.1f} ms, "
        f"p99 {figures['health_p99_ms']:.1f} ms, max {figures['health_max_ms']:.1f} ms "
        f"over {figures['health_probes']} probes; requests {figures['requests']}"
    )
    write_result("health_under_load", figures)


if __name__ == "__main__":
    main()
