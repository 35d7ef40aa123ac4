"""`pagedserve serve` with its engine core in a process of its own: the same answers as the
offline engine across the process boundary, aborts, /device and smi, /health under overload,
and what a killed engine process does to the server."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pagedserve import LLM, SamplingParams
from tests.helpers.metrics import read_metrics, wait_idle
from tests.helpers.processes import tagged_env, wait_until_gone

PROMPT_IDS = [2, 4, 60, 61, 62, 63, 64, 65, 66, 67]
ENGINE = dict(dtype="float32", num_kv_pages=256, block_size=16, max_model_len=256, device="cpu")


def serve_flags(model_dir, *extra: str) -> list[str]:
    return [
        "--model", str(model_dir), "--served-model-name", "tiny", "--dtype", "float32",
        "--device", "cpu", "--num-kv-pages", "256", "--max-model-len", "256", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def engine_process_server(tiny_glm4, tmp_path_factory):
    from pagedserve.testing import serve

    # admits 4 running + 8 queued: the overload test drives it at 20x that
    flags = serve_flags(tiny_glm4[0], "--max-num-seqs", "4", "--max-queue-len", "8")
    log = (tmp_path_factory.mktemp("serve") / "serve.log").open("w+")
    with serve(*flags, "--log-level", "warning", log=log) as (proc, url):
        yield proc, url


@pytest.fixture(scope="module")
def offline(tiny_glm4):
    return LLM(model=str(tiny_glm4[0]), **ENGINE)


def complete(url: str, **body) -> dict:
    r = httpx.post(url + "/v1/completions", json={"prompt": PROMPT_IDS, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def run_offline(llm: LLM, **params):
    return llm.generate({"prompt_token_ids": PROMPT_IDS}, SamplingParams(**params), False)[0]


def engine_pid(url: str) -> int:
    return httpx.get(url + "/health", timeout=10).json()["pid"]


# ---- the same answers as the offline engine -----------------------------------------------------
def test_greedy_tokens_and_logprobs_cross_the_process_boundary(engine_process_server, offline):
    _, url = engine_process_server
    out = complete(url, max_tokens=8, temperature=0, logprobs=2, ignore_eos=True)["choices"][0]
    ref = run_offline(offline, max_tokens=8, temperature=0, logprobs=2, ignore_eos=True).outputs[0]
    assert out["text"] == ref.text and out["finish_reason"] == "length"
    expected = [lp[t] for lp, t in zip(ref.logprobs, ref.token_ids)]
    assert out["logprobs"]["token_logprobs"] == pytest.approx(expected, abs=1e-4)
    assert all(len(top) <= 2 for top in out["logprobs"]["top_logprobs"])


def test_a_stop_string_matched_in_the_http_process_ends_the_text_as_offline(
    engine_process_server, offline
):
    _, url = engine_process_server
    full = run_offline(offline, max_tokens=12, temperature=0, ignore_eos=True).outputs[0].text
    stop = full[4:6]
    assert stop
    ref = run_offline(offline, max_tokens=12, temperature=0, ignore_eos=True, stop=[stop])
    out = complete(url, max_tokens=12, temperature=0, ignore_eos=True, stop=[stop])["choices"][0]
    assert (out["text"], out["finish_reason"], out["stop_reason"]) == (
        ref.outputs[0].text,
        "stop",
        stop,
    )
    assert stop not in out["text"]
    streamed = _stream_text(url, max_tokens=12, temperature=0, ignore_eos=True, stop=[stop])
    assert streamed == ref.outputs[0].text
    wait_idle(url)  # the core aborted the stopped sequence: no page stays in use


def _stream_text(url: str, **body) -> str:
    text = ""
    with httpx.stream(
        "POST", url + "/v1/completions", json={"prompt": PROMPT_IDS, "stream": True, **body}
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
    return text


def test_n_2_with_a_seed_and_echoed_prompt_logprobs_match_offline(engine_process_server, offline):
    _, url = engine_process_server
    body = dict(max_tokens=8, n=2, seed=3, temperature=1.0, ignore_eos=True)
    out = complete(url, **body)
    ref = run_offline(offline, **body)
    assert [c["text"] for c in out["choices"]] == [o.text for o in ref.outputs]
    assert out["usage"]["completion_tokens"] == 16
    echo = complete(url, max_tokens=1, temperature=0, logprobs=1, echo=True)["choices"][0]
    ref = run_offline(offline, max_tokens=1, temperature=0, logprobs=1, prompt_logprobs=1)
    expected = [None] + [ref.prompt_logprobs[i][t] for i, t in enumerate(PROMPT_IDS) if i]
    assert echo["logprobs"]["token_logprobs"][: len(PROMPT_IDS)] == pytest.approx(
        expected, abs=1e-4
    )


# ---- aborts, metrics, /device, smi --------------------------------------------------------------
def test_a_disconnected_stream_is_aborted_in_the_engine_process(engine_process_server):
    _, url = engine_process_server
    aborted = 'pagedserve:request_success_total{finished_reason="abort"}'
    generated = "pagedserve:generation_tokens_total"
    before = read_metrics(url)
    body = {"prompt": PROMPT_IDS, "max_tokens": 240, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        assert read_metrics(url)["pagedserve:kv_cache_usage_perc"] > 0
    after = wait_idle(url)
    assert after[aborted] == before.get(aborted, 0) + 1
    assert 3 <= after[generated] - before.get(generated, 0) < 240  # stopped short of max_tokens


def test_device_smi_and_health_read_the_engine_process(engine_process_server, capsys):
    from pagedserve.entrypoints.cli.main import main

    proc, url = engine_process_server
    device = httpx.get(url + "/device", timeout=10).json()
    assert device["kv_pages"]["total"] == 256 and device["model"] == "tiny"
    assert main(["smi", "--url", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["kv_pages"]["total"] == 256
    health = httpx.get(url + "/health", timeout=10).json()
    assert health["engine"] == "alive" and health["pid"] != proc.pid
    complete(url, max_tokens=4)
    assert httpx.get(url + "/health", timeout=10).json()["num_steps"] > health["num_steps"]


def test_the_http_process_does_not_load_torch():
    code = (
        "import sys, pagedserve.entrypoints.cli.main, pagedserve.server.app, pagedserve.engine.async_engine;"
        "pagedserve.entrypoints.cli.main.build_parser(['serve']); print('torch' in sys.modules)"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = __import__("subprocess").run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert out.stdout.strip() == "False"


# ---- liveness -----------------------------------------------------------------------------------
def test_health_answers_under_20x_overload(engine_process_server):
    """240 clients against 4 running + 8 queued: every request ends 200 or 503 with Retry-After
    and /health keeps answering (the strict figures: benchmarks/health_under_load.py)."""
    from benchmarks.health_under_load import drive

    _, url = engine_process_server
    body = {"prompt": PROMPT_IDS, "max_tokens": 16, "stream": True, "ignore_eos": True}
    figures = asyncio.run(drive(url, clients=240, duration=4.0, body=body))
    print(
        f"/health under 240 clients: median {figures['health_median_ms']:.1f} ms, "
        f"p99 {figures['health_p99_ms']:.1f} ms; requests {figures['requests']}"
    )
    assert set(figures["requests"]) <= {"200", "503 with Retry-After"}, figures["requests"]
    assert figures["requests"].get("200") and figures["requests"].get("503 with Retry-After")
    assert figures["health_codes"] == {"200": figures["health_probes"]}
    assert figures["health_median_ms"] < 500 and figures["health_p99_ms"] < 5000
    wait_idle(url)


def test_an_idle_keep_alive_connection_outlives_the_clients_pool_expiry(engine_process_server):
    """httpx (and so the openai SDK) reuses a pooled connection idle for up to 5 s. A server that
    closed idle connections at 5 s too would close some just as a client sent on them: a
    connection reset under load (the 20x overload test above saw one in about four runs)."""
    import socket

    _, url = engine_process_server
    host, port = url.removeprefix("http://").split(":")
    request = f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()

    def response(conn) -> bytes:
        """One whole response (head and Content-Length body); b"" when the server closed."""
        data = b""
        while b"\r\n\r\n" not in data and (chunk := conn.recv(65536)):
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = int(re.search(rb"(?i)content-length: (\d+)", head).group(1)) if head else 0
        while len(body) < length:
            body += conn.recv(65536)
        return head

    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(request)
        assert response(conn).startswith(b"HTTP/1.1 200")
        time.sleep(httpx.Limits().keepalive_expiry + 0.5)
        conn.sendall(request)  # a server that had closed it: b"" or a connection reset
        assert response(conn).startswith(b"HTTP/1.1 200")


def test_a_killed_engine_process_fails_requests_and_the_server_exits_non_zero(tiny_glm4):
    from pagedserve.testing import serve

    with serve(*serve_flags(tiny_glm4[0])) as (proc, url):
        body = {"prompt": PROMPT_IDS, "max_tokens": 240, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)
            os.kill(engine_pid(url), signal.SIGKILL)
            killed = time.monotonic()
            while (health := httpx.get(url + "/health", timeout=10)).status_code == 200:
                time.sleep(0.02)
            detected = time.monotonic() - killed
            rest = [line for line in lines if line.startswith("data: ")]
        assert health.status_code == 503 and "exited with code -9" in health.text
        assert detected < 1.0, f"/health took {detected:.2f} s to turn 503"
        assert "error" in json.loads(rest[-2][6:]) and rest[-1] == "data: [DONE]"
        assert proc.wait(30) != 0


# ---- a clean stop at tensor-parallel size 2 -----------------------------------------------------
def _finish_reason(lines) -> str | None:
    """The finish_reason that the rest of a completion stream ends with."""
    reason = None
    for line in lines:
        if line.startswith("data: {"):
            reason = json.loads(line[6:])["choices"][0]["finish_reason"] or reason
    return reason


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT to the group", "SIGKILL"])
def test_serve_at_tp_2_stops_on_a_signal_leaving_no_process_and_no_socket_file(
    tiny_glm4, short_tmp_path, how
):
    """SIGTERM (a supervisor's stop) or Ctrl-C (SIGINT to the whole foreground process group):
    the request in flight finishes, the server exits 0. SIGKILL of the server: its engine core
    and ranks notice and end. Either way no process and no ipc socket file is left."""
    from pagedserve.testing import serve

    sockets = short_tmp_path  # the server's TMPDIR: where it makes its ipc socket directory
    env, tag = tagged_env(TMPDIR=str(sockets))
    flags = serve_flags(tiny_glm4[0], "--tp-size", "2", "--log-level", "warning")
    with serve(*flags, env=env, start_new_session=True) as (proc, url):
        assert len(list(sockets.glob("pagedserve-*"))) == 1
        body = {"prompt": PROMPT_IDS, "max_tokens": 40, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)  # running
            if how == "SIGTERM":
                proc.send_signal(signal.SIGTERM)
            elif how == "SIGINT to the group":
                os.killpg(proc.pid, signal.SIGINT)
            else:
                proc.kill()
            if how == "SIGKILL":
                with pytest.raises(httpx.HTTPError):
                    _finish_reason(lines)
            else:  # drained: the request in flight gets all its tokens
                assert _finish_reason(lines) == "length"
        assert proc.wait(60) == (-signal.SIGKILL if how == "SIGKILL" else 0)
    assert wait_until_gone(tag) == []  # the engine core and its tensor-parallel rank
    assert list(sockets.glob("pagedserve-*")) == []


def _wait_for(found, what: str, timeout: float = 120.0):
    """``found()`` once it is truthy; fails, naming ``what``, after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not (value := found()):
        assert time.monotonic() < deadline, f"no {what} within {timeout:g} s"
        time.sleep(0.02)
    return value


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT to the group"])
def test_serve_at_tp_2_stopped_while_its_engine_starts_ends_leaving_nothing(
    tiny_glm4, short_tmp_path, how
):
    """A supervisor's stop or a Ctrl-C while the engine core and its rank are still starting:
    the server says so and exits 128 + the signal's number, as a shell reports it (0, had it
    just become ready and drained), its engine core and rank end too, and no ipc socket
    directory is left."""
    from pagedserve.testing import free_port

    sockets = short_tmp_path  # the server's TMPDIR: where it makes its ipc socket directory
    env, tag = tagged_env(TMPDIR=str(sockets))
    flags = serve_flags(tiny_glm4[0], "--tp-size", "2", "--port", str(free_port()))
    cmd = [sys.executable, "-m", "pagedserve", "serve", *flags, "--log-level", "warning"]
    server = subprocess.Popen(cmd, env=env, start_new_session=True, stderr=subprocess.PIPE)
    try:
        # made before the engine core starts: the server now waits for it to load
        _wait_for(lambda: list(sockets.glob("pagedserve-*")), "ipc socket directory")
        if how == "SIGTERM":
            server.send_signal(signal.SIGTERM)
        else:
            os.killpg(server.pid, signal.SIGINT)
        _, err = server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)
    signum = signal.SIGTERM if how == "SIGTERM" else signal.SIGINT
    assert server.returncode in (128 + signum, 0), err.decode()[-3000:]
    if server.returncode:
        assert f"stopped by {signum.name} while starting" in err.decode()
    assert wait_until_gone(tag) == []  # the engine core and its tensor-parallel rank
    assert list(sockets.glob("pagedserve-*")) == []


ENGINE_CORE_SCRIPT = """
import sys
from pagedserve.config import EngineConfig
from pagedserve.engine.async_engine import AsyncLLMEngine

if __name__ == "__main__":
    config = EngineConfig.from_kwargs(
        model=sys.argv[1], device="cpu", tensor_parallel_size=2, num_kv_pages=16
    )
    engine = AsyncLLMEngine.from_config(config, log_level="warning")
    print("loaded", engine.health()["tp_worker_pids"], flush=True)
    # the program ends with its engine core (not a daemon at tp > 1) never shut down
"""


@pytest.mark.timeout(300)
def test_an_engine_core_never_shut_down_does_not_block_the_programs_end(
    tiny_glm4, tmp_path, short_tmp_path
):
    script = tmp_path / "core.py"
    script.write_text(ENGINE_CORE_SCRIPT)
    sockets = short_tmp_path  # the server's TMPDIR: where it makes its ipc socket directory
    env, tag = tagged_env(TMPDIR=str(sockets))
    run = subprocess.run(
        [sys.executable, str(script), str(tiny_glm4[0])],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert run.returncode == 0 and "loaded [" in run.stdout, run.stderr
    assert wait_until_gone(tag) == []
    assert list(sockets.glob("pagedserve-*")) == []


def test_admission_counts_a_stream_from_the_moment_it_is_handed_out():
    """A streaming response starts reading its stream only after the headers go out; requests
    admitted meanwhile must count, or 20x overload admits everyone (and they time out)."""
    import gc

    from pagedserve.config import EngineConfig
    from pagedserve.engine.async_engine import AsyncLLMEngine
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig.from_kwargs(model="demo", device="cpu", num_kv_pages=16))
    async_engine = AsyncLLMEngine.from_engine(engine, max_queue_len=2)
    streams = [async_engine.generate(f"r{i}", [1, 2], SamplingParams()) for i in range(2)]
    assert async_engine.num_waiting == 2 and async_engine.queue_full()
    del streams
    gc.collect()
    assert async_engine.num_waiting == 0 and not async_engine.queue_full()  # dropped unread
