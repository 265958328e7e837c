"""A disk whose fsyncs are slow, or one of whose writes is held, for the tests of what a wait for one
lets happen meanwhile (a creation's, a delete's, a close's, a rotation's)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import gevent
import pytest

from kestrel.storage import disk
from tests.conftest import STALL_S


class Fsyncs(list[int]):
    """The threads (`threading.get_ident`) the slowed fsyncs ran in, as they began, and the most of
    them that were in flight at once (`peak`)."""

    def __init__(self) -> None:
        super().__init__()
        self.begun = threading.Event()  # set as the first begins
        self.peak = 0
        self._in_flight = 0
        self._guard = threading.Lock()

    def began(self) -> None:
        with self._guard:
            self.append(threading.get_ident())
            self._in_flight += 1
            self.peak = max(self.peak, self._in_flight)
        self.begun.set()

    def ended(self) -> None:
        with self._guard:
            self._in_flight -= 1


def slow_fsyncs(monkeypatch: pytest.MonkeyPatch, seconds: float, data: bool = False) -> Fsyncs:
    """Every `os.fsync` of the test (and with `data` every `os.fdatasync`: a journal's own, where no
    group commit takes it) takes `seconds` more (it sleeps in the calling thread: the pool's, where
    the server runs its fsyncs off the loop); undone with the test's monkeypatch. Returns the threads
    the fsyncs ran in, as they run: whether one ran on the loop's thread says whether it stalled the
    loop, and how many were in flight at once whether they overlapped, where a clock's reading on a
    busy machine can say neither."""
    return _slowed(monkeypatch, seconds, ("fsync", "fdatasync") if data else ("fsync",))


def slow_fdatasyncs(monkeypatch: pytest.MonkeyPatch, seconds: float) -> Fsyncs:
    """`slow_fsyncs` of `os.fdatasync` alone (a journal's own fsync, a close's), the folders' fsyncs
    left as they are; `begun` tells when a close (a delete's, a stop's) is inside its wait."""
    return _slowed(monkeypatch, seconds, ("fdatasync",))


def _slowed(monkeypatch: pytest.MonkeyPatch, seconds: float, calls: tuple[str, ...]) -> Fsyncs:
    fsyncs = Fsyncs()

    def slowed(real: Callable[[int], None]) -> Callable[[int], None]:
        def slow(fd: int) -> None:
            fsyncs.began()
            try:
                time.sleep(seconds)
                real(fd)
            finally:
                fsyncs.ended()
        return slow

    for call in calls:
        monkeypatch.setattr(os, call, slowed(getattr(os, call)))
    return fsyncs


def until_begun(started: threading.Event, caller: gevent.Greenlet | None = None) -> None:
    """Let the hub run until the blocking call a spawned caller makes has begun on the pool (the
    call sets `started`), or until `caller` ended without it; AssertionError after STALL_S."""
    for _ in range(int(STALL_S / 0.01)):
        if started.is_set() or (caller is not None and caller.ready()):
            return
        gevent.sleep(0.01)
    raise AssertionError(f"the blocking call never began, {caller or 'its caller'} waiting elsewhere")


def held_fdatasyncs(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Every `os.fdatasync` of the test waits until the second event returned is set (60 s at
    most), so that a change waiting for its fsync stays in progress meanwhile; the first is set as
    one begins (`until_begun`). Undone with the test's monkeypatch."""
    real, syncing, synced = os.fdatasync, threading.Event(), threading.Event()

    def held(fd: int) -> None:
        syncing.set()
        synced.wait(60)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", held)
    return syncing, synced


class HeldFileWrites:
    """`disk.write_all` to a file whose name starts with `prefix` (a Kestrel 2 queue `q`'s manifest
    written whole: its temporary `.kestrel/q~~manifest-...`, before its fsync and rename) off the
    loop's thread waits until `release` (60 s at most), then fails with the error given there, if
    one is, nothing written; `started` is set as it begins (`until_begun`). Only the first such
    write is held; on the loop thread nothing waits (the test would hang). Released at the end of a
    `with` block, however it ends; undone with the test's monkeypatch."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, prefix: str) -> None:
        self.loop_thread = threading.get_ident()
        self.started = threading.Event()
        self._released = threading.Event()
        self._error: OSError | None = None
        real = disk.write_all

        def held(fd: int, data: bytes | memoryview) -> None:
            if (threading.get_ident() != self.loop_thread and not self.started.is_set()
                    and os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(prefix)):
                self.started.set()
                self._released.wait(60)
                if self._error is not None:
                    raise self._error
            real(fd, data)

        monkeypatch.setattr(disk, "write_all", held)

    def release(self, error: OSError | None = None) -> None:
        self._error = error
        self._released.set()

    def __enter__(self) -> HeldFileWrites:
        return self

    def __exit__(self, *exc: object) -> None:
        self._released.set()  # (a test that failed first leaves no thread held)
