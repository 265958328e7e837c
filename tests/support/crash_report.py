"""Run a command (`make test`'s pytest) with core dumps allowed; when a process of it died leaving a
dump (the run failed, or a test let it pass), print every thread's C stack in that dump (gdb), then
delete the dump.

Why: a test process that dies of a signal in C code shows, through Python's faulthandler, only its
threads' Python frames, and none at all for a thread in compiled code or in a greenlet that runs
only compiled code. The C stack names the function that crashed.

    python tests/support/crash_report.py COMMAND [ARG ...]

The exit status is the command's (128 + N where a signal N killed it, as a shell gives). Dumps land
where the kernel's `core_pattern` puts them: with a plain pattern (Debian's default, `core`), in the
dying process's working directory, which for the test processes is the checkout; a pattern that
pipes dumps to a program (systemd-coredump, apport) leaves nothing here to read, which the report
of a failed run says.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

CORE_PATTERN = Path("/proc/sys/kernel/core_pattern")
FRAMES_PER_THREAD = 40
GDB_SECONDS = 300


def dumps_since(started: float, where: Path) -> list[Path]:
    """The core dumps written in `where` since `started`: files named `core` or `core.<anything>`."""
    found = [path for path in where.glob("core*")
             if (path.name == "core" or path.name.startswith("core.")) and path.is_file()]
    return sorted(path for path in found if path.stat().st_mtime >= started)


def c_stacks(dump: Path, executable: str) -> str:
    """Every thread's C stack in `dump` of a process of `executable`, as gdb prints it."""
    try:
        done = subprocess.run(["gdb", "-batch", "-nx", "-q", "-iex", "set auto-load safe-path /",
                               "-ex", f"thread apply all bt {FRAMES_PER_THREAD}", executable, str(dump)],
                              capture_output=True, text=True, timeout=GDB_SECONDS)
    except subprocess.TimeoutExpired as e:  # (what it captured comes as bytes, text or not)
        printed = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
        return f"gdb took over {GDB_SECONDS} s; what it printed:\n{printed}"
    return done.stdout + done.stderr


def report(started: float, where: Path, executable: str, failed: bool) -> None:
    dumps = dumps_since(started, where)
    if not dumps:
        pattern = CORE_PATTERN.read_text().strip() if CORE_PATTERN.exists() else "?"
        if failed and pattern.startswith("|"):
            print(f"crash report: core dumps go to a program here ({pattern}), none to read", file=sys.stderr)
        return
    for dump in dumps:
        print(f"\ncrash report: {dump} ({dump.stat().st_size:,} bytes)", file=sys.stderr)
        if shutil.which("gdb") is None:
            print("crash report: gdb is not installed; the dump is left for a look", file=sys.stderr)
            continue
        print(c_stacks(dump, executable), file=sys.stderr)
        dump.unlink()


def main(command: list[str]) -> int:
    if not command:
        print(__doc__, file=sys.stderr)
        return 2
    _, hard = resource.getrlimit(resource.RLIMIT_CORE)
    resource.setrlimit(resource.RLIMIT_CORE, (hard, hard))  # inherited by the command's processes
    started = time.time()
    status = subprocess.call(command)
    report(started, Path.cwd(), os.path.realpath(sys.executable), failed=status != 0)
    return 128 - status if status < 0 else status  # killed by signal N: 128 + N, as a shell says


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
