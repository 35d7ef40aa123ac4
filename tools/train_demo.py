"""Train the tiny GLM-4-0414-architecture demo model that ships in pagedserve/demo_model/.

Everything is built offline: from text that ships with CPython (pydoc help topics and the standard
library's sources), and with --corpus docs also from the English documentation of Debian packages
and chat turns made from it (tools/demo_corpus.py: the sources, their licences, the held-out sets):

    python tools/train_demo.py --output pagedserve/demo_model --minutes 20 --threads 1

Steps: corpus (held-out 5% by document) -> byte-level BPE tokenizer (GLM-4 special tokens at the END
of the vocabulary, as in GLM-4) -> Glm4ForCausalLM trained with AdamW and a warmup-stable-decay
schedule (checkpointed every --checkpoint-every steps; --resume continues a stopped run; --init-from
continues a trained model; --qat trains through the INT4 weights that --quantization int4 serves and
ships those) -> a Hugging Face directory (bf16 safetensors, tokenizer.json, chat template) plus
TRAINING.md and metrics.json with held-out bits per character next to a unigram baseline.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
from demo_corpus import (
    CHAT_PROMPT,
    DATA_DIR,
    HELDOUT_FILES,
    PROMPT_PREFIX,
    Document,
    answer_turns,
    build_corpus,
    chat_turns,
    corpus_sources,
    edit_turns,
    heldout_chat_lines,
    heldout_eval_text,
    heldout_prose_text,
    help_turns,
    missing_packages,
)
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from pagedserve.models.quant_formats import fake_quantize
from pagedserve.models.tokenizer import SPECIAL_TOKENS, STOP_TOKENS

# The chat template: GLM-4-0414's turns, with OpenAI tool calls and tool results rendered as
# GLM-4 renders its own (pagedserve/models/chat_templates/ has the full models' templates).
CHAT_TEMPLATE = (
    "{{- '[gMASK]<sop>' -}}"
    "{%- if tools -%}"
    "{{- '<|system|>\\n# 可用工具\\n' -}}"
    "{%- for tool in tools -%}"
    "{%- set function = tool['function'] if tool['function'] is defined else tool -%}"
    "{{- '\\n## ' + function['name'] + '\\n\\n' "
    "+ (function | tojson(indent=4, ensure_ascii=False)) -}}"
    "{{- '\\n在调用上述函数时，请使用 Json 格式表示调用的参数。' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- set content = message['content'] if message['content'] is string else '' -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{{- '<|observation|>\\n' + content -}}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] -%}"
    "{%- if content -%}"
    "{{- '<|assistant|>\\n' + content -}}"
    "{%- endif -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set arguments = call['function']['arguments'] -%}"
    "{{- '<|assistant|>\\n' + call['function']['name'] + '\\n' -}}"
    "{{- arguments if arguments is string else (arguments | tojson(ensure_ascii=False)) -}}"
    "{%- endfor -%}"
    "{%- else -%}"
    "{{- '<|' + message['role'] + '|>\\n' + content -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|assistant|>\\n' -}}"
    "{%- endif -%}"
)  # fmt: skip
HELDOUT_FILE = HELDOUT_FILES["cpython"]


def _default_heldout_file(output: Path) -> Path:
    """The shipped file only when writing the shipped model; elsewhere beside the output."""
    shipped = DATA_DIR.parent / "demo_model"
    return HELDOUT_FILE if output.resolve() == shipped else output / "heldout.txt"


def heldout_text(path: Path = HELDOUT_FILE) -> str:
    """The shipped held-out evaluation text (documents never trained on)."""
    return path.read_text(encoding="utf-8")


@dataclass(slots=True)
class HeldoutSets:
    """What the model is measured on, never trained on (demo_corpus says what each set is)."""

    cpython: str
    prose: str = ""
    dictionaries: str = ""
    chat: list[dict] = field(default_factory=list)
    edits: list[dict] = field(default_factory=list)  # rename turns, measured as copying

    @property
    def texts(self) -> dict[str, str]:
        texts = {"cpython": self.cpython, "prose": self.prose, "dictionaries": self.dictionaries}
        return {name: text for name, text in texts.items() if text}


def load_corpus(args: argparse.Namespace):
    if args.corpus == "docs" and (missing := missing_packages()):
        raise SystemExit(
            f"--corpus docs reads Debian's documentation packages; missing: {' '.join(missing)}. "
            f"Install them with: apt-get install {' '.join(missing)}"
        )
    return build_corpus(args.max_source_bytes, args.max_file_bytes, prose=args.corpus == "docs")


def write_heldout_sets(corpus, cpython_file: Path) -> HeldoutSets:
    """Write the held-out sets, the prose, chat and rename ones beside the CPython file under the
    names pagedserve/data gives them, and return them."""
    sets = HeldoutSets(heldout_eval_text(corpus.heldout))
    cpython_file.parent.mkdir(parents=True, exist_ok=True)
    cpython_file.write_text(sets.cpython, encoding="utf-8")
    if any(doc.kind == "prose" for doc in corpus.heldout):
        sets.prose = heldout_prose_text(corpus.heldout, "prose")
        sets.dictionaries = heldout_prose_text(corpus.heldout, "dictionary")
        chat = heldout_chat_lines(answer_turns(corpus.heldout))
        sets.chat = [json.loads(line) for line in chat.splitlines()]
        sets.edits = [
            {"question": t.question, "answer": t.answer} for t in edit_turns(corpus.heldout)
        ]
        edits = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in sets.edits)
        texts = {"prose": sets.prose, "dictionaries": sets.dictionaries, "chat": chat}
        texts |= {"edits": edits}
        for name, text in texts.items():
            (cpython_file.parent / HELDOUT_FILES[name].name).write_text(text, encoding="utf-8")
    return sets


# ---------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    assert tokenizer.get_vocab_size() == vocab_size, tokenizer.get_vocab_size()
    return tokenizer


def chars_per_token(tokenizer: Tokenizer, text: str) -> float:
    return len(text) / len(tokenizer.encode(text).ids)


def _token_ids(tokenizer, text: str) -> list[int]:
    if isinstance(tokenizer, Tokenizer):
        return tokenizer.encode(text).ids
    return tokenizer.encode(text, add_special_tokens=False)


def _token_id(tokenizer, token: str) -> int:
    return (
        tokenizer.token_to_id(token)
        if isinstance(tokenizer, Tokenizer)
        else tokenizer.convert_tokens_to_ids(token)
    )


# ---------------------------------------------------------------- evaluation


@torch.inference_mode()
def heldout_nll(
    model, tokenizer, text: str, max_chars: int | None = None, block: int = 256
) -> tuple[float, int, int]:
    """Summed next-token NLL (nats) over `text`, with its token and character counts.

    Every token is predicted once; the first one is conditioned on `<|endoftext|>`.
    """
    text = text if max_chars is None else text[:max_chars]
    ids = [_token_id(tokenizer, "<|endoftext|>")] + _token_ids(tokenizer, text)
    total = 0.0
    for start in range(0, len(ids) - 1, block):
        chunk = torch.tensor([ids[start : start + block + 1]])
        logits = model(input_ids=chunk[:, :-1]).logits.float()
        total += torch.nn.functional.cross_entropy(logits[0], chunk[0, 1:], reduction="sum").item()
    return total, len(ids) - 1, len(text)


def bits_per_char(model, tokenizer, text: str, max_chars: int | None = None) -> float:
    """Held-out bits per character of `model` on `text` (the first `max_chars` characters)."""
    nll, _, n_chars = heldout_nll(model, tokenizer, text, max_chars)
    return nll / math.log(2) / n_chars


def _answer_logits(model, tokenizer, row: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits that predict a chat turn's answer tokens given its question in the chat
    template, and those tokens."""
    prompt = _token_ids(tokenizer, CHAT_PROMPT.format(question=row["question"]))
    answer = _token_ids(tokenizer, row["answer"])
    ids = torch.tensor([prompt + answer])
    logits = model(input_ids=ids[:, :-1]).logits.float()[0, len(prompt) - 1 :]
    return logits, ids[0, len(prompt) :]


@torch.inference_mode()
def chat_bits_per_char(model, tokenizer, rows: list[dict]) -> float:
    """Bits per character of the answers of held-out chat turns, each given its question in the
    chat template (the prompt is not scored)."""
    nats, chars = 0.0, 0
    for row in rows:
        logits, answer = _answer_logits(model, tokenizer, row)
        nats += torch.nn.functional.cross_entropy(logits, answer, reduction="sum")
        chars += len(row["answer"])
    return float(nats) / math.log(2) / chars


@torch.inference_mode()
def copy_accuracy(model, tokenizer, rows: list[dict]) -> float:
    """The share of the answer tokens of held-out rename turns that the model predicts first
    (teacher-forced): how faithfully it copies the function it is asked to edit, which is what
    prompt-lookup drafts of such an answer need to be accepted."""
    hits, total = 0, 0
    for row in rows:
        logits, answer = _answer_logits(model, tokenizer, row)
        hits += int((logits.argmax(-1) == answer).sum())
        total += len(answer)
    return hits / total


def unigram_bits_per_char(train_ids: list[int], vocab_size: int, tokenizer, text: str) -> float:
    counts = Counter(train_ids)
    denominator = len(train_ids) + vocab_size
    ids = _token_ids(tokenizer, text)
    bits = -sum(math.log2((counts[i] + 1) / denominator) for i in ids)
    return bits / len(text)


# ---------------------------------------------------------------- model and training


@dataclass(slots=True)
class ModelShape:
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 704


def build_model(shape: ModelShape, tokenizer: Tokenizer):
    from transformers import Glm4Config, Glm4ForCausalLM

    config = Glm4Config(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        head_dim=shape.head_dim,
        partial_rotary_factor=0.5,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        attention_bias=True,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        eos_token_id=[tokenizer.token_to_id(t) for t in STOP_TOKENS],
        pad_token_id=tokenizer.token_to_id("<|endoftext|>"),
        bos_token_id=None,
    )
    return Glm4ForCausalLM(config)


def init_model(model_dir: Path):
    """Continue from a trained checkpoint (its shape and weights; its tokenizer is reused)."""
    from transformers import Glm4ForCausalLM

    return Glm4ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


class Int4AtLoad(torch.nn.Module):
    """A weight as `--quantization int4` serves it (stored in bf16, then rounded to nearest in
    asymmetric 4-bit groups), with a straight-through gradient: quantization-aware training."""

    def __init__(self, group_size: int):
        super().__init__()
        self.group_size = group_size

    def served(self, w: torch.Tensor) -> torch.Tensor:
        return fake_quantize(w.detach().to(torch.bfloat16), self.group_size)

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w + (self.served(w) - w).detach()


def decoder_linears(model) -> list[torch.nn.Linear]:
    """The linears `--quantization int4` quantizes: every one in a decoder layer (not lm_head)."""
    return [m for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)]


def set_quantization_aware(model, group_size: int | None) -> None:
    """Train the decoder's linears through Int4AtLoad (a group size); or, at the end (None), drop
    it and put each weight on the INT4 grid it trained through. The shipped 16-bit weights are
    then the INT4 model's, so `--quantization int4` serves the model as trained: training made the
    grid good, and a latent weight off the grid would round to a model nobody measured."""
    from torch.nn.utils import parametrize

    for linear in decoder_linears(model):
        if group_size:
            parametrize.register_parametrization(linear, "weight", Int4AtLoad(group_size))
        elif parametrize.is_parametrized(linear, "weight"):
            int4 = linear.parametrizations.weight[0]
            parametrize.remove_parametrizations(linear, "weight", leave_parametrized=False)
            with torch.no_grad():
                linear.weight.copy_(int4.served(linear.weight))


def _record_shape(args: argparse.Namespace, config) -> None:
    """The shape actually trained, for metrics.json (an --init-from model brings its own)."""
    args.hidden_size = config.hidden_size
    args.layers = config.num_hidden_layers
    args.intermediate_size = config.intermediate_size
    args.num_attention_heads = config.num_attention_heads
    args.num_key_value_heads = config.num_key_value_heads


def _init_commands(model_dir: Path | None) -> list[str]:
    """The runs that trained the --init-from checkpoint, oldest first, as each one's metrics.json
    records them; the last run's --output becomes ``model_dir``, where this run read it."""
    if model_dir is None:
        return []
    metrics = json.loads((model_dir / "metrics.json").read_text())
    earlier = metrics.get("init_from") or []
    earlier = [earlier] if isinstance(earlier, str) else earlier  # one run, as older models wrote
    output = metrics["command"].split("--output ", 1)[1].split()[0]
    return [*earlier, metrics["command"].replace(f"--output {output}", f"--output {model_dir}")]


def token_stream(
    tokenizer: Tokenizer, docs: list[Document], chats: list[str], chat_repeats: int, seed: int
) -> list[int]:
    eos = tokenizer.token_to_id("<|endoftext|>")
    # Every document opens as GLM-4 prompts do, so a plain completion prompt ([gMASK]<sop> + text,
    # as the engine encodes it) continues the text instead of ending at once.
    pieces = [PROMPT_PREFIX + doc.text for doc in docs] + chats * chat_repeats
    random.Random(seed).shuffle(pieces)
    stream = []
    for piece in tokenizer.encode_batch(pieces):
        stream += piece.ids
        if not piece.ids or piece.ids[-1] != eos:
            stream.append(eos)
    return stream


@dataclass(slots=True)
class Schedule:
    """Warmup-stable-decay: linear warmup, a constant peak, then a linear decay to zero.

    A run stopped during the stable phase is still a good starting point: resuming it with a
    decay is all it takes to finish, which is what makes a wall-clock budget safe.
    `total` and `decay_start` stay None until a --minutes run reaches its decay point. `cosine`
    is the schedule of earlier runs (a cosine from the peak down to a tenth of it over `total`),
    kept so that their commands still reproduce them.
    """

    peak: float
    warmup: int
    total: int | None = None
    decay_start: int | None = None
    cosine: bool = False

    def lr(self, step: int) -> float:
        if step < self.warmup:
            return self.peak * (step + 1) / self.warmup
        if self.cosine:
            progress = (step - self.warmup) / max(1, self.total - self.warmup)
            return self.peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        if self.decay_start is None or step < self.decay_start:
            return self.peak
        return self.peak * max(0.0, (self.total - step) / (self.total - self.decay_start))

    @classmethod
    def for_steps(
        cls, peak: float, warmup: int, steps: int, decay_steps: int, cosine: bool = False
    ) -> Schedule:
        return cls(peak, warmup, steps, steps - decay_steps, cosine)

    def describe(self) -> str:
        if self.cosine:
            return f"warmup {self.warmup}, cosine to a tenth of the peak at step {self.total}"
        return (
            f"warmup {self.warmup}, stable, linear decay to zero over the last "
            f"{self.total - self.decay_start} steps"
        )


def chat_starts(tokenizer: Tokenizer, stream: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Where the chat turns of ``stream`` begin (documents begin ``[gMASK]<sop>`` too, but
    never ``<|user|>`` after it), those a window of ``seq_len`` fits after."""
    opening = torch.tensor(_token_ids(tokenizer, CHAT_PROMPT.split("\n", 1)[0]))
    windows = stream[: len(stream) - seq_len - 1].unfold(0, len(opening), 1)
    return (windows == opening).all(dim=1).nonzero().flatten()


def sample_batch(
    stream: torch.Tensor,
    batch: int,
    seq_len: int,
    gen: torch.Generator,
    turn_starts: torch.Tensor | None = None,
    num_aligned: int = 0,
) -> torch.Tensor:
    """``batch`` windows of ``seq_len + 1`` tokens at random places; the first ``num_aligned``
    of them at the start of a chat turn (from ``turn_starts``), so that a rename turn's window
    holds the function it asks for as well as the answer that copies it."""
    starts = torch.randint(0, len(stream) - seq_len - 1, (batch,), generator=gen)
    if num_aligned:
        picks = torch.randint(0, len(turn_starts), (num_aligned,), generator=gen)
        starts[:num_aligned] = turn_starts[picks]
    return torch.stack([stream[s : s + seq_len + 1] for s in starts.tolist()])


def train_step(model, optimizer, batch: torch.Tensor, autocast: bool = True) -> float:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = model(input_ids=batch[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss.item()


@dataclass(slots=True)
class Progress:
    """Everything a resumed run needs besides the model and optimizer."""

    step: int = 0
    seconds: float = 0.0
    ema: float | None = None


def save_checkpoint(path: Path, model, optimizer, gen, schedule, progress, tokenizer) -> None:
    """Write the run's state atomically, so a run killed mid-write keeps its last checkpoint."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "generator": gen.get_state(),
        "schedule": (schedule.total, schedule.decay_start),
        "progress": (progress.step, progress.seconds, progress.ema),
        "tokenizer": tokenizer.to_str(),
    }
    torch.save(state, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").replace(path)


def checkpoint_tokenizer(path: Path) -> Tokenizer:
    return Tokenizer.from_str(torch.load(path, weights_only=False)["tokenizer"])


def load_checkpoint(path: Path, model, optimizer, gen, schedule) -> Progress:
    state = torch.load(path, weights_only=False)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    gen.set_state(state["generator"])
    if schedule.total is None:  # a --minutes run keeps the decay point it had reached
        schedule.total, schedule.decay_start = state["schedule"]
    return Progress(*state["progress"])


def _start_decay(schedule: Schedule, progress: Progress, budget_s: float, fraction: float) -> None:
    """Fix the decay length from the measured step time: it fills the rest of the budget."""
    per_step = progress.seconds / max(1, progress.step)
    remaining = max(budget_s - progress.seconds, fraction * budget_s)
    schedule.decay_start = progress.step
    schedule.total = progress.step + max(1, round(remaining / per_step))


def train(model, stream: torch.Tensor, args, schedule: Schedule, tokenizer, probe) -> Progress:
    """Train until the schedule ends; `probe(model)` reports held-out bits/char at checkpoints."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(args.seed)
    progress = Progress()
    if args.resume and args.checkpoint.exists():
        progress = load_checkpoint(args.checkpoint, model, optimizer, gen, schedule)
        print(f"resumed at step {progress.step} ({progress.seconds:.0f} s trained)", flush=True)
    budget_s = args.minutes * 60
    stepped = torch.compile(model) if args.compile else model  # shares model's parameters
    num_aligned = round(args.aligned_fraction * args.batch)
    turn_starts = chat_starts(tokenizer, stream, args.seq_len) if num_aligned else None
    model.train()
    while schedule.total is None or progress.step < schedule.total:
        if schedule.total is None and progress.seconds >= (1 - args.decay_fraction) * budget_s:
            _start_decay(schedule, progress, budget_s, args.decay_fraction)
            print(f"decay from step {schedule.decay_start} to {schedule.total}", flush=True)
        for group in optimizer.param_groups:
            group["lr"] = schedule.lr(progress.step)
        start = time.perf_counter()
        batch = sample_batch(stream, args.batch, args.seq_len, gen, turn_starts, num_aligned)
        loss = train_step(stepped, optimizer, batch, args.autocast)
        progress.seconds += time.perf_counter() - start
        progress.step += 1
        progress.ema = loss if progress.ema is None else 0.98 * progress.ema + 0.02 * loss
        if progress.step % args.checkpoint_every == 0 or progress.step == schedule.total:
            save_checkpoint(args.checkpoint, model, optimizer, gen, schedule, progress, tokenizer)
            model.eval()
            bpc = probe(model)
            model.train()
            print(
                f"step {progress.step}/{schedule.total or '?'} {progress.seconds:.0f}s "
                f"lr {schedule.lr(progress.step - 1):.2e} loss {progress.ema:.3f} "
                f"probe bits/char: {bpc}",
                flush=True,
            )
    model.eval()
    return progress


# ---------------------------------------------------------------- output


def write_tokenizer_files(tokenizer: Tokenizer, out: Path) -> None:
    tokenizer.save(str(out / "tokenizer.json"))
    added = {
        str(tokenizer.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "clean_up_tokenization_spaces": False,
        "do_lower_case": False,
        "model_max_length": 2048,
        "padding_side": "left",
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )


def write_model_files(model, tokenizer: Tokenizer, out: Path) -> None:
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    model.float()
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config["torch_dtype"] = "bfloat16"
    config["rope_theta"] = config["rope_parameters"]["rope_theta"]
    config["partial_rotary_factor"] = config["rope_parameters"]["partial_rotary_factor"]
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    generation = {
        "eos_token_id": [tokenizer.token_to_id(t) for t in STOP_TOKENS],
        "pad_token_id": tokenizer.token_to_id("<|endoftext|>"),
        "do_sample": False,
        "max_new_tokens": 256,
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def docs_metrics(model, tokenizer, heldout: HeldoutSets, args) -> dict:
    """With --corpus docs: the sources trained on and the held-out prose and chat figures."""
    if not heldout.prose:
        return {}
    return {
        "sources": corpus_sources(),
        "heldout_prose_chars": len(heldout.prose),
        "heldout_prose_bits_per_char": round(bits_per_char(model, tokenizer, heldout.prose), 4),
        "test_prose_slice_bits_per_char": round(
            bits_per_char(model, tokenizer, heldout.prose, args.test_slice_chars), 4
        ),
        "heldout_dictionaries_chars": len(heldout.dictionaries),
        "heldout_dictionaries_bits_per_char": round(
            bits_per_char(model, tokenizer, heldout.dictionaries), 4
        ),
        "heldout_chat_turns": len(heldout.chat),
        "heldout_chat_bits_per_char": round(chat_bits_per_char(model, tokenizer, heldout.chat), 4),
        "heldout_edit_turns": len(heldout.edits),
        "heldout_edit_copy_accuracy": round(copy_accuracy(model, tokenizer, heldout.edits), 4),
    }


def greedy_samples(model_dir: Path, prompts: list[str], max_new_tokens: int = 48) -> list[str]:
    from transformers import AutoTokenizer, Glm4ForCausalLM

    model = Glm4ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    outs = []
    for prompt in prompts:
        ids = torch.tensor([tok.encode(prompt, add_special_tokens=False)])
        gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        outs.append(tok.decode(gen[0, ids.shape[1] :]))
    return outs


def _init_lines(metrics: dict) -> list[str]:
    earlier = metrics.get("init_from") or []
    if not earlier:
        return []
    lines = ["That run continues (`--init-from`) the model these runs trained, in this order:", ""]
    for command in earlier:
        lines += [f"    {command}", ""]
    return lines


def write_report(out: Path, metrics: dict, samples: dict[str, str]) -> None:
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    lines = [
        "# pagedserve demo model",
        "",
        "A tiny GLM-4-0414-architecture model (`Glm4ForCausalLM`: sandwich norms, partial interleaved",
        "RoPE, GQA, qkv bias) trained on CPU. Its first runs read text that ships with CPython (the",
        "pydoc help topics and standard-library sources, plus chat turns whose answers are the first",
        "paragraph of a help topic or module docstring); with `--corpus docs` it also reads the",
        "English documentation of the Debian packages below, and chat turns made from them (FAQ",
        "questions and their answers, glossary and dictionary definitions, and requests to rename a",
        "variable in a standard-library function, answered with the function rewritten). Reproduce",
        "with:",
        "",
        f"    {metrics['command']}",
        "",
        *_init_lines(metrics),
        *_source_lines(metrics),
        "Special tokens sit at the end of the vocabulary (as in GLM-4); the tokenizer's post-processor",
        "adds none: prompts get `[gMASK]<sop>` from the chat template.",
        "",
        "| figure | value |",
        "|---|---|",
    ]
    keys = ["parameters", "vocab_size", "train_seconds", "steps", "tokens_seen", "train_tokens"]
    keys += ["heldout_chars", "heldout_tokens", "heldout_perplexity_per_token"]
    keys += ["heldout_bits_per_char", "unigram_bits_per_char", "test_slice_chars"]
    keys += ["test_slice_bits_per_char", "heldout_prose_chars", "heldout_prose_bits_per_char"]
    keys += ["heldout_dictionaries_chars", "heldout_dictionaries_bits_per_char"]
    keys += ["heldout_chat_turns", "heldout_chat_bits_per_char"]
    keys += ["heldout_edit_turns", "heldout_edit_copy_accuracy"]
    lines += [f"| {key} | {metrics[key]} |" for key in keys if key in metrics]
    lines += _vocab_lines(metrics)
    lines += ["", "Greedy samples:", ""]
    for prompt, completion in samples.items():
        lines += [f"- `{prompt!r}` -> `{completion!r}`"]
    (out / "TRAINING.md").write_text("\n".join(lines) + "\n")


def _source_lines(metrics: dict) -> list[str]:
    """The sources of a --corpus docs run, with their packages' versions and licences."""
    if not metrics.get("sources"):
        return []
    lines = ["Sources (Debian 12's packages; held out: one document in 20, by a hash of its name):"]
    lines += ["", "| source | package | version | licence |", "|---|---|---|---|"]
    for row in metrics["sources"]:
        lines.append(f"| {row['name']} | {row['package']} | {row['version']} | {row['licence']} |")
    return [*lines, ""]


def _vocab_lines(metrics: dict) -> list[str]:
    """The vocabulary-size table, when the run measured more than the size it used."""
    if len(metrics["vocab_measurements"]) < 2:
        return []
    lines = [
        "",
        "Vocabulary size, by measurement: held-out characters per token, and what the embedding",
        "plus the untied lm_head cost at this hidden size. The chosen size is the knee: doubling",
        "past it buys fewer characters per token for as many parameters as all decoder layers.",
        "",
        "| vocab | chars/token | embedding + lm_head parameters |",
        "|---|---|---|",
    ]
    hidden = metrics["hidden_size"]
    for vocab, cpt in sorted(metrics["vocab_measurements"].items(), key=lambda kv: int(kv[0])):
        lines.append(f"| {vocab} | {cpt} | {2 * int(vocab) * hidden} |")
    return lines


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output", type=Path, default=Path("pagedserve/demo_model"))
    p.add_argument(
        "--minutes",
        type=float,
        default=20.0,
        help="training time when --steps is not given; the decay takes its last --decay-fraction",
    )
    p.add_argument(
        "--steps", type=int, default=None, help="exact number of optimizer steps (reproducible)"
    )
    p.add_argument(
        "--decay-steps",
        type=int,
        default=None,
        help="with --steps: the last this many steps decay the learning rate to zero "
        "(default: --decay-fraction of --steps)",
    )
    p.add_argument("--decay-fraction", type=float, default=0.2)
    p.add_argument(
        "--schedule",
        choices=["wsd", "cosine"],
        default="wsd",
        help="warmup-stable-decay, or the cosine of earlier runs (needs --steps)",
    )
    p.add_argument(
        "--init-from",
        type=Path,
        default=None,
        help="continue training a model directory written by this script (its tokenizer and "
        "shape are kept; the shape flags are ignored)",
    )
    p.add_argument(
        "--checkpoint",
        type=Path,
        default=Path("build/train_demo_checkpoint.pt"),
        help="where the run's state is saved every --checkpoint-every steps",
    )
    p.add_argument("--checkpoint-every", type=int, default=100)
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from --checkpoint (same corpus and shape; the budget counts time "
        "already trained)",
    )
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--heldout-file",
        type=Path,
        default=None,
        help="where to write the held-out eval text (default: pagedserve/data/demo_heldout.txt "
        "for the shipped model, else OUTPUT/heldout.txt)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--measure-vocab", type=int, nargs="*", default=[2048, 4096, 8192])
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--intermediate-size", type=int, default=704)  # a multiple of 32 (int4 groups)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument(
        "--autocast",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="bf16 autocast for training matmuls (2x faster on CPUs with AVX-512 bf16)",
    )
    p.add_argument(
        "--qat",
        action="store_true",
        help="quantization-aware training: the decoder's linears compute with the INT4 weights "
        "that --quantization int4 serves (straight-through gradients), so that INT4 keeps the "
        "16-bit model's quality; a short last run with --init-from",
    )
    p.add_argument("--qat-group-size", type=int, default=32, help="INT4 group size for --qat")
    p.add_argument(
        "--corpus",
        choices=["cpython", "docs"],
        default="cpython",
        help="cpython: CPython's help topics and sources (the runs before the docs corpus); "
        "docs: also the English documentation of Debian packages and chat turns made from it "
        "(tools/demo_corpus.py lists them and their licences)",
    )
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="torch.compile the training forward (about 1.5x the tokens/s of eager on one thread)",
    )
    p.add_argument("--chat-repeats", type=int, default=3)
    p.add_argument(
        "--edit-turns-per-file",
        type=int,
        default=3,
        help="with --corpus docs: rename turns made from each standard-library source file (at "
        "most; one function each), the examples that teach the model to copy from its prompt",
    )
    p.add_argument(
        "--aligned-fraction",
        type=float,
        default=0.0,
        help="the share of each batch's windows that start where a chat turn starts (0, as every "
        "earlier run: all at random places, which cut most rename turns from the function they "
        "copy)",
    )
    p.add_argument(
        "--probe-edit-turns",
        type=int,
        default=40,
        help="held-out rename turns probed at checkpoints",
    )
    p.add_argument("--max-source-bytes", type=int, default=16_000_000)
    p.add_argument("--max-file-bytes", type=int, default=30_000)
    p.add_argument("--num-attention-heads", type=int, default=4)
    p.add_argument("--num-key-value-heads", type=int, default=2)
    p.add_argument(
        "--probe-chars", type=int, default=8000, help="held-out text probed at checkpoints"
    )
    p.add_argument("--test-slice-chars", type=int, default=4000)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = args.output
    out.mkdir(parents=True, exist_ok=True)

    corpus = load_corpus(args)
    train_texts = [d.text for d in corpus.train]
    heldout = write_heldout_sets(corpus, args.heldout_file or _default_heldout_file(out))
    print(
        f"corpus: {len(corpus.train)} train docs ({sum(map(len, train_texts))} chars), "
        f"{len(corpus.heldout)} held-out docs; eval texts "
        + ", ".join(f"{name} {len(text)} chars" for name, text in heldout.texts.items()),
        flush=True,
    )

    vocab_measurements = {}
    for vocab in [] if args.init_from else args.measure_vocab:
        if vocab != args.vocab_size:
            cpt = chars_per_token(train_tokenizer(train_texts, vocab), heldout.cpython)
            vocab_measurements[str(vocab)] = round(cpt, 3)
    if args.resume and args.checkpoint.exists():
        tokenizer = checkpoint_tokenizer(args.checkpoint)
    elif args.init_from:
        tokenizer = Tokenizer.from_file(str(args.init_from / "tokenizer.json"))
    else:
        tokenizer = train_tokenizer(train_texts, args.vocab_size)
    vocab_measurements[str(args.vocab_size)] = round(chars_per_token(tokenizer, heldout.cpython), 3)
    print(f"chars/token by vocab: {vocab_measurements}", flush=True)

    if args.corpus == "docs":
        turns = chat_turns(corpus.train, args.edit_turns_per_file)
    else:
        turns = help_turns(corpus.train)
    chats = [turn.text() for turn in turns]
    stream_ids = token_stream(tokenizer, corpus.train, chats, args.chat_repeats, args.seed)
    stream = torch.tensor(stream_ids)
    print(f"{len(chats)} chat examples; training stream {len(stream)} tokens", flush=True)

    shape = ModelShape(
        hidden_size=args.hidden_size,
        num_hidden_layers=args.layers,
        intermediate_size=args.intermediate_size,
        num_attention_heads=args.num_attention_heads,
        num_key_value_heads=args.num_key_value_heads,
    )
    model = init_model(args.init_from) if args.init_from else build_model(shape, tokenizer)
    _record_shape(args, model.config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params} parameters; batches of {args.batch}x{args.seq_len}", flush=True)
    if args.steps:
        decay_steps = args.decay_steps or round(args.decay_fraction * args.steps)
        cosine = args.schedule == "cosine"
        schedule = Schedule.for_steps(args.lr, args.warmup, args.steps, decay_steps, cosine)
    elif args.schedule == "cosine":
        raise SystemExit("--schedule cosine needs --steps")
    else:
        schedule = Schedule(args.lr, args.warmup)

    def probe(m) -> str:
        figures = [
            f"{name} {bits_per_char(m, tokenizer, text, args.probe_chars):.4f}"
            for name, text in heldout.texts.items()
        ]
        if heldout.edits:
            edits = heldout.edits[: args.probe_edit_turns]
            figures.append(f"edit copy accuracy {copy_accuracy(m, tokenizer, edits):.4f}")
        return ", ".join(figures)

    if args.qat:
        set_quantization_aware(model, args.qat_group_size)
    progress = train(model, stream, args, schedule, tokenizer, probe)
    set_quantization_aware(model, None)
    steps, seconds = progress.step, progress.seconds
    write_tokenizer_files(tokenizer, out)
    write_model_files(model, tokenizer, out)

    from transformers import Glm4ForCausalLM, PreTrainedTokenizerFast

    shipped = Glm4ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    shipped_tok = PreTrainedTokenizerFast.from_pretrained(out)
    nll, n_tokens, n_chars = heldout_nll(shipped, shipped_tok, heldout.cpython)
    metrics = {
        "command": "python tools/train_demo.py --output pagedserve/demo_model "
        f"--steps {steps} --decay-steps {schedule.total - schedule.decay_start} "
        f"--threads {args.threads} --seed {args.seed} --vocab-size {args.vocab_size} "
        f"--hidden-size {args.hidden_size} --layers {args.layers} "
        f"--num-attention-heads {args.num_attention_heads} "
        f"--num-key-value-heads {args.num_key_value_heads} "
        f"--intermediate-size {args.intermediate_size} --batch {args.batch} "
        f"--seq-len {args.seq_len} --lr {args.lr} "
        f"--warmup {args.warmup} --max-file-bytes {args.max_file_bytes} "
        f"--max-source-bytes {args.max_source_bytes} --schedule {args.schedule}"
        + (f" --qat --qat-group-size {args.qat_group_size}" if args.qat else "")
        + (f" --init-from {args.init_from.as_posix()}" if args.init_from else "")
        + (f" --corpus {args.corpus}" if args.corpus != "cpython" else "")
        + (
            f" --edit-turns-per-file {args.edit_turns_per_file}"
            if args.edit_turns_per_file != 3
            else ""
        )
        + (f" --aligned-fraction {args.aligned_fraction}" if args.aligned_fraction else "")
        + (" --compile" if args.compile else ""),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "parameters": n_params,
        "vocab_size": tokenizer.get_vocab_size(),
        "hidden_size": args.hidden_size,
        "layers": args.layers,
        "intermediate_size": args.intermediate_size,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "lr": args.lr,
        "schedule": schedule.describe(),
        "init_from": _init_commands(args.init_from),
        "train_seconds": round(seconds, 1),
        "steps": steps,
        "tokens_seen": steps * args.batch * args.seq_len,
        "train_tokens": len(stream_ids),
        "chat_examples": len(chats),
        "heldout_chars": n_chars,
        "heldout_tokens": n_tokens,
        "heldout_perplexity_per_token": round(math.exp(nll / n_tokens), 3),
        "heldout_bits_per_char": round(nll / math.log(2) / n_chars, 4),
        "unigram_bits_per_char": round(
            unigram_bits_per_char(
                token_stream(tokenizer, corpus.train, [], 0, args.seed),
                tokenizer.get_vocab_size(),
                tokenizer,
                heldout.cpython,
            ),
            4,
        ),
        "test_slice_chars": args.test_slice_chars,
        "test_slice_bits_per_char": round(
            bits_per_char(shipped, shipped_tok, heldout.cpython, args.test_slice_chars), 4
        ),
        "vocab_measurements": vocab_measurements,
        **docs_metrics(shipped, shipped_tok, heldout, args),
    }
    prompts = [
        "def ",
        "[gMASK]<sop><|user|>\nWhat does the return statement do?<|assistant|>\n",
        "import os\n\n",
        "[gMASK]<sop><|user|>\nExplain the json module.<|assistant|>\n",
    ]
    samples = dict(zip(prompts, greedy_samples(out, prompts), strict=True))
    write_report(out, metrics, samples)
    print(json.dumps(metrics, indent=2))
    for prompt, completion in samples.items():
        print(f"--- {prompt!r}\n{completion}")


if __name__ == "__main__":
    main()
