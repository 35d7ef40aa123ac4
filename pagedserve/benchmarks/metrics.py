"""The serving benchmark's figures under vLLM's JSON field names: counts, throughputs, and mean,
median, standard deviation and percentiles of TTFT, TPOT, ITL and E2E latency.

TPOT: ``(e2e - ttft) / (output_tokens - 1)`` per request with more than one output token.
"""

from __future__ import annotations

import statistics

from pagedserve.benchmarks.request import RequestFuncOutput

PERCENTILES = (90, 99)


def percentile(values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def latency_stats(name: str, seconds: list[float]) -> dict[str, float]:
    ms = [s * 1000 for s in seconds]
    stats = {
        f"mean_{name}_ms": statistics.fmean(ms) if ms else 0.0,
        f"median_{name}_ms": statistics.median(ms) if ms else 0.0,
        f"std_{name}_ms": statistics.pstdev(ms) if ms else 0.0,
    }
    stats.update({f"p{p}_{name}_ms": percentile(ms, p) for p in PERCENTILES})
    return stats


def compute_metrics(outputs: list[RequestFuncOutput], duration: float) -> dict:
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
    metrics |= latency_stats("ttft", [o.ttft for o in done])
    metrics |= latency_stats("tpot", tpots)
    metrics |= latency_stats("itl", [gap for o in done for gap in o.itl])
    metrics |= latency_stats("e2el", [o.latency for o in done])
    metrics["max_output_tokens_per_s"] = max(throughput_series(outputs)[1], default=0.0)
    return metrics


def throughput_series(outputs: list[RequestFuncOutput]) -> tuple[list[float], list[float]]:
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
