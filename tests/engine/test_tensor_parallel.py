"""Tensor parallelism: a node's cards, Megatron sharding held to tp 1's greedy tokens, any
vocabulary (padded), a lifecycle (stop, start again, never a hang), a model larger than one card
served over two, two "machines" on loopback, and a dead rank failing cleanly.

Every test here runs under a timeout that fails it instead of hanging the suite, and every test
must leave no rank process and no process group behind (``no_rank_outlives_its_test``)."""

from __future__ import annotations

import gc
import json
import logging
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing

from pagedserve import LLM, SamplingParams
from pagedserve.config import EngineConfig, UsageContext
from pagedserve.engine.executor import START_METHOD_ENV, check_parallel_config, rank_context
from pagedserve.engine.memory_plan import weight_bytes
from pagedserve.hal import load_device_preset
from pagedserve.models import load_config, load_state_dict
from pagedserve.models.config import GlmConfig, pad_vocab_size
from pagedserve.models.tensor_parallel import Shard, TensorParallel
from pagedserve.sampling_params import StructuredOutputsParams
from pagedserve.testing import free_port, serve
from tests.helpers.models import build_tiny_hf_model, build_tiny_model_dir, tiny_hf_config
from tests.helpers.processes import alive, tagged_env, wait_until_gone

pytestmark = pytest.mark.timeout(300)

PROMPTS = [[11, 12, 13], [(5 * i) % 300 + 10 for i in range(29)], [99]]
MAX_TOKENS = 6
ODD_VOCAB = 611  # neither 2 nor 4 divides it
ODD_PROMPTS = [[11, 12, 13], [(5 * i) % 600 + 10 for i in range(29)], [ODD_VOCAB - 1], [99]]
SCRIPT_TIMEOUT_S = 120  # the scripts below run with this --dist-timeout, and must end within it


def _rank_processes() -> list[multiprocessing.process.BaseProcess]:
    return [p for p in multiprocessing.active_children() if p.name.startswith("pagedserve-tp")]


@pytest.fixture(autouse=True)
def no_rank_outlives_its_test():
    """After each test: no rank process of this process alive, no process group left."""
    yield
    ranks, group = _rank_processes(), dist.is_initialized()
    for proc in ranks:  # clean up for the next test, then fail this one
        proc.kill()
        proc.join(10)
    if group:
        dist.destroy_process_group()
    assert not ranks and not group, f"left behind: ranks {ranks}, a process group: {group}"


@pytest.fixture
def forked_ranks(monkeypatch):
    """The ranks of this process's engines fork from one forkserver that imported torch once
    (START_METHOD_ENV): a rank starts in a fraction of a second instead of the 4-5 s of a core
    that spawn's fresh interpreter takes on a 2-core Zen 3, and the file's in-process engines
    start about 20 ranks. The scripts and servers below keep the default, spawn."""
    monkeypatch.setenv(START_METHOD_ENV, "forkserver")


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


def _shapes(**overrides) -> GlmConfig:
    """The tiny GLM's config as pagedserve reads it (4 heads, 2 KV heads of 16, intermediate 96,
    vocabulary 320: tiny_hf_config's), with ``overrides`` in transformers' names."""
    return GlmConfig.from_dict(tiny_hf_config("glm", **overrides).to_dict())


def test_each_ranks_heads_kv_heads_and_vocabulary_are_its_share_of_the_models():
    config = _shapes(num_attention_heads=8, num_key_value_heads=4, vocab_size=611)
    for tp in (1, 2, 4, 8):
        ranks = [TensorParallel(config, r, tp) for r in range(tp)]
        assert {r.num_heads for r in ranks} == {8 // tp}
        assert {r.num_kv_heads for r in ranks} == {max(4 // tp, 1)}
        padded = pad_vocab_size(611, tp)
        assert {r.padded_vocab_size for r in ranks} == {padded}
        # the ranks' vocabulary rows tile the padded vocabulary, in rank order
        assert [r.vocab_range for r in ranks] == [
            (i * padded // tp, (i + 1) * padded // tp) for i in range(tp)
        ]


def test_a_size_that_cannot_split_the_model_is_refused_naming_each_reason():
    with pytest.raises(ValueError) as e:
        TensorParallel(_shapes(), 0, 3).check(None, flag="--tensor-parallel-size")
    assert str(e.value) == (
        "--tensor-parallel-size 3 cannot split this model: it does not divide the 4 attention "
        "heads; it and the 2 KV heads do not divide one another; use a size that splits it "
        "(1, 2, 4)"
    )
    with pytest.raises(ValueError, match=r"^--tp-size 8 cannot split this model: it does not "):
        TensorParallel(_shapes(num_attention_heads=8, intermediate_size=100), 0, 8).check(None)
    with pytest.raises(ValueError) as e:
        TensorParallel(_shapes(num_attention_heads=8, intermediate_size=100), 0, 8).check(16)
    assert "does not divide intermediate_size 100" in str(e.value)
    assert "INT4" not in str(e.value)  # the groups are checked only on a size that splits
    with pytest.raises(ValueError, match="cut the INT4 groups of o_proj: 64 .* = 32 .* 64"):
        TensorParallel(_shapes(intermediate_size=256), 0, 2).check(64)
    for tp in (1, 2, 4):  # replicated KV heads at 4: a size the KV heads divide
        TensorParallel(_shapes(), 0, tp).check(8)


def test_int4_groups_limit_a_split_only_of_layers_whose_input_they_divide():
    # down_proj's 200 inputs are no whole number of 32-groups: that layer stays 16-bit
    # (GlmForCausalLM._linear) and splits as one; o_proj's 64 split in 2 cut its 64-group
    odd = _shapes(intermediate_size=200)
    for tp in (1, 2):
        TensorParallel(odd, 0, tp).check(32)
    with pytest.raises(ValueError) as e:
        TensorParallel(_shapes(intermediate_size=256), 0, 2).check(
            64, flag="--tensor-parallel-size"
        )
    assert str(e.value) == (
        "--tensor-parallel-size 2 cannot split this model: it would cut the INT4 groups of "
        "o_proj: 64 input columns / 2 = 32 per rank, not a multiple of the group size 64; use a "
        "size that splits it (1)"
    )


def test_only_the_split_projections_and_the_vocabulary_are_sharded():
    tp = TensorParallel(_shapes(), 1, 2)
    whole = (
        "model.norm.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
        "model.layers.0.self_attn.q_proj.qweight",  # quantized: cut in canonical form
        "model.rotary.inv_freq",
    )
    assert [tp.shard(name) for name in whole] == [None] * len(whole)
    assert TensorParallel(_shapes(), 0, 1).shard("model.layers.0.self_attn.q_proj.weight") is None
    p = "model.layers.1."
    assert tp.shard(p + "self_attn.q_proj.bias") == Shard(0, 64, ((32, 64),))
    assert tp.shard(p + "self_attn.v_proj.weight") == Shard(0, 32, ((16, 32),))
    assert tp.shard(p + "self_attn.o_proj.weight") == Shard(1, 64, ((32, 64),))
    assert tp.shard(p + "mlp.gate_up_proj.weight") == Shard(0, 192, ((48, 96), (144, 192)))
    assert tp.shard(p + "mlp.down_proj.weight") == Shard(1, 96, ((48, 96),))
    assert tp.shard("lm_head.weight") == Shard(0, 320, ((160, 320),))


def test_a_tensor_that_is_already_a_ranks_shard_is_taken_as_it_is():
    tp = TensorParallel(_shapes(), 1, 2)
    name = "model.layers.0.self_attn.o_proj.weight"
    whole = torch.randn(64, 64)
    shard = tp.take(name, whole)
    assert torch.equal(shard, whole[:, 32:]) and shard.is_contiguous()
    assert tp.take(name, shard) is shard
    norm = torch.randn(64)
    assert tp.take("model.norm.weight", norm) is norm


@pytest.mark.parametrize("tp_size", [2, 4])
def test_an_int4_layer_cut_for_a_rank_dequantizes_to_that_ranks_cut_of_the_dense_layer(tp_size):
    from pagedserve.models.quant_formats import dequantize, quantize_rtn

    inter, group = (96 if tp_size == 2 else 64), 16
    config = _shapes(num_attention_heads=8, num_key_value_heads=4, intermediate_size=inter)
    torch.manual_seed(0)
    shapes = {  # (out_features, in_features) of the full layer
        "self_attn.q_proj": (128, 64),
        "self_attn.k_proj": (64, 64),
        "self_attn.o_proj": (64, 128),
        "mlp.gate_up_proj": (2 * inter, 64),
        "mlp.down_proj": (64, inter),
    }
    for part, (n, k) in shapes.items():
        prefix = f"model.layers.0.{part}"
        q, s, z = quantize_rtn(torch.randn(n, k), group)
        dense = dequantize(q, s, z, group)
        for rank in range(tp_size):
            tp = TensorParallel(config, rank, tp_size)
            cut = tp.take_int4(prefix, q, s, z, group)
            assert torch.equal(dequantize(*cut, group), tp.take(prefix + ".weight", dense)), part
    one = TensorParallel(config, 0, 1).take_int4("model.layers.0.mlp.down_proj", q, s, z, group)
    assert all(a is b for a, b in zip(one, (q, s, z), strict=True))
    if tp_size == 2:  # 48 input columns of down_proj a rank: a group of 32 would be cut
        q, s, z = quantize_rtn(torch.randn(64, inter), 32)
        with pytest.raises(AssertionError, match="cuts an INT4 group"):
            TensorParallel(config, 1, 2).take_int4("model.layers.0.mlp.down_proj", q, s, z, 32)


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


@pytest.mark.usefixtures("forked_ranks")
def test_device_collectives_combine_the_ranks_and_count_the_bytes_sent():
    ctx, _ = rank_context()  # forkserver: the forked_ranks fixture's, for the same reason
    results = ctx.Queue()
    address = f"127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_collectives, args=(r, address, results)) for r in range(2)]
    for proc in procs:
        proc.start()
    try:
        got = dict((r[0], r[1:]) for r in (results.get(timeout=120) for _ in procs))
    finally:
        for proc in procs:
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join(10)
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


def _llm(path, **kwargs) -> LLM:
    return LLM(
        **{"model": str(path), "dtype": "float32", "device": "cpu", "num_kv_pages": 64, **kwargs}
    )


def _greedy_tokens(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _greedy(path, **kwargs) -> list[list[int]]:
    with _llm(path, **kwargs) as llm:
        return _greedy_tokens(llm)


@pytest.mark.parametrize(
    "arch, tp, kwargs",
    [
        ("glm", 2, {}),
        ("glm4", 2, {}),
        ("glm", 2, {"quantization": "int4"}),
        ("glm4", 4, {}),  # 2 KV heads over 4 ranks: each KV head on two ranks
    ],
)
@pytest.mark.usefixtures("forked_ranks")
def test_greedy_tokens_at_tensor_parallel_size_equal_one_card(tp_model_dirs, arch, tp, kwargs):
    reference = _greedy(tp_model_dirs[arch], **kwargs)
    with _llm(tp_model_dirs[arch], tensor_parallel_size=tp, **kwargs) as llm:
        assert _greedy_tokens(llm) == reference
        cards = llm.llm_engine.get_device_stats()
        assert [c["tp_rank"] for c in cards] == list(range(tp))
        assert all(c["collective_bytes_sent"] > 0 for c in cards)
        assert llm.llm_engine.get_stats()["collective_bytes_sent_total"] > 0


@pytest.mark.usefixtures("forked_ranks")
def test_an_autoawq_checkpoint_shards_and_keeps_tp_1_greedy_tokens(tp_model_dirs, tmp_path):
    import argparse

    from pagedserve.entrypoints.cli.quantize import add_quantize_args, run_quantize

    argv = ["--model-path", str(tp_model_dirs["glm"]), "--output-path", str(tmp_path / "awq")]
    argv += ["--format", "autoawq", "--calib-samples", "2", "--calib-seq-len", "16"]
    assert run_quantize(add_quantize_args(argparse.ArgumentParser()).parse_args(argv)) == 0
    assert _greedy(tmp_path / "awq", tensor_parallel_size=2) == _greedy(tmp_path / "awq")


@pytest.mark.usefixtures("forked_ranks")
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


@pytest.mark.usefixtures("forked_ranks")
def test_bf16_logprobs_at_tp_2_stay_close_to_tp_1(tp_model_dirs):
    from tests.helpers.models import prompt_logprobs

    logprobs = []
    for tp in (1, 2):
        with LLM(
            model=str(tp_model_dirs["glm4"]),
            dtype="bfloat16",
            device="cpu",
            num_kv_pages=64,
            tensor_parallel_size=tp,
        ) as llm:
            logprobs.append(prompt_logprobs(llm, PROMPTS[1]))
    diff = (logprobs[0] - logprobs[1]).abs()
    assert diff.mean() < 0.02 and diff.max() < 0.2, (diff.mean(), diff.max())


# ---- any vocabulary: padded as vLLM pads it, never seen past compute_logits -------------------
def test_the_vocabulary_is_padded_to_a_multiple_of_64_then_of_the_size():
    assert pad_vocab_size(ODD_VOCAB, 1) == ODD_VOCAB  # one rank: nothing to split
    assert [pad_vocab_size(ODD_VOCAB, tp) for tp in (2, 4, 8)] == [640, 640, 640]
    assert pad_vocab_size(ODD_VOCAB, 3) == 642  # 640 rows do not split in 3: where vLLM refuses
    assert pad_vocab_size(320, 2) == 320 and pad_vocab_size(151552, 8) == 151552  # GLM-4's


@pytest.fixture(scope="module")
def odd_vocab_dir(tmp_path_factory):
    """GLM-4-0414 with a vocabulary of 611 and a tokenizer (of 300 of them); heads of 32 so that
    o_proj's 128 input columns split into whole INT4 groups of 32 even at tp 4."""
    path = tmp_path_factory.mktemp("odd-vocab")
    build_tiny_model_dir(path, "glm4", vocab_size=ODD_VOCAB, head_dim=32, intermediate_size=128)
    return path


def test_each_rank_keeps_its_rows_of_an_odd_vocabulary_and_zeros_past_its_end(odd_vocab_dir):
    config = load_config(odd_vocab_dir)
    whole = load_state_dict(odd_vocab_dir, config)
    for tp in (2, 4):
        TensorParallel(config, 0, tp).check(32)  # not refused
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            read = [
                load_state_dict(odd_vocab_dir, config, tp=TensorParallel(config, r, tp))[name]
                for r in range(tp)
            ]
            cut = [TensorParallel(config, r, tp).take(name, whole[name]) for r in range(tp)]
            for parts in (read, cut):  # read from the file, or cut from a whole tensor
                assert [p.shape[0] for p in parts] == [640 // tp] * tp
                rows = torch.cat(parts)
                assert torch.equal(rows[:ODD_VOCAB], whole[name])
                assert not rows[ODD_VOCAB:].any()


@pytest.fixture(scope="module")
def odd_vocab_one_card(odd_vocab_dir):
    """tp 1's greedy outputs (with logprobs) of the odd vocabulary, by quantization."""
    return {}


DENSE_AND_INT4 = {"dense": {}, "int4": {"quantization": "int4", "quantize_lm_head": "int4"}}
# fp32 dense: only the all-reduce's summation order differs. INT4: the W4A16 kernel rounds its
# activations to bf16, so a last-bit fp32 difference (that order, or tp 1's fused decoder layer
# against tp > 1's layer by layer) can flip a bf16 rounding: 3.6e-4 seen on Zen 4, none on Intel.
# Both stay far below the 0.046 that the padding would cost.
LOGPROB_TOLERANCE = {"dense": 1e-4, "int4": 2e-3}


def _greedy_outputs(path, **kwargs):
    """(the odd prompts' greedy outputs with logprobs, each card's bytes of weights)."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3)
    with _llm(path, **kwargs) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in ODD_PROMPTS], params, use_tqdm=False)
        cards = llm.llm_engine.get_device_stats()
    cards = cards if isinstance(cards, list) else [cards]  # tp 1: one record
    weights = [c["tiers"]["weight"]["used_bytes"] for c in cards]
    return [o.outputs[0] for o in outs], weights


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("quant", DENSE_AND_INT4)
@pytest.mark.usefixtures("forked_ranks")
def test_an_odd_vocabulary_gives_one_cards_greedy_tokens_and_logprobs(
    odd_vocab_dir, odd_vocab_one_card, quant, tp
):
    kwargs = DENSE_AND_INT4[quant]  # int4: the decoder's linears and lm_head (its padding too)
    if quant not in odd_vocab_one_card:
        odd_vocab_one_card[quant] = _greedy_outputs(odd_vocab_dir, **kwargs)[0]
    reference = odd_vocab_one_card[quant]
    got, weights = _greedy_outputs(odd_vocab_dir, tensor_parallel_size=tp, **kwargs)
    assert [o.token_ids for o in got] == [o.token_ids for o in reference]
    if quant == "dense":  # what tune plans for each card: the padded vocabulary's share
        planned = weight_bytes(load_config(odd_vocab_dir), tp, "none", 32, dtype_bytes=4)
        assert weights == [sum(planned)] * tp
    for out, ref in zip(got, reference):
        for logprobs, ref_logprobs in zip(out.logprobs, ref.logprobs):
            # 29 padding logits in the softmax would move every logprob by log(640/611) = 0.046
            assert logprobs.keys() == ref_logprobs.keys()
            assert logprobs == pytest.approx(ref_logprobs, abs=LOGPROB_TOLERANCE[quant])


@pytest.mark.usefixtures("forked_ranks")
def test_sampling_and_grammars_at_tp_2_never_see_the_padding(odd_vocab_dir):
    """Seeded sampling over the whole distribution (the padding's zero logits would hold about 4%
    of it) and a grammar's mask give what one card gives, and no id past the vocabulary."""
    sampled = SamplingParams(temperature=1.0, seed=7, max_tokens=16, ignore_eos=True, logprobs=5)
    choices = ["Paris", "London", "New York"]
    choice = StructuredOutputsParams(choice=choices)
    constrained = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=choice)
    runs = []
    for tp in (1, 2):
        with _llm(odd_vocab_dir, tensor_parallel_size=tp) as llm:
            prompts = [{"prompt_token_ids": p} for p in ODD_PROMPTS]
            outs = [o.outputs[0] for o in llm.generate(prompts, sampled, use_tqdm=False)]
            answer = llm.generate("The city is", constrained, use_tqdm=False)[0].outputs[0]
        runs.append(([o.token_ids for o in outs], [o.logprobs for o in outs], answer.text))
    (tokens, logprobs, answer), (ref_tokens, ref_logprobs, ref_answer) = runs[1], runs[0]
    assert tokens == ref_tokens and answer == ref_answer and answer in choices
    ids = [t for seq in tokens for t in seq] + [t for seq in logprobs for lp in seq for t in lp]
    assert max(ids) < ODD_VOCAB
    for seq, ref_seq in zip(logprobs, ref_logprobs):
        for lp, ref_lp in zip(seq, ref_seq):
            assert lp == pytest.approx(ref_lp, abs=1e-4)


# ---- a lifecycle: shut down, start again, in one process --------------------------------------
def _answer(llm: LLM) -> list[int]:
    return _greedy_tokens(llm, PROMPTS[:1])[0]


@pytest.mark.usefixtures("forked_ranks")
def test_sequential_engines_of_tp_2_4_and_1_in_one_process_each_shut_down_all_answer(
    odd_vocab_dir,
):
    answers = []
    with _llm(odd_vocab_dir, tensor_parallel_size=2) as llm:  # the end of a with block
        with pytest.raises(RuntimeError, match="one tensor-parallel engine per process"):
            _llm(odd_vocab_dir, tensor_parallel_size=2)  # refused before it starts a rank
        answers.append(_answer(llm))
        pids = llm.llm_engine.executor.worker_pids
        assert len(_rank_processes()) == 1
    assert not any(map(alive, pids)) and not dist.is_initialized()
    llm = _llm(odd_vocab_dir, tensor_parallel_size=4)  # shutdown()
    answers.append(_answer(llm))
    pids = llm.llm_engine.executor.worker_pids
    llm.shutdown()
    llm.shutdown()  # idempotent
    assert len(pids) == 3 and not any(map(alive, pids)) and not dist.is_initialized()
    with pytest.raises(RuntimeError, match="has been shut down"):
        _answer(llm)
    with _llm(odd_vocab_dir) as llm:
        answers.append(_answer(llm))
    llm = _llm(odd_vocab_dir, tensor_parallel_size=2)  # del, then the garbage collector
    answers.append(_answer(llm))
    pids = llm.llm_engine.executor.worker_pids
    del llm
    gc.collect()
    assert not any(map(alive, pids)) and not dist.is_initialized()
    assert answers == answers[:1] * 4


def test_a_forked_rank_runs_in_the_environment_its_engine_started_in(
    odd_vocab_dir, forked_ranks, monkeypatch
):
    """The forkserver keeps the environment it started in; a rank forked from it takes on that
    of its engine, as a spawned one does: here a CPU without AVX2 (PAGEDSERVE_CPU_FLAGS), set
    after the forkserver began. Rank 0 chose its kernels once for this process."""
    with _llm(odd_vocab_dir, tensor_parallel_size=2) as llm:  # starts the forkserver, if not yet
        if llm.llm_engine.get_device_stats()[1]["kernels"] in ("portable", "eager"):
            pytest.skip("this CPU runs the portable kernels anyway")
    monkeypatch.setenv("PAGEDSERVE_CPU_FLAGS", "fpu sse2")
    with _llm(odd_vocab_dir, tensor_parallel_size=2) as llm:
        assert llm.llm_engine.get_device_stats()[1]["kernels"] in ("portable", "eager")
        assert _answer(llm)


def test_an_unknown_start_method_is_refused_naming_the_variable(odd_vocab_dir, monkeypatch):
    monkeypatch.setenv(START_METHOD_ENV, "fork")
    with pytest.raises(ValueError, match=f"{START_METHOD_ENV}='fork': choose one of spawn, fork"):
        _llm(odd_vocab_dir, tensor_parallel_size=2)
    assert not _rank_processes() and not dist.is_initialized()


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"tensor_parallel_size": 3}, "cannot split this model"),  # before the ranks start
        ({"num_kv_pages": None, "gpu_memory_utilization": 1e-9}, "no room for KV pages"),  # loaded
    ],
    ids=["refused-before-the-ranks", "after-loading"],
)
@pytest.mark.usefixtures("forked_ranks")
def test_a_start_that_fails_part_way_leaves_nothing_and_the_next_one_starts(
    odd_vocab_dir, kwargs, error
):
    with pytest.raises(ValueError, match=error):
        _llm(odd_vocab_dir, **{"tensor_parallel_size": 2, **kwargs})
    assert not _rank_processes() and not dist.is_initialized()
    with _llm(odd_vocab_dir, tensor_parallel_size=2) as llm:
        assert _answer(llm)


def test_a_size_that_cannot_split_the_model_is_refused_before_any_rank_starts(
    odd_vocab_dir, monkeypatch
):
    """Issue 50: ``--tensor-parallel-size 3`` on the demo model was refused only by the ranks,
    after about 10 s of starting them."""
    from pagedserve.engine import llm_engine

    def no_ranks(*args, **kwargs):
        raise AssertionError("the ranks were started")

    monkeypatch.setattr(llm_engine, "create_executor", no_ranks)
    with pytest.raises(ValueError, match="^tensor_parallel_size 3 cannot split this model"):
        _llm(odd_vocab_dir, tensor_parallel_size=3)


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


# ---- no hangs: a program with a tensor-parallel engine always ends -----------------------------
ENGINE_SCRIPT = """
import os, signal, sys
from pagedserve import LLM, SamplingParams

def main(model, how):
    llm = LLM(model=model, tensor_parallel_size=2, device="cpu", dtype="float32", num_kv_pages=16,
              dist_timeout={timeout})
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    print("answer", llm.generate({{"prompt_token_ids": [11, 12]}}, params, use_tqdm=False)[0]
          .outputs[0].token_ids, flush=True)
    if how == "kill-a-rank":  # the next step fails; the script ends on that exception
        os.kill(llm.llm_engine.executor.worker_pids[0], signal.SIGKILL)
        llm.generate({{"prompt_token_ids": [11, 12]}}, params, use_tqdm=False)
    if how == "killed":  # no time to stop anything: the ranks must notice on their own
        os.kill(os.getpid(), signal.SIGKILL)
    # "left-running": the script ends with the engine never shut down
"""


def _run_script(
    path, *args: str, stdin: str | None = None
) -> tuple[subprocess.CompletedProcess, list[int]]:
    """Run a Python program in a child process; (its result, the processes it left behind)."""
    env, tag = tagged_env()
    run = subprocess.run(
        [sys.executable, str(path), *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=env,
        timeout=SCRIPT_TIMEOUT_S,  # its --dist-timeout: a start that hung would end here
    )
    return run, wait_until_gone(tag)


@pytest.mark.parametrize(
    "how, returncode",
    [("left-running", 0), ("kill-a-rank", 1), ("killed", -signal.SIGKILL)],
)
def test_an_engine_never_shut_down_does_not_block_the_programs_end(
    odd_vocab_dir, tmp_path, how, returncode
):
    script = tmp_path / "engine.py"
    body = ENGINE_SCRIPT.format(timeout=SCRIPT_TIMEOUT_S)
    script.write_text(body + '\nif __name__ == "__main__":\n    main(*sys.argv[1:])\n')
    run, left = _run_script(script, str(odd_vocab_dir), how)
    assert run.returncode == returncode, run.stderr
    assert "answer [" in run.stdout
    if how == "kill-a-rank":
        assert "a tensor-parallel rank failed during a step" in run.stderr
    assert left == [], f"processes outlived the program: {left}"


UNGUARDED = """
from pagedserve import LLM
LLM(model={model!r}, tensor_parallel_size=2, device="cpu", dist_timeout={timeout})
print("started")
"""


def test_a_script_from_standard_input_ends_with_a_clear_error(odd_vocab_dir):
    script = UNGUARDED.format(model=str(odd_vocab_dir), timeout=SCRIPT_TIMEOUT_S)
    run, left = _run_script("-", stdin=script)
    assert run.returncode == 1 and "started" not in run.stdout
    assert "main module is '<stdin>', which a rank's process cannot read again" in run.stderr
    assert "from a script file" in run.stderr and 'if __name__ == "__main__":' in run.stderr
    assert left == []


def test_a_script_whose_ranks_crash_re_importing_it_ends_with_a_clear_error(
    odd_vocab_dir, tmp_path
):
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED.format(model=str(odd_vocab_dir), timeout=SCRIPT_TIMEOUT_S))
    run, left = _run_script(script)
    assert run.returncode == 1 and "started" not in run.stdout
    # the rank's own traceback, then the parent's error with the fix
    assert "RuntimeError: this is a tensor-parallel rank's process re-importing" in run.stderr
    assert re.search(r"rank 1 \(pid \d+\) exited with code 1 before it ran", run.stderr)
    assert 'put the code that builds LLM(...) under `if __name__ == "__main__":`' in run.stderr
    assert left == []


WAITS_WHEN_IMPORTED = """
import time
from pagedserve import LLM

if __name__ != "__main__":  # a rank's re-import: it waits, as a server started at import would
    time.sleep(3600)
LLM(model={model!r}, tensor_parallel_size=2, device="cpu", dist_timeout={timeout})
print("started")
"""


def test_a_script_whose_ranks_wait_re_importing_it_ends_at_dist_timeout_with_the_fix(
    odd_vocab_dir, tmp_path
):
    script = tmp_path / "waits.py"
    script.write_text(WAITS_WHEN_IMPORTED.format(model=str(odd_vocab_dir), timeout=4))
    start = time.monotonic()
    run, left = _run_script(script)
    assert run.returncode == 1 and "started" not in run.stdout
    assert time.monotonic() - start >= 4  # it waited its dist_timeout, then gave up
    assert re.search(
        r"rank 1 \(pid \d+\) never ran within 4 s \(dist_timeout\): its process", run.stderr
    )
    assert "still re-importing the program's main module" in run.stderr
    assert 'under `if __name__ == "__main__":`' in run.stderr
    assert left == []  # the waiting rank was killed
