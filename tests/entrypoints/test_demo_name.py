"""`demo` names the embedded demo model in every command and in `LLM(...)`."""

from __future__ import annotations

import json
from dataclasses import asdict

from pagedserve.benchmarks import datasets
from pagedserve.engine.memory_plan import tune
from pagedserve.entrypoints.cli.main import main
from pagedserve.presets import demo_model_dir


def test_tune_model_demo_is_the_demo_models_preset_and_launches_it(capsys):
    assert main(["tune", "--model", "demo", "--device", "kunlun-emu-small", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    by_preset_name = asdict(tune("glm4-demo", "kunlun-emu-small"))
    for key in ("model", "weight_bytes", "kv_bytes_per_token", "num_kv_pages", "max_num_seqs"):
        assert result[key] == by_preset_name[key], key
    script = result["launch_script"]
    assert "--model demo" in script and "MODEL_DIR" not in script


def test_bench_tokenizer_demo_is_the_demo_models_tokenizer():
    from tokenizers import Tokenizer

    shipped = Tokenizer.from_file(str(demo_model_dir() / "tokenizer.json"))
    prompts = datasets.PromptBuilder(datasets.local_tokenizer("demo"))
    text = "def fibonacci(n):\n    return n"
    bare = len(shipped.encode(text, add_special_tokens=False).ids)
    assert prompts.count(text, as_prompt=False) == bare > 0


def test_bench_tokenizer_that_is_not_there_is_named_in_the_error(tmp_path, capsys):
    missing = str(tmp_path / "nowhere")
    code = main(["bench", "--model", "m", "--tokenizer", missing, "--base-url", "http://unused"])
    err = capsys.readouterr().err
    assert code == 2
    assert f"--tokenizer {missing!r}" in err and "demo" in err and "Errno" not in err


def test_quantize_and_eval_quant_take_demo(tmp_path, capsys):
    out = tmp_path / "demo-rtn"
    quantize = ["quantize", "--model-path", "demo", "--output-path", str(out)]
    calib = ["--quant-method", "rtn", "--calib-samples", "2", "--calib-seq-len", "32"]
    assert main([*quantize, *calib]) == 0
    assert json.loads((out / "config.json").read_text())["quantization_config"]["bits"] == 4
    report = tmp_path / "eval.json"
    evaluate = ["eval-quant", "--reference", "demo", "--candidate", str(out), "--json", str(report)]
    assert main([*evaluate, "--num-samples", "2", "--seq-len", "64", "--max-tokens", "4"]) == 0
    assert json.loads(report.read_text())["ppl_reference"] > 1


def test_llm_model_demo_loads_the_embedded_model():
    from pagedserve import LLM, SamplingParams

    llm = LLM(model="demo", num_kv_pages=16)
    assert llm.llm_engine.model_path == demo_model_dir()
    out = llm.generate(["def add(a, b):"], SamplingParams(max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
