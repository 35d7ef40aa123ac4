"""SGLang's own frontend (``sglang.RuntimeEndpoint``) runs a program with gen, select, fork and
regex against pagedserve's server (the demo model's, served in a thread: conftest), unchanged.

SGLang's frontend lives in a virtual environment of its own (``pip install sglang`` pulls a CUDA
torch); ``python3 -m tests.helpers.sglang_venv`` makes it, cached under ``~/.cache/pagedserve``
(the recipe and why: that module's docstring), and ``.ci/run`` does so before the suite. The test
runs the program with that environment's python (``$PAGEDSERVE_SGLANG_PYTHON`` names another);
where there is none it is skipped, saying why (in CI, ``CI=true``, it fails).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

from tests.helpers.sglang_venv import sglang_python, wait_for_venv
from tests.helpers.tools import missing_tool

ROOT = Path(__file__).resolve().parents[2]
SGLANG_PYTHON = str(sglang_python())

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
    wait_for_venv()  # .ci/run builds it beside the suite
    if not Path(SGLANG_PYTHON).exists():
        return (
            f"no SGLang frontend environment at {SGLANG_PYTHON}: make it with "
            "`python3 -m tests.helpers.sglang_venv`"
        )
    probe = subprocess.run(
        [SGLANG_PYTHON, "-c", "import sglang; from sglang import RuntimeEndpoint"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if probe.returncode != 0:
        return f"sglang's frontend does not import in {SGLANG_PYTHON}: {probe.stderr[-300:]}"
    return None


def test_sglang_frontend_runs_a_program_against_pagedserve(demo_thread_server):
    why = _sglang_available()
    if why:
        missing_tool(why)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [SGLANG_PYTHON, "-c", PROGRAM, demo_thread_server[0]],
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
