"""A group commit round of several journals as one syncfs(2) of their file system.

Each fdatasync of a journal that grew makes the file system commit its own journal and flush the
disk's cache; a round of 16 journals pays that up to 16 times, however concurrently the fsyncs are
issued. syncfs writes back every dirty file of the file system and commits once, so a round costs
one commit whatever the number of journals in it (on this project's build machine, rounds of 16
journals ran about twice as fast; README, Performance).

What it promises is the same: when syncfs returns 0, every journal's records written before it are
on disk. Two conditions keep it honest:
- Linux reports writeback errors through syncfs only since 5.8; before, it returned 0 regardless,
  so there it is never used.
- syncfs reports an error of any file of the file system, ours or not, without saying which. On
  an error the round fdatasyncs each journal as well, and each journal's own fdatasync reports its
  own failure: a failure fails exactly the journals whose data did not reach the disk.

The cost: syncfs also writes back other programs' dirty files on the same file system, so a round
waits for them. On this project's shared build machine, with other builds writing, a syncfs of 16
journals once took three times as long as their concurrent fdatasyncs; on the quiet machine it took
half as long. So neither is fixed: each round goes the way whose recent rounds were faster, and one
round every PROBE_SECONDS goes the other way to keep its figure current (by time, not by count, so
that a way that has turned very slow costs one slow round a second, however many rounds there
are). Rounds of a single journal keep their fdatasync; `KESTREL_FSYNC=threads` turns syncfs off.
"""

from __future__ import annotations

import ctypes
import os
import platform
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import gevent
import structlog

if TYPE_CHECKING:
    from storage.group_commit import FsyncMany

log = structlog.get_logger("kestrel.journal")

FIRST_KERNEL_REPORTING_ERRORS = (5, 8)
PROBE_SECONDS = 1.0  # once in this long, a round goes the way that is slower for now
SMOOTHING = 8  # a way's figure moves by 1/SMOOTHING of the gap to each new round's time


def reports_errors(release: str) -> bool:
    """Whether a Linux kernel of this release (`uname -r`) returns writeback errors from syncfs."""
    found = re.match(r"(\d+)\.(\d+)", release)
    return found is not None and (int(found[1]), int(found[2])) >= FIRST_KERNEL_REPORTING_ERRORS


def _libc_syncfs() -> Callable[[int], int] | None:
    """syncfs from the C library as a call returning 0 or the errno; None where there is none."""
    if platform.system() != "Linux" or not reports_errors(platform.release()):
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int]
    call.restype = ctypes.c_int

    def syncfs(fd: int) -> int:  # ctypes lets go of the interpreter lock during the call
        return 0 if call(fd) == 0 else ctypes.get_errno()  # errno of this thread, read in it

    return syncfs


class FilesystemSync:
    """Rounds of two or more journals on one file system as one syncfs on the hub's thread pool, or
    through `each` (one fdatasync a journal), whichever has lately been faster; anything else, and
    every round whose syncfs failed, through `each`."""

    def __init__(self, each: FsyncMany, syncfs: Callable[[int], int],
                 device: Callable[[int], int] = lambda fd: os.fstat(fd).st_dev,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.each = each
        self._syncfs = syncfs
        self._device = device
        self._clock = clock
        self.seconds = {"syncfs": 0.0, "each": 0.0}  # recent time of a round each way (0: none yet)
        self._last_probe = 0.0

    @classmethod
    def create(cls, each: FsyncMany) -> FilesystemSync | None:
        """syncfs rounds on this machine, or None where the kernel or C library cannot do them."""
        syncfs = _libc_syncfs()
        return None if syncfs is None else cls(each, syncfs)

    def fsync_all(self, fds: list[int]) -> list[OSError | None]:
        if len(fds) < 2 or not self._one_file_system(fds):
            return self.each.fsync_all(fds)
        started = self._clock()
        way = self._choose(started)
        results = self._syncfs_round(fds) if way == "syncfs" else self.each.fsync_all(fds)
        took = self._clock() - started
        known = self.seconds[way]
        self.seconds[way] = took if not known else known + (took - known) / SMOOTHING
        return results

    def _choose(self, now: float) -> str:
        syncfs, each = self.seconds["syncfs"], self.seconds["each"]
        if not syncfs or not each:
            self._last_probe = now
            return "syncfs" if not syncfs else "each"
        faster, slower = ("syncfs", "each") if syncfs <= each else ("each", "syncfs")
        if now - self._last_probe < PROBE_SECONDS:
            return faster
        self._last_probe = now
        return slower

    def _syncfs_round(self, fds: list[int]) -> list[OSError | None]:
        code = gevent.get_hub().threadpool.apply(self._syncfs, (fds[0],))
        if code == 0:
            return [None] * len(fds)
        log.warning("syncfs reported an error; each journal of the round is fsynced to find its own",
                    error=os.strerror(code), journals=len(fds))
        return self.each.fsync_all(fds)

    def _one_file_system(self, fds: list[int]) -> bool:
        try:
            first = self._device(fds[0])
            return all(self._device(fd) == first for fd in fds[1:])
        except OSError:  # a bad descriptor: each fdatasync names it
            return False
