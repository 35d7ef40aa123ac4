"""The memory plan of a toy model on toy devices, every figure summed by hand: the weights, the KV
pool and its bound, the batch limits, the explanation and the launch script, word for word; and
each setting it refuses, with its reason and the way out."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from pagedserve.engine import memory_plan as plan_mod
from pagedserve.engine.memory_plan import (
    TuneError,
    check_tensor_parallel,
    explain,
    load_device,
    load_model,
    tune,
    weight_bytes,
)
from pagedserve.models.config import GlmConfig

# The toy: 2 layers, hidden 128, 4 heads of 32, 2 kv heads, intermediate 256, vocab 1000.
TOY = {
    "architecture": "glm4",
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "partial_rotary_factor": 0.5,
    "intermediate_size": 256,
    "vocab_size": 1000,
    "max_position_embeddings": 1024,
    "attention_bias": True,
    "tie_word_embeddings": False,
}
# int4 at group 32 (0.5 B a weight, 2 x 2 B a group of 32 inputs per output), tp 1:
# q 128x128: 8192 + 4 x 128 x 4 = 10240; k, v 128x64: 4096 + 4 x 64 x 4 = 5120 each;
# o 10240; gate_up 128x512: 32768 + 4 x 512 x 4 = 40960; down 256x128: 16384 + 8 x 128 x 4 = 20480
TOY_LINEAR_INT4 = 2 * (10240 + 5120 + 5120 + 10240 + 40960 + 20480)  # 184320
# embed_tokens and lm_head 2 x 1000 x 128, the final norm 128, per layer 4 norms of 128 and the
# q, k, v biases 128 + 64 + 64: 257664 parameters of 2 bytes
TOY_16BIT = 2 * (2 * 1000 * 128 + 128 + 2 * (4 * 128 + 256))  # 515328
TOY_WEIGHTS = TOY_16BIT + TOY_LINEAR_INT4  # 699648 (683.25 KiB)
# tp 2, int4: 357120 bytes a rank; tp 4: 184960 (see the test of the split)
TOY_TP2, TOY_TP4 = 357120, 184960


@pytest.fixture(autouse=True)
def roomy_host(monkeypatch):
    """An emulated pool is bounded by its device alone, unless a test passes ``host_limit``."""
    monkeypatch.setattr(plan_mod, "host_memory_limit", lambda: float("inf"))


def _toy_preset(tmp_path: Path, **fields) -> str:
    """A model preset file with no name: the plan names the model by the file, ``toy``."""
    path = tmp_path / "toy.yaml"
    path.write_text(yaml.safe_dump({**TOY, **fields}))
    return str(path)


def _device(tmp_path: Path, memory: int, weight: int | None = None, cards=4, **extra) -> str:
    """A card whose kv and weight tiers share ``memory`` bytes of HBM (``memory`` 0: separate
    tiers, ``extra`` gives them), in a directory whose name needs quoting in a shell."""
    folder = tmp_path / "my presets"
    folder.mkdir(exist_ok=True)
    tiers = {"kv": memory, "weight": memory if weight is None else weight, "host": 0}
    preset = {
        "name": "toycard",
        "backend": "cuda",
        "cards": cards,
        "memory_bytes": memory,
        "tiers": {**tiers, **extra},
        "kv_memory_attr": "cached",
    }
    path = folder / "toycard.yaml"
    path.write_text(yaml.safe_dump(preset))
    return str(path)


def _config(**fields) -> GlmConfig:
    """The toy's shapes, as the plan reads a preset, with ``fields`` changed."""
    return GlmConfig.from_dict({**TOY, **fields, "model_type": "glm4"})


def test_the_toys_weights_are_summed_by_hand_per_kind_of_parameter():
    toy = _config()
    assert weight_bytes(toy, 1, "int4", 32) == (TOY_16BIT, TOY_LINEAR_INT4) == (515328, 184320)
    # unquantized: 2 bytes a weight by default, 4 in fp32 (every 16-bit parameter too)
    linear = 2 * (128 * 128 + 2 * 128 * 64 + 128 * 128 + 128 * 512 + 256 * 128)  # weights
    assert weight_bytes(toy, 1, "none", 32) == (TOY_16BIT, 2 * linear)
    assert weight_bytes(toy, 1, "none", 32, 4) == (2 * TOY_16BIT, 4 * linear)
    # tp 2: the vocabulary padded to 1024, 512 rows a rank; q/o, the MLP and the kv heads split
    assert weight_bytes(toy, 2, "int4", 32) == (2 * (2 * 512 * 128 + 128 + 2 * (512 + 128)), 92160)
    # tied embeddings are counted once; no qkv bias, no bias bytes; GLM-4-9B's "glm" layers have
    # 2 norms, not the 4 of GLM-4-0414's
    tied = dataclasses.replace(toy, tie_word_embeddings=True)
    assert weight_bytes(tied, 1, "int4", 32)[0] == TOY_16BIT - 2 * 1000 * 128
    unbiased = dataclasses.replace(toy, attention_bias=False)
    assert weight_bytes(unbiased, 1, "int4", 32)[0] == TOY_16BIT - 2 * 2 * 256
    glm = dataclasses.replace(toy, architecture="glm")
    assert weight_bytes(glm, 1, "int4", 32)[0] == TOY_16BIT - 2 * 2 * 2 * 128
    assert all(type(b) is int for b in weight_bytes(toy, 2, "int4", 32))  # whole bytes


def test_a_plan_on_a_shared_hbm_card_matches_hand_computation(tmp_path):
    model, device = _toy_preset(tmp_path), _device(tmp_path, 4 * 2**20)
    r = tune(model, device, quantization="int4")
    # 0.9 x 4 MiB = 3774873.6 bytes, less the weights: 3075225 bytes of pool; a token's KV is
    # 2 x 2 layers x 2 kv heads x 32 x 2 B = 512 B, a page of 16 tokens 8192 B: 375 pages;
    # 1024 tokens (the toy's context) take 64 pages: 5 sequences
    assert dataclasses.asdict(r) == {
        "model": "toy",
        "model_arg": model,
        "served_model_name": "toy",
        "device": "toycard",
        "device_arg": device,
        "tensor_parallel_size": 1,
        "quantization": "int4",
        "quant_group_size": 32,
        "quant_zero_point_bytes": 2,  # a cuda card: 16 bits, as the checkpoint stores it
        "kv_dtype": "bf16",
        "kv_cache_dtype": "auto",
        "block_size": 16,
        "max_model_len": 1024,
        "gpu_memory_utilization": 0.9,
        "memory_bytes": 4 * 2**20,
        "weight_bytes": TOY_WEIGHTS,
        "weight_bytes_16bit": TOY_16BIT,
        "weight_bytes_linear": TOY_LINEAR_INT4,
        "kv_bytes_per_token": 512,
        "kv_bytes_per_seq": 512 * 1024,
        "kv_pool_limits": {"kv tier": 4 * 2**20, "memory budget": 3075225},
        "kv_pool_bound": "memory budget",
        "kv_pool_bytes": 3075225,
        "num_kv_pages": 375,
        "max_concurrency": 375 * 16 / 1024,
        "pages_per_seq": 64,
        "max_num_seqs": 5,
        "max_num_batched_tokens": 2048,
        "max_loras": 0,  # no --enable-lora: no adapter slots
        "max_lora_rank": 0,
        "lora_bytes": 0,
        "launch_script": r.launch_script,
    }
    # fewer batched tokens than the sequences the pages hold bound max_num_seqs
    assert tune(model, device, max_num_batched_tokens=4).max_num_seqs == 4


def test_the_explanation_of_a_plan_is_its_figures_and_their_formulas(tmp_path):
    r = tune(_toy_preset(tmp_path), _device(tmp_path, 4 * 2**20))
    head = "toy on toycard: tp=1, int4, kv bf16, block 16, max_model_len 1024"
    assert explain(r).splitlines() == [
        head,
        "-" * len(head),
        "device memory                   4.00 MiB  toycard: one card's memory",
        "weights (16-bit part)         503.25 KiB  "
        "embed_tokens + lm_head (vocab-parallel), norms, qkv bias",
        "weights (linear part)         180.00 KiB  "
        "q/k/v/o, gate_up, down split over tp=1: "
        "0.5 B/weight + a 2 B scale and a 2 B zero point per group of 32",
        "weights per rank              683.25 KiB  699648 bytes",
        "KV bytes per token                 512 B  "
        "2 x layers x kv_heads/rank x head_dim x 2 B (bf16)",
        "KV per max-model-len seq      512.00 KiB  1024 tokens x KV bytes per token",
        "KV pool bound: kv tier          4.00 MiB  the preset's kv tier",
        "KV pool bound: memory budget    2.93 MiB  "
        "memory x gpu_memory_utilization - weights <- the pool",
        "num KV pages                         375  floor(pool / (16 x KV bytes per token))",
        "max concurrency                    5.86x  "
        "pages x block_size / max_model_len: full-length sequences at once",
        "pages per sequence                    64  ceil(max_model_len / block_size)",
        "--max-num-seqs                         5  "
        "min(256, batched tokens, pages // pages per seq)",
        "--max-num-batched-tokens            2048  "
        "2048 unless given (chunked prefill); >= max_num_seqs",
        "fits on one card of toycard: 683.25 KiB of weights and 375 KV pages on each",
    ]


def test_the_launch_script_quotes_what_the_shell_would_split_and_asks_for_a_model_dir(tmp_path):
    device = _device(tmp_path, 4 * 2**20)
    r = tune(_toy_preset(tmp_path), device)
    assert r.launch_script == (
        "#!/usr/bin/env bash\n"
        "# pagedserve tune: toy on toycard, tp=1, int4 weights, 375 KV pages\n"
        "set -euo pipefail\n"
        "# MODEL_DIR: the local checkpoint directory of toy\n"
        "exec pagedserve serve \\\n"
        '  --model "${MODEL_DIR:?set MODEL_DIR}" \\\n'
        "  --served-model-name toy \\\n"
        f"  --device '{Path(device).resolve()}' \\\n"
        "  --dtype bfloat16 \\\n"
        "  --tensor-parallel-size 1 \\\n"
        "  --max-model-len 1024 \\\n"
        "  --gpu-memory-utilization 0.9 \\\n"
        "  --block-size 16 \\\n"
        "  --max-num-seqs 5 \\\n"
        "  --max-num-batched-tokens 2048 \\\n"
        "  --quantization int4 \\\n"
        '  "$@"\n'
    )


def _toy_dir(tmp_path: Path) -> Path:
    """The toy as a checkpoint directory (config.json), at a path with a space in it."""
    path = tmp_path / "my models" / "toy"
    path.mkdir(parents=True)
    config = {k: v for k, v in TOY.items() if k != "architecture"} | {"model_type": "glm4"}
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_an_emulated_pool_bound_by_the_host_with_int8_kv_over_two_cards_matches_hand_computation(
    tmp_path,
):
    model = _toy_dir(tmp_path)
    r = tune(
        str(model),
        "kunlun-emu",
        tensor_parallel_size=2,
        max_model_len=256,
        quantization="none",
        kv_dtype="fp32",
        kv_cache_dtype="int8",
        block_size=8,
        host_limit=2**20,
    )
    # weights in fp32, split over 2 ranks: 1119744 bytes a rank; a token's KV: 2 x 2 layers x 1
    # kv head a rank x (32 codes + a 4-byte scale) = 144 B; 1 MiB of host RAM sets the pool:
    # 1048576 // (8 x 144) = 910 pages, 256 tokens take 32: 28 sequences
    weights = 4 * (2 * 512 * 128 + 128 + 2 * (512 + 128))
    weights += 2 * 4 * (128 * 64 + 2 * 128 * 32 + 64 * 128 + 128 * 256 + 128 * 128)
    assert r.weight_bytes == weights == 1119744
    assert (r.kv_bytes_per_token, r.kv_pool_bound, r.num_kv_pages) == (144, "host memory", 910)
    assert (r.pages_per_seq, r.max_num_seqs, r.memory_bytes) == (32, 28, 8 * 2**30)
    budget = int(8 * 2**30 * 0.9 - weights)
    assert r.kv_pool_limits == {"kv tier": 2**31, "memory budget": budget, "host memory": 2**20}
    text = explain(r).splitlines()
    assert text[0] == "toy on kunlun-emu: tp=2, none, kv int8, block 8, max_model_len 256"
    assert text[4].endswith("q/k/v/o, gate_up, down split over tp=2: 16-bit")
    assert text[6] == (
        "KV bytes per token                 144 B  "
        "2 x layers x kv_heads/rank x (head_dim + 4) B (int8 codes + an fp32 scale)"
    )
    assert text[8:11] == [
        "KV pool bound: kv tier          2.00 GiB  the preset's kv tier",
        "KV pool bound: memory budget    7.20 GiB  memory x gpu_memory_utilization - weights",
        "KV pool bound: host memory      1.00 MiB  "
        "half this machine's free RAM (the device lives in host memory) <- the pool",
    ]
    # the card alone: 2 GiB of kv tier // 1152 B a page = 1864135 pages
    assert text[-1] == (
        "fits on 2 cards of kunlun-emu: 1.07 MiB of weights and 910 KV pages on each; this "
        "machine's RAM sets the pool: the card alone would hold 1864135 pages"
    )
    assert r.launch_script.splitlines()[3:] == [
        "exec pagedserve serve \\",
        f"  --model '{model.resolve()}' \\",
        "  --served-model-name toy \\",
        "  --device kunlun-emu \\",
        "  --dtype float32 \\",
        "  --tensor-parallel-size 2 \\",
        "  --max-model-len 256 \\",
        "  --gpu-memory-utilization 0.9 \\",
        "  --block-size 8 \\",
        "  --max-num-seqs 28 \\",
        "  --max-num-batched-tokens 2048 \\",
        "  --kv-cache-dtype int8 \\",
        '  "$@"',
    ]


def test_separate_tiers_make_the_card_and_the_weight_tier_bounds_the_weights(tmp_path):
    mib = 2**20
    # separate tiers: the card is the two together, the weights have their own tier
    exact = _device(tmp_path, 0, weight=TOY_WEIGHTS, kv=mib)
    r = tune(_toy_preset(tmp_path), exact, max_model_len=256)
    assert r.memory_bytes == mib + TOY_WEIGHTS
    assert r.kv_pool_limits == {"kv tier": int(0.9 * mib)} and r.weight_bytes == TOY_WEIGHTS
    short = _device(tmp_path, 0, weight=TOY_WEIGHTS - 1, kv=mib)
    with pytest.raises(TuneError) as e:
        tune(_toy_preset(tmp_path), short, max_model_len=256)
    assert str(e.value).startswith(
        "the weights do not fit: toy needs 683.25 KiB of weights per rank at "
        "--tensor-parallel-size 1, and one card of toycard holds 683.25 KiB of weights with KV "
        "pages beside them; use --tensor-parallel-size 2, use --quantization int4"
    )


def test_weights_that_leave_no_byte_of_the_budget_do_not_fit_and_one_byte_is_a_pool(tmp_path):
    model = _toy_preset(tmp_path)
    with pytest.raises(TuneError, match="^the weights do not fit"):
        tune(model, _device(tmp_path, TOY_WEIGHTS), gpu_memory_utilization=1.0)
    with pytest.raises(TuneError, match="^not even one sequence"):
        tune(model, _device(tmp_path, TOY_WEIGHTS + 1), gpu_memory_utilization=1.0)


@pytest.mark.parametrize(
    ("memory", "weight", "cards", "kv_dtype", "quantization", "advice"),
    [
        # tp 1 would fit the whole card (not 0.9 of it); tp 2 fits
        (720_000, None, 4, "bf16", "int4", "use --tensor-parallel-size 2"),
        # tp 2 would fit its tier and twice the card; only tp 4, all the cards, fits
        (300_000, 400_000, 4, "bf16", "int4", "use --tensor-parallel-size 4"),
        # in fp32 tp 2 needs 1119744 bytes, tp 4 595200 (in bf16 tp 2 would fit: 559872)
        (600_000, None, 4, "fp32", "none", "use --tensor-parallel-size 4"),
        # a card of unknown count: up to 64 are tried
        (300_000, None, "per-process", "bf16", "int4", "use --tensor-parallel-size 4"),
        # 3 cards: tp 4 would fit, but the node has no 4 cards
        (300_000, None, 3, "bf16", "int4", "raise --tensor-parallel-size"),
        (100_000, None, 4, "bf16", "int4", "raise --tensor-parallel-size"),
    ],
)
def test_weights_that_do_not_fit_name_the_fewest_cards_that_hold_them(
    tmp_path, memory, weight, cards, kv_dtype, quantization, advice
):
    device = _device(tmp_path, memory, weight, cards=cards)
    with pytest.raises(TuneError, match="weights do not fit") as e:
        tune(_toy_preset(tmp_path), device, kv_dtype=kv_dtype, quantization=quantization)
    assert f"pages beside them; {advice}, use --quantization int4" in str(e.value)


def test_a_device_of_no_card_count_is_searched_up_to_64_cards(tmp_path):
    # 65 heads split over 5, 13 or 65 ranks: 1505408, 579712 or 116864 bytes of weights a rank
    wide = {**TOY, "hidden_size": 64, "num_attention_heads": 65, "num_key_value_heads": 65}
    wide |= {"head_dim": 64, "intermediate_size": 65 * 64, "vocab_size": 64}
    path = tmp_path / "wide.yaml"
    path.write_text(yaml.safe_dump(wide))
    device = _device(tmp_path, 500_000, cards="per-process")
    with pytest.raises(TuneError, match="weights do not fit") as e:
        tune(str(path), device, quantization="none")
    assert "pages beside them; raise --tensor-parallel-size, use" in str(e.value)
    # 65 cards would hold them
    r = tune(str(path), device, quantization="none", tensor_parallel_size=65, max_model_len=256)
    assert r.weight_bytes == 116864 and r.max_num_seqs == 2


def test_the_refusal_of_weights_names_the_room_one_card_has_for_them(tmp_path):
    device = _device(tmp_path, 720_000, weight=600_000)  # 0.9 x 720000 = 648000: the tier binds
    with pytest.raises(TuneError) as e:
        tune(_toy_preset(tmp_path), device)
    assert str(e.value) == (
        "the weights do not fit: toy needs 683.25 KiB of weights per rank at "
        "--tensor-parallel-size 1, and one card of toycard holds 585.94 KiB of weights with KV "
        "pages beside them; use --tensor-parallel-size 2, use --quantization int4, or pick a "
        "larger device"
    )
    device = _device(tmp_path, 720_000)  # the budget binds: 648000 bytes = 632.81 KiB
    with pytest.raises(TuneError, match="holds 632.81 KiB of weights"):
        tune(_toy_preset(tmp_path), device)


def test_a_card_too_small_for_one_sequence_says_how_much_is_missing_and_what_to_change(tmp_path):
    device = _device(tmp_path, 2**20)  # 943718 bytes of budget, 244070 left after the weights
    with pytest.raises(TuneError) as e:
        tune(_toy_preset(tmp_path), device)
    # 64 pages of 8192 B = 512 KiB needed; 524288 - 244070 = 280218 bytes missing
    assert str(e.value) == (
        "not even one sequence of --max-model-len 1024 fits: it needs 512.00 KiB of KV cache, "
        "the pool gets 238.35 KiB (set by the memory budget; 273.65 KiB missing); lower "
        "--max-model-len, raise --gpu-memory-utilization or --tensor-parallel-size"
    )
    with pytest.raises(TuneError) as e:
        tune(str(_toy_dir(tmp_path)), "kunlun-emu", host_limit=100_000)
    assert str(e.value) == (
        "not even one sequence of --max-model-len 1024 fits: it needs 512.00 KiB of KV cache, "
        "the pool gets 97.66 KiB (set by the host memory; 414.34 KiB missing); free memory on "
        "this machine, whose RAM holds the emulated pool, or lower --max-model-len"
    )


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"tensor_parallel_size": 0}, "--tensor-parallel-size 0 must be at least 1"),
        (
            {"tensor_parallel_size": 3},
            "--tensor-parallel-size 3 does not divide the 4 attention heads of toy; "
            "use a divisor of 4",
        ),
        ({"gpu_memory_utilization": 0.0}, "--gpu-memory-utilization 0.0 must be in (0, 1]"),
        ({"gpu_memory_utilization": 1.5}, "--gpu-memory-utilization 1.5 must be in (0, 1]"),
        ({"block_size": 0}, "--block-size and --max-model-len must be positive"),
        ({"max_model_len": -1}, "--block-size and --max-model-len must be positive"),
        *(
            (
                {key: value},
                "--quantization must be int4 or none; --kv-dtype one of bf16, fp16, fp32",
            )
            for key, value in (("quantization", "int8"), ("kv_dtype", "int8"))
        ),
        ({"kv_cache_dtype": "fp8"}, "--kv-cache-dtype must be one of auto, int8"),
        (
            {"quant_group_size": 48},
            "a projection with 128 inputs per rank is not a multiple of --quant-group-size 48; "
            "pick a group size that divides it (32, 64 or 128) or another --tensor-parallel-size",
        ),
    ],
)
def test_a_setting_that_cannot_work_is_refused_with_its_reason(tmp_path, kwargs, error):
    with pytest.raises(TuneError) as e:
        tune(_toy_preset(tmp_path), _device(tmp_path, 4 * 2**20), **kwargs)
    assert str(e.value) == error


def test_the_edges_of_the_settings_ranges_are_accepted(tmp_path):
    model, device = _toy_preset(tmp_path), _device(tmp_path, 4 * 2**20)
    assert tune(model, device, gpu_memory_utilization=1.0).kv_pool_bytes == 4 * 2**20 - TOY_WEIGHTS
    one = tune(model, device, block_size=1, max_model_len=1)
    assert (one.pages_per_seq, one.num_kv_pages) == (1, 3075225 // 512)


def test_shapes_that_cannot_be_split_name_the_heads_or_the_intermediate_size():
    wide = _config(num_attention_heads=12, num_key_value_heads=3)
    with pytest.raises(TuneError) as e:
        check_tensor_parallel("wide", wide, 2)
    assert str(e.value) == (
        "--tensor-parallel-size 2 and the 3 kv heads of wide neither divide the other; kv heads "
        "cannot be split or replicated evenly"
    )
    odd = _config(intermediate_size=130)
    with pytest.raises(TuneError) as e:
        check_tensor_parallel("odd", odd, 4)
    assert str(e.value) == "--tensor-parallel-size 4 does not divide intermediate_size 130 of odd"


def test_a_model_or_device_that_cannot_be_read_is_refused_naming_what_there_is(tmp_path):
    with pytest.raises(TuneError) as e:
        load_model("nope")
    assert str(e.value) == (
        "--model 'nope' is neither a directory with config.json nor a preset; presets: "
        "glm-4-32b-0414, glm-4-9b-0414, glm-4-9b-chat, glm-4-9b-chat-1m, glm4-demo"
    )
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(TuneError) as e:
        load_model(str(tmp_path))
    assert str(e.value).startswith(f"--model {tmp_path}: unsupported model_type 'bert'")
    with pytest.raises(TuneError) as e:
        load_device("nope")
    assert str(e.value).startswith("unknown device 'nope'; choose one of cpu, cuda")


def test_a_preset_file_names_its_model_by_its_name_field_else_by_the_file(tmp_path):
    named = tmp_path / "toy-file.yaml"
    named.write_text(yaml.safe_dump({**TOY, "name": "toy-named"}))
    assert load_model(str(named))[0] == "toy-named"
    assert load_model(_toy_preset(tmp_path))[0] == "toy"
