"""SGLang's own frontend (``sglang.RuntimeEndpoint``) runs a program with gen, select, fork and
regex against ``pagedserve serve``, unchanged.

SGLang cannot be a test extra: ``pip install sglang`` pulls its own CUDA torch. Its frontend
needs only a few small packages, so it lives in a virtual environment of its own that sees this
one's packages (torch stays as it is):

    python -m venv --system-site-packages .venv-sglang
    .venv-sglang/bin/pip install --no-deps sglang==0.5.23
    .venv-sglang/bin/pip install psutil pybase64 msgspec aiohttp requests triton orjson pillow \
        ipython pyzmq

The test runs the program with that environment's python (``$PAGEDSERVE_SGLANG_PYTHON`` names
another) and is skipped, saying why, where there is none.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from pagedserve.testing import serve

ROOT = Path(__file__).resolve().parents[2]
SGLANG_PYTHON = os.environ.get("PAGEDSERVE_SGLANG_PYTHON", str(ROOT / ".venv-sglang/bin/python"))

PROGRAM = r"""
import json, sys
import sglang as sgl

@sgl.function
def program(s, question):
    s += "Question: " + question + "\n"
    s += "Kind: " + sgl.select("kind", choices=["math", "history", "geography"]) + "\n"
    s += "Number: " + sgl.gen("number", max_tokens=8, regex=r"[0-9]{1,4}") + "\n"
    forks = s.fork(3)
    for i, f in enumerate(forks):
        f += f"Idea {i}:" + sgl.gen("idea", max_tokens=6, stop="\n")
    forks.join()
    s += "Done: " + sgl.gen("done", max_tokens=4, choices=["yes", "no"])

sgl.set_default_backend(sgl.RuntimeEndpoint(sys.argv[1]))
state = program.run(question="What is 12 times 12?")
print(json.dumps({k: state[k] for k in ("kind", "number", "done")}))
"""


def _sglang_available() -> str | None:
    if not Path(SGLANG_PYTHON).exists():
        return f"no SGLang frontend environment at {SGLANG_PYTHON} (see this file's docstring)"
    probe = subprocess.run(
        [SGLANG_PYTHON, "-c", "import sglang; from sglang import RuntimeEndpoint"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if probe.returncode != 0:
        return f"sglang's frontend does not import in {SGLANG_PYTHON}: {probe.stderr[-300:]}"
    return None


def test_sglang_frontend_runs_a_program_against_pagedserve():
    why = _sglang_available()
    if why:
        pytest.skip(why)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with serve("--model", "demo") as (_, url):
        out = subprocess.run(
            [SGLANG_PYTHON, "-c", PROGRAM, url],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
        )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["kind"] in ("math", "history", "geography")
    assert re.fullmatch(r"[0-9]{1,4}", result["number"])
    assert result["done"] in ("yes", "no")
