"""A group commit round of several journals as one syncfs(2) of their file system.

Each fdatasync of a journal that grew makes the file system commit its own journal and flush the
disk's cache; a round of 16 journals pays that up to 16 times, however concurrently the fsyncs are
issued. syncfs writes back every dirty file of the file system and commits once, so a round costs
one commit whatever the number of journals in it (on this project's quiet build machine, rounds of
16 journals ran 1.4 to 1.8 times as fast: bench_fsync in bench/README.md).

What it promises is the same: when syncfs returns 0, every journal's records written before it are
on disk. Two conditions keep it honest:
- Linux reports writeback errors through syncfs only since 5.8; before, it returned 0 regardless,
  so there it is never used.
- syncfs reports an error of any file of the file system, ours or not, without saying which. On
  an error the round fdatasyncs each journal as well, and each journal's own fdatasync reports its
  own failure: a failure fails exactly the journals whose data did not reach the disk.

The cost: syncfs also writes back other programs' dirty files on the same file system, so a round
waits for them. On this project's shared build machine, with other builds writing to the disk, a
syncfs of 16 journals once took three times as long as their concurrent fdatasyncs; on the quiet
machine it took half as long. Timing both ways and taking the faster, tried here, did worse than
either alone (round times vary too much from one round to the next to rank the ways by), so it is a
choice made for the machine: `KESTREL_FSYNC=syncfs`, for a queue path on a file system of its own.
Rounds of a single journal keep their fdatasync.
"""

from __future__ import annotations

import ctypes
import os
import platform
import re
from collections.abc import Callable

import structlog

from kestrel.storage.fsync import FsyncMany

log = structlog.get_logger("kestrel.journal")

FIRST_KERNEL_REPORTING_ERRORS = (5, 8)


def reports_errors(release: str) -> bool:
    """Whether a Linux kernel of this release (`uname -r`) returns writeback errors from syncfs."""
    found = re.match(r"(\d+)\.(\d+)", release)
    return found is not None and (int(found[1]), int(found[2])) >= FIRST_KERNEL_REPORTING_ERRORS


def libc_syncfs() -> Callable[[int], None] | None:
    """syncfs from the C library, raising OSError as os.fdatasync does; None where the kernel does not
    report writeback errors through it or the C library lacks it."""
    if platform.system() != "Linux" or not reports_errors(platform.release()):
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int]
    call.restype = ctypes.c_int

    def syncfs(fd: int) -> None:  # ctypes lets go of the interpreter lock during the call
        if call(fd) != 0:
            code = ctypes.get_errno()  # errno of this thread, read in it
            raise OSError(code, os.strerror(code))

    return syncfs


class FilesystemSync:
    """Rounds of two or more journals on one file system as one syncfs, issued the way the round's
    fdatasyncs would be (`src/kestrel/storage/fsync/group_commit.py`'s `filesystem_sync`); anything else, and
    every round whose syncfs failed, through `each` (one fdatasync a journal)."""

    def __init__(self, each: FsyncMany, syncfs: Callable[[list[int]], list[OSError | None]],
                 device: Callable[[int], int] = lambda fd: os.fstat(fd).st_dev) -> None:
        """`syncfs`: for each descriptor, the syncfs of its file system, off the event loop."""
        self.each = each
        self._syncfs = syncfs
        self._device = device

    def fsync_all(self, fds: list[int]) -> list[OSError | None]:
        if len(fds) < 2 or not self._one_file_system(fds):
            return self.each.fsync_all(fds)
        (error,) = self._syncfs(fds[:1])
        if error is None:
            return [None] * len(fds)
        log.warning("syncfs reported an error; each journal of the round is fsynced to find its own",
                    error=error.strerror, journals=len(fds))
        return self.each.fsync_all(fds)

    def _one_file_system(self, fds: list[int]) -> bool:
        try:
            first = self._device(fds[0])
            return all(self._device(fd) == first for fd in fds[1:])
        except OSError:  # a bad descriptor: each fdatasync names it
            return False
