"""CI runs what a user runs: `.ci/run` installs the tools the tests drive and then runs exactly
the README's test command, and with ``CI=true`` a test that lacks its tool fails instead of
skipping (outside CI it skips, saying why)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CI_RUN = (ROOT / ".ci" / "run").read_text()

NEEDS_A_TOOL = """
from tests.helpers.tools import missing_tool, require_module

def test_needs_a_browser():
    missing_tool("no browser here: apt-get install chromium")

def test_needs_a_module():
    require_module("no_such_module_anywhere", "pip install it")
"""


def _readme_test_command() -> str:
    readme = (ROOT / "README.md").read_text()
    block = readme.split("Set up and run the whole test suite", 1)[1].split("```")[1]
    (command,) = block.strip().splitlines()
    return command


def test_ci_runs_exactly_the_readmes_test_command_last():
    lines = [ln.strip() for ln in CI_RUN.splitlines()]
    assert f"{_readme_test_command()} || status=$?" in lines
    suite = lines.index(f"{_readme_test_command()} || status=$?")
    assert suite > max(
        i for i, ln in enumerate(lines) if "apt-get install -y" in ln or "sglang_venv" in ln
    ), "the installs start before the suite"
    # apt runs beside the suite: its lock is taken before the suite starts, so that no test
    # looks for its tools before it has ended
    assert lines.index('exec 9>"$cache/ci-installs.lock"') < lines.index("flock 9") < suite
    assert "export CI=true" in lines


def test_a_tools_lookup_waits_for_the_apt_step_beside_the_suite(tmp_path, monkeypatch):
    import fcntl
    import threading

    from tests.helpers.tools import which

    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path))
    found = []
    with open(tmp_path / "ci-installs.lock", "w") as apt_step:
        fcntl.flock(apt_step, fcntl.LOCK_EX)
        lookup = threading.Thread(target=lambda: found.append(which("sh")))
        lookup.start()
        lookup.join(timeout=1.0)
        assert lookup.is_alive() and found == []  # waiting while the apt step runs
    lookup.join(timeout=10)
    assert found and found[0].endswith("/sh")


@pytest.mark.parametrize("package", ["chromium", "chromium-driver", "zsh"])
def test_ci_installs_every_apt_tool_only_where_missing(package):
    command = {"chromium-driver": "chromedriver"}.get(package, package)
    assert f"command -v {command} >/dev/null || apt_packages+=({package})" in CI_RUN


@pytest.mark.parametrize("ci", ["true", None], ids=["in-ci", "outside-ci"])
def test_a_missing_tool_fails_in_ci_and_skips_saying_why_elsewhere(ci, tmp_path):
    (tmp_path / "test_needs.py").write_text(NEEDS_A_TOOL)
    env = {k: v for k, v in os.environ.items() if k != "CI"} | ({"CI": ci} if ci else {})
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # hypothesis, schemathesis: not needed here
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
    ).stdout
    if ci:
        assert re.search(r"\b2 failed\b", out), out
        assert "no browser here: apt-get install chromium (CI=true" in out
    else:
        assert re.search(r"\b2 skipped\b", out), out
        assert "no browser here: apt-get install chromium" in out
        assert "pip install it (No module named 'no_such_module_anywhere')" in out
