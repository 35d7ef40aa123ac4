"""``pagedserve tune``: the weights, KV pages and batch limits of a model on a device
(``pagedserve.engine.memory_plan``), explained, and a launch script for ``pagedserve serve``."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from pagedserve.config import KV_CACHE_DTYPES
from pagedserve.engine.memory_plan import (
    DEFAULT_DEVICE,
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    KV_DTYPE_BYTES,
    explain,
    tune,
)
from pagedserve.entrypoints.cli.utils import offer
from pagedserve.presets import preset_names


def add_tune_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    model = parser.add_argument(
        "--model",
        required=True,
        help="checkpoint directory or model preset "
        f"({', '.join(preset_names('models'))}; demo: the embedded demo model's)",
    )
    offer(model, ["demo", *preset_names("models")])
    device = parser.add_argument(
        "--device",
        default=DEFAULT_DEVICE,
        help=f"device preset ({', '.join(preset_names('devices'))}) or a preset YAML file "
        "(default: %(default)s, as for serve)",
    )
    offer(device, preset_names("devices"))
    parser.add_argument(
        "--tensor-parallel-size",
        "--tp-size",
        "-tp",
        type=int,
        default=1,
        help="cards the weights and KV heads are split over (figures are per card)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="default: the model's max_position_embeddings",
    )
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--quantization", choices=["int4", "none"], default="int4")
    parser.add_argument("--quant-group-size", type=int, default=32)
    parser.add_argument(
        "--kv-dtype",
        choices=list(KV_DTYPE_BYTES),
        default="bf16",
        help="dtype of the 16-bit weights, and of the KV cache unless --kv-cache-dtype is int8 "
        "(serve's --dtype)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="as serve's: auto keeps the KV cache in --kv-dtype; int8 stores head_dim + 4 bytes "
        "a head and token (codes and a scale)",
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help=f"token budget of one engine step (default {DEFAULT_MAX_NUM_BATCHED_TOKENS}, serve's)",
    )
    parser.add_argument(
        "--enable-lora",
        action="store_true",
        help="plan for serve --enable-lora: the adapters' device slots beside the weights",
    )
    parser.add_argument(
        "--max-loras",
        type=int,
        default=1,
        help="adapters in one step, a device slot each (with --enable-lora) (default 1, serve's)",
    )
    parser.add_argument(
        "--max-lora-rank",
        type=int,
        default=16,
        help="the slots' rank (with --enable-lora) (default 16, serve's)",
    )
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument(
        "--write",
        metavar="FILE",
        default=None,
        help="write the launch script to FILE too (default: print it only)",
    )
    return parser


def run_tune(args: argparse.Namespace) -> int:
    try:
        result = tune(
            args.model,
            args.device,
            args.tensor_parallel_size,
            args.max_model_len,
            args.gpu_memory_utilization,
            args.quantization,
            args.kv_dtype,
            args.block_size,
            args.quant_group_size,
            args.max_num_batched_tokens,
            args.kv_cache_dtype,
            max_loras=args.max_loras if args.enable_lora else 0,
            max_lora_rank=args.max_lora_rank,
        )
    except ValueError as exc:
        print(f"pagedserve tune: error: {exc}", file=sys.stderr)
        return 2
    if args.write:
        path = Path(args.write)
        path.write_text(result.launch_script)
        path.chmod(0o755)
    if args.json:
        print(json.dumps(asdict(result), indent=2))
    else:
        print(explain(result))
        print(f"\nlaunch script{f' (written to {args.write})' if args.write else ''}:\n")
        print(result.launch_script)
    return 0
