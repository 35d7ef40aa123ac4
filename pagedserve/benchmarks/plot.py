"""``pagedserve bench --plot FILE.png``: latency distributions and throughput over time.

Six panels: histograms of TTFT, TPOT, ITL and E2E latency (median and p99 marked), output tokens
per second in one-second bins, and requests in flight. matplotlib is an optional extra
(``pip install 'pagedserve[plot]'``); ``require_matplotlib`` is called before the benchmark runs,
so that a missing extra is reported before minutes of requests, not after.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedserve.benchmarks.request import RequestFuncOutput

EXTRA = "pagedserve[plot]"


def require_matplotlib() -> None:
    """Raise ``ValueError`` naming the extra to install when matplotlib cannot be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError(
            f"--plot needs matplotlib, which is not installed; install it with "
            f"pip install '{EXTRA}' (or pip install matplotlib), or drop --plot"
        ) from None


def latency_series(outputs: list[RequestFuncOutput]) -> dict[str, list[float]]:
    """Milliseconds per successful request (per gap for ITL), under vLLM's definitions."""
    done = [o for o in outputs if o.success]
    return {
        "TTFT": [o.ttft * 1000 for o in done],
        "TPOT": [
            (o.latency - o.ttft) * 1000 / (o.output_tokens - 1) for o in done if o.output_tokens > 1
        ],
        "ITL": [gap * 1000 for o in done for gap in o.itl],
        "E2E latency": [o.latency * 1000 for o in done],
    }


def in_flight_series(outputs: list[RequestFuncOutput]) -> tuple[list[float], list[int]]:
    """(seconds from the first request's start, requests in flight from then on): a step
    function with one point per start and end."""
    if not outputs:
        return [], []
    t0 = min(o.start for o in outputs)
    events = sorted(
        [(o.start - t0, 1) for o in outputs] + [(o.start - t0 + o.latency, -1) for o in outputs]
    )
    times, counts, running = [], [], 0
    for t, step in events:
        running += step
        times.append(t)
        counts.append(running)
    return times, counts


def plot(outputs: list[RequestFuncOutput], path: str, title: str = "") -> None:
    """Draw the six panels into ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")  # no display: the figure only goes to a file
    import matplotlib.pyplot as plt

    from pagedserve.benchmarks.metrics import percentile, throughput_series

    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (name, values) in zip(axes.flat, latency_series(outputs).items()):
        ax.hist(values, bins=30, color="tab:blue")
        for p, style in ((50, "--"), (99, ":")):
            if values:
                x = percentile(values, p)
                ax.axvline(x, color="black", linestyle=style, label=f"p{p} {x:.1f} ms")
        ax.set(title=f"{name} ({len(values)})", xlabel="ms", ylabel="count")
        if values:
            ax.legend()
    seconds, tokens = throughput_series(outputs)
    axes.flat[4].bar(seconds, tokens, width=1.0, align="edge", color="tab:green")
    axes.flat[4].set(title="output throughput", xlabel="s", ylabel="tokens/s")
    times, in_flight = in_flight_series(outputs)
    axes.flat[5].plot(times, in_flight, drawstyle="steps-post", color="tab:orange")
    axes.flat[5].set(title="requests in flight", xlabel="s", ylabel="requests")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
