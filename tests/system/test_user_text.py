"""Words a user can follow. The industrial port that pagedserve reproduces is "the Kunlun XPU
deployment guide" (its `glm4_quantize` flags, its KV-cache formula, its INT4 bar) wherever a user
reads about it: README, --help, docstrings, messages and comments, presets, deployment files,
benchmarks and tests. A user has no "seed" (a random-number seed is a seed, and is fine), no
"deployment guide" short of that name, and nothing outside the repository to look at."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pagedserve.entrypoints.cli.main import build_parser
from pagedserve.entrypoints.cli.quantize import glm4_quantize_main
from pagedserve.entrypoints.cli.utils import subparser

ROOT = Path(__file__).resolve().parents[2]
# "the seed" / "seed's" name the port; random-number seeds are "--seed", "a seed", "seed=0"
SEED = re.compile(r"\bthe seed\b|\bseed's\b", re.IGNORECASE)
VAGUE_GUIDE = re.compile(r"(?<!Kunlun XPU )\bdeployment guide\b", re.IGNORECASE)
OUTSIDE = "../shared"
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".json", ".conf", ".sh", ".toml", ".txt", ""}


def _text_files(folder: Path) -> list[Path]:
    return [
        p
        for p in folder.rglob("*")
        if p.is_file() and p.suffix in TEXT_SUFFIXES and "__pycache__" not in p.parts
    ]


def user_facing_files() -> list[Path]:
    """Everything a user reads or runs, but this file: it has to name what it forbids."""
    files = [ROOT / "README.md", ROOT / "Dockerfile", ROOT / "docker-compose.yml"]
    files += [ROOT / "pyproject.toml"]
    for folder in ("pagedserve", "deploy", "configs", "benchmarks", "tests", "tools"):
        files += _text_files(ROOT / folder)
    return sorted(p for p in files if p != Path(__file__).resolve())


def help_texts() -> dict[str, str]:
    parser = build_parser()
    commands = ["serve", "smi", "tune", "bench", "quantize", "eval-quant", "completion"]
    return {c: _one_line(subparser(parser, c).format_help()) for c in commands}


def _one_line(text: str) -> str:
    """Lines joined, so that a name wrapped over two lines is still one name."""
    return re.sub(r"\s+", " ", text)


def _saying(pattern: re.Pattern) -> list[str]:
    return [
        f"{p.relative_to(ROOT)}: {m.group(0)!r}"
        for p in user_facing_files()
        for m in pattern.finditer(_one_line(p.read_text(errors="replace")))
    ]


def test_user_facing_text_never_calls_the_kunlun_guide_the_seed():
    files = user_facing_files()
    assert len(files) > 100 and ROOT / "README.md" in files
    assert any(p.parent.name == "configs" or "configs" in p.parts for p in files)
    assert _saying(SEED) == []


def test_the_deployment_guide_is_always_named_in_full():
    assert _saying(VAGUE_GUIDE) == []


def test_nothing_user_facing_points_outside_the_repository():
    assert [str(p.relative_to(ROOT)) for p in user_facing_files() if OUTSIDE in p.read_text()] == []


def test_help_names_the_guide_never_the_seed_nor_points_outside():
    for command, text in help_texts().items():
        assert not SEED.findall(text), command
        assert not VAGUE_GUIDE.findall(text), command
        assert OUTSIDE not in text, command


def test_glm4_quantize_help_says_whose_flags_it_takes(capsys):
    with pytest.raises(SystemExit):
        glm4_quantize_main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "with the flags of the Kunlun XPU deployment guide's glm4_quantize" in text
    assert "the names the Kunlun XPU deployment guide's glm4_quantize takes" in text


def test_the_detector_tells_the_port_from_random_seeds():
    port = [
        "the seed's flags",
        "as the seed describes",
        "The Seed's formula",
        "the deployment guide",
    ]
    random_seeds = ["--seed 0", "a per-request seed", "seed=1234", "the same seed gives", "seeded"]
    assert all(SEED.search(t) or VAGUE_GUIDE.search(t) for t in port)
    assert not any(SEED.search(t) or VAGUE_GUIDE.search(t) for t in random_seeds)
    assert not VAGUE_GUIDE.search("the Kunlun XPU deployment guide's KV-cache formula")
