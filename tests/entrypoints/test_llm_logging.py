"""The offline `LLM`'s warnings in a script that sets up no logging: each on a line of its own,
with its level and logger (not Python's bare message), above the progress bar and not inside
it; in a script that sets up its own logging, its format, once."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

SCRIPT = """\
{setup}
import logging
from pagedserve import LLM, SamplingParams

llm = LLM(model={model!r}, num_kv_pages=64, enforce_eager=True)
step, warned = llm.llm_engine.step, []


def step_that_warns_once():
    if not warned:
        warned.append(1)
        logging.getLogger("pagedserve.engine.llm_engine").warning("a warning while the bar runs")
    return step()


llm.llm_engine.step = step_that_warns_once
llm.generate(["Hello", "word " * 5000], SamplingParams(max_tokens=2))  # the second is rejected
"""


def _shown_lines(stderr: str) -> list[str]:
    """What a terminal shows of each line: the text after its last carriage return (a bar
    redraws itself over the same line with one)."""
    return [line.rsplit("\r", 1)[-1] for line in stderr.split("\n")]


def _run(model_dir, setup: str = "") -> list[str]:
    program = SCRIPT.format(setup=setup, model=str(model_dir))
    proc = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Processed prompts: 100%" in proc.stderr  # the bar ran
    return _shown_lines(proc.stderr)


@pytest.mark.parametrize(
    ("setup", "shown"),
    [
        ("", r"\d{{4}}-\d\d-\d\d [\d:,]+ WARNING {logger}: {message}"),  # serve's format
        ("import logging; logging.basicConfig()", "WARNING:{logger}:{message}"),  # the script's
    ],
    ids=["no-logging-setup", "basicConfig"],
)
def test_offline_warnings_stand_on_lines_of_their_own_above_the_bar(tiny_glm4, setup, shown):
    lines = _run(tiny_glm4[0], setup)
    for logger, message in [
        ("pagedserve.engine.llm_engine", "a warning while the bar runs"),
        ("pagedserve.entrypoints.llm", "prompt 1 rejected: this request needs"),
    ]:
        showing = [line for line in lines if message in line]
        expected = shown.format(logger=re.escape(logger), message=re.escape(message))
        assert len(showing) == 1, lines
        assert re.match(expected, showing[0]), showing[0]
