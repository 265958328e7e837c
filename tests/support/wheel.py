"""The project's own wheel, built as an operator builds it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT


def build_wheel(workdir: Path, pure: bool = False) -> Path:
    """The project's wheel, built under `workdir` from a clean copy of the repository: setuptools
    leaves build/ behind, whose stale files would reach the wheel. Compiled where mypyc and a C
    compiler are at hand, as an operator's is; with `pure`, the pure build (KESTREL_PURE_PYTHON=1,
    quicker to make)."""
    source = workdir / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".*", "build", "dist", "var", "*.egg-info", "__pycache__", "tests", "bench", "spark-warehouse", "*.so"))
    env = dict(os.environ, KESTREL_PURE_PYTHON="1" if pure else "0")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--quiet", "-w",
                           str(workdir / "dist")], cwd=workdir, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, f"building the wheel failed:\n{done.stdout}\n{done.stderr}"
    (wheel,) = (workdir / "dist").glob("kestrel_py-*.whl")
    return wheel
