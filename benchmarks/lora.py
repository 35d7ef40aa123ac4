"""Multi-LoRA serving on the ~122M GLM-4-0414 (INT4 base, rank-16 adapters): the throughput of
32 concurrent requests spread over 1, 4 and 8 distinct adapters against the same requests on
the base alone, the time of an adapter's swap-in from host memory, and the grouped LoRA ops
that decided ``lora/ops.py``.

    python -m benchmarks.lora [--runs 3] [--threads 2]   # writes benchmarks/results/lora.json
    python -m benchmarks.lora --targets q_proj v_proj --skip-ops --output lora_qv

- **Adapters**: rank 16 (alpha 32) on all six linear modules of every layer (``--targets``:
  fewer, e.g. PEFT's common ``q_proj v_proj``). An adapter's bytes are what a decode step adds to
  read; on all six modules of a model this small, eight of them weigh nearly as much as the INT4
  base (``swap_in.device_slots_mb`` against the weight tier in the results).
- **Throughput**: ``LLM.generate`` over 32 requests of 64 random prompt tokens and 64 greedy
  output tokens each (``ignore_eos``), all submitted at once (``--max-num-seqs 32``), prompts
  included in the time; tokens/s = generated tokens / seconds. The requests go round-robin over
  the adapters (vLLM's bench spreads them over ``--lora-modules`` at random), ``--max-loras 8``.
  The base-only figure runs on an engine without ``enable_lora`` (what a server of the base
  alone does: its decode steps take the native fused layers); the adapter runs on one with
  ``enable_lora=True``, whose steps with adapter rows run op by op plus the LoRA ops. Each
  run times the four cases in turn; the figure is the median of ``--runs`` runs.
- **Swap-in**: one adapter copied from host memory into a device slot (``LoRASlots.activate``),
  the median of 20; and read from disk (the host cache dropped) for comparison.
- **Ops**: the added ``B (A x)`` of every target of the 12 layers (each layer its own slots, as
  in the engine), for 32 decode rows and for a 512-token prefill, over 1, 4 and 8 adapters
  (bf16, rank 16, every row with an adapter, sorted by adapter as the engine sorts them): grouped
  GEMMs (rows sorted by adapter, ``torch._grouped_mm``), padded bmm (the runs padded to one
  length), a loop of two matmuls per adapter, a gathered per-row bmm (Punica's BGMV), one
  matmul over every slot with the others' columns masked; and ``add_lora``'s own choice; where
  this CPU runs native kernels, their LoRA kernel (``csrc/lora.h``, a row at a time) and the CPU
  device's choice between it and the grouped ops (``CpuDevice.lora_add``: the kernel up to
  ``LORA_NATIVE_MAX_ROWS`` adapter rows). Each the best of ``--op-repeats`` timings, one thread.

The machine should be quiet (`uptime`); the results file records the load average at the start
and the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from benchmarks.bench_models import SHAPES, build_model, cache_root
from benchmarks.results import spread, write_result
from pagedserve.hal import get_device
from pagedserve.lora.peft import HF_TARGETS, random_adapter_tensors

RANK, ALPHA = 16, 32
NUM_ADAPTERS = 8
NUM_REQUESTS, PROMPT_LEN, MAX_TOKENS = 32, 64, 64
CASES = {"base only": 0, "1 adapter": 1, "4 adapters": 4, "8 adapters": 8}
TARGET_RATIO = 0.8


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---- adapters ---------------------------------------------------------------------------------
def build_adapters(model: str = "122m", targets: tuple[str, ...] = HF_TARGETS) -> list[Path]:
    """``NUM_ADAPTERS`` random rank-16 PEFT adapters on ``targets`` of every layer, built once."""
    suffix = "" if tuple(targets) == HF_TARGETS else "-" + "-".join(targets)
    root = cache_root() / f"lora-{model}-r{RANK}{suffix}"
    paths = [root / f"adapter-{i}" for i in range(NUM_ADAPTERS)]
    for seed, path in enumerate(paths):
        if not (path / "adapter_model.safetensors").is_file():
            log(f"building adapter {path.name} in {root} ...")
            _write_adapter(path, SHAPES[model], seed, targets)
    return paths


def _write_adapter(path: Path, shape: dict, seed: int, targets: tuple[str, ...]) -> None:
    g = torch.Generator().manual_seed(1000 + seed)
    tensors = random_adapter_tensors(shape, RANK, g, 0.01, targets)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": RANK,
        "lora_alpha": ALPHA,
        "target_modules": [t for t in HF_TARGETS if t in targets],
        "bias": "none",
    }
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))


# ---- throughput -------------------------------------------------------------------------------
def engine_kwargs() -> dict:
    return dict(
        quantization="int4",
        max_num_seqs=NUM_REQUESTS,
        max_num_batched_tokens=2048,
        num_kv_pages=NUM_REQUESTS * (PROMPT_LEN + MAX_TOKENS) // 16 + 64,
        max_model_len=PROMPT_LEN + MAX_TOKENS + 16,
        enable_prefix_caching=False,
        seed=0,
    )


def time_generate(llm, prompts, loras) -> dict:
    from pagedserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    seconds = time.perf_counter() - start
    assert all(o.error is None for o in outs), [o.error for o in outs if o.error]
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tokens_per_s": tokens / seconds, "seconds": seconds, "tokens": tokens}


def throughput(model_dir: Path, adapters: list[Path], runs: int) -> dict:
    from pagedserve import LLM, LoRARequest

    g = torch.Generator().manual_seed(0)
    prompts = [
        {"prompt_token_ids": torch.randint(100, 30000, (PROMPT_LEN,), generator=g).tolist()}
        for _ in range(NUM_REQUESTS)
    ]
    requests = [LoRARequest(f"adapter-{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
    log("loading the base-only engine and the LoRA engine ...")
    base = LLM(str(model_dir), **engine_kwargs())
    lora = LLM(
        str(model_dir),
        **engine_kwargs(),
        enable_lora=True,
        max_loras=NUM_ADAPTERS,
        max_lora_rank=RANK,
    )
    for r in requests:  # read and checked before timing (a server loads --lora-modules at start)
        lora.llm_engine.add_lora(r)
    time_generate(base, prompts[:4], None)  # warm-up: kernels, allocator
    time_generate(lora, prompts[:4], requests[:4])
    figures: dict[str, list[dict]] = {case: [] for case in CASES}
    for run in range(runs):
        for case, k in CASES.items():
            llm = base if k == 0 else lora
            loras = None if k == 0 else [requests[i % k] for i in range(NUM_REQUESTS)]
            result = time_generate(llm, prompts, loras)
            figures[case].append(result)
            log(f"run {run + 1}/{runs} {case}: {result['tokens_per_s']:.1f} tokens/s")
    swap = swap_in_times(lora, requests)
    base_rate = statistics.median(r["tokens_per_s"] for r in figures["base only"])
    out = {}
    for case, results in figures.items():
        rates = [r["tokens_per_s"] for r in results]
        out[case] = {
            "tokens_per_s": spread(rates),
            "of_base_only": statistics.median(rates) / base_rate,
        }
    return {"throughput": out, "swap_in": swap}


def swap_in_times(llm, requests) -> dict:
    """One adapter into a device slot: from host memory (the median of 20), and from disk."""
    slots = llm.llm_engine.executor.worker.lora
    lora_id = requests[0].lora_int_id
    host = []
    for _ in range(20):
        slots.activate(0, lora_id)
        host.append(slots.last_swap_in_seconds)
    disk = []
    for _ in range(3):
        slots.host.pop(lora_id, None)
        slots.activate(0, lora_id)
        disk.append(slots.last_swap_in_seconds)
    adapter = slots.host[lora_id]
    llm.llm_engine.lora_registry.slot_ids[0] = lora_id
    return {
        "adapter_mb": adapter.nbytes / 2**20,
        "from_host_memory_ms": spread([t * 1e3 for t in host]),
        "from_disk_ms": spread([t * 1e3 for t in disk]),
        "device_slots_mb": slots.nbytes / 2**20,
    }


# ---- the grouped ops --------------------------------------------------------------------------
def op_variants():
    """name -> (the op, ``padded`` for ``LoRABatch.build``: forced, or None to let it choose).
    The rows are sorted by adapter, as the engine sorts a step's: one span of the batch. Each op
    adds ``x @ a[s] @ b_p[s]`` into part ``p``'s columns of ``y`` (q, k and v of qkv_proj)."""
    from pagedserve.lora.ops import add_lora, add_lora_on

    def expand(y, h, parts, mm):
        r, col = parts[0].shape[1], 0
        for p, part in enumerate(parts):
            mm(y[:, col : col + part.shape[2]], h[..., p * r : (p + 1) * r], part)
            col += part.shape[2]

    def loop(x, y, a, parts, batch):
        s, e = batch.span
        h = torch.cat([x[s + i : s + j] @ a[t] for t, i, j in batch.runs])

        def mm(cols, hp, part):
            cols[s:e] += torch.cat([hp[i:j] @ part[t] for t, i, j in batch.runs])

        expand(y, h, parts, mm)

    def gathered(x, y, a, parts, batch):
        rows, slots = batch.order, batch.token_slots[batch.order]
        h = torch.bmm(x[rows].unsqueeze(1), a[slots])

        def mm(cols, hp, part):
            cols.index_add_(0, rows, torch.bmm(hp, part[slots]).squeeze(1))

        expand(y, h, parts, mm)

    def masked(x, y, a, parts, batch):
        n, fan_in, width = a.shape
        h = (x @ a.permute(1, 0, 2).reshape(fan_in, n * width)).view(-1, n, width)
        h = h * batch.mask.unsqueeze(-1)

        def mm(cols, hp, part):
            cols += hp.reshape(-1, n * hp.shape[-1]) @ part.reshape(n * part.shape[1], -1)

        expand(y, h, parts, mm)

    def lora(x, y, a, parts, batch):
        add_lora(y, x, a, parts, batch)

    variants = {
        "grouped GEMM": (lora, False),
        "padded bmm": (lora, True),
        "loop of matmuls": (loop, None),
        "gathered per-row bmm (BGMV)": (gathered, None),
        "masked, every slot": (masked, None),
        "add_lora (chosen)": (lora, None),
    }
    device = get_device("cpu")
    if device.native is not None:

        def native(x, y, a, parts, batch):
            device.native.lora_add(y, x, a, parts, batch.row_slots)

        def chosen(x, y, a, parts, batch):
            add_lora_on(device, y, x, a, parts, batch)

        variants["native kernel"] = (native, None)
        variants["the CPU device's choice"] = (chosen, None)
    return variants


def op_timings(repeats: int) -> dict:
    from pagedserve.lora.ops import LoRABatch, add_lora_reference
    from pagedserve.lora.sizes import slot_shapes
    from pagedserve.models.config import GlmConfig

    torch.set_num_threads(1)
    shape = SHAPES["122m"]
    config = GlmConfig(architecture="glm4", **shape)
    targets = slot_shapes(config, 1, RANK)
    g = torch.Generator().manual_seed(0)

    def rand(*size):
        return (torch.randn(*size, generator=g) * 0.05).to(torch.bfloat16)

    # every layer its own slots, as the engine has them: a step reads them all from memory
    layers = [
        {t: (rand(NUM_ADAPTERS, i, r * len(outs)), [rand(NUM_ADAPTERS, r, o) for o in outs])
         for t, (i, r, outs) in targets.items()}
        for _ in range(shape["num_hidden_layers"])
    ]  # fmt: skip
    out: dict[str, dict] = {}
    for rows, label in ((32, "32 decode rows"), (512, "512-token prefill")):
        for k in (1, 4, 8):
            token_slots = _spread_slots(rows, k)
            xs = {t: torch.randn(rows, i).to(torch.bfloat16) for t, (i, _, _) in targets.items()}
            row = {}
            for name, (fn, padded) in op_variants().items():
                batch = LoRABatch.build(token_slots, NUM_ADAPTERS, padded)
                batch.token_slots = torch.tensor(token_slots)
                batch.mask = torch.nn.functional.one_hot(batch.token_slots, NUM_ADAPTERS)
                batch.mask = batch.mask.to(torch.bfloat16)
                _check(fn, xs, layers[0], batch, token_slots, add_lora_reference)
                row[name] = _best_ms(fn, xs, layers, batch, repeats)
            out[f"{label}, {k} adapter{'s' if k > 1 else ''}"] = row
            log(f"ops {label}, {k} adapters: " + ", ".join(f"{n} {v:.2f}" for n, v in row.items()))
    return out


def _spread_slots(rows: int, k: int) -> list[int]:
    """Rows spread evenly over k adapters, sorted by adapter (as the engine sorts a step)."""
    return [i * k // rows for i in range(rows)]


def _check(fn, xs, weights, batch, token_slots, reference) -> None:
    t = "qkv_proj"
    a, parts = weights[t]
    width = sum(p.shape[2] for p in parts)
    y = torch.zeros(xs[t].shape[0], width, dtype=torch.bfloat16)
    fn(xs[t], y, a, parts, batch)
    as_double = [p.double() for p in parts]
    want = reference(y.double() * 0, xs[t].double(), a.double(), as_double, token_slots)
    err = (y.double() - want).abs().max().item() / want.abs().max().item()
    assert err < 0.05, f"{fn.__name__}: relative error {err:.3f}"


def _best_ms(fn, xs, layers, batch, repeats: int) -> float:
    """The best time of one step: every target of every layer, each layer's own slots."""
    ys = {
        t: torch.zeros(xs[t].shape[0], sum(p.shape[2] for p in parts), dtype=torch.bfloat16)
        for t, (_, parts) in layers[0].items()
    }
    best = float("inf")
    for _ in range(repeats + 2):
        start = time.perf_counter()
        for weights in layers:
            for t, (a, parts) in weights.items():
                fn(xs[t], ys[t], a, parts, batch)
        best = min(best, time.perf_counter() - start)
    return best * 1e3  # ms per step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="timed runs of the four cases")
    parser.add_argument("--threads", type=int, default=2, help="torch threads for the engines")
    parser.add_argument("--op-repeats", type=int, default=20, help="timings per op (best kept)")
    parser.add_argument("--skip-ops", action="store_true", help="throughput and swap-in only")
    parser.add_argument("--output", default="lora", help="results file name")
    parser.add_argument(
        "--targets",
        nargs="+",
        default=list(HF_TARGETS),
        choices=HF_TARGETS,
        help="the adapters' target modules (default: all six)",
    )
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    model_dir = build_model("122m")
    adapters = build_adapters(targets=tuple(args.targets))
    ops = {} if args.skip_ops else op_timings(args.op_repeats)
    torch.set_num_threads(args.threads)
    figures = throughput(model_dir, adapters, args.runs)
    rates = figures["throughput"]
    worst = min(v["of_base_only"] for k, v in rates.items() if k != "base only")
    result = {
        "model": "122m",
        "quantization": "int4",
        "rank": RANK,
        "target_modules": args.targets,
        "requests": NUM_REQUESTS,
        "prompt_tokens": PROMPT_LEN,
        "max_tokens": MAX_TOKENS,
        "threads": args.threads,
        "load_average_before": list(load_before),
        "load_average_after": list(os.getloadavg()),
        **figures,
        "worst_of_base_only": worst,
        "target": f">= {TARGET_RATIO} of base-only throughput",
        "met": worst >= TARGET_RATIO,
        "ops_ms_per_step": ops,
    }
    path = write_result(args.output, result)
    log(f"wrote {path}")
    for case, v in rates.items():
        log(f"{case}: {v['tokens_per_s']['median']:.1f} tokens/s ({v['of_base_only']:.2f} of base)")
    swap = figures["swap_in"]
    log(f"swap-in from host memory: {swap['from_host_memory_ms']['median']:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
