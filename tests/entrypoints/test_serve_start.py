"""What the command line refuses before it loads anything, and how it ends when its reader leaves:
`serve` on a port already taken fails at once naming ``--port`` (it loaded the whole model
first), ``--tensor-parallel-size`` that cannot split the model is refused before the engine core
and its ranks start, and ``smi`` and ``tune`` piped into ``head`` end without a traceback."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedserve.entrypoints.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_engine(monkeypatch):
    """The engine core may not start: a test that reaches it fails."""
    from pagedserve.engine.async_engine import AsyncLLMEngine

    def refuse(*args, **kwargs):
        raise AssertionError("the engine core was started")

    monkeypatch.setattr(AsyncLLMEngine, "from_config", refuse)


def test_a_busy_port_fails_at_once_naming_the_flag_before_the_model_loads(no_engine, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.monotonic()
        assert main(["serve", "--port", str(port)]) == 2
        assert time.monotonic() - start < 1.0
    err = capsys.readouterr().err
    assert err == (
        f"pagedserve serve: error: --port {port}: 127.0.0.1:{port} is already in use (another "
        f"server listens there); stop it, or start this one with another --port\n"
    )


def test_a_host_that_is_not_this_machines_names_both_flags(no_engine, capsys):
    assert main(["serve", "--host", "192.0.2.1", "--port", "8000"]) == 2  # TEST-NET-1
    err = capsys.readouterr().err
    assert err.startswith("pagedserve serve: error: --host 192.0.2.1 --port 8000: cannot listen")


def test_a_tensor_parallel_size_that_cannot_split_the_model_is_refused_before_the_engine(
    no_engine, capsys
):
    assert main(["serve", "--tensor-parallel-size", "3", "--port", "0"]) == 2
    assert capsys.readouterr().err.startswith(
        "pagedserve serve: error: --tensor-parallel-size 3 cannot split this model: it does not "
        "divide the 4 attention heads"
    )


def _reader_leaves(*args: str) -> subprocess.CompletedProcess:
    """``pagedserve ARGS | head -0``: the pipe is closed before the command writes a byte."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedserve", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )
    proc.stdout.close()
    err = proc.stderr.read()
    return subprocess.CompletedProcess(proc.args, proc.wait(timeout=60), "", err)


@pytest.mark.parametrize("command", ["smi", "tune"])
def test_a_command_whose_reader_leaves_ends_quietly_as_cat_does(command, live_server):
    args = {
        "smi": ["smi", "--json", "--url", live_server.url, "--api-key", live_server.api_key],
        "tune": ["tune", "--model", "demo", "--device", "cpu"],
    }[command]
    done = _reader_leaves(*args)
    assert done.stderr == ""
    assert done.returncode == 128 + signal.SIGPIPE
