"""`pagedserve smi` against the live server (conftest)."""

from __future__ import annotations

import json
import threading
import time

import httpx

from pagedserve.entrypoints.cli.main import main

# requests sent one after another while smi polls: on a loaded machine (the suite on 2 cores)
# one tiny-model request could finish between two smi calls
REQUESTS = 4


def _smi(capsys, live_server, *extra: str) -> str:
    assert main(["smi", "--url", live_server.url, "--api-key", live_server.api_key, *extra]) == 0
    return capsys.readouterr().out


def test_smi_json_shows_kv_pages_that_change_while_requests_run(capsys, live_server):
    idle = json.loads(_smi(capsys, live_server, "--json"))[0]
    assert idle["kv_pages"]["in_use"] == 0 and idle["kv_pages"]["total"] == 256
    assert set(idle["tiers"]) and idle["requests"] == {"running": 0, "waiting": 0}
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 200, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {live_server.api_key}"}

    def requests_one_after_another():  # a longer window than one request's, one at a time
        for _ in range(REQUESTS):
            httpx.post(live_server.url + "/v1/completions", json=body, headers=headers, timeout=60)

    request = threading.Thread(target=requests_one_after_another)
    request.start()
    busy = None
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and request.is_alive():
        snap = json.loads(_smi(capsys, live_server, "--json", "-d", "0"))[0]
        if snap["kv_pages"]["in_use"] > 0:
            busy = snap
            break
        time.sleep(0.01)
    request.join(60)
    assert busy is not None, "smi never saw a KV page in use"
    assert busy["requests"]["running"] == 1
    after = json.loads(_smi(capsys, live_server, "--json"))[0]
    assert after["kv_pages"]["in_use"] == 0
    assert after["kv_pages"]["cached"] > 0  # the request's full blocks stay in the prefix cache
    for snap in (idle, busy, after):
        kv = snap["kv_pages"]
        assert kv["in_use"] + kv["cached"] + kv["free"] == kv["total"] == 256
    assert after["generation_tokens_total"] >= idle["generation_tokens_total"] + REQUESTS * 200


def test_smi_table_and_detail_views(capsys, live_server):
    table = _smi(capsys, live_server)
    assert "KV pages" in table and "tok/s" in table and "faults detected" in table
    widths = {len(line) for line in table.splitlines()}
    assert widths == {88}, table  # every row as wide as the border, the title's included
    detail = _smi(capsys, live_server, "-q", "-d", "0")
    assert "Device 0" in detail and "Faults detected" in detail


def test_smi_names_the_kernels_the_device_runs(capsys, live_server):
    # the CPU backends name the instruction-set target auto chose on this machine
    from pagedserve.hal.native import choose_kernels

    expected = choose_kernels("auto").name
    device = json.loads(_smi(capsys, live_server, "--json"))[0]
    assert device["kernels"] == expected
    assert f"{expected} kernels)" in _smi(capsys, live_server)
    assert f"Kernels               : {expected}" in _smi(capsys, live_server, "-q", "-d", "0")


def test_smi_reports_an_unreachable_server(capsys):
    from pagedserve.testing import free_port

    assert main(["smi", "--url", f"http://127.0.0.1:{free_port()}", "--timeout", "1"]) == 1
    assert "cannot read" in capsys.readouterr().err


def test_smi_rejects_an_unknown_device_index(capsys, live_server):
    assert main(["smi", "--url", live_server.url, "--api-key", live_server.api_key, "-d", "3"]) == 2


def test_smi_without_the_servers_api_key_says_to_pass_it(capsys, live_server):
    assert main(["smi", "--url", live_server.url]) == 2
    assert "pass an API key with --api-key" in capsys.readouterr().err
    assert main(["smi", "--url", live_server.url, "--api-key", "wrong"]) == 2
    assert "pass a different key with --api-key" in capsys.readouterr().err
