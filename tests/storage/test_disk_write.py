"""A journal append's writes: the C helper (src/kestrel/storage/_disk.c), which keeps the
interpreter's lock through the system calls while no call runs on a worker thread, answers as its
twins do (`os.write`; `disk.writev_all_python`, the gathering writes of an append's pieces), and
gives the lock up while one runs."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import gevent
import pytest
from gevent import monkey

from kestrel.storage import disk
from kestrel.storage.runtime import GeventRuntime
from tests.conftest import STALL_S

try:
    from kestrel.storage._disk import write as c_write
    from kestrel.storage._disk import writev_all as c_writev_all
except ImportError:  # built without a C compiler
    c_write = c_writev_all = None

F_GETPIPE_SZ = getattr(fcntl, "F_GETPIPE_SZ", 1032)  # Linux's, named from Python 3.10

Write = Callable[[int, bytes | memoryview], int]
WritevAll = Callable[[int, list[Any]], int]
WRITES = [pytest.param(os.write, id="os")] + ([] if c_write is None else [pytest.param(c_write, id="c")])
WRITEV_ALLS = [pytest.param(disk.writev_all_python, id="python")] + (
    [] if c_writev_all is None else [pytest.param(c_writev_all, id="c")])


def test_the_journal_appends_write_through_the_helper_where_the_build_has_it() -> None:
    assert disk.write is (os.write if c_write is None else c_write)
    assert disk.writev_all is (disk.writev_all_python if c_writev_all is None else c_writev_all)


@pytest.mark.parametrize("writev_all", WRITEV_ALLS)
def test_gathering_writes_land_every_piece_in_order_however_many(tmp_path: Path, writev_all: WritevAll) -> None:
    """More pieces than one system call takes (the system's IOV_MAX), of each kind of bytes and
    empty ones among them, land whole and in order; what is not a sequence of bytes is refused."""
    path = tmp_path / "journal"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    pieces: list[Any] = [bytes([n % 256]) * (n % 7) for n in range(disk.WRITE_PIECES + 5)]
    pieces[3:6] = [memoryview(b"--mv--")[2:-2], bytearray(b"ba"), b""]
    try:
        assert writev_all(fd, pieces) == sum(map(len, pieces))
        assert writev_all(fd, []) == 0 and writev_all(fd, [b"", b""]) == 0
        assert writev_all(fd, (b"a", b"tuple")) == 6  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            writev_all(fd, 5)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            writev_all(fd, [b"a", "str"])
        with pytest.raises(TypeError):
            writev_all("3", [b"a"])  # type: ignore[arg-type]
    finally:
        os.close(fd)
    assert path.read_bytes().startswith(b"".join(bytes(piece) for piece in pieces) + b"atuple")


@pytest.mark.parametrize("writev_all", WRITEV_ALLS)
def test_gathering_writes_that_fail_raise_the_oserror_of_their_errno(tmp_path: Path, writev_all: WritevAll) -> None:
    refused_by_errno(lambda fd: writev_all(fd, [b"da", b"ta"]), tmp_path)


@pytest.mark.parametrize("writev_all", WRITEV_ALLS)
def test_gathering_writes_cut_short_by_signals_go_on_from_where_they_stopped(writev_all: WritevAll) -> None:
    """Into a pipe with no room, which a signal's handler empties every few milliseconds: each write
    is interrupted, with nothing written (EINTR: made again) or part of it (a short write: the rest
    follows); every byte arrives once, in order."""
    read_end, write_end = pipe_with_room(0)
    os.set_blocking(write_end, True)
    received: list[bytes] = []
    capacity = fcntl.fcntl(write_end, F_GETPIPE_SZ)
    os.read(read_end, capacity)  # the filler: what the handlers read from here on is what was written

    def drain(signum: int, frame: object) -> None:
        os.set_blocking(read_end, False)
        with contextlib.suppress(BlockingIOError):
            received.append(os.read(read_end, 1 << 20))

    os.write(write_end, b"\0" * capacity)  # full again
    received.clear()
    pieces = [bytes([n]) * 10_000 for n in range(1, 40)]
    previous = signal.signal(signal.SIGALRM, drain)
    signal.setitimer(signal.ITIMER_REAL, 0.002, 0.002)
    try:
        assert writev_all(write_end, pieces) == sum(map(len, pieces))
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    drain(0, None)
    os.close(write_end)
    os.close(read_end)
    assert b"".join(received).lstrip(b"\0") == b"".join(pieces)


@pytest.mark.parametrize("write", WRITES)
def test_each_kind_of_bytes_lands_whole_after_what_was_there(tmp_path: Path, write: Write) -> None:
    path = tmp_path / "journal"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        pieces = [b"first", memoryview(b"--second--")[2:-2], bytes(bytearray(b"third")), b""]
        assert [write(fd, piece) for piece in pieces] == [5, 6, 5, 0]
    finally:
        os.close(fd)
    assert path.read_bytes() == b"firstsecondthird"


@pytest.mark.parametrize("write", WRITES)
def test_a_failed_write_raises_the_oserror_of_its_errno(tmp_path: Path, write: Write) -> None:
    reading = os.open(tmp_path / "r", os.O_RDONLY | os.O_CREAT, 0o644)
    os.close(reading)
    with pytest.raises(OSError) as raised:
        write(reading, b"data")  # closed
    assert raised.value.errno == errno.EBADF
    refused_by_errno(lambda fd: write(fd, b"data"), tmp_path)


def refused_by_errno(write: Callable[[int], object], tmp_path: Path) -> None:
    """`write` on a file open only for reading raises EBADF, and on /dev/full (where there is one)
    ENOSPC, as the OSError of its errno."""
    reading = os.open(tmp_path / "r", os.O_RDONLY | os.O_CREAT, 0o644)
    try:
        with pytest.raises(OSError) as raised:
            write(reading)  # not open for writing
        assert raised.value.errno == errno.EBADF
    finally:
        os.close(reading)
    if os.path.exists("/dev/full"):
        full = os.open("/dev/full", os.O_WRONLY)
        try:
            with pytest.raises(OSError) as raised:
                write(full)
            assert raised.value.errno == errno.ENOSPC
        finally:
            os.close(full)


@pytest.mark.parametrize("write", WRITES)
def test_what_is_not_a_descriptor_or_bytes_is_refused_by_name(write: Write) -> None:
    with pytest.raises(TypeError):
        write("3", b"data")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        write(1, "data")  # type: ignore[arg-type]
    with pytest.raises(OverflowError):
        write(1 << 40, b"data")


def pipe_with_room(room: int) -> tuple[int, int]:
    """A pipe whose write end has exactly `room` bytes of space left (its reader reads nothing)."""
    read_end, write_end = os.pipe()
    capacity = fcntl.fcntl(write_end, F_GETPIPE_SZ)
    os.set_blocking(write_end, False)
    os.write(write_end, b"\0" * (capacity - room))
    return read_end, write_end


@pytest.mark.parametrize("write", WRITES)
def test_a_short_write_answers_what_was_taken_and_the_next_call_what_follows(write: Write) -> None:
    """Where the file takes part of the data (a pipe with little room, as a disk nearly full), both
    answer the count taken, and a write with no room the errno: `JournalWriter.append` finishes
    the rest with `write_all` or cuts it back."""
    read_end, write_end = pipe_with_room(4096)
    try:
        assert write(write_end, b"x" * 10_000) == 4096
        with pytest.raises(BlockingIOError) as raised:
            write(write_end, b"more")
        assert raised.value.errno == errno.EAGAIN
    finally:
        os.close(read_end)
        os.close(write_end)


@pytest.mark.parametrize("write", WRITES)
@pytest.mark.parametrize("handler_raises", [False, True])
@pytest.mark.parametrize("workers", [0, 1], ids=["lock-held", "lock-given-up"])
def test_a_write_interrupted_by_a_signal_runs_the_handler_then_goes_on_or_raises_its_error(
        write: Write, handler_raises: bool, workers: int) -> None:
    """A write that blocks (a full pipe) and is interrupted (EINTR) runs the signal's handler and is
    made again, as PEP 475 makes os.write; a handler that raises ends it with that error, nothing
    written. The handler here makes the room the write waits for. The same whether the C helper
    holds the interpreter's lock or, a call running on a worker thread, gives it up."""
    disk.workers(workers)
    try:
        _interrupted_write(write, handler_raises)
    finally:
        disk.workers(-workers)


def _interrupted_write(write: Write, handler_raises: bool) -> None:
    read_end, write_end = pipe_with_room(0)
    os.set_blocking(write_end, True)
    handled: list[int] = []

    def make_room(signum: int, frame: object) -> None:
        handled.append(signum)
        os.read(read_end, 1 << 16)
        if handler_raises:
            raise InterruptedError("the handler's own error")

    previous = signal.signal(signal.SIGALRM, make_room)
    signal.setitimer(signal.ITIMER_REAL, 0.05)
    try:
        if handler_raises:
            with pytest.raises(InterruptedError, match="the handler's own error"):
                write(write_end, b"data")
            os.set_blocking(read_end, False)
            with pytest.raises(BlockingIOError):
                os.read(read_end, 1 << 20)  # the handler emptied the pipe and nothing of it was written
        else:
            assert write(write_end, b"data") == 4
            assert os.read(read_end, 1 << 20).endswith(b"data")
        assert handled == [signal.SIGALRM]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        os.close(read_end)
        os.close(write_end)


@pytest.fixture
def long_switch_interval() -> Iterator[None]:
    """The interpreter's switch interval made far longer than the test: a thread that waits for the
    lock gets it only when its holder gives it up."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(10 * STALL_S)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


@pytest.mark.skipif(c_write is None, reason="built without a C compiler: every write gives the lock up")
@pytest.mark.usefixtures("long_switch_interval")
@pytest.mark.parametrize("gathering", [False, True], ids=["write", "writev_all"])
def test_the_writes_give_the_lock_up_while_a_call_runs_on_a_worker_thread(tmp_path: Path, gathering: bool) -> None:
    """A loop busy with appends never waits, so a pack's Python on a worker thread would get the
    lock only when the interpreter made the loop let go of it (every 5 ms, a hand-over each time):
    while the runtime runs a call there, each write gives the lock up, and the call runs beside a
    loop that writes without ever yielding. Once the call is done, the count is back to none."""
    gate = monkey.get_original("_thread", "allocate_lock")()  # waited on without the lock
    gate.acquire()
    waiting: list[bool] = []
    ran: list[bool] = []

    def call() -> None:
        waiting.append(True)
        gate.acquire()
        ran.append(True)  # the lock wanted, to go on from `acquire`

    caller = gevent.spawn(partial(GeventRuntime().run_blocking, call))
    deadline = time.monotonic() + STALL_S
    while not waiting and time.monotonic() < deadline:
        gevent.sleep(0.01)
    assert waiting and disk.workers(0) == 1
    fd = os.open(tmp_path / "journal", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        gate.release()  # (keeps the lock): from here the call goes on only when a write gives it up
        chunk = bytes(64 * 1024)
        writes = 0
        while not ran and writes < 4096:  # up to 256 MB
            if gathering:
                disk.writev_all(fd, [chunk])  # never yields to the hub
            else:
                disk.write(fd, chunk)
            writes += 1
        ran_beside = bool(ran)  # (before the close, which gives the lock up)
    finally:
        os.close(fd)
    assert ran_beside, f"the worker's call did not run during {writes} writes made while it waited for the lock"
    caller.join(STALL_S)
    assert caller.dead and disk.workers(0) == 0
