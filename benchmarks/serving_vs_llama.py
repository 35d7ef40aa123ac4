"""Serving on a CPU: pagedserve against llama.cpp's own server, on the same model and workload.

    python -m benchmarks.serving_vs_llama --setup [--isa avx2]   # once: llama-server, built with
        # cmake from the llama.cpp that compare.py's setup unpacked (~15 min on 2 cores)
    python -m benchmarks.serving_vs_llama [--isa avx2] [--runs 3]
        # writes benchmarks/results/serving_vs_llama_<kernels>.json

`llama-server` is the serving peer that matters on a CPU: continuous batching over parallel
slots, Q4_0 weights. Both servers get the ~122M GLM-4-0414 model of bench_models.py (llama.cpp
the Q4_0 file compare.py converts; pagedserve `--quantization int4`, and `w4a8` with
--quantization int4 w4a8), 2 threads, and the same client: `pagedserve bench` (random 128 tokens in /
64 out, 64 prompts sent at once, --ignore-eos, output tokens from each server's streamed usage).
llama-server runs 16 slots of 256 tokens (a slot is a sequence; vLLM's client measures it the
same way), pagedserve its defaults. `--isa` is compare.py's: `avx2` runs pagedserve's avx2 kernels
against a llama-server built for AVX2 + FMA + F16C only; `--llama-server PATH` uses a binary
built elsewhere.

Each server runs REPEATS times after one warm-up run that is not counted; with --runs N the whole
comparison repeats N times, and the report gives the median and the range. Check `uptime` first:
nothing else should be running.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.bench_models import build_model, cache_root
from benchmarks.compare import (
    LLAMA_CMAKE_ARGS,
    PAGEDSERVE_KERNELS,
    gguf_q4_0,
    llama_cmake_args,
    llama_paths,
)
from benchmarks.results import spread, write_result
from pagedserve.testing import free_port

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = {"random_input_len": 128, "random_output_len": 64, "num_prompts": 64, "threads": 2}
LLAMA_SLOTS, LLAMA_SLOT_TOKENS = 16, 256


def llama_server_path(root: Path, isa: str) -> Path:
    return root / f"llama-server-{isa}" / "bin" / "llama-server"


def setup_llama_server(root: Path, isa: str) -> None:
    _, source = llama_paths(root, isa)
    if not source.is_dir():
        sys.exit(
            f"no llama.cpp source at {source}: run `python -m benchmarks.compare --setup` first"
        )
    build = llama_server_path(root, isa).parents[1]
    print(
        f"building llama-server for --isa {isa} into {build} (~15 min on 2 cores) ...", flush=True
    )
    subprocess.run(
        ["cmake", "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
         "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
         "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON",
         *llama_cmake_args(isa).split()],
        check=True,
    )  # fmt: skip
    subprocess.run(
        ["cmake", "--build", str(build), "-j", "2", "--target", "llama-server"], check=True
    )
    print(f"llama-server ready: {llama_server_path(root, isa)}")


@contextlib.contextmanager
def running(cmd: list[str], port: int, log: Path, env: dict | None = None):
    """A server started in its own process group, up when /v1/models answers; stopped on exit."""
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}; see {log}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{cmd[0]} did not answer in 10 minutes; see {log}")
            time.sleep(0.5)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


def bench(url: str, name: str, tokenizer: Path, out: Path) -> dict:
    """One run of `pagedserve bench` against ``url``: its JSON metrics."""
    subprocess.run(
        [sys.executable, "-m", "pagedserve", "bench", "--base-url", url, "--model", name,
         "--tokenizer", str(tokenizer), "--dataset", "random",
         "--random-input-len", str(WORKLOAD["random_input_len"]),
         "--random-output-len", str(WORKLOAD["random_output_len"]),
         "--num-prompts", str(WORKLOAD["num_prompts"]), "--max-concurrency",
         str(WORKLOAD["num_prompts"]), "--ignore-eos", "--seed", "0", "--disable-tqdm",
         "--output-file", str(out)],
        check=True, capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    metrics = json.loads(out.read_text())
    if metrics["failed"] or metrics["completed"] != WORKLOAD["num_prompts"]:
        raise RuntimeError(f"{name}: {metrics['failed']} of the requests failed ({url})")
    return metrics


def server_commands(args: argparse.Namespace, model: Path, gguf: Path, port: int) -> dict:
    kernels = PAGEDSERVE_KERNELS[args.isa]
    commands = {
        f"pagedserve {q}": [
            sys.executable, "-m", "pagedserve", "serve", "--model", str(model),
            "--served-model-name", model.name, "--quantization", q, "--kernels", kernels,
            "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
        ]
        for q in args.quantization
    }  # fmt: skip
    commands["llama-server"] = [
        str(args.llama_server), "-m", str(gguf), "--alias", model.name, "--host", "127.0.0.1",
        "--port", str(port), "-t", "2", "-np", str(LLAMA_SLOTS),
        "-c", str(LLAMA_SLOTS * LLAMA_SLOT_TOKENS),
    ]  # fmt: skip
    return commands


KEYS = ("output_throughput", "request_throughput", "median_ttft_ms", "median_tpot_ms")


def one_run(args: argparse.Namespace, model: Path, gguf: Path, tmp: Path) -> dict:
    figures = {}
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    for label, cmd in server_commands(args, model, gguf, port).items():
        print(f"[{label}] ...", flush=True)
        with running(cmd, port, tmp / f"{label.replace(' ', '-')}.log", env) as url:
            bench(url, model.name, model, tmp / "warmup.json")
            runs = [bench(url, model.name, model, tmp / "run.json") for _ in range(args.repeats)]
        figures[label] = {k: sorted(r[k] for r in runs)[len(runs) // 2] for k in KEYS}
    return figures


def report(runs: list[dict]) -> dict:
    labels = list(runs[0])
    out = {label: {k: spread([r[label][k] for r in runs]) for k in KEYS} for label in labels}
    print(f"{'server':20s} {'output tok/s':>14s} {'range':>16s} {'TTFT ms':>9s} {'TPOT ms':>9s}")
    for label in labels:
        tput = out[label]["output_throughput"]
        print(
            f"{label:20s} {tput['median']:14.1f} {tput['min']:7.1f}-{tput['max']:<8.1f} "
            f"{out[label]['median_ttft_ms']['median']:9.1f} "
            f"{out[label]['median_tpot_ms']['median']:9.1f}"
        )
    for label in labels:
        if label == "llama-server":
            continue
        ratios = [
            r[label]["output_throughput"] / r["llama-server"]["output_throughput"] for r in runs
        ]
        out[label]["output_throughput_vs_llama_server"] = spread(ratios)
        s = out[label]["output_throughput_vs_llama_server"]
        print(f"{label} / llama-server: {s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--setup", action="store_true", help="build llama-server for --isa")
    ap.add_argument("--isa", choices=sorted(LLAMA_CMAKE_ARGS), default="native",
                    help="the instruction set both servers run (compare.py's)")  # fmt: skip
    ap.add_argument("--llama-server", type=Path, help="a llama-server binary built elsewhere")
    ap.add_argument("--quantization", nargs="+", choices=["int4", "w4a8"], default=["int4"])
    ap.add_argument("--runs", type=int, default=1, help="repeat the whole comparison N times")
    ap.add_argument("--repeats", type=int, default=3, help="measured runs per server, per run")
    ap.add_argument("--num-prompts", type=int, default=WORKLOAD["num_prompts"])
    args = ap.parse_args()
    WORKLOAD["num_prompts"] = args.num_prompts
    root = cache_root()
    if args.setup:
        setup_llama_server(root, args.isa)
        return
    args.llama_server = args.llama_server or llama_server_path(root, args.isa)
    if not args.llama_server.is_file():
        sys.exit(
            f"no llama-server at {args.llama_server}: run `python -m benchmarks.serving_vs_llama "
            f"--setup --isa {args.isa}` (or pass --llama-server PATH)"
        )
    from pagedserve.hal.native import choose_kernels

    kernels = choose_kernels(PAGEDSERVE_KERNELS[args.isa]).name
    print(f"pagedserve kernels: {kernels}; llama-server: {args.llama_server}", flush=True)
    model = build_model("122m")
    gguf = gguf_q4_0(model, root, args.isa)
    with tempfile.TemporaryDirectory() as tmp:
        runs = []
        for i in range(args.runs):
            print(f"=== run {i + 1} of {args.runs}", flush=True)
            runs.append(one_run(args, model, gguf, Path(tmp)))
    figures = report(runs)
    workload = {**WORKLOAD, "model": "122m", "llama_server_slots": LLAMA_SLOTS,
                "repeats": args.repeats, "runs": args.runs}  # fmt: skip
    record = {"pagedserve_kernels": kernels, "workload": workload, "servers": figures}
    path = write_result(f"serving_vs_llama_{kernels}", record)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
