"""The queue path's lock: one process at a time owns the journals (a server, or the converter).

`<queue_path>/.kestrel/lock` is locked with `flock` for as long as the owner lives; the kernel drops
the lock when the process dies, so a crash never leaves it held. The file names its owner (what and
which pid) so that a refused process can say who holds the path. The queue path's directory itself
is locked too: a lock file removed while its owner runs (taken for a stale one) would otherwise let
a second process lock a new file of that name and write the same journals. The owner must be able
to create files in the queue path (each new queue's journal goes there), which is checked before
anything is served. It then moves what an earlier version kept beside the journals into the
server's own directory (`layout.migrate`); a process of that version, which locks
`<queue_path>/.lock`, is refused first.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os

from kestrel.storage import filenames, layout
from kestrel.storage.errors import QueuePathInUse

EARLIER_LOCK_NAME = ".lock"  # where versions before the server's own directory kept the lock


class QueuePathLock:
    """An exclusive lock on a queue path, taken at once or refused (never waited for)."""

    def __init__(self, queue_path: str) -> None:
        self.queue_path = queue_path
        self.path = filenames.own_path(queue_path, filenames.LOCK_NAME)
        self._fd = self._directory_fd = -1

    def acquire(self, owner: str) -> None:
        """Take the lock for `owner` (e.g. "kestrel serve"), then move an earlier layout's files.

        Raises QueuePathInUse naming the process that holds it, OSError (PermissionError for a
        queue path no file can be created in).
        """
        layout.ensure(self.queue_path)
        fd = _lock(self.path, self.queue_path)
        try:
            self._directory_fd = _lock_directory(self.queue_path, self.path)
            check_writable_directory(self.queue_path)
            earlier = os.path.join(self.queue_path, EARLIER_LOCK_NAME)
            if os.path.exists(earlier):
                os.close(_lock(earlier, self.queue_path))  # refused while an earlier version runs
            layout.migrate(self.queue_path)
        except BaseException:
            os.close(fd)
            self._close_directory()
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
        self._close_directory()

    def _close_directory(self) -> None:
        if self._directory_fd >= 0:
            os.close(self._directory_fd)
            self._directory_fd = -1

    def __enter__(self) -> QueuePathLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def holder(queue_path: str) -> QueuePathInUse | None:
    """The refusal `acquire` would meet now, naming the process that holds the queue path (its lock
    file's owner line: what and which pid), or None when no process holds any of its locks. Looked
    at, never created: the lock file, an earlier version's, or the directory itself (its lock file
    removed). For the tools that only read the journals (`kestrel journal check`)."""
    lock_file = filenames.own_path(queue_path, filenames.LOCK_NAME)
    for path in (lock_file, os.path.join(queue_path, EARLIER_LOCK_NAME)):
        try:
            fd, taken = _flocked(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            if not taken:
                return _held(fd, path, queue_path)
        finally:
            os.close(fd)
    try:
        fd, taken = _flocked(queue_path, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return None
    os.close(fd)
    return None if taken else _directory_held(queue_path, lock_file)


def left_alone(queue_path: str) -> bool:
    """Whether a tool that writes (`kestrel journal convert`, `recover`) leaves `queue_path` as it is:
    no server or tool has owned it (`layout.owned`), so there is nothing to act on and no lock file
    is made. Raises QueuePathInUse where a process holds the directory all the same."""
    if layout.owned(queue_path):
        return False
    in_use = holder(queue_path)
    if in_use is not None:
        raise in_use
    return True

def _flocked(path: str, flags: int) -> tuple[int, bool]:
    """A descriptor of `path` and whether it now holds its lock (taken at once, never waited for)."""
    fd = os.open(path, flags, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return fd, False
    except BaseException:
        os.close(fd)
        raise
    return fd, True


def _held(fd: int, path: str, queue_path: str) -> QueuePathInUse:
    """The refusal for a lock file `path` (open as `fd`) that another process holds, naming it by
    the owner line it wrote (`acquire`)."""
    owner = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "another process"
    return QueuePathInUse(f"queue path {queue_path} is in use by {owner} (it holds {path}); stop it first")


def _directory_held(queue_path: str, lock_file: str) -> QueuePathInUse:
    """The refusal for a queue path whose directory another process holds, its lock file removed:
    the process named from the kernel's list of locks, where it shows."""
    pid = _flock_holder(queue_path)
    who = "another process" if pid is None else f"pid {pid}{_command_of(pid)}"
    return QueuePathInUse(f"queue path {queue_path} is in use by {who}, which holds the "
                          f"directory's lock although its lock file {lock_file} was removed (never "
                          f"remove the lock file of a running server); stop it first")


def _flock_holder(path: str) -> int | None:
    """The pid of the process holding a flock on `path`, from /proc/locks (Linux), or None where it
    does not show (another pid namespace, no /proc)."""
    try:
        found = os.stat(path)
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    inode = f"{os.major(found.st_dev):02x}:{os.minor(found.st_dev):02x}:{found.st_ino}"
    for line in lines:
        fields = line.split()  # `1: FLOCK  ADVISORY  WRITE 1234 fe:00:260072 0 EOF`; a waiter's has `->`
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == inode and fields[4].isdigit():
            pid = int(fields[4])
            return pid or None
    return None


def _command_of(pid: int) -> str:
    """` (<its command line>)`, short, or nothing where it cannot be read."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            words = f.read(400).split(b"\0")
    except OSError:
        return ""
    command = " ".join(w.decode("utf-8", "replace") for w in words if w)
    return f" ({command[:120]})" if command else ""


def _lock(path: str, queue_path: str) -> int:
    """A descriptor of `path` holding its lock. Raises QueuePathInUse naming the holder."""
    fd, taken = _flocked(path, os.O_RDWR | os.O_CREAT)
    if not taken:
        try:
            raise _held(fd, path, queue_path)
        finally:
            os.close(fd)
    return fd


def _lock_directory(queue_path: str, lock_file: str) -> int:
    """A descriptor of the queue path's directory holding its lock. Its lock file taken, only a
    process whose lock file was removed from under it can hold this one. Raises QueuePathInUse."""
    fd, taken = _flocked(queue_path, os.O_RDONLY | os.O_DIRECTORY)
    if not taken:
        os.close(fd)
        raise _directory_held(queue_path, lock_file)
    return fd


def check_writable_directory(directory: str) -> None:
    """Raise PermissionError naming `directory` unless a file can be created in it: an unnamed one
    (O_TMPFILE), which leaves nothing behind even if the process dies, or where the file system
    has none, the access check. Root without the right to override permissions is refused too."""
    try:
        os.close(os.open(directory, os.O_TMPFILE | os.O_WRONLY, 0o600))
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise OSError(e.errno, e.strerror, directory) from None
        if not os.access(directory, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, "no file can be created in it", directory) from None
