"""No request body makes the server answer 5xx or hang (RELIABILITY.md, "Fuzzing from the
schema"), and the API's security promises: the key guards what it should, a request's `model`
never names something to load, the chat template is sandboxed, CORS is off unless asked for.

A demo-model server in this process (benchmarks/reliability/fuzz.py's, which also measures the
README's fuzz figure with more examples)."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

from tests.helpers.tools import require_module

ROOT = Path(__file__).resolve().parents[2]
require_module("schemathesis", "the API fuzzer is a test extra: pip install -e '.[test]'")

from benchmarks.reliability import fuzz  # noqa: E402 - after the check

AUTH = {"Authorization": f"Bearer {fuzz.API_KEY}"}
CHAT = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def fuzz_server():
    with fuzz.demo_server() as (url, app):
        yield url, app


def post(server, path: str, body, **kwargs) -> httpx.Response:
    url, _ = server
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {**AUTH, "Content-Type": "application/json", **kwargs.pop("headers", {})}
    return httpx.post(url + path, content=content, headers=headers, timeout=60, **kwargs)


def assert_client_error(r: httpx.Response, param: str | None = None) -> dict:
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


# ---- fuzzing --------------------------------------------------------------------------------------
def test_fuzzing_every_operation_of_the_openapi_schema_gives_no_5xx_and_no_hang(fuzz_server):
    url, _ = fuzz_server
    figures = fuzz.fuzz(url, examples=6, timeout=60)
    assert figures["operations"] >= 15 and figures["cases"] >= 80
    assert figures["server_error_cases"] == [] and figures["hang_cases"] == []
    assert figures["bad_requests_naming_no_field_cases"] == []
    assert fuzz.completion_works(url)


@pytest.mark.parametrize("top_p", [5e-324, 3.3e-231])
def test_a_top_p_the_fuzzer_found_is_served_nearly_greedy(fuzz_server, top_p):
    """Valid, though 0 in float32: the fuzzer's seed 1 found both answered 500."""
    body = {"prompt": "def f(", "max_tokens": 6, "temperature": 1.0, "ignore_eos": True}
    greedy = post(fuzz_server, "/v1/completions", {**body, "temperature": 0})
    r = post(fuzz_server, "/v1/completions", {**body, "top_p": top_p})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"]
    r = post(fuzz_server, "/v1/chat/completions", {"messages": CHAT, "top_p": top_p})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("role", ["", " \n"])
def test_a_message_whose_role_names_no_one_is_a_400_at_the_schema(fuzz_server, role):
    """The fuzzer's seed 1 sent ``role: ""`` (to the template it is no speaker at all)."""
    messages = [{"role": role, "content": "Hi"}]
    for path in ("/v1/chat/completions", "/tokenize"):
        error = assert_client_error(post(fuzz_server, path, {"messages": messages}))
        assert error["param"] == "messages.0.role"
        assert error["message"].endswith("must name who speaks: system, user, assistant or tool")


# ---- the numbers of a request are checked at the schema --------------------------------------------
OUT_OF_RANGE = [
    ("/v1/completions", {"prompt": "Hi", "seed": 10**30}, "seed"),
    ("/v1/chat/completions", {"messages": CHAT, "seed": -(2**63) - 1}, "seed"),
    ("/v1/completions", {"prompt": "Hi", "top_k": 2**63}, "top_k"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 10**20}, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "n": 10**20}, "n"),
    ("/v1/completions", {"prompt": "Hi", "min_tokens": -1}, "min_tokens"),
    ("/v1/completions", {"prompt": "Hi", "logprobs": 10**20}, "logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, None),
    ("/v1/completions", {"prompt": [1, 2**40]}, "prompt.1"),
    ("/v1/completions", {"prompt": [[1], [-1]]}, "prompt.1.0"),
    ("/v1/completions", {"prompt": "Hi", "stop_token_ids": [2**64]}, "stop_token_ids.0"),
    ("/v1/completions", {"prompt": "Hi", "logit_bias": {"99999999": 1}}, "logit_bias"),
    ("/detokenize", {"tokens": [10**30]}, "tokens.0"),
    ("/generate", {"text": "Hi", "sampling_params": {"seed": 10**30}}, "sampling_params.seed"),
    ("/generate", {"text": "Hi", "sampling_params": {"top_k": 2**63}}, "sampling_params.top_k"),
    ("/generate", {"text": "Hi", "sampling_params": {"logit_bias": {"x": 1}}}, "logit_bias"),
    ("/generate", {"text": "Hi", "sampling_params": {"regex": 5}}, "sampling_params.regex"),
    ("/generate", {"text": ["a", "b"], "return_logprob": [True]}, "return_logprob"),
    ("/generate", {"input_ids": [2**40]}, "input_ids.0"),
]
NOT_FINITE = ["NaN", "Infinity", "-Infinity", "1e999"]


@pytest.mark.parametrize("path, body, param", OUT_OF_RANGE)
def test_an_integer_that_does_not_fit_is_a_400_naming_the_field(fuzz_server, path, body, param):
    assert_client_error(post(fuzz_server, path, body), param)


@pytest.mark.parametrize(
    "field", ["temperature", "top_p", "presence_penalty", "repetition_penalty"]
)
@pytest.mark.parametrize("value", NOT_FINITE)
def test_a_float_that_is_not_finite_is_a_400_naming_the_field(fuzz_server, field, value):
    body = f'{{"prompt": "Hi", "max_tokens": 1, "{field}": {value}}}'.encode()
    assert_client_error(post(fuzz_server, "/v1/completions", body), field)


def test_a_logit_bias_that_is_not_finite_is_a_400(fuzz_server):
    body = b'{"prompt": "Hi", "max_tokens": 1, "logit_bias": {"5": NaN}}'
    assert_client_error(post(fuzz_server, "/v1/completions", body), "logit_bias.5")


def test_the_edges_of_the_ranges_are_served(fuzz_server):
    edges = {"seed": 2**63 - 1, "top_k": 2**31 - 1, "temperature": 1e308, "logprobs": 20}
    r = post(fuzz_server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, **edges})
    assert r.status_code == 200, r.text
    r = post(fuzz_server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "seed": -(2**63)})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", float("nan")),
        ("top_p", float("inf")),
        ("repetition_penalty", float("inf")),
        ("presence_penalty", float("-inf")),
        ("seed", 2**64),
        ("top_k", 2**40),
        ("logit_bias", {5: float("nan")}),
    ],
)
def test_sampling_params_refuse_what_torch_cannot_hold(field, value):
    """The engine's own gate, for LLM() and every other caller that skips the HTTP schema."""
    from pagedserve.sampling_params import SamplingParams

    with pytest.raises(ValueError, match=f"^{field}="):
        SamplingParams(**{field: value})


# ---- bodies no client should send ------------------------------------------------------------------
def test_malformed_utf8_is_a_400_saying_the_body_is_not_json(fuzz_server):
    r = post(fuzz_server, "/v1/completions", b'{"prompt": "\xff\xfe", "max_tokens": 1}')
    error = assert_client_error(r)
    assert error["message"] == "the request body is not valid JSON: send a JSON object in UTF-8"


def test_deeply_nested_json_is_a_400(fuzz_server):
    deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert_client_error(post(fuzz_server, "/v1/completions", deep))
    schema: dict = {"type": "string"}
    for _ in range(500):
        schema = {"type": "array", "items": schema}
    r = post(
        fuzz_server, "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "guided_json": schema}
    )
    assert r.status_code < 500, r.text[:300]


def test_a_deeply_nested_session_state_is_a_400(fuzz_server):
    url, _ = fuzz_server
    deep = b"[" * 100_000 + b"]" * 100_000
    r = httpx.put(url + "/sessions/deep/state", content=deep, headers=AUTH, timeout=60)
    assert_client_error(r, "state")


def test_a_1mb_prompt_is_a_400_saying_it_is_too_long(fuzz_server):
    error = assert_client_error(post(fuzz_server, "/v1/completions", {"prompt": "a " * 500_000}))
    assert error["code"] == "context_length_exceeded"


TOO_LONG = "a " * 5_000  # more tokens than the demo server's max_model_len


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": TOO_LONG}, "prompt"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": TOO_LONG}]}, "messages"),
        ("/generate", {"text": TOO_LONG}, "text"),
        ("/generate", {"input_ids": [5] * 10_000}, "input_ids"),
    ],
)
def test_a_prompt_too_long_names_the_field_it_came_in(fuzz_server, path, body, param):
    error = assert_client_error(post(fuzz_server, path, {**body, "max_tokens": 4}), param)
    assert error["code"] == "context_length_exceeded" and "max_model_len" in error["message"]


def test_10000_stop_strings_are_a_400(fuzz_server):
    body = {"prompt": "Hi", "stop": [f"s{i}" for i in range(10_000)]}
    error = assert_client_error(post(fuzz_server, "/v1/completions", body), "stop")
    assert "at most 64" in error["message"] and len(error["message"]) < 300


def _raw_request(server, head: bytes, chunks: list[bytes] = ()) -> bytes:
    """Send a request by hand (a size the headers lie about, a chunked body) and read the answer
    while the body is still being sent, as the server answers without reading the rest."""
    url = urlparse(server[0])
    with socket.create_connection((url.hostname, url.port), timeout=30) as s:
        s.sendall(head)

        def send_body() -> None:
            try:
                for piece in chunks:
                    s.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            except OSError:  # the server answered and closed while the client was still sending
                pass

        sender = threading.Thread(target=send_body, daemon=True)
        sender.start()
        answer = b""
        try:
            while chunk := s.recv(65536):  # the server closes the connection after a 413
                answer += chunk
        except ConnectionResetError:  # ... resetting it if body bytes were left unread
            pass
        sender.join(30)
        return answer


def test_a_body_over_the_limit_is_a_413_before_it_is_read(fuzz_server):
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer %s\r\nContent-Length: %d\r\n\r\n" % (fuzz.API_KEY.encode(), 10**11)
    )
    answer = _raw_request(fuzz_server, head)  # no byte of the body is sent: reading it would hang
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"--max-request-body" in answer


def test_a_chunked_body_over_the_limit_is_a_413(fuzz_server):
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Authorization: Bearer %s\r\nTransfer-Encoding: chunked\r\n\r\n" % fuzz.API_KEY.encode()
    )
    answer = _raw_request(fuzz_server, head, [b'{"prompt": "' + b"a" * 2**20] * 9)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]


# ---- security -------------------------------------------------------------------------------------
@pytest.mark.parametrize("model", ["/etc/passwd", "../demo", "demo/../../etc", "/tmp"])
def test_a_model_that_names_a_path_is_404_and_nothing_is_loaded(fuzz_server, model):
    _, app = fuzz_server
    for path, body in (
        ("/v1/completions", {"model": model, "prompt": "Hi"}),
        ("/v1/chat/completions", {"model": model, "messages": CHAT}),
        ("/tokenize", {"model": model, "prompt": "Hi"}),
    ):
        r = post(fuzz_server, path, body)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
    assert app.state.serving.model_name == "demo"


def test_a_chat_template_reaching_python_internals_is_refused(fuzz_server, monkeypatch):
    _, app = fuzz_server
    evil = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    monkeypatch.setattr(app.state.serving.tokenizer, "chat_template", evil)
    error = assert_client_error(post(fuzz_server, "/v1/chat/completions", {"messages": CHAT}))
    assert "chat template" in error["message"] and "subclasses" not in error["message"][:60]
    assert "<class" not in error["message"]


def test_the_api_key_is_required_and_a_near_miss_is_refused(fuzz_server):
    url, _ = fuzz_server
    near = fuzz.API_KEY[:-1] + "X"
    for headers in ({}, {"Authorization": f"Bearer {near}"}, {"Authorization": fuzz.API_KEY}):
        r = httpx.get(url + "/v1/models", headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url + "/v1/models", headers=AUTH, timeout=30).status_code == 200


def test_the_api_key_is_compared_in_constant_time(fuzz_server, monkeypatch):
    import hmac

    compared = []
    real = hmac.compare_digest

    def recording(a, b):
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", recording)
    httpx.get(fuzz_server[0] + "/v1/models", headers={"Authorization": "Bearer guess"}, timeout=30)
    assert compared == [(b"Bearer guess", f"Bearer {fuzz.API_KEY}".encode())]


def test_no_cors_headers_unless_origins_are_allowed(fuzz_server):
    url, _ = fuzz_server
    origin = {"Origin": "http://evil.example"}
    r = httpx.get(url + "/health", headers=origin, timeout=30)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    preflight = {**origin, "Access-Control-Request-Method": "POST"}
    r = httpx.options(url + "/v1/completions", headers=preflight, timeout=30)
    assert "access-control-allow-origin" not in r.headers


def test_serve_allows_the_origins_it_is_given_limits_bodies_and_never_logs_the_key(tmp_path):
    from pagedserve.testing import serve

    key, wrong = "sk-never-logged-4f1d", "sk-wrong-guess-77ab"
    flags = ["--model", "demo", "--max-model-len", "64", "--num-kv-pages", "16"]
    flags += ["--api-key", key, "--allowed-origins", "http://ok.example"]
    flags += ["--max-request-body", "4096", "--log-level", "debug"]
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log, serve(*flags, log=log) as (_, url):
        ok = httpx.get(url + "/health", headers={"Origin": "http://ok.example"}, timeout=30)
        assert ok.headers["access-control-allow-origin"] == "http://ok.example"
        other = httpx.get(url + "/health", headers={"Origin": "http://evil.example"}, timeout=30)
        assert "access-control-allow-origin" not in other.headers
        bearer = {"Authorization": f"Bearer {key}"}
        big = {"prompt": "a" * 5000, "max_tokens": 1}
        assert httpx.post(url + "/v1/completions", json=big, headers=bearer).status_code == 413
        r = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {wrong}"})
        assert r.status_code == 401
        small = {"prompt": "Hello", "max_tokens": 2}
        r = httpx.post(url + "/v1/completions", json=small, headers=bearer, timeout=60)
        assert r.status_code == 200, r.text
    text = log_path.read_text()
    assert "GET /v1/models" in text  # the log did record the requests
    assert key not in text and wrong not in text
