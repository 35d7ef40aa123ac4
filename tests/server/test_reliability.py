"""`pagedserve serve` under faults: injected device faults show in smi and /metrics and leave the
server serving; a SIGKILLed server restarts on its port with nothing to clean by hand; a short
soak ends with an empty, consistent KV pool (the long one: benchmarks/reliability/soak.py)."""

from __future__ import annotations

import glob
import os
import re
import signal
import time

import httpx
import pytest

from pagedserve.entrypoints.cli.main import main
from tests.helpers.metrics import read_metrics

PROMPT_IDS = [2, 4, 60, 61, 62, 63, 64, 65, 66, 67]


def serve_flags(model_dir, *extra: str) -> list[str]:
    return [
        "--model", str(model_dir), "--served-model-name", "tiny", "--dtype", "float32",
        "--device", "kunlun-emu", "--num-kv-pages", "128", "--max-model-len", "256",
        "--log-level", "warning", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def fault_injection_server(tiny_glm4):
    from pagedserve.testing import serve

    flags = serve_flags(tiny_glm4[0], "--enable-fault-injection", "--weight-scrub-pages", "100000")
    with serve(*flags) as (proc, url):
        yield url


def complete(url: str, max_tokens: int = 8, prompt: list[int] = PROMPT_IDS) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def fault_counts(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {
        kind: float(value)
        for kind, value in re.findall(
            r'^pagedserve:device_faults_total\{kind="(\w+)"\} (\S+)$', text, re.M
        )
    }


def inject(url: str, **body) -> dict:
    r = httpx.post(url + "/device/faults", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


# two full blocks of 16 tokens and more: a second request reads those two from the prefix cache,
# so a fault in their pages is read unless recovery drops them
CACHED_PROMPT_IDS = [(7 * i) % 200 + 20 for i in range(40)]


def cached_pages(url: str) -> set[int]:
    cells = httpx.get(url + "/device/pages", timeout=10).json()["cells"]
    return {page for page, state in enumerate(cells) if state == "1"}


@pytest.mark.faults
def test_every_injected_fault_kind_is_recovered_and_shows_in_metrics_and_smi(
    fault_injection_server, capsys
):
    url = fault_injection_server
    clean = complete(url).json()["choices"][0]["text"]
    inject(url, kind="weight_page", tag="model.norm.weight", page=0)
    assert complete(url).json()["choices"][0]["text"] == clean  # restored, step recomputed
    before = cached_pages(url)
    cached_clean = complete(url, prompt=CACHED_PROMPT_IDS).json()["choices"][0]["text"]
    pages = sorted(cached_pages(url) - before)
    assert len(pages) >= 2  # the prompt's full blocks, which the same prompt reads again
    for page in pages:
        inject(url, kind="kv_page", page=page)
    hits = read_metrics(url)["pagedserve:prefix_cache_hits_total"]
    assert complete(url, prompt=CACHED_PROMPT_IDS).json()["choices"][0]["text"] == cached_clean
    assert read_metrics(url)["pagedserve:prefix_cache_hits_total"] == hits  # none read
    inject(url, kind="step")
    failed = complete(url)
    assert (
        failed.status_code == 500 and "injected kernel fault" in failed.json()["error"]["message"]
    )
    assert complete(url).json()["choices"][0]["text"] == clean  # the next request is served
    n = len(pages)
    assert fault_counts(url) == {"kv_page": n, "weight_page": 1.0, "step": 1.0}
    faults = httpx.get(url + "/device", timeout=10).json()["faults"]
    assert faults["kv_page"] == {"injected": n, "detected": n, "recovered": n}
    assert faults["weight_page"] == faults["step"] == {"injected": 1, "detected": 1, "recovered": 1}
    assert main(["smi", "--url", url]) == 0
    assert (
        f"faults kv_page {n}/{n}  weight_page 1/1  step 1/1 (detected/recovered)"
        in capsys.readouterr().out
    )
    invariants = httpx.get(url + "/device/invariants", timeout=10).json()
    assert invariants["problems"] == [] and invariants["kv_cache_usage_perc"] == 0


@pytest.mark.faults
def test_a_scrub_on_demand_and_bad_injections_answer_plainly(fault_injection_server):
    url = fault_injection_server
    inject(url, kind="weight_page", tag="lm_head.weight", page=0)
    scrub = httpx.post(url + "/device/scrub", timeout=30).json()
    assert scrub["pages_restored"] == 1 and scrub["pages_verified"] > 1
    r = httpx.post(url + "/device/faults", json={"kind": "kv_page", "page": 5000}, timeout=10)
    assert r.status_code == 400 and "KV pages are 0..127, not 5000" in r.text
    r = httpx.post(url + "/device/faults", json={"kind": "disk"}, timeout=10)
    assert r.status_code == 400


def test_fault_injection_is_off_unless_the_server_allows_it(live_server):
    headers = {"Authorization": f"Bearer {live_server.api_key}"}
    r = httpx.post(live_server.url + "/device/faults", json={"kind": "step"}, headers=headers)
    assert r.status_code == 403 and "--enable-fault-injection" in r.text
    assert httpx.post(live_server.url + "/device/faults", json={"kind": "step"}).status_code == 401


def _gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_a_sigkilled_server_restarts_on_its_port_with_nothing_to_clean(
    tiny_glm4, tmp_path, monkeypatch
):
    from pagedserve.testing import free_port, serve

    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where the server makes its ZeroMQ ipc files
    port = free_port()
    flags = serve_flags(tiny_glm4[0])
    with serve(*flags, port=port) as (proc, url):
        core = httpx.get(url + "/health", timeout=10).json()["pid"]
        body = {"prompt": PROMPT_IDS, "max_tokens": 200, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            next(r.iter_lines())  # mid-load: a stream in flight
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
        assert _gone(core, 10), "the engine core outlived its SIGKILLed server"
    assert glob.glob(str(tmp_path / "pagedserve-*")) == [], "ipc files left behind"
    with serve(*flags, port=port) as (proc, url):
        assert complete(url).status_code == 200
    assert glob.glob(str(tmp_path / "pagedserve-*")) == []


def test_a_short_soak_leaves_an_empty_consistent_pool(tiny_glm4, tmp_path):
    """A few hundred mixed requests (streaming or not, n up to 4, shared prefixes, 20% of
    clients gone at a random moment): zero 5xx, nothing running or waiting, no page in use, the
    allocator's invariant check passes."""
    from benchmarks.reliability.processes import logged_errors
    from benchmarks.reliability.soak import run_soak
    from pagedserve.testing import serve

    flags = serve_flags(tiny_glm4[0], "--max-num-seqs", "8")
    with (tmp_path / "serve.log").open("w+") as log:
        with serve(*flags, log=log) as (proc, url):
            figures = run_soak(url, 120, concurrency=12, memory_pids=[], prefix_copies=1)
        log.seek(0)
        assert logged_errors(log.read()) == []  # gone clients' requests end without an error
    assert figures["status_5xx"] == 0 and figures["other_errors"] == 0, figures["outcomes"]
    assert figures["completed"] + figures["disconnected"] == 120
    assert figures["disconnected"] > 0
    end = figures["end_state"]
    assert end["problems"] == [] and end["kv_cache_usage_perc"] == 0
    assert end["num_requests_running"] == end["num_requests_waiting"] == end["num_groups"] == 0
