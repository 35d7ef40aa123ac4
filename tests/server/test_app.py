"""The app ``build_app`` makes, in this process on the demo model (FastAPI's TestClient, no
socket): what each of its settings does, the key and the routes open without it, the OpenAPI
schema's stated limits, and the small endpoint families (``/v1/models``, ``/health``,
``/version``, ``/metrics``, ``/tokenize``, ``/detokenize``, ``/device``, the web console). Each test
builds its own app over one engine, fast enough for mutation testing (tools/mutation.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

import pagedserve
from pagedserve.server.app import build_app
from pagedserve.server.reasoning_parsers import Glm4ReasoningParser
from pagedserve.server.tool_parsers import Glm4ToolParser, Glm45ToolParser
from tests.helpers.apps import AUTH, KEY, LIMITS, demo_engine, served

CHAT = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def engine():
    return demo_engine()


@pytest.fixture
def client(engine) -> Iterator[TestClient]:
    with served(engine) as c:
        yield c


def error_of(r, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


# ---- build_app's settings ---------------------------------------------------------------------
def test_the_api_describes_itself_as_pagedserve(engine, monkeypatch):
    # a version of its own: FastAPI's default, 0.1.0, is also this package's today
    monkeypatch.setattr(pagedserve, "__version__", "9.8.7")
    with served(engine) as client:
        info = client.get("/openapi.json").json()["info"]
    assert info == {
        "title": "pagedserve",
        "version": "9.8.7",
        "description": "OpenAI-compatible API of the pagedserve paged inference engine",
    }


def test_auto_tool_choice_without_a_parser_is_refused(engine):
    with pytest.raises(ValueError) as e:
        build_app(engine, enable_auto_tool_choice=True)
    assert str(e.value) == "--enable-auto-tool-choice needs --tool-call-parser NAME (e.g. glm4)"


def test_the_parsers_are_the_ones_named_and_glm4s_calls_by_default(engine):
    serving = build_app(engine).state.serving
    assert (serving.tool_parser, serving.reasoning_parser) == (Glm4ToolParser, None)
    assert serving.enable_auto_tool_choice is False
    serving = build_app(
        engine, tool_call_parser="glm45", enable_auto_tool_choice=True, reasoning_parser="glm4"
    ).state.serving
    assert (serving.tool_parser, serving.reasoning_parser) == (Glm45ToolParser, Glm4ReasoningParser)
    assert serving.enable_auto_tool_choice is True


def test_a_parser_without_auto_tool_choice_reads_forced_calls_only(engine):
    serving = build_app(engine, tool_call_parser="glm4").state.serving
    assert serving.tool_parser is Glm4ToolParser and serving.enable_auto_tool_choice is False


@pytest.mark.parametrize("flag", ["tool_call_parser", "reasoning_parser"])
def test_an_unknown_parser_is_refused_naming_the_flag(engine, flag):
    with pytest.raises(ValueError, match=f"^--{flag.replace('_', '-')} nope: no such parser"):
        build_app(engine, **{flag: "nope"})


def test_the_served_name_defaults_to_the_engines_model(engine):
    assert build_app(engine).state.serving.model_name == engine.config.model.model
    assert build_app(engine, "mine").state.serving.model_name == "mine"


def test_the_limits_given_reach_the_serving_layer(engine):
    serving = build_app(engine, max_queue_len=3, max_logprobs=5).state.serving
    assert (serving.max_logprobs, serving.engine.max_queue_len) == (5, 3)


def test_a_chat_template_given_replaces_the_models(engine, monkeypatch):
    # the app sets the template on the engine's tokenizer, which this file's other apps share:
    # monkeypatch puts the model's own back afterwards
    tokenizer = engine.tokenizer
    monkeypatch.setattr(tokenizer, "chat_template", tokenizer.chat_template)
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    with served(engine, chat_template=template) as c:
        r = c.post("/tokenize", json={"messages": CHAT}, headers=AUTH)
        assert r.json()["prompt"] == "[Hi]"


def test_the_lifespan_starts_and_stops_the_engine_loop(engine):
    app = build_app(engine, "demo")
    serving = app.state.serving
    assert not serving.engine.is_alive
    with TestClient(app) as c:
        assert serving.engine.is_alive
        assert c.get("/health").status_code == 200
    assert not serving.engine.is_alive


def test_a_request_body_over_the_limit_given_is_a_413(engine):
    with served(engine, max_request_body=100) as c:
        r = c.post("/v1/completions", json={"prompt": "a" * 200}, headers=AUTH)
        assert error_of(r, 413)["code"] == "request_too_large"
        r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, headers=AUTH)
        assert r.status_code == 200


def test_the_default_body_limit_is_8_mib(engine, client):
    r = client.post("/v1/completions", json={"prompt": "a" * 2**20}, headers=AUTH)
    assert r.status_code == 400  # a prompt too long, read whole: not a 413
    body = b'{"prompt": "' + b"a" * (8 * 2**20) + b'"}'
    r = client.post("/v1/completions", content=body, headers=AUTH)
    assert error_of(r, 413)["code"] == "request_too_large"


def test_cors_answers_only_the_origins_allowed(engine, client):
    preflight = {"Origin": "http://ok.example", "Access-Control-Request-Method": "POST"}
    preflight["Access-Control-Request-Headers"] = "authorization, x-custom"
    r = client.options("/v1/completions", headers=preflight)
    assert "access-control-allow-origin" not in r.headers
    with served(engine, allowed_origins=["http://ok.example"]) as c:
        r = c.options("/v1/completions", headers=preflight)
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "http://ok.example"
        assert "POST" in r.headers["access-control-allow-methods"]
        assert "x-custom" in r.headers["access-control-allow-headers"].lower()
        r = c.get("/v1/models", headers={**AUTH, "Origin": "http://ok.example"})
        assert r.headers["access-control-allow-origin"] == "http://ok.example"
        r = c.get("/v1/models", headers={**AUTH, "Origin": "http://evil.example"})
        assert "access-control-allow-origin" not in r.headers


def test_every_endpoint_family_is_routed(client):
    paths = set(client.get("/openapi.json").json()["paths"])
    assert {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/device",
        "/device/faults",
        "/generate",
        "/sessions/{session_id}/state",
    } <= paths
    r = client.put("/sessions/s/state", json={"a": 1}, headers=AUTH)
    assert r.status_code == 200
    for path, body in (
        ("/v1/completions", {"prompt": "Hi"}),
        ("/v1/chat/completions", {"messages": CHAT}),
    ):
        r = client.post(path, json={**body, "max_tokens": 1}, headers=AUTH)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 1
    r = client.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 401
    r = client.post(
        "/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 1}}, headers=AUTH
    )
    assert r.status_code == 200, r.text


# each route of the families above by its method: the request and response models its schema names
ROUTES = {
    ("/v1/completions", "post"): ("CompletionRequest", "CompletionResponse"),
    ("/v1/chat/completions", "post"): ("ChatCompletionRequest", "ChatCompletionResponse"),
    ("/tokenize", "post"): ("TokenizeRequest", "TokenizeResponse"),
    ("/detokenize", "post"): ("DetokenizeRequest", "DetokenizeResponse"),
    ("/v1/models", "get"): (None, "ModelList"),
    ("/version", "get"): (None, "VersionResponse"),
    ("/health", "get"): (None, None),
    ("/metrics", "get"): (None, None),
    ("/device", "get"): (None, None),
    ("/device/pages", "get"): (None, None),
    ("/device/invariants", "get"): (None, None),
    ("/device/scrub", "post"): (None, None),
    ("/device/faults", "post"): ("FaultRequest", None),
}


def _ref(schema: dict | None) -> str | None:
    ref = (schema or {}).get("$ref")
    return ref.removeprefix("#/components/schemas/") if ref else None


def test_each_route_takes_its_method_and_its_schema_names_its_models(client):
    paths = client.get("/openapi.json").json()["paths"]
    for path in {path for path, _ in ROUTES}:
        assert set(paths[path]) == {m for p, m in ROUTES if p == path}, path
    for (path, method), models in ROUTES.items():
        operation = paths[path][method]
        body = operation.get("requestBody", {}).get("content", {}).get("application/json")
        answer = operation["responses"]["200"].get("content", {}).get("application/json")
        assert (_ref((body or {}).get("schema")), _ref((answer or {}).get("schema"))) == models


def test_a_bad_body_is_a_400_in_openais_shape(client):
    r = client.post("/v1/completions", json={"prompt": "Hi", "n": 0}, headers=AUTH)
    assert error_of(r, 400) == {
        "message": "n=0 must be >= 1",
        "type": "invalid_request_error",
        "param": "n",
        "code": None,
    }


# ---- the key ----------------------------------------------------------------------------------
def test_without_the_key_a_route_is_401(client):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = client.get("/v1/models", headers=headers)
        assert error_of(r, 401) == {
            "message": "missing or wrong API key: send 'Authorization: Bearer <key>' with the "
            "server's --api-key",
            "type": "authentication_error",
            "param": None,
            "code": "invalid_api_key",
        }
    assert client.get("/v1/models", headers=AUTH).status_code == 200


@pytest.mark.parametrize(
    "path", ["/health", "/metrics", "/version", "/docs", "/openapi.json", "/redoc", "/"]
)
def test_probes_docs_and_the_console_need_no_key(client, path):
    assert client.get(path).status_code == 200


@pytest.mark.parametrize("path", ["/console/console.js", "/console/console.css"])
def test_the_consoles_files_need_no_key(client, path):
    assert client.get(path).status_code == 200


@pytest.mark.parametrize("path", ["/device", "/device/pages", "/tokenize", "/sessions/s/state"])
def test_the_data_routes_need_the_key(client, path):
    assert client.get(path).status_code == 401


def test_no_key_set_opens_every_route(engine):
    with served(engine, api_key=None) as c:
        assert c.get("/v1/models").status_code == 200
    with served(engine, api_key="") as c:
        assert c.get("/v1/models").status_code == 200


# ---- the OpenAPI schema states this server's limits --------------------------------------------
def _maximum(schema: dict, model: str, field: str):
    prop = schema["components"]["schemas"][model]["properties"][field]
    return [a.get("maximum") for a in prop.get("anyOf", [prop]) if a.get("type") == "integer"]


def test_the_schema_states_the_servers_limits_as_maxima(engine):
    app = build_app(engine, max_logprobs=7)
    schema = TestClient(app).get("/openapi.json").json()
    most_tokens = LIMITS["max_model_len"] - 1
    assert _maximum(schema, "CompletionRequest", "n") == [LIMITS["max_num_seqs"]]
    assert _maximum(schema, "CompletionRequest", "logprobs") == [7]
    assert _maximum(schema, "ChatCompletionRequest", "top_logprobs") == [7]
    assert _maximum(schema, "CompletionRequest", "max_tokens") == [most_tokens]
    assert _maximum(schema, "ChatCompletionRequest", "max_completion_tokens") == [most_tokens]
    assert _maximum(schema, "CompletionRequest", "min_tokens") == [most_tokens]
    sglang = schema["components"]["schemas"]
    sampling = next(m for m in sglang.values() if "max_new_tokens" in m.get("properties", {}))
    for field in ("max_new_tokens", "min_new_tokens"):
        prop = sampling["properties"][field]
        maxima = [a.get("maximum") for a in prop.get("anyOf", [prop]) if a.get("type") == "integer"]
        assert maxima == [most_tokens], field
    generate = next(m for m in sglang.values() if "top_logprobs_num" in m.get("properties", {}))
    prop = generate["properties"]["top_logprobs_num"]
    assert [a.get("maximum") for a in prop.get("anyOf", [prop]) if a.get("type") == "integer"] == [
        7
    ]


def test_the_schema_leaves_other_fields_and_non_integers_alone(engine):
    schema = TestClient(build_app(engine)).get("/openapi.json").json()
    (seed,) = _maximum(schema, "CompletionRequest", "seed")
    assert seed > 2**62  # its own range (int64), not one of this server's limits
    echo = schema["components"]["schemas"]["CompletionRequest"]["properties"]["echo"]
    assert "maximum" not in echo
    logprobs = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]["logprobs"]
    assert "maximum" not in logprobs  # chat's logprobs is a boolean


def test_the_schema_is_built_once(engine):
    app = build_app(engine)
    assert app.openapi() is app.openapi()


# ---- /v1/models, /health, /version, /metrics ------------------------------------------------------
def test_models_lists_the_served_name_its_root_and_context(engine):
    with served(engine, served_model_name="tiny-demo") as c:
        data = c.get("/v1/models", headers=AUTH).json()
    assert data["object"] == "list"
    (card,) = data["data"]
    assert (card["id"], card["object"], card["owned_by"]) == ("tiny-demo", "model", "pagedserve")
    assert card["root"] == engine.config.model.model and card["max_model_len"] == 64


def test_health_is_200_with_the_engines_figures_while_it_runs(client):
    r = client.get("/health")
    assert r.status_code == 200
    assert r.json()["engine"] == "alive" and "num_steps" in r.json()


def test_health_is_503_once_the_engine_is_dead(engine):
    with served(engine, started=False) as c:
        r = c.get("/health")
    assert error_of(r, 503) == {
        "message": "the engine loop is not running: it is not running",
        "type": "server_error",
        "param": None,
        "code": "engine_dead",
    }


def test_health_names_how_the_core_ended_before_the_loop_has_handled_it(engine, monkeypatch):
    """The core process has exited and the loop's watcher has not run yet: the client's account
    (its exit code) is the reason, not a bare "not running"."""
    with served(engine, started=False) as c:
        core = c.app.state.serving.engine.client
        monkeypatch.setattr(core, "exit_reason", lambda: "the engine core process exited with -9")
        r = c.get("/health")
    reason = "the engine loop is not running: the engine core process exited with -9"
    assert error_of(r, 503)["message"] == reason


def test_version_is_the_packages(client):
    assert client.get("/version").json() == {"version": pagedserve.__version__}


def test_metrics_are_prometheus_text(client):
    r = client.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain; version=")
    assert "pagedserve:num_requests_running" in r.text


# ---- /tokenize, /detokenize -----------------------------------------------------------------------
def test_tokenize_a_prompt_and_detokenize_it_back(client):
    r = client.post("/tokenize", json={"prompt": "Hello world"}, headers=AUTH)
    body = r.json()
    assert body["count"] == len(body["tokens"]) > 0 and body["max_model_len"] == 64
    assert body["prompt"] is None
    r = client.post("/detokenize", json={"tokens": body["tokens"]}, headers=AUTH)
    assert r.json() == {"prompt": "Hello world"}


def test_tokenize_messages_answers_the_prompt_the_template_made(client):
    r = client.post("/tokenize", json={"messages": CHAT}, headers=AUTH)
    body = r.json()
    assert "Hi" in body["prompt"] and body["count"] == len(body["tokens"])


def test_tokenize_needs_a_prompt_or_messages(client):
    r = client.post("/tokenize", json={}, headers=AUTH)
    error = error_of(r, 400)
    assert (error["param"], error["message"]) == (
        "prompt",
        "send 'prompt' (a string) or 'messages'",
    )


def test_detokenize_refuses_an_id_outside_the_vocabulary(client, engine):
    vocab = engine.model_config.vocab_size
    r = client.post("/detokenize", json={"tokens": [1, vocab, vocab + 5]}, headers=AUTH)
    error = error_of(r, 400)
    assert error["param"] == "tokens"
    assert error["message"] == f"token id {vocab} is outside the vocabulary [0, {vocab})"
    assert client.post("/detokenize", json={"tokens": [vocab - 1]}, headers=AUTH).status_code == 200


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_tokenization_names_the_served_model_only(client, path):
    r = client.post(path, json={"model": "other", "prompt": "x", "tokens": [1]}, headers=AUTH)
    assert error_of(r, 404)["code"] == "model_not_found"


# ---- /device ------------------------------------------------------------------------------------
def test_device_reports_the_engines_figures_and_the_served_model(client):
    r = client.get("/device", headers=AUTH)
    body = r.json()
    assert body["model"] == "demo" and body["tokens_per_second"] == 0.0
    assert isinstance(body["tokens_per_second_history"], list) and "kv_pages" in body


def test_device_pages_is_the_page_map(client):
    body = client.get("/device/pages", headers=AUTH).json()
    assert isinstance(body, dict) and body


def test_scrub_and_invariants_are_the_engine_cores_answers(client):
    r = client.post("/device/scrub", headers=AUTH)
    assert r.status_code == 200 and isinstance(r.json(), dict)
    r = client.get("/device/invariants", headers=AUTH)
    assert r.status_code == 200 and r.json()["problems"] == []


def test_fault_injection_is_403_unless_the_server_allows_it(client):
    r = client.post("/device/faults", json={"kind": "step"}, headers=AUTH)
    assert error_of(r, 403) == {
        "message": "fault injection is off: start the server with --enable-fault-injection",
        "type": "invalid_request_error",
        "param": None,
        "code": "fault_injection_disabled",
    }


def test_a_fault_the_engine_cannot_inject_is_a_400(engine):
    with served(engine, enable_fault_injection=True) as c:
        r = c.post("/device/faults", json={"kind": "kv_page", "page": 10**6}, headers=AUTH)
        assert r.status_code == 400, r.text


def test_a_fault_the_engine_cannot_inject_is_a_400_saying_why(engine):
    with served(engine, enable_fault_injection=True) as c:
        r = c.post("/device/faults", json={"kind": "step"}, headers=AUTH)
    assert "fault injection needs --device kunlun-emu, not cpu" in error_of(r, 400)["message"]


def test_a_fault_injected_is_the_one_asked_for():
    from pagedserve.config import EngineConfig
    from pagedserve.engine.llm_engine import LLMEngine

    emu = LLMEngine(EngineConfig.from_kwargs(model="demo", device="kunlun-emu", **LIMITS))
    tag = sorted(emu.device.weight_tensors)[-1]
    with served(emu, enable_fault_injection=True) as c:
        r = c.post("/device/faults", json={"kind": "kv_page", "page": 3}, headers=AUTH)
        assert r.json() == {"kind": "kv_page", "page": 3}, r.text
        body = {"kind": "weight_page", "tag": tag, "page": 0}
        r = c.post("/device/faults", json=body, headers=AUTH)
        assert r.json() == body, r.text


@pytest.mark.parametrize(
    "method, path",
    [
        ("post", "/device/scrub"),
        ("get", "/device/invariants"),
        ("get", "/device"),
        ("get", "/device/pages"),
    ],
)
def test_device_routes_are_503_once_the_engine_is_dead(engine, method, path):
    with served(engine, started=False) as c:
        r = getattr(c, method)(path, headers=AUTH)
    assert error_of(r, 503) == {
        "message": "the engine loop is not running: None",
        "type": "server_error",
        "param": None,
        "code": "engine_dead",
    }


def test_fault_injection_on_a_dead_engine_is_503(engine):
    with served(engine, started=False, enable_fault_injection=True) as c:
        r = c.post("/device/faults", json={"kind": "step"}, headers=AUTH)
    assert error_of(r, 503)["code"] == "engine_dead"


# ---- the web console ----------------------------------------------------------------------------
def test_the_console_page_is_served_uncached_at_root(client):
    r = client.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert r.headers["cache-control"] == "no-cache" and "<html" in r.text.lower()


def test_without_the_web_ui_there_is_no_page_at_root(engine):
    with served(engine, web_ui=False) as c:
        assert c.get("/", headers=AUTH).status_code == 404
        assert c.get("/console/console.js", headers=AUTH).status_code == 404
