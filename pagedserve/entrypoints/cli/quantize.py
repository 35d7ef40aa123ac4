"""``pagedserve quantize`` (also ``glm4_quantize``, with the Kunlun XPU deployment guide's flags)
and ``pagedserve eval-quant``.

``eval-quant`` exits 0 on PASS and 1 on FAIL. The tools (``pagedserve.quant``) and torch load only
when a command runs, not for its ``--help``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from pagedserve.entrypoints.cli.utils import offer
from pagedserve.models.config import load_config

logger = logging.getLogger("pagedserve.quant")


def add_quantize_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    a = parser.add_argument
    offer(
        a(
            "--model-path",
            "--model",
            dest="model_path",
            required=True,
            help="16-bit source model directory, or demo (the embedded demo model)",
        ),
        ["demo"],
    )
    a("--output-path", "--output", dest="output_path", required=True, help="output directory")
    a(
        "--quant-method",
        choices=["awq", "rtn"],
        default="awq",
        help="awq: activation-aware scale search on calibration text, then 4-bit groups; "
        "rtn: plain round-to-nearest (default: awq)",
    )
    a("--group-size", type=int, default=32, help="weights per scale/zero group: 32, 64 or 128")
    a("--wbits", type=int, default=4, help="weight bits (only 4)")
    a(
        "--abits",
        type=int,
        default=16,
        help="8: W4A8 (dynamic int8 inputs per block of 32); 16: W4A16",
    )
    a(
        "--skip-layers",
        default="",
        help="comma-separated linear names or globs kept 16-bit "
        "(e.g. '*.down_proj'); the names the Kunlun XPU deployment guide's glm4_quantize takes, "
        "ln_1/ln_2/attn.softmax, are accepted (never quantized)",
    )
    a("--calib-data", default=None, help="plain text, or JSONL with a 'text' field")
    a("--calib-samples", type=int, default=128, help="calibration sequences (default 128)")
    a("--calib-seq-len", type=int, default=512, help="tokens per calibration sequence")
    a(
        "--format",
        choices=["pagedserve", "autoawq"],
        default="pagedserve",
        help="output layout: pagedserve's own, or AutoAWQ's GEMM layout for other engines",
    )
    a("--no-clip", action="store_true", help="AWQ without the clipping search")
    a("--seed", type=int, default=0, help="for random calibration ids (no tokenizer)")
    return parser


def add_eval_quant_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    a = parser.add_argument
    a("--reference", required=True, help="16-bit model directory, or demo (the embedded model)")
    a("--candidate", required=True, help="quantized model directory")
    a(
        "--data",
        default=None,
        help="held-out text/JSONL (needs a tokenizer; default: the demo text)",
    )
    a("--num-samples", type=int, default=16, help="held-out blocks")
    a("--seq-len", type=int, default=256, help="tokens per held-out block")
    a("--max-tokens", type=int, default=32, help="greedy continuation length")
    a("--prompt-len", type=int, default=32, help="prompt tokens for the continuations")
    a(
        "--max-loss-pct",
        type=float,
        default=0.5,
        help="PASS when perplexity rises at most this %% (the Kunlun XPU deployment guide's bar)",
    )
    a(
        "--abits",
        type=int,
        choices=[8, 16],
        default=None,
        help="override the candidate's activation bits (default: its config's abits)",
    )
    a(
        "--generator",
        choices=["reference", "llm"],
        default="reference",
        help="greedy continuations from the fp32 reference forward or from pagedserve's LLM",
    )
    a(
        "--lm-head",
        choices=["none", "int8", "int4"],
        default=None,
        help="round the candidate's lm_head as `serve --quantize-lm-head` would (int4 in groups of "
        "32), to judge that setting; the candidate may be the reference directory itself",
    )
    a(
        "--kv-cache-dtype",
        choices=["auto", "int8"],
        default="auto",
        help="round the candidate's keys and values to int8 with a scale per token and head, as "
        "`serve --kv-cache-dtype int8` stores them, to judge that setting (the KV row); the "
        "candidate may be the reference directory itself",
    )
    a("--seed", type=int, default=1234, help="for random held-out ids (no tokenizer)")
    a("--json", default=None, help="write the results here")
    return parser


def _setup_logging() -> None:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")


def _tokenizer(model_dir: str | Path):
    from pagedserve.models.tokenizer import Tokenizer

    return Tokenizer(model_dir) if (Path(model_dir) / "tokenizer.json").is_file() else None


def _check_quantize_args(args: argparse.Namespace) -> None:
    if args.wbits != 4:
        raise ValueError(f"--wbits {args.wbits}: only 4-bit weights are supported")
    if args.abits not in (8, 16):
        raise ValueError(f"--abits {args.abits}: use 8 (W4A8) or 16 (W4A16)")
    if args.calib_samples < 1 or args.calib_seq_len < 2:
        raise ValueError("--calib-samples must be >= 1 and --calib-seq-len >= 2")


def run_quantize(args: argparse.Namespace) -> int:
    import torch

    from pagedserve.models import resolve_model_path
    from pagedserve.models.loader import load_state_dict
    from pagedserve.models.quant_formats import quantization_config_for, save_quantized
    from pagedserve.quant.awq import QuantizeSettings, quantize_model
    from pagedserve.quant.calib import DEFAULT_CORPUS, load_blocks

    _setup_logging()
    _check_quantize_args(args)
    src, dst = resolve_model_path(args.model_path), Path(args.output_path)
    config = load_config(src)
    if config.quantization_config:
        raise ValueError(f"{src} is already quantized; quantize the 16-bit checkpoint")
    if args.calib_seq_len > config.max_position_embeddings:
        raise ValueError(
            f"--calib-seq-len {args.calib_seq_len} exceeds the model's "
            f"max_position_embeddings {config.max_position_embeddings}"
        )
    state_dict = load_state_dict(src, config)
    calib = load_blocks(
        _tokenizer(src),
        args.calib_data,
        config.vocab_size,
        args.calib_samples,
        args.calib_seq_len,
        args.seed,
        DEFAULT_CORPUS,
        "calibration",
    )
    skip = [s.strip() for s in args.skip_layers.split(",") if s.strip()]
    settings = QuantizeSettings(args.quant_method, args.group_size, skip, clip=not args.no_clip)
    with torch.no_grad():
        result = quantize_model(config, state_dict, calib, settings)
    qc = quantization_config_for(args.format, args.group_size, args.abits, skip, args.quant_method)
    raw_config = json.loads((src / "config.json").read_text())
    save_quantized(dst, result.dense, result.quantized, raw_config, qc, source_dir=src)
    report = {
        **result.report,
        "abits": args.abits,
        "format": args.format,
        "calibration": {"samples": int(calib.shape[0]), "seq_len": int(calib.shape[1])},
    }
    (dst / "quant_report.json").write_text(json.dumps(report, indent=2))
    logger.info(
        "quantized %d linears (%d kept 16-bit) into %s",
        len(result.quantized),
        len(result.report["skipped"]),
        dst,
    )
    return 0


def run_eval_quant(args: argparse.Namespace) -> int:
    from pagedserve.models import resolve_model_path
    from pagedserve.quant.calib import load_blocks
    from pagedserve.quant.evaluate import (
        DEFAULT_HELDOUT,
        evaluate,
        format_table,
        load_reference_model,
        sample_blocks,
    )

    _setup_logging()
    args.reference = str(resolve_model_path(args.reference))
    args.candidate = str(resolve_model_path(args.candidate))
    config = load_config(args.reference)
    tokenizer = _tokenizer(args.reference)
    if tokenizer is None and args.data is None:
        logger.info(
            "held-out: no tokenizer; sampling %d blocks from the reference", args.num_samples
        )
        reference = load_reference_model(args.reference, act_bits=16)
        blocks = sample_blocks(reference, args.num_samples, args.seq_len, args.seed)
    else:
        blocks = load_blocks(
            tokenizer,
            args.data,
            config.vocab_size,
            args.num_samples,
            args.seq_len,
            args.seed,
            DEFAULT_HELDOUT,
            "held-out",
        )
    result = evaluate(
        args.reference,
        args.candidate,
        blocks,
        args.max_loss_pct,
        args.prompt_len,
        args.max_tokens,
        args.generator,
        args.abits,
        args.lm_head,
        args.kv_cache_dtype,
    )
    print(format_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_dict(), indent=2))
    return 0 if result.passed else 1


def glm4_quantize_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="glm4_quantize",
        description="AWQ/RTN INT4 for GLM-4, with the flags of the Kunlun XPU deployment guide's "
        "glm4_quantize",
    )
    args = add_quantize_args(parser).parse_args(argv)
    try:
        return run_quantize(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
