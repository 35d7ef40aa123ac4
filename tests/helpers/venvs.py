"""Virtual environments that see the running environment's packages, whatever it is.

``python -m venv --system-site-packages`` borrows the *base* interpreter's site-packages: run from
a venv (as many users run pytest), the new environment misses every package installed there. A
venv made here instead lists the running interpreter's own site directories in a ``.pth`` file,
after its own: what it installs wins, everything else (torch, fastapi, ...) comes from the
environment that made it, be it a venv or the system interpreter. Only the stdlib is used:
``.ci/run`` calls this before the test extras are installed.
"""

from __future__ import annotations

import site
import subprocess
import sys
from pathlib import Path


def site_dirs() -> list[str]:
    """The running interpreter's site directories, in its import order (a venv's own, then the
    base interpreter's where it inherits them, then the user's), and the directories such a venv
    made here inherits through its ``.pth`` file: a venv made from one made here (the suite run by
    ``benchmarks/suite_time.py`` in a venv of its own) sees them all."""
    dirs = [*site.getsitepackages()]
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    dirs += [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages")]
    return [d for d in dict.fromkeys(dirs) if Path(d).is_dir()]


def make_inheriting_venv(path: Path) -> Path:
    """A venv at ``path`` with no pip of its own that imports this environment's packages after
    its own (no ``.pth`` file of them runs: an editable install there stays out); its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    python = path / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(purelib) / "_inherited_site.pth").write_text("\n".join(site_dirs()) + "\n")
    return python
