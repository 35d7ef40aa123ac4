"""No test and no results file reads a file outside the repository: a fresh clone has, on any
machine, everything they need. (A results file once recorded a command that ran a script under
/tmp, and the test that checks its command passed only where that script happened to exist.)

Both checks read the text, where what a test or a benchmark reads is named:

- **A results file's command**: each word that names a path (a script, an option's file or
  directory) is a relative path inside the repository. Not checked: the argument of an option
  that names where the benchmark writes (``--log``, ``--output``). ``KNOWN_OUTSIDE`` lists the
  commands that still read something outside, each with what it is.
- **A test module** (``tests/**/*.py``): a string that starts with a directory of the
  filesystem's root (the FHS's: ``/tmp``, ``/etc``, ``/usr``, ``/proc``, ...) or with ``~/``, and
  a call of ``Path.home()`` or ``expanduser``, name something outside the repository; each must be
  one of ``OUTSIDE_PATHS``, with why a fresh clone needs no file there (a directory the test makes,
  the kernel's view of the test's own processes, a path a request names that must not be read).

An entry that its file no longer holds fails, so both lists stay true and short.
"""

from __future__ import annotations

import ast
import json
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = ROOT / "benchmarks" / "results"
TESTS_DIR = ROOT / "tests"

ROOT_DIRS = "bin|boot|dev|etc|home|lib|lib64|media|mnt|opt|proc|root|run|sbin|srv|sys|tmp|usr|var"
OUTSIDE = re.compile(rf"^(~/|/({ROOT_DIRS})(/|$))")
WRITES = ("--log", "--output")  # options that name where a benchmark writes, not what it reads

# (results file, the word of its command that is outside): what it is
KNOWN_OUTSIDE = {
    ("grammar_engines.json", "/tmp/bigtok2"): (
        "a GLM-4-sized tokenizer trained locally (the README says so), not in the repository: "
        "to remove once the benchmark builds its own"
    ),
}

# (test module, the string or call it holds): why a fresh clone needs no file there
OUTSIDE_PATHS = {
    ("tests/conftest.py", "/tmp"): "short_tmp_path makes a new directory there, for Unix sockets",
    ("tests/helpers/processes.py", "/proc"): "the kernel's view of the test's own processes",
    ("tests/helpers/processes.py", "/proc/"): "the kernel's view of the test's own processes",
    ("tests/system/test_readme.py", "/proc/"): "the memory of the server the test started",
    ("tests/hal/test_huge_pages.py", "/proc/self/smaps"): (
        "the kernel's view of the test's own memory: which of it is on huge pages"
    ),
    ("tests/hal/test_huge_pages.py", "/sys/kernel/mm/transparent_hugepage/enabled"): (
        "the OS's huge-page setting; the tests that need one skip where it is absent"
    ),
    ("tests/helpers/sglang_venv.py", "Path.home()"): (
        "where the suite builds SGLang's venv itself (the native kernels' cache)"
    ),
    ("tests/engine/test_core_client.py", "/tmp"): (
        "the directory the code under test chooses for its sockets; nothing is read there"
    ),
    ("tests/server/test_reliability_api.py", "/etc/passwd"): (
        "a request's model name, which the server must answer with a 404, reading nothing"
    ),
    ("tests/server/test_reliability_api.py", "/tmp"): "the same: a model name that is a directory",
    ("tests/system/test_deploy.py", "/etc/prometheus/prometheus.yml"): (
        "where compose mounts the repository's file in its container: the test reads the mount's "
        "source, in the repository"
    ),
    ("tests/system/test_deploy.py", "/etc/grafana/provisioning/datasources/pagedserve.yml"): (
        "the same: a mount point in a container"
    ),
    ("tests/system/test_deploy.py", "/etc/grafana/provisioning/dashboards/pagedserve.yml"): (
        "the same: a mount point in a container"
    ),
}


def outside_words(command: str) -> list[str]:
    """The words of a command line that name a path outside the repository (or a path in it
    that does not exist), but for the arguments of ``WRITES`` options."""
    words = shlex.split(command)
    found = []
    for before, word in zip(["", *words], words):
        if before in WRITES or word.startswith("-"):
            continue
        if OUTSIDE.match(word) or word.startswith("/") or ".." in Path(word).parts:
            found.append(word)
        elif "/" in word and not (ROOT / word).exists():
            found.append(word)
    return found


def outside_paths(source: str) -> list[str]:
    """The strings of a module that start at a directory of the filesystem's root (or ``~/``),
    and its calls that read the home directory."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if OUTSIDE.match(node.value):
                found.append(node.value)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr == "home" and getattr(node.func.value, "id", None) == "Path":
                found.append("Path.home()")
            elif node.func.attr == "expanduser":
                found.append("expanduser")
    return found


def results_commands() -> dict[str, str]:
    return {
        p.name: json.loads(p.read_text())["command"] for p in sorted(RESULTS_DIR.glob("*.json"))
    }


def suite_modules() -> list[Path]:
    """Every module of the suite but this one, whose strings are the paths it looks for."""
    return sorted(p for p in TESTS_DIR.rglob("*.py") if p != Path(__file__).resolve())


@pytest.mark.parametrize("name", sorted(results_commands()))
def test_a_results_files_command_reads_only_files_in_the_repository(name):
    outside = [w for w in outside_words(results_commands()[name]) if (name, w) not in KNOWN_OUTSIDE]
    assert not outside, f"{name}: its command reads {outside}, outside the repository"


def test_every_known_outside_read_is_still_there():
    commands = results_commands()
    for name, word in KNOWN_OUTSIDE:
        assert word in outside_words(commands.get(name, "")), f"{name} no longer reads {word}"


def test_no_test_reads_a_file_outside_the_repository():
    found = {
        (str(path.relative_to(ROOT)), s)
        for path in suite_modules()
        for s in outside_paths(path.read_text())
    }
    unexplained = sorted(found - set(OUTSIDE_PATHS))
    assert not unexplained, f"paths outside the repository, not in OUTSIDE_PATHS: {unexplained}"
    gone = sorted(set(OUTSIDE_PATHS) - found)
    assert not gone, f"OUTSIDE_PATHS entries no longer in their file: {gone}"


def test_the_checks_catch_a_read_outside_the_repository():
    """The command issue 50 found, and a test that opens a file under /tmp or the home."""
    command = "python -m benchmarks.suite_time --command bash /tmp/ci-fresh.sh --log /tmp/s.log"
    assert outside_words(command) == ["/tmp/ci-fresh.sh"]
    assert outside_words("python tools/mutation.py ../elsewhere/data benchmarks/nope.py") == [
        "../elsewhere/data",
        "benchmarks/nope.py",
    ]
    assert (
        outside_words("python -m benchmarks.grammar_engines --tokenizer pagedserve/demo_model")
        == []
    )
    source = (
        'open("/tmp/ci-fresh.sh"); Path(f"/etc/{x}"); Path.home(); p.expanduser(); "/v1/models"'
    )
    assert sorted(outside_paths(source)) == [
        "/etc/",
        "/tmp/ci-fresh.sh",
        "Path.home()",
        "expanduser",
    ]
