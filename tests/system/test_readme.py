"""The README's examples run as a new user would run them, against `pagedserve serve` on the
embedded demo model (on a free port instead of the README's 8000), and its claims hold: the
completion it shows is the one the demo model gives, the memory it quotes is what the server
takes, and the routes it says the API key guards are the ones it guards."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from benchmarks import demo_heldout
from pagedserve.testing import serve

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
README_PORT = 8000
DEMO_METRICS = json.loads((ROOT / "pagedserve" / "demo_model" / "metrics.json").read_text())
# the server's weights are the ones tools/train_demo.py measured; its forward is not bit-identical
SERVER_BITS_PER_CHAR_TOLERANCE = 0.005


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def curl_examples() -> list[str]:
    return [b.strip() for b in code_blocks("bash") if b.lstrip().startswith("curl ")]


def python_examples(server: bool) -> list[str]:
    """The Python blocks that talk to the server (they name its address), or the others; the
    tool examples aside (they need the server the README starts for them)."""
    blocks = [b for b in code_blocks("python") if b not in tool_examples()]
    return [b for b in blocks if (f":{README_PORT}" in b) == server]


def tool_examples() -> list[str]:
    """The Python blocks that send tools to the server."""
    return [b for b in code_blocks("python") if f":{README_PORT}" in b and "tools=" in b]


def tool_server_flags() -> list[str]:
    """The flags of the `pagedserve serve` line the README runs the tool examples against."""
    lines = [
        line.split()[2:]
        for b in code_blocks("bash")
        for line in b.splitlines()
        if line.startswith("pagedserve serve ") and "--tool-call-parser" in line
    ]
    assert len(lines) == 1, "the README shows no (or more than one) serve line for its tools"
    return lines[0]


def on_port(example: str, port: int) -> str:
    return re.sub(rf"(localhost|127\.0\.0\.1):{README_PORT}\b", rf"\1:{port}", example)


def shown_completion() -> str:
    """The JSON text the README prints under its first curl example."""
    m = re.search(r"```json\n(.*?)```", README.read_text(), flags=re.S)
    assert m, "README shows no JSON response"
    return json.loads(m.group(1))["choices"][0]["text"]


def readme_gb(pattern: str) -> float:
    text = re.sub(r"\s+", " ", README.read_text())
    m = re.search(pattern, text)
    assert m, f"README no longer says {pattern!r}"
    return float(m.group(1))


def resident_gb(pid: int) -> float:
    """Resident memory of a process and its children (the server's engine core process)."""
    status = Path(f"/proc/{pid}/status")
    if not status.exists():
        pytest.skip("no /proc on this system")
    kib = int(re.search(r"VmRSS:\s+(\d+) kB", status.read_text()).group(1))
    children = Path(f"/proc/{pid}/task/{pid}/children")
    kids = children.read_text().split() if children.exists() else []
    return kib * 1024 / 1e9 + sum(resident_gb(int(kid)) for kid in kids)


@pytest.fixture(scope="module")
def readme_server():
    """`pagedserve serve` with no flags, as the README starts it: (process, port)."""
    with serve() as (proc, url):
        yield proc, int(url.rsplit(":", 1)[1])


def _run(cmd: list[str], timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


def test_readme_has_curl_examples_for_completions_chat_and_streaming():
    joined = "\n".join(curl_examples())
    for path in ("/v1/completions", "/v1/chat/completions", '"stream": true'):
        assert path in joined


@pytest.mark.parametrize("index", range(len(curl_examples())))
def test_readme_curl_example_runs(readme_server, index):
    _, port = readme_server
    example = on_port(curl_examples()[index], port)
    out = _run(["bash", "-c", f"set -o pipefail; {example}"], timeout=120).stdout.strip()
    assert out, "no output"
    if out.startswith("{"):
        assert "error" not in json.loads(out)
    else:
        assert out.startswith("data:") and out.rstrip().endswith("data: [DONE]")


def _per_request(text: str) -> str:
    """A completion's text without the two fields that differ from request to request."""
    text = re.sub(r'"id": "cmpl-[0-9a-f]+"', '"id": "cmpl-..."', text)
    return re.sub(r'"created": \d+', '"created": ...', text).strip()


def test_readme_shows_the_demo_models_real_completion(readme_server):
    """Character for character what the example prints, all but its id and creation time."""
    _, port = readme_server
    example = curl_examples()[0]
    assert example.endswith("| python3 -m json.tool")  # the JSON shown is laid out by it
    out = _run(["bash", "-c", f"set -o pipefail; {on_port(example, port)}"], timeout=120).stdout
    assert json.loads(out)["choices"][0]["text"] == shown_completion()
    shown = re.search(r"```json\n(.*?)```", README.read_text(), flags=re.S).group(1)
    assert _per_request(out) == _per_request(shown)


# held-out set (benchmarks/demo_heldout.py's name) -> training's figures: the whole set, a slice
HELDOUT_SETS = {
    "cpython": ("heldout_bits_per_char", "test_slice_bits_per_char"),
    "prose": ("heldout_prose_bits_per_char", "test_prose_slice_bits_per_char"),
    "dictionaries": ("heldout_dictionaries_bits_per_char", None),
    "chat": ("heldout_chat_bits_per_char", None),
}


@pytest.mark.parametrize("name", ["cpython", "prose"])
def test_the_server_scores_the_heldout_slice_as_training_recorded(readme_server, name):
    """echo + logprobs through the server on the slice metrics.json records (held-out documents
    the model never trained on): the shipped model is as good there as its training run said."""
    _, port = readme_server
    path, slice_key = demo_heldout.TEXT_FILES[name], HELDOUT_SETS[name][1]
    text = path.read_text(encoding="utf-8")[: DEMO_METRICS["test_slice_chars"]]
    measured = demo_heldout.server_bits_per_char(f"http://127.0.0.1:{port}", text)
    recorded = DEMO_METRICS[slice_key]
    assert measured["heldout_bits_per_char"] <= recorded + SERVER_BITS_PER_CHAR_TOLERANCE
    assert measured["heldout_bits_per_char"] == pytest.approx(
        recorded, abs=SERVER_BITS_PER_CHAR_TOLERANCE
    )


@pytest.mark.parametrize("name", HELDOUT_SETS)
def test_readme_quotes_the_heldout_bits_per_char_measured_through_the_server(name):
    """Each README figure is benchmarks/demo_heldout.py's result on a whole held-out set, and
    that agrees with what training recorded for the shipped weights."""
    result = json.loads((ROOT / "benchmarks" / "results" / "demo_heldout.json").read_text())
    row = result[name]
    key = HELDOUT_SETS[name][0]
    if name == "chat":
        assert row["heldout_chars"] == sum(len(t["answer"]) for t in demo_heldout.chat_turns())
    else:
        assert row["heldout_chars"] == len(demo_heldout.TEXT_FILES[name].read_text("utf-8"))
    bpc = row["heldout_bits_per_char"]
    assert bpc == pytest.approx(DEMO_METRICS[key], abs=SERVER_BITS_PER_CHAR_TOLERANCE)
    shown = readme_gb(rf"\| `{name}` \| [^|]+ \| [\d,]+ \| ([\d.]+) \|")
    assert shown == round(bpc, 3)


@pytest.mark.parametrize("index", range(len(python_examples(server=True))))
def test_readme_python_example_against_the_server_runs_as_a_script(readme_server, index):
    _, port = readme_server
    example = on_port(python_examples(server=True)[index], port)
    assert _run([sys.executable, "-c", example]).stdout.strip(), "printed nothing"


def test_readme_agent_loop_runs_against_the_server_it_starts():
    """The tool-calling agent loop, against `pagedserve serve` with the README's flags: it
    prints the call's arguments (valid for the tool's schema) and the answer."""
    (example,) = tool_examples()
    with serve(*tool_server_flags()) as (_, url):
        port = int(url.rsplit(":", 1)[1])
        out = _run([sys.executable, "-c", on_port(example, port)]).stdout
    arguments, _, answer = out.partition(" -> ")
    assert set(json.loads(arguments)) == {"city"} and answer.strip()


def test_readme_offline_python_examples_run_as_one_script():
    """The blocks without a server, in README order (the later ones use the first's `llm`)."""
    examples = python_examples(server=False)
    assert any("LLM(" in e for e in examples)
    out = _run([sys.executable, "-c", "\n".join(examples)]).stdout
    assert "rejected: this request needs" in out  # the rejection example's prompt


def test_readme_memory_figures_bound_what_the_demo_server_takes(readme_server):
    # upper bounds: how much of an untouched pool is resident depends on the kernel
    proc, _ = readme_server
    default = readme_gb(r"The demo server takes up to about ([\d.]+) GB")
    assert resident_gb(proc.pid) <= default * 1.1
    small = readme_gb(r"--num-kv-pages 512` \(8,192 tokens\) takes up to about ([\d.]+) GB")
    with serve("--num-kv-pages", "512") as (small_proc, _):
        assert resident_gb(small_proc.pid) <= small * 1.5


def _routes(routes):
    """Every route, including those of routers the app includes (FastAPI >= 0.165 keeps an
    included router whole in ``app.routes``)."""
    for route in routes:
        inner = getattr(route, "original_router", None)
        yield from _routes(inner.routes) if inner is not None else (route,)


def test_readme_names_the_routes_the_api_key_guards(live_server):
    text = re.sub(r"\s+", " ", README.read_text())
    m = re.search(r"With `--api-key`, every route answers 401 (.*?)\. ", text)
    assert m, "README no longer says which routes the API key guards"
    guarded_part, _, open_part = m.group(1).partition(" except ")
    guarded = re.findall(r"`(/[^`]*)`", guarded_part)
    public = re.findall(r"`(/[^`]*)`", open_part)
    assert "/tokenize" in guarded and "/health" in public and "/" in public
    for route in _routes(live_server.app.routes):
        method = sorted(getattr(route, "methods", None) or ["GET"])[0]
        r = httpx.request(method, live_server.url + route.path, timeout=30)
        assert (r.status_code != 401) == _listed(route.path, public), (route.path, r.status_code)
        if r.status_code == 401:
            assert _listed(route.path, guarded), route.path


def _listed(path: str, names: list[str]) -> bool:
    """``/`` names the root only; ``/x`` and ``/x/*`` name everything under ``/x``."""
    return any(path == n if n == "/" else path.startswith(n.rstrip("*/")) for n in names)


def test_readme_lists_exactly_the_presets_that_ship():
    from pagedserve.presets import preset_names

    text = README.read_text()
    table = re.search(r"`--device` takes .*?\n\n(\|.*?)\n\n", text, flags=re.S).group(1)
    rows = table.splitlines()[2:]
    devices = {name for row in rows for name in re.findall(r"`([^`]+)`", row.split("|")[1])}
    assert devices - {"cuda"} == set(preset_names("devices"))  # cuda: the backend, no preset
    models = re.search(r"From a model preset \(`configs/models/`: (.*?)\) or", text, flags=re.S)
    assert set(re.findall(r"`([^`]+)`", models.group(1))) - {"demo"} == set(preset_names("models"))


def test_the_readmes_port_is_the_servers_default():
    from pagedserve.entrypoints.cli.main import build_parser

    assert build_parser(["serve"]).parse_args(["serve"]).port == README_PORT
