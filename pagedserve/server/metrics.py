"""Prometheus metrics under vLLM's names, prefixed ``pagedserve:``; one registry per app.

Gauges and token counters are read from ``engine.get_stats()`` at scrape time; per-request
latencies are observed by ``RequestTimer`` as outputs reach the HTTP side. The figures that
Kubernetes' inference gateways (the Gateway API Inference Extension's endpoint picker, llm-d,
KServe) and vLLM's production-stack router read are also exported under vLLM's own ``vllm:``
names, so that they route to this server as to a vLLM one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

PREFIX = "pagedserve:"
GAUGES = {
    "num_requests_running": "Requests in the running batch.",
    "num_requests_waiting": "Requests waiting to be scheduled.",
    "kv_cache_usage_perc": "Fraction of KV pages in use (1 = full).",
    "num_requests_swapped": "Waiting requests whose KV pages are swapped out to the host tier.",
    "num_swapped_pages": "Host-tier page frames held by swapped-out requests.",
    "host_kv_cache_usage_perc": "Fraction of the host tier's KV frames held (1 = full).",
    "spec_decode_draft_acceptance_rate": "Accepted drafts over proposed ones, since start-up.",
    "spec_decode_mean_acceptance_length": "Tokens a verification step outputs on average: one, "
    "plus its accepted drafts, since start-up.",
}
COUNTERS = {
    "prefix_cache_queries_total": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hits_total": "Prompt tokens found in the prefix cache (either tier).",
    "host_prefix_cache_queries_total": "Prompt tokens looked up in the host tier's prefix cache.",
    "host_prefix_cache_hits_total": "Prompt tokens found there (copied back, not recomputed).",
    "num_preemptions_total": "Sequences preempted for lack of KV pages.",
    "num_swapped_preemptions_total": "Of those, the ones swapped out to the host tier.",
    "swapped_out_pages_total": "KV pages copied to the host tier for swapped-out requests.",
    "swapped_in_pages_total": "KV pages copied back from the host tier for resumed requests.",
    "recomputed_tokens_total": "Tokens computed again because a preemption freed them.",
    "prompt_tokens_total": "Prompt tokens admitted.",
    "generation_tokens_total": "Tokens generated.",
    "collective_bytes_sent_total": "Bytes rank 0's card sent through tensor-parallel collectives.",
    "engine_step_errors_total": "Forward passes that raised for another cause than a device "
    "fault (a bug, logged with its traceback); their requests were answered 500.",
    "spec_decode_num_drafts_total": "Verification steps of a sequence that had drafts.",
    "spec_decode_num_draft_tokens_total": "Draft tokens proposed and verified.",
    "spec_decode_num_accepted_tokens_total": "Draft tokens accepted.",
}
VLLM_PREFIX = "vllm:"
# vLLM's name -> (the stats key it shows, its help); gpu_cache_usage_perc is the name vLLM used
# before kv_cache_usage_perc, which production-stack's router still reads
VLLM_GAUGES = {
    "num_requests_running": ("num_requests_running", GAUGES["num_requests_running"]),
    "num_requests_waiting": ("num_requests_waiting", GAUGES["num_requests_waiting"]),
    "kv_cache_usage_perc": ("kv_cache_usage_perc", GAUGES["kv_cache_usage_perc"]),
    "gpu_cache_usage_perc": (
        "kv_cache_usage_perc",
        "The same as kv_cache_usage_perc (vLLM's older name).",
    ),
}
LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


class _EngineStatsCollector(Collector):
    def __init__(
        self, get_stats: Callable[[], dict], model_name: str, cache_config: dict[str, object]
    ):
        self.get_stats = get_stats
        self.model_name = model_name
        self.cache_config = {k: str(v) for k, v in cache_config.items()}

    def collect(self) -> Iterable[Metric]:
        stats = self.get_stats()
        for name, doc in GAUGES.items():
            yield GaugeMetricFamily(PREFIX + name, doc, value=float(stats.get(name, 0)))
        for name, doc in COUNTERS.items():
            # CounterMetricFamily drops the name's _total; its sample gets it back
            yield CounterMetricFamily(PREFIX + name, doc, value=float(stats.get(name, 0)))
        faults = CounterMetricFamily(
            PREFIX + "device_faults",
            "Device faults detected, by kind (kv_page, weight_page, step).",
            labels=["kind"],
        )
        for kind, count in (stats.get("device_faults_total") or {}).items():
            faults.add_metric([kind], float(count))
        yield faults
        per_pos = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by their position among a step's drafts (0: the first).",
            labels=["position"],
        )
        for position, count in enumerate(stats.get("spec_decode_num_accepted_tokens_per_pos", ())):
            per_pos.add_metric([str(position)], float(count))
        if per_pos.samples:  # a series per draft position: none on a server that does not draft
            yield per_pos
        yield from self._vllm_names(stats)
        yield from _lora_metrics(stats.get("lora"))

    def _vllm_names(self, stats: dict) -> Iterable[Metric]:
        """vLLM's gauges with its ``model_name`` label, and ``vllm:cache_config_info`` (value 1,
        the KV cache's settings as labels: the gateways read ``block_size`` and
        ``num_gpu_blocks``)."""
        for name, (key, doc) in VLLM_GAUGES.items():
            gauge = GaugeMetricFamily(VLLM_PREFIX + name, doc, labels=["model_name"])
            gauge.add_metric([self.model_name], float(stats.get(key, 0)))
            yield gauge
        info = GaugeMetricFamily(
            VLLM_PREFIX + "cache_config_info",
            "Information of the KV cache's configuration.",
            labels=list(self.cache_config),
        )
        info.add_metric(list(self.cache_config.values()), 1.0)
        yield info


def _lora_metrics(lora: dict | None) -> Iterable[Metric]:
    """vLLM's ``vllm:lora_requests_info`` under its own name (the Gateway API Inference
    Extension routes by it): one sample whose labels list the adapters of the running and of the
    waiting requests (comma-separated) and ``max_lora``, its value the time it was read, as
    vLLM's; and the requests each adapter has served. Nothing on a server without LoRA."""
    if lora is None:
        return
    info = GaugeMetricFamily(
        VLLM_PREFIX + "lora_requests_info",
        "Running and waiting LoRA adapters (labels); the value is when they were read.",
        labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
    )
    running, waiting = (
        ",".join(lora[k]) for k in ("running_lora_adapters", "waiting_lora_adapters")
    )
    info.add_metric([str(lora["max_lora"]), running, waiting], time.time())
    yield info
    counts = CounterMetricFamily(
        PREFIX + "lora_requests", "Requests admitted, by LoRA adapter.", labels=["lora_name"]
    )
    for name, count in sorted(lora["requests_total"].items()):
        counts.add_metric([name], float(count))
    yield counts


class ServerMetrics:
    """``model_name``: the ``model_name`` label of the ``vllm:`` gauges; ``cache_config``: the
    labels of ``vllm:cache_config_info`` (``block_size``, ``num_gpu_blocks``: the KV pages)."""

    def __init__(self, model_name: str = "", cache_config: dict[str, object] | None = None):
        self.registry = CollectorRegistry()
        self.latest_stats: dict = {}
        collector = _EngineStatsCollector(lambda: self.latest_stats, model_name, cache_config or {})
        self.registry.register(collector)
        self.request_success = Counter(
            PREFIX + "request_success",
            "Finished requests by finish reason.",
            ["finished_reason"],
            registry=self.registry,
        )
        self.ttft = self._histogram("time_to_first_token_seconds", "Time to the first token.")
        self.itl = self._histogram("inter_token_latency_seconds", "Time between output tokens.")
        self.e2e = self._histogram("e2e_request_latency_seconds", "Arrival to last token.")
        self.queue_time = self._histogram(
            "request_queue_time_seconds", "Arrival to first scheduling (upper bound: first token)."
        )

    def _histogram(self, name: str, doc: str) -> Histogram:
        return Histogram(PREFIX + name, doc, buckets=LATENCY_BUCKETS, registry=self.registry)

    def render(self, stats: dict) -> bytes:
        """The Prometheus text exposition, with gauges and token counters from ``stats``."""
        self.latest_stats = stats
        return generate_latest(self.registry)


class RequestTimer:
    """Observes one request's latencies as its outputs arrive on the HTTP side."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics
        self.arrival = time.monotonic()
        self.last_token_time: float | None = None
        self.num_tokens = 0

    def on_output(self, num_tokens: int, engine_metrics: dict[str, float] | None = None) -> None:
        new = num_tokens - self.num_tokens
        if new <= 0:
            return
        now = time.monotonic()
        if self.last_token_time is None:
            self.metrics.ttft.observe(now - self.arrival)
            scheduled = (engine_metrics or {}).get("first_scheduled_time") or now
            self.metrics.queue_time.observe(max(scheduled - self.arrival, 0.0))
        else:
            gap = (now - self.last_token_time) / new
            for _ in range(new):
                self.metrics.itl.observe(gap)
        self.last_token_time, self.num_tokens = now, num_tokens

    def on_finish(self, finish_reasons: list[str | None]) -> None:
        """The request's end: one latency, and one count per sequence (None: aborted)."""
        self.metrics.e2e.observe(time.monotonic() - self.arrival)
        for reason in finish_reasons:
            self.metrics.request_success.labels(finished_reason=reason or "abort").inc()
