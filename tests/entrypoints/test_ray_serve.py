"""``pagedserve serve --data-parallel-backend ray`` on a two-node Ray cluster on this machine
(``ray.cluster_utils.Cluster``): two replicas of the demo model, one on each node, behind one
port. They answer as ``pagedserve serve`` does (the same server code over one engine, here in
this process: the same greedy text, tool calls and streamed chunks), both take traffic, the
metrics carry vLLM's names, a SIGKILLed engine core fails only its own requests (503) and Ray
replaces its replica, and SIGTERM drains.

One cluster and one application for the whole file (Ray is slow to start on two cores): the
tests run in order, the restart and the drain last.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.helpers.tools import require_module

ray = require_module("ray", "the Ray Serve tests need Ray: pip install 'pagedserve[ray]'")

LIMITS = {"max_model_len": 256, "num_kv_pages": 64, "max_num_seqs": 8, "block_size": 16}
FLAGS = [
    *("--device", "cpu", "--seed", "0"),
    *(f"--{k.replace('_', '-')}={v}" for k, v in LIMITS.items()),
    *("--enable-auto-tool-choice", "--tool-call-parser", "glm4"),
]
RAY_FLAGS = [
    *("--data-parallel-size", "2", "--data-parallel-backend", "ray"),
    *("--num-cpus-per-replica", "0.5", "--max-replicas-per-node", "1"),
    *("--request-router", "session", "--shutdown-timeout", "60"),
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
RESTART_TIMEOUT_S = 120


@pytest.fixture(scope="module")
def cluster() -> Iterator:
    """A head node and a worker node, one CPU each, on this machine."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    try:
        yield cluster
    finally:
        cluster.shutdown()


@pytest.fixture(scope="module")
def ray_server(cluster, tmp_path_factory) -> Iterator[tuple]:
    """The command, joining the cluster: (its process, its URL, its log file)."""
    from pagedserve.testing import serve

    log_path = tmp_path_factory.mktemp("ray") / "serve.log"
    with (
        log_path.open("w") as log,
        serve(*FLAGS, *RAY_FLAGS, "--ray-address", cluster.address, log=log, timeout=300) as (
            proc,
            url,
        ),
    ):
        wait_for(lambda: len(alive_replicas(url)) == 2, "both replicas reporting")
        yield proc, url, log_path


@pytest.fixture(scope="module")
def reference() -> Iterator:
    """``pagedserve serve``'s app over one engine with the same flags, in this process."""
    from tests.helpers.apps import demo_engine, served

    engine = demo_engine(seed=0, **LIMITS)
    with served(
        engine, api_key=None, tool_call_parser="glm4", enable_auto_tool_choice=True
    ) as client:
        yield client


def wait_for(condition, what: str, timeout: float = RESTART_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {timeout:.0f} s"
        time.sleep(0.25)


def health(url: str) -> dict:
    return httpx.get(url + "/health", timeout=10).json()


def alive_replicas(url: str) -> list[dict]:
    return [r for r in health(url)["replicas"] if r["engine"] == "alive"]


def routed(url: str) -> dict[str, int]:
    return {r["replica"]: r["num_routed"] for r in health(url)["replicas"]}


def post(url_or_client, path: str, body: dict, **kwargs) -> httpx.Response:
    if isinstance(url_or_client, str):
        return httpx.post(url_or_client + path, json=body, timeout=120, **kwargs)
    return url_or_client.post(path, json=body, **kwargs)


def sse_events(response_text: str) -> list[dict]:
    return [
        json.loads(line[6:]) for line in response_text.splitlines() if line.startswith("data: {")
    ]


def without_ids(body: dict) -> dict:
    """A response less what differs from call to call (ids, creation time)."""
    body = {k: v for k, v in body.items() if k not in ("id", "created")}
    for choice in body.get("choices", []):
        for call in (choice.get("message") or choice.get("delta") or {}).get("tool_calls") or []:
            call.pop("id", None)
    return body


def merged(events: list[dict]) -> dict:
    """A stream's chunks joined per choice (how outputs fall into chunks depends on timing, in
    the single server too): the text, the tool calls' names and arguments, the finish reason,
    the logprobs' tokens."""
    out: dict = {}
    for event in events:
        for choice in event["choices"]:
            mine = out.setdefault(choice["index"], {"text": "", "calls": {}, "tokens": []})
            delta = choice.get("delta") or {}
            mine["text"] += choice.get("text") or delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                name, args = mine["calls"].get(call["index"], ("", ""))
                fn = call.get("function") or {}
                mine["calls"][call["index"]] = (
                    name + (fn.get("name") or ""),
                    args + (fn.get("arguments") or ""),
                )
            mine["tokens"] += (choice.get("logprobs") or {}).get("tokens") or []
            mine["finish_reason"] = choice.get("finish_reason") or mine.get("finish_reason")
    return out


CASES = [
    ("/v1/completions", {"prompt": "The capital of France", "max_tokens": 24}),
    ("/v1/completions", {"prompt": "In a hole", "max_tokens": 8, "logprobs": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 24}),
    (
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Weather in Paris?"}],
            "tools": TOOLS,
            "tool_choice": "required",
            "max_tokens": 40,
        },
    ),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": TOOLS},
    ),
]


@pytest.mark.parametrize("path, body", CASES, ids=[f"{p}-{i}" for i, (p, _) in enumerate(CASES)])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_replicas_answer_exactly_as_pagedserve_serve_does(
    ray_server, reference, path, body, stream
):
    _, url, _ = ray_server
    body = {**body, "model": "demo", "stream": stream, "temperature": 0}  # greedy
    got, want = post(url, path, body), post(reference, path, body)
    assert got.status_code == want.status_code == 200, got.text
    if stream:
        assert merged(sse_events(got.text)) == merged(sse_events(want.text))
        assert got.text.rstrip().endswith("data: [DONE]")
    else:
        assert without_ids(got.json()) == without_ids(want.json())


def test_a_request_of_several_prompts_is_answered_whole(ray_server):
    """Its prompts may go to different replicas (each then runs in a batch of its own, so the
    greedy text need not be the one a shared batch gives)."""
    _, url, _ = ray_server
    body = {"prompt": ["Once upon", "In a hole", "The end"], "max_tokens": 8, "n": 2}
    r = post(url, "/v1/completions", body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == list(range(6))
    assert all(c["finish_reason"] == "length" for c in choices)
    assert r.json()["usage"]["completion_tokens"] == 48


def test_errors_are_the_single_servers(ray_server, reference):
    _, url, _ = ray_server
    body = {"model": "demo", "prompt": "x" * 2000, "max_tokens": 4}
    got, want = post(url, "/v1/completions", body), post(reference, "/v1/completions", body)
    assert got.status_code == want.status_code == 400
    assert got.json() == want.json()
    got = post(url, "/v1/completions", {"model": "gpt-4", "prompt": "hi"})
    assert got.status_code == 404 and got.json()["error"]["code"] == "model_not_found"


def test_both_replicas_take_traffic(ray_server):
    _, url, _ = ray_server
    before = routed(url)
    threads = [
        threading.Thread(
            target=post, args=(url, "/v1/completions", {"prompt": f"{i} apples", "max_tokens": 16})
        )
        for i in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = routed(url)
    assert sum(after.values()) - sum(before.values()) == 8
    assert all(after[r] > before.get(r, 0) for r in after), (before, after)


def test_a_replica_runs_on_each_node_of_the_cluster(ray_server, cluster):
    _, url, _ = ray_server
    nodes = {cluster.head_node.node_id, *(n.node_id for n in cluster.worker_nodes)}
    assert {r["node_id"] for r in health(url)["replicas"]} == nodes


def test_a_conversation_and_a_session_each_keep_to_one_replica(ray_server):
    _, url, _ = ray_server
    history = [{"role": "system", "content": "You are a terse assistant. " * 8}]
    homes = set()
    for turn in range(3):
        history.append({"role": "user", "content": f"Question number {turn}?"})
        before = routed(url)
        r = post(url, "/v1/chat/completions", {"messages": history, "max_tokens": 8})
        history.append(
            {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]}
        )
        after = routed(url)
        homes |= {k for k in after if after[k] != before.get(k, 0)}
    assert len(homes) == 1
    before = routed(url)
    for i in range(4):  # different prompts, one session: one replica
        headers = {"X-Session-ID": "alice"}
        post(url, "/v1/completions", {"prompt": f"{i} pears", "max_tokens": 2}, headers=headers)
    after = routed(url)
    assert sorted(after[k] - before.get(k, 0) for k in after) == [0, 4]


def test_metrics_carry_vllms_names_summed_over_the_replicas(ray_server):
    _, url, _ = ray_server
    post(url, "/v1/completions", {"prompt": "count me", "max_tokens": 3})
    time.sleep(2.5)  # the replicas report every second
    text = httpx.get(url + "/metrics", timeout=10).text
    for name in (
        "num_requests_waiting",
        "num_requests_running",
        "kv_cache_usage_perc",
        "gpu_cache_usage_perc",
    ):
        assert f'vllm:{name}{{model_name="demo"}}' in text, name
    assert 'vllm:cache_config_info{block_size="16",num_gpu_blocks="64"} 1.0' in text
    generated = float(text.split("\npagedserve:generation_tokens_total ")[1].split()[0])
    assert generated >= 3


def start_streams(url: str, prompts: list[str]) -> tuple[list[threading.Thread], list]:
    """Long streamed completions, one thread each; returns once each has its first chunk."""
    results: list = []
    started = [threading.Event() for _ in prompts]

    def run(prompt: str, first: threading.Event) -> None:
        body = {"prompt": prompt, "max_tokens": 230, "ignore_eos": True, "stream": True}
        lines = []
        try:
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    first.set()
        finally:
            first.set()
        results.append((r.status_code, sse_events("\n".join(lines))))

    threads = [threading.Thread(target=run, args=args) for args in zip(prompts, started)]
    for t in threads:
        t.start()
    for event in started:
        assert event.wait(120), "no first chunk"
    return threads, results


def join_all(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a client hangs"


def test_a_killed_engine_core_fails_its_requests_with_503_and_ray_replaces_its_replica(ray_server):
    _, url, _ = ray_server
    victim = alive_replicas(url)[0]
    threads, results = start_streams(url, [f"Tale {i}:" for i in range(4)])  # two on each
    os.kill(victim["pid"], signal.SIGKILL)
    join_all(threads)
    # until Ray has replaced it, the dead replica passes what reaches it on to the other
    meanwhile = [
        post(url, "/v1/completions", {"prompt": f"{i} plums", "max_tokens": 4}) for i in range(4)
    ]
    assert [r.status_code for r in meanwhile] == [200] * 4, [r.text for r in meanwhile]
    ends = []
    for status, events in results:
        assert status == 200
        last = events[-1]
        ends.append(
            last["error"]["code"] if "error" in last else last["choices"][0]["finish_reason"]
        )
    assert sorted(set(ends)) == ["engine_dead", "length"], ends
    wait_for(
        lambda: (
            len(reps := alive_replicas(url)) == 2
            and victim["replica"] not in {r["replica"] for r in reps}
        ),
        "replacement replica",
    )
    assert post(url, "/v1/completions", {"prompt": "after", "max_tokens": 4}).status_code == 200


def test_sigterm_drains_the_requests_in_flight_then_exits(ray_server):
    proc, url, log_path = ray_server
    threads, results = start_streams(url, [f"Drain {i}:" for i in range(3)])
    proc.send_signal(signal.SIGTERM)

    def refused() -> bool:
        r = post(url, "/v1/completions", {"prompt": "late", "max_tokens": 1})
        return r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"

    wait_for(refused, "503 to a new request", 30)
    join_all(threads)
    assert [events[-1]["choices"][0]["finish_reason"] for _, events in results] == ["length"] * 3
    assert proc.wait(60) == 0, log_path.read_text()[-3000:]
