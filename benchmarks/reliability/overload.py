"""Overload: 20x what the server admits, and what becomes of every request.

    taskset -c 1 nice -n 10 python -m benchmarks.reliability.overload [--clients 240] [--duration 30]

Starts `pagedserve serve` on the demo model with --max-num-seqs 4 --max-queue-len 8 (12 requests
admitted at once) on 127.0.0.1, and drives it with CLIENTS looping clients (240: 20x) for
DURATION seconds, each request with a timeout (REQUEST_TIMEOUT s): every request must end 200 or
503 with Retry-After, none past its timeout. Two prober processes ask GET /health and GET
/metrics every 50 ms (targets: median < 20 ms, p99 < 100 ms). Reports the request rate, the
rejection share, p50/p99 time to first token of the admitted requests and the resident memory of
the server's processes before, during (peak of samples) and after. Reuses
benchmarks/health_under_load.py's driver. Writes benchmarks/results/overload.json.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time

from benchmarks.health_under_load import drive
from benchmarks.reliability.processes import process_tree, rss_bytes
from pagedserve.testing import serve

ADMITTED = ("200",)
REJECTED = ("503 with Retry-After",)


def sample_rss(pids: list[int], stop: threading.Event, samples: list[int]) -> None:
    while not stop.wait(0.5):
        samples.append(rss_bytes(pids))


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--clients", type=int, default=240)
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--max-queue-len", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--request-timeout", type=float, default=60.0)
    args = ap.parse_args()
    from benchmarks.results import write_result

    flags = ["--max-num-seqs", str(args.max_num_seqs), "--max-queue-len", str(args.max_queue_len)]
    body = {"prompt": "The quick brown fox", "max_tokens": args.max_tokens, "stream": True}
    body["ignore_eos"] = True
    with serve(*flags, log=None, log_level="warning", timeout=300) as (server, url):
        pids = process_tree(server.pid)
        before = rss_bytes(pids)
        samples: list[int] = []
        stop = threading.Event()
        sampler = threading.Thread(target=sample_rss, args=(pids, stop, samples), daemon=True)
        sampler.start()
        figures = asyncio.run(
            drive(
                url,
                args.clients,
                args.duration,
                body,
                request_timeout=args.request_timeout,
                probe_paths=("/health", "/metrics"),
            )
        )
        stop.set()
        sampler.join()
        time.sleep(2)  # the aborted and finished requests' memory returns
        after = rss_bytes(pids)
    requests = figures["requests"]
    total = sum(requests.values())
    admitted = sum(requests.get(k, 0) for k in ADMITTED)
    rejected = sum(requests.get(k, 0) for k in REJECTED)
    figures |= {
        "admits": args.max_num_seqs + args.max_queue_len,
        "overload_factor": args.clients / (args.max_num_seqs + args.max_queue_len),
        "max_num_seqs": args.max_num_seqs,
        "max_queue_len": args.max_queue_len,
        "request_timeout_s": args.request_timeout,
        "requests_per_s": round(total / args.duration, 1),
        "admitted": admitted,
        "rejected": rejected,
        "other": total - admitted - rejected,
        "rejection_share": round(rejected / total, 3) if total else None,
        "rss_mb": {
            "before": round(before / 2**20, 1),
            "peak_during": round(max(samples, default=before) / 2**20, 1),
            "after": round(after / 2**20, 1),
        },
        "note": "correctness and bounds, not speed: pinned to one busy core with its clients",
    }
    print(
        f"overload: {args.clients} clients against {figures['admits']} admitted "
        f"({figures['overload_factor']:.0f}x) for {args.duration:.0f} s: {total} requests "
        f"({figures['requests_per_s']}/s), {admitted} served, {rejected} 503 with Retry-After "
        f"({figures['rejection_share']:.1%}), {figures['other']} other; TTFT of the served "
        f"p50 {figures['ttft_p50_ms']:.0f} ms p99 {figures['ttft_p99_ms']:.0f} ms; /health "
        f"median {figures['health_median_ms']:.1f} ms p99 {figures['health_p99_ms']:.1f} ms; "
        f"/metrics median {figures['metrics_median_ms']:.1f} ms p99 "
        f"{figures['metrics_p99_ms']:.1f} ms; resident memory {figures['rss_mb']} MB"
    )
    write_result("overload", figures)


if __name__ == "__main__":
    main()
