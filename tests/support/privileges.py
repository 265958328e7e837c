"""Files and directories the server may not write, though the tests run as root (who writes
anywhere): a server run without the capabilities that let root do so, or a file made immutable."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


def as_plain_user() -> list[str]:
    """The command prefix that runs a program with the permissions a plain user has on files (as
    root: setpriv without CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH and CAP_FOWNER); skips the test
    where that cannot be had."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv (util-linux) to drop CAP_DAC_OVERRIDE")
    return [setpriv, "--bounding-set=-dac_override,-dac_read_search,-fowner"]


@contextmanager
def unwritable(path: Path) -> Iterator[None]:
    """`path` cannot be opened for writing by this process while inside: mode 444 for a plain
    user, `chattr +i` for root (skips the test where the file system has no immutable flag)."""
    if os.geteuid() != 0:
        mode = path.stat().st_mode
        path.chmod(0o444)
        try:
            yield
        finally:
            path.chmod(mode)
        return
    chattr = shutil.which("chattr")
    if chattr is None or subprocess.run([chattr, "+i", str(path)], capture_output=True).returncode:
        pytest.skip("running as root, and no chattr +i here to make a file unwritable")
    try:
        yield
    finally:
        subprocess.run([chattr, "-i", str(path)], check=True)
