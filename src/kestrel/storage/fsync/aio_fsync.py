"""Many fdatasyncs issued at once with Linux native AIO, and no thread: what a group-commit round uses.

`io_submit` hands every journal's IOCB_CMD_FDSYNC to the kernel in one system call; the kernel runs
them concurrently (its own workers call the same `vfs_fsync` as fdatasync(2)) and counts each
completion on an eventfd that the event loop watches, so the loop keeps serving meanwhile and no
Python thread has to take the interpreter lock to report a result. Linux 4.18 or later, on x86-64 or
arm64; `AioFsync.create()` answers None elsewhere, and the caller uses threads instead.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import sys
from functools import partial

import gevent

from kestrel.storage.fsync.eventfd import read_when_ready

# The io_* system calls by machine: (io_setup, io_destroy, io_getevents, io_submit).
_SYSCALLS = {"x86_64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2)}
_CMD_FDSYNC = 3
_FLAG_RESFD = 1  # count the completion on the eventfd in `resfd`
SLOTS = 256  # fsyncs in flight at once; a larger round is issued in parts


class AioUnsupported(Exception):
    """Raised when the kernel refuses an asynchronous fsync on this file system (before Linux 4.18)."""


class _Iocb(ctypes.Structure):
    """struct iocb, little-endian layout."""

    _fields_ = [("data", ctypes.c_uint64), ("key", ctypes.c_uint32), ("rw_flags", ctypes.c_int32),
                ("opcode", ctypes.c_uint16), ("reqprio", ctypes.c_int16), ("fildes", ctypes.c_uint32),
                ("buf", ctypes.c_uint64), ("nbytes", ctypes.c_uint64), ("offset", ctypes.c_int64),
                ("reserved2", ctypes.c_uint64), ("flags", ctypes.c_uint32), ("resfd", ctypes.c_uint32)]


class _Event(ctypes.Structure):
    """struct io_event."""

    _fields_ = [("data", ctypes.c_uint64), ("obj", ctypes.c_uint64), ("res", ctypes.c_int64),
                ("res2", ctypes.c_int64)]


class AioFsync:
    """One AIO context and its eventfd; `fsync_all` from one greenlet at a time."""

    def __init__(self, libc: ctypes.CDLL, numbers: tuple[int, int, int, int], context: ctypes.c_ulong,
                 eventfd: int) -> None:
        self._syscall = libc.syscall
        self._setup, self._destroy, self._getevents, self._submit = numbers
        self._context = context
        self._eventfd = eventfd
        self._watcher = gevent.get_hub().loop.io(eventfd, 1)
        self._wait = partial(gevent.get_hub().wait, self._watcher)
        self._iocbs = (_Iocb * SLOTS)()
        self._pointers = (ctypes.POINTER(_Iocb) * SLOTS)(*[ctypes.pointer(cb) for cb in self._iocbs])
        self._events = (_Event * SLOTS)()
        for i, cb in enumerate(self._iocbs):
            cb.opcode, cb.data, cb.flags, cb.resfd = _CMD_FDSYNC, i, _FLAG_RESFD, eventfd

    @classmethod
    def create(cls) -> AioFsync | None:
        """A context, or None where native AIO is not available (the caller falls back to threads).

        Raises OSError when its eventfd cannot be made (out of descriptors): try again later.
        """
        numbers = _SYSCALLS.get(platform.machine())
        if not sys.platform.startswith("linux") or numbers is None or sys.byteorder != "little":
            return None
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        context = ctypes.c_ulong(0)
        if libc.syscall(numbers[0], SLOTS, ctypes.byref(context)) != 0:
            return None  # no AIO in this kernel, or the system's aio-max-nr is used up
        try:
            eventfd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        except OSError:
            libc.syscall(numbers[1], context)
            raise
        return cls(libc, numbers, context, eventfd)

    def close(self) -> None:
        self._watcher.close()
        os.close(self._eventfd)
        self._syscall(self._destroy, self._context)

    def fsync_all(self, fds: list[int]) -> list[OSError | None]:
        """fdatasync every descriptor, concurrently; for each, None or the error of its fsync.

        Raises AioUnsupported when the kernel refuses the first of them as an operation it lacks.
        """
        results: list[OSError | None] = []
        for start in range(0, len(fds), SLOTS):
            results += self._round(fds[start:start + SLOTS], first=start == 0)
        return results

    def _round(self, fds: list[int], first: bool) -> list[OSError | None]:
        results: list[OSError | None] = [None] * len(fds)
        for i, fd in enumerate(fds):
            self._iocbs[i].fildes = fd
        pointers = ctypes.cast(self._pointers, ctypes.c_void_p).value or 0
        size = ctypes.sizeof(ctypes.c_void_p)
        issued, in_flight = 0, 0
        while issued < len(fds):  # io_submit stops at the first it refuses: note that one, go on
            n = self._syscall(self._submit, self._context, len(fds) - issued,
                              ctypes.c_void_p(pointers + issued * size))
            if n < 0:
                code = ctypes.get_errno()
                if code == errno.EINVAL and first and issued == 0:
                    raise AioUnsupported(f"the kernel refuses asynchronous fsync: {os.strerror(code)}")
                results[issued] = OSError(code, os.strerror(code))
                issued += 1
                continue
            issued += n
            in_flight += n
        while in_flight:
            read_when_ready(self._eventfd, self._wait)
            n = self._syscall(self._getevents, self._context, 0, SLOTS, self._events, None)
            if n < 0:
                code = ctypes.get_errno()
                if code == errno.EINTR:
                    continue
                raise OSError(code, f"io_getevents: {os.strerror(code)}")
            for event in self._events[:n]:
                if event.res < 0:
                    results[event.data] = OSError(-event.res, os.strerror(-event.res))
            in_flight -= n
        return results
