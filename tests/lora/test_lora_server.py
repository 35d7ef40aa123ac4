"""LoRA adapters through the official ``openai`` client: a request picks its adapter by
``model`` and gets transformers + PEFT's tokens; ``/v1/models`` lists each adapter with its
parent; adapters load and unload at run time (an unknown one is a 404 in OpenAI's shape, a bad
directory a 400 naming what is wrong, one in use is refused naming its requests); a soak that
mixes adapters leaves no page and no adapter behind; ``/metrics`` has vLLM's
``lora_requests_info`` and the requests per adapter."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from pagedserve.testing import serve_app
from tests.helpers.lora import build_peft_adapter
from tests.helpers.metrics import read_metrics
from tests.helpers.models import hf_greedy

PROMPT = [11, 12, 13, 14, 15]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def lora_server(tiny_glm4, tmp_path_factory):
    """A server over the tiny GLM-4-0414 with adapter "sql" loaded at start, "chat" and "fit"
    on disk for the run-time loads, two device slots; and each adapter's reference tokens."""
    from pagedserve.config import EngineConfig
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.server.app import build_app

    model_dir, hf = tiny_glm4
    root = tmp_path_factory.mktemp("adapters")
    refs = {"tiny": hf_greedy(hf, PROMPT, MAX_TOKENS)}
    for seed, name in enumerate(("sql", "chat", "fit"), 1):
        refs[name] = hf_greedy(build_peft_adapter(hf, root / name, seed), PROMPT, MAX_TOKENS)
    build_peft_adapter(hf, root / "big", 9, r=32)
    config = EngineConfig.from_kwargs(
        model=str(model_dir),
        dtype="float32",
        device="cpu",
        num_kv_pages=256,
        max_num_seqs=16,
        enable_lora=True,
        max_loras=2,
        lora_modules=[{"name": "sql", "path": str(root / "sql"), "base_model_name": None}],
    )
    app = build_app(LLMEngine(config), "tiny", allow_runtime_lora_updating=True)
    with serve_app(app) as url:
        yield url, root, refs, app.state.serving.llm_engine


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def _complete(url: str, model: str, **kwargs):
    return _client(url).completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body={"ignore_eos": True},
        **kwargs,
    )


def _text(engine, tokens: list[int]) -> str:
    return engine.tokenizer.decode(tokens, skip_special_tokens=True)


def test_a_request_picks_its_adapter_by_model_and_gets_peft_tokens(lora_server):
    url, _, refs, engine = lora_server
    base, sql = _complete(url, "tiny"), _complete(url, "sql")
    assert base.choices[0].text == _text(engine, refs["tiny"])
    assert sql.choices[0].text == _text(engine, refs["sql"]) != base.choices[0].text
    assert sql.model == "sql" and base.model == "tiny"
    chunks = list(
        _client(url).chat.completions.create(
            model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True
        )
    )
    assert chunks and all(c.model == "sql" for c in chunks)


def test_models_lists_each_adapter_with_its_parent(lora_server):
    url = lora_server[0]
    cards = {m.id: m for m in _client(url).models.list().data}
    assert cards["tiny"].model_extra.get("parent") is None
    assert cards["sql"].model_extra["parent"] == "tiny"
    assert cards["sql"].model_extra["root"].endswith("sql")


def test_an_unknown_adapter_is_a_404_in_openais_shape(lora_server):
    with pytest.raises(openai.NotFoundError) as e:
        _complete(lora_server[0], "nobody")
    error = e.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "'nobody' does not exist" in error["message"] and "'sql'" in error["message"]


def _load(url: str, name: str, path) -> httpx.Response:
    body = {"lora_name": name, "lora_path": str(path)}
    return httpx.post(url + "/v1/load_lora_adapter", json=body, timeout=60)


def _unload(url: str, name: str) -> httpx.Response:
    return httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60)


def test_an_adapter_loads_and_unloads_at_run_time(lora_server):
    url, root, refs, engine = lora_server
    r = _load(url, "chat", root / "chat")
    assert r.status_code == 200 and "added" in r.text
    assert "chat" in {m.id for m in _client(url).models.list().data}
    assert _complete(url, "chat").choices[0].text == _text(engine, refs["chat"])
    assert _load(url, "chat", root / "chat").json()["error"]["param"] == "lora_name"  # twice
    r = _unload(url, "chat")
    assert r.status_code == 200 and "removed" in r.text
    assert "chat" not in {m.id for m in _client(url).models.list().data}
    with pytest.raises(openai.NotFoundError):
        _complete(url, "chat")
    assert _unload(url, "chat").status_code == 404
    # loaded again, it is read afresh (a new id: no block of the old one is taken for it)
    assert _load(url, "chat", root / "chat").status_code == 200
    assert _complete(url, "chat").choices[0].text == _text(engine, refs["chat"])
    assert _unload(url, "chat").status_code == 200


@pytest.mark.parametrize(
    "where, words",
    [
        ("missing", ["is not a directory"]),
        ("base", ["no adapter_config.json in"]),  # the base model's directory is no adapter
        ("big", ["rank 32", "--max-lora-rank 32"]),
    ],
)
def test_a_bad_adapter_directory_is_a_400_naming_what_is_wrong(
    lora_server, tiny_glm4, where, words
):
    url, root = lora_server[:2]
    path = tiny_glm4[0] if where == "base" else root / where
    r = _load(url, "bad", path)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "lora_path" and all(w in error["message"] for w in words), error
    assert "bad" not in {m.id for m in _client(url).models.list().data}


def test_unloading_an_adapter_in_use_is_refused_naming_its_requests(lora_server):
    url, root, _, engine = lora_server
    assert _load(url, "fit", root / "fit").status_code == 200
    step = engine.execute_step

    def slow_step():  # 100 steps of at least 20 ms: the request is in flight for 2 s or more
        time.sleep(0.02)
        return step()

    engine.execute_step = slow_step
    try:
        stream = _client(url).completions.create(
            model="fit", prompt=PROMPT, max_tokens=100, stream=True, extra_body={"ignore_eos": True}
        )
        next(iter(stream))  # it runs
        r = _unload(url, "fit")
        stream.close()  # the client leaves: the request is aborted
    finally:
        engine.execute_step = step
    assert r.status_code == 409, r.text
    error = r.json()["error"]
    assert error["code"] == "lora_adapter_in_use" and "cmpl-" in error["message"], error
    deadline = time.monotonic() + 30
    while (r := _unload(url, "fit")).status_code == 409 and time.monotonic() < deadline:
        time.sleep(0.05)  # the abort reaches the engine a step later
    assert r.status_code == 200, r.text


def test_a_soak_mixing_adapters_leaks_no_page_and_no_adapter(lora_server):
    """Three adapters over two device slots, streaming and not, clients that leave early; then
    nothing in flight, no page in use, the pool's invariants hold, and no adapter is left
    running or waiting."""
    from benchmarks.reliability.soak import run_soak

    url, root, _, engine = lora_server
    for name in ("chat", "fit"):
        assert _load(url, name, root / name).status_code == 200
    swap_ins = engine.lora_registry.num_swap_ins
    try:
        models = ["tiny", "sql", "chat", "fit"]
        figures = run_soak(url, 48, concurrency=8, memory_pids=[], prefix_copies=1, models=models)
    finally:
        for name in ("chat", "fit"):
            _unload(url, name)
    assert engine.lora_registry.num_swap_ins > swap_ins + 2  # three adapters through two slots
    assert figures["status_5xx"] == 0 and figures["other_errors"] == 0, figures["outcomes"]
    assert figures["completed"] + figures["disconnected"] == 48 and figures["completed"] > 24
    end = figures["end_state"]
    assert end["problems"] == [] and end["num_kv_pages_in_use"] == 0
    text = httpx.get(url + "/metrics").text
    info = [line for line in text.splitlines() if line.startswith("vllm:lora_requests_info{")]
    assert len(info) == 1 and 'max_lora="2"' in info[0]
    assert 'running_lora_adapters=""' in info[0] and 'waiting_lora_adapters=""' in info[0]
    metrics = read_metrics(url)
    assert metrics['pagedserve:lora_requests_total{lora_name="sql"}'] > 0
    assert metrics['pagedserve:lora_requests_total{lora_name="chat"}'] > 0


def test_runtime_updating_answers_only_where_the_operator_allowed_it(monkeypatch):
    from pagedserve.server.lora import runtime_lora_updating_allowed

    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    assert not runtime_lora_updating_allowed()
    assert runtime_lora_updating_allowed(flag=True)
    for value, allowed in (("true", True), ("True", True), ("1", True), ("false", False)):
        monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", value)
        assert runtime_lora_updating_allowed() is allowed


def test_the_sdk_sglangs_generate_lang_and_smi_take_adapters_too(lora_server):
    """Every place that names a model takes an adapter's name: the SDK (and its run-time
    loads), SGLang's /generate (``lora_path``), pagedserve.lang (``run(lora_path=...)``) and
    ``pagedserve smi``'s summary and detail."""
    import argparse

    from pagedserve.client import Client
    from pagedserve.entrypoints.cli.smi import fetch_devices, render
    from pagedserve.lang import Runtime, function, gen

    url, root, refs, engine = lora_server
    want = _text(engine, refs["chat"])
    with Client(url) as client:
        assert "added" in client.load_lora_adapter("chat", str(root / "chat"))
        try:
            out = client.completions.create(
                model="chat", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True
            )
            assert out.choices[0].text == want and out.model == "chat"
            sampling = {"max_new_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
            body = {"input_ids": PROMPT, "sampling_params": sampling, "lora_path": "chat"}
            assert httpx.post(url + "/generate", json=body).json()["text"] == want
            r = httpx.post(url + "/generate", json={**body, "lora_path": "nobody"})
            assert r.status_code == 404 and r.json()["error"]["param"] == "lora_path"

            @function
            def program(s):
                s += "Hello"
                s += gen("answer", max_tokens=MAX_TOKENS, temperature=0)

            runtime = Runtime(url)
            by_lang = program.run(backend=runtime, lora_path="chat")["answer"]
            openai_text = _client(url).completions.create(
                model="chat", prompt="Hello", max_tokens=MAX_TOKENS, temperature=0
            )
            assert by_lang == openai_text.choices[0].text
            devices = fetch_devices(url)
            args = argparse.Namespace(device_index=None, json=False, query=False)
            summary = render(devices, args)
            assert "LoRA slots" in summary and "chat" in summary, summary
            detail = render(devices, argparse.Namespace(device_index=0, json=False, query=True))
            assert "LoRA adapters" in detail and "sql" in detail, detail
        finally:
            assert "removed" in client.unload_lora_adapter("chat")


def test_bench_spreads_its_requests_over_the_lora_modules(lora_server, tmp_path, capsys):
    """``pagedserve bench --lora-modules``: each request names one of them as its model (the
    server's per-adapter counts grow by the requests), an unknown one is refused up front."""
    import json

    from pagedserve.entrypoints.cli.main import main

    url = lora_server[0]
    before = read_metrics(url).get('pagedserve:lora_requests_total{lora_name="sql"}', 0)
    out = tmp_path / "bench.json"
    flags = ["bench", "--base-url", url, "--num-prompts", "4", "--random-input-len", "8"]
    flags += ["--random-output-len", "2", "--disable-tqdm", "--output-file", str(out)]
    assert main([*flags, "--lora-modules", "sql"]) == 0
    assert json.loads(out.read_text())["completed"] == 4
    assert read_metrics(url)['pagedserve:lora_requests_total{lora_name="sql"}'] == before + 4
    assert main([*flags, "--lora-modules", "sql", "nobody"]) != 0
    err = capsys.readouterr().err
    assert "--lora-modules nobody" in err and "does not serve it" in err, err
