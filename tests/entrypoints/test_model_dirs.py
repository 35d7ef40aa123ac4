"""Every command that reads a model directory works with the parts a user really has: a Hugging
Face directory of config.json, the weights (one file or shards) and tokenizer.json, with no
tokenizer_config.json, no generation_config.json, no chat template and perhaps no special tokens;
or it says in one line what is missing and what to add (issue: `quantize` died with a TypeError
on such a directory)."""

from __future__ import annotations

import shutil

import pytest
from fastapi.testclient import TestClient

from pagedserve.entrypoints.cli.main import main
from pagedserve.entrypoints.llm import LLM
from pagedserve.sampling_params import SamplingParams
from tests.helpers.models import build_tiny_hf_model, build_tiny_model_dir, build_tiny_tokenizer

LIMITS = dict(device="cpu", dtype="float32", num_kv_pages=64, max_model_len=128)
PROMPT_IDS = [5, 6, 7, 8]
KINDS = ["bare", "sharded", "no_special_tokens"]


def _keep_only(model_dir, *names: str) -> None:
    for path in model_dir.iterdir():
        if path.name not in names and not path.name.startswith("model-"):
            path.unlink()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """The complete tiny model and three stripped copies of the same weights."""
    root = tmp_path_factory.mktemp("model-dirs")
    build_tiny_model_dir(root / "full", "glm4")
    dirs = {"full": root / "full"}
    shutil.copytree(root / "full", root / "bare")
    _keep_only(root / "bare", "config.json", "model.safetensors", "tokenizer.json")
    build_tiny_hf_model(root / "sharded", "glm4", max_shard_size="40KB")
    shutil.copy(root / "full" / "tokenizer.json", root / "sharded")
    _keep_only(root / "sharded", "config.json", "model.safetensors.index.json", "tokenizer.json")
    shutil.copytree(root / "bare", root / "no_special_tokens")
    build_tiny_tokenizer(root / "no_special_tokens", special_tokens=())
    _keep_only(root / "no_special_tokens", "config.json", "model.safetensors", "tokenizer.json")
    for kind in KINDS:
        dirs[kind] = root / kind
    assert len(list(dirs["sharded"].glob("model-*.safetensors"))) > 1
    return dirs


def _greedy_ids(model_dir) -> list[int]:
    llm = LLM(str(model_dir), **LIMITS)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    (out,) = llm.generate({"prompt_token_ids": PROMPT_IDS}, params, use_tqdm=False)
    (text_out,) = llm.generate("Hello world", SamplingParams(max_tokens=3), use_tqdm=False)
    assert text_out.outputs[0].finish_reason in ("length", "stop")
    return list(out.outputs[0].token_ids)


@pytest.mark.parametrize("kind", KINDS)
def test_llm_generates_from_a_partial_directory_as_from_the_complete_one(model_dirs, kind):
    assert _greedy_ids(model_dirs[kind]) == _greedy_ids(model_dirs["full"])


def test_chat_without_a_template_says_in_one_line_what_to_add(model_dirs):
    llm = LLM(str(model_dirs["bare"]), **LIMITS)
    with pytest.raises(ValueError) as e:
        llm.chat([{"role": "user", "content": "Hi"}], use_tqdm=False)
    message = str(e.value)
    assert "\n" not in message and "chat_template.jinja" in message


def test_serve_completes_and_answers_chat_without_a_template_with_a_400(model_dirs):
    from pagedserve.config import EngineConfig
    from pagedserve.engine.llm_engine import LLMEngine
    from pagedserve.server.app import build_app

    engine = LLMEngine(EngineConfig.from_kwargs(model=str(model_dirs["bare"]), **LIMITS))
    with TestClient(build_app(engine, "bare")) as client:
        r = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2})
        assert r.status_code == 200, r.text
        r = client.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]}
        )
        assert r.status_code == 400 and "chat_template.jinja" in r.json()["error"]["message"]


@pytest.mark.parametrize("kind", KINDS)
def test_quantize_eval_quant_and_tune_read_a_partial_directory(model_dirs, kind, tmp_path, capsys):
    model_dir, out = str(model_dirs[kind]), str(tmp_path / "int4")
    calib = ["--quant-method", "rtn", "--calib-samples", "2", "--calib-seq-len", "32"]
    assert main(["quantize", "--model-path", model_dir, "--output-path", out, *calib]) == 0
    evaluate = ["--num-samples", "2", "--seq-len", "32", "--max-tokens", "4", "--prompt-len", "8"]
    rc = main(["eval-quant", "--reference", model_dir, "--candidate", out, *evaluate])
    assert rc in (0, 1) and "verdict" in capsys.readouterr().out  # it ran and judged
    assert main(["tune", "--model", model_dir, "--device", "cpu"]) == 0


# ---- damaged directories: one line naming the file, what is wrong and what to do -------------
def _damage(model_dirs, tmp_path, kind: str):
    """A copy of the bare directory with one file damaged as users' copies get damaged."""
    path = tmp_path / kind
    shutil.copytree(model_dirs["bare"], path)
    config, weights = path / "config.json", path / "model.safetensors"
    if kind == "config_without_a_key":
        config.write_text(config.read_text().replace('"num_attention_heads"', '"num_heads"'))
    elif kind == "config_not_json":
        config.write_text(config.read_text().replace("{", "{\n  ,", 1))
    elif kind == "weights_truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif kind == "weights_header_truncated":
        weights.write_bytes(weights.read_bytes()[:40])
    return path


DAMAGED = {  # what the one line says: the file, what is wrong, what to do
    "config_without_a_key": (
        "config.json",
        "missing 'num_attention_heads', which a 'glm4' model needs",
        "add it from the checkpoint's original config.json",
    ),
    "config_not_json": (
        "config.json",
        "not valid JSON (Expecting property name enclosed in double quotes at line 2, column 3)",
        "fix it, or copy config.json again from the checkpoint",
    ),
    "weights_truncated": (
        "model.safetensors",
        "truncated: it holds",
        "copy or download it again from the checkpoint",
    ),
    "weights_header_truncated": (
        "model.safetensors",
        "truncated: it holds 40 bytes, not even its whole header",
        "copy or download it again from the checkpoint",
    ),
}


def _says_what_is_wrong(message: str, path, kind: str) -> None:
    name, problem, fix = DAMAGED[kind]
    assert "\n" not in message.strip() and "Traceback" not in message
    assert message.startswith(f"{path / name}: {problem}") and message.rstrip().endswith(fix)


@pytest.mark.parametrize("kind", DAMAGED)
def test_llm_names_the_damaged_file_what_is_wrong_and_what_to_do(model_dirs, tmp_path, kind):
    from pagedserve.models.model_dir import ModelDirError

    path = _damage(model_dirs, tmp_path, kind)
    with pytest.raises(ModelDirError) as e:
        LLM(str(path), **LIMITS)
    _says_what_is_wrong(str(e.value), path, kind)
    # no "During handling of the above exception" with a KeyError under it
    assert e.value.__context__ is None or e.value.__suppress_context__


@pytest.mark.parametrize("kind", DAMAGED)
def test_serve_says_it_in_one_line_before_starting_the_engine(
    model_dirs, tmp_path, kind, capsys, monkeypatch
):
    from pagedserve.engine.async_engine import AsyncLLMEngine

    def no_engine(*args, **kwargs):
        raise AssertionError("the engine core was started")

    monkeypatch.setattr(AsyncLLMEngine, "from_config", no_engine)
    path = _damage(model_dirs, tmp_path, kind)
    assert main(["serve", "--model", str(path), "--port", "0", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    _says_what_is_wrong(err.removeprefix("pagedserve serve: error: "), path, kind)
