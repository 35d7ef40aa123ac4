"""One rank's worker, in this process: its dtype, its card and its share of the model, the refusals
of a model or a pool that cannot be held (each saying what to change), its KV pages sized to the
fullest card, its host tier's frames, and what it reports of its card.

A rank other than 0 is built here without a process group: only its collectives need one, and the
tests that reach them give the worker a stand-in card whose collectives combine several ranks."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from pagedserve.config import EngineConfig, UsageContext
from pagedserve.engine.worker import Worker, resolve_dtype
from pagedserve.hal.memory import DeviceOutOfMemoryError
from tests.helpers.models import host_tier_gib

# the tiny GLM-4 of the tiny_glm4 fixture: 2 layers, 4 heads, 2 KV heads of 16, intermediate 96
LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 16


def _config(model_dir, **settings) -> EngineConfig:
    return EngineConfig.from_kwargs(
        model=str(model_dir), **{"dtype": "float32", "device": "cpu", **settings}
    )


def _worker(model_dir, *args, **settings) -> Worker:
    return Worker(_config(model_dir, **settings), *args)


def _preset(tmp_path, **tiers) -> str:
    """A one-card CPU preset with these tiers (bytes), as a YAML file's path."""
    path = tmp_path / "card.yaml"
    memory = {"kv": "64MiB", "weight": "64MiB", "host": "64MiB"} | tiers
    path.write_text(json.dumps({"name": "card", "backend": "cpu", "tiers": memory}))
    return str(path)


# ---- dtype --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "dtype, checkpoint, expected",
    [
        ("auto", "float16", torch.float16),
        ("auto", "float32", torch.float32),
        ("auto", "bfloat16", torch.bfloat16),
        ("auto", None, torch.bfloat16),
        ("auto", "float64", torch.bfloat16),
        ("float32", "float16", torch.float32),
        ("float16", None, torch.float16),
    ],
)
def test_auto_takes_a_supported_checkpoint_dtype_else_bfloat16_and_a_named_one_wins(
    dtype, checkpoint, expected
):
    assert resolve_dtype(dtype, checkpoint) is expected


def test_an_unsupported_dtype_is_refused_naming_the_choices():
    with pytest.raises(ValueError) as e:
        resolve_dtype("float64", "float32")
    assert str(e.value) == (
        "--dtype 'float64' is not supported; use auto, float32, bfloat16, float16"
    )


# ---- the rank's card and share of the model ------------------------------------------------------
def test_a_worker_by_default_is_rank_0_of_1_with_the_whole_model_for_the_server(tiny_glm4):
    w = _worker(tiny_glm4[0], block_size=8)
    assert (w.device.rank, w.device.world_size) == (0, 1)
    assert (w.tp.rank, w.tp.size, w.tp.num_kv_heads) == (0, 1, KV_HEADS)
    assert w.usage_context is UsageContext.OPENAI_API_SERVER
    assert w.model_path == tiny_glm4[0] and w.model_config.num_hidden_layers == LAYERS
    assert w.dtype is torch.float32 and w.kv_cache_dtype is torch.float32
    assert w.block_size == 8 and w.runner is None
    assert (w.num_swap_frames, w.num_host_cache_frames) == (0, 0)
    assert w.device.name == "cpu" and w.model.lm_head is not None


def test_auto_loads_the_tiny_checkpoint_in_its_own_float32_on_the_kernels_asked_for(tiny_glm4):
    w = _worker(tiny_glm4[0], dtype="auto", kernels="eager")
    assert w.model_config.torch_dtype == "float32" and w.dtype is torch.float32
    assert w.device.kernel_set == "eager" and _worker(tiny_glm4[0]).device.kernel_set != "eager"


def test_a_rank_of_two_holds_its_card_and_half_the_kv_heads(tiny_glm4):
    w = _worker(tiny_glm4[0], 1, 2, kv_cache_dtype="int8")
    assert (w.device.rank, w.device.world_size) == (1, 2)
    assert (w.tp.rank, w.tp.size, w.tp.num_kv_heads) == (1, 2, KV_HEADS // 2)
    assert w.kv_cache_dtype is torch.int8 and w.dtype is torch.float32


@pytest.mark.parametrize(
    "usage, flag",
    [(UsageContext.OPENAI_API_SERVER, "--tensor-parallel-size"), (UsageContext.LLM_CLASS, "")],
)
def test_a_size_that_cannot_split_the_model_is_refused_by_the_worker_naming_its_flag(
    tiny_glm4, usage, flag
):
    with pytest.raises(ValueError) as e:
        Worker(_config(tiny_glm4[0]), 0, 3, usage)
    assert str(e.value).startswith(f"{flag or 'tensor_parallel_size'} 3 cannot split this model")


def test_int4_at_two_ranks_is_refused_for_the_groups_it_would_cut(tiny_glm4):
    # unquantized, two ranks split the tiny model; its down_proj's 96 columns / 2 = 48 per rank
    # cut int4 groups of 32
    assert _worker(tiny_glm4[0], 0, 2).tp.size == 2
    with pytest.raises(ValueError, match="would cut the INT4 groups of down_proj"):
        _worker(tiny_glm4[0], 0, 2, quantization="int4")


def test_a_rank_reads_only_its_share_of_each_split_tensor_from_the_checkpoint(
    tiny_glm4, monkeypatch
):
    from pagedserve.models import loader

    whole = []

    class Recording:
        def __init__(self, *args, **kwargs):
            self.file = loader_safe_open(*args, **kwargs)

        def __enter__(self):
            self.f = self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def keys(self):
            return self.f.keys()

        def get_slice(self, name):
            return self.f.get_slice(name)

        def get_tensor(self, name):
            whole.append(name)
            return self.f.get_tensor(name)

    loader_safe_open = loader.safe_open
    monkeypatch.setattr(loader, "safe_open", Recording)
    w = _worker(tiny_glm4[0], 1, 2)
    assert "model.layers.0.input_layernorm.weight" in whole  # not split: read whole
    assert not [n for n in whole if "proj" in n or "embed" in n or "lm_head" in n]
    assert w.tp.rank == 1


def test_the_checkpoints_tensors_reach_the_model_cast_to_its_dtype(tiny_glm4, monkeypatch):
    from pagedserve.models.glm4 import GlmForCausalLM

    dtypes = set()
    load_weights = GlmForCausalLM.load_weights

    def recording(self, state_dict):
        dtypes.update(t.dtype for t in state_dict.values())
        return load_weights(self, state_dict)

    monkeypatch.setattr(GlmForCausalLM, "load_weights", recording)
    _worker(tiny_glm4[0], dtype="bfloat16")  # a float32 checkpoint
    assert dtypes == {torch.bfloat16}


def _bare_worker(quantization=None, quantization_config=None, group_size=32) -> Worker:
    w = Worker.__new__(Worker)
    w.config = SimpleNamespace(
        model=SimpleNamespace(quantization=quantization, quant_group_size=group_size)
    )
    w.model_config = SimpleNamespace(quantization_config=quantization_config)
    return w


@pytest.mark.parametrize(
    "quantization, quantization_config, expected",
    [
        (None, {"group_size": 128, "q_group_size": 64}, 128),
        ("awq", {"q_group_size": "64"}, 64),
        (None, {"bits": 4}, 16),
        ("int4", None, 16),
        ("w4a8", None, 16),
        ("awq", None, None),
        (None, None, None),
    ],
)
def test_the_int4_group_size_is_the_checkpoints_else_the_flags_when_quantizing(
    quantization, quantization_config, expected
):
    size = _bare_worker(quantization, quantization_config, 16)._int4_group_size()
    assert size == expected and (size is None or type(size) is int)


def test_an_unknown_quantization_is_refused_naming_the_choices(tiny_glm4):
    with pytest.raises(ValueError) as e:
        _worker(tiny_glm4[0], quantization="fp8")
    assert str(e.value) == (
        "--quantization 'fp8' is not supported; use int4 (load-time round-to-nearest, bf16 "
        "activations), w4a8 (the same weights, int8 activations), or point --model at an "
        "AWQ/GPTQ/pagedserve quantized directory"
    )


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_awq_or_gptq_on_an_unquantized_checkpoint_is_refused_naming_the_ways_out(tiny_glm4, method):
    with pytest.raises(ValueError) as e:
        _worker(tiny_glm4[0], quantization=method)
    assert str(e.value) == (
        f"--quantization {method} needs a quantized checkpoint, but {tiny_glm4[0]} has no "
        "quantization_config; use --quantization int4 to quantize at load time, or run "
        "`pagedserve quantize` first"
    )


@pytest.mark.parametrize("quantization", ["int4", "w4a8"])
def test_the_model_is_built_on_the_workers_card_share_and_dtype_as_the_flags_quantize_it(
    tiny_glm4, quantization
):
    w = _worker(tiny_glm4[0], 0, 2, quantization=quantization, quant_group_size=16,
                quantize_lm_head="int8")  # fmt: skip
    m = w.model
    assert (m.config, m.device, m.tp) == (w.model_config, w.device, w.tp)
    assert (m.dtype, m.quantization, m.quant_group_size) == (torch.float32, quantization, 16)
    assert m.quantize_lm_head == "int8" and "lm_head.qweight" in w.device.weight_tensors
    # rank 0 of 2 holds 2 heads and 1 KV head: 64 qkv rows of 64 columns, in int4 groups of 16
    scales = w.device.weight_tensors["model.layers.0.self_attn.qkv_proj.scales"]
    assert scales.shape == (64, 64 // 16)


def test_a_card_too_small_for_the_weights_is_refused_suggesting_more_ranks(tiny_glm4, tmp_path):
    checkpoint = sum(f.stat().st_size for f in tiny_glm4[0].glob("*.safetensors"))
    device = _preset(tmp_path, weight=f"{checkpoint // 3}B")
    with pytest.raises(ValueError) as e:
        _worker(tiny_glm4[0], device=device)
    assert e.value.__cause__ is None and e.value.__suppress_context__
    text = str(e.value)
    assert text.startswith(
        "the weights do not fit on one card of card at --tensor-parallel-size 1: the checkpoint "
        f"has {checkpoint / 2**10:.2f} KiB, a card holds {checkpoint // 3 / 2**10:.2f} KiB ("
    )
    assert text.endswith("); split it over 4 cards with --tensor-parallel-size 4")
    assert "KiB (memory tier 'weight' cannot hold " in text  # the card's own error


def _oom_worker(tmp_path, checkpoint, card, tier, tp=1, usage=UsageContext.OPENAI_API_SERVER):
    """A worker whose card (``card`` bytes, None: none given; a weight tier of ``tier``) could
    not hold a checkpoint of ``checkpoint`` bytes at ``tp`` ranks."""
    (tmp_path / "model.safetensors").write_bytes(b"\0" * checkpoint)
    w = Worker.__new__(Worker)
    w.model_path, w.usage_context, w.tp = tmp_path, usage, SimpleNamespace(size=tp)
    w.device = SimpleNamespace(
        name="small",
        tiers={"weight": SimpleNamespace(capacity=tier)},
        preset=SimpleNamespace(memory_bytes=card),
    )
    return w


@pytest.mark.parametrize(
    "checkpoint, card, expected",
    [
        (1700, 1000, 2),  # 850 < 900
        (1800, 1000, 4),  # 900 is not below 0.9 of the card
        (3500, 1000, 4),
        (3600, 1000, 8),
        (7000, 1000, 8),
        (14000, 1000, 16),
        (28000, 1000, 32),
        (56000, 1000, 64),
    ],
)
def test_the_advice_is_the_fewest_ranks_of_a_power_of_two_whose_share_is_below_0_9_of_a_card(
    tmp_path, checkpoint, card, expected
):
    w = _oom_worker(tmp_path, checkpoint, card, tier=1)
    text = w._weights_do_not_fit(DeviceOutOfMemoryError("full"))
    assert text == (
        f"the weights do not fit on one card of small at --tensor-parallel-size 1: the checkpoint "
        f"has {checkpoint / 1024:.2f} KiB, a card holds 1000 B (full); split it over {expected} "
        f"cards with --tensor-parallel-size {expected}"
    )


def test_a_checkpoint_no_64_cards_hold_is_advised_a_larger_device_or_int4(tmp_path):
    w = _oom_worker(tmp_path, 57600, 1000, tier=1)
    assert w._weights_do_not_fit(DeviceOutOfMemoryError("full")).endswith(
        "(full); use a larger device preset or --quantization int4"
    )


def test_the_advice_counts_from_the_next_size_and_by_the_weight_tier_without_a_card_size(tmp_path):
    w = _oom_worker(tmp_path, 1700, None, tier=1000, tp=2, usage=UsageContext.LLM_CLASS)
    assert w._weights_do_not_fit(DeviceOutOfMemoryError("full")) == (
        "the weights do not fit on one card of small at tensor_parallel_size 2: the checkpoint "
        "has 1.66 KiB, a card holds 1000 B (full); split it over 4 cards with "
        "tensor_parallel_size=4"
    )


# ---- the KV cache ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "settings, tp, expected",
    [
        ({}, 1, 2 * LAYERS * KV_HEADS * HEAD_DIM * 4),
        ({"dtype": "bfloat16"}, 1, 2 * LAYERS * KV_HEADS * HEAD_DIM * 2),
        ({}, 2, 2 * LAYERS * HEAD_DIM * 4),  # one KV head per card
        ({"kv_cache_dtype": "int8"}, 1, 2 * LAYERS * KV_HEADS * (HEAD_DIM + 4)),  # codes, scale
    ],
)
def test_kv_bytes_per_token_are_the_cards_kv_heads_in_the_caches_dtype(
    tiny_glm4, settings, tp, expected
):
    w = _worker(tiny_glm4[0], 0, tp, block_size=8, **settings)
    assert w.kv_bytes_per_token() == expected
    assert w.page_bytes == 8 * expected


@pytest.mark.parametrize("kv_cache_dtype, dtype", [("auto", torch.float32), ("int8", torch.int8)])
def test_the_pool_holds_the_pages_asked_for_in_the_caches_dtype(tiny_glm4, kv_cache_dtype, dtype):
    w = _worker(tiny_glm4[0], block_size=8, num_kv_pages=5, kv_cache_dtype=kv_cache_dtype)
    runner = w.init_kv_cache()
    assert runner is w.runner and runner.block_size == 8 and runner.model is w.model
    assert runner.device is w.device and runner.kv_cache is w.device.kv_cache
    assert w.device.kv_cache.shape[:5] == (LAYERS, 2, 5, 8, KV_HEADS)
    assert w.device.kv_cache.dtype is dtype
    assert w.device.host_kv_cache is None and w.device.tiers["host"].used == 0


def test_a_pool_of_one_page_is_allowed(tiny_glm4):
    w = _worker(tiny_glm4[0], num_kv_pages=1)
    assert w.init_kv_cache().kv_cache.shape[2] == 1


def test_without_a_page_count_the_pool_fills_the_share_of_the_card_asked_for(tiny_glm4, tmp_path):
    device = _preset(tmp_path, kv="1MiB")
    w = _worker(tiny_glm4[0], device=device, num_kv_pages=None, gpu_memory_utilization=0.5)
    expected = w.device.num_kv_pages_available(w.page_bytes, 0.5)
    assert expected == 2**19 // w.page_bytes
    w.init_kv_cache()
    assert w.device.kv_cache.shape[2] == expected


def test_a_card_with_no_room_for_one_page_is_refused_naming_the_flags(tiny_glm4):
    w = _worker(tiny_glm4[0], num_kv_pages=None, gpu_memory_utilization=1e-9, block_size=8)
    with pytest.raises(ValueError) as e:
        w.init_kv_cache()
    assert str(e.value) == (
        "no room for KV pages on cpu: one page needs 4.00 KiB; raise --gpu-memory-utilization "
        "or use a larger --device"
    )
    w = Worker(_config(tiny_glm4[0], num_kv_pages=None, gpu_memory_utilization=1e-9))
    w.usage_context = UsageContext.LLM_CLASS
    with pytest.raises(ValueError, match="raise gpu_memory_utilization or use a larger device$"):
        w.init_kv_cache()


class _Ranks:
    """A card among ranks whose other cards hold ``others`` (the same for every count asked)."""

    def __init__(self, device, others: int):
        self.device, self.others, self.ops = device, others, []

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        reduce = {"sum": sum, "min": min}[op]
        self.ops.append(op)
        t[0] = reduce([int(t[0]), self.others])
        return t

    def __getattr__(self, name):
        return getattr(self.device, name)


def test_every_rank_takes_the_smallest_pool_and_host_tier_of_all_ranks(tiny_glm4):
    page_gib = host_tier_gib(tiny_glm4[0], 1, 16)
    w = _worker(tiny_glm4[0], num_kv_pages=6, swap_space=3 * page_gib, host_prefix_cache=page_gib)
    w.device = _Ranks(w.device, others=2)
    w.init_kv_cache()
    assert w.device.kv_cache.shape[2] == 2  # the other ranks' 2 pages, not this one's 6
    assert (w.num_swap_frames, w.num_host_cache_frames) == (2, 1)
    assert w.device.host_kv_cache.shape[0] == 3 and set(w.device.ops) == {"min"}


def test_the_counts_are_reduced_in_the_cards_own_memory():
    """nccl reduces only tensors in the card's memory: a meta card stands for one here."""
    seen = []

    def all_reduce(t, op="sum"):
        seen.append((t.device.type, t.dtype, op))
        return torch.tensor([3])  # what the ranks agreed on, read back

    w = Worker.__new__(Worker)
    w.device = SimpleNamespace(torch_device=torch.device("meta"), all_reduce=all_reduce)
    assert w._same_on_every_rank(5) == 3 and seen == [("meta", torch.int64, "min")]


def test_no_rank_with_no_room_refuses_the_others_their_pool(tiny_glm4):
    w = _worker(tiny_glm4[0], num_kv_pages=4)
    w.device = _Ranks(w.device, others=0)
    with pytest.raises(ValueError, match="^no room for KV pages on cpu"):
        w.init_kv_cache()


@pytest.mark.parametrize("swap, cached", [(3, 2), (2, 2), (3, 0), (0, 2)])
def test_swap_space_and_the_host_prefix_cache_are_frames_of_one_host_pool(tiny_glm4, swap, cached):
    gib = host_tier_gib(tiny_glm4[0], 1, 16)
    w = _worker(tiny_glm4[0], num_kv_pages=4, swap_space=swap * gib, host_prefix_cache=cached * gib)
    w.init_kv_cache()
    assert (w.num_swap_frames, w.num_host_cache_frames) == (swap, cached)
    assert w.device.host_kv_cache.shape == (swap + cached, *w.device.kv_cache[:, :, 0].shape)
    assert w.device.tiers["host"].used == (swap + cached) * w.page_bytes


def test_a_part_of_a_frame_is_not_a_frame(tiny_glm4):
    gib = host_tier_gib(tiny_glm4[0], 1, 16)
    w = _worker(tiny_glm4[0], num_kv_pages=4, swap_space=2.99 * gib, host_prefix_cache=0.99 * gib)
    w.init_kv_cache()
    assert (w.num_swap_frames, w.num_host_cache_frames) == (2, 0)


def test_a_host_tier_holding_exactly_the_frames_takes_them(tiny_glm4, tmp_path):
    gib = host_tier_gib(tiny_glm4[0], 1, 16)
    page = 16 * 2 * LAYERS * KV_HEADS * HEAD_DIM * 4
    w = _worker(tiny_glm4[0], device=_preset(tmp_path, host=f"{5 * page}B"), num_kv_pages=4,
                swap_space=3 * gib, host_prefix_cache=2 * gib)  # fmt: skip
    w.init_kv_cache()
    assert w.device.tiers["host"].free == 0


def test_frames_beyond_the_host_tier_are_refused_naming_both_flags(tiny_glm4, tmp_path):
    gib = host_tier_gib(tiny_glm4[0], 1, 16)
    page = 16 * 2 * LAYERS * KV_HEADS * HEAD_DIM * 4  # 8 KiB
    device = _preset(tmp_path, host=f"{5 * page - 1}B")
    w = _worker(tiny_glm4[0], device=device, num_kv_pages=4, swap_space=3 * gib,
                host_prefix_cache=2 * gib)  # fmt: skip
    with pytest.raises(ValueError) as e:
        w.init_kv_cache()
    assert str(e.value) == (
        f"--swap-space {3 * gib:g} GiB and --host-prefix-cache {2 * gib:g} GiB (40.00 KiB) do "
        "not fit the host tier of card: 40.00 KiB free of 40.00 KiB; lower them or use a "
        "device preset with a larger host tier"
    )
    assert w.device.host_kv_cache is None and (w.num_swap_frames, w.num_host_cache_frames) == (0, 0)


@pytest.mark.parametrize("limit, fits", [(40 * 2**10, True), (40 * 2**10 - 1, False)])
def test_frames_beyond_what_the_machine_can_give_are_refused(tiny_glm4, monkeypatch, limit, fits):
    gib = host_tier_gib(tiny_glm4[0], 1, 16)
    w = _worker(tiny_glm4[0], num_kv_pages=4, swap_space=3 * gib, host_prefix_cache=2 * gib)
    w.usage_context = UsageContext.LLM_CLASS
    monkeypatch.setattr(w.device, "host_memory_limit", lambda: limit)
    if fits:
        w.init_kv_cache()
        assert w.device.host_kv_cache.shape[0] == 5
        return
    with pytest.raises(ValueError) as e:
        w.init_kv_cache()
    assert str(e.value) == (
        f"swap_space {3 * gib:g} GiB and host_prefix_cache {2 * gib:g} GiB (40.00 KiB) ask for "
        "more host memory than this machine can give (40.00 KiB); lower them"
    )


# ---- what it reports ---------------------------------------------------------------------------
def test_a_single_cards_stats_are_its_name_backend_kernels_and_tiers(tiny_glm4):
    w = _worker(tiny_glm4[0], num_kv_pages=4)
    w.init_kv_cache()
    d = w.device
    assert w.device_stats() == {
        "name": "cpu",
        "backend": d.backend,
        "kernels": d.kernel_set,
        "native_ops": d.native_ops(),
        "description": d.preset.description,
        "tiers": d.memory_stats(),
    }
    assert d.native_ops() == {} or d.native_ops()["rms_norm"] == "native"
    assert w.device_stats()["tiers"]["kv"]["used_bytes"] == d.kv_cache.numel() * 4


def test_a_ranks_stats_add_its_rank_and_the_bytes_it_sent(tiny_glm4):
    w = _worker(tiny_glm4[0], 1, 2)
    w.device.collective_bytes_sent = 1234
    stats = w.device_stats()
    assert stats["name"] == "cpu card 1" and stats["description"] == w.device.preset.description
    assert (stats["tp_rank"], stats["collective_bytes_sent"]) == (1, 1234)
    assert set(stats) == {"name", "backend", "kernels", "native_ops", "description", "tiers",
                          "tp_rank", "collective_bytes_sent"}  # fmt: skip
