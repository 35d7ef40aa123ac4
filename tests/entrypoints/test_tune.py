"""`pagedserve tune` figures checked against sums written out by hand from the published shapes."""

from __future__ import annotations

import json
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pagedserve.engine import memory_plan as tune_mod
from pagedserve.engine.memory_plan import TuneError, explain, tune
from pagedserve.entrypoints.cli.tune import add_tune_args, run_tune
from pagedserve.hal.cpu_targets import TARGETS
from pagedserve.hal.memory import parse_bytes

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "pagedserve" / "configs"  # the packaged presets (configs/ links to them)
GIB = 2**30

# GLM-4-9B-chat (GLM4.md): 40 layers, hidden 4096, 32 heads, 2 kv heads, head_dim 128,
# intermediate 13696, vocab 151552, qkv bias, untied lm_head.
L, H, NH, KV, D, INTER, V = 40, 4096, 32, 2, 128, 13696, 151552


# The emulated Kunlun cards run on this machine's CPU: pinned to an AVX2 CPU (the fixture below),
# their INT4 tiles keep a group's zero point in one byte on x86; two in PyTorch's layout elsewhere.
AVX2_CPU = " ".join(TARGETS["avx2"].cpu_flags)
ON_X86 = platform.machine().lower() in TARGETS["avx2"].machines
TILES_ZERO_POINT = 1 if ON_X86 else 2


def _hand_int4_linear(k: int, n: int, group: int = 32, zero_point: int = TILES_ZERO_POINT) -> int:
    return k * n // 2 + (k // group) * n * (2 + zero_point)  # codes; a 2-byte scale, the zero


def _hand_9b_weights(tp: int, int4: bool, zero_point: int = TILES_ZERO_POINT) -> int:
    kv_rank = max(1, KV // tp)
    shapes = [
        (H, NH * D // tp),
        (H, kv_rank * D),
        (H, kv_rank * D),
        (NH * D // tp, H),
        (H, 2 * INTER // tp),
        (INTER // tp, H),
    ]
    linear = sum(_hand_int4_linear(k, n, 32, zero_point) if int4 else 2 * k * n for k, n in shapes)
    bias = NH * D // tp + 2 * kv_rank * D
    sixteen_bit = 2 * (2 * (V // tp) * H + H + L * (2 * H + bias))
    return sixteen_bit + L * linear


def _parse(argv: list[str]):
    import argparse

    return add_tune_args(argparse.ArgumentParser()).parse_args(argv)


@pytest.fixture(autouse=True)
def avx2_cpu(monkeypatch):
    """Plans as on an AVX2 CPU, whichever this one is (the INT4 zero points' bytes follow it)."""
    monkeypatch.setenv("PAGEDSERVE_CPU_FLAGS", AVX2_CPU)


@pytest.fixture(autouse=True)
def roomy_host(monkeypatch):
    """Plans as on a machine with RAM to spare, whatever else runs on this one: an emulated pool
    is bounded by its device alone (the host's bound has tests that pass ``host_limit``)."""
    monkeypatch.setattr(tune_mod, "host_memory_limit", lambda: float("inf"))


def test_glm4_9b_chat_on_kunlun_matches_hand_computation(capsys):
    code = run_tune(
        _parse(
            [
                "--model",
                "glm-4-9b-chat",
                "--device",
                "kunlun-xpu-32g",
                "--max-model-len",
                "131072",
                "--json",
            ]
        )
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kv_bytes_per_token"] == 40960 == 2 * L * KV * D * 2
    assert (
        out["kv_bytes_per_token"] * 131072 == 5 * GIB
    )  # not the Kunlun XPU deployment guide's ~4.6 GB
    assert out["weight_bytes"] == _hand_9b_weights(tp=1, int4=True)
    assert round(out["weight_bytes"] / GIB, 2) == (6.82 if ON_X86 else 7.06)  # as the README says

    # one HBM of 32 GiB: the weights are paid from 0.9 of it, the rest is the pool (the KV
    # tier is the whole HBM, so it does not bind)
    pool = int(32 * GIB * 0.9 - out["weight_bytes"])
    assert out["kv_pool_bound"] == "memory budget" and out["kv_pool_bytes"] == pool
    pages = pool // (16 * 40960)
    assert out["num_kv_pages"] == pages
    assert out["max_num_seqs"] == pages // (131072 // 16) == 4
    assert out["max_concurrency"] == pages * 16 / 131072
    assert out["max_num_batched_tokens"] == 2048
    assert set(out) >= {
        "kv_bytes_per_token",
        "weight_bytes",
        "num_kv_pages",
        "max_num_seqs",
        "max_num_batched_tokens",
        "launch_script",
    }


def test_the_kv_tier_caps_the_pool_of_the_default_device():
    r = tune("demo", host_limit=float("inf"))  # serve's default device, kunlun-emu
    assert r.device == "kunlun-emu" and r.kv_pool_limits["kv tier"] == 2 * GIB
    assert r.kv_pool_bound == "kv tier"
    assert r.num_kv_pages == 2 * GIB // (16 * r.kv_bytes_per_token) == 65536
    assert r.max_concurrency == 65536 * 16 / 2048 == 512
    assert r.max_num_seqs == 256  # vLLM's cap, below the 512 sequences the pages hold


def test_an_emulated_pool_stops_at_half_the_hosts_free_ram_and_says_so():
    host = 3 * GIB
    r = tune("glm-4-9b-chat", "kunlun-xpu-32g", max_model_len=32768, host_limit=host)
    assert r.kv_pool_bound == "host memory" and r.kv_pool_bytes == host
    assert r.num_kv_pages == host // (16 * 40960)
    text = explain(r)
    assert "this machine's RAM sets the pool" in text
    card = int(32 * GIB * 0.9 - r.weight_bytes) // (16 * 40960)
    assert f"the card alone would hold {card} pages" in text


def test_a_host_too_small_for_one_sequence_is_named_as_the_bound():
    with pytest.raises(TuneError, match=r"set by the host memory.*free memory on this machine"):
        tune("glm-4-9b-chat", "kunlun-xpu-32g", max_model_len=131072, host_limit=4 * GIB)


def test_a_device_outside_host_memory_has_no_host_bound():
    r = tune("glm-4-9b-chat", "cuda-h200", max_model_len=8192, host_limit=1.0)
    assert "host memory" not in r.kv_pool_limits


def test_tune_model_demo_plans_for_serves_default_device(capsys):
    from pagedserve.entrypoints.cli.main import main

    assert main(["tune", "--model", "demo", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["device"] == "kunlun-emu"
    assert "--device kunlun-emu" in out["launch_script"]


def test_the_explanation_quotes_no_other_models_figures():
    text = explain(tune("demo", host_limit=float("inf")))
    assert "4.6 GB" not in text and "5.00 GiB" not in text
    assert "4.00 MiB  2048 tokens x KV bytes per token" in text  # the demo's own: 2 KiB a token


def test_the_launch_script_serves_the_model_name_the_readmes_requests_send():
    readme = (ROOT / "README.md").read_text()
    sent = set(re.findall(r'"model": "([^"]+)"', readme))
    adapters = set(re.findall(r"--lora-modules ([\w-]+)=", readme))  # LoRA: a model name too
    assert sent - adapters == {"demo"} and adapters
    assert "--served-model-name demo" in tune("demo").launch_script
    nine_b = tune("glm-4-9b-chat", "kunlun-xpu-32g", max_model_len=8192)
    assert "--served-model-name glm-4-9b-chat" in nine_b.launch_script


def test_tensor_parallel_splits_weights_and_replicates_kv_heads():
    tp2 = tune("glm-4-9b-chat", "kunlun-p800x8", tensor_parallel_size=2, max_model_len=32768)
    tp4 = tune("glm-4-9b-chat", "kunlun-p800x8", tensor_parallel_size=4, max_model_len=32768)
    assert tp2.weight_bytes == _hand_9b_weights(tp=2, int4=True)
    assert tp4.weight_bytes == _hand_9b_weights(tp=4, int4=True)
    assert tp2.kv_bytes_per_token == 2 * L * 1 * D * 2
    assert tp4.kv_bytes_per_token == tp2.kv_bytes_per_token  # 2 kv heads over 4 ranks: replicated


def test_int4_zero_points_take_what_the_devices_kernels_pack(monkeypatch):
    """An emulated card packs as this CPU's kernels do: one byte a zero point in the avx2 and
    avx512 tiles, two on a CPU that has neither (PyTorch's layout); a CUDA card's plan keeps the
    checkpoint's two."""
    emulated = tune("glm-4-9b-chat", "kunlun-xpu-32g", max_model_len=8192)
    assert emulated.quant_zero_point_bytes == TILES_ZERO_POINT
    assert f"a 2 B scale and a {TILES_ZERO_POINT} B zero point per group of 32" in explain(emulated)
    monkeypatch.setenv("PAGEDSERVE_CPU_FLAGS", "")  # the portable kernels: PyTorch's INT4 layout
    portable = tune("glm-4-9b-chat", "kunlun-xpu-32g", max_model_len=8192)
    assert portable.quant_zero_point_bytes == 2
    assert portable.weight_bytes == _hand_9b_weights(tp=1, int4=True, zero_point=2)
    assert round(portable.weight_bytes / GIB, 2) == 7.06  # the checkpoint's form, as README says
    cuda = tune("glm-4-9b-chat", "cuda-h200", max_model_len=8192)
    assert cuda.quant_zero_point_bytes == 2 and cuda.weight_bytes == portable.weight_bytes


def test_unquantized_weights_are_two_bytes_per_parameter():
    r = tune("glm-4-9b-chat", "cuda-h200", quantization="none", max_model_len=8192)
    assert r.weight_bytes == _hand_9b_weights(tp=1, int4=False)
    params = r.weight_bytes // 2
    assert 9.3e9 < params < 9.5e9  # GLM-4-9B has 9.4B parameters


def test_32b_on_32g_device_refuses_bf16_weights_and_fits_int4():
    with pytest.raises(TuneError, match="weights do not fit"):
        tune("glm-4-32b-0414", "kunlun-xpu-32g", quantization="none")
    r = tune("glm-4-32b-0414", "kunlun-xpu-32g", max_model_len=32768)
    assert r.kv_bytes_per_token == 2 * 61 * 2 * 128 * 2
    assert r.max_num_seqs >= 1


def test_refuses_tensor_parallel_size_that_does_not_divide_heads():
    with pytest.raises(TuneError, match="does not divide the 32 attention heads"):
        tune("glm-4-9b-chat", "kunlun-p800x8", tensor_parallel_size=3)


def test_refuses_max_model_len_beyond_context():
    with pytest.raises(TuneError, match="beyond glm-4-9b-0414's context of 32768"):
        tune("glm-4-9b-0414", "kunlun-xpu-32g", max_model_len=65536)


def test_refuses_when_one_sequence_does_not_fit_and_says_how_much_is_missing():
    with pytest.raises(TuneError, match=r"not even one sequence.*GiB missing"):
        tune("glm-4-9b-chat-1m", "kunlun-xpu-32g", max_model_len=1048576)


def test_cli_reports_refusal_on_stderr(capsys):
    code = run_tune(
        _parse(
            [
                "--model",
                "glm-4-9b-chat",
                "--device",
                "kunlun-xpu-32g",
                "--tensor-parallel-size",
                "3",
            ]
        )
    )
    assert code != 0
    assert "attention heads" in capsys.readouterr().err


def test_model_directory_config_json_is_read(tmp_path):
    cfg = yaml.safe_load((CONFIGS / "models/glm-4-9b-chat.yaml").read_text())
    cfg.pop("name"), cfg.pop("architecture")
    cfg["model_type"] = "glm"
    cfg["rope_parameters"] = {"rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    from_dir = tune(str(tmp_path), "kunlun-xpu-32g", max_model_len=8192)
    from_preset = tune("glm-4-9b-chat", "kunlun-xpu-32g", max_model_len=8192)
    assert from_dir.weight_bytes == from_preset.weight_bytes
    assert str(tmp_path) in from_dir.launch_script


def test_presets_have_the_published_shapes_and_device_schema():
    shapes = {
        "glm-4-9b-chat": (40, 4096, 32, 2, 13696, 131072),
        "glm-4-9b-chat-1m": (40, 4096, 32, 4, 13696, 1048576),
        "glm-4-9b-0414": (40, 4096, 32, 2, 13696, 32768),
        "glm-4-32b-0414": (61, 6144, 48, 2, 23040, 32768),
    }
    for name, expected in shapes.items():
        _, s = tune_mod.load_model(name)
        got = (
            s.num_hidden_layers,
            s.hidden_size,
            s.num_attention_heads,
            s.num_key_value_heads,
            s.intermediate_size,
            s.max_position_embeddings,
        )
        assert got == expected, name
        assert (s.head_dim, s.vocab_size) == (128, 151552)
    for path in (CONFIGS / "devices").glob("*.yaml"):
        cfg = yaml.safe_load(path.read_text())
        assert cfg["name"] == path.stem
        assert cfg["backend"] in ("kunlun-emu", "cpu", "cuda")
        assert set(cfg["tiers"]) == {"kv", "weight", "host"}
        assert parse_bytes(cfg["memory_bytes"]) > 0
        assert cfg["kv_memory_attr"] in ("cached", "uncached")
        assert isinstance(cfg["int4_unit"], bool)
    assert tune_mod.card_memory_bytes(tune_mod.load_device("kunlun-xpu-32g")) == 32 * GIB


def test_demo_preset_has_the_shipped_demo_models_shapes():
    preset = yaml.safe_load((CONFIGS / "models/glm4-demo.yaml").read_text())
    shipped = json.loads((ROOT / "pagedserve/demo_model/config.json").read_text())
    for key in (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "vocab_size",
        "max_position_embeddings",
    ):
        assert preset[key] == shipped[key], key


def test_demo_model_fits_the_small_emulated_device():
    r = tune("glm4-demo", "kunlun-emu-small", max_model_len=2048)
    assert r.max_num_seqs >= 1


def test_write_produces_an_executable_launch_script(tmp_path):
    path = tmp_path / "launch.sh"
    code = run_tune(
        _parse(
            [
                "--model",
                "glm-4-9b-chat",
                "--device",
                "kunlun-xpu-32g",
                "--max-model-len",
                "32768",
                "--write",
                str(path),
            ]
        )
    )
    assert code == 0
    text = path.read_text()
    assert path.stat().st_mode & 0o111
    assert "exec pagedserve serve" in text
    r = tune("glm-4-9b-chat", "kunlun-xpu-32g", max_model_len=32768)
    assert f"--max-num-seqs {r.max_num_seqs}" in text
    assert f"--max-num-batched-tokens {r.max_num_batched_tokens}" in text
    subprocess.run(["bash", "-n", str(path)], check=True)


def test_module_entry_point_runs():
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedserve",
            "tune",
            "--model",
            "glm-4-9b-chat",
            "--device",
            "cuda-h200",  # a card whose pool no host RAM bounds: the same answer on any machine
            "--max-model-len",
            "131072",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "40960" in proc.stdout and "5.00 GiB" in proc.stdout


def test_tp_size_divides_the_weights_per_card_and_says_whether_it_fits(capsys):
    from pagedserve.entrypoints.cli.main import main

    flags = ["tune", "--model", "glm-4-9b-chat", "--device", "kunlun-emu", "--quantization", "none"]
    assert main(flags) == 2
    assert "use --tensor-parallel-size 4" in capsys.readouterr().err  # 17.5 GiB on 8 GiB cards
    assert main([*flags, "--tp-size", "4", "--max-model-len", "32768"]) == 0
    assert "fits on 4 cards of kunlun-emu" in capsys.readouterr().out
    assert main([*flags, "--tp-size", "16"]) == 2
    assert "8 per node" in capsys.readouterr().err


def test_int8_kv_nearly_doubles_the_sequences_that_fit_and_tune_and_a_live_server_agree(tmp_path):
    """The same KV bytes per token in the plan and in the running server's pool, and the same
    gain in sequences: 2 x head_dim bytes a head in bf16 against head_dim + 4 in INT8."""
    import httpx

    from pagedserve.config import EngineConfig
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.server.app import build_app
    from pagedserve.testing import serve_app
    from tests.helpers.models import build_tiny_hf_model

    build_tiny_hf_model(tmp_path, "glm4", head_dim=128, max_position_embeddings=4096)
    planned, served = {}, {}
    for kv_cache_dtype in ("auto", "int8"):
        plan = tune(
            str(tmp_path), "kunlun-emu-small", max_model_len=4096, kv_cache_dtype=kv_cache_dtype
        )
        assert ("--kv-cache-dtype int8" in plan.launch_script) == (kv_cache_dtype == "int8")
        config = EngineConfig.from_kwargs(
            model=str(tmp_path),
            device="kunlun-emu-small",
            dtype="bfloat16",
            kv_cache_dtype=kv_cache_dtype,
            max_model_len=4096,
        )
        with serve_app(build_app(LLMEngine(config), "tiny")) as url:
            kv = httpx.get(url + "/device", timeout=30).json()["kv_pages"]
        assert (
            kv["bytes_per_token"]
            == plan.kv_bytes_per_token
            == 2 * 2 * 2 * (128 * 2 if kv_cache_dtype == "auto" else 128 + 4)
        )
        planned[kv_cache_dtype] = plan.num_kv_pages // plan.pages_per_seq
        served[kv_cache_dtype] = kv["total"] // plan.pages_per_seq
    gain = 256 / 132
    assert planned["int8"] / planned["auto"] == pytest.approx(gain, rel=0.01)
    assert served["int8"] / served["auto"] == pytest.approx(gain, rel=0.01)
