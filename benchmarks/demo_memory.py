"""How much memory the demo server takes, and how the KV-pool flags shrink it.

    python -m benchmarks.demo_memory [--runs 3]

Starts ``pagedserve serve`` on the embedded demo model (on a free port) as the README starts it,
then with ``--num-kv-pages 512`` and with ``--gpu-memory-utilization 0.1``; in each it serves a
burst of completions, then reads the resident memory (VmRSS, and the peak VmHWM) of the server's
process tree (the HTTP process and its engine core process) and the KV pool the server reports at
``GET /device`` (pages, tokens, MiB, and how many sequences of ``max_model_len`` tokens it holds). How much of an untouched pool is resident depends on the kernel, so the default
server runs ``--runs`` times and the file keeps every run. Writes
benchmarks/results/demo_memory.json; rerun it whenever pagedserve/demo_model changes.
"""

from __future__ import annotations

import argparse
import asyncio
import re
from pathlib import Path

import httpx

from benchmarks.results import spread, write_result
from pagedserve.testing import serve

SETTINGS = {
    "default": [],
    "num_kv_pages_512": ["--num-kv-pages", "512"],
    "gpu_memory_utilization_0.1": ["--gpu-memory-utilization", "0.1"],
}


def process_tree_kib(pid: int, field: str) -> dict[int, int]:
    """``field`` (VmRSS, VmHWM) in KiB of pid and every descendant."""
    status = Path(f"/proc/{pid}/status").read_text()
    sizes = {pid: int(re.search(rf"{field}:\s+(\d+) kB", status).group(1))}
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    for child in children:
        sizes.update(process_tree_kib(int(child), field))
    return sizes


async def burst(url: str, requests: int = 16, max_tokens: int = 64) -> None:
    """Concurrent completions, so that the pool and the engine's buffers are in use."""
    body = {"model": "demo", "prompt": "def fibonacci(n):", "max_tokens": max_tokens}
    async with httpx.AsyncClient(timeout=600) as client:
        replies = await asyncio.gather(
            *(client.post(url + "/v1/completions", json=body) for _ in range(requests))
        )
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]


def kv_pool(url: str) -> dict:
    """The KV pool the server reports: pages, tokens, MiB, and full-length sequences it holds."""
    device = httpx.get(url + "/device", timeout=60).json()
    max_model_len = httpx.get(url + "/v1/models", timeout=60).json()["data"][0]["max_model_len"]
    pages, block_size = device["kv_pages"]["total"], device["kv_pages"]["block_size"]
    return {
        "num_kv_pages": pages,
        "block_size": block_size,
        "tokens": pages * block_size,
        "mib": device["tiers"]["kv"]["allocations"]["kv_cache"] / 2**20,
        "max_model_len": max_model_len,
        "full_length_sequences": pages * block_size // max_model_len,
    }


def measure(flags: list[str]) -> dict:
    with serve(*flags, log_level="warning") as (server, url):
        pid = server.pid
        pool = kv_pool(url)
        asyncio.run(burst(url))
        rss, peak = process_tree_kib(pid, "VmRSS"), process_tree_kib(pid, "VmHWM")
    return {
        "rss_gb": sum(rss.values()) * 1024 / 1e9,
        "peak_rss_gb": sum(peak.values()) * 1024 / 1e9,
        "http_process_rss_mb": rss[pid] * 1024 / 1e6,
        "kv_pool": pool,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of the default server")
    args = parser.parse_args()
    figures = {}
    for name, flags in SETTINGS.items():
        runs = [measure(flags) for _ in range(args.runs if name == "default" else 1)]
        figures[name] = {
            "flags": " ".join(flags),
            "rss_gb": spread([r["rss_gb"] for r in runs]),
            "peak_rss_gb": spread([r["peak_rss_gb"] for r in runs]),
            "http_process_rss_mb": spread([r["http_process_rss_mb"] for r in runs]),
            "kv_pool": runs[0]["kv_pool"],
        }
        print(name, figures[name], flush=True)
    print(write_result("demo_memory", figures))


if __name__ == "__main__":
    main()
