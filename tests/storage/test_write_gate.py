"""Large appends written off the event loop (src/kestrel/storage/write_gate.py): the write runs on
another thread while the loop serves other queues, the changes of its own journal wait their turn,
and a write that fails leaves the journal as it was. Observed through the threads the system
calls run on and the greenlets that are done, never through timing."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import gevent
import pytest

from kestrel.storage import JournalWriteError, QueueCollection, QueueConfigs, disk
from kestrel.storage.clock import FakeClock
from kestrel.storage.journal_file import JournalWriter
from kestrel.storage.runtime import ManualRuntime
from kestrel.storage.write_gate import LARGE_APPEND, WriteGate
from tests.conftest import STALL_S
from tests.support.queues import drain, load_strictly

T0 = 1_700_000_000_000
LARGE = b"L" * (LARGE_APPEND + 1000)

SETTINGS = [
    pytest.param({"journal_format": "kestrel2"}, False, id="kestrel2"),
    pytest.param({"journal_format": "kestrel3"}, False, id="kestrel3"),
    pytest.param({"journal_format": "kestrel2", "sync_journal": "always"}, True, id="kestrel2-commit-log"),
    pytest.param({"journal_format": "kestrel3", "sync_journal": "always"}, True, id="kestrel3-commit-log"),
]


class HeldWrites:
    """`disk.write_all` and `disk.writev_all` (which a journal's appends of 1 MB or more call) noting
    the thread each runs on and how many bytes; the large item's write off the loop thread waits
    for `release`, and fails with `error` if one is set, once `part` bytes of it reached the file (a
    disk filling up). Other writes go through: the commit log lays its next segment down on a thread
    too, in writes of at most 1 MB, and holding one of those was taken for the item's write. On the
    loop thread nothing waits (the test would hang)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.loop_thread = threading.get_ident()
        self.threads: list[tuple[bool, int]] = []  # (on the loop thread, bytes) per write
        self.started = threading.Event()
        self.release = threading.Event()
        self.error: OSError | None = None
        self.part = 0
        write_all, writev_all = disk.write_all, disk.writev_all

        def held(fn: Callable[..., Any], size: Callable[[Any], int]) -> Callable[..., Any]:
            def write(fd: int, data: Any) -> Any:
                on_loop, count = threading.get_ident() == self.loop_thread, size(data)
                self.threads.append((on_loop, count))
                if not on_loop and count >= len(LARGE):
                    self.started.set()
                    self.release.wait(60)
                    if self.error is not None:
                        os.write(fd, (data if isinstance(data, bytes) else b"".join(data))[:self.part])
                        raise self.error
                return fn(fd, data)
            return write

        monkeypatch.setattr(disk, "write_all", held(write_all, len))
        monkeypatch.setattr(disk, "writev_all", held(writev_all, lambda parts: sum(map(len, parts))))

    def wait_started(self, put: gevent.Greenlet) -> None:
        """Let the loop run until the large write is under way on its thread (or `put` ended)."""
        while not self.started.is_set() and not put.ready():
            gevent.sleep(0.001)

    @property
    def large(self) -> list[bool]:
        """For each write of the large item: whether it ran on the loop thread."""
        return [on_loop for on_loop, size in self.threads if size >= len(LARGE)]


@pytest.fixture
def writes(monkeypatch: pytest.MonkeyPatch) -> Iterator[HeldWrites]:
    held = HeldWrites(monkeypatch)
    yield held
    held.release.set()


def collection(path: Path, settings: dict[str, str], commit_log: bool) -> QueueCollection:
    """A collection on `path`, loaded once; a refused queue raises its CorruptJournalError."""
    return load_strictly(QueueCollection(str(path), QueueConfigs(settings), clock=FakeClock(T0),
                                         commit_log=commit_log))


@pytest.mark.parametrize(("settings", "commit_log"), SETTINGS)
def test_a_large_put_is_written_off_the_loop_and_its_queue_waits_its_turn(
        tmp_path: Path, writes: HeldWrites, settings: dict[str, str], commit_log: bool) -> None:
    coll = collection(tmp_path, settings, commit_log)
    coll.queue("q")  # (a new Kestrel 3 queue's checkpoint and manifest are written off the loop)
    made = len(writes.threads)
    under = b"u" * (LARGE_APPEND - 1000)  # Kestrel 2 writes it where it is, as the large one
    coll.put("q", [under])
    assert coll.remove("q", 1)[0].data == under
    assert all(on_loop for on_loop, _ in writes.threads[made:])  # appends under 1 MB stay on the loop
    put = gevent.spawn(partial(coll.put, "q", [LARGE]))
    writes.wait_started(put)
    assert writes.large == [False], "the large item was written on the loop thread"
    # The loop serves other queues meanwhile; a get of this queue waits until the item is written.
    get = gevent.spawn(partial(coll.remove, "q", 1))
    assert coll.put("other", [b"meanwhile"]) == 1
    gevent.sleep(0)
    assert not put.ready() and not get.ready()
    writes.release.set()
    assert put.get(timeout=60) == 1
    assert [item.data for item in get.get(timeout=60)] == [LARGE]
    coll.put("q", [b"after"])
    coll.close()
    again = collection(tmp_path, settings, commit_log)
    assert drain(again, "q") == [b"after"]  # the journal has the put, then the get, then the next put
    assert drain(again, "other") == [b"meanwhile"]
    again.close()


@pytest.mark.parametrize(("settings", "commit_log"), SETTINGS)
def test_a_large_write_that_fails_leaves_the_journal_as_it_was(
        tmp_path: Path, writes: HeldWrites, settings: dict[str, str], commit_log: bool) -> None:
    coll = collection(tmp_path, settings, commit_log)
    coll.put("q", [b"before"])
    writes.error = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    put = gevent.spawn(partial(coll.put, "q", [LARGE]))
    writes.wait_started(put)
    get = gevent.spawn(partial(coll.remove, "q", 2))
    writes.release.set()
    with pytest.raises(JournalWriteError, match="disk is full"):
        put.get(timeout=60)
    assert writes.large == [False]
    get.join(timeout=60)
    # The get ran after the failed put was undone: at most the item from before, never the large one.
    assert get.successful() and [item.data for item in get.value] == [b"before"]
    coll.close()
    again = collection(tmp_path, settings, commit_log)
    assert drain(again, "q") == []
    again.close()


def test_a_checkpoint_deletes_the_segments_of_large_items_off_the_loop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Deleting a segment that held large items frees its pages, tens of milliseconds: a thread's."""
    coll = collection(tmp_path, {"sync_journal": "always"}, True)
    coll.put("q", [LARGE])
    loop_thread, unlink = threading.get_ident(), os.unlink
    deleted: list[tuple[str, bool]] = []

    def noted(path: str, *args: Any, **kwargs: Any) -> None:
        deleted.append((os.path.basename(os.path.dirname(path)), threading.get_ident() == loop_thread))
        unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", noted)
    assert coll.commit_log is not None
    coll.commit_log.checkpoint()
    monkeypatch.undo()
    assert ("commit-log", False) in deleted and ("commit-log", True) not in deleted
    coll.close()


@pytest.mark.parametrize(("settings", "commit_log"), SETTINGS)
@pytest.mark.parametrize("fails", [False, True], ids=["written", "failed-part-way"])
def test_a_caller_killed_during_a_large_write_leaves_the_journal_as_the_write_left_it(
        tmp_path: Path, writes: HeldWrites, monkeypatch: pytest.MonkeyPatch, settings: dict[str, str],
        commit_log: bool, fails: bool) -> None:
    """A put killed (a shutdown's time-out ends its connection) while its large item is written
    off the loop: the write's outcome is the change's, the kill comes after. Written whole, the
    item is counted where the journal ends (an unacknowledged item kept, as after a crash); failed
    part way, the part is cut off and the put undone. Raising the kill instead of the outcome left
    the journal's size behind the file, so that a later failed append cut back to it, through an
    acknowledged put (and Kestrel 3 gave the item's ids out again)."""
    coll = collection(tmp_path, settings, commit_log)
    coll.put("q", [b"before"])
    if fails:
        writes.error, writes.part = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), len(LARGE) // 2
    put = gevent.spawn(partial(coll.put, "q", [LARGE]))
    writes.wait_started(put)
    put.kill(block=False)
    gevent.sleep(0)
    assert not put.dead, "the killed put went on while its write still ran"
    writes.release.set()
    put.join(timeout=60)
    assert put.dead
    assert coll.put("q", [b"after"]) == 1  # acknowledged

    def fail_part_way(fd: int, data: bytes | memoryview) -> int:
        os.write(fd, data[:1])
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    write = disk.write
    monkeypatch.setattr(disk, "write", fail_part_way)
    with pytest.raises(JournalWriteError):
        coll.put("q", [b"refused"])  # cut back to where the journal's writer believes it ends
    monkeypatch.setattr(disk, "write", write)
    coll.close()
    again = collection(tmp_path, settings, commit_log)
    assert drain(again, "q") == ([b"before", b"after"] if fails else [b"before", LARGE, b"after"])
    again.close()


def test_a_journal_closed_while_its_large_append_is_written_off_the_loop_closes_its_descriptor_after(
        tmp_path: Path, writes: HeldWrites) -> None:
    """The descriptor a large append writes through on a thread is held (`JournalWriter.hold`), as
    an fsync's is: a close meanwhile closes it once the write ends. Closed under the write, the
    write failed with EBADF, or, had the number been taken by a file opened meanwhile, went there."""
    writer = JournalWriter(str(tmp_path / "q"), None)
    writer.gate = WriteGate(writer.runtime)
    writer.open()
    fd = writer.fd
    append = gevent.spawn(partial(writer.append, LARGE))
    writes.wait_started(append)
    writer.close(sync=False)
    os.fstat(fd)  # still open under the write
    writes.release.set()
    append.get(timeout=60)
    with pytest.raises(OSError) as closed:
        os.fstat(fd)
    assert closed.value.errno == errno.EBADF
    assert (tmp_path / "q").read_bytes() == LARGE


def test_a_change_that_goes_on_after_its_fsync_does_not_rotate_while_a_large_append_is_written(
        tmp_path: Path, writes: HeldWrites, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Kestrel 2 put waiting for its fsync finds the journal due for rotation as it goes on; while
    another put's append of 1 MB or more is still written off the loop, half made, it leaves the
    rotation to a later change: rotating then flushed that append's records a second time (the
    items doubled at the next start, the file refused there as grown past its manifest entry)."""
    configs = QueueConfigs({"sync_journal": "always", "max_memory_size": 2000})
    coll = load_strictly(QueueCollection(str(tmp_path), configs, runtime=ManualRuntime()))
    coll.put("q", [b"x" * 1500])  # the next change's commit finds the journal due
    real, syncing = os.fdatasync, threading.Event()

    def slow(fd: int) -> None:
        syncing.set()
        writes.started.wait(60)  # until the large append is being written
        real(fd)

    monkeypatch.setattr(os, "fdatasync", slow)
    waiting = gevent.spawn(partial(coll.put, "q", [b"a" * 600]))  # in its commit: goes on to rotate
    while not syncing.is_set():
        gevent.sleep(0.001)
    batch = [b"%07d" % i + b"." * 93 for i in range(LARGE_APPEND // 100 + 100)]  # one string of records
    large = gevent.spawn(partial(coll.put, "q", batch))
    writes.wait_started(large)
    assert waiting.get(timeout=STALL_S) == 1  # its fsync done, while the large append is held
    writes.release.set()
    assert large.get(timeout=60) == len(batch)
    monkeypatch.undo()
    coll.close()
    again = load_strictly(QueueCollection(str(tmp_path), configs, runtime=ManualRuntime()))
    assert drain(again, "q") == [b"x" * 1500, b"a" * 600, *batch]
    again.close()


def kestrel3_get_waiting_for_its_fsync(
        path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[QueueCollection, gevent.Greenlet, threading.Event]:
    """A Kestrel 3 queue under `always` holding `first`, an item expired by now and `second`, and a
    get of it in progress: `first` taken, its id written, its fsync held until the event is set."""
    clock = FakeClock(T0)
    configs = QueueConfigs({"journal_format": "kestrel3", "sync_journal": "always"})
    coll = load_strictly(QueueCollection(str(path), configs, runtime=ManualRuntime(clock=clock), clock=clock))
    coll.put("q", [b"first"])
    coll.put("q", [b"expired"], expiry_ms=T0 + 10)  # the next put's admission takes it from the head
    coll.put("q", [b"second"], expiry_ms=T0 + 10_000)
    clock.advance(100)
    real, syncing, synced = os.fdatasync, threading.Event(), threading.Event()

    def slow(fd: int) -> None:
        syncing.set()
        synced.wait(60)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", slow)
    get = gevent.spawn(partial(coll.remove, "q"))
    while not syncing.is_set():
        gevent.sleep(0.001)
    return coll, get, synced


@pytest.mark.parametrize("fails", [False, True], ids=["written", "failed"])
def test_a_kestrel3_change_that_goes_on_after_its_fsync_while_a_large_append_is_written_serves_each_item_once(
        tmp_path: Path, writes: HeldWrites, monkeypatch: pytest.MonkeyPatch, fails: bool) -> None:
    """The get goes on after its fsync while a put of the same reader is half made, its append of
    1 MB written off the loop and the expired head it took noted. The get's end drops what the
    reader noted for an undo, the put's note too: nothing is lost by it, as what a put takes from
    the head before its append left by itself and is never undone (`_settle_later`), written or
    not. Each item is served once."""
    coll, get, synced = kestrel3_get_waiting_for_its_fsync(tmp_path, monkeypatch)
    put = gevent.spawn(partial(coll.put, "q", [LARGE]))
    writes.wait_started(put)
    assert writes.large == [False]
    synced.set()
    assert [item.data for item in get.get(timeout=60)] == [b"first"]  # gone on, the put still half made
    if fails:
        writes.error = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    writes.release.set()
    if fails:
        with pytest.raises(JournalWriteError):
            put.get(timeout=60)
    else:
        assert put.get(timeout=60) == 1
    monkeypatch.undo()
    assert drain(coll, "q") == [b"second", *([] if fails else [LARGE])]
    assert coll.queue("q").expired_items == 1
    coll.close()


@pytest.mark.parametrize("large", [True, False], ids=["large-append", "small-append"])
def test_a_kestrel3_change_whose_write_fails_undoes_nothing_of_another_waiting_for_its_fsync(
        tmp_path: Path, writes: HeldWrites, monkeypatch: pytest.MonkeyPatch, large: bool) -> None:
    """A put of the same reader fails its write (the disk full) while the get waits for its fsync:
    the put is undone, and only the put. Undoing what the get noted too put `first` back at the
    head while the get handed it out, its id on disk: served twice."""
    coll, get, synced = kestrel3_get_waiting_for_its_fsync(tmp_path, monkeypatch)
    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    if large:
        writes.error = full
        writes.release.set()
    else:
        def refused(fd: int, data: bytes) -> int:
            raise full
        monkeypatch.setattr(disk, "write", refused)
    with pytest.raises(JournalWriteError):
        coll.put("q", [LARGE if large else b"small"])
    assert not get.ready()
    synced.set()
    assert [item.data for item in get.get(timeout=60)] == [b"first"]
    monkeypatch.undo()
    assert drain(coll, "q") == [b"second"]
    coll.close()


def test_a_kestrel3_get_whose_fsync_fails_takes_its_item_back_to_the_head(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a change noted for its undo is its own while it waits for its fsync, and comes back
    for the undo when that fsync fails: the item it took is at the head again, none lost."""
    configs = QueueConfigs({"journal_format": "kestrel3", "sync_journal": "always"})
    coll = load_strictly(QueueCollection(str(tmp_path), configs, runtime=ManualRuntime()))
    coll.put("q", [b"first", b"second"])

    def failing(fd: int) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, "fdatasync", failing)
    with pytest.raises(JournalWriteError):
        coll.remove("q")
    monkeypatch.undo()
    assert drain(coll, "q") == [b"first", b"second"]
    coll.close()
