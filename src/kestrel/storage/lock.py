"""The queue path's lock: one process at a time owns the journals (a server, or the converter).

`<queue_path>/.lock` is locked with `flock` for as long as the owner lives; the kernel drops the
lock when the process dies, so a crash never leaves it held. The file names its owner (what and
which pid) so that a refused process can say who holds the path.
"""

from __future__ import annotations

import contextlib
import fcntl
import os

from kestrel.storage.errors import QueuePathInUse

LOCK_NAME = ".lock"


class QueuePathLock:
    """An exclusive lock on a queue path, taken at once or refused (never waited for)."""

    def __init__(self, queue_path: str) -> None:
        self.path = os.path.join(queue_path, LOCK_NAME)
        self._fd = -1

    def acquire(self, owner: str) -> None:
        """Take the lock for `owner` (e.g. "kestrel serve").

        Raises QueuePathInUse naming the process that holds it.
        """
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "another process"
            os.close(fd)
            raise QueuePathInUse(f"queue path {os.path.dirname(self.path)} is in use by {holder} "
                                 f"(it holds {self.path}); stop it first") from None
        except BaseException:
            os.close(fd)
            raise
        with contextlib.suppress(OSError):  # naming the owner is a courtesy: a full disk refuses it
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{owner} (pid {os.getpid()})\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, 0)
            os.close(self._fd)  # closing the descriptor drops the lock
            self._fd = -1

    def __enter__(self) -> QueuePathLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
