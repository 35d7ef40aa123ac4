"""Models whose sizes are not multiples of 16 (pruned, distilled and merged GLM-4 variants) run on
every kernel set this CPU executes: greedy tokens in float32 equal transformers', with a roomy KV
pool and under forced preemption; with ``--quantization int4`` every request runs to its length,
the layers the group size cannot split staying 16-bit. What falls back is said once, when the
model loads, and shown by the device's statistics (``smi``, ``/device``)."""

from __future__ import annotations

import logging

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.entrypoints.cli.smi import format_detail, format_summary
from tests.helpers.kernels import KERNEL_SETS
from tests.helpers.models import build_tiny_model_dir, hf_greedy

MAX_TOKENS = 8
PROMPTS = [
    [11, 12, 13],
    [(5 * i) % 300 + 10 for i in range(29)],
    [99],
    [(3 * i + 1) % 300 + 10 for i in range(45)],
    [(7 * i + 2) % 300 + 10 for i in range(33)],
    [(11 * i + 5) % 300 + 10 for i in range(21)],
]
# GLM-4 with an odd hidden size and an intermediate size 32 does not divide; GLM-4-0414 with
# head_dim 160 (past the 128 of the real models), a GQA ratio of 4 and an odd vocabulary
SHAPES = {
    "glm": dict(hidden_size=72, intermediate_size=200, head_dim=80, num_attention_heads=4),
    "glm4": dict(
        hidden_size=100,
        intermediate_size=136,
        head_dim=160,
        num_attention_heads=4,
        num_key_value_heads=1,
        vocab_size=333,
    ),
}
# the six need 46 pages of 4 to run at once: 16 hold the longest (14) and force a preemption
POOLS = {"roomy": dict(num_kv_pages=256), "preempted": dict(num_kv_pages=16)}


@pytest.fixture(scope="module", params=list(SHAPES))
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = build_tiny_model_dir(path, request.param, **SHAPES[request.param])
    refs = [hf_greedy(hf, prompt, MAX_TOKENS) for prompt in PROMPTS]
    return path, refs, SHAPES[request.param]


def _generate(path, **kwargs) -> tuple[LLM, list]:
    llm = LLM(model=str(path), block_size=4, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return llm, [o.outputs[0] for o in outs]


def _assert_drained(llm: LLM, pool: str) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_pages == engine.num_kv_pages
    assert engine.check_invariants() == []
    assert (engine.scheduler.num_preemptions > 0) == (pool == "preempted")


@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.parametrize("kernels", KERNEL_SETS)
def test_greedy_tokens_of_odd_shapes_equal_transformers(model, kernels, pool):
    path, refs, _ = model
    llm, outs = _generate(path, dtype="float32", kernels=kernels, **POOLS[pool])
    assert [o.token_ids for o in outs] == refs
    _assert_drained(llm, pool)


@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.parametrize("kernels", KERNEL_SETS)
def test_int4_odd_shapes_load_and_every_request_runs_to_its_length(model, kernels, pool, caplog):
    path, _, shapes = model
    with caplog.at_level(logging.WARNING):
        llm, outs = _generate(path, dtype="bfloat16", kernels=kernels, quantization="int4",
                              **POOLS[pool])  # fmt: skip
    assert [(len(o.token_ids), o.finish_reason) for o in outs] == [(MAX_TOKENS, "length")] * len(
        PROMPTS
    )
    _assert_drained(llm, pool)
    kept = [r.getMessage() for r in caplog.records if "kept in 16-bit" in r.getMessage()]
    inter = shapes["intermediate_size"]
    assert kept[-1] == (
        f"model.layers.*.mlp.down_proj: in_features {inter} is not a multiple of the INT4 group "
        "size 32; kept in 16-bit"
    )
    assert len(kept) == len(set(kept))  # each kind of layer said once, not once per layer


@pytest.mark.parametrize("kernels", [p for p in KERNEL_SETS if p != "eager"])
def test_an_op_that_falls_back_is_named_once_at_load_and_in_smi(tmp_path, kernels, caplog):
    # head_dim 72: no decode-attention kernel is compiled for it
    build_tiny_model_dir(tmp_path, "glm4", head_dim=72)
    with caplog.at_level(logging.WARNING):
        llm = LLM(model=str(tmp_path), dtype="float32", kernels=kernels, num_kv_pages=64)
        loaded = [r.getMessage() for r in caplog.records]
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    said = [m for m in loaded if m.startswith("paged_attention_decode: head_dim 72")]
    assert said == [
        "paged_attention_decode: head_dim 72 is not one the kernel is compiled for (16, 32, 48, "
        "64, 80, 96, 112, 128, 160, 192, 256); using the PyTorch reference"
    ]
    # said when the model loaded, and not again by the requests
    assert [r.getMessage() for r in caplog.records].count(said[0]) == 1
    stats = llm.llm_engine.get_device_stats()
    ops = stats["native_ops"]
    assert ops["paged_attention_decode"].startswith("head_dim 72 is not one")
    assert ops["rms_norm"] == ops["silu_and_mul"] == "native"
    assert ops["fused_decoder_layer"] == (
        "paged_attention_decode not native; its ops one at a time"
    )
    assert "ops native but fused_decoder_layer, paged_attention_decode" in format_summary([stats])
    detail = format_detail(stats, 0).splitlines()
    (line,) = [line for line in detail if line.strip().startswith("paged_attention_decode ")]
    assert line.split(":", 1)[1].strip() == ops["paged_attention_decode"]
