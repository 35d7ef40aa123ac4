"""Speculative decoding with n-gram (prompt lookup) drafts at batch 1: pagedserve side by side
with llama-cpp-python's prompt-lookup decoding, on the demo model (converted to GGUF with
llama.cpp's own converter, as ``benchmarks.compare`` does).

    python -m benchmarks.compare --setup [--isa avx2]   # once: llama-cpp-python in its venv
    python -m benchmarks.speculative [--isa avx2] [--runs 3]
        # writes benchmarks/results/speculative_<kernels>[_int4].json

Four workloads at batch 1, each the median of ``--repeats`` timed runs after a warm-up,
a system's two variants (without and with speculation) timed in turn in one process, both
systems given the same prompt token ids:
- ``edit``: a chat turn asking to rename a variable in a function given in full, so that the
  answer repeats most of the prompt (where prompt lookup drafts are accepted; the demo model
  learnt such renames on standard-library functions, not on this one);
- ``stdlib-edit``: the same request on standard-library functions the demo model never trained
  on (the first ``STDLIB_EDITS`` held-out rename turns, pagedserve/data/demo_heldout_edits.jsonl),
  one after the other: the kind of function its rename turns were made of;
- ``free``: greedy free generation from a short prompt (a small model's greedy text repeats
  itself, which drafts copy);
- ``sampled``: the same prompt sampled at temperature 1 (a fixed seed each generation; no top-k,
  top-p or min-p on either system), which repeats little: what speculation costs where it finds
  little to copy.
The first three are greedy.
Every generation has ``--max-tokens`` tokens: pagedserve's go on past a stop token
(``ignore_eos``), llama.cpp's never sample one (``logit_bias``).

For each, tokens/s (generated tokens / seconds, prompt included in the time) without and with
speculation, and the answers themselves (up to their first stop token): for the two edit
workloads, how closely they are the functions renamed as asked (``copy_of_answer``: difflib's
similarity ratio from the first ``def`` on, averaged over the prompts; 1.0 for the exact renamed
functions), which says whether accepted drafts copied the function or a loop of the model's own; pagedserve ``--speculative-config '{"method": "ngram", "num_speculative_tokens":
K, "prompt_lookup_max": N}'`` against llama-cpp-python's
``Llama(draft_model=LlamaPromptLookupDecoding(num_pred_tokens=K, max_ngram_size=N))``; and
pagedserve's acceptance rate and mean accepted length. ``--precision 16bit`` runs pagedserve in
bf16 against llama.cpp's F16 file; ``int4`` pagedserve's INT4 (lm_head INT4) against Q4_0. No
prefix caching: each repetition computes its prompt. Each system runs in its own process; check
`uptime` first: nothing else should be running. The speed-up is the median of the runs' ratios
(each measured in one process), not a ratio of medians.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.bench_models import cache_root
from benchmarks.compare import CONVERT, PAGEDSERVE_KERNELS, llama_paths, llama_system_info
from benchmarks.results import spread, write_result

ROOT = Path(__file__).resolve().parents[1]

FUNCTION = '''def summarize_orders(orders, tax_rate):
    """Total, mean and largest order value, tax included."""
    total = 0.0
    largest = None
    for order in orders:
        value = order["price"] * order["quantity"]
        value = value * (1.0 + tax_rate)
        total = total + value
        if largest is None or value > largest:
            largest = value
    mean = total / len(orders) if orders else 0.0
    return {"total": total, "mean": mean, "largest": largest}
'''
CHAT_TURN = "[gMASK]<sop><|user|>\n{question}<|assistant|>\n"  # the chat template's turn
EDIT_REQUEST = (
    "Rename the variable `value` to `amount` in this function and return the whole function."
)
STDLIB_EDITS = 6  # held-out rename turns in the stdlib-edit workload
HELDOUT_EDITS = ROOT / "pagedserve" / "data" / "demo_heldout_edits.jsonl"


@dataclass(frozen=True)
class Workload:
    prompts: list[str]  # as text: both systems get the same token ids (prompt_ids)
    answers: list[str] | None = None  # what a perfect copy answers (the edit workloads)
    temperature: float = 0.0  # 0: greedy


FREE_PROMPT = "[gMASK]<sop>Once upon a time, in a small village by the sea, there lived"
SAMPLING_SEED = 0


@functools.cache
def workloads() -> dict[str, Workload]:
    turns = [json.loads(line) for line in HELDOUT_EDITS.read_text("utf-8").splitlines()]
    turns = turns[:STDLIB_EDITS]
    return {
        "edit": Workload(  # a chat turn, as a user asks a chat model to edit code
            [CHAT_TURN.format(question=f"{EDIT_REQUEST}\n\n{FUNCTION}")], [renamed_function()]
        ),
        "stdlib-edit": Workload(
            [CHAT_TURN.format(question=t["question"]) for t in turns], [t["answer"] for t in turns]
        ),
        "free": Workload([FREE_PROMPT]),
        "sampled": Workload([FREE_PROMPT], temperature=1.0),
    }


@functools.cache
def demo_tokenizer():
    from tokenizers import Tokenizer

    from pagedserve.models import resolve_model_path

    return Tokenizer.from_file(str(resolve_model_path("demo") / "tokenizer.json"))


def renamed_function() -> str:
    """The answer the edit workload asks for: FUNCTION with the name ``value`` spelt ``amount``
    (names only: the docstring's "order value" stays), as the demo model's rename turns were
    made (tools/demo_corpus.py)."""
    sys.path.insert(0, str(ROOT / "tools"))
    from demo_corpus import rename

    return rename(FUNCTION, "value", "amount")


def copy_of_answer(expected: str, answer: str) -> float:
    """How close an answer is to the renamed function asked for: difflib's ratio of the two from
    their first ``def`` on (1.0: the function exactly)."""

    def function(text: str) -> str:
        return text[max(text.find("def "), 0) :]

    return difflib.SequenceMatcher(None, function(expected), function(answer)).ratio()


def prompt_ids() -> dict[str, list[list[int]]]:
    """Each workload's prompts in the demo model's token ids."""
    encode = demo_tokenizer().encode
    return {name: [encode(p).ids for p in w.prompts] for name, w in workloads().items()}


def answer_text(token_ids: list[int]) -> str:
    """The generated tokens up to the first stop token (the runs go on past it), as text."""
    stops = set(stop_ids())
    end = next((i for i, t in enumerate(token_ids) if t in stops), len(token_ids))
    return demo_tokenizer().decode(token_ids[:end])


def stop_ids() -> list[int]:
    """The demo model's stop tokens, which llama.cpp's run never samples (pagedserve's runs go on
    past them, ignore_eos), so that every generation has --max-tokens tokens."""
    from pagedserve.models.tokenizer import STOP_TOKENS

    return [demo_tokenizer().token_to_id(token) for token in STOP_TOKENS]


def speculative_config(k: int, n: int) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n,
            "prompt_lookup_min": 2}  # fmt: skip


# ---- workers (each system in its own process) ----------------------------------------------------
def alternated_medians(runs: dict, repeats: int) -> dict[str, float]:
    """Median seconds of each ``runs[name]()`` after one warm-up each, timed in turn, one of
    each per round: the variants of a system see the same machine, so a drift of its speed (the
    spread between runs here is wider than the effect measured) falls on both alike."""
    for run in runs.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


SPEC_COUNTERS = (
    "spec_decode_num_drafts_total",
    "spec_decode_num_draft_tokens_total",
    "spec_decode_num_accepted_tokens_total",
)


def worker_pagedserve(args: argparse.Namespace) -> dict:
    """pagedserve without and with speculation, two engines in one process."""
    from pagedserve import LLM, SamplingParams

    int4 = args.precision == "int4"
    engines = {
        label: LLM(
            model="demo",
            dtype="bfloat16",
            quantization="int4" if int4 else None,
            quantize_lm_head="int4" if int4 else None,
            kernels=PAGEDSERVE_KERNELS[args.isa],
            enable_prefix_caching=False,
            speculative_config=spec,
        )
        for label, spec in (("pagedserve", None), ("pagedserve ngram", speculative_config(args.k, args.n)))
    }  # fmt: skip
    rows: dict[str, dict] = {label: {} for label in engines}
    for name, ids in prompt_ids().items():
        temperature = workloads()[name].temperature
        params = SamplingParams(
            temperature=temperature,
            seed=SAMPLING_SEED if temperature else None,
            max_tokens=args.max_tokens,
            ignore_eos=True,
        )
        lengths: dict[str, int] = {}
        before = engines["pagedserve ngram"].llm_engine.get_stats()
        answers: dict[str, list[str]] = {}

        def run(label, ids=ids, lengths=lengths, answers=answers, params=params):
            outs = [
                engines[label].generate({"prompt_token_ids": p}, params, use_tqdm=False)[0]
                for p in ids
            ]  # one at a time: batch 1
            lengths[label] = sum(len(o.outputs[0].token_ids) for o in outs)
            answers[label] = [answer_text(o.outputs[0].token_ids) for o in outs]

        seconds = alternated_medians(
            {label: functools.partial(run, label) for label in engines}, args.repeats
        )
        expected = workloads()[name].answers
        for label in engines:
            rows[label][name] = {
                "tokens_per_s": lengths[label] / seconds[label],
                "num_tokens": lengths[label],
                "answers": answers[label],
            }
            if expected:
                copies = map(copy_of_answer, expected, answers[label])
                rows[label][name]["copy_of_answer"] = statistics.mean(copies)
        after = engines["pagedserve ngram"].llm_engine.get_stats()
        drafts, draft_tokens, accepted = (after[k] - before[k] for k in SPEC_COUNTERS)
        rows["pagedserve ngram"][name]["acceptance_rate"] = (
            accepted / draft_tokens if draft_tokens else 0.0
        )
        rows["pagedserve ngram"][name]["mean_acceptance_length"] = (
            1 + accepted / drafts if drafts else 0.0
        )
    return rows


LLAMA_WORKER = """
import functools, json, sys
from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
sys.path.insert(0, sys.argv[7])
from benchmarks.speculative import alternated_medians
path, workloads, k, n, max_tokens, repeats = sys.argv[1], json.loads(sys.argv[2]), *map(int, sys.argv[3:7])
never = {token: -100.0 for token in json.loads(sys.argv[8])}  # the stop tokens: no early end
temperatures, seed = json.loads(sys.argv[9]), int(sys.argv[10])
llms = {
    label: Llama(model_path=path, n_ctx=1024, n_threads=2, n_batch=512, verbose=False, draft_model=draft)
    for label, draft in (("llama.cpp", None),
                         ("llama.cpp lookup", LlamaPromptLookupDecoding(num_pred_tokens=k, max_ngram_size=n)))
}
rows = {label: {} for label in llms}
for name, prompts in workloads.items():
    counts = {}
    sampling = dict(temperature=temperatures[name], top_k=0, top_p=1.0, min_p=0.0, seed=seed)
    def run(label, prompts=prompts, sampling=sampling):
        outs = [llms[label].create_completion(prompt, max_tokens=max_tokens, logit_bias=never,
                                              **sampling) for prompt in prompts]
        counts[label] = sum(out["usage"]["completion_tokens"] for out in outs)
    seconds = alternated_medians({label: functools.partial(run, label) for label in llms}, repeats)
    for label in llms:
        rows[label][name] = {"tokens_per_s": counts[label] / seconds[label], "num_tokens": counts[label]}
print(json.dumps(rows))
"""


def demo_gguf(root: Path, isa: str, precision: str) -> Path:
    """The demo model as GGUF (F16, and Q4_0 from it), converted once into the cache, under a
    name that changes with its weights (a retrained demo model is converted again)."""
    from pagedserve.models import resolve_model_path

    model = resolve_model_path("demo")
    digest = hashlib.sha256((model / "model.safetensors").read_bytes()).hexdigest()[:12]
    out_dir = root / f"demo-gguf-{digest}"
    name = "f16.gguf" if precision == "16bit" else "q4_0.gguf"
    if (out_dir / name).exists():
        return out_dir / name
    shutil.copytree(model, out_dir / "model", dirs_exist_ok=True)
    venv, converter = llama_paths(root, isa)
    print("converting the demo model to GGUF with llama.cpp's converter ...", flush=True)
    subprocess.run(
        [str(venv / "bin" / "python"), "-c", CONVERT, str(converter), str(out_dir / "model"),
         str(out_dir / "f16.gguf"), str(out_dir / "q4_0.gguf")],
        check=True, capture_output=True,
        env={**os.environ, "PYTHONPATH": f"{converter}:{converter}/gguf-py"},
    )  # fmt: skip
    return out_dir / name


def run_llama(args: argparse.Namespace, root: Path) -> dict:
    venv, _ = llama_paths(root, args.isa)
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", LLAMA_WORKER,
         str(demo_gguf(root, args.isa, args.precision)), json.dumps(prompt_ids()), str(args.k),
         str(args.n), str(args.max_tokens), str(args.repeats), str(ROOT), json.dumps(stop_ids()),
         json.dumps({name: w.temperature for name, w in workloads().items()}), str(SAMPLING_SEED)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_pagedserve(args: argparse.Namespace) -> dict:
    flags = ["--worker", "--isa", args.isa, "--precision", args.precision, "--k", str(args.k)]
    flags += ["--n", str(args.n), "--max-tokens", str(args.max_tokens)]
    flags += ["--repeats", str(args.repeats)]
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.speculative", *flags],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def one_run(args: argparse.Namespace, root: Path) -> dict:
    print("pagedserve, without and with speculation ...", flush=True)
    systems = run_pagedserve(args)
    if not args.skip_llama:
        print("llama.cpp, without and with lookup decoding ...", flush=True)
        systems |= run_llama(args, root)
    return systems


def report(runs: list[dict], args: argparse.Namespace, kernels: str, llama_build: str) -> dict:
    """Per workload and system: tokens/s (the median over runs and its range), each system's
    speed-up from speculation (the median and range of its runs' ratios) and pagedserve's
    acceptance."""
    figures = {}
    for name in workloads():
        rows = {}
        for system in runs[0]:
            rates = [r[system][name]["tokens_per_s"] for r in runs]
            rows[system] = {
                "tokens_per_s": spread(rates),
                "num_tokens": runs[0][system][name]["num_tokens"],
            }
            for key in ("acceptance_rate", "mean_acceptance_length"):
                if key in runs[0][system][name]:
                    rows[system][key] = statistics.median(r[system][name][key] for r in runs)
            for key in ("answers", "copy_of_answer"):  # greedy: the same in every run
                if key in runs[0][system][name]:
                    rows[system][key] = runs[0][system][name][key]
        rows |= {
            f"{system} speed-up": spread(
                [r[f"{system} {how}"][name]["tokens_per_s"] / r[system][name]["tokens_per_s"]
                 for r in runs]
            )
            for system, how in (("pagedserve", "ngram"), ("llama.cpp", "lookup"))
            if f"{system} {how}" in runs[0]
        }  # fmt: skip
        figures[name] = rows
    return {
        "kernels": kernels,
        "llama_cpp_build": llama_build,
        "precision": args.precision,
        "num_speculative_tokens": args.k,
        "prompt_lookup_max": args.n,
        "max_tokens": args.max_tokens,
        "runs": args.runs,
        "workloads": figures,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--isa", default="native", choices=sorted(PAGEDSERVE_KERNELS))
    ap.add_argument("--precision", default="16bit", choices=["16bit", "int4"])
    ap.add_argument("--k", type=int, default=5, help="num_speculative_tokens / num_pred_tokens")
    ap.add_argument("--n", type=int, default=3, help="prompt_lookup_max / max_ngram_size")
    ap.add_argument("--max-tokens", type=int, default=160, help="tokens generated per workload")
    ap.add_argument("--repeats", type=int, default=9, help="timed generations (median)")
    ap.add_argument("--runs", type=int, default=1, help="repeat the whole comparison N times")
    ap.add_argument("--skip-llama", action="store_true")
    ap.add_argument("--no-write", action="store_true", help="print the figures only")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker_pagedserve(args)))
        return
    root = cache_root()
    venv = llama_paths(root, args.isa)[0]
    if not args.skip_llama and not (venv / "bin" / "python").exists():
        sys.exit(f"llama.cpp is not set up for --isa {args.isa}: run `python -m benchmarks.compare "
                 f"--setup --isa {args.isa}` first (or pass --skip-llama)")  # fmt: skip
    from pagedserve.hal.native import choose_kernels

    kernels = choose_kernels(PAGEDSERVE_KERNELS[args.isa]).name
    llama_build = "" if args.skip_llama else llama_system_info(venv)
    runs = []
    for i in range(args.runs):
        print(f"=== run {i + 1} of {args.runs}", flush=True)
        runs.append(one_run(args, root))
    figures = report(runs, args, kernels, llama_build)
    print(json.dumps(figures["workloads"], indent=2))
    if not args.no_write:
        name = f"speculative_{kernels}" + ("_int4" if args.precision == "int4" else "")
        print(f"\nwrote {write_result(name, figures)}")


if __name__ == "__main__":
    main()
