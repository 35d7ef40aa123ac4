"""Faults: inject every device fault kind into a serving demo model and count what was recovered.

    taskset -c 1 nice -n 10 python -m benchmarks.reliability.faults [--rounds 10]

Starts `pagedserve serve` on the demo model with --device kunlun-emu --enable-fault-injection and
a patrol scrub over every weight page in every step, takes a fault-free greedy answer, then for
ROUNDS rounds per kind: flips a bit in a random weight page (the answer must equal the fault-free
one), in the KV page of a request mid-stream (its answer must equal the fault-free one), and
fails a kernel under a request (that request gets an error saying so, the next one is answered).
Reads the counts back from /device and /metrics (pagedserve:device_faults_total{kind}). Writes
benchmarks/results/faults.json.
"""

from __future__ import annotations

import argparse
import json
import re

from pagedserve.testing import serve

BODY = {"prompt": "Once upon a time", "max_tokens": 32, "temperature": 0, "ignore_eos": True}


def _answer(http, url: str) -> tuple[int, str]:
    r = http.post(url + "/v1/completions", json=BODY)
    body = r.json()
    return r.status_code, body["choices"][0]["text"] if r.status_code == 200 else str(body)


def _inject(http, url: str, **fault) -> None:
    r = http.post(url + "/device/faults", json=fault)
    r.raise_for_status()


def _kv_fault_mid_stream(http, url: str) -> str:
    """Stream the answer; after its third token, flip a bit in its first KV page."""
    text = []
    with http.stream("POST", url + "/v1/completions", json={**BODY, "stream": True}) as r:
        for i, line in enumerate(line for line in r.iter_lines() if line.startswith("data: {")):
            text.append(json.loads(line[6:])["choices"][0]["text"])
            if i == 2:
                _inject(http, url, kind="kv_page")
    return "".join(text)


def run(url: str, rounds: int) -> dict:
    import httpx

    outcome = {
        k: {"rounds": rounds, "answers_as_fault_free": 0} for k in ("weight_page", "kv_page")
    }
    outcome["step"] = {"rounds": rounds, "failed_with_error": 0, "next_answered": 0}
    with httpx.Client(timeout=120) as http:
        status, clean = _answer(http, url)
        assert status == 200, clean
        for _ in range(rounds):
            _inject(http, url, kind="weight_page")
            outcome["weight_page"]["answers_as_fault_free"] += _answer(http, url) == (200, clean)
            outcome["kv_page"]["answers_as_fault_free"] += _kv_fault_mid_stream(http, url) == clean
            _inject(http, url, kind="step")
            status, error = _answer(http, url)
            outcome["step"]["failed_with_error"] += status == 500 and "kernel fault" in error
            outcome["step"]["next_answered"] += _answer(http, url) == (200, clean)
        device = http.get(url + "/device").json()
        metrics = http.get(url + "/metrics").text
    exported = dict(
        re.findall(r'^pagedserve:device_faults_total\{kind="(\w+)"\} (\S+)$', metrics, re.M)
    )
    for kind, counts in device["faults"].items():
        outcome[kind] |= counts | {"metrics_device_faults_total": float(exported.get(kind, 0))}
    return outcome


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    from benchmarks.results import write_result

    flags = ["--device", "kunlun-emu", "--enable-fault-injection", "--weight-scrub-pages", "100000"]
    with serve(*flags, log=None, log_level="warning", timeout=300) as (_, url):
        faults = run(url, args.rounds)
    for kind, f in faults.items():
        print(
            f"{kind}: {f['injected']} injected, {f['detected']} detected, {f['recovered']} "
            f"recovered; "
            + ", ".join(
                f"{k} {v}" for k, v in f.items() if k not in ("injected", "detected", "recovered")
            )
        )
    write_result("faults", {"faults": faults})


if __name__ == "__main__":
    main()
