"""`pagedserve tune`'s plan is what `pagedserve serve` then starts with: a server started with the
flags tune prints reports tune's KV pages, concurrency and per-card weights."""

from __future__ import annotations

import re

import httpx
import pytest

from pagedserve.engine.memory_plan import serve_args, tune
from pagedserve.testing import serve
from tests.helpers.models import build_tiny_model_dir

# GLM-4-9B-chat's architecture (glm: qkv bias, two norms a layer, untied lm_head), its 2 KV heads
# and head_dim 128, at a size this machine serves in seconds; every INT4 group boundary holds at
# tensor-parallel size 2
NINE_B_SHAPED = dict(
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=128,
    attention_bias=True,
    tie_word_embeddings=False,
)

# two cards whose one HBM the weights and the KV cache share: at 0.5 the budget, not the KV
# tier, sets the pool
SHARED_HBM_NODE = """\
name: test-shared-hbm
backend: kunlun-emu
cards: 2
memory_bytes: 64MiB
tiers:
  kv: 64MiB
  weight: 64MiB
  host: 64MiB
kv_memory_attr: cached
"""


def served(flags: list[str], log_path) -> dict:
    """What `pagedserve serve FLAGS` reports: pages and per-card weights (/device), its
    --max-num-seqs (/server_info), its served name (/v1/models) and the concurrency its
    start-up log states."""
    with open(log_path, "w") as log, serve(*flags, log=log, log_level="info") as (_, url):
        device = httpx.get(url + "/device", timeout=30).json()
        info = httpx.get(url + "/server_info", timeout=30).json()
        models = httpx.get(url + "/v1/models", timeout=30).json()
    cards = device if isinstance(device, list) else [device]
    logged = re.findall(r"max concurrency at max_model_len ([\d.]+)x", log_path.read_text())
    assert len(logged) == 1, log_path.read_text()[-3000:]  # the start-up line, once, not twice
    return {
        "pages": {card["kv_pages"]["total"] for card in cards},
        "weights": [card["tiers"]["weight"]["used_bytes"] for card in cards],
        "max_num_seqs": info["max_running_requests"],
        "concurrency": float(logged[0]),
        "model": [m["id"] for m in models["data"]],
    }


def assert_serve_runs_the_plan(plan, log_path) -> None:
    got = served(serve_args(plan), log_path)
    assert got["pages"] == {plan.num_kv_pages}
    assert got["weights"] == [plan.weight_bytes] * plan.tensor_parallel_size
    assert got["max_num_seqs"] == plan.max_num_seqs
    assert got["concurrency"] == pytest.approx(plan.max_concurrency, abs=0.005)
    assert got["model"] == [plan.served_model_name]


# one card whose KV tier caps the pool: 64 MiB, so that half this machine's free RAM (the bound of
# an emulated pool) never decides, however busy the machine (kunlun-emu's 2 GiB tier would need
# 4 GiB free; test_tune.py plans kunlun-emu's own pool with the host bound lifted)
SMALL_KV_TIER_NODE = """\
name: test-small-kv-tier
backend: kunlun-emu
cards: 1
memory_bytes: 1GiB
tiers:
  kv: 64MiB
  weight: 512MiB
  host: 512MiB
kv_memory_attr: cached
"""


def test_serve_with_tunes_flags_for_the_demo_model_has_tunes_pages(tmp_path):
    device = tmp_path / "test-small-kv-tier.yaml"
    device.write_text(SMALL_KV_TIER_NODE)
    plan = tune("demo", str(device))
    assert plan.kv_pool_bound == "kv tier"
    assert plan.num_kv_pages == 64 * 2**20 // (16 * plan.kv_bytes_per_token)
    assert_serve_runs_the_plan(plan, tmp_path / "serve.log")


def test_serve_with_tunes_flags_for_a_9b_shaped_model_on_two_cards(tmp_path):
    model_dir = tmp_path / "glm-4-9b-shaped"
    build_tiny_model_dir(model_dir, "glm", **NINE_B_SHAPED)
    device = tmp_path / "test-shared-hbm.yaml"
    device.write_text(SHARED_HBM_NODE)
    plan = tune(
        str(model_dir),
        str(device),
        tensor_parallel_size=2,
        max_model_len=512,
        gpu_memory_utilization=0.5,
        quantization="none",
    )
    assert plan.kv_pool_bound == "memory budget"
    assert plan.max_num_seqs < plan.max_num_batched_tokens  # the pages, not a cap, set it
    assert_serve_runs_the_plan(plan, tmp_path / "serve.log")
