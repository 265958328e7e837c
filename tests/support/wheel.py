"""The project's own wheel, built as an operator builds it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT


def build_wheel(workdir: Path) -> Path:
    """The project's wheel, built under `workdir` from a clean copy of the repository: setuptools
    leaves build/ behind, whose stale files would reach the wheel."""
    source = workdir / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".*", "build", "dist", "var", "*.egg-info", "__pycache__", "tests", "bench", "spark-warehouse"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--quiet", "-w",
                           str(workdir / "dist")], cwd=workdir, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"building the wheel failed:\n{done.stdout}\n{done.stderr}"
    (wheel,) = (workdir / "dist").glob("kestrel_py-*.whl")
    return wheel
