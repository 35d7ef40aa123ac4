"""A non-editable install (a built wheel, as the Dockerfile's `pip install .` makes) carries the
device and model presets and the native kernels' sources: run from outside the source tree,
`tune` finds the model presets and `serve` reads the packaged device YAML and serves the web
console's files. The wheel's venv takes its dependencies from the environment running the tests
(tests/helpers/venvs.py), a venv or the system interpreter alike."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from pagedserve.testing import free_port
from tests.helpers.venvs import make_inheriting_venv

ROOT = Path(__file__).resolve().parents[2]
WEB_CONSOLE_FILES = ("/", "/console/console.js", "/console/console.css")


def _run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kwargs)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory) -> tuple[Path, dict[str, str], Path]:
    """(venv bin directory, environment without PYTHONPATH, a working directory outside the
    source tree) with the wheel built from this checkout installed into a fresh venv."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"  # build from a copy so the checkout gets no build/ or egg-info
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(
        ROOT / "pagedserve", src / "pagedserve", ignore=shutil.ignore_patterns("__pycache__")
    )
    pip = [sys.executable, "-m", "pip"]
    _run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", str(src), "-w", str(tmp)])
    (wheel,) = tmp.glob("pagedserve-*.whl")
    venv = tmp / "venv"
    # Dependencies (torch, fastapi, ...) come from the environment running the tests, be it a
    # venv or the system interpreter; the venv's own wheel comes first.
    python = make_inheriting_venv(venv)
    # --ignore-installed: this environment may hold pagedserve too (editable); never touch it
    _run(
        [
            *pip,
            "--python",
            str(python),
            "install",
            "-q",
            "--no-deps",
            "--ignore-installed",
            str(wheel),
        ]
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    workdir = tmp / "elsewhere"
    workdir.mkdir()
    where = _run(
        [str(python), "-c", "import pagedserve; print(pagedserve.__file__)"], cwd=workdir, env=env
    )
    assert Path(where.stdout.strip()).is_relative_to(venv), "the venv imports another pagedserve"
    return venv / "bin", env, workdir


def test_wheel_ships_every_preset(wheel_venv):
    bin_dir, env, workdir = wheel_venv
    code = "from pagedserve.presets import preset_names as p; print(p('models'), p('devices'))"
    listed = _run([str(bin_dir / "python"), "-c", code], cwd=workdir, env=env).stdout
    for path in (ROOT / "configs").glob("*/*.yaml"):
        assert repr(path.stem) in listed, f"{path} is missing from the wheel"


def test_wheel_ships_the_chat_templates(wheel_venv):
    from pagedserve.models.chat_templates import BUILTIN_CHAT_TEMPLATES, builtin_chat_template

    bin_dir, env, workdir = wheel_venv
    code = (
        "from pagedserve.models.chat_templates import BUILTIN_CHAT_TEMPLATES as b, "
        "builtin_chat_template as t; import json; print(json.dumps({n: t(n) for n in b}))"
    )
    shipped = json.loads(_run([str(bin_dir / "python"), "-c", code], cwd=workdir, env=env).stdout)
    assert shipped == {name: builtin_chat_template(name) for name in BUILTIN_CHAT_TEMPLATES}


def test_wheel_ships_the_native_kernel_sources(wheel_venv):
    bin_dir, env, workdir = wheel_venv
    code = "import importlib.util as u; print(u.find_spec('pagedserve').origin)"  # no torch
    package = _run([str(bin_dir / "python"), "-c", code], cwd=workdir, env=env).stdout.strip()
    installed = Path(package).parent / "hal" / "csrc"
    source = ROOT / "pagedserve" / "hal" / "csrc"

    def files(root: Path) -> list[str]:
        return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())

    assert files(source) and files(installed) == files(source)


def test_installed_tune_finds_the_model_and_device_presets(wheel_venv):
    from pagedserve.engine.memory_plan import tune

    bin_dir, env, workdir = wheel_venv
    cmd = [str(bin_dir / "pagedserve"), "tune", "--model", "glm-4-9b-chat"]
    # a GPU preset: its pool is bounded by the card alone, not by this machine's free RAM
    out = _run([*cmd, "--device", "cuda-h200", "--json"], cwd=workdir, env=env).stdout
    installed = json.loads(out)
    in_tree = tune("glm-4-9b-chat", "cuda-h200")
    assert installed["model"] == "glm-4-9b-chat" and installed["device"] == "cuda-h200"
    assert installed["num_kv_pages"] == in_tree.num_kv_pages
    assert installed["max_num_seqs"] == in_tree.max_num_seqs
    assert installed["kv_bytes_per_token"] == in_tree.kv_bytes_per_token == 40960


def test_installed_serve_reads_the_packaged_device_preset_and_answers_health(wheel_venv):
    bin_dir, env, workdir = wheel_venv
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # eager kernels: a native build from the wheel's own path (a new build key) would only take
    # minutes here; the sources it needs are held by test_wheel_ships_the_native_kernel_sources
    cmd = [str(bin_dir / "pagedserve"), "serve", "--device", "kunlun-emu", "--port", str(port)]
    cmd += ["--kernels", "eager"]
    log = workdir / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [*cmd, "--num-kv-pages", "32"], cwd=workdir, env=env, stdout=out, stderr=out
        )
        try:
            assert _wait_for_health(proc, url, log) == 200
            device = httpx.get(url + "/device", timeout=10).json()
            console = [httpx.get(url + path, timeout=10) for path in WEB_CONSOLE_FILES]
        finally:
            proc.terminate()
            proc.wait(30)
    preset = yaml.safe_load((ROOT / "configs/devices/kunlun-emu.yaml").read_text())
    assert device["name"] == "kunlun-emu"
    assert device["description"] == preset["description"]  # the YAML, not a built-in fallback
    assert [r.status_code for r in console] == [200] * len(WEB_CONSOLE_FILES), "console missing"


def _wait_for_health(proc: subprocess.Popen, url: str, log: Path, timeout: float = 600) -> int:
    """A server that exits fails at once; one that never answers fails after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"serve exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            return httpx.get(url + "/health", timeout=1).status_code
        except httpx.HTTPError:
            time.sleep(0.1)
    pytest.fail(f"serve did not answer /health in {timeout}s")


def test_a_venv_made_from_one_made_here_sees_every_package(tmp_path):
    """benchmarks/suite_time.py runs the suite in a venv made here; the venvs its tests make in
    turn (this wheel's, SGLang's) must still see torch, pydantic and the rest."""
    child = make_inheriting_venv(tmp_path / "child")
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); from pathlib import Path; "
        "from tests.helpers.venvs import make_inheriting_venv; "
        "print(make_inheriting_venv(Path(sys.argv[2])))"
    )
    made = _run([str(child), "-c", code, str(ROOT), str(tmp_path / "grandchild")])
    grandchild = made.stdout.strip()
    _run([grandchild, "-c", "import pydantic, yaml, numpy"], cwd=tmp_path)
