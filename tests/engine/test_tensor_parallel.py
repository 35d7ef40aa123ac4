"""Tensor parallelism: a node's cards, Megatron sharding held to tp 1's greedy tokens, a model larger
than one card served over two, two "machines" on loopback, and a dead rank failing cleanly."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
import torch
import torch.multiprocessing

from pagedserve import LLM, SamplingParams
from pagedserve.config import EngineConfig, UsageContext
from pagedserve.engine.executor import check_parallel_config
from pagedserve.hal import load_device_preset
from pagedserve.models import load_config
from pagedserve.models.tensor_parallel import TensorParallel
from pagedserve.testing import free_port, serve
from tests.helpers.models import build_tiny_hf_model

PROMPTS = [[11, 12, 13], [(5 * i) % 300 + 10 for i in range(29)], [99]]
MAX_TOKENS = 6


# ---- cards ------------------------------------------------------------------------------------
def test_the_default_device_is_a_node_of_8_cards_and_refuses_more_ranks():
    node = load_device_preset("kunlun-emu")
    assert node.cards == 8
    assert node.check_tensor_parallel_size(2) == [2, 3, 4, 5, 6, 7]  # named in a warning
    with pytest.raises(ValueError, match=r"--tp-size 9 .* 8 card\(s\) per node"):
        node.check_tensor_parallel_size(9)
    p800 = load_device_preset("kunlun-p800x8")
    assert p800.cards == 8 and p800.memory_bytes == 32 * 2**30
    assert load_device_preset("cpu").check_tensor_parallel_size(64) == []  # one card per process


def test_fewer_ranks_than_cards_names_the_unused_cards(caplog):
    config = EngineConfig.from_kwargs(tensor_parallel_size=4, device="kunlun-emu")
    with caplog.at_level(logging.WARNING):
        check_parallel_config(config, UsageContext.OPENAI_API_SERVER)
    assert "cards 4, 5, 6, 7 stay unused" in caplog.text


def test_serve_refuses_more_ranks_than_the_node_has_cards(capsys):
    from pagedserve.entrypoints.cli.main import main

    assert main(["serve", "--tensor-parallel-size", "9"]) == 2
    assert "8 card(s) per node" in capsys.readouterr().err


# ---- sharding ---------------------------------------------------------------------------------
def test_a_size_that_would_cut_int4_groups_is_refused_with_the_reason(tmp_path):
    build_tiny_hf_model(tmp_path, "glm", intermediate_size=96)
    tp = TensorParallel(load_config(tmp_path), 0, 2)
    tp.check(None)  # dense: 48 columns of down_proj per rank are fine
    with pytest.raises(ValueError, match="cut the INT4 groups of down_proj: 96 .* = 48 .* 32"):
        tp.check(32)


def test_kv_heads_are_replicated_when_fewer_than_ranks(tmp_path):
    build_tiny_hf_model(tmp_path, "glm")  # 4 heads, 2 KV heads
    config = load_config(tmp_path)
    kv = [
        TensorParallel(config, r, 4).shard("model.layers.0.self_attn.k_proj.weight")
        for r in range(4)
    ]
    D = config.head_dim
    assert [s.ranges for s in kv] == [((0, D),), ((0, D),), ((D, 2 * D),), ((D, 2 * D),)]


def test_each_rank_reads_only_its_rows_and_columns(tmp_path):
    from pagedserve.models import load_state_dict

    build_tiny_hf_model(tmp_path, "glm")
    config = load_config(tmp_path)
    whole = load_state_dict(tmp_path, config)
    half = load_state_dict(tmp_path, config, tp=TensorParallel(config, 1, 2))
    p = "model.layers.0."
    assert torch.equal(half["model.embed_tokens.weight"], whole["model.embed_tokens.weight"][160:])
    assert torch.equal(
        half[p + "self_attn.q_proj.weight"], whole[p + "self_attn.q_proj.weight"][32:]
    )
    assert torch.equal(half[p + "self_attn.k_proj.bias"], whole[p + "self_attn.k_proj.bias"][16:])
    assert torch.equal(
        half[p + "self_attn.o_proj.weight"], whole[p + "self_attn.o_proj.weight"][:, 32:]
    )
    gate_up = whole[p + "mlp.gate_up_proj.weight"]  # [gate 96 | up 96] rows
    assert torch.equal(
        half[p + "mlp.gate_up_proj.weight"], torch.cat([gate_up[48:96], gate_up[144:]])
    )
    assert torch.equal(half[p + "mlp.down_proj.weight"], whole[p + "mlp.down_proj.weight"][:, 48:])
    assert torch.equal(half[p + "input_layernorm.weight"], whole[p + "input_layernorm.weight"])


def _collectives(rank: int, address: str, results) -> None:
    """One rank of the collectives test: the Device's all_reduce, all_gather and broadcast."""
    from pagedserve.config import ParallelConfig
    from pagedserve.engine.executor import init_distributed
    from pagedserve.hal import get_device

    init_distributed(ParallelConfig(tensor_parallel_size=2), rank, "gloo", address)
    device = get_device("kunlun-emu")
    device.join_group(rank, 2)
    summed = device.all_reduce(torch.full((4,), float(rank + 1))).tolist()
    gathered = device.all_gather(torch.full((2, 3), float(rank)), dim=-1).tolist()
    sent = torch.arange(5) if rank == 0 else torch.zeros(5, dtype=torch.long)
    broadcast = device.broadcast(sent, src=0).tolist()
    results.put((rank, summed, gathered, broadcast, device.collective_bytes_sent))
    torch.distributed.destroy_process_group()


def test_device_collectives_combine_the_ranks_and_count_the_bytes_sent():
    ctx = torch.multiprocessing.get_context("spawn")
    results = ctx.Queue()
    address = f"127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_collectives, args=(r, address, results)) for r in range(2)]
    for proc in procs:
        proc.start()
    got = dict((r[0], r[1:]) for r in (results.get(timeout=120) for _ in procs))
    for proc in procs:
        proc.join(30)
    for rank in range(2):
        summed, gathered, broadcast, sent = got[rank]
        assert summed == [3.0] * 4
        assert gathered == [[0.0] * 3 + [1.0] * 3] * 2
        assert broadcast == [0, 1, 2, 3, 4]
        # ring all-reduce: 2 (n-1)/n of 16 B; all-gather: 24 B to the other; broadcast: 40 B from 0
        assert sent == 16 + 24 + (40 if rank == 0 else 0)


@pytest.fixture(scope="module")
def tp_model_dirs(tmp_path_factory):
    """glm and glm4 with 128 intermediate columns (64 per rank: whole INT4 groups of 32)."""
    paths = {}
    for arch in ("glm", "glm4"):
        path = tmp_path_factory.mktemp(arch)
        build_tiny_hf_model(path, arch, intermediate_size=128)
        paths[arch] = path
    return paths


def _greedy(path, **kwargs) -> tuple[list[list[int]], LLM]:
    llm = LLM(model=str(path), dtype="float32", device="cpu", num_kv_pages=64, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.mark.parametrize(
    "arch, tp, kwargs",
    [
        ("glm", 2, {}),
        ("glm4", 2, {}),
        ("glm", 2, {"quantization": "int4"}),
        ("glm4", 4, {}),  # 2 KV heads over 4 ranks: each KV head on two ranks
    ],
)
def test_greedy_tokens_at_tensor_parallel_size_equal_one_card(tp_model_dirs, arch, tp, kwargs):
    reference, llm = _greedy(tp_model_dirs[arch], **kwargs)
    llm.llm_engine.shutdown()
    got, llm = _greedy(tp_model_dirs[arch], tensor_parallel_size=tp, **kwargs)
    try:
        assert got == reference
        cards = llm.llm_engine.get_device_stats()
        assert [c["tp_rank"] for c in cards] == list(range(tp))
        assert all(c["collective_bytes_sent"] > 0 for c in cards)
        assert llm.llm_engine.get_stats()["collective_bytes_sent_total"] > 0
    finally:
        llm.llm_engine.shutdown()


def test_an_autoawq_checkpoint_shards_and_keeps_tp_1_greedy_tokens(tp_model_dirs, tmp_path):
    import argparse

    from pagedserve.entrypoints.cli.quantize import add_quantize_args, run_quantize

    argv = ["--model-path", str(tp_model_dirs["glm"]), "--output-path", str(tmp_path / "awq")]
    argv += ["--format", "autoawq", "--calib-samples", "2", "--calib-seq-len", "16"]
    assert run_quantize(add_quantize_args(argparse.ArgumentParser()).parse_args(argv)) == 0
    reference, llm = _greedy(tmp_path / "awq")
    llm.llm_engine.shutdown()
    got, llm = _greedy(tmp_path / "awq", tensor_parallel_size=2)
    llm.llm_engine.shutdown()
    assert got == reference


def test_swapped_pages_move_on_every_rank_and_keep_tp_1_greedy_tokens(tp_model_dirs):
    """Every rank holds the same pages of its own KV heads, so each step's swaps run on each."""
    from tests.helpers.models import host_tier_gib

    path = tp_model_dirs["glm4"]
    prompts = [[(5 * i + k) % 300 + 10 for i in range(30)] for k in (1, 2)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = {}
    for tp in (1, 2):
        # 16 pages of 4 tokens: the two prompts (38 tokens, 10 pages each) cannot run together
        llm = LLM(
            model=str(path),
            dtype="float32",
            device="cpu",
            block_size=4,
            num_kv_pages=16,
            preemption_mode="swap",
            swap_space=host_tier_gib(path, 32, 4),  # per card: each holds half the KV heads
            tensor_parallel_size=tp,
        )
        try:
            got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            outs[tp] = [o.outputs[0].token_ids for o in got]
            assert llm.llm_engine.scheduler.num_swapped_preemptions > 0
            assert llm.llm_engine.check_invariants() == []
        finally:
            llm.llm_engine.shutdown()
    assert outs[2] == outs[1]


def test_bf16_logprobs_at_tp_2_stay_close_to_tp_1(tp_model_dirs):
    from tests.helpers.models import prompt_logprobs

    logprobs = []
    for tp in (1, 2):
        llm = LLM(
            model=str(tp_model_dirs["glm4"]),
            dtype="bfloat16",
            device="cpu",
            num_kv_pages=64,
            tensor_parallel_size=tp,
        )
        logprobs.append(prompt_logprobs(llm, PROMPTS[1]))
        llm.llm_engine.shutdown()
    diff = (logprobs[0] - logprobs[1]).abs()
    assert diff.mean() < 0.02 and diff.max() < 0.2, (diff.mean(), diff.max())


# ---- serving: a model larger than one card ---------------------------------------------------
SERVE_FLAGS = ["--dtype", "float32", "--served-model-name", "tiny", "--max-model-len", "256"]
SERVE_FLAGS += ["--num-kv-pages", "16"]


@pytest.fixture(scope="module")
def small_cards(tmp_path_factory, tiny_glm4):
    """A node of 2 emulated cards, each with room for about 3/4 of the tiny model's weights."""
    weights = sum(f.stat().st_size for f in tiny_glm4[0].glob("*.safetensors"))
    size = f"{int(weights * 0.75)}B"
    preset = tmp_path_factory.mktemp("presets") / "two-small-cards.yaml"
    preset.write_text(
        json.dumps(
            {
                "name": "two-small-cards",
                "backend": "kunlun-emu",
                "cards": 2,
                "memory_bytes": size,
                "tiers": {"kv": size, "weight": size, "host": "64MiB"},
            }
        )
    )
    return preset, weights


def test_a_model_larger_than_a_card_is_refused_at_tp_1_suggesting_tp_2(tiny_glm4, small_cards):
    flags = ["--model", str(tiny_glm4[0]), "--device", str(small_cards[0]), *SERVE_FLAGS]
    run = subprocess.run(
        [sys.executable, "-m", "pagedserve", "serve", *flags, "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2
    assert "do not fit on one card" in run.stderr and "--tensor-parallel-size 2" in run.stderr


def test_tp_2_serves_it_with_half_the_weights_on_each_card(tiny_glm4, small_cards, capsys):
    from pagedserve.entrypoints.cli.main import main

    preset, checkpoint = small_cards
    flags = ["--model", str(tiny_glm4[0]), "--device", str(preset), *SERVE_FLAGS, "--tp-size", "2"]
    with serve(*flags) as (_, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        done = client.completions.create(model="tiny", prompt="Hello", max_tokens=5)
        assert done.choices[0].text and done.usage.completion_tokens == 5
        assert main(["smi", "--url", url, "--json"]) == 0
        cards = json.loads(capsys.readouterr().out)
        assert [c["name"] for c in cards] == ["two-small-cards card 0", "two-small-cards card 1"]
        for card in cards:
            assert 0.45 < card["tiers"]["weight"]["used_bytes"] / checkpoint < 0.6
        assert main(["smi", "--url", url, "-d", "1", "--json"]) == 0
        assert [c["tp_rank"] for c in json.loads(capsys.readouterr().out)] == [1]
        metrics = httpx.get(url + "/metrics").text
        assert "pagedserve:collective_bytes_sent_total" in metrics


# ---- across machines --------------------------------------------------------------------------
def _completion(url: str, api_key: str = "none") -> str:
    client = openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0)
    body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}
    return client.completions.create(**body).choices[0].text


def test_two_machines_on_loopback_serve_what_one_card_serves(tiny_glm4, live_server, tmp_path):
    address = f"127.0.0.1:{free_port()}"
    common = ["--model", str(tiny_glm4[0]), "--device", "cpu", *SERVE_FLAGS]
    multi = ["--tp-size", "2", "--nnodes", "2", "--dist-init-addr", address]
    log = (tmp_path / "node1.log").open("w+")
    node1 = subprocess.Popen(
        [sys.executable, "-m", "pagedserve", "serve", *common, *multi, "--node-rank", "1"],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        with serve(*common, *multi, "--node-rank", "0") as (_, url):
            assert _completion(url) == _completion(live_server.url, live_server.api_key)
        assert node1.wait(30) == 0  # node 0 told its ranks to stop
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait(10)


def test_an_unreachable_rendezvous_times_out_naming_the_address(tiny_glm4):
    address = f"127.0.0.1:{free_port()}"  # nobody listens there
    flags = ["--model", str(tiny_glm4[0]), "--device", "cpu", "--tp-size", "2", "--nnodes", "2"]
    flags += ["--node-rank", "1", "--dist-init-addr", address, "--dist-timeout", "2"]
    start = time.monotonic()
    run = subprocess.run(
        [sys.executable, "-m", "pagedserve", "serve", *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2
    assert f"could not reach the rendezvous at {address} within 2 s" in run.stderr
    assert time.monotonic() - start < 60


# ---- failure ----------------------------------------------------------------------------------
def test_a_killed_worker_turns_health_503_and_fails_the_pending_request(tiny_glm4):
    flags = ["--model", str(tiny_glm4[0]), "--device", "cpu", "--dtype", "float32"]
    flags += ["--served-model-name", "tiny", "--tp-size", "2", "--num-kv-pages", "64"]
    with serve(*flags) as (_, url):
        worker = httpx.get(url + "/health").json()["tp_worker_pids"][0]
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 500, "ignore_eos": True}
        body["stream"] = True
        with (
            httpx.Client(timeout=60) as http,
            http.stream("POST", url + "/v1/completions", json=body) as stream,
        ):
            lines = stream.iter_lines()
            next(lines)  # the request is running
            os.kill(worker, signal.SIGKILL)
            killed_at = time.monotonic()
            statuses = set()
            while time.monotonic() - killed_at < 20 and 503 not in statuses:
                try:
                    statuses.add(httpx.get(url + "/health", timeout=2).status_code)
                except httpx.HTTPError:
                    break  # the server exits (non-zero) a moment after its engine died
                time.sleep(0.02)
            rest = [line for line in lines if line.startswith("data: {")]
        ended_after = time.monotonic() - killed_at
    assert 503 in statuses
    assert '"error"' in rest[-1] and "rank" in rest[-1]
    assert ended_after < 10
    assert sum(line.count('"text"') for line in rest) < 500
