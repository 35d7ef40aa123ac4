"""`pagedserve bench` against a fake OpenAI-compatible streaming server with known delays."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
from dataclasses import dataclass

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagedserve.benchmarks import datasets, metrics
from pagedserve.benchmarks import serve as bench
from pagedserve.benchmarks.request import RequestFuncOutput
from pagedserve.entrypoints.cli.bench import add_bench_args, run_bench
from pagedserve.testing import free_port, serve_app
from tests.helpers.tools import require_module

TTFT_S = 0.20
ITL_S = 0.04
PROMPT_TOKENS = 7


@dataclass
class FakeBehaviour:
    fail_every: int = 0  # every n-th request gets HTTP 500
    usage: bool = True
    received: int = 0


def fake_app(behaviour: FakeBehaviour) -> FastAPI:
    app = FastAPI()

    async def stream(body: dict, chat: bool):
        await asyncio.sleep(TTFT_S)
        n = body["max_tokens"]
        for i in range(n):
            if i:
                await asyncio.sleep(ITL_S)
            piece = f" tok{i}"
            choice = (
                {"index": 0, "delta": {"content": piece}, "finish_reason": None}
                if chat
                else {"index": 0, "text": piece, "finish_reason": None}
            )
            yield f"data: {json.dumps({'id': 'x', 'choices': [choice]})}\n\n"
        if behaviour.usage and body.get("stream_options", {}).get("include_usage"):
            usage = {
                "prompt_tokens": PROMPT_TOKENS,
                "completion_tokens": n,
                "total_tokens": PROMPT_TOKENS + n,
            }
            yield f"data: {json.dumps({'id': 'x', 'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"

    async def handle(request: Request, chat: bool):
        body = await request.json()
        behaviour.received += 1
        if behaviour.fail_every and behaviour.received % behaviour.fail_every == 0:
            return JSONResponse({"error": {"message": "injected failure"}}, status_code=500)
        assert body["stream"] is True
        assert ("messages" in body) == chat and ("prompt" in body) != chat
        return StreamingResponse(stream(body, chat), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


def serve(behaviour: FakeBehaviour):
    """The fake server in a thread of this process: its base URL."""
    return serve_app(fake_app(behaviour), lifespan="off")


def _args(base_url: str, *extra: str) -> argparse.Namespace:
    return add_bench_args(argparse.ArgumentParser()).parse_args(
        [
            "--base-url",
            base_url,
            "--model",
            "fake",
            "--num-prompts",
            "6",
            "--random-input-len",
            "16",
            "--random-output-len",
            "5",
            "--ignore-eos",
            "--disable-tqdm",
            *extra,
        ]
    )


def _run(base_url: str, tmp_path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "result.json"
    code = run_bench(_args(base_url, "--output-file", str(out), *extra))
    return code, json.loads(out.read_text())


def test_bench_completes_every_request_and_reports_vllm_fields(tmp_path):
    with serve(FakeBehaviour()) as url:
        code, result = _run(url, tmp_path)
    assert code == 0
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["total_output_tokens"] == 6 * 5
    assert result["total_input_tokens"] == 6 * PROMPT_TOKENS  # the server's usage wins
    for name in ("request_throughput", "output_throughput", "total_token_throughput"):
        assert result[name] > 0
    for metric in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p90", "p99"):
            assert f"{stat}_{metric}_ms" in result


def test_latencies_match_the_servers_known_delays(tmp_path):
    with serve(FakeBehaviour()) as url:
        _, result = _run(url, tmp_path, "--max-concurrency", "3")
    # lower bounds only: the server sleeps at least this long; a loaded machine adds, never takes
    assert result["mean_ttft_ms"] >= TTFT_S * 1000
    assert result["mean_e2el_ms"] >= (TTFT_S + 4 * ITL_S) * 1000
    # vLLM's definitions tie the figures together: e2el = ttft + 4 tpot (5 tokens a request),
    # and the gaps between tokens fit in the time after the first token
    assert result["mean_e2el_ms"] == pytest.approx(
        result["mean_ttft_ms"] + 4 * result["mean_tpot_ms"]
    )
    assert 0 < result["mean_itl_ms"] <= result["mean_tpot_ms"] + 1e-6
    assert result["mean_e2el_ms"] <= result["duration"] * 1000
    assert result["output_throughput"] == pytest.approx(
        result["total_output_tokens"] / result["duration"]
    )


def test_max_concurrency_serialises_requests(tmp_path):
    with serve(FakeBehaviour()) as url:
        _, result = _run(url, tmp_path, "--max-concurrency", "1", "--num-prompts", "3")
    one_request = TTFT_S + 4 * ITL_S
    assert result["duration"] >= 3 * one_request


def test_failed_requests_are_counted_not_fatal(tmp_path):
    with serve(FakeBehaviour(fail_every=2)) as url:
        code, result = _run(url, tmp_path)
    assert code == 0
    assert result["completed"] == 3 and result["failed"] == 3
    assert all("500" in e for e in result["errors"])
    assert result["total_output_tokens"] == 3 * 5


def test_chat_endpoint_without_usage_counts_chunks(tmp_path):
    with serve(FakeBehaviour(usage=False)) as url:
        code, result = _run(url, tmp_path, "--endpoint", "chat")
    assert code == 0 and result["completed"] == 6
    assert result["total_output_tokens"] == 6 * 5  # one token per content chunk
    assert result["total_input_tokens"] == 6 * 16  # the dataset's length when no usage


def test_sharegpt_and_prefix_repetition_datasets(tmp_path):
    convs = [
        {
            "conversations": [
                {"from": "human", "value": f"question {i} " + "word " * 10},
                {"from": "gpt", "value": "answer " * 8},
            ]
        }
        for i in range(8)
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(convs))
    with serve(FakeBehaviour()) as url:
        code, result = _run(
            url,
            tmp_path,
            "--dataset",
            "sharegpt",
            "--dataset-path",
            str(path),
            "--num-prompts",
            "4",
            "--request-rate",
            "50",
            "--save-detailed",
        )
        assert code == 0 and result["completed"] == 4
        assert result["output_lens"] == [8] * 4  # max_tokens from the reply's length
        code, result = _run(
            url,
            tmp_path,
            "--dataset",
            "prefix-repetition",
            "--prefix-repetition-prefix-len",
            "8",
            "--prefix-repetition-suffix-len",
            "4",
            "--prefix-repetition-output-len",
            "3",
            "--prefix-repetition-num-prefixes",
            "2",
        )
    assert code == 0 and result["completed"] == 6
    assert result["total_output_tokens"] == 6 * 3


def test_prefix_repetition_prompts_share_prefixes():
    args = _args(
        "http://unused",
        "--dataset",
        "prefix-repetition",
        "--num-prompts",
        "8",
        "--prefix-repetition-prefix-len",
        "20",
        "--prefix-repetition-num-prefixes",
        "2",
    )
    samples = datasets.prefix_repetition_dataset(args, datasets.PromptBuilder(None))
    prefixes = {" ".join(s.prompt.split()[:20]) for s in samples}
    assert len(samples) == 8 and len(prefixes) == 2


@pytest.mark.parametrize(
    "flags", [[], ["--model", "m"], ["--dataset", "agent"]], ids=["no-model", "model", "agent"]
)
def test_a_server_that_is_down_is_named_before_any_request(tmp_path, capsys, flags):
    url = f"http://127.0.0.1:{free_port()}"
    out = tmp_path / "result.json"
    argv = ["--base-url", url, "--num-prompts", "2", "--output-file", str(out), *flags]
    assert run_bench(add_bench_args(argparse.ArgumentParser()).parse_args(argv)) == 2
    err = capsys.readouterr().err
    assert f"cannot reach a server at {url}" in err and "pagedserve serve" in err
    assert "pass --model" not in err and not out.exists()


def test_poisson_arrivals_have_the_requested_mean_rate():
    gaps = bench.arrival_gaps(4000, request_rate=20.0, burstiness=1.0, seed=0)
    assert statistics.fmean(gaps) == pytest.approx(1 / 20, rel=0.05)
    assert statistics.pstdev(gaps) == pytest.approx(1 / 20, rel=0.08)  # exponential: sd = mean
    bursty = bench.arrival_gaps(4000, request_rate=20.0, burstiness=0.25, seed=0)
    assert statistics.fmean(bursty) == pytest.approx(1 / 20, rel=0.1)
    assert statistics.pstdev(bursty) > 1.5 * statistics.pstdev(gaps)
    assert bench.arrival_gaps(3, float("inf"), 1.0, 0) == [0.0, 0.0, 0.0]


def test_tpot_and_percentiles_follow_vllm_definitions():
    outs = [
        RequestFuncOutput(
            success=True, output_tokens=5, ttft=0.1, latency=0.5, itl=[0.1] * 4, prompt_len=10
        ),
        RequestFuncOutput(success=True, output_tokens=1, ttft=0.2, latency=0.2, prompt_len=10),
        RequestFuncOutput(success=False, error="x"),
    ]
    m = metrics.compute_metrics(outs, duration=2.0)
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["mean_tpot_ms"] == pytest.approx(100.0)  # (0.5 - 0.1) / 4; 1-token request excluded
    assert m["mean_ttft_ms"] == pytest.approx(150.0)
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["total_token_throughput"] == pytest.approx((20 + 6) / 2.0)
    assert metrics.percentile([1, 2, 3, 4, 5], 90) == pytest.approx(4.6)  # numpy's linear rule


def test_bad_arguments_are_refused_with_a_reason(capsys):
    code = run_bench(_args("http://unused", "--dataset", "sharegpt"))
    assert code == 2 and "--dataset-path" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _args("http://unused", "--request-rate", "0")


def test_tokenizer_gives_exact_prompt_lengths(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["[UNK]", *sorted(set(datasets.WORDS))])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    prompts = datasets.PromptBuilder(datasets.local_tokenizer(str(tmp_path)))
    args = _args("http://unused", "--tokenizer", str(tmp_path), "--random-input-len", "37")
    samples = datasets.random_dataset(args, prompts)
    assert all(prompts.count(s.prompt) == s.prompt_len == 37 for s in samples)


@pytest.mark.parametrize("num_tokens", [1, 2, 3, 17, 128, 1000])
def test_random_prompts_have_the_asked_length_as_the_demo_server_counts_it(num_tokens):
    from pagedserve.models.tokenizer import Tokenizer
    from pagedserve.presets import demo_model_dir

    server_side = Tokenizer(demo_model_dir())  # what `pagedserve serve` counts with
    prompts = datasets.PromptBuilder(datasets.local_tokenizer("demo"))
    assert prompts.num_special == 2  # [gMASK]<sop>
    rng = random.Random(num_tokens)
    for _ in range(5):
        text, count = prompts.text(rng, max(num_tokens, 3))
        assert count == len(server_side.encode(text)) == max(num_tokens, 3)


def _live_args(live_server, *extra: str) -> argparse.Namespace:
    return add_bench_args(argparse.ArgumentParser()).parse_args(
        [
            "--base-url",
            live_server.url,
            "--api-key",
            live_server.api_key,
            "--num-prompts",
            "3",
            "--ignore-eos",
            "--save-detailed",
            "--disable-tqdm",
            *extra,
        ]
    )


def _run_live(live_server, tmp_path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "live.json"
    code = run_bench(_live_args(live_server, "--output-file", str(out), *extra))
    return code, json.loads(out.read_text()) if out.exists() else {}


def test_prompts_have_the_asked_length_by_the_servers_tokenize(live_server, tmp_path, capsys):
    lengths = ["--random-input-len", "40", "--random-output-len", "3"]
    code, result = _run_live(live_server, tmp_path, "--model", live_server.model, *lengths)
    assert code == 0 and result["failed"] == 0
    assert result["input_lens"] == [40] * 3  # the server's own usage.prompt_tokens
    assert "/tokenize" in capsys.readouterr().err


def test_without_model_the_servers_first_model_is_benchmarked(live_server, tmp_path, capsys):
    lengths = ["--random-input-len", "8", "--random-output-len", "2"]
    code, result = _run_live(live_server, tmp_path, *lengths)
    assert code == 0 and result["completed"] == 3
    assert result["model_id"] == live_server.model
    assert f"--model {live_server.model}" in capsys.readouterr().err


def test_default_lengths_shrink_to_fit_the_servers_max_model_len(live_server, tmp_path, capsys):
    limit = live_server.serving.max_model_len
    assert limit < datasets.DEFAULT_RANDOM_INPUT_LEN + datasets.DEFAULT_RANDOM_OUTPUT_LEN
    code, result = _run_live(live_server, tmp_path, "--num-prompts", "2")
    assert code == 0 and result["failed"] == 0
    default_total = datasets.DEFAULT_RANDOM_INPUT_LEN + datasets.DEFAULT_RANDOM_OUTPUT_LEN
    n_in = int(datasets.DEFAULT_RANDOM_INPUT_LEN * limit / default_total)  # 1024:128, scaled down
    n_out = int(datasets.DEFAULT_RANDOM_OUTPUT_LEN * limit / default_total)
    assert set(result["input_lens"]) == {n_in} and set(result["output_lens"]) == {n_out}
    assert n_in + n_out <= limit
    assert f"max_model_len is {limit}" in capsys.readouterr().err


def test_lengths_that_cannot_fit_are_refused_before_any_request(live_server, tmp_path, capsys):
    engine = live_server.serving.llm_engine
    before = engine.stats["prompt_tokens_total"]
    code, _ = _run_live(live_server, tmp_path, "--random-input-len", "300")
    err = capsys.readouterr().err
    assert code == 2
    assert "--random-input-len 300" in err and "max_model_len 256" in err
    assert engine.stats["prompt_tokens_total"] == before


def test_model_demo_measures_prompts_with_the_local_demo_tokenizer(tmp_path, capsys):
    with serve(FakeBehaviour(usage=False)) as url:  # no /tokenize, no usage
        args = _args(url, "--model", "demo", "--random-input-len", "50", "--save-detailed")
        out = tmp_path / "r.json"
        args.output_file = str(out)
        assert run_bench(args) == 0
    assert json.loads(out.read_text())["input_lens"] == [50] * 6
    assert "tokenizer of --model demo" in capsys.readouterr().err


def test_without_any_tokenizer_the_lengths_are_said_to_be_words(tmp_path, capsys):
    with serve(FakeBehaviour()) as url:
        code, _ = _run(url, tmp_path)
    assert code == 0
    assert "counted in words, not tokens" in capsys.readouterr().err


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bench_against_a_live_pagedserve_server_completes_every_request(
    live_server, tmp_path, endpoint
):
    out = tmp_path / "live.json"
    args = add_bench_args(argparse.ArgumentParser()).parse_args(
        [
            "--base-url",
            live_server.url,
            "--model",
            live_server.model,
            "--api-key",
            live_server.api_key,
            "--endpoint",
            endpoint,
            "--num-prompts",
            "8",
            "--random-input-len",
            "16",
            "--random-output-len",
            "6",
            "--ignore-eos",
            "--output-file",
            str(out),
            "--disable-tqdm",
        ]
    )
    assert run_bench(args) == 0
    result = json.loads(out.read_text())
    assert result["completed"] == 8 and result["failed"] == 0
    assert result["total_output_tokens"] == 8 * 6
    for name in (
        "request_throughput",
        "output_throughput",
        "mean_ttft_ms",
        "median_tpot_ms",
        "p99_itl_ms",
        "median_e2el_ms",
    ):
        assert result[name] > 0


def test_base_url_alone_benchmarks_a_live_server_and_writes_its_json(
    live_server, tmp_path, monkeypatch, capsys
):
    """`pagedserve bench --base-url URL` (the API key from $OPENAI_API_KEY, as vLLM reads it):
    the model from /v1/models, lengths fitted to its max_model_len, JSON under vLLM's name."""
    from pagedserve.entrypoints.cli.main import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OPENAI_API_KEY", live_server.api_key)
    assert main(["bench", "--base-url", live_server.url, "--num-prompts", "2"]) == 0
    (written,) = tmp_path.glob("*.json")
    assert written.name.startswith(f"openai-infqps-{live_server.model}-")
    result = json.loads(written.read_text())
    assert result["model_id"] == live_server.model
    assert result["completed"] == 2 and result["failed"] == 0
    assert result["total_input_tokens"] + result["total_output_tokens"] <= 2 * 256
    assert str(written.name) in capsys.readouterr().err


def test_default_output_file_is_named_as_vllm_names_it():
    args = _args("http://unused", "--request-rate", "2.5", "--max-concurrency", "4")
    args.model = "/models/glm-4-9b-chat/"
    name = bench.default_output_file(args, "20260101-120000")
    assert name == "openai-2.5qps-concurrency4-glm-4-9b-chat-20260101-120000.json"


def test_throughput_over_time_counts_tokens_not_chunks():
    # two tokens a chunk (as a server that streams every other step would): 4 chunks, 8 tokens
    out = RequestFuncOutput(
        success=True,
        start=10.0,
        output_tokens=8,
        num_chunks=4,
        token_times=[10.2, 10.5, 11.1, 11.9],
    )
    seconds, tokens = metrics.throughput_series([out])
    assert seconds == [0.0, 1.0] and tokens == [4.0, 4.0]
    assert sum(tokens) == out.output_tokens


def test_plot_draws_a_png_of_the_runs_latencies_and_throughput(tmp_path):
    image = require_module(
        "matplotlib.image", "the plot extra is not installed: pip install -e '.[test]'"
    )
    png = tmp_path / "bench.png"
    with serve(FakeBehaviour()) as url:
        code, result = _run(url, tmp_path, "--plot", str(png))
    assert code == 0 and result["completed"] == 6
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = image.imread(png)
    assert pixels.shape[:2] == (800, 1500)  # six panels, 15 x 8 inches at 100 dpi
    # drawn, not blank: many distinct colours (bars, lines, text), far from one background
    distinct = {tuple(row) for row in pixels.reshape(-1, pixels.shape[2]).round(2).tolist()}
    assert len(distinct) > 50


def test_plot_series_follow_vllm_definitions():
    from pagedserve.benchmarks.plot import in_flight_series, latency_series

    outs = [
        RequestFuncOutput(
            success=True, start=0.0, ttft=0.1, latency=0.5, output_tokens=5, itl=[0.1] * 4
        ),
        RequestFuncOutput(success=True, start=0.2, ttft=0.2, latency=0.2, output_tokens=1),
        RequestFuncOutput(success=False, start=0.3, latency=0.05, error="x"),
    ]
    series = latency_series(outs)
    assert series["TTFT"] == pytest.approx([100.0, 200.0])
    assert series["TPOT"] == pytest.approx([100.0])  # the one-token request has no TPOT
    assert series["ITL"] == pytest.approx([100.0] * 4)
    assert series["E2E latency"] == pytest.approx([500.0, 200.0])
    times, running = in_flight_series(outs)
    assert times == pytest.approx([0.0, 0.2, 0.3, 0.35, 0.4, 0.5])
    assert running == [1, 2, 3, 2, 1, 0]  # a failed request is in flight until it fails


def test_plot_without_matplotlib_names_the_extra_before_any_request(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    behaviour = FakeBehaviour()
    with serve(behaviour) as url:
        code = run_bench(_args(url, "--plot", str(tmp_path / "p.png")))
    assert code == 2
    assert "pagedserve[plot]" in capsys.readouterr().err
    assert behaviour.received == 0 and not (tmp_path / "p.png").exists()


def test_plot_with_the_agent_dataset_is_refused_with_a_reason(tmp_path, capsys):
    args = _args("http://unused", "--dataset", "agent", "--plot", str(tmp_path / "p.png"))
    assert run_bench(args) == 2
    assert "--plot" in capsys.readouterr().err and not (tmp_path / "p.png").exists()


@pytest.mark.parametrize("program", ["select", "tools"])
def test_the_agent_programs_run_against_the_demo_model(program, tmp_path):
    """Both agent programs at a tiny size: every program completes, each step is timed (the tool
    program's call is one the grammar held to a declared function)."""
    from pagedserve.config import EngineConfig
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.server.app import build_app

    engine = LLMEngine(
        EngineConfig.from_kwargs(model="demo", device="cpu", num_kv_pages=256, max_model_len=1024)
    )
    out = tmp_path / "agent.json"
    with serve_app(build_app(engine, "demo")) as url:
        flags = ("--dataset", "agent", "--agent-program", program, "--max-concurrency", "2")
        args = _args(url, *flags, "--num-prompts", "2", "--output-file", str(out))
        assert run_bench(args) == 0
    report = json.loads(out.read_text())
    assert report["num_completed_requests"] == 2 and report["num_failed_requests"] == 0
    assert report["program"] == program
    steps = {"select": {"select", "fork", "constrained_gen"}, "tools": {"tool_call", "answer"}}
    assert set(report["steps"]) == steps[program]
    assert all(step["avg_latency_ms"] > 0 for step in report["steps"].values())
