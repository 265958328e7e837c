"""Installing the Debian packages a test needs, once, when the machine lets us."""

from __future__ import annotations

import os
import shutil
import subprocess

_updated = False


def ensure_debian_package(command: str, package: str) -> str | None:
    """Path of `command`, installing `package` with apt-get if missing; None with the reason logged."""
    global _updated
    found = shutil.which(command)
    if found or os.geteuid() != 0 or shutil.which("apt-get") is None:
        return found
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for attempt in range(2):
        if attempt or not _updated:
            subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=300)
            _updated = True
        done = subprocess.run(["apt-get", "install", "-y", "-qq", package], env=env, capture_output=True,
                              timeout=600)
        if done.returncode == 0:
            break
    return shutil.which(command)
