"""The agent benchmark of the README, with and without prefix caching, on the demo model.

    python -m benchmarks.agent_prefix_caching [--num-prompts 24] [--max-concurrency 8]

For each setting it starts ``pagedserve serve`` on the embedded demo model (on a free port; with
``--no-enable-prefix-caching`` for "off") and runs what the README shows,

    pagedserve bench --dataset agent --num-prompts 24 --max-concurrency 8 --output-file OUT

then writes its report to benchmarks/results/agent_prefix_caching_on.json and
agent_prefix_caching_off.json. Server and client share the machine, so the latencies depend on
how busy it is. Rerun it whenever pagedserve/demo_model changes.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.results import write_result
from pagedserve.testing import serve

SETTINGS = {"on": [], "off": ["--no-enable-prefix-caching"]}


def agent_bench(url: str, num_prompts: int, max_concurrency: int) -> dict:
    """``pagedserve bench --dataset agent`` against url: its --output-file report."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "agent.json"
        cmd = [sys.executable, "-m", "pagedserve", "bench", "--dataset", "agent"]
        cmd += ["--base-url", url, "--num-prompts", str(num_prompts)]
        cmd += ["--max-concurrency", str(max_concurrency), "--output-file", str(out)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=24, help="agent programs")
    parser.add_argument("--max-concurrency", type=int, default=8, help="programs at once")
    args = parser.parse_args()
    for name, flags in SETTINGS.items():
        with serve(*flags, log_level="warning") as (_, url):
            report = agent_bench(url, args.num_prompts, args.max_concurrency)
        report["server_flags"] = " ".join(flags)
        print(name, report, flush=True)
        print(write_result(f"agent_prefix_caching_{name}", report))


if __name__ == "__main__":
    main()
