"""User-facing text (README outside its Performance section, --help, docstrings and messages,
presets, deployment files) names the Kunlun XPU deployment guide, never "the seed", and points at
nothing outside the repository."""

from __future__ import annotations

import re
from pathlib import Path

from pagedserve.cli import _subparser, build_parser

ROOT = Path(__file__).resolve().parents[1]
SEED = re.compile(r"\bthe seed\b|\bseed's\b", re.IGNORECASE)
OUTSIDE = "../shared"


def readme_outside_performance() -> str:
    text = (ROOT / "README.md").read_text()
    return re.sub(r"^## Performance\n.*?(?=^## )", "", text, flags=re.M | re.S)


def shipped_text_files() -> list[Path]:
    files = [p for ext in ("py", "yaml", "md") for p in (ROOT / "pagedserve").rglob(f"*.{ext}")]
    files += [*(ROOT / "deploy").iterdir(), ROOT / "Dockerfile", ROOT / "docker-compose.yml"]
    return sorted(files)


def help_texts() -> dict[str, str]:
    parser = build_parser()
    commands = ["serve", "smi", "tune", "bench", "quantize", "eval-quant"]
    return {c: _subparser(parser, c).format_help() for c in commands}


def test_readme_outside_performance_never_says_the_seed_nor_points_outside():
    text = readme_outside_performance()
    assert "## Talk to it" in text and "## Performance" not in text
    assert not SEED.findall(text)
    assert OUTSIDE not in text


def test_shipped_text_never_says_the_seed():
    files = shipped_text_files()
    assert len(files) > 40
    saying = [str(p.relative_to(ROOT)) for p in files if SEED.search(p.read_text(errors="replace"))]
    assert saying == []


def test_help_never_says_the_seed_nor_points_outside():
    for command, text in help_texts().items():
        assert not SEED.findall(text), command
        assert OUTSIDE not in text, command
