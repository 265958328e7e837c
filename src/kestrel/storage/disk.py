"""The system calls that put a journal's bytes on the disk: writing all of a buffer, fsyncing a file
or a folder, unlinking files durably (`remove_files`); the one read of a large record a journal
reader makes (`pread`); and the open of a queue's files, which never waits on a FIFO or a device in
a file's place (`open_file`).

This module stays Python in the compiled build (src/kestrel/build.py): the journals' writers call
`disk.write`, `disk.write_all`, `disk.writev_all` and `disk.fsync_path`, looked up on each call, so
that the fault tests can replace them to fail a write or an fsync in either build. `write` is the
system call itself, and `writev_all` the gathering writes of an append's pieces (an item among
them, written where it is): a journal's append calls them straight, so no Python frame runs between
the compiled request path and the kernel. Where the build has a C compiler they are the C helper's
(src/kestrel/storage/_disk.c), which keeps the interpreter's lock through the writes while no call
runs on a worker thread (`workers`, counted by the runtime's `run_blocking`), and gives it up as
`os.write` and `writev_all_python`, their twins, do around each one while any does, so that the
worker's Python runs beside the loop's writes. The large appends are written on the thread pool
(src/kestrel/storage/write_gate.py), through `write_all` and `writev_all`, which give the lock up
there, so the loop runs meanwhile; so does `pread`, by which a reader reads a record larger than its
buffer whole, on the thread pool from `LARGE_APPEND` bytes, and by which a read-behind cursor reads
what `pread_cached` found the page cache not to hold.
"""
from __future__ import annotations

import contextlib
import errno
import io
import os
import stat
from collections.abc import Callable, Iterable

pwrite = os.pwrite
pread = os.pread


def write_all(fd: int, data: bytes | memoryview) -> None:
    """os.write until every byte is written (a short write means the disk is full: it raises)."""
    done = os.write(fd, data)
    while done < len(data):
        n = os.write(fd, memoryview(data)[done:])
        if n <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        done += n


# The most pieces one gathering write takes (the system's IOV_MAX).
WRITE_PIECES = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 16


def writev_all_python(fd: int, parts: list[bytes]) -> int:
    """os.writev until every byte of `parts` is written, in order and without joining them (a short
    write means the disk is full: it raises); how many bytes that was."""
    total = 0
    for first in range(0, len(parts), WRITE_PIECES):
        pieces = parts if len(parts) <= WRITE_PIECES else parts[first:first + WRITE_PIECES]
        size = sum(map(len, pieces))
        done = os.writev(fd, pieces)
        if done < size:  # the rest of the pieces, from where the write stopped
            for piece in pieces:
                if done >= len(piece):
                    done -= len(piece)
                    continue
                write_all(fd, memoryview(piece)[done:])
                done = 0
        total += size
    return total


write: Callable[[int, bytes | memoryview], int]
writev_all: Callable[[int, list[bytes]], int]
workers: Callable[[int], int]
try:
    from kestrel.storage._disk import workers, write, writev_all
except ImportError:  # built without a C compiler: every write gives the lock up, none counts workers
    write = os.write
    writev_all = writev_all_python

    def workers(change: int) -> int:
        """The helper's count of calls on worker threads, which `os.write` does not need."""
        return 0


# `preadv2`'s flag for a read that takes only what the page cache holds (Linux 4.14); 0 elsewhere.
_CACHED_ONLY = getattr(os, "RWF_NOWAIT", 0)


def pread_cached(fd: int, size: int, offset: int) -> bytes:
    """Up to `size` bytes at `offset` that the page cache holds, never waiting for the disk
    (`preadv2` with `RWF_NOWAIT`): fewer where it holds only the first of them or the file ends
    first, none where it holds none there. None either where the system cannot tell (no
    `RWF_NOWAIT`, a file system without it): the caller then reads from the disk. Raises
    OSError for any other failure."""
    if not _CACHED_ONLY:
        return b""
    room = bytearray(size)
    try:
        got = os.preadv(fd, [room], offset, _CACHED_ONLY)
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            return b""
        raise
    return bytes(memoryview(room)[:got])


def pwrite_all(fd: int, data: bytes, offset: int) -> None:
    """os.pwrite until every byte is written at `offset` (a short write means the disk is full)."""
    done = 0
    while done < len(data):
        n = os.pwrite(fd, memoryview(data)[done:], offset + done)
        if n <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        done += n


def open_file(path: str, flags: int, mode: int = 0o644) -> int:
    """`os.open` of a queue's file, or of a file the server reads whole (its config): a FIFO or a
    device in the file's place would hold the loop in `open` or `read` for good, so the open never
    waits (`O_NONBLOCK`, which a regular file's reads and writes ignore), and anything but a regular
    file is refused. Raises OSError naming the path."""
    try:
        fd = os.open(path, flags | os.O_NONBLOCK, mode)
    except OSError as e:
        if e.errno == errno.ENXIO:  # a FIFO opened for writing with no reader, or a device: name it
            raise _not_regular(path, os.stat(path).st_mode) from None
        raise
    try:
        kind = os.fstat(fd).st_mode
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(kind):
        os.close(fd)
        raise _not_regular(path, kind)
    return fd


def open_to_read(path: str) -> io.BufferedReader:
    """A file of the queue path (a journal, a checkpoint, a commit log segment, a manifest) opened to
    read as `open_file` opens it: a FIFO or a device in its place is refused, never waited on."""
    return io.BufferedReader(io.FileIO(open_file(path, os.O_RDONLY), "rb"))


def _not_regular(path: str, mode: int) -> OSError:
    return OSError(errno.EINVAL, f"not a regular file but a {_file_kind(mode)}", path)


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket"),
                       (stat.S_ISDIR, "directory")):
        if test(mode):
            return name
    return "special file"


def fsync_path(path: str) -> None:
    """Make a directory's entries, or a whole file, durable (opened read-only: no write is due)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_files(folder: str, paths: Iterable[str]) -> None:
    """Unlink the files `paths` of `folder` (one gone already is skipped), then fsync the folder
    once for them all: an unlink is durable only then, and one a power cut undid brought a deleted
    queue or reader back at the next start. Blocking: it runs off the loop. Raises OSError."""
    for path in paths:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    fsync_path(folder)


def replace_file(path: str, data: bytes, temporary: str, sync: bool = True) -> None:
    """Put `data` in `path` in one step, so that a crash leaves the old file or the new, never a
    mix: written to `temporary` (a name start-up deletes), fsynced, renamed over `path`, and the
    folder fsynced, so that the new name is on disk too. Without `sync` neither fsync is made: the
    change may be lost by a power cut, but still not torn. A failure raises its OSError: before the
    rename with the temporary removed and `path` as it was; in the folder's fsync after it, with
    the new file in place but perhaps not yet durable."""
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            write_all(fd, data)
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    if sync:
        fsync_path(os.path.dirname(path) or os.curdir)
