"""The HAL: memory tiers charge every allocation and refuse overdraft clearly; backend kernels equal
the plain-PyTorch references."""

from __future__ import annotations

import logging

import pytest
import torch

from pagedserve.hal import DeviceOutOfMemoryError, MemoryAttr, get_device, kernels
from pagedserve.hal.cpu import _AttentionPlan, decode_attention, prefill_attention
from pagedserve.hal.device_preset import DevicePreset, load_device_preset
from tests.helpers.kernels import paged_batch


def _small_device(**tiers):
    preset = DevicePreset.from_dict("t", {"backend": "kunlun-emu", "tiers": tiers})
    return _emu(preset)


def _emu(preset):
    from pagedserve.hal.kunlun_emu import KunlunEmuDevice

    return KunlunEmuDevice(preset)


def test_presets_load_by_backend_name_and_by_preset_name():
    assert get_device("kunlun-emu").backend == "kunlun-emu"
    assert get_device("cpu").backend == "cpu"
    assert load_device_preset("kunlun-xpu-32g").memory_bytes == 32 * 2**30


def test_unknown_device_names_the_flag_and_the_choices():
    with pytest.raises(ValueError, match=r"kunlun-emu.*--device"):
        get_device("tpu-v9")


def test_every_allocation_is_charged_to_its_tier_and_released():
    dev = _small_device(kv="1MiB", weight="1MiB", host="1MiB")
    t = dev.empty((1024,), torch.float32, "weight", "w0")
    assert dev.tiers["weight"].used == 4096
    assert dev.memory_stats()["weight"]["allocations"] == {"w0": 4096}
    dev.free(t)
    assert dev.tiers["weight"].used == 0


def test_overdrawing_a_tier_names_tier_bytes_free_and_the_flag():
    dev = _small_device(kv="1KiB", weight="1MiB", host="1MiB")
    with pytest.raises(DeviceOutOfMemoryError) as err:
        dev.empty((1024,), torch.float32, "kv", "kv_cache")
    msg = str(err.value)
    assert "'kv'" in msg and "4.00 KiB" in msg and "1.00 KiB free" in msg
    assert "--gpu-memory-utilization" in msg


def test_kv_pool_is_numbered_page_frames_from_the_kv_tier():
    dev = _small_device(kv="1MiB", weight="1MiB", host="1MiB")
    page_bytes = 2 * 2 * 4 * 2 * 8 * 4  # layers * (K,V) * block * kv_heads * head_dim * fp32
    n = dev.num_kv_pages_available(page_bytes, utilization=0.5)
    assert n == (2**20 // 2) // page_bytes
    kv = dev.allocate_kv_cache(2, n, 4, 2, 8, torch.float32)
    assert kv.shape == (2, 2, n, 4, 2, 8)
    assert dev.tiers["kv"].used == n * page_bytes
    assert dev.kv_memory_attr is MemoryAttr.CACHED


def test_an_int8_kv_pool_keeps_each_heads_scale_in_its_row_and_its_faults_are_detected():
    # head_dim 8 int8 codes + a 4-byte scale: 12 bytes a token and head instead of 32 in fp32
    dev = _small_device(kv="1MiB", weight="1MiB", host="1MiB")
    kv = dev.allocate_kv_cache(2, 16, 4, 2, 8, torch.int8)
    assert kv.shape == (2, 2, 16, 4, 2, 12) and kv.dtype == torch.int8
    assert dev.tiers["kv"].used == 2 * 2 * 16 * 4 * 2 * 12
    before = kv[1, 0, 5].clone()
    dev.inject_fault(page=5, layer=1)
    assert not torch.equal(kv[1, 0, 5], before) and dev.take_faulted_pages() == [5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_pages_move_whole_between_the_kv_tier_and_host_frames(dtype):
    dev = _small_device(kv="1MiB", weight="1MiB", host="1MiB")
    kv = dev.allocate_kv_cache(3, 6, 4, 2, 8, dtype)
    kv.copy_((torch.randn(kv.shape) * 50).to(dtype))
    host = dev.allocate_host_kv_cache(5)
    assert host.shape == (5, 3, 2, 4, 2, kv.shape[-1]) and host.device.type == "cpu"
    assert dev.tiers["host"].used == 5 * kv[:, :, 0].numel() * kv.element_size()
    pages = kv.clone()
    dev.swap_out([(4, 0), (1, 3)])
    assert torch.equal(host[0], pages[:, :, 4]) and torch.equal(host[3], pages[:, :, 1])
    dev.swap_in([(3, 5), (0, 2)])  # frame 3 to page 5, frame 0 to page 2
    assert torch.equal(kv[:, :, 5], pages[:, :, 1]) and torch.equal(kv[:, :, 2], pages[:, :, 4])
    untouched = [0, 1, 3, 4]
    assert torch.equal(kv[:, :, untouched], pages[:, :, untouched])


def test_a_host_frame_that_does_not_fit_the_host_tier_is_refused_naming_the_flags():
    dev = _small_device(kv="1MiB", weight="1MiB", host="4KiB")
    dev.allocate_kv_cache(2, 8, 4, 2, 8, torch.float32)
    with pytest.raises(DeviceOutOfMemoryError, match=r"'host'.*--swap-space, --host-prefix-cache"):
        dev.allocate_host_kv_cache(8)


def test_a_flipped_bit_in_a_host_frame_is_reported_as_a_kv_page_fault():
    dev = get_device("kunlun-emu")
    dev.allocate_kv_cache(2, 4, 4, 2, 8, torch.float32)
    host = dev.allocate_host_kv_cache(3)
    before = host[2].clone()
    dev.inject_host_fault(2)
    assert not torch.equal(host[2], before)
    assert dev.take_faulted_host_frames() == [2] and dev.take_faulted_host_frames() == []
    assert dev.faults.injected["kv_page"] == dev.faults.detected["kv_page"] == 1


def test_shared_hbm_pays_weights_before_kv_pages():
    preset = DevicePreset.from_dict(
        "t",
        {
            "backend": "kunlun-emu",
            "memory_bytes": "1MiB",
            "tiers": {"kv": "1MiB", "weight": "1MiB"},
        },
    )
    dev = _emu(preset)
    dev.empty((2**20 // 8,), torch.float32, "weight", "w")  # half the HBM
    assert dev.num_kv_pages_available(1024, utilization=1.0) == 512


def test_an_emulated_pool_is_capped_by_half_the_hosts_free_ram(monkeypatch):
    from pagedserve.hal import device as device_module
    from pagedserve.hal.device import Device

    monkeypatch.setattr(device_module, "host_memory_limit", lambda: 300 * 1024.0)
    dev = _small_device(kv="1MiB", weight="1MiB", host="1MiB")
    assert dev.num_kv_pages_available(1024, utilization=1.0) == 300  # not the tier's 1024
    assert get_device("cpu").host_memory_limit() == 300 * 1024.0
    cuda = Device(DevicePreset.from_dict("g", {"backend": "cuda", "tiers": {"kv": "1MiB"}}))
    assert cuda.host_memory_limit() == float("inf")  # a GPU's memory is its own
    assert cuda.num_kv_pages_available(1024, utilization=1.0) == 1024


def test_uncached_kv_pool_logs_a_warning(caplog):
    dev = _small_device(kv="1MiB", weight="1MiB", host="1MiB")
    with caplog.at_level(logging.WARNING):
        dev.allocate_kv_cache(1, 4, 4, 1, 8, torch.float32, attr=MemoryAttr.UNCACHED)
    assert "UNCACHED" in caplog.text


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_cpu_paged_attention_equals_reference_on_mixed_batches(block_size):
    # decode rows, a full prefill, and a chunk on top of a cached prefix, in one flat batch
    q, kc, vc, meta = paged_batch([9, 1, 17, 33, 5], [1, 1, 17, 6, 1], block_size=block_size)
    ref = kernels.paged_attention(q, kc, vc, meta, scale=0.3)
    got = get_device("cpu").paged_attention(q, kc, vc, meta, scale=0.3)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_decode_attention_ignores_padding_beyond_each_context():
    q, kc, vc, meta = paged_batch([3, 12], [1, 1])
    out = decode_attention(q, kc, vc, _AttentionPlan(meta), 0.5)
    torch.testing.assert_close(out, kernels.paged_attention(q, kc, vc, meta, 0.5))


def test_prefill_attention_matches_reference_causal_attention():
    g = torch.Generator().manual_seed(1)
    q, k, v = (
        torch.randn(5, 4, 8, generator=g),
        torch.randn(9, 2, 8, generator=g),
        torch.randn(9, 2, 8, generator=g),
    )
    torch.testing.assert_close(
        prefill_attention(q, k, v, 0.25),
        kernels._causal_attention(q, k, v, 0.25),
        atol=1e-5,
        rtol=1e-5,
    )


def test_cpu_linear_of_one_row_equals_reference():
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(40, 24, generator=g), torch.randn(1, 24, generator=g)
    torch.testing.assert_close(get_device("cpu").linear(x, w), kernels.linear(x, w))


def test_write_kv_stores_each_token_at_its_slot():
    kc, vc = torch.zeros(3, 4, 2, 8), torch.zeros(3, 4, 2, 8)
    k, v = torch.randn(2, 2, 8), torch.randn(2, 2, 8)
    kernels.write_kv(k, v, kc, vc, torch.tensor([9, 2]))  # page 2 offset 1, page 0 offset 2
    torch.testing.assert_close(kc[2, 1], k[0])
    torch.testing.assert_close(vc[0, 2], v[1])


def test_interleaved_partial_rotary_rotates_adjacent_pairs_of_the_first_dims():
    cos_sin = kernels.rotary_cos_sin(rotary_dim=4, theta=10000.0, max_position=8)
    x = torch.randn(1, 1, 8)
    y = kernels.apply_rotary(x, *kernels.rotary_at(cos_sin, torch.tensor([3])))
    angle0 = torch.tensor(3.0)  # inv_freq[0] = 1
    x0, x1 = x[0, 0, 0], x[0, 0, 1]
    torch.testing.assert_close(y[0, 0, 0], x0 * angle0.cos() - x1 * angle0.sin())
    torch.testing.assert_close(y[0, 0, 1], x1 * angle0.cos() + x0 * angle0.sin())
    torch.testing.assert_close(y[0, 0, 4:], x[0, 0, 4:])  # dims past rotary_dim pass through


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_a_clear_error_naming_the_alternatives():
    with pytest.raises(ValueError, match="needs a GPU.*--device kunlun-emu or cpu"):
        get_device("cuda")
