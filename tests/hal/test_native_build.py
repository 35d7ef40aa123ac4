"""The native kernels' build: a machine without a compiler runs eager after one warning; an
interrupted build does not hang the next start."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from pagedserve.hal import native

NATIVE = native.load_native_kernels() is not None


def test_without_a_compiler_the_engine_runs_eager_after_one_warning(tmp_path):
    code = (
        "import logging; logging.basicConfig(level=logging.WARNING)\n"
        "from pagedserve import LLM, SamplingParams\n"
        "llm = LLM(model='demo', device='cpu', num_kv_pages=16)\n"
        "print('kernels:', llm.llm_engine.device.kernel_set)\n"
        "out = llm.generate(['import os'], SamplingParams(max_tokens=4), use_tqdm=False)\n"
        "print('tokens:', len(out[0].outputs[0].token_ids))\n"
    )
    env = {
        **os.environ,
        "CXX": str(tmp_path / "no-such-compiler"),
        "PAGEDSERVE_CACHE_DIR": str(tmp_path),
    }
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "kernels: eager" in proc.stdout and "tokens: 4" in proc.stdout
    assert proc.stderr.count("native CPU kernels unavailable") == 1


def test_a_build_lock_left_by_a_killed_build_does_not_hang_the_next_start(tmp_path):
    # a first start killed while compiling leaves torch's lock file behind
    code = (
        "from pagedserve.hal import native\n"
        "d = native.cache_dir() / native._build_key()\n"
        "d.mkdir(parents=True, exist_ok=True)\n"
        "(d / 'lock').write_text('')\n"
        "print('loaded:', native.load_native_kernels() is not None)\n"
    )
    if NATIVE:  # start from this machine's finished build, so that nothing compiles again
        shutil.copytree(native.cache_dir(), tmp_path / "kernels")
    env = {**os.environ, "PAGEDSERVE_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"loaded: {NATIVE}" in proc.stdout
    assert NATIVE is False or "stale build lock" in proc.stderr
