"""Installing what a test needs: the Debian packages, once, when the machine lets us; the project's
own wheel, as an operator installs it.

The suite's processes may want packages at the same moment, and dpkg takes one install at a time:
a second apt-get fails at once on dpkg's lock, which once skipped every ZooKeeper test of a run. So
installs take turns on a lock file of their own, and apt-get also waits for dpkg's lock (another
program's install) instead of failing.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.conftest import ROOT

LOCK_PATH = Path(tempfile.gettempdir()) / "kestrel-tests-apt.lock"
DPKG_LOCK_WAIT_S = 600


def ensure_debian_package(command: str, package: str) -> str | None:
    """Path of `command`, installing `package` with apt-get if missing; None if it cannot be had."""
    found = shutil.which(command)
    if found or os.geteuid() != 0 or shutil.which("apt-get") is None:
        return found
    with open(LOCK_PATH, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = shutil.which(command)  # another test process may have installed it meanwhile
        if found:
            return found
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        wait = ["-o", f"DPkg::Lock::Timeout={DPKG_LOCK_WAIT_S}"]
        for attempt in range(2):
            if attempt:  # a stale package list is the usual reason for a failed install
                subprocess.run(["apt-get", *wait, "update", "-qq"], env=env, capture_output=True, timeout=300)
            done = subprocess.run(["apt-get", *wait, "install", "-y", "-qq", package], env=env,
                                  capture_output=True, timeout=DPKG_LOCK_WAIT_S + 300)
            if done.returncode == 0:
                break
        return shutil.which(command)


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
