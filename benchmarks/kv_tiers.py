"""Multi-turn chat on a KV tier too small for it: recompute, swap, and swap + a host prefix cache.

    python -m benchmarks.kv_tiers [--conversations 32] [--turns 6] [--user-tokens 256]
        [--max-tokens 48] [--fast-tier 0.33] [--quantization int4|w4a8|none]
        [--dtype bfloat16|float32] [--threads N] [--modes recompute swap swap+host-cache auto]
        [--output kv_tiers]

Each conversation is a closed loop: its next turn (the whole history, its last answer and
``--user-tokens`` new tokens) is sent as soon as its last answer is done, so every turn adds about
``user-tokens + max-tokens`` tokens to its context. All conversations run at once
(``--max-num-seqs`` = conversations) on the ~122M GLM-4-0414 model of ``bench_models.py``, and the
KV tier (``--num-kv-pages``) holds ``--fast-tier`` of the contexts the conversations end with:

- recompute: preempted sequences and evicted prefix blocks are computed again (vLLM v1);
- swap: ``--preemption-mode swap`` with a swap space that holds every context;
- swap+host-cache: and a host prefix cache of the same size, so a turn finds its history in the
  host tier when the KV tier has evicted it (SGLang's HiCache);
- auto: ``--preemption-mode auto`` with both host shares.

Per mode: TTFT p50 and p99 over every turn (and over the turns after the first, the ones a cache
can help), output tokens/s over the run, recomputed tokens (every token the forward passes
computed beyond the ones no earlier pass had: each turn's new message, the last answer's last
token, its own decode steps), pages swapped out and host-cache hits; and whether every answer
equals the first mode's (greedy). The engine runs in this process (no HTTP), timed from each
turn's submission to its first token. Writes benchmarks/results/NAME.json (``--output``).

The answers may part after a few tokens wherever a mode reads KV another mode computed
differently: a host-cache hit (or a swapped-in page) reads the previous turn's history as its
decode steps wrote it, a recompute as a prefill writes it, and the two sum in a different order
(random weights leave the greedy choice a near tie); far more often in bfloat16 than in float32,
where they part in a few conversations of 32. The results name each such turn and the tokens its
answers share.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
from dataclasses import dataclass, field

import torch

from benchmarks.bench_models import build_model
from benchmarks.results import write_result
from pagedserve import SamplingParams
from pagedserve.config import EngineConfig, UsageContext
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.models import load_config

BLOCK_SIZE = 16
MODES = {  # preemption mode, and whether the host tier has a swap space / a prefix cache
    "recompute": ("recompute", False, False),
    "swap": ("swap", True, False),
    "swap+host-cache": ("swap", True, True),
    "auto": ("auto", True, True),
}


@dataclass
class Turn:
    conversation: int
    index: int
    prompt: list[int]
    submitted: float
    first_token: float | None = None
    history: int = 0  # tokens of the prompt computed in an earlier turn
    cached: int = 0  # prompt tokens found in a prefix cache (either tier) at its admission
    answer: list[int] = field(default_factory=list)


def user_messages(args: argparse.Namespace, vocab_size: int) -> list[list[list[int]]]:
    """Per conversation, per turn: its new tokens (ids clear of the special tokens, in the
    model's vocabulary)."""
    rng = random.Random(args.seed)
    high = min(7900, vocab_size)
    return [
        [[rng.randrange(100, high) for _ in range(args.user_tokens)] for _ in range(args.turns)]
        for _ in range(args.conversations)
    ]


def engine_settings(args: argparse.Namespace, mode: str, model: str) -> dict:
    preemption, swap, host_cache = MODES[mode]
    config = load_config(model)
    elem = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    page_bytes = BLOCK_SIZE * config.kv_bytes_per_token(config.num_key_value_heads, elem)
    final_context = args.turns * (args.user_tokens + args.max_tokens)
    all_pages = args.conversations * math.ceil(final_context / BLOCK_SIZE)
    every_context = all_pages * page_bytes / 2**30  # GiB: room for every conversation
    return dict(
        model=model,
        dtype=args.dtype,
        quantization=None if args.quantization == "none" else args.quantization,
        device=args.device,
        block_size=BLOCK_SIZE,
        num_kv_pages=max(math.ceil(args.fast_tier * all_pages), math.ceil(final_context / 16)),
        max_model_len=final_context + args.max_tokens,
        max_num_seqs=args.conversations,
        preemption_mode=preemption,
        swap_space=every_context if swap else 0.0,
        host_prefix_cache=every_context if host_cache else 0.0,
    )


def run_mode(args: argparse.Namespace, mode: str, model: str, messages) -> dict:
    settings = engine_settings(args, mode, model)
    engine = LLMEngine(EngineConfig.from_kwargs(**settings), UsageContext.LLM_CLASS)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    engine.add_request("warm-up", messages[0][0][:32], params)
    while engine.has_unfinished_requests():
        engine.step()
    engine.block_manager.reset_prefix_cache()
    computed = _count_computed_tokens(engine)
    before = engine.get_stats()
    turns: dict[str, Turn] = {}
    done: list[Turn] = []

    def submit(conversation: int, index: int, history: list[int]) -> None:
        rid = f"c{conversation}t{index}"
        prompt = history + messages[conversation][index]
        turns[rid] = Turn(conversation, index, prompt, time.perf_counter(), history=len(history))
        engine.add_request(rid, prompt, params)

    start = time.perf_counter()
    for c in range(args.conversations):
        submit(c, 0, [])
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            turn = turns[out.request_id]
            if turn.first_token is None:
                turn.first_token, turn.cached = now, out.num_cached_tokens
            if out.finished:
                turn.answer = out.outputs[0].token_ids
                done.append(turn)
                if turn.index + 1 < args.turns:
                    submit(turn.conversation, turn.index + 1, turn.prompt + turn.answer)
    elapsed = time.perf_counter() - start
    after = engine.get_stats()
    problems = engine.check_invariants()
    assert not problems, problems
    return summarize(settings, done, elapsed, before, after, computed[0], engine.scheduler.costs)


def _count_computed_tokens(engine: LLMEngine) -> list[int]:
    """A counter of the tokens every step schedules from now on (what its forward pass
    computes): ``[total]``, updated in place."""
    total = [0]
    schedule = engine.scheduler.schedule

    def counted():
        out = schedule()
        total[0] += out.total_num_scheduled_tokens
        return out

    engine.scheduler.schedule = counted
    return total


def summarize(settings, done, elapsed, before, after, computed, costs) -> dict:
    def delta(name: str) -> float:
        return after[name] - before[name]

    ttft = [t.first_token - t.submitted for t in done]
    later = [t.first_token - t.submitted for t in done if t.index > 0]
    # tokens no earlier pass computed: the new message (and the last answer's last token, which
    # was sampled but never fed back), then every answer token but the last (its decode steps)
    fresh = sum(len(t.prompt) - t.history + (t.index > 0) + len(t.answer) - 1 for t in done)
    preemption_recomputed = delta("recomputed_tokens_total")
    return {
        "settings": {k: v for k, v in settings.items() if k != "model"},
        "turns": len(done),
        "ttft_p50_s": _percentile(ttft, 50),
        "ttft_p99_s": _percentile(ttft, 99),
        "ttft_p50_later_turns_s": _percentile(later, 50),
        "ttft_p99_later_turns_s": _percentile(later, 99),
        "output_tokens_per_s": sum(len(t.answer) for t in done) / elapsed,
        "elapsed_s": elapsed,
        "computed_tokens": computed,
        "recomputed_tokens": computed - fresh,
        "history_tokens_recomputed": computed - fresh - preemption_recomputed,
        "preemption_tokens_recomputed": preemption_recomputed,
        "history_tokens_cached_at_admission": sum(min(t.cached, t.history) for t in done),
        "preemptions": delta("num_preemptions_total"),
        "swapped_preemptions": delta("num_swapped_preemptions_total"),
        "swapped_out_pages": delta("swapped_out_pages_total"),
        "host_prefix_cache_hit_tokens": delta("host_prefix_cache_hits_total"),
        "prefix_cache_hit_tokens": delta("prefix_cache_hits_total"),
        "seconds_per_page_copy": costs.seconds_per_page_copy,
        "seconds_per_prefill_token": costs.seconds_per_prefill_token,
        "answers": {f"c{t.conversation}t{t.index}": t.answer for t in done},
    }


def _percentile(values: list[float], q: int) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def compare_answers(results: dict) -> None:
    """Each mode's answers against the first mode's: how many turns answered the same, and for
    each turn that did not, the tokens its two answers share before they part."""
    first = next(iter(results.values()))["answers"]
    for r in results.values():
        parted = {
            rid: _common_prefix(r["answers"].get(rid, []), answer)
            for rid, answer in first.items()
            if r["answers"].get(rid) != answer
        }
        r["turns_answered_as_the_first_mode"] = len(first) - len(parted)
        r["same_greedy_outputs"] = not parted
        r["parted_turns_tokens_in_common"] = parted


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def print_table(results: dict) -> None:
    base = next(iter(results.values()))["ttft_p50_s"]
    print(
        f"{'mode':<16} {'TTFT p50':>9} {'p99':>8} {'later p50':>10} {'tok/s':>7} "
        f"{'recomputed':>10} {'swapped':>8} {'host hits':>9} {'p50 gain':>8} same"
    )
    for mode, r in results.items():
        print(
            f"{mode:<16} {r['ttft_p50_s']:>8.3f}s {r['ttft_p99_s']:>7.3f}s "
            f"{r['ttft_p50_later_turns_s'] or 0:>9.3f}s {r['output_tokens_per_s']:>7.1f} "
            f"{r['recomputed_tokens']:>10.0f} {r['swapped_out_pages']:>8.0f} "
            f"{r['host_prefix_cache_hit_tokens']:>9.0f} {base / r['ttft_p50_s']:>7.2f}x "
            f"{r['same_greedy_outputs']}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--user-tokens", type=int, default=256, help="new tokens in each turn")
    ap.add_argument("--max-tokens", type=int, default=48, help="answer tokens in each turn")
    ap.add_argument(
        "--fast-tier", type=float, default=1 / 3,
        help="share of the conversations' final contexts the KV tier holds",
    )  # fmt: skip
    ap.add_argument("--quantization", default="int4", choices=["int4", "w4a8", "none"])
    ap.add_argument(
        "--dtype", default="bfloat16", choices=["bfloat16", "float32"],
        help="activations and KV cache (float32: far fewer answers that part between modes)",
    )  # fmt: skip
    ap.add_argument("--device", default="kunlun-emu")
    ap.add_argument("--model", default="122m", help="a bench_models.py shape")
    ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES)[:3])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--output", default="kv_tiers", help="results file name")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = str(build_model(args.model))
    messages = user_messages(args, load_config(model).vocab_size)
    results = {}
    for mode in args.modes:
        results[mode] = run_mode(args, mode, model, messages)
        print(mode, {k: v for k, v in results[mode].items() if k != "answers"}, flush=True)
    compare_answers(results)
    print_table(results)
    figures = {
        "model": args.model,
        "workload": {
            "conversations": args.conversations,
            "turns": args.turns,
            "user_tokens": args.user_tokens,
            "max_tokens": args.max_tokens,
            "fast_tier": args.fast_tier,
            "quantization": args.quantization,
            "dtype": args.dtype,
        },
        "threads": torch.get_num_threads(),
        "modes": {m: {k: v for k, v in r.items() if k != "answers"} for m, r in results.items()},
    }
    print(write_result(args.output, figures))


if __name__ == "__main__":
    main()
