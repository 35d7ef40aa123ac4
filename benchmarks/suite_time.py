"""How long CI takes: `bash .ci/run` end to end (installs included) in a fresh clone of the
repository, in a new virtual environment, as CI runs it; and pytest's own time.

    python -m benchmarks.suite_time                 # one run
    python -m benchmarks.suite_time --runs 5 --hog  # five in a row, a CPU hog beside them
    python -m benchmarks.suite_time --hide-avx512   # as on an AVX2-only CPU (Zen 3)
    PYTEST_ADDOPTS=--durations=30 python -m benchmarks.suite_time --log suite.log  # the slowest

Each run clones this repository's committed HEAD (what CI checks out: uncommitted changes are not
measured) into ``$PAGEDSERVE_CACHE_DIR/suite-time/pagedserve`` and makes a new venv beside it
that sees this environment's packages (``tests/helpers/venvs.py``), so that ``.ci/run``'s
``pip install -e`` goes into that venv and leaves this environment's install alone. Both paths
are the same on every run: the native kernels' and SGLang's venv's caches are keyed by them, so
a machine's first run builds them beside the suite and its later runs find them in place.

``--hide-avx512`` sets ``PAGEDSERVE_CPU_FLAGS`` to this CPU's flags without AVX-512, AMX and
AVX-VNNI, so that the kernels and the tests see an AVX2-only CPU: the suite as a Zen 3 runs it,
on this machine.

Run it on the machine CI runs on. ``--hog`` keeps one core busy with a spinning process for the
whole measurement, the flakiness check: every failure under it is a bug to find. Each run's wall
time, pytest's time and its counts go to benchmarks/results/suite_time.json, or
suite_time_hog.json with ``--hog``, suite_time_avx2.json with ``--hide-avx512`` (the README quotes
them), with the commit measured and the
load average before and after (others' work on a shared machine slows the suite: note it); the
command exits nonzero when any run failed.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.results import spread, write_result
from tests.helpers.sglang_venv import cache_root
from tests.helpers.venvs import make_inheriting_venv

ROOT = Path(__file__).resolve().parents[1]
SUMMARY = re.compile(r"^=*\s*(?P<counts>(?:\d+ \w+(?:, )?)+) in (?P<seconds>[\d.]+)s", re.M)
CI_COMMAND = ["bash", ".ci/run"]


def workdir() -> Path:
    return cache_root() / "suite-time"


def fresh_checkout() -> tuple[Path, dict[str, str]]:
    """A fresh clone of this repository's HEAD and the environment of a new venv beside it:
    (the clone, the environment to run ``.ci/run`` in)."""
    work = workdir()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    clone = work / "pagedserve"
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(clone)], check=True)
    python = make_inheriting_venv(work / "venv")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PATH"] = f"{python.parent}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(work / "venv")
    return clone, env


def avx2_only_flags() -> str:
    """This CPU's flags as a Zen 3 has them: no AVX-512, no AMX, no AVX-VNNI."""
    from pagedserve.hal.native import cpu_flags

    hidden = ("avx512", "amx", "avx_vnni")
    return " ".join(sorted(f for f in cpu_flags() if not f.startswith(hidden)))


def one_run(log: Path | None = None, env_extra: dict[str, str] | None = None) -> dict:
    """``bash .ci/run`` in a fresh checkout: its wall time (the clone and venv not included),
    exit status and pytest's summary (counts and its own seconds). ``log``: where its whole
    output is appended."""
    clone, env = fresh_checkout()
    env.update(env_extra or {})
    print(f"run: {' '.join(CI_COMMAND)} in a fresh clone at {clone}", flush=True)
    start = time.monotonic()
    proc = subprocess.run(CI_COMMAND, cwd=clone, env=env, capture_output=True, text=True)
    wall = time.monotonic() - start
    if log is not None:
        with log.open("a") as f:
            f.write(proc.stdout + proc.stderr)
    sys.stdout.write(proc.stdout[-3000:])
    sys.stderr.write(proc.stderr[-3000:])
    found = SUMMARY.findall(proc.stdout)
    counts, seconds = found[-1] if found else ("", "nan")
    return {
        "returncode": proc.returncode,
        "wall_s": round(wall, 1),
        "pytest_s": float(seconds),
        "counts": {w: int(n) for n, w in re.findall(r"(\d+) (\w+)", counts)},
    }


def head_commit() -> str:
    return subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1, help="consecutive runs (default 1)")
    parser.add_argument("--hog", action="store_true", help="a CPU-spinning process beside them")
    parser.add_argument(
        "--hide-avx512", action="store_true", help="hide AVX-512, AMX, AVX-VNNI: a Zen 3's flags"
    )
    parser.add_argument("--log", type=Path, help="append each run's whole output to this file")
    args = parser.parse_args(argv)
    commit, load_before = head_commit(), os.getloadavg()
    env_extra = {"PAGEDSERVE_CPU_FLAGS": avx2_only_flags()} if args.hide_avx512 else {}
    hog = None
    if args.hog:
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        runs = [one_run(args.log, env_extra) for _ in range(args.runs)]
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    figures = {
        "commit": commit,
        "hog": args.hog,
        "cpu_flags": env_extra.get("PAGEDSERVE_CPU_FLAGS", "as the CPU has them"),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "runs": runs,
        "wall_s": spread([r["wall_s"] for r in runs]),
        "pytest_s": spread([r["pytest_s"] for r in runs]),
        "all_passed": all(r["returncode"] == 0 for r in runs),
    }
    name = "suite_time_hog" if args.hog else "suite_time"
    print(f"wrote {write_result(name + ('_avx2' if args.hide_avx512 else ''), figures)}")
    return 0 if figures["all_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
