"""pagedserve against its peers on this machine, one after the other, on the same models.

    python -m benchmarks.compare --setup [--isa avx2]  # once: llama.cpp (llama-cpp-python 0.3.36
                                                       # from PyPI, built here: ~6 min) in its venv
    python -m benchmarks.compare [--isa avx2] [--runs 3]
        # the comparison; writes benchmarks/results/compare_<kernels>.json

--isa picks the instruction set both systems run: `native` (the default) is pagedserve's best
kernels for this CPU (--kernels auto) against llama.cpp built for this CPU (GGML_NATIVE); `avx2`
is pagedserve's avx2 kernels against llama.cpp built for AVX2 + FMA + F16C only (GGML_NATIVE=OFF,
AVX-512 and AVX-VNNI off), so that the AVX2 comparison can be made on an AVX-512 machine too:
pagedserve's workers then see this CPU's flags without AVX-512, AVX-VNNI and AMX
($PAGEDSERVE_CPU_FLAGS), so that their avx2 kernels are built as on a Zen 3, and PyTorch's
and oneDNN's own kernels, theirs and transformers', are held to AVX2 (transformers then runs fp32,
its fastest dtype where bf16 is emulated).

Measures (each figure the median of 5 timed repetitions after a warm-up; with --runs N the whole
comparison repeats N times and the report gives the median and the range):
- prompt processing (`prompt_<model>`): one 512-token prompt computed in one step (llama.cpp:
  n_batch 512), tokens/s = 512 / seconds to its first token;
- decode at a long context (`decode_long_122m`): 64 greedy tokens after a 1,536-token prompt,
  tokens/s = 64 / seconds from the first token to the last;
- batch 1: a 32-token prompt then 64 greedy tokens, whole time, tokens/s = 64 / seconds;
  pagedserve INT4 (group 32; W4A16 `int4` and W4A8 `w4a8`; lm_head as --lm-head says, INT4 by
  default as llama.cpp's Q4_0 files quantize theirs, to Q6_K) against llama.cpp Q4_0
  (llama-cpp-python, 2 threads, converted with llama.cpp's own converter from the same
  checkpoint), on the ~122M and ~1B random GLM-4-0414 models of bench_models.py;
- offline: 16 prompts of 16-128 tokens x 64 new tokens (greedy, no early stop), output tokens/s,
  pagedserve INT4 against transformers `generate` in its fastest dtype here (bf16 where the CPU
  has AVX-512 BF16 or AMX, fp32 where bf16 is emulated, as on AVX2), on the ~122M model.

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
PP_TOKENS = 512  # prompt processing: one prompt of this many tokens, in one step
LONG_CONTEXT = 1536  # decode after a prompt of this many tokens
WORKLOAD = {  # (recorded with the figures)
    "prompt_processing_tokens": PP_TOKENS,
    "batch1_prompt_tokens": PROMPT_LEN,
    "new_tokens": NEW_TOKENS,
    "long_context_tokens": LONG_CONTEXT,
    "offline_prompts": OFFLINE_PROMPTS,
    "repeats": REPEATS,
}


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


def worker_pagedserve(
    model: str, quantization: str, lm_head: str, batch: str, kernels: str
) -> float:
    """tokens/s of one measure: ``batch`` is "1" or "16" (whole generations), "pp" (a 512-token
    prompt's first token) or "long" (64 tokens after a 1,536-token prompt)."""
    from pagedserve import LLM, SamplingParams

    llm = LLM(
        model=model,
        dtype="bfloat16",
        quantization=quantization,
        quantize_lm_head=lm_head,
        kernels=kernels,
        max_model_len=2048,
        max_num_batched_tokens=2048,  # a prompt of up to 2,048 tokens in one step
        enable_prefix_caching=False,  # every repetition computes its prompts, as the peers do
    )
    if batch == "pp":
        first = SamplingParams(temperature=0.0, max_tokens=1)
        prompt = [{"prompt_token_ids": long_prompt(PP_TOKENS)}]
        return PP_TOKENS / timed_median(lambda: llm.generate(prompt, first, use_tqdm=False))
    if batch == "long":  # (decode_seconds times the decode alone, not the prompt before it)
        prompt = long_prompt(LONG_CONTEXT)
        decode_seconds(llm, prompt)
        return NEW_TOKENS / statistics.median(decode_seconds(llm, prompt) for _ in range(REPEATS))
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = [batch1_prompt()] if batch == "1" else offline_prompts()
    inputs = [{"prompt_token_ids": p} for p in prompts]
    seconds = timed_median(lambda: llm.generate(inputs, params, use_tqdm=False))
    return len(prompts) * NEW_TOKENS / seconds


def long_prompt(n: int) -> list[int]:
    return [(7 * i + 3) % 7000 + 20 for i in range(n)]


def decode_seconds(llm, prompt: list[int]) -> float:
    """Seconds from a request's first token (its prompt computed) to its NEW_TOKENS-th."""
    from pagedserve import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    engine.add_request("long", prompt, params)
    while not any(o.outputs[0].token_ids for o in engine.step()):
        pass
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return (time.perf_counter() - start) * NEW_TOKENS / (NEW_TOKENS - 1)


def fastest_transformers_dtype(isa: str) -> str:
    """bf16 where the CPU computes it natively (and --isa lets it), else fp32 (GLM4.md: on AVX2,
    transformers made 40 tok/s in bf16 and 137 in fp32 on the same workload)."""
    from benchmarks.results import machine

    native_bf16 = {"avx512_bf16", "amx_bf16"} & set(machine()["isa_flags"])
    return "bfloat16" if native_bf16 and isa != "avx2" else "float32"


def worker_transformers(model: str, dtype: str) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).eval()
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
path, measure, prompt_len, new_tokens, repeats = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
n_batch = min(prompt_len, 512)
llm = Llama(model_path=path, n_ctx=prompt_len + new_tokens + 8, n_threads=2, n_batch=n_batch,
            n_ubatch=n_batch, verbose=False)
if measure == "batch1":
    prompt = list(range(10, 10 + prompt_len))
else:  # compare.long_prompt
    prompt = [(7 * i + 3) % 7000 + 20 for i in range(prompt_len)]
def run():
    llm.reset()
    start = time.perf_counter()
    llm.eval(prompt)
    if measure == "pp":
        return prompt_len / (time.perf_counter() - start)
    if measure == "long":
        start = time.perf_counter()
    for i in range(new_tokens):
        llm.eval([(prompt[-1] + i) % 600 + 5])
    return new_tokens / (time.perf_counter() - start)
run()
print(statistics.median(run() for _ in range(repeats)))
"""
LLAMA_PROMPT_LEN = {"batch1": PROMPT_LEN, "pp": PP_TOKENS, "long": LONG_CONTEXT}


# ---- llama.cpp: setup and conversion -------------------------------------------------------------
# llama.cpp's CMake options for each --isa: native detects the CPU; avx2 is AVX2 + FMA + F16C
# and nothing newer, whatever the CPU has.
LLAMA_CMAKE_ARGS = {
    "native": "",
    "avx2": "-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON "
    "-DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF "
    "-DGGML_AVX_VNNI=OFF",
}
PAGEDSERVE_KERNELS = {"native": "auto", "avx2": "avx2"}
# llama.cpp 0.3.36's AMX kernels (Intel Sapphire Rapids and later) crash on the benchmark models:
# SIGSEGV in ggml_backend_amx_mul_mat at the first matmul of the demo model (hidden size 256),
# seen on a 2-core Xeon with AMX. The native build there keeps every other extension the CPU has
# (AVX-512 VNNI / BF16, what it uses on AMD Zen 4) and leaves AMX out.
NO_AMX = "-DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8"


def llama_cmake_args(isa: str) -> str:
    """The CMake options of llama.cpp's build for ``--isa`` on this machine."""
    from pagedserve.hal.native import cpu_flags

    if isa == "native" and "amx_int8" in cpu_flags():
        return NO_AMX
    return LLAMA_CMAKE_ARGS[isa]


def llama_paths(root: Path, isa: str = "native") -> tuple[Path, Path]:
    venv = root / ("llama-venv" if isa == "native" else f"llama-venv-{isa}")
    converter = root / "llama-sdist" / f"llama_cpp_python-{LLAMA_VERSION}" / "vendor" / "llama.cpp"
    return venv, converter


def setup_llama(root: Path, isa: str) -> None:
    venv, converter = llama_paths(root, isa)
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    print(
        f"installing llama-cpp-python {LLAMA_VERSION} for --isa {isa} (compiles llama.cpp: "
        "~6 min) ...",
        flush=True,
    )
    subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", "--no-cache-dir",
         f"llama-cpp-python=={LLAMA_VERSION}", "torch==2.13.0", "transformers", "safetensors",
         "numpy", "sentencepiece"],
        check=True,
        env={"CMAKE_BUILD_PARALLEL_LEVEL": "2", "CMAKE_ARGS": llama_cmake_args(isa), **os.environ},
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


def llama_system_info(venv: Path) -> str:
    """What llama.cpp says it was built for (``AVX2 = 1 | ...``): recorded with its figures."""
    code = "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())"
    out = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True)
    return out.stdout.strip()


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


def gguf_q4_0(model: Path, root: Path, isa: str) -> Path:
    """The Q4_0 file (the same for every --isa: llama.cpp repacks it for the CPU as it loads)."""
    out = model / "q4_0.gguf"
    if out.exists():
        return out
    venv, converter = llama_paths(root, isa)
    print(f"converting {model.name} to GGUF Q4_0 with llama.cpp's converter ...", flush=True)
    subprocess.run(
        [str(venv / "bin" / "python"), "-c", CONVERT, str(converter), str(model),
         str(model / "f16.gguf"), str(out)],
        check=True, capture_output=True,
        env={**os.environ, "PYTHONPATH": f"{converter}:{converter}/gguf-py"},
    )  # fmt: skip
    (model / "f16.gguf").unlink()
    return out


def llama_rate(gguf: Path, root: Path, isa: str, measure: str) -> float:
    """llama.cpp's tokens/s of ``measure``: batch1, pp or long (as worker_pagedserve's)."""
    venv, _ = llama_paths(root, isa)
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", LLAMA_WORKER, str(gguf), measure,
         str(LLAMA_PROMPT_LEN[measure]), str(NEW_TOKENS), str(REPEATS)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return float(out.stdout.strip().splitlines()[-1])


# ---- the comparison ------------------------------------------------------------------------------
def worker_env(isa: str) -> dict:
    """The environment of the pagedserve and transformers workers: under --isa avx2, AVX2 as on a
    Zen 3 (the llama.cpp they meet is built without anything newer): pagedserve sees this CPU's
    flags without AVX-512, AVX-VNNI and AMX, so that its avx2 kernels build and run so, and
    PyTorch's own kernels and oneDNN's are held to AVX2 (ATEN_CPU_CAPABILITY,
    ONEDNN_MAX_CPU_ISA)."""
    if isa != "avx2":
        return dict(os.environ)
    from pagedserve.hal.native import cpu_flags

    newer = ("avx512", "avx_vnni", "amx")
    flags = sorted(f for f in cpu_flags() if not f.startswith(newer))
    return {
        **os.environ,
        "PAGEDSERVE_CPU_FLAGS": " ".join(flags),
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
    }


def run_worker(isa: str, *args: str) -> float:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.compare", "--worker", *args],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
        env=worker_env(isa),
    )
    return float(out.stdout.strip().splitlines()[-1])


# measure -> (models it runs on, pagedserve's worker argument, llama.cpp's measure)
LLAMA_MEASURES = {"prompt": ("pp", "pp"), "batch1": ("1", "batch1")}


def one_run(args: argparse.Namespace, root: Path) -> dict:
    rows = {}
    kernels = PAGEDSERVE_KERNELS[args.isa]
    llama_measures = [(f"{m}_{name}", name, *LLAMA_MEASURES[m]) for m in args.measures
                      if m in LLAMA_MEASURES for name in args.models]  # fmt: skip
    if "long" in args.measures and "122m" in args.models:
        llama_measures.append(("decode_long_122m", "122m", "long", "long"))
    for key, name, ours, theirs in llama_measures:
        model = build_model(name)
        rows[key] = {}
        for q in args.quantization:
            print(f"[{key}] pagedserve {q} (lm_head {args.lm_head}) ...", flush=True)
            rows[key][f"pagedserve {q}"] = run_worker(
                args.isa, "pagedserve", str(model), q, args.lm_head, ours, kernels
            )
        if not args.skip_llama:
            print(f"[{key}] llama.cpp Q4_0 ...", flush=True)
            gguf = gguf_q4_0(model, root, args.isa)
            rows[key]["llama.cpp"] = llama_rate(gguf, root, args.isa, theirs)
    if "offline" in args.measures and "122m" in args.models:
        model = build_model("122m")
        rows["offline_122m"] = {}
        for q in args.quantization:
            print(f"[offline_122m] pagedserve {q} ...", flush=True)
            rows["offline_122m"][f"pagedserve {q}"] = run_worker(
                args.isa, "pagedserve", str(model), q, args.lm_head, "16", kernels
            )
        if not args.skip_transformers:
            print(f"[offline_122m] transformers {args.transformers_dtype} ...", flush=True)
            rows["offline_122m"]["transformers"] = run_worker(
                args.isa, "transformers", str(model), args.transformers_dtype
            )
    for row in rows.values():
        ours = [k for k in row if k.startswith("pagedserve")]
        peers = [k for k in row if not k.startswith("pagedserve")]
        row["ratio"] = {f"{o} / {p}": row[o] / row[p] for o in ours for p in peers}
    return rows


def report(runs: list[dict], args: argparse.Namespace, kernels: str, llama_build: str) -> dict:
    figures: dict = {
        "isa": args.isa,
        "pagedserve_kernels": kernels,
        "llama_cpp_build": llama_build,
        "transformers_dtype": args.transformers_dtype,
        "lm_head": args.lm_head,
        "workload": WORKLOAD,
        "runs": runs,
        "summary": {},
    }
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
    ap.add_argument(
        "--isa",
        default="native",
        choices=sorted(LLAMA_CMAKE_ARGS),
        help="the instruction set both systems run (see above)",
    )
    ap.add_argument(
        "--transformers-dtype",
        default=None,
        choices=["bfloat16", "float32"],
        help="transformers' dtype offline (default: its fastest here, bf16 only with native bf16)",
    )
    ap.add_argument("--runs", type=int, default=1, help="repeat the whole comparison N times")
    ap.add_argument("--models", nargs="+", default=["122m", "1b"], choices=["122m", "1b"])
    ap.add_argument(
        "--measures",
        nargs="+",
        default=["prompt", "batch1", "long", "offline"],
        choices=["prompt", "batch1", "long", "offline"],
        help="what to measure (default: all; long and offline run on the ~122M model only)",
    )
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
        setup_llama(root, args.isa)
        return
    venv = llama_paths(root, args.isa)[0]
    if not args.skip_llama and not (venv / "bin" / "python").exists():
        sys.exit(f"llama.cpp is not set up for --isa {args.isa}: run `python -m benchmarks.compare "
                 f"--setup --isa {args.isa}` first (or pass --skip-llama)")  # fmt: skip
    args.transformers_dtype = args.transformers_dtype or fastest_transformers_dtype(args.isa)
    from pagedserve.hal.native import choose_kernels

    os.environ.update(worker_env(args.isa))  # (the kernels the workers will choose)
    kernels = choose_kernels(PAGEDSERVE_KERNELS[args.isa]).name
    llama_build = "" if args.skip_llama else llama_system_info(venv)
    print(f"pagedserve kernels: {kernels}; llama.cpp: {llama_build or 'skipped'}", flush=True)
    runs = []
    for i in range(args.runs):
        print(f"=== run {i + 1} of {args.runs}", flush=True)
        runs.append(one_run(args, root))
    figures = report(runs, args, kernels, llama_build)
    path = write_result(f"compare_{kernels}", figures)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
