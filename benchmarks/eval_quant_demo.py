"""The eval-quant table of the README: the embedded demo model quantized each way, judged against
its bf16 weights by ``pagedserve eval-quant``, and how long each quantization took.

    python -m benchmarks.eval_quant_demo [--model demo] [--threads N] [--output NAME]
        [--candidates NAME ...]

For AWQ W4A16, AWQ W4A8 and RTN W4A16 it runs what the README tells a user to run,

    pagedserve quantize --model-path demo --output-path DST --quant-method awq|rtn --abits 16|8
    pagedserve eval-quant --reference demo --candidate DST --json OUT

and for the INT8 KV cache (the KV row: nothing to quantize, the model against itself with its
keys and values rounded as ``serve --kv-cache-dtype int8`` stores them)

    pagedserve eval-quant --reference demo --candidate demo --kv-cache-dtype int8 --json OUT

in this process (so the quantize time is the quantization, not Python's start-up), into a
temporary directory, and writes benchmarks/results/eval_quant_demo.json: per candidate the
eval-quant results (perplexities, increase in %, top-1 agreement, mean KL, BLEU-4, ROUGE-L,
verdict), the quantize wall time in seconds and the size of the quantized directory in MB. AWQ and RTN are deterministic, so the quality
figures repeat exactly for a given model; the times depend on how busy the machine is.
It depends on the demo model: rerun it whenever pagedserve/demo_model changes.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.results import write_result
from pagedserve.entrypoints.cli.quantize import (
    add_eval_quant_args,
    add_quantize_args,
    run_eval_quant,
    run_quantize,
)

CANDIDATES = {  # (quant method, abits, kv cache dtype); no method: the 16-bit weights
    "AWQ W4A16": ("awq", 16, "auto"),
    "AWQ W4A8": ("awq", 8, "auto"),
    "RTN W4A16": ("rtn", 16, "auto"),
    "INT8 KV cache": (None, 16, "int8"),
}


def quantize(model: str, out: Path, method: str, abits: int) -> float:
    """``pagedserve quantize`` into ``out``; its wall time in seconds."""
    argv = ["--model-path", model, "--output-path", str(out), "--quant-method", method]
    args = add_quantize_args(argparse.ArgumentParser()).parse_args([*argv, "--abits", str(abits)])
    start = time.perf_counter()
    run_quantize(args)
    return time.perf_counter() - start


def eval_quant(model: str, candidate: Path | str, out_json: Path, kv_cache_dtype: str) -> dict:
    """``pagedserve eval-quant`` of ``candidate`` against ``model``: its --json record."""
    argv = ["--reference", model, "--candidate", str(candidate), "--json", str(out_json)]
    argv += ["--kv-cache-dtype", kv_cache_dtype]
    run_eval_quant(add_eval_quant_args(argparse.ArgumentParser()).parse_args(argv))
    return json.loads(out_json.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="demo", help="16-bit model directory, or demo")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    parser.add_argument("--output", default="eval_quant_demo", help="results file name")
    parser.add_argument(
        "--candidates", nargs="+", choices=list(CANDIDATES), default=list(CANDIDATES),
        help="the rows to measure (default: all)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    candidates = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.candidates:
            method, abits, kv_cache_dtype = CANDIDATES[name]
            report = Path(tmp) / f"{method}-a{abits}-{kv_cache_dtype}.json"
            if method is None:  # the KV row: the model against itself
                result = eval_quant(args.model, args.model, report, kv_cache_dtype)
                candidates[name] = result
            else:
                out = Path(tmp) / f"{method}-a{abits}"
                seconds = quantize(args.model, out, method, abits)
                size_mb = sum(f.stat().st_size for f in out.iterdir()) / 1e6
                result = eval_quant(args.model, out, report, kv_cache_dtype)
                candidates[name] = {
                    "quantize_seconds": round(seconds, 1),
                    "directory_mb": round(size_mb, 1),
                    **result,
                }
            print(name, candidates[name], flush=True)
    figures = {
        "model": args.model,
        "group_size": 32,
        "threads": torch.get_num_threads(),
        "candidates": candidates,
    }
    print(write_result(args.output, figures))


if __name__ == "__main__":
    main()
