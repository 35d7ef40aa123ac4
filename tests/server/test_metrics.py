"""The Prometheus exposition (metrics.py) on its own, without a model: every gauge and counter
read from the engine's stats under its ``pagedserve:`` name and help text, the per-kind and
per-position series, and the latencies ``RequestTimer`` observes on a clock the test moves.
test_server_fields.py reads the same figures from a live server."""

from __future__ import annotations

import re

import pytest

from pagedserve.server import metrics as metrics_module
from pagedserve.server.metrics import (
    COUNTERS,
    GAUGES,
    LATENCY_BUCKETS,
    RequestTimer,
    ServerMetrics,
)

SAMPLE = re.compile(r"^(pagedserve:\w+(?:\{[^}]*\})?) (\S+)$")


def samples(text: bytes) -> dict[str, float]:
    lines = text.decode().splitlines()
    return {m.group(1): float(m.group(2)) for m in map(SAMPLE.match, lines) if m}


def helps(text: bytes) -> dict[str, str]:
    out = {}
    for line in text.decode().splitlines():
        if line.startswith("# HELP "):
            name, doc = line.removeprefix("# HELP ").split(" ", 1)
            out[name] = doc
    return out


def types(text: bytes) -> dict[str, str]:
    return dict(
        line.removeprefix("# TYPE ").split(" ", 1)
        for line in text.decode().splitlines()
        if line.startswith("# TYPE ")
    )


class Clock:
    def __init__(self):
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(metrics_module, "time", clock)  # the module's clock only
    return clock


# ---- the engine's figures -------------------------------------------------------------------------
def test_every_gauge_and_counter_is_read_from_the_stats_under_its_name():
    stats = {name: float(i + 1) for i, name in enumerate([*GAUGES, *COUNTERS])}
    text = ServerMetrics().render(stats)
    got = samples(text)
    for name in GAUGES:
        assert got[f"pagedserve:{name}"] == stats[name], name
    for name in COUNTERS:
        assert got[f"pagedserve:{name}"] == stats[name], name  # counters end in _total
    kinds = types(text)
    assert all(kinds[f"pagedserve:{n}"] == "gauge" for n in GAUGES)
    assert all(kinds[f"pagedserve:{n}"] == "counter" for n in COUNTERS)


def test_each_figure_has_its_help_text():
    text = ServerMetrics().render({})
    docs = helps(text)
    for name, doc in GAUGES.items():
        assert docs[f"pagedserve:{name}"] == doc
    for name, doc in COUNTERS.items():
        assert docs[f"pagedserve:{name}"] == doc
    assert docs["pagedserve:device_faults_total"] == (
        "Device faults detected, by kind (kv_page, weight_page, step)."
    )
    assert docs["pagedserve:request_success_total"] == "Finished requests by finish reason."
    assert docs["pagedserve:time_to_first_token_seconds"] == "Time to the first token."
    assert docs["pagedserve:inter_token_latency_seconds"] == "Time between output tokens."
    assert docs["pagedserve:e2e_request_latency_seconds"] == "Arrival to last token."
    assert docs["pagedserve:request_queue_time_seconds"] == (
        "Arrival to first scheduling (upper bound: first token)."
    )


def test_a_figure_the_stats_lack_is_zero():
    got = samples(ServerMetrics().render({"num_requests_running": 3}))
    assert got["pagedserve:num_requests_running"] == 3
    assert got["pagedserve:num_requests_waiting"] == 0
    assert got["pagedserve:prompt_tokens_total"] == 0


def test_the_latest_stats_are_the_ones_rendered():
    metrics = ServerMetrics()
    metrics.render({"num_requests_running": 2})
    got = samples(metrics.render({"num_requests_waiting": 5}))
    assert got["pagedserve:num_requests_running"] == 0
    assert got["pagedserve:num_requests_waiting"] == 5
    assert metrics.latest_stats == {"num_requests_waiting": 5}


def test_device_faults_are_counted_by_kind():
    stats = {"device_faults_total": {"kv_page": 2, "step": 1}}
    got = samples(ServerMetrics().render(stats))
    assert got['pagedserve:device_faults_total{kind="kv_page"}'] == 2
    assert got['pagedserve:device_faults_total{kind="step"}'] == 1
    assert not any(
        k.startswith("pagedserve:device_faults_total")
        for k in samples(ServerMetrics().render({"device_faults_total": None}))
    )


def test_accepted_drafts_are_counted_by_position_only_on_a_server_that_drafts():
    got = samples(ServerMetrics().render({"spec_decode_num_accepted_tokens_per_pos": [5, 3]}))
    name = "pagedserve:spec_decode_num_accepted_tokens_per_pos_total"
    assert got[f'{name}{{position="0"}}'] == 5 and got[f'{name}{{position="1"}}'] == 3
    text = ServerMetrics().render({})
    assert "spec_decode_num_accepted_tokens_per_pos" not in text.decode()
    assert (
        helps(ServerMetrics().render({"spec_decode_num_accepted_tokens_per_pos": [1]}))[name]
        == "Draft tokens accepted, by their position among a step's drafts (0: the first)."
    )


VLLM_SAMPLE = re.compile(r"^(vllm:\w+(?:\{[^}]*\})?) (\S+)$")


def vllm_samples(text: bytes) -> dict[str, float]:
    lines = text.decode().splitlines()
    return {m.group(1): float(m.group(2)) for m in map(VLLM_SAMPLE.match, lines) if m}


def test_the_gateways_read_the_queue_and_kv_figures_under_vllms_names():
    """The endpoint picker of the Gateway API Inference Extension, llm-d and KServe read these;
    production-stack's router reads the older gpu_cache_usage_perc."""
    stats = {"num_requests_running": 2, "num_requests_waiting": 5, "kv_cache_usage_perc": 0.25}
    text = ServerMetrics("glm", {"block_size": 16, "num_gpu_blocks": 512}).render(stats)
    got = vllm_samples(text)
    assert got == {
        'vllm:num_requests_running{model_name="glm"}': 2,
        'vllm:num_requests_waiting{model_name="glm"}': 5,
        'vllm:kv_cache_usage_perc{model_name="glm"}': 0.25,
        'vllm:gpu_cache_usage_perc{model_name="glm"}': 0.25,
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="512"}': 1,
    }
    assert all(types(text)[name.split("{")[0]] == "gauge" for name in got)
    assert samples(text)["pagedserve:num_requests_waiting"] == 5  # beside the pagedserve: ones


def test_each_app_has_a_registry_of_its_own():
    a, b = ServerMetrics(), ServerMetrics()
    a.request_success.labels(finished_reason="stop").inc()
    assert 'pagedserve:request_success_total{finished_reason="stop"}' in samples(a.render({}))
    assert 'pagedserve:request_success_total{finished_reason="stop"}' not in samples(b.render({}))


def test_latencies_use_vllms_buckets():
    metrics = ServerMetrics()
    metrics.e2e.observe(0.03)
    got = samples(metrics.render({}))
    buckets = [
        float(k.split('le="')[1].rstrip('"}'))
        for k in got
        if k.startswith("pagedserve:e2e_request_latency_seconds_bucket") and "+Inf" not in k
    ]
    assert buckets == list(LATENCY_BUCKETS)
    assert got['pagedserve:e2e_request_latency_seconds_bucket{le="0.02"}'] == 0
    assert got['pagedserve:e2e_request_latency_seconds_bucket{le="0.04"}'] == 1


# ---- one request's latencies ----------------------------------------------------------------------
def histogram(metrics: ServerMetrics, name: str) -> tuple[float, float]:
    got = samples(metrics.render({}))
    return got[f"pagedserve:{name}_count"], got[f"pagedserve:{name}_sum"]


def test_the_first_tokens_give_the_time_to_first_token_and_the_queue_time(clock):
    metrics = ServerMetrics()
    timer = RequestTimer(metrics)
    clock.now += 0.5
    timer.on_output(2, {"first_scheduled_time": 100.2})
    assert histogram(metrics, "time_to_first_token_seconds") == (1, pytest.approx(0.5))
    assert histogram(metrics, "request_queue_time_seconds") == (1, pytest.approx(0.2))
    assert histogram(metrics, "inter_token_latency_seconds") == (0, 0)


def test_without_a_scheduling_time_the_queue_time_is_up_to_the_first_token(clock):
    metrics = ServerMetrics()
    timer = RequestTimer(metrics)
    clock.now += 0.25
    timer.on_output(1)
    assert histogram(metrics, "request_queue_time_seconds") == (1, pytest.approx(0.25))
    metrics = ServerMetrics()
    timer = RequestTimer(metrics)
    clock.now += 0.25
    timer.on_output(1, {"first_scheduled_time": None})
    assert histogram(metrics, "request_queue_time_seconds") == (1, pytest.approx(0.25))


def test_a_scheduling_time_before_arrival_is_a_queue_time_of_zero(clock):
    metrics = ServerMetrics()
    timer = RequestTimer(metrics)
    clock.now += 1
    timer.on_output(1, {"first_scheduled_time": 50.0})
    assert histogram(metrics, "request_queue_time_seconds") == (1, 0)


def test_later_tokens_each_observe_their_share_of_the_gap(clock):
    metrics = ServerMetrics()
    timer = RequestTimer(metrics)
    clock.now += 0.1
    timer.on_output(1)
    clock.now += 0.3
    timer.on_output(4)  # 3 new tokens in 0.3 s
    assert histogram(metrics, "inter_token_latency_seconds") == (3, pytest.approx(0.3))
    clock.now += 0.2
    timer.on_output(5)
    assert histogram(metrics, "inter_token_latency_seconds") == (4, pytest.approx(0.5))
    assert histogram(metrics, "time_to_first_token_seconds")[0] == 1


def test_an_output_without_new_tokens_observes_nothing(clock):
    metrics = ServerMetrics()
    timer = RequestTimer(metrics)
    clock.now += 0.1
    timer.on_output(0)
    assert histogram(metrics, "time_to_first_token_seconds") == (0, 0)
    timer.on_output(2)
    clock.now += 0.1
    timer.on_output(2)
    timer.on_output(1)
    assert histogram(metrics, "inter_token_latency_seconds") == (0, 0)
    assert (timer.num_tokens, timer.last_token_time) == (2, pytest.approx(100.1))


def test_the_end_observes_the_latency_and_counts_each_sequence_once(clock):
    metrics = ServerMetrics()
    timer = RequestTimer(metrics)
    clock.now += 2.0
    timer.on_finish(["stop", "length", None, "stop"])
    assert histogram(metrics, "e2e_request_latency_seconds") == (1, pytest.approx(2.0))
    got = samples(metrics.render({}))
    assert got['pagedserve:request_success_total{finished_reason="stop"}'] == 2
    assert got['pagedserve:request_success_total{finished_reason="length"}'] == 1
    assert got['pagedserve:request_success_total{finished_reason="abort"}'] == 1
