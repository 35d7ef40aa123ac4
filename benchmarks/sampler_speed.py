"""Sampler cost per step at GLM-4-sized (151552) and benchmark-sized (32000) vocabularies, on peaked
logits like a language model's, for a batch-1 decode step and for 32 rows: the sampler as the
engine builds it on this machine's best CPU kernels (the native argmax and random draw), and with
PyTorch's ops alone (the eager kernels, and any backend without a draw of its own).

    python -m benchmarks.sampler_speed [--rows 1 32] [--iters 20]
"""

from __future__ import annotations

import argparse
import time

import torch

from pagedserve.engine.sampler import Sampler, SamplingMetadata
from pagedserve.hal import get_device
from pagedserve.sampling_params import SamplingParams

CASES = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature": SamplingParams(temperature=0.8),
    "temperature, seeded": SamplingParams(temperature=0.8, seed=0),
    "top_k + top_p": SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
    "top_p alone": SamplingParams(temperature=0.8, top_p=0.9),
    "penalties + logprobs": SamplingParams(temperature=0.8, presence_penalty=0.5, logprobs=5),
}


def time_call(sampler: Sampler, logits: torch.Tensor, meta: SamplingMetadata, iters: int) -> float:
    """Milliseconds per call, the median of ``iters`` calls after one warm-up."""
    sampler(logits, meta)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        sampler(logits, meta)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def main(rows_list: list[int], iters: int) -> None:
    device = get_device("cpu")
    samplers = {
        f"{device.kernel_set} kernels": Sampler(
            argmax=device.argmax, categorical=device.categorical()
        ),
        "PyTorch ops": Sampler(),
    }
    print(f"milliseconds per sampler call (median of {iters}); columns: {', '.join(samplers)}")
    for rows in rows_list:
        for vocab in (32000, 151552):
            logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3
            logits[:, :50] += 12  # a few likely tokens, as a language model has
            for name, params in CASES.items():
                meta = SamplingMetadata(
                    [params] * rows,
                    [[1, 2, 3]] * rows,
                    [[4, 5]] * rows,
                    [None if params.seed is None else torch.Generator().manual_seed(0)] * rows,
                    [frozenset({0})] * rows,
                )
                figures = [time_call(s, logits, meta, iters) for s in samplers.values()]
                cells = "".join(f"{ms:9.3f}" for ms in figures)
                print(f"rows {rows:3d}  vocab {vocab:6d}  {name:22s}{cells}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 32], help="batch sizes")
    ap.add_argument("--iters", type=int, default=20, help="timed calls per case (median)")
    args = ap.parse_args()
    main(args.rows, args.iters)
