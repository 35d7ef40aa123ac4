"""Sampler cost per step for 32 rows at GLM-4-sized (151552) and benchmark-sized (32000) vocabularies,
on peaked logits like a language model's.

    python -m benchmarks.sampler_speed
"""

from __future__ import annotations

import time

import torch

from pagedserve.engine.sampler import Sampler, SamplingMetadata
from pagedserve.sampling_params import SamplingParams

CASES = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature": SamplingParams(temperature=0.8),
    "top_k + top_p": SamplingParams(temperature=0.8, top_k=50, top_p=0.9),
    "top_p alone": SamplingParams(temperature=0.8, top_p=0.9),
    "penalties + logprobs": SamplingParams(temperature=0.8, presence_penalty=0.5, logprobs=5),
}


def main(rows: int = 32, iters: int = 5) -> None:
    sampler = Sampler()
    print(f"{rows} rows; milliseconds per sampler call")
    for vocab in (32000, 151552):
        logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3
        logits[:, :50] += 12  # a few likely tokens, as a language model has
        for name, params in CASES.items():
            meta = SamplingMetadata(
                [params] * rows,
                [[1, 2, 3]] * rows,
                [[4, 5]] * rows,
                [None] * rows,
                [frozenset({0})] * rows,
            )
            sampler(logits, meta)
            start = time.perf_counter()
            for _ in range(iters):
                sampler(logits, meta)
            print(
                f"vocab {vocab:6d}  {name:22s} {(time.perf_counter() - start) / iters * 1e3:7.1f}"
            )


if __name__ == "__main__":
    main()
