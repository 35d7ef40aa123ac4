"""LoRA's settings as vLLM users write them: --lora-modules in both forms, and each setting that
cannot work named as the user wrote it (serve's flag, LLM's keyword)."""

from __future__ import annotations

import pytest

from pagedserve import LLM, LoRARequest, SamplingParams
from pagedserve.entrypoints.cli.main import build_parser
from pagedserve.entrypoints.cli.serve import engine_kwargs


def _serve_args(*flags: str):
    return build_parser().parse_args(["serve", *flags])


def test_lora_modules_take_name_equals_path_and_vllms_json_form():
    args = _serve_args(
        "--enable-lora",
        "--max-loras", "4",
        "--lora-modules", "sql=/adapters/sql",
        '{"name": "chat", "path": "/adapters/chat", "base_model_name": "glm-4"}',
    )  # fmt: skip
    kwargs = engine_kwargs(args)
    assert kwargs["enable_lora"] and kwargs["max_loras"] == 4
    assert kwargs["lora_modules"] == [
        {"name": "sql", "path": "/adapters/sql", "base_model_name": None},
        {"name": "chat", "path": "/adapters/chat", "base_model_name": "glm-4"},
    ]


@pytest.mark.parametrize(
    "entry, words",
    [
        ("sql", "neither name=path nor a JSON object"),
        ('{"name": "chat"}', "missing ['path']"),
        ('{"name": "a", "path": "/p", "rank": 8}', "unknown keys ['rank']"),
        ("{oops", "not valid JSON"),
    ],
)
def test_a_bad_lora_modules_entry_is_an_error_naming_the_flag(entry, words, capsys):
    with pytest.raises(SystemExit) as e:
        _serve_args("--enable-lora", "--lora-modules", entry)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--lora-modules" in err and words in err, err


def test_settings_that_cannot_work_are_named_as_the_user_wrote_them(tiny_glm4):
    model = str(tiny_glm4[0])
    with pytest.raises(ValueError, match=r"lora_modules needs LoRA turned on: create the LLM"):
        LLM(model, device="cpu", lora_modules=[{"name": "a", "path": "/a"}])
    with pytest.raises(ValueError, match=r"max_cpu_loras=1 is less than max_loras=2"):
        LLM(model, device="cpu", enable_lora=True, max_loras=2, max_cpu_loras=1)


def test_an_adapter_asked_of_an_engine_without_lora_is_rejected_saying_how(tiny_glm4):
    llm = LLM(str(tiny_glm4[0]), dtype="float32", device="cpu", num_kv_pages=64)
    out = llm.generate(
        {"prompt_token_ids": [11, 12]},
        SamplingParams(max_tokens=2),
        use_tqdm=False,
        lora_request=LoRARequest("sql", 1, "/nowhere"),
    )[0]
    assert out.outputs[0].finish_reason == "rejected"
    assert "LoRA is off" in out.error and "enable_lora=True" in out.error


def test_lora_request_is_vllms_record():
    r = LoRARequest("sql", 3, "/adapters/sql")
    assert (r.lora_name, r.lora_int_id, r.lora_path) == ("sql", 3, "/adapters/sql")
    assert (r.name, r.adapter_id, r.path) == ("sql", 3, "/adapters/sql")
    with pytest.raises(ValueError, match="lora_int_id must be an integer > 0"):
        LoRARequest("sql", 0, "/adapters/sql")


def test_tune_counts_the_device_slots_the_engine_allocates(tiny_glm4):
    """``pagedserve tune --enable-lora`` plans the slots by the rule the engine allocates them
    by: the same bytes, charged to the weight tier before the KV pool is sized."""
    from pagedserve.engine.memory_plan import tune
    from pagedserve.lora.sizes import slots_nbytes

    model = str(tiny_glm4[0])
    plan = tune(model, "cpu", max_model_len=256, max_loras=2, max_lora_rank=16)
    base = tune(model, "cpu", max_model_len=256)
    assert plan.lora_bytes > 0 and plan.weight_bytes == base.weight_bytes + plan.lora_bytes
    script = " ".join(plan.launch_script.replace("\\", "").split())
    assert "--enable-lora --max-loras 2 --max-lora-rank 16" in script
    llm = LLM(model, dtype="bfloat16", device="cpu", enable_lora=True, max_loras=2)
    slots = llm.llm_engine.executor.worker.lora
    config = llm.llm_engine.model_config
    assert slots.nbytes == plan.lora_bytes == slots_nbytes(config, 1, 2, 16, 2)
    tier = llm.llm_engine.device.tiers["weight"]
    assert (
        sum(a.nbytes for a in tier.allocations.values() if a.tag.startswith("lora."))
        == slots.nbytes
    )
