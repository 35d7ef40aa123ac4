"""The README's curl examples, run verbatim against `pagedserve serve` on the embedded demo model,
work; and the completion the README shows is the one the demo model really gives.

The server listens on a free port, not the README's 8000 (which may be taken); the examples are run
with only their port changed to it."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
from conftest import serve_subprocess

README = Path(__file__).resolve().parents[1] / "README.md"
README_PORT = 8000  # the README's examples say localhost:8000


def curl_examples() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    return [b.strip() for b in blocks if b.lstrip().startswith("curl ")]


def shown_completion() -> str:
    """The JSON text the README prints under its first curl example."""
    m = re.search(r"```json\n(.*?)```", README.read_text(), flags=re.S)
    assert m, "README shows no JSON response"
    return json.loads(m.group(1))["choices"][0]["text"]


@pytest.fixture(scope="module")
def demo_server() -> int:
    """The port of `pagedserve serve` with its defaults (the demo model)."""
    with serve_subprocess() as (_, url):
        yield int(url.rsplit(":", 1)[1])


def on_port(example: str, port: int) -> str:
    """The example with the README's port replaced by ``port``."""
    pattern = rf"\b(localhost|127\.0\.0\.1):{README_PORT}\b"
    assert re.search(pattern, example), f"example does not address port {README_PORT}: {example}"
    return re.sub(pattern, rf"\g<1>:{port}", example)


def test_readme_has_curl_examples_for_completions_chat_and_streaming():
    joined = "\n".join(curl_examples())
    for path in ("/v1/completions", "/v1/chat/completions", '"stream": true'):
        assert path in joined


@pytest.mark.parametrize("index", range(len(curl_examples())))
def test_readme_curl_example_runs_verbatim(demo_server, index):
    example = on_port(curl_examples()[index], demo_server)
    proc = subprocess.run(
        ["bash", "-c", f"set -o pipefail; {example}"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.strip()
    assert out, "no output"
    if out.startswith("{"):
        assert "error" not in json.loads(out)
    elif out.startswith("data:"):
        assert out.rstrip().endswith("data: [DONE]")


def test_readme_shows_the_demo_models_real_completion(demo_server):
    first = on_port(curl_examples()[0], demo_server)
    proc = subprocess.run(["bash", "-c", first], capture_output=True, text=True, timeout=120)
    assert json.loads(proc.stdout)["choices"][0]["text"] == shown_completion()


def test_the_readmes_port_is_the_servers_default():
    from pagedserve.cli import build_parser

    assert build_parser().parse_args(["serve"]).port == README_PORT
