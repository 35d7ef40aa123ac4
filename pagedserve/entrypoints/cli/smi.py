"""``pagedserve smi``: nvidia-smi for a running server, read from its ``GET /device``."""

from __future__ import annotations

import argparse
import json
import sys
import time

import httpx

DEFAULT_URL = "http://127.0.0.1:8000"


def add_smi_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    a = parser.add_argument
    a("--url", default=DEFAULT_URL, help=f"the server's base URL (default {DEFAULT_URL})")
    a("--api-key", default=None, help="the server's --api-key, if it has one")
    a("-q", "--query", action="store_true", help="detailed report (per tier, per allocation)")
    a(
        "-d",
        "--device-index",
        "--id",
        type=int,
        default=None,
        dest="device_index",
        help="only card N (a tensor-parallel server has one card per rank; otherwise 0)",
    )
    a("--json", action="store_true", help="print the raw figures as JSON")
    a(
        "--watch",
        "-l",
        type=float,
        default=None,
        metavar="SECONDS",
        help="refresh every SECONDS until interrupted",
    )
    a("--timeout", type=float, default=5.0, help="HTTP timeout in seconds")
    return parser


def fetch_devices(url: str, api_key: str | None = None, timeout: float = 5.0) -> list[dict]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(url.rstrip("/") + "/device", headers=headers, timeout=timeout)
    if response.status_code == 401:
        what = "a different key" if api_key else "an API key"
        raise ValueError(
            f"{url}/device answered 401: the server was started with --api-key; pass {what} "
            "with --api-key"
        )
    response.raise_for_status()
    body = response.json()
    return body if isinstance(body, list) else [body]


def _mib(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / 2**20:,.0f}MiB" if n >= 2**20 else f"{n / 2**10:,.1f}KiB"


def _tier_line(tier: dict) -> str:
    cap = tier.get("capacity_bytes")
    used = tier.get("used_bytes", 0)
    pct = f" ({100 * used / cap:.1f}%)" if cap else ""
    return f"{_mib(used)} / {_mib(cap) if cap else 'unbounded'}{pct}"


def format_summary(devices: list[dict]) -> str:
    bar = "+" + "-" * 86 + "+"
    title = f"pagedserve smi{time.strftime('%Y-%m-%d %H:%M:%S'):>70}"
    lines = [bar, f"| {title:<84} |", bar]
    for i, d in enumerate(devices):
        kv, req = d.get("kv_pages", {}), d.get("requests", {})
        head = (
            f"{i:>2}  {d.get('name', '?')} ({d.get('backend', '?')}, {d.get('kernels', '?')} kernels)"
            f"  model {d.get('model', '-')}"
        )
        lines.append(f"| {head:<84} |")
        if d.get("native_ops"):
            lines.append(f"|     {_native_ops_line(d['native_ops']):<80} |")
        for name, tier in d.get("tiers", {}).items():
            lines.append(f"|     {name + ' tier':<12} {_tier_line(tier):<67} |")
        pages = (
            f"KV pages {kv.get('in_use', 0)} in use / {kv.get('cached', 0)} cached / "
            f"{kv.get('free', 0)} free of {kv.get('total', 0)} "
            f"(x{kv.get('block_size', '?')} tokens, {kv.get('memory_attr') or '-'})"
        )
        lines.append(f"|     {pages:<80} |")
        if d.get("host_pages"):
            lines.append(f"|     {_host_pages_line(d['host_pages']):<80} |")
        load = (
            f"requests {req.get('running', 0)} running / {req.get('waiting', 0)} waiting   "
            f"{d.get('tokens_per_second', 0.0):.1f} tok/s   "
            f"faults detected {d.get('faults_detected', 0)}"
        )
        lines.append(f"|     {load:<80} |")
        if d.get("faults"):
            lines.append(f"|     {_faults_line(d['faults']):<80} |")
        if d.get("speculative"):
            lines.append(f"|     {_speculative_line(d['speculative']):<80} |")
        if d.get("lora"):
            lines.append(f"|     {_lora_line(d['lora'], d.get('lora_memory', {})):<80} |")
        if "tp_rank" in d:
            sent = _mib(d.get("collective_bytes_sent", 0))
            sent = f"tensor-parallel rank {d['tp_rank']}   collectives sent {sent}"
            lines.append(f"|     {sent:<80} |")
        lines.append(bar)
    return "\n".join(lines)


def _native_ops_line(ops: dict) -> str:
    """``ops all native`` or ``ops native but paged_attention_decode, ... (smi -q: why)``."""
    fallbacks = [op for op, status in ops.items() if status != "native"]
    if not fallbacks:
        return "ops all native"
    return f"ops native but {', '.join(fallbacks)} (smi -q: why)"


def _host_pages_line(host: dict) -> str:
    """The host tier's KV frames, a tier of their own: swapped-out pages and spilled blocks."""
    return (
        f"host pages {host.get('swapped', 0)} swapped / {host.get('cached', 0)} cached / "
        f"{host.get('free', 0)} free of {host.get('total', 0)}"
    )


def _speculative_line(spec: dict) -> str:
    """``speculative ngram x4   acceptance 62.5%   mean accepted length 3.10``."""
    return (
        f"speculative {spec.get('method')} x{spec.get('num_speculative_tokens')}   "
        f"acceptance {100 * spec.get('acceptance_rate', 0.0):.1f}%   "
        f"mean accepted length {spec.get('mean_acceptance_length', 0.0):.2f}"
    )


def _lora_line(lora: dict, memory: dict) -> str:
    """``LoRA slots sql, chat, - of 3 (1.2MiB)  loaded 4  running sql  waiting -``."""
    slots = ", ".join(name or "-" for name in lora.get("slots", []))
    line = (
        f"LoRA slots {slots} ({_mib(memory.get('slots_bytes'))})  loaded "
        f"{len(lora.get('loaded', []))}  running {','.join(lora.get('running', [])) or '-'}  "
        f"waiting {','.join(lora.get('waiting', [])) or '-'}"
    )
    return line if len(line) <= 80 else line[:77] + "..."


def _faults_line(faults: dict) -> str:
    """``faults kv_page 1/1  weight_page 2/2  step 0/0 (detected/recovered)``."""
    counts = "  ".join(f"{k} {v['detected']}/{v['recovered']}" for k, v in faults.items())
    return f"faults {counts} (detected/recovered)"


def format_detail(device: dict, index: int) -> str:
    kv, req = device.get("kv_pages", {}), device.get("requests", {})
    lines = [
        f"Device {index}",
        f"    Name                  : {device.get('name')}",
        f"    Backend               : {device.get('backend')}",
        f"    Kernels               : {device.get('kernels', '-')}",
        f"    Description           : {device.get('description', '-')}",
        f"    Model                 : {device.get('model', '-')}",
    ]
    if device.get("native_ops"):
        lines.append("    Ops (native, or what runs instead and why)")
        lines += [f"        {op:<24}: {status}" for op, status in device["native_ops"].items()]
    lines.append("    Memory tiers")
    for name, tier in device.get("tiers", {}).items():
        lines += [
            f"        {name}",
            f"            Used / Total  : {_tier_line(tier)}",
            f"            Peak          : {_mib(tier.get('peak_bytes'))}",
        ]
        for alloc, size in sorted(tier.get("allocations", {}).items(), key=lambda x: -x[1])[:8]:
            lines.append(f"            {alloc[:40]:<40} {_mib(size)}")
    lines += ["    KV pages"] + [f"        {k:<18}: {v}" for k, v in kv.items()]
    host = device.get("host_pages") or {}
    lines += ["    Host pages"] * bool(host) + [f"        {k:<18}: {v}" for k, v in host.items()]
    lines += [
        "    Requests",
        f"        Running           : {req.get('running', 0)}",
        f"        Waiting           : {req.get('waiting', 0)}",
        f"    Tokens/s              : {device.get('tokens_per_second', 0.0):.1f}",
        f"    Generated tokens      : {device.get('generation_tokens_total', 0)}",
        f"    Faults detected       : {device.get('faults_detected', 0)}",
    ]
    spec = device.get("speculative")
    if spec:
        lines.insert(-1, f"    {_speculative_line(spec)}")
    lora, memory = device.get("lora"), device.get("lora_memory", {})
    if lora:
        lines += [
            "    LoRA adapters",
            f"        Device slots      : {', '.join(n or '-' for n in lora['slots'])} "
            f"({_mib(memory.get('slots_bytes'))}, rank <= {lora['max_lora_rank']})",
            f"        Loaded            : {', '.join(lora['loaded']) or '-'}",
            f"        In host memory    : {memory.get('host_adapters', 0)} "
            f"({_mib(memory.get('host_bytes'))})",
            f"        Running / waiting : {', '.join(lora['running']) or '-'} / "
            f"{', '.join(lora['waiting']) or '-'}",
            f"        Swap-ins          : {lora['swap_ins_total']} "
            f"({memory.get('disk_loads_total', 0)} read from disk again)",
        ]
    for kind, counts in device.get("faults", {}).items():
        lines.append(
            f"        {kind:<18}: injected {counts['injected']}, detected {counts['detected']}, "
            f"recovered {counts['recovered']}"
        )
    scrub = device.get("weight_pages")
    if scrub:
        lines.append(
            f"    Weight pages          : {scrub['total']} (patrol {scrub['scrub_pages_per_step']} "
            f"per step, {scrub['scrubbed_total']} verified so far)"
        )
    if "tp_rank" in device:
        lines += [
            f"    Tensor-parallel rank  : {device['tp_rank']}",
            f"    Collectives sent      : {_mib(device.get('collective_bytes_sent', 0))}",
        ]
    return "\n".join(lines)


def render(devices: list[dict], args: argparse.Namespace) -> str:
    if args.device_index is not None:
        if not 0 <= args.device_index < len(devices):
            raise ValueError(
                f"-d {args.device_index}: this server has {len(devices)} device(s), "
                f"numbered 0..{len(devices) - 1}"
            )
        indexed = [(args.device_index, devices[args.device_index])]
    else:
        indexed = list(enumerate(devices))
    if args.json:
        return json.dumps([d for _, d in indexed], indent=2)
    if args.query:
        return "\n\n".join(format_detail(d, i) for i, d in indexed)
    return format_summary([d for _, d in indexed])


def run_smi(args: argparse.Namespace) -> int:
    while True:
        try:
            print(render(fetch_devices(args.url, args.api_key, args.timeout), args), flush=True)
        except httpx.HTTPError as e:
            print(f"pagedserve smi: cannot read {args.url}/device: {e}", file=sys.stderr)
            return 1
        except ValueError as e:
            print(f"pagedserve smi: error: {e}", file=sys.stderr)
            return 2
        if not args.watch:
            return 0
        try:
            time.sleep(args.watch)
        except KeyboardInterrupt:
            return 0
