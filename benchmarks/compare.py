"""pagedserve against its peers on this machine, one after the other, on the same models.

    python -m benchmarks.compare --setup          # once: llama.cpp (llama-cpp-python 0.3.36 from
                                                  # PyPI, built here: ~6 min) in its own venv
    python -m benchmarks.compare [--runs 3]       # the comparison; writes benchmarks/results/compare.json

Measures (each figure the median of 5 timed repetitions after a warm-up; with --runs N the whole
comparison repeats N times and the report gives the median and the range):
- batch 1: a 32-token prompt then 64 greedy tokens, whole time, tokens/s = 64 / seconds;
  pagedserve INT4 (group 32; W4A16 `int4` and W4A8 `w4a8`; lm_head as --lm-head says, INT4 by
  default as llama.cpp's Q4_0 files quantize theirs, to Q6_K) against llama.cpp Q4_0
  (llama-cpp-python, 2 threads, converted with llama.cpp's own converter from the same
  checkpoint), on the ~122M and ~1B random GLM-4-0414 models of bench_models.py;
- offline: 16 prompts of 16-128 tokens x 64 new tokens (greedy, no early stop), output tokens/s,
  pagedserve INT4 against transformers `generate` in bf16, on the ~122M model.

No prefix caching across repetitions: every run computes its prompts, as the peers do.

Each system runs in its own process. Check `uptime` first: nothing else should be running.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from benchmarks.bench_models import build_model, cache_root, num_parameters
from benchmarks.results import spread, write_result

ROOT = Path(__file__).resolve().parents[1]  # where `python -m benchmarks.compare` runs

LLAMA_VERSION = "0.3.36"
PROMPT_LEN, NEW_TOKENS, REPEATS = 32, 64, 5
OFFLINE_PROMPTS = 16


# ---- workers (each runs in its own process: `compare.py --worker NAME ...`) ---------------------
def batch1_prompt() -> list[int]:
    return list(range(10, 10 + PROMPT_LEN))


def offline_prompts() -> list[list[int]]:
    lengths = [16 + (112 * i) // (OFFLINE_PROMPTS - 1) for i in range(OFFLINE_PROMPTS)]
    return [[(37 * i + 11 * j) % 7000 + 20 for j in range(n)] for i, n in enumerate(lengths)]


def timed_median(run, repeats: int = REPEATS) -> float:
    """Median seconds of ``run()`` after one warm-up."""
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def worker_pagedserve(model: str, quantization: str, lm_head: str, batch: str) -> float:
    from pagedserve import LLM, SamplingParams

    llm = LLM(
        model=model,
        dtype="bfloat16",
        quantization=quantization,
        quantize_lm_head=lm_head,
        max_model_len=2048,
        enable_prefix_caching=False,  # every repetition computes its prompts, as the peers do
    )
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = [batch1_prompt()] if batch == "1" else offline_prompts()
    inputs = [{"prompt_token_ids": p} for p in prompts]
    seconds = timed_median(lambda: llm.generate(inputs, params, use_tqdm=False))
    return len(prompts) * NEW_TOKENS / seconds


def worker_transformers(model: str) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).eval()
    prompts = offline_prompts()
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def run():
        with torch.inference_mode():
            hf.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )

    return len(prompts) * NEW_TOKENS / timed_median(run, repeats=3)


LLAMA_WORKER = """
import statistics, sys, time
from llama_cpp import Llama
path, prompt_len, new_tokens, repeats = sys.argv[1], *map(int, sys.argv[2:5])
llm = Llama(model_path=path, n_ctx=256, n_threads=2, n_batch=256, verbose=False)
prompt = list(range(10, 10 + prompt_len))
def run():
    llm.reset()
    llm.eval(prompt)
    for i in range(new_tokens):
        llm.eval([(prompt[-1] + i) % 600 + 5])
run()
times = []
for _ in range(repeats):
    start = time.perf_counter(); run(); times.append(time.perf_counter() - start)
print(new_tokens / statistics.median(times))
"""


# ---- llama.cpp: setup and conversion -------------------------------------------------------------
def llama_paths(root: Path) -> tuple[Path, Path]:
    venv = root / "llama-venv"
    converter = root / "llama-sdist" / f"llama_cpp_python-{LLAMA_VERSION}" / "vendor" / "llama.cpp"
    return venv, converter


def setup_llama(root: Path) -> None:
    venv, converter = llama_paths(root)
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    print(
        f"installing llama-cpp-python {LLAMA_VERSION} (compiles llama.cpp: ~6 min) ...", flush=True
    )
    subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", f"llama-cpp-python=={LLAMA_VERSION}",
         "torch==2.13.0", "transformers", "safetensors", "numpy", "sentencepiece"],
        check=True,
        env={"CMAKE_BUILD_PARALLEL_LEVEL": "2", **os.environ},
    )  # fmt: skip
    sdist_dir = converter.parents[2]
    sdist_dir.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [str(venv / "bin" / "pip"), "download", "-q", "--no-binary", ":all:", "--no-deps",
         f"llama-cpp-python=={LLAMA_VERSION}", "-d", str(sdist_dir)],
        check=True,
    )  # fmt: skip
    with tarfile.open(sdist_dir / f"llama_cpp_python-{LLAMA_VERSION}.tar.gz") as tar:
        tar.extractall(sdist_dir, filter="data")
    print(f"llama.cpp ready in {venv}")


CONVERT = """
import runpy, sys
llama_cpp_dir, model, out_f16, out_q4 = sys.argv[1:5]
import conversion.base as base  # llama.cpp's converter and gguf-py: on PYTHONPATH
# the benchmark tokenizer is our own BPE, not GLM-4's: name its pre-tokenizer for the converter
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "glm4"
sys.argv = ["convert_hf_to_gguf.py", model, "--outtype", "f16", "--outfile", out_f16]
runpy.run_path(llama_cpp_dir + "/convert_hf_to_gguf.py", run_name="__main__")
import llama_cpp
p = llama_cpp.llama_model_quantize_default_params()
p.ftype, p.nthread = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, 2
assert llama_cpp.llama_model_quantize(out_f16.encode(), out_q4.encode(), p) == 0
"""


def gguf_q4_0(model: Path, root: Path) -> Path:
    out = model / "q4_0.gguf"
    if out.exists():
        return out
    venv, converter = llama_paths(root)
    print(f"converting {model.name} to GGUF Q4_0 with llama.cpp's converter ...", flush=True)
    subprocess.run(
        [str(venv / "bin" / "python"), "-c", CONVERT, str(converter), str(model),
         str(model / "f16.gguf"), str(out)],
        check=True, capture_output=True,
        env={**os.environ, "PYTHONPATH": f"{converter}:{converter}/gguf-py"},
    )  # fmt: skip
    (model / "f16.gguf").unlink()
    return out


def llama_batch1(gguf: Path, root: Path) -> float:
    venv, _ = llama_paths(root)
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", LLAMA_WORKER, str(gguf), str(PROMPT_LEN),
         str(NEW_TOKENS), str(REPEATS)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return float(out.stdout.strip().splitlines()[-1])


# ---- the comparison ------------------------------------------------------------------------------
def run_worker(*args: str) -> float:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.compare", "--worker", *args],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def one_run(args: argparse.Namespace, root: Path) -> dict:
    rows = {}
    for name in args.models:
        model = build_model(name)
        key = f"batch1_{name}"
        rows[key] = {}
        for q in args.quantization:
            print(f"[{key}] pagedserve {q} (lm_head {args.lm_head}) ...", flush=True)
            rows[key][f"pagedserve {q}"] = run_worker(
                "pagedserve", str(model), q, args.lm_head, "1"
            )
        if not args.skip_llama:
            print(f"[{key}] llama.cpp Q4_0 ...", flush=True)
            rows[key]["llama.cpp"] = llama_batch1(gguf_q4_0(model, root), root)
    if "122m" in args.models:
        model = build_model("122m")
        rows["offline_122m"] = {}
        for q in args.quantization:
            print(f"[offline_122m] pagedserve {q} ...", flush=True)
            rows["offline_122m"][f"pagedserve {q}"] = run_worker(
                "pagedserve", str(model), q, args.lm_head, "16"
            )
        if not args.skip_transformers:
            print("[offline_122m] transformers bf16 ...", flush=True)
            rows["offline_122m"]["transformers"] = run_worker("transformers", str(model))
    for row in rows.values():
        ours = [k for k in row if k.startswith("pagedserve")]
        peers = [k for k in row if not k.startswith("pagedserve")]
        row["ratio"] = {f"{o} / {p}": row[o] / row[p] for o in ours for p in peers}
    return rows


PEER = {"batch1": "llama.cpp", "offline": "transformers"}


def report(runs: list[dict], args: argparse.Namespace) -> dict:
    figures: dict = {"lm_head": args.lm_head, "runs": runs, "summary": {}}
    print(f"\n{'measure':<14} {'system':<18} {'tok/s (median)':>15} {'range':>17}")
    for key in runs[0]:
        summary = {}
        for system in [k for k in runs[0][key] if k != "ratio"]:
            s = summary[system] = spread([r[key][system] for r in runs])
            print(f"{key:<14} {system:<18} {s['median']:>15.1f} {s['min']:>8.1f}-{s['max']:<8.1f}")
        summary["ratio"] = {}
        for pair in runs[0][key]["ratio"]:
            q = summary["ratio"][pair] = spread([r[key]["ratio"][pair] for r in runs])
            print(f"{'':<14} {pair:<40} {q['median']:.2f}x ({q['min']:.2f}-{q['max']:.2f})")
        figures["summary"][key] = summary
    figures["models"] = {name: num_parameters(name) for name in args.models}
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--setup", action="store_true", help="install llama.cpp for the comparison")
    ap.add_argument("--runs", type=int, default=1, help="repeat the whole comparison N times")
    ap.add_argument("--models", nargs="+", default=["122m", "1b"], choices=["122m", "1b"])
    ap.add_argument(
        "--quantization",
        nargs="+",
        default=["int4", "w4a8"],
        choices=["int4", "w4a8"],
        help="pagedserve's INT4 modes to measure",
    )
    ap.add_argument("--lm-head", default="int4", choices=["none", "int8", "int4"],
                    help="pagedserve's --quantize-lm-head (llama.cpp's Q4_0 files quantize theirs)")  # fmt: skip
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        kind, *rest = args.worker
        rate = worker_pagedserve(*rest) if kind == "pagedserve" else worker_transformers(*rest)
        print(rate)
        return
    root = cache_root()
    if args.setup:
        setup_llama(root)
        return
    if not args.skip_llama and not (llama_paths(root)[0] / "bin" / "python").exists():
        sys.exit("llama.cpp is not set up: run `python -m benchmarks.compare --setup` first "
                 "(or pass --skip-llama)")  # fmt: skip
    runs = []
    for i in range(args.runs):
        print(f"=== run {i + 1} of {args.runs}", flush=True)
        runs.append(one_run(args, root))
    figures = report(runs, args)
    path = write_result("compare", figures)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
