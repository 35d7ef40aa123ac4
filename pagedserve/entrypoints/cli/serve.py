"""``pagedserve serve``: the OpenAI-compatible HTTP server over an engine core in a process of its
own (or, with ``--node-rank`` > 0, a node's tensor-parallel ranks without HTTP).

The flags are vLLM's names (with SGLang's ``--mem-fraction-static`` and ``--tp-size`` as aliases)
so that a vLLM launch script works unchanged; ``--config FILE`` reads them from YAML.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

from pagedserve.config import (
    KERNEL_CHOICES,
    KV_CACHE_DTYPES,
    PREEMPTION_MODES,
    SpeculativeConfig,
)
from pagedserve.entrypoints.cli.utils import offer, subparser
from pagedserve.presets import preset_names

logger = logging.getLogger("pagedserve.serve")

DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0  # as Kubernetes' default terminationGracePeriodSeconds

ENGINE_ARGS = (
    "model", "tokenizer", "dtype", "quantization", "quant_group_size", "block_size",
    "max_num_seqs", "max_num_batched_tokens", "max_model_len", "gpu_memory_utilization",
    "num_kv_pages", "enable_prefix_caching", "seed", "device", "kernels", "enforce_eager",
    "quantize_lm_head", "weight_scrub_pages", "tensor_parallel_size", "nnodes", "node_rank",
    "dist_init_addr", "dist_timeout", "kv_cache_dtype", "swap_space", "host_prefix_cache",
    "preemption_mode", "speculative_config", "enable_lora", "max_loras", "max_lora_rank",
    "max_cpu_loras",
)  # fmt: skip


# `serve --help` in groups, as vLLM's is (its ModelConfig, CacheConfig, SchedulerConfig,
# DeviceConfig/ParallelConfig and frontend groups); a flag's name and default stay vLLM's.
SERVE_GROUPS = {
    "Model": "Which checkpoint, its dtype and quantization, its context length.",
    "Cache": "The paged KV cache: page size, memory share, prefix sharing, its dtype, and the "
    "host tier's share for swapped pages and spilled prefix blocks.",
    "Scheduler": "How many sequences and tokens one engine step takes; the waiting queue.",
    "Device": "Where the model runs, on how many ranks, with which kernels; how many "
    "data-parallel replicas of it.",
    "LoRA": "Fine-tuned LoRA adapters (PEFT directories) served beside the base model; a "
    "request picks one by its model name.",
    "Server": "The HTTP front end.",
    "Ray Serve": "Data-parallel replicas on Ray Serve (--data-parallel-backend ray): how "
    "requests are routed to them, how many run, where they go.",
}


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="YAML file of serve flags (keys are flag names, with dashes "
        "or underscores); flags on the command line override it (default: none)",
    )
    groups = {title: parser.add_argument_group(title, text) for title, text in SERVE_GROUPS.items()}
    _add_model_args(groups["Model"].add_argument)
    _add_cache_args(groups["Cache"].add_argument)
    _add_scheduler_args(groups["Scheduler"].add_argument)
    _add_device_args(groups["Device"].add_argument)
    _add_lora_args(groups["LoRA"].add_argument)
    _add_server_args(groups["Server"].add_argument)
    _add_tool_args(groups["Server"].add_argument)  # vLLM keeps them with its frontend's flags
    _add_ray_serve_args(groups["Ray Serve"].add_argument)
    return parser


def _add_model_args(a: Callable[..., argparse.Action]) -> None:
    model = a(
        "--model",
        default="demo",
        help="local model directory (config.json, safetensors, "
        "tokenizer.json) or 'demo' for the embedded demo model; nothing is downloaded",
    )
    offer(model, ["demo"])
    a("--tokenizer", default=None, help="tokenizer directory (default: the model directory)")
    a("--served-model-name", default=None, help="the model name clients send (default: --model)")
    a(
        "--dtype",
        default=None,
        choices=["auto", "float32", "bfloat16", "float16"],
        help="activation / 16-bit weight dtype (default auto: the checkpoint's)",
    )
    a(
        "--quantization",
        "-q",
        default=None,
        help="weight quantization at load: int4 (group-wise round-to-nearest, bf16 activations) "
        "or w4a8 (the same weights, activations rounded to int8 per block of 32, as llama.cpp's "
        "Q8_0: integer dot products, "
        "about twice the arithmetic rate) (default: the checkpoint's own, so none for a 16-bit "
        "checkpoint)",
    )
    a(
        "--quant-group-size",
        type=int,
        default=None,
        help="int4 group size of --quantization: 32, 64 or 128 (default 32)",
    )
    a(
        "--quantize-lm-head",
        choices=["none", "int8", "int4"],
        default=None,
        help="lm_head weights: 16-bit, int8 per channel, or int4 in groups of --quant-group-size "
        "(default: as the checkpoint has them). At batch 1 lm_head is a large share of each "
        "token; check the quality with `pagedserve eval-quant --lm-head`",
    )
    a(
        "--max-model-len",
        type=int,
        default=None,
        help="longest prompt + output in tokens (default: the model's context)",
    )
    a("--seed", type=int, default=None, help="random seed of the engine (default 0)")


def _add_cache_args(a: Callable[..., argparse.Action]) -> None:
    a("--block-size", type=int, default=None, help="tokens per KV page (default 16)")
    a(
        "--gpu-memory-utilization",
        "--mem-fraction-static",
        type=float,
        default=None,
        help="fraction of device memory that weights plus KV cache may take, as in vLLM; on a "
        "preset without a shared memory_bytes, of its KV tier (default 0.9)",
    )
    a(
        "--num-kv-pages",
        type=int,
        default=None,
        help="exact KV page count (default: as many as --gpu-memory-utilization leaves room for)",
    )
    a(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="share KV pages between requests with a common prefix (default on)",
    )
    a(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default=None,
        help="auto: keys and values in the model's dtype; int8: int8 codes with an fp32 scale per "
        "token and head (head_dim + 4 bytes a head instead of 2 x head_dim: nearly twice the "
        "tokens per page pool; `pagedserve eval-quant --kv-cache-dtype int8` measures the cost) "
        "(default auto)",
    )
    a(
        "--swap-space",
        type=float,
        default=None,
        metavar="GiB",
        help="host-tier memory per card for the KV pages of preempted sequences, which come "
        "back by copy instead of being recomputed (see --preemption-mode) (default 0: none)",
    )
    a(
        "--host-prefix-cache",
        type=float,
        default=None,
        metavar="GiB",
        help="host-tier memory per card for prefix-cache blocks the KV cache evicts (least "
        "recently used first); a later hit copies them back instead of recomputing them, as "
        "SGLang's HiCache does (default 0: evicted blocks are lost)",
    )


def _add_scheduler_args(a: Callable[..., argparse.Action]) -> None:
    a("--max-num-seqs", type=int, default=None, help="most sequences in one batch (default 64)")
    a(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="token budget of one engine step (default 2048)",
    )
    a(
        "--max-queue-len",
        type=int,
        default=None,
        help="waiting requests beyond which new ones get 503 with Retry-After (default: unbounded)",
    )
    a(
        "--preemption-mode",
        choices=PREEMPTION_MODES,
        default=None,
        help="when KV pages run out, what the preempted sequence's pages become: recompute "
        "(freed, computed again later), swap (copied to the --swap-space and back while it has "
        "room), auto (swap when the copy costs less than the recompute, by the rates measured "
        "on this device; recompute when the swap space is full) (default auto)",
    )

    a(
        "--speculative-config",
        type=_speculative_config,
        default=None,
        metavar="JSON",
        help="speculative decoding, as vLLM's JSON: "
        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\' drafts up '
        "to num_speculative_tokens (1 to 7) tokens by looking the last prompt_lookup_max down to "
        "prompt_lookup_min tokens up earlier in the sequence, and verifies them in one forward "
        "pass; greedy output is unchanged (default: none)",
    )


def _speculative_config(text: str) -> SpeculativeConfig:
    """``--speculative-config``'s JSON, or argparse's error naming the flag and what is wrong."""
    try:
        return SpeculativeConfig.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_device_args(a: Callable[..., argparse.Action]) -> None:
    device = a(
        "--device",
        default=None,
        help="a backend (kunlun-emu, the default; cpu; cuda), a device preset "
        f"({', '.join(preset_names('devices'))}) or the path of a preset YAML file",
    )
    offer(device, dict.fromkeys(["kunlun-emu", "cpu", "cuda", *preset_names("devices")]))
    a(
        "--tensor-parallel-size",
        "--tp-size",
        type=int,
        default=1,
        help="tensor-parallel ranks, one card each (one process per rank): the weights and KV "
        "heads are split Megatron-style. At most the device's cards per node (kunlun-emu: 8); "
        "cpu allows any size",
    )
    a(
        "--nnodes",
        type=int,
        default=None,
        help="machines the tensor-parallel ranks are spread over, as in SGLang (default 1)",
    )
    a(
        "--node-rank",
        type=int,
        default=None,
        help="this machine's index among --nnodes; node 0 serves HTTP, the others only compute "
        "(default 0)",
    )
    a(
        "--dist-init-addr",
        default=None,
        metavar="HOST:PORT",
        help="node 0's rendezvous address (torch.distributed TCP store) that every node reaches; "
        "needed with --nnodes > 1 (default: a free local port)",
    )
    a(
        "--dist-timeout",
        type=float,
        default=None,
        help="seconds to wait at start-up for every rank to join the rendezvous (default 60)",
    )
    a(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        metavar="N",
        help="replicas of the whole engine (each with its own engine core and KV pool) behind "
        "one OpenAI-compatible endpoint, as vLLM's flag; more than 1 needs "
        "--data-parallel-backend ray (default %(default)s)",
    )
    a(
        "--data-parallel-backend",
        "-dpb",
        choices=["mp", "ray"],
        default="mp",
        help="ray: the replicas run on Ray Serve (pip install 'pagedserve[ray]'), on this "
        "machine or across a Ray cluster (--ray-address), with the routing, autoscaling, "
        "restarts and drain of the Ray Serve flags; mp (vLLM's default): one engine, in a "
        "process of its own (default %(default)s)",
    )
    a(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="the Ray cluster to join (HOST:6379 of its head, or auto: the one this machine "
        "belongs to); the server's application is removed from it on exit (default: $RAY_ADDRESS, "
        "else a Ray instance on this machine, started and stopped with the server)",
    )
    a(
        "--kernels",
        default=None,
        choices=KERNEL_CHOICES,
        help="the CPU backends' native kernels: auto takes the best instruction set this CPU "
        "executes (avx512: AVX-512 BF16 + VNNI; avx2: AVX2 + FMA + F16C; portable: plain C++), "
        "built once per machine and cached; eager runs plain PyTorch ops (default auto)",
    )
    a(
        "--enforce-eager",
        action="store_true",
        default=None,
        help="the same as --kernels eager (vLLM's flag): plain PyTorch ops, for debugging and for "
        "machines without a C++ compiler",
    )

    a(
        "--weight-scrub-pages",
        type=int,
        default=None,
        help="weight pages (64 KiB each) whose checksums the patrol scrub verifies in every "
        "step; a corrupted page is restored from the checkpoint and the step recomputed; 0 "
        "turns the patrol off (POST /device/scrub still verifies all) (default 2: 128 KiB, "
        "about 0.1 ms a step)",
    )
    a(
        "--enable-fault-injection",
        action="store_true",
        default=None,
        help="let POST /device/faults inject device faults (a flipped bit in a KV or weight "
        "page, a failing kernel) on --device kunlun-emu, to test recovery; never in production",
    )


def _add_lora_args(a: Callable[..., argparse.Action]) -> None:
    a(
        "--enable-lora",
        action="store_true",
        default=None,
        help="serve LoRA adapters beside the base model (an INT4 base stays INT4; adapters are "
        "16-bit); a request picks one by its model name",
    )
    a(
        "--lora-modules",
        nargs="+",
        type=_lora_module,
        default=None,
        metavar="NAME=PATH",
        help="adapters loaded at start-up, each name=path or vLLM's JSON "
        '\'{"name": "sql", "path": "/adapters/sql", "base_model_name": "glm-4"}\'; a path is a '
        "PEFT directory (adapter_config.json + adapter_model.safetensors) whose target modules "
        "are GLM-4's linear layers (HF names or the original chatglm ones) (default: none)",
    )
    a(
        "--max-loras",
        type=int,
        default=None,
        help="most distinct adapters in one engine step (each has a device slot); a request "
        "for another waits (default 1)",
    )
    a(
        "--max-lora-rank",
        type=int,
        default=None,
        help="highest adapter rank served; an adapter of a higher rank is refused (default 16)",
    )
    a(
        "--max-cpu-loras",
        type=int,
        default=None,
        help="adapters kept in host memory, least recently used leave first (then read from disk "
        "again when needed); at least --max-loras (default: --max-loras)",
    )
    a(
        "--allow-runtime-lora-updating",
        action="store_true",
        default=None,
        help="let POST /v1/load_lora_adapter and /v1/unload_lora_adapter change the adapters "
        "while serving (the same as vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING=true)",
    )


def _lora_module(text: str):
    """One ``--lora-modules`` entry, or argparse's error saying what is wrong."""
    from pagedserve.lora.request import LoRAModulePath

    try:
        return LoRAModulePath.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _add_server_args(a: Callable[..., argparse.Action]) -> None:
    a("--host", default="127.0.0.1", help="address to listen on; 0.0.0.0 for all interfaces")
    a("--port", type=int, default=8000, help="TCP port to listen on")
    a(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health, /metrics, "
        "/version and the API docs (default: $PAGEDSERVE_API_KEY)",
    )
    a(
        "--disable-web-ui",
        action="store_true",
        help="do not serve the web console (chat playground and device monitor) at /",
    )
    a(
        "--max-logprobs",
        type=int,
        default=20,
        help="most logprobs / top_logprobs a request may ask for per token, as in vLLM "
        "(default %(default)s)",
    )
    a(
        "--max-request-body",
        type=int,
        default=8 * 2**20,
        metavar="BYTES",
        help="request bodies over this many bytes get 413 before they are read "
        "(default %(default)s: 8 MiB)",
    )
    a(
        "--allowed-origins",
        nargs="+",
        default=None,
        metavar="ORIGIN",
        help="browser origins allowed by CORS, e.g. https://app.example.com, or * for any "
        "(default: none, and no CORS headers are sent)",
    )
    a(
        "--timeout-keep-alive",
        type=float,
        default=75.0,
        metavar="SECONDS",
        help="close a keep-alive connection after it has been idle this long (default "
        "%(default)s). Keep it above your clients' idle expiry (httpx and the openai SDK: 5 s; "
        "proxies and load balancers: often 60 s), or a client can send on a connection the "
        "server is closing and get a connection reset",
    )
    a(
        "--shutdown-timeout",
        type=float,
        default=DEFAULT_SHUTDOWN_TIMEOUT_S,
        metavar="SECONDS",
        help="on SIGTERM (or Ctrl-C), admit no new requests (503) and let those in flight finish "
        "for up to this long, then fail the rest with 503 and exit; with "
        "--data-parallel-backend ray, also how long a replica being stopped or scaled down "
        "drains. 0 fails them at once, as vLLM's default does (default %(default)s)",
    )
    a(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error", "critical"],
        help="log verbosity",
    )


def _add_tool_args(a: Callable[..., argparse.Action]) -> None:
    a(
        "--enable-auto-tool-choice",
        action="store_true",
        default=None,
        help="let the model decide whether to call the request's tools (tool_choice 'auto', the "
        "default with tools); needs --tool-call-parser (default off: 'auto' is a 400 naming "
        "this flag)",
    )
    a(
        "--tool-call-parser",
        default=None,
        metavar="NAME",
        help="the model's tool-call format: glm4 (GLM-4-9B-chat, GLM-4-0414, the demo model: "
        "the name, a newline, the JSON arguments) or glm45 (GLM-4.5's XML), or one a "
        "--tool-parser-plugin registers (default: none; tool_choice 'required' and named "
        "functions then use the glm4 form)",
    )
    a(
        "--tool-parser-plugin",
        default=None,
        metavar="FILE",
        help="a Python file that registers tool-call parsers "
        "(@ToolParserManager.register_module('name')) (default: none)",
    )
    a(
        "--reasoning-parser",
        default=None,
        metavar="NAME",
        help="split a thinking model's output into reasoning_content and content: glm4 (GLM-Z1's "
        "<think>...</think>) (default: none; the thinking stays in content)",
    )
    chat_template = a(
        "--chat-template",
        default=None,
        metavar="NAME_OR_FILE",
        help="the chat template: a jinja file, or a built-in (glm4-chat, glm4-0414, "
        "glm-z1-0414: GLM-4's formats, with OpenAI's tool messages) (default: the model's own; "
        "a model with GLM-4's published template gets its built-in counterpart)",
    )
    offer(chat_template, ["glm4-chat", "glm4-0414", "glm-z1-0414"])


def _add_ray_serve_args(a: Callable[..., argparse.Action]) -> None:
    from pagedserve.entrypoints.ray_serve.affinity import DEFAULT_IMBALANCE_THRESHOLD

    a(
        "--request-router",
        choices=["prefix-aware", "session", "power-of-two"],
        default="prefix-aware",
        help="which replica takes a request. prefix-aware: the one where it costs the fewest "
        "tokens of prefill, those queued there plus twice those of the prompt that its prefix "
        "cache most likely lacks (a conversation's next turn goes where its history is cached "
        "unless that replica's queue is longer than twice the history; a prefix that many prompts "
        "share, such as a system prompt, is cached on every replica); session: every request "
        "with the same X-Session-ID header or `user` field to one replica, others as "
        "prefix-aware; power-of-two: Ray Serve's default, the shorter queue of two replicas "
        "drawn at random (default %(default)s)",
    )
    a(
        "--router-imbalance-threshold",
        type=int,
        default=DEFAULT_IMBALANCE_THRESHOLD,
        metavar="N",
        help="prefix-aware and session routing send a request to the least-loaded replica "
        "instead once the replica they would pick has N more requests in flight "
        "(default %(default)s)",
    )
    a(
        "--min-replicas",
        type=int,
        default=None,
        metavar="N",
        help="autoscale: the fewest replicas Ray Serve scales down to (default: no autoscaling; "
        "--data-parallel-size replicas run)",
    )
    a(
        "--max-replicas",
        type=int,
        default=None,
        metavar="N",
        help="autoscale: the most replicas Ray Serve scales up to; --data-parallel-size is the "
        "number it starts with (default: no autoscaling)",
    )
    a(
        "--target-ongoing-requests",
        type=float,
        default=None,
        metavar="N",
        help="autoscale to keep about this many requests in flight per replica (default: "
        "--max-num-seqs, one full batch)",
    )
    a(
        "--max-ongoing-requests",
        type=int,
        default=None,
        metavar="N",
        help="requests in flight one replica takes; more wait at the router (default: twice "
        "--max-num-seqs)",
    )
    a(
        "--max-replicas-per-node",
        type=int,
        default=None,
        metavar="N",
        help="most replicas on one Ray node, e.g. 1 for one engine per machine (default: no limit)",
    )
    a(
        "--num-cpus-per-replica",
        type=float,
        default=1.0,
        metavar="CPUS",
        help="the CPUs Ray reserves for each replica (fractions allowed), which also sets its "
        "engine's threads (default %(default)s)",
    )


def tool_settings(args: argparse.Namespace) -> dict:
    """The tool, reasoning and template flags as ``build_app`` takes them; ``ValueError`` (or
    ``FileNotFoundError``) names a bad flag."""
    from pagedserve.models.chat_templates import load_chat_template
    from pagedserve.server.reasoning_parsers import ReasoningParserManager
    from pagedserve.server.tool_parsers import ToolParserManager

    if args.tool_parser_plugin:
        ToolParserManager.import_tool_parser(args.tool_parser_plugin)
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME (e.g. glm4)")
    if args.tool_call_parser:
        ToolParserManager.get_tool_parser(args.tool_call_parser)
    if args.reasoning_parser:
        ReasoningParserManager.get_reasoning_parser(args.reasoning_parser)
    return {
        "tool_call_parser": args.tool_call_parser,
        "enable_auto_tool_choice": bool(args.enable_auto_tool_choice),
        "reasoning_parser": args.reasoning_parser,
        "chat_template": load_chat_template(args.chat_template) if args.chat_template else None,
    }


def apply_config_file(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse ``argv``; values from ``--config FILE`` fill in every flag not given on the line."""
    args = parser.parse_args(argv)
    if not getattr(args, "config", None):
        return args
    serve = subparser(parser, "serve")
    serve.set_defaults(**read_config_file(serve, args.config))
    return parser.parse_args(argv)


def read_config_file(parser: argparse.ArgumentParser, path: str) -> dict:
    file = Path(path)
    if not file.is_file():
        parser.error(f"--config {path}: no such file")
    data = yaml.safe_load(file.read_text()) or {}
    if not isinstance(data, dict):
        parser.error(f"--config {path}: expected a mapping of flag names to values")
    return flag_defaults(parser, data, f"--config {path}")


def flag_defaults(parser: argparse.ArgumentParser, data: dict, where: str) -> dict:
    """``data`` (serve flag names, with dashes or underscores, to values) as the parser's
    defaults by destination; an unknown name is ``parser.error`` saying ``where`` it was."""
    dests = {opt.lstrip("-"): act.dest for opt, act in parser._option_string_actions.items()}
    defaults = {}
    for key, value in data.items():
        flag = str(key).replace("_", "-")
        if flag not in dests or flag in ("config", "help", "h"):
            parser.error(f"{where}: unknown key {key!r}; keys are serve flag names")
        defaults[dests[flag]] = value
    return defaults


def engine_kwargs(args: argparse.Namespace) -> dict:
    kwargs = {k: getattr(args, k) for k in ENGINE_ARGS if getattr(args, k, None) is not None}
    modules = getattr(args, "lora_modules", None)
    if modules:
        kwargs["lora_modules"] = [_lora_module_dict(m) for m in modules]
    return kwargs


def _lora_module_dict(module) -> dict:
    """A ``--lora-modules`` entry as the engine takes it (a YAML ``--config`` gives strings or
    mappings, which argparse's type does not see)."""
    from pagedserve.lora.request import LoRAModulePath

    if isinstance(module, dict):
        module = LoRAModulePath.parse(json.dumps(module))
    elif isinstance(module, str):
        module = LoRAModulePath.parse(module)
    return {"name": module.name, "path": module.path, "base_model_name": module.base_model_name}


ENGINE_DEAD_EXIT_DELAY_S = 1.0


def run_serve(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.data_parallel_backend == "ray":
        return _serve_on_ray(args)
    listener = None
    try:
        if args.data_parallel_size != 1:
            raise ValueError(
                f"--data-parallel-size {args.data_parallel_size} needs --data-parallel-backend "
                "ray: data-parallel replicas run on Ray Serve (pip install 'pagedserve[ray]')"
            )
        if args.node_rank:
            return _serve_node(args)
        tools = tool_settings(args)
        listener = bind_listener(args.host, args.port)  # a busy port fails now, not after loading
        with _signals_stop_the_start():
            engine = _build_engine(args)
    except (ValueError, TypeError, FileNotFoundError) as e:
        _close(listener)
        logger.debug("the server could not start", exc_info=True)  # --log-level debug
        print(f"pagedserve serve: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        _close(listener)
        logger.debug("the server could not start", exc_info=True)
        print(f"pagedserve serve: error: {e}", file=sys.stderr)
        return 1
    except StartInterrupted as e:
        _close(listener)
        name = signal.Signals(e.signum).name
        print(f"pagedserve serve: stopped by {name} while starting", file=sys.stderr)
        return 128 + e.signum  # as a shell reports a program that a signal ended
    return _serve(engine, args, tools, listener)


def _close(listener: socket.socket | None) -> None:
    if listener is not None:
        listener.close()


def bind_listener(host: str, port: int) -> socket.socket:
    """The server's socket, bound (not yet listening: a client is refused until the model has
    loaded) before anything loads, as uvicorn would bind it; a ``ValueError`` naming the flag
    when the address is taken or cannot be had. Not inherited by the engine core."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ValueError(
                f"--port {port}: {host}:{port} is already in use (another server listens "
                f"there); stop it, or start this one with another --port"
            ) from None
        raise ValueError(
            f"--host {host} --port {port}: cannot listen there ({e.strerror or e}); choose "
            f"another --port (ports below 1024 need root), or a --host of this machine"
        ) from None
    return sock


def _serve_on_ray(args: argparse.Namespace) -> int:
    """The replicas on Ray Serve (``entrypoints.ray_serve``), once the flags are known good."""
    try:
        from pagedserve.entrypoints.ray_serve.app import application, run_serve
    except ImportError as e:
        print(
            f"pagedserve serve: error: --data-parallel-backend ray needs Ray Serve ({e}): "
            "pip install 'pagedserve[ray]'",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        app = application(args, engine_kwargs(args), tool_settings(args))
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"pagedserve serve: error: {e}", file=sys.stderr)
        return 2
    return run_serve(args, app)


class StartInterrupted(BaseException):  # noqa: N818 - a stop, as KeyboardInterrupt is
    """SIGTERM or SIGINT arrived while the engine core was starting."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


@contextmanager
def _signals_stop_the_start() -> Iterator[None]:
    """SIGTERM (a supervisor's stop) and SIGINT (Ctrl-C) raise ``StartInterrupted`` while the
    engine loads, so that what it started is stopped on the way out (``MPCoreClient``: the
    engine core, and with it its tensor-parallel ranks, and the socket directory). Python's own
    SIGTERM would end this process at once and leave them to notice; once serving, uvicorn
    handles both (a drain)."""

    def stop(signum: int, frame: object) -> None:
        raise StartInterrupted(signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _build_engine(args: argparse.Namespace):
    """The engine core in a process of its own, once it has loaded."""
    from pagedserve.config import EngineConfig
    from pagedserve.engine.async_engine import AsyncLLMEngine
    from pagedserve.engine.start_checks import check_before_start
    from pagedserve.models.model_dir import resolve_model_path

    config = EngineConfig.from_kwargs(**engine_kwargs(args))
    # more ranks than cards, a damaged model directory, a --tensor-parallel-size that cannot
    # split the model: said in one line before the engine core (and its ranks) are spawned
    check_before_start(resolve_model_path(config.model.model), config)
    # the engine core logs its device, pages and concurrency once it has loaded: not again here
    return AsyncLLMEngine.from_config(config, args.max_queue_len, args.log_level)


def _serve_node(args: argparse.Namespace) -> int:
    """A node other than 0 of a multi-node tensor-parallel server: its ranks, no HTTP."""
    from pagedserve.config import EngineConfig
    from pagedserve.engine.executor import serve_node

    logger.info("node %d of %d: joining %s", args.node_rank, args.nnodes or 1, args.dist_init_addr)
    return serve_node(EngineConfig.from_kwargs(**engine_kwargs(args)), args.log_level)


def _serve(engine, args: argparse.Namespace, tools: dict, listener: socket.socket) -> int:
    """Serve until SIGTERM (drained: exit 0) or the engine core's death (exit 1)."""
    import uvicorn

    from pagedserve.server.app import build_app

    api_key = args.api_key or os.environ.get("PAGEDSERVE_API_KEY")
    app = build_app(
        engine,
        args.served_model_name or args.model,
        api_key,
        args.max_queue_len,
        web_ui=not args.disable_web_ui,
        enable_fault_injection=bool(args.enable_fault_injection),
        max_logprobs=args.max_logprobs,
        max_request_body=args.max_request_body,
        allowed_origins=args.allowed_origins,
        allow_runtime_lora_updating=bool(args.allow_runtime_lora_updating),
        **tools,
    )
    # httptools parses HTTP faster than h11 (a dependency; uvicorn's "auto" picks it); uvloop
    # measured no faster than asyncio here, so asyncio (README "Serving")
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        loop="asyncio",
        timeout_keep_alive=args.timeout_keep_alive,
    )
    logger.info(
        "serving %s on http://%s:%d", args.served_model_name or args.model, args.host, args.port
    )
    server = DrainingServer(config, engine, args.shutdown_timeout)
    engine.on_dead(server.exit_on_engine_death)
    try:
        server.run(sockets=[listener])
    finally:
        engine.shutdown()
        listener.close()
    return server.exit_code


def _draining_server_class():
    import uvicorn

    class _DrainingServer(uvicorn.Server):
        """On SIGTERM: stop admitting (503), let the requests in flight finish for up to
        ``shutdown_timeout`` seconds, fail the rest (503), then exit 0. When the engine core
        dies: fail what is in flight, answer 503 for a moment, exit 1."""

        def __init__(self, config, async_engine, shutdown_timeout: float):
            super().__init__(config)
            self.async_engine = async_engine
            self.shutdown_timeout = shutdown_timeout
            self.exit_code = 0

        def handle_exit(self, sig, frame) -> None:
            if self.async_engine.draining:
                return super().handle_exit(sig, frame)
            logger.info(
                "signal %s: draining %d requests in flight for up to %g s "
                "(--shutdown-timeout), admitting none",
                sig,
                self.async_engine.num_unfinished,
                self.shutdown_timeout,
            )
            self.async_engine.draining = True
            loop = asyncio.get_event_loop()  # the serving loop: a signal runs on its thread
            threading.Thread(target=self._exit_when_drained, args=(loop,), daemon=True).start()

        def _exit_when_drained(self, loop: asyncio.AbstractEventLoop) -> None:
            engine = self.async_engine
            deadline = time.monotonic() + self.shutdown_timeout
            while engine.num_unfinished and engine.is_alive and time.monotonic() < deadline:
                time.sleep(0.05)
            if engine.num_unfinished and engine.is_alive:
                reason = (
                    f"the server shut down before this request finished: --shutdown-timeout "
                    f"{self.shutdown_timeout:g} s passed; send it again"
                )
                loop.call_soon_threadsafe(engine.fail_all, reason)
                while engine.num_unfinished and time.monotonic() < deadline + 5:
                    time.sleep(0.05)  # the failed streams end their responses
            self.should_exit = True

        def exit_on_engine_death(self, reason: str) -> None:
            """Exit non-zero so that a supervisor (compose's restart policy) restarts the server;
            /health answers 503 until then."""
            logger.error("%s; the server exits so that it can be restarted", reason)
            self.exit_code = 1
            loop = asyncio.get_running_loop()
            loop.call_later(ENGINE_DEAD_EXIT_DELAY_S, setattr, self, "should_exit", True)

    return _DrainingServer


def DrainingServer(  # noqa: N802 - a class built lazily (uvicorn import)
    config, async_engine, shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S
):
    return _draining_server_class()(config, async_engine, shutdown_timeout)
