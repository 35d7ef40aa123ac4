"""`pagedserve serve` with a host tier: swapped pages and the host prefix cache in /metrics,
/device, the console's page map and `pagedserve smi`, as a tier of their own; a fault injected
into host frames is detected and the request that needed them is recomputed, not answered wrong.
"""

from __future__ import annotations

import httpx
import pytest

from pagedserve.entrypoints.cli.main import main
from tests.helpers.metrics import read_metrics
from tests.helpers.models import host_tier_gib

BLOCK, PAGES = 4, 24
PROMPT = [(5 * i) % 250 + 20 for i in range(30)]  # 30 tokens: 7 full blocks


@pytest.fixture(scope="module")
def tiers_server(tiny_glm4):
    from pagedserve.testing import serve

    path = tiny_glm4[0]
    flags = [
        "--model", str(path), "--served-model-name", "tiny", "--dtype", "float32",
        "--device", "kunlun-emu", "--block-size", str(BLOCK), "--num-kv-pages", str(PAGES),
        "--max-model-len", "96", "--preemption-mode", "swap",
        "--swap-space", str(host_tier_gib(path, 32, BLOCK)),
        "--host-prefix-cache", str(host_tier_gib(path, 16, BLOCK)),
        "--enable-fault-injection", "--log-level", "warning",
    ]  # fmt: skip
    with serve(*flags) as (_, url):
        yield url


def complete(url: str, prompt: list[int], max_tokens: int, n: int = 1) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/v1/completions", json={**body, "n": n}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_swapped_pages_show_in_metrics_device_page_map_and_smi(tiers_server, capsys):
    url = tiers_server
    # n = 2: two sequences of 30 + 40 tokens need 8 shared pages and 10 more each, of 24: the
    # second sibling is swapped out, and back
    out = complete(url, PROMPT, 40, n=2)
    assert out["choices"][0]["text"] == out["choices"][1]["text"]  # greedy, the same path
    m = read_metrics(url)
    assert m["pagedserve:num_swapped_preemptions_total"] >= 1
    assert m["pagedserve:swapped_out_pages_total"] == m["pagedserve:swapped_in_pages_total"] > 0
    assert m["pagedserve:num_requests_swapped"] == m["pagedserve:num_swapped_pages"] == 0
    assert m["pagedserve:recomputed_tokens_total"] == 0
    device = httpx.get(url + "/device", timeout=10).json()
    host = device["host_pages"]
    assert host["total"] == 48 and host["swap_share"] == 32 and host["cache_share"] == 16
    pages = httpx.get(url + "/device/pages", timeout=10).json()["host"]
    assert pages["total"] == len(pages["cells"]) == host["total"]
    assert pages["counts"] == {k: host[k] for k in ("free", "cached", "swapped")}
    assert main(["smi", "--url", url]) == 0
    summary = capsys.readouterr().out
    assert f"host pages 0 swapped / {host['cached']} cached / {host['free']} free of 48" in summary
    assert main(["smi", "--url", url, "-q"]) == 0
    assert "    Host pages\n        total             : 48" in capsys.readouterr().out


@pytest.mark.faults
def test_a_fault_in_the_host_prefix_cache_is_detected_and_the_prompt_recomputed(tiers_server):
    url = tiers_server
    clean = complete(url, PROMPT, 8)["choices"][0]["text"]
    other = [(7 * i) % 250 + 20 for i in range(80)]
    complete(url, other, 8)  # 22 pages: PROMPT's cached blocks leave the KV tier for the host
    cells = httpx.get(url + "/device/pages", timeout=10).json()["host"]["cells"]
    cached = [frame for frame, state in enumerate(cells) if state == "1"]
    before = read_metrics(url)
    for frame in cached:
        r = httpx.post(url + "/device/faults", json={"kind": "host_page", "page": frame})
        assert r.status_code == 200 and r.json() == {"kind": "host_page", "page": frame}
    assert complete(url, PROMPT, 8)["choices"][0]["text"] == clean
    after = read_metrics(url)
    faults = 'pagedserve:device_faults_total{kind="kv_page"}'
    assert after[faults] - before[faults] == len(cached) > 0
    hits = "pagedserve:host_prefix_cache_hits_total"
    assert after[hits] == before[hits]  # none of the corrupted blocks was used
    invariants = httpx.get(url + "/device/invariants", timeout=10).json()
    assert invariants["problems"] == []


def test_a_host_fault_outside_the_host_tier_is_a_400(tiers_server):
    r = httpx.post(tiers_server + "/device/faults", json={"kind": "host_page", "page": 48})
    assert r.status_code == 400 and "host-tier frames are 0..47, not 48" in r.text
