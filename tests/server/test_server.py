"""The HTTP server against the official openai client, on a live uvicorn server (conftest)."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from pagedserve.entrypoints.cli.main import build_parser
from pagedserve.entrypoints.cli.serve import apply_config_file
from tests.helpers.metrics import read_metrics, wait_idle
from tests.helpers.models import tiny_engine

README = Path(__file__).resolve().parents[2] / "README.md"
PROMPT = "The quick brown fox"
CHAT = [{"role": "user", "content": "Hello world!"}]


@pytest.fixture(scope="module")
def openai_client(live_server):
    return openai.OpenAI(
        base_url=live_server.url + "/v1", api_key=live_server.api_key, max_retries=0, timeout=60
    )


def _auth(live_server) -> dict:
    return {"Authorization": f"Bearer {live_server.api_key}"}


def _metrics(live_server) -> dict[str, float]:
    return read_metrics(live_server.url)


def _hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def _tokenize(live_server, text: str) -> list[int]:
    r = httpx.post(live_server.url + "/tokenize", json={"prompt": text}, headers=_auth(live_server))
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


# ---- generation ---------------------------------------------------------------------------------
def test_models_lists_the_served_name(openai_client, live_server):
    models = openai_client.models.list()
    assert [m.id for m in models.data] == [live_server.model]


def test_greedy_completion_matches_hf_tokens_and_logprobs(openai_client, live_server, tiny_glm4):
    _, hf = tiny_glm4
    ids = _tokenize(live_server, PROMPT)
    out = openai_client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    choice = out.choices[0]
    assert choice.finish_reason == "length"
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == 6
    seq = list(ids)
    for pos in range(6):
        ref = _hf_logprobs(hf, seq)[-1]
        token = int(ref.argmax())
        tok_str = httpx.post(
            live_server.url + "/detokenize", json={"tokens": [token]}, headers=_auth(live_server)
        ).json()["prompt"]
        assert choice.logprobs.tokens[pos] == tok_str
        assert choice.logprobs.token_logprobs[pos] == pytest.approx(float(ref[token]), abs=1e-3)
        assert len(choice.logprobs.top_logprobs[pos]) <= 2
        assert max(choice.logprobs.top_logprobs[pos].values()) == pytest.approx(
            float(ref.max()), abs=1e-3
        )
        seq.append(token)
    assert choice.logprobs.text_offset == sorted(choice.logprobs.text_offset)


def test_echo_with_logprobs_returns_prompt_logprobs(openai_client, live_server, tiny_glm4):
    _, hf = tiny_glm4
    ids = _tokenize(live_server, PROMPT)
    out = openai_client.completions.create(
        model="tiny", prompt=ids, max_tokens=1, temperature=0, logprobs=1, echo=True
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = _hf_logprobs(hf, ids)
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(float(ref[i - 1, ids[i]]), abs=1e-3)
    text = out.choices[0].text
    assert PROMPT in text and text.startswith("".join(lp.tokens[: len(ids)]))


def test_chat_completion_uses_the_chat_template(openai_client, live_server, tiny_glm4):
    _, hf = tiny_glm4
    r = httpx.post(
        live_server.url + "/tokenize", json={"messages": CHAT}, headers=_auth(live_server)
    )
    ids = r.json()["tokens"]
    out = openai_client.chat.completions.create(
        model="tiny",
        messages=CHAT,
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert out.object == "chat.completion"
    assert out.usage.prompt_tokens == len(ids)
    assert out.choices[0].message.role == "assistant"
    content = out.choices[0].logprobs.content
    assert len(content) == 4
    first = _hf_logprobs(hf, ids)[-1]
    assert content[0].logprob == pytest.approx(float(first.max()), abs=1e-3)
    assert len(content[0].top_logprobs) == 2
    assert content[0].bytes == list(content[0].token.encode())


def test_streaming_with_usage_matches_the_non_streamed_text(openai_client):
    kwargs = dict(
        model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    whole = openai_client.completions.create(**kwargs).choices[0].text
    chunks = list(
        openai_client.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_streaming_sends_role_then_deltas_then_usage(openai_client):
    chunks = list(
        openai_client.chat.completions.create(
            model="tiny",
            messages=CHAT,
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    whole = openai_client.chat.completions.create(
        model="tiny", messages=CHAT, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 5


def test_n_2_returns_two_choices(openai_client):
    out = openai_client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=6, n=2, seed=3, extra_body={"ignore_eos": True}
    )
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.usage.completion_tokens == 12


def test_seed_makes_sampling_reproducible(openai_client):
    def sample(seed: int) -> str:
        return (
            openai_client.completions.create(
                model="tiny",
                prompt=PROMPT,
                max_tokens=12,
                seed=seed,
                temperature=1.0,
                extra_body={"ignore_eos": True},
            )
            .choices[0]
            .text
        )

    assert sample(7) == sample(7)
    assert len({sample(s) for s in (1, 2, 3)}) > 1


def test_stop_string_ends_the_text_before_it(openai_client):
    full = (
        openai_client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=10,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
    )
    stop = full[3:5]
    assert stop
    out = openai_client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=10,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    ).choices[0]
    assert out.finish_reason == "stop"
    assert out.text == full[: full.index(stop)]  # everything before the stop string, not it


# ---- errors -------------------------------------------------------------------------------------
def _assert_error(response: httpx.Response, status: int, *needles: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    for needle in needles:
        assert needle in error["message"], error["message"]
    return error


def test_malformed_json_is_400(live_server):
    r = httpx.post(
        live_server.url + "/v1/completions",
        content=b'{"model": "tiny", "prompt": ',
        headers={**_auth(live_server), "Content-Type": "application/json"},
    )
    _assert_error(r, 400, "JSON")


def test_wrong_type_is_400_not_422(openai_client):
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.completions.create(
            model="tiny", prompt=PROMPT, extra_body={"temperature": "hot"}
        )
    assert e.value.status_code == 400 and "temperature" in str(e.value)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 17}, "max-num-seqs"),
        ({"logprobs": 21}, "logprobs"),
        ({"extra_body": {"top_p": 0}}, "top_p"),
        ({"logit_bias": {"99999": 1.0}}, "logit_bias"),
    ],
)
def test_invalid_sampling_fields_are_400(openai_client, kwargs, needle):
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.completions.create(model="tiny", prompt=PROMPT, **kwargs)
    assert needle in e.value.message


def test_prompt_too_long_is_400_with_both_numbers(openai_client, live_server):
    ids = [5] * 200
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.completions.create(model="tiny", prompt=ids, max_tokens=100)
    assert "300" in e.value.message and "256" in e.value.message


def _bad_request(openai_client, **fields) -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        openai_client.completions.create(model="tiny", **{"max_tokens": 4, **fields})
    return e.value.body


def test_a_token_id_outside_the_vocabulary_is_400_naming_its_field(openai_client):
    error = _bad_request(openai_client, prompt=[10**6])
    assert "prompt token id 1000000 is outside the vocabulary [0, 320)" in error["message"]
    assert error["param"] == "prompt" and error["code"] is None  # invalid, not too long
    error = _bad_request(openai_client, prompt=PROMPT, extra_body={"stop_token_ids": [10**6]})
    assert error["param"] == "stop_token_ids" and error["code"] is None


def test_a_prompt_too_long_for_the_model_is_context_length_exceeded(openai_client):
    error = _bad_request(openai_client, prompt=[5] * 200, max_tokens=100)
    assert error["param"] == "prompt" and error["code"] == "context_length_exceeded"


@pytest.mark.parametrize("prompt", ["", [], [PROMPT, ""], [[]]])
def test_an_empty_prompt_is_400_as_vllm_answers_it(openai_client, prompt):
    error = _bad_request(openai_client, prompt=prompt)
    assert error["param"] == "prompt" and "empty" in error["message"]


def test_missing_or_wrong_api_key_is_401(live_server):
    bad = openai.OpenAI(base_url=live_server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = httpx.get(live_server.url + "/v1/models")
    _assert_error(r, 401, "API key")
    assert httpx.get(live_server.url + "/health").status_code == 200


def test_unknown_model_is_404(openai_client):
    with pytest.raises(openai.NotFoundError) as e:
        openai_client.completions.create(model="nope", prompt=PROMPT)
    assert "nope" in e.value.message


def test_full_queue_is_503_with_retry_after(openai_client, live_server):
    engine = live_server.serving.engine
    engine.pause()
    engine.max_queue_len = 2
    results = []

    def post():
        results.append(
            httpx.post(
                live_server.url + "/v1/completions",
                headers=_auth(live_server),
                json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2},
                timeout=30,
            ).status_code
        )

    threads = [threading.Thread(target=post) for _ in range(2)]
    try:
        for t in threads:
            t.start()
        while engine.num_waiting < 2:  # pytest-timeout bounds a hang
            time.sleep(0.01)
        r = httpx.post(
            live_server.url + "/v1/completions",
            headers=_auth(live_server),
            json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2},
        )
        _assert_error(r, 503, "--max-queue-len 2")
        assert r.headers["retry-after"]
    finally:
        engine.max_queue_len = 64
        engine.resume()
        for t in threads:
            t.join(30)
    assert results == [200, 200]


# ---- load, disconnects, metrics -----------------------------------------------------------------
def test_32_concurrent_streams_complete_and_free_every_page(live_server):
    async def one(client: openai.AsyncOpenAI, i: int) -> int:
        stream = await client.completions.create(
            model="tiny",
            prompt=f"{PROMPT} {i}",
            max_tokens=8,
            stream=True,
            temperature=0.8,
            seed=i,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
        return usage.completion_tokens

    async def run() -> list[int]:
        client = openai.AsyncOpenAI(
            base_url=live_server.url + "/v1", api_key=live_server.api_key, max_retries=0, timeout=60
        )
        return await asyncio.gather(*(one(client, i) for i in range(32)))

    before = _metrics(live_server)
    assert asyncio.run(run()) == [8] * 32
    after = wait_idle(live_server.url)
    assert after["pagedserve:kv_cache_usage_perc"] == 0
    assert after["pagedserve:num_requests_running"] == 0
    assert (
        after["pagedserve:generation_tokens_total"] - before["pagedserve:generation_tokens_total"]
    ) == 32 * 8
    success = 'pagedserve:request_success_total{finished_reason="length"}'
    assert after[success] - before.get(success, 0) == 32
    assert after["pagedserve:time_to_first_token_seconds_count"] >= 32


def test_disconnected_stream_is_aborted_and_its_pages_freed(live_server, slow_steps):
    aborted = 'pagedserve:request_success_total{finished_reason="abort"}'
    before = _metrics(live_server).get(aborted, 0)
    body = {
        "model": "tiny",
        "prompt": PROMPT,
        "max_tokens": 240,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.Client(timeout=30) as http:
        with http.stream(
            "POST", live_server.url + "/v1/completions", json=body, headers=_auth(live_server)
        ) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for _ in range(3):
                next(lines)
            usage = _metrics(live_server)["pagedserve:kv_cache_usage_perc"]
            assert usage > 0
    after = wait_idle(live_server.url)
    assert after["pagedserve:kv_cache_usage_perc"] == 0
    assert after["pagedserve:num_requests_running"] == 0
    assert after[aborted] == before + 1


def test_metrics_exposes_vllm_names(live_server):
    text = httpx.get(live_server.url + "/metrics").text
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "num_preemptions_total",
        "num_swapped_preemptions_total",
        "num_requests_swapped",
        "num_swapped_pages",
        "host_kv_cache_usage_perc",
        "swapped_out_pages_total",
        "swapped_in_pages_total",
        "host_prefix_cache_queries_total",
        "host_prefix_cache_hits_total",
        "recomputed_tokens_total",
        "prompt_tokens_total",
        "generation_tokens_total",
        "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_bucket",
        "e2e_request_latency_seconds_bucket",
        "request_queue_time_seconds_bucket",
    ):
        assert f"pagedserve:{name}" in text, name


def test_health_version_docs_and_device(live_server):
    assert httpx.get(live_server.url + "/health").status_code == 200
    assert httpx.get(live_server.url + "/version").json()["version"]
    docs = httpx.get(live_server.url + "/docs")
    assert docs.status_code == 200
    # FastAPI's page fetches Swagger UI from a CDN: the README says so, where the console needs none
    assert "https://cdn.jsdelivr.net/" in docs.text
    assert "load their scripts and styles from a CDN, jsdelivr" in README.read_text()
    device = httpx.get(live_server.url + "/device", headers=_auth(live_server)).json()
    assert device["kv_pages"]["total"] == 256 and "tokens_per_second" in device


# ---- the command line ---------------------------------------------------------------------------
def test_serve_parser_takes_vllm_flags_and_aliases():
    args = build_parser().parse_args(
        [
            "serve",
            "--model",
            "m",
            "--mem-fraction-static",
            "0.5",
            "--tp-size",
            "1",
            "--no-enable-prefix-caching",
            "--max-queue-len",
            "3",
            "--enforce-eager",
        ]
    )
    assert args.gpu_memory_utilization == 0.5 and args.tensor_parallel_size == 1
    assert args.enable_prefix_caching is False and args.max_queue_len == 3


def test_config_file_fills_flags_and_the_command_line_wins(tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("port: 9001\nmax_num_seqs: 4\nblock-size: 32\n")
    args = apply_config_file(build_parser(), ["serve", "--config", str(cfg), "--port", "9002"])
    assert (args.port, args.max_num_seqs, args.block_size) == (9002, 4, 32)
    cfg.write_text("bogus-flag: 1\n")
    with pytest.raises(SystemExit):
        apply_config_file(build_parser(), ["serve", "--config", str(cfg)])


def _tiny_serve_flags(tiny_glm4) -> list[str]:
    return [
        *("--model", str(tiny_glm4[0]), "--served-model-name", "tiny", "--dtype", "float32"),
        *("--device", "cpu", "--num-kv-pages", "64", "--max-model-len", "256"),
        *("--log-level", "info"),
    ]


def test_serve_command_drains_in_flight_requests_on_sigterm(tiny_glm4, tmp_path):
    import json
    import signal

    from pagedserve.testing import serve

    flags = _tiny_serve_flags(tiny_glm4)
    log = (tmp_path / "serve.log").open("w+")
    with serve(*flags, log=log) as (proc, url):
        body = {
            "model": "tiny",
            "prompt": PROMPT,
            "max_tokens": 240,
            "stream": True,
            "ignore_eos": True,
        }
        with (
            httpx.Client(timeout=60) as http,
            http.stream("POST", url + "/v1/completions", json=body) as r,
        ):
            lines = r.iter_lines()
            next(lines)
            proc.send_signal(signal.SIGTERM)
            refused = httpx.post(url + "/v1/completions", json={"prompt": PROMPT}, timeout=60)
            rest = [ln for ln in lines if ln.startswith("data: {")]
        _assert_error(refused, 503, "shutting down")
        assert json.loads(rest[-1][6:])["choices"][0]["finish_reason"] == "length"
        assert proc.wait(30) == 0
    log.seek(0)
    assert "KV cache 64 pages" in log.read()


def test_a_drain_past_the_shutdown_timeout_fails_the_rest_with_503_and_exits(tiny_glm4):
    """--shutdown-timeout 0, vLLM's default: SIGTERM fails what is in flight at once."""
    import json
    import signal

    from pagedserve.testing import serve

    flags = [*_tiny_serve_flags(tiny_glm4), "--shutdown-timeout", "0"]
    with serve(*flags) as (proc, url):
        body = {"prompt": PROMPT, "max_tokens": 240, "stream": True, "ignore_eos": True}
        with (
            httpx.Client(timeout=60) as http,
            http.stream("POST", url + "/v1/completions", json=body) as r,
        ):
            lines = r.iter_lines()
            next(lines)
            started = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            events = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
        assert proc.wait(30) == 0
    error = events[-1]["error"]
    assert error["code"] == "engine_dead" and "--shutdown-timeout 0 s" in error["message"]
    assert not any(c["finish_reason"] for e in events[:-1] for c in e["choices"])
    assert time.monotonic() - started < 10


def test_a_failing_step_fails_its_request_and_the_loop_lives_on(openai_client, live_server):
    engine = live_server.serving.llm_engine

    def broken_step():
        del engine.execute_step  # fail once, then the real method again
        raise RuntimeError("injected step failure")

    engine.execute_step = broken_step
    with pytest.raises(openai.InternalServerError) as e:
        openai_client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2)
    assert "injected" in e.value.message
    assert httpx.get(live_server.url + "/health").status_code == 200
    assert openai_client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2).choices
    wait_idle(live_server.url)


def test_health_is_503_when_the_engine_loop_dies(tiny_glm4):
    from fastapi.testclient import TestClient

    from pagedserve.server.app import build_app

    engine = tiny_engine(tiny_glm4[0], num_kv_pages=32, max_model_len=128)
    app = build_app(engine, "tiny")
    with TestClient(app) as http:
        assert http.get("/health").status_code == 200
        engine.has_unfinished_requests = lambda: 1 / 0
        app.state.serving.engine.abort("wake-up")
        while http.get("/health").status_code == 200:  # pytest-timeout bounds a hang
            time.sleep(0.02)
        assert http.get("/health").status_code == 503
        r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
        _assert_error(r, 503, "engine loop")
