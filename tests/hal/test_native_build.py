"""The native kernels' build and choice: each target is built only on a CPU that can run it, the
best one is chosen and the log says why a better one was not; a machine without a compiler runs
eager after one warning; an interrupted build does not hang the next start."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedserve.hal import native
from tests.helpers.tools import missing_tool

BEST = native.choose_kernels("auto").name
AVX2_FLAGS = " ".join(native.TARGETS["avx2"].cpu_flags)
ON_X86 = platform.machine().lower() in native.TARGETS["avx2"].machines


def _run(code: str, env: dict, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _cached_builds(tmp_path, *targets: str) -> None:
    """This machine's finished builds (of ``targets`` only, if named), so that a test compiles
    nothing it need not."""
    (tmp_path / "kernels").mkdir()
    for build in native.cache_dir().glob("*-*") if native.cache_dir().is_dir() else []:
        if not targets or build.name.split("-")[0] in targets:
            shutil.copytree(build, tmp_path / "kernels" / build.name)


def _builds(tmp_path) -> set[str]:
    return {p.name.split("-")[0] for p in (tmp_path / "kernels").glob("*-*")}


def test_without_a_compiler_the_engine_runs_eager_after_one_warning(tmp_path):
    code = (
        "import logging; logging.basicConfig(level=logging.WARNING)\n"
        "from pagedserve import LLM, SamplingParams\n"
        "llm = LLM(model='demo', device='cpu', num_kv_pages=16)\n"
        "print('kernels:', llm.llm_engine.device.kernel_set)\n"
        "out = llm.generate(['import os'], SamplingParams(max_tokens=4), use_tqdm=False)\n"
        "print('tokens:', len(out[0].outputs[0].token_ids))\n"
    )
    env = {"CXX": str(tmp_path / "no-such-compiler"), "PAGEDSERVE_CACHE_DIR": str(tmp_path)}
    proc = _run(code, env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "kernels: eager" in proc.stdout and "tokens: 4" in proc.stdout
    assert proc.stderr.count("native CPU kernels unavailable") == 1


def test_a_build_lock_left_by_a_killed_build_does_not_hang_the_next_start(tmp_path):
    # a first start killed while compiling leaves torch's lock file behind
    code = (
        "from pagedserve.hal import native\n"
        f"target = native.TARGETS[{BEST!r}]\n"
        "d = native.cache_dir() / native.build_key(target)\n"
        "d.mkdir(parents=True, exist_ok=True)\n"
        "(d / 'lock').write_text('')\n"
        "print('loaded:', native.choose_kernels('auto').name)\n"
    )
    _cached_builds(tmp_path)
    proc = _run(code, {"PAGEDSERVE_CACHE_DIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"loaded: {BEST}" in proc.stdout
    assert BEST == "eager" or "stale build lock" in proc.stderr


@pytest.mark.skipif(not ON_X86, reason="the avx2 and avx512 targets are x86-64 code")
def test_an_avx2_cpu_builds_no_avx512_kernels_and_says_why_it_runs_avx2(tmp_path):
    # the flags of an AVX2-only CPU (Zen 3, say): auto takes avx2, and nothing is compiled for
    # avx512, which that CPU could not execute
    if "avx2" not in native.executable_targets():
        pytest.skip("this CPU cannot execute the avx2 kernels itself")
    code = (
        "import logging; logging.basicConfig(level=logging.INFO)\n"
        "from pagedserve.hal import get_device\n"
        "print('kernels:', get_device('cpu').kernel_set)\n"
    )
    native.load_target("avx2")  # built once, in this machine's cache: the child copies it
    _cached_builds(tmp_path, "avx2")
    env = {"PAGEDSERVE_CACHE_DIR": str(tmp_path), "PAGEDSERVE_CPU_FLAGS": AVX2_FLAGS}
    proc = _run(code, env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "kernels: avx2" in proc.stdout
    assert "(not avx512: this CPU lacks avx512f avx512bw" in proc.stderr
    assert "avx512_bf16 avx512_vnni)" in proc.stderr
    assert _builds(tmp_path) == {"avx2"}, "a build for a target this CPU cannot run was made"


@pytest.mark.skipif(not ON_X86, reason="the avx2 and avx512 targets are x86-64 code")
def test_a_cpu_without_avx2_builds_only_the_portable_kernels(tmp_path):
    code = (
        "import logging; logging.basicConfig(level=logging.INFO)\n"
        "from pagedserve.hal import get_device\n"
        "print('kernels:', get_device('cpu').kernel_set)\n"
    )
    # built once, in this machine's cache (test_native_kernels.py runs it there too): the child
    # copies it instead of compiling it a second time
    native.load_target("portable")
    _cached_builds(tmp_path, "portable")
    env = {"PAGEDSERVE_CACHE_DIR": str(tmp_path), "PAGEDSERVE_CPU_FLAGS": "sse2 sse4_1 sse4_2"}
    proc = _run(code, env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "kernels: portable" in proc.stdout
    assert "avx2: this CPU lacks avx avx2 fma f16c" in proc.stderr
    assert _builds(tmp_path) == {"portable"}, "a build for a target this CPU cannot run was made"


@pytest.mark.skipif(not ON_X86, reason="the avx2 and avx512 targets are x86-64 code")
def test_asking_for_kernels_the_cpu_cannot_execute_names_what_it_lacks(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CPU_FLAGS", AVX2_FLAGS)
    lacks = r"--kernels avx512: this CPU cannot execute them \(it lacks avx512f"
    with pytest.raises(ValueError, match=lacks):
        native.choose_kernels("avx512")
    with pytest.raises(ValueError, match="--kernels 'avx1024': choose one of auto, avx512"):
        native.choose_kernels("avx1024")


def test_a_build_is_keyed_by_its_target_and_flags_not_by_the_machine_it_was_made_on(monkeypatch):
    # a cache shared by two machines of the same instruction set reuses the build; a different
    # target, or AVX-VNNI on an AVX2 CPU (its own -m flag), is a different build directory
    avx2 = native.TARGETS["avx2"]
    monkeypatch.setenv("PAGEDSERVE_CPU_FLAGS", AVX2_FLAGS + " some_other_flag")
    key = native.build_key(avx2)
    monkeypatch.setenv("PAGEDSERVE_CPU_FLAGS", AVX2_FLAGS)
    assert native.build_key(avx2) == key
    monkeypatch.setenv("PAGEDSERVE_CPU_FLAGS", AVX2_FLAGS + " avx_vnni")
    assert native.build_key(avx2) != key and "-mavxvnni" in native.target_cflags(avx2)
    assert native.build_key(native.TARGETS["portable"]).startswith("portable-")
    assert all("-march=native" not in native.target_cflags(t) for t in native.TARGETS.values())


def test_every_translation_unit_of_the_kernels_is_built():
    # a .cpp left out of native.SOURCES would leave its ops undefined in the library (an import
    # error on first start), or its code unbuilt
    assert set(native.SOURCES) == set(native.CSRC.glob("*.cpp"))
    assert native.SOURCES[0].name == "bindings.cpp"  # the syntax check's binding (below)


def _unrunnable_targets() -> list[str]:
    """The targets this CPU cannot execute. (AVX-VNNI's branch of avx2 is built and run on a CPU
    without AVX-VNNI by test_avx_vnni_emulated.py, its two instructions emulated.)"""
    return [name for name, target in native.TARGETS.items() if native.missing_flags(target)]


def _kernels_source(tmp_path) -> Path:
    """The library's sources in one file: the headers the binding includes and the other
    translation units (int4.cpp, attention.cpp), whose functions instantiate every tile and vector
    template of the target, so that an error in one fails the check. Not the binding itself:
    pybind11's and torch's Python headers took half of each check (24 of 48 s on a 2-core Zen 3),
    and its few lines of its own (amx_enable on avx512) are compiled where the target is built."""
    binding, *units = native.SOURCES
    includes = re.findall(r'^#include "([^"]+)"', binding.read_text(), flags=re.MULTILINE)
    assert includes, f"{binding} includes no kernel header"
    source = tmp_path / "kernels_syntax_check.cpp"
    source.write_text("".join(f'#include "{h}"\n' for h in [*includes, *(u.name for u in units)]))
    return source


@pytest.fixture(scope="module")
def syntax_checks(
    tmp_path_factory,
) -> Iterator[dict[str, subprocess.Popen]]:
    """Every syntax check of ``_unrunnable_targets``, started at once: each is one compiler
    process, so together they take one check's time on a machine of as many cores."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        missing_tool("no C++ compiler: apt-get install -y g++")
    from torch.utils import cpp_extension

    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    includes += [f"-I{sysconfig.get_paths()['include']}", f"-I{native.CSRC}"]
    source = _kernels_source(tmp_path_factory.mktemp("syntax"))
    checks = {}
    for name in _unrunnable_targets():
        cmd = [
            os.environ.get("CXX", "c++"), "-std=c++17", "-fsyntax-only",
            *native.target_cflags(native.TARGETS[name]), *includes, str(source),
        ]  # fmt: skip
        checks[name] = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    yield checks
    for proc in checks.values():
        proc.kill()
        proc.wait()


@pytest.mark.skipif(not ON_X86, reason="the avx2 and avx512 targets are x86-64 code")
@pytest.mark.parametrize("name", _unrunnable_targets())
def test_a_target_this_cpu_cannot_execute_still_compiles(name, syntax_checks):
    # what the CPU cannot run is never built to run here, but its source must still compile: a
    # syntax check with the target's own flags, so that an AVX2 machine's CI sees avx512 breakage
    _, stderr = syntax_checks[name].communicate(timeout=300)
    assert syntax_checks[name].returncode == 0, stderr[-3000:]
