"""`make test`'s crash report (tests/support/crash_report.py): a process of the run that dies of a
segmentation fault in C has its threads' C stacks printed and its dump deleted, and the run's status
is kept."""

from __future__ import annotations

import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.support import crash_report

# A process that reads address 0 from C, from a function of its own name on the C stack
# (ctypes' `string_at` calls libc's `strlen` on the address it is given).
CRASHES = "import ctypes\ndef crashing_here():\n    ctypes.string_at(0)\ncrashing_here()\n"


def dumps_here() -> bool:
    """Whether a crashed process can leave a dump in its directory: no program takes the dumps, and
    the hard limit on their size lets one be written."""
    return (not crash_report.CORE_PATTERN.read_text().startswith("|")
            and resource.getrlimit(resource.RLIMIT_CORE)[1] != 0)


def run_report(tmp_path: Path, *command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "tests/support/crash_report.py"), *command],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(shutil.which("gdb") is None, reason="gdb is not installed")
@pytest.mark.skipif(not dumps_here(), reason="no core dump can be left here (core_pattern, ulimit -c)")
def test_a_crash_in_c_prints_its_c_stack_and_the_dump_is_deleted(tmp_path: Path) -> None:
    done = run_report(tmp_path, sys.executable, "-c", CRASHES)
    assert done.returncode == 128 + 11, (done.returncode, done.stderr[-2000:])  # SIGSEGV
    assert "crash report: " in done.stderr and "core" in done.stderr, done.stderr[-2000:]
    assert "strlen" in done.stderr, done.stderr[-4000:]  # the C function that read address 0
    assert "Thread 1" in done.stderr
    assert not crash_report.dumps_since(0, tmp_path)


@pytest.mark.skipif(shutil.which("gdb") is None, reason="gdb is not installed")
@pytest.mark.skipif(not dumps_here(), reason="no core dump can be left here (core_pattern, ulimit -c)")
def test_a_crash_that_the_run_lets_pass_is_reported_too(tmp_path: Path) -> None:
    """A test that runs a process which crashes, and passes all the same: the run's status stands,
    and the dump left behind is read and deleted."""
    tolerant = f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {CRASHES!r}])\n"
    done = run_report(tmp_path, sys.executable, "-c", tolerant)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "strlen" in done.stderr, done.stderr[-4000:]
    assert not crash_report.dumps_since(0, tmp_path)


def test_a_run_that_passes_or_fails_without_a_crash_reports_nothing(tmp_path: Path) -> None:
    (tmp_path / "core.unrelated").write_text("an older file of that name")
    passed = run_report(tmp_path, sys.executable, "-c", "pass")
    failed = run_report(tmp_path, sys.executable, "-c", "raise SystemExit(3)")
    assert (passed.returncode, failed.returncode) == (0, 3)
    assert "crash report" not in passed.stderr + failed.stderr
    assert (tmp_path / "core.unrelated").exists()  # written before the run: not its dump
