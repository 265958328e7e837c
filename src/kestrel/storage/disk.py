"""The system calls that put a journal's bytes on the disk: writing all of a buffer, fsyncing a file
or a folder.

This module stays Python in the compiled build (src/kestrel/build.py): the journals' writers call
`disk.write_all` and `disk.fsync_path`, looked up on each call, so that the fault tests can replace
them to fail a write or an fsync in either build.
"""

from __future__ import annotations

import errno
import os


def write_all(fd: int, data: bytes) -> None:
    """os.write until every byte is written (a short write means the disk is full: it raises)."""
    done = os.write(fd, data)
    while done < len(data):
        n = os.write(fd, memoryview(data)[done:])
        if n <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        done += n


def pwrite_all(fd: int, data: bytes, offset: int) -> None:
    """os.pwrite until every byte is written at `offset` (a short write means the disk is full)."""
    done = 0
    while done < len(data):
        n = os.pwrite(fd, memoryview(data)[done:], offset + done)
        if n <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        done += n


def fsync_path(path: str) -> None:
    """Make a directory's entries, or a whole file, durable (opened read-only: no write is due)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
