"""How long CI takes: `bash .ci/run` end to end (installs included), and pytest's own time.

    python -m benchmarks.suite_time                 # one run of .ci/run
    python -m benchmarks.suite_time --runs 5 --hog  # five in a row, a CPU hog beside them
    PYTEST_ADDOPTS=--durations=30 python -m benchmarks.suite_time --log suite.log  # the slowest

Run it on the machine CI runs on (a fresh one for the installs' cost: a second run finds
chromium, zsh and SGLang's venv in place). ``--hog`` keeps one core busy with a spinning process
for the whole measurement, the flakiness check: every failure under it is a bug to find. Each
run's wall time, pytest's time and its counts go to benchmarks/results/suite_time.json, or
suite_time_hog.json with ``--hog`` (the README quotes both); the command exits nonzero when any
run failed.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.results import spread, write_result

ROOT = Path(__file__).resolve().parents[1]
SUMMARY = re.compile(r"^=*\s*(?P<counts>(?:\d+ \w+(?:, )?)+) in (?P<seconds>[\d.]+)s", re.M)


def one_run(command: list[str], log: Path | None = None) -> dict:
    """Run ``command`` from the repository root; its wall time, exit status and pytest's
    summary (counts and its own seconds). ``log``: where its whole output is appended."""
    start = time.monotonic()
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=1, help="consecutive runs (default 1)")
    parser.add_argument("--hog", action="store_true", help="a CPU-spinning process beside them")
    parser.add_argument(
        "--command", default="bash .ci/run", help="what to time (default: bash .ci/run)"
    )
    parser.add_argument("--log", type=Path, help="append each run's whole output to this file")
    args = parser.parse_args(argv)
    hog = None
    if args.hog:
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        runs = [one_run(args.command.split(), args.log) for _ in range(args.runs)]
    finally:
        if hog is not None:
            hog.kill()
            hog.wait()
    figures = {
        "hog": args.hog,
        "runs": runs,
        "wall_s": spread([r["wall_s"] for r in runs]),
        "pytest_s": spread([r["pytest_s"] for r in runs]),
        "all_passed": all(r["returncode"] == 0 for r in runs),
    }
    print(f"wrote {write_result('suite_time_hog' if args.hog else 'suite_time', figures)}")
    return 0 if figures["all_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
