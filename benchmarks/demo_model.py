"""The demo model's figures that the README quotes, from the metrics its training wrote.

    python -m benchmarks.demo_model

``tools/train_demo.py`` measures the embedded demo model as it trains it (parameters, training
time, held-out bits per character and perplexity, a unigram baseline, the fixed test slice) and
writes pagedserve/demo_model/metrics.json beside the weights. This copies those measurements into
benchmarks/results/demo_model.json with the training command, and adds the training time in
minutes as the README states it. Rerun it whenever pagedserve/demo_model changes.
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.results import write_result

METRICS = Path(__file__).resolve().parents[1] / "pagedserve" / "demo_model" / "metrics.json"


def main() -> None:
    metrics = json.loads(METRICS.read_text())
    training_command = metrics.pop("command")
    figures = {
        "training_command": training_command,
        "train_minutes": round(metrics["train_seconds"] / 60, 1),
        **metrics,
    }
    print(write_result("demo_model", figures))


if __name__ == "__main__":
    main()
