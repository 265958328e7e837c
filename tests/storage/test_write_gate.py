"""Large appends written off the event loop (src/kestrel/storage/write_gate.py): the write runs on
another thread while the loop serves other queues, the changes of its own journal wait their turn,
and a write that fails leaves the journal as it was; so do they while a change hands items to
another queue. Observed through the threads the system calls run on and the greenlets that are
done, never through timing."""

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
from tests.support.slow_disk import held_fdatasyncs, until_begun

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
        until_begun(self.started, put)

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
    syncing, synced = held_fdatasyncs(monkeypatch)
    get = gevent.spawn(partial(coll.remove, "q"))
    until_begun(syncing)
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


# A change that hands items to another queue (an expired item to `expire_to_queue`, a poison item to
# its `error_queue`) pauses half made while that queue's put waits: the journal's other changes
# wait at its gate meanwhile (`WriteGate.hand_over`), and what it noted is its own.

FORMATS = pytest.mark.parametrize("journal_format", ["kestrel2", "kestrel3"])


def file_of(fd: int) -> str:
    """The name of the file open at `fd` ("" once closed)."""
    try:
        return os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        return ""


class HeldSyncs:
    """`os.fdatasync` of the files of queue `name` (`name`, `name.<n>`, `name.read.`) held on their
    thread from `hold(name)` until `release(name)`, then failing with the error given there, if
    one is; other fsyncs go through."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.held: dict[str, tuple[threading.Event, threading.Event]] = {}
        self.errors: dict[str, OSError] = {}
        real = os.fdatasync

        def sync(fd: int) -> None:
            name = file_of(fd).partition(".")[0]
            events = self.held.get(name)
            if events is not None:
                events[0].set()
                events[1].wait(60)
                if name in self.errors:
                    raise self.errors.pop(name)
            real(fd)

        monkeypatch.setattr(os, "fdatasync", sync)

    def hold(self, name: str) -> None:
        self.held[name] = (threading.Event(), threading.Event())

    def wait_held(self, name: str, task: gevent.Greenlet) -> None:
        """Let the loop run until an fsync of `name`'s files is held (or `task` ended)."""
        until_begun(self.held[name][0], task)
        assert not task.ready(), f"{task} ended without waiting for an fsync of {name!r}"

    def release(self, name: str, error: OSError | None = None) -> None:
        if error is not None:
            self.errors[name] = error
        self.held.pop(name)[1].set()


@pytest.fixture
def syncs(monkeypatch: pytest.MonkeyPatch) -> Iterator[HeldSyncs]:
    held = HeldSyncs(monkeypatch)
    yield held
    for name in list(held.held):
        held.release(name)


def refuse_writes(monkeypatch: pytest.MonkeyPatch, refused: Callable[[int], bool]) -> None:
    """`disk.write` (a journal's appends under 1 MB) fails with ENOSPC where `refused(fd)`."""
    write = disk.write

    def full(fd: int, data: bytes | memoryview) -> int:
        if refused(fd):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return write(fd, data)

    monkeypatch.setattr(disk, "write", full)


def expiring(path: Path, journal_format: str, q: dict[str, str] | None = None) -> tuple[QueueCollection, FakeClock]:
    """Queue `q` holding `h`, expired by now, then `x` and `y`, its expired items moved to `dead`,
    whose changes wait for their fsync (`always`); the clock, for a put before `h` expires."""
    clock = FakeClock(T0)
    configs = QueueConfigs({"journal_format": journal_format},
                           {"q": {"expire_to_queue": "dead", **(q or {})}, "dead": {"sync_journal": "always"}})
    coll = load_strictly(QueueCollection(str(path), configs, runtime=ManualRuntime(clock=clock), clock=clock))
    coll.queue("dead")
    coll.put("q", [b"h"], T0 + 10)
    coll.put("q", [b"x", b"y"])
    return coll, clock


def dead_fills(monkeypatch: pytest.MonkeyPatch, writes: HeldWrites, large: gevent.Greenlet,
               get: gevent.Greenlet) -> None:
    """Queue `dead`'s disk fills while its `large` put is written and a `get` of `q` waits to hand it
    an expired item: both fail, the get naming `dead`."""
    refuse_writes(monkeypatch, lambda fd: file_of(fd).startswith("dead"))
    writes.error = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    writes.release.set()
    with pytest.raises(JournalWriteError):
        large.get(timeout=60)
    with pytest.raises(JournalWriteError, match="'dead'"):
        get.get(timeout=60)


def settled(task: gevent.Greenlet) -> list[bytes]:
    """What a get returned (nothing if it failed with JournalWriteError)."""
    try:
        return [item.data for item in task.get(timeout=60)]
    except JournalWriteError:
        return []


@FORMATS
def test_a_get_handing_an_expired_item_over_keeps_it_when_the_expiry_queue_then_refuses_it(
        tmp_path: Path, writes: HeldWrites, monkeypatch: pytest.MonkeyPatch, journal_format: str) -> None:
    """`dead`'s put of `h` waits its turn behind a large append of `dead`, and then `dead`'s disk is
    full: the get is undone, `h` at the head again. Meanwhile another get of `q` waits its turn:
    going on, it took `x` and wrote that `h` had left (its REMOVE; its id consumed), and the undo
    lost `h`."""
    coll, clock = expiring(tmp_path, journal_format)
    clock.advance(100)
    large = gevent.spawn(partial(coll.put, "dead", [LARGE]))
    writes.wait_started(large)
    get = gevent.spawn(partial(coll.remove, "q"))
    gevent.sleep(0.01)
    other = gevent.spawn(partial(coll.remove, "q"))
    gevent.sleep(0.01)
    went_on = other.ready()
    dead_fills(monkeypatch, writes, large, get)
    took = settled(other)  # nothing: it finds `h` at the head again, and `dead` refusing it
    monkeypatch.undo()
    assert (took, drain(coll, "q"), drain(coll, "dead")) == ([], [b"x", b"y"], [b"h"])
    assert not went_on
    coll.close()
    again = load_strictly(QueueCollection(str(tmp_path), coll.configs, runtime=ManualRuntime()))
    assert drain(again, "q") == drain(again, "dead") == []
    again.close()


@FORMATS
def test_an_expired_item_whose_expiry_queues_fsync_fails_is_kept_in_both_queues_never_lost(
        tmp_path: Path, syncs: HeldSyncs, journal_format: str) -> None:
    """`dead`'s put of `h` is written and its fsync fails: the put keeps its records (their outcome
    unknown, as any change whose fsync failed) and the get leaves `q` as it was. `h` is in both
    queues, live and after a restart: a copy, where taking it from `q` could lose it with the pages
    the failed fsync may never have written."""
    def kept(coll: QueueCollection) -> tuple[int, int]:  # (a peek would move `h` again)
        return coll.queue("q").length, coll.queue("dead").length

    coll, clock = expiring(tmp_path, journal_format)
    clock.advance(100)
    syncs.hold("dead")
    get = gevent.spawn(partial(coll.remove, "q"))
    syncs.wait_held("dead", get)
    syncs.release("dead", OSError(errno.EIO, os.strerror(errno.EIO)))
    with pytest.raises(JournalWriteError, match="'dead'.*Input/output error"):
        get.get(timeout=60)
    assert kept(coll) == (3, 1)
    coll.close()
    again = load_strictly(QueueCollection(str(tmp_path), coll.configs, runtime=ManualRuntime(clock=clock),
                                          clock=clock))
    assert kept(again) == (3, 1)
    assert drain(again, "dead") == [b"h"] and drain(again, "q") == [b"x", b"y"] and drain(again, "dead") == [b"h"]
    again.close()


@FORMATS
def test_a_change_whose_write_fails_while_a_get_hands_an_expired_item_over_undoes_only_itself(
        tmp_path: Path, syncs: HeldSyncs, monkeypatch: pytest.MonkeyPatch, journal_format: str) -> None:
    """A put of `q` comes while the get moving `h` waits for `dead`'s fsync, and its write fails
    (the disk full): it waits its turn, and is undone alone. Going on, it undid the get with itself
    (Kestrel 2: memory replayed from the journal; Kestrel 3: the get's notes undone), `h` back at
    the head while `dead` took it, and the get moved `h` again: served twice."""
    coll, clock = expiring(tmp_path, journal_format)
    clock.advance(100)
    syncs.hold("dead")
    get = gevent.spawn(partial(coll.remove, "q"))
    syncs.wait_held("dead", get)
    put = gevent.spawn(partial(coll.put, "q", [b"z"]))
    refuse_writes(monkeypatch, lambda fd: gevent.getcurrent() is put)
    gevent.sleep(0.01)
    went_on = put.ready()
    syncs.release("dead")
    with pytest.raises(JournalWriteError, match="disk is full"):
        put.get(timeout=60)
    assert (settled(get), drain(coll, "dead"), drain(coll, "q")) == ([b"x"], [b"h"], [b"y"])
    assert not went_on
    coll.close()


@FORMATS
def test_a_change_whose_fsync_fails_while_a_get_hands_an_expired_item_over_undoes_only_itself(
        tmp_path: Path, syncs: HeldSyncs, journal_format: str) -> None:
    """A put of `q` (`always`) waiting for its fsync when the get starts moving `h` to `dead`: its
    fsync fails while the get waits for `dead`'s. Kestrel 2 replays its journal once the get has
    written its records (`_rebuild` waits its turn); Kestrel 3 undoes the put alone, the get's
    notes its own meanwhile. Undone with the put, the get moved `h` a second time."""
    coll, clock = expiring(tmp_path, journal_format, {"sync_journal": "always"})
    syncs.hold("q")
    put = gevent.spawn(partial(coll.put, "q", [b"z"]))
    syncs.wait_held("q", put)
    clock.advance(100)  # `h` expired: the get moves it
    syncs.hold("dead")
    get = gevent.spawn(partial(coll.remove, "q"))
    syncs.wait_held("dead", get)
    syncs.release("q", OSError(errno.EIO, os.strerror(errno.EIO)))
    gevent.sleep(0.01)
    syncs.release("dead")
    with pytest.raises(JournalWriteError):
        put.get(timeout=60)
    assert (settled(get), drain(coll, "dead")) == ([b"x"], [b"h"])
    assert drain(coll, "q") == [b"y", b"z"]  # (written, and so kept: its fsync's outcome unknown)
    coll.close()


@FORMATS
def test_an_abort_handing_a_poison_item_over_keeps_the_journal_in_the_order_of_memory(
        tmp_path: Path, syncs: HeldSyncs, journal_format: str) -> None:
    """An abort returns `b` to the head, then hands poison `a` to `dead` and waits for its fsync,
    its records (the return of `b`) not yet written. A get of `q` waits its turn: going on, it took
    `b` from memory and wrote a Kestrel 2 REMOVE, which the journal applied to the head it held,
    `c`; the next start served `b` again and lost `c`."""
    configs = QueueConfigs({"journal_format": journal_format},
                           {"q": {"max_errors": 2, "error_queue": "dead"}, "dead": {"sync_journal": "always"}})
    coll = load_strictly(QueueCollection(str(tmp_path), configs, runtime=ManualRuntime()))
    coll.queue("dead")
    coll.put("q", [b"a", b"b", b"c"])
    first = coll.remove("q", transaction=True)[0]
    coll.unremove("q", [first.xid])  # one error: the next abort makes `a` poison
    a, b = coll.remove("q", 2, transaction=True)
    assert (a.data, b.data) == (b"a", b"b")
    syncs.hold("dead")
    abort = gevent.spawn(partial(coll.unremove, "q", [b.xid, a.xid]))
    syncs.wait_held("dead", abort)
    get = gevent.spawn(partial(coll.remove, "q"))
    gevent.sleep(0.01)
    went_on = get.ready()
    syncs.release("dead")
    assert abort.get(timeout=60) == 2
    assert settled(get) == [b"b"]
    coll.close()
    again = load_strictly(QueueCollection(str(tmp_path), configs, runtime=ManualRuntime()))
    assert (drain(again, "q"), drain(again, "dead")) == ([b"c"], [b"a"])
    assert not went_on
    again.close()


@FORMATS
def test_an_expiry_queue_handing_items_back_passes_the_gate_of_the_change_that_waits_for_it(
        tmp_path: Path, journal_format: str) -> None:
    """`q` and `dead` move their expired items to each other: `dead`'s put of `h`, inside the get
    that holds `q`'s gate, moves `dead`'s own expired item to `q` through that gate (its own task's),
    rather than wait for itself for good."""
    coll, clock = expiring(tmp_path, journal_format)
    coll.reload(QueueConfigs({"journal_format": journal_format},
                             {"q": {"expire_to_queue": "dead"}, "dead": {"expire_to_queue": "q"}}), {})
    coll.put("dead", [b"e"], T0 + 10)
    clock.advance(100)
    get = gevent.spawn(partial(coll.remove, "q"))
    assert [item.data for item in get.get(timeout=STALL_S)] == [b"x"]
    assert (drain(coll, "q"), drain(coll, "dead")) == ([b"y", b"e"], [b"h"])
    coll.close()


@FORMATS
def test_two_queues_expiring_to_each_other_whose_hand_over_fails_its_fsync_both_end_and_lose_nothing(
        tmp_path: Path, syncs: HeldSyncs, journal_format: str) -> None:
    """A get of `q` holds its gate while its put of `h` to `dead` waits for `dead`'s fsync; a get of
    `dead` then moves `e` to `q` and waits at `q`'s gate, holding `dead`'s. `dead`'s next fsync
    fails (the put's, or the get of `dead`'s once it has gone on): both gets end, neither waiting
    for the other (a Kestrel 2 replay waits its turn at its queue's gate, where its own task holds
    it); what one took is in neither queue, and every item not taken is in one or both."""
    coll, clock = expiring(tmp_path, journal_format)
    coll.reload(QueueConfigs({"journal_format": journal_format},
                             {"q": {"expire_to_queue": "dead", "sync_journal": "always"},
                              "dead": {"expire_to_queue": "q", "sync_journal": "always"}}), {})
    coll.put("dead", [b"e"], T0 + 10)
    coll.put("dead", [b"f"])
    clock.advance(100)
    syncs.hold("dead")
    get_q = gevent.spawn(partial(coll.remove, "q"))
    syncs.wait_held("dead", get_q)
    get_dead = gevent.spawn(partial(coll.remove, "dead"))
    gevent.sleep(0.01)
    assert not get_dead.ready()  # at `q`'s gate
    syncs.release("dead", OSError(errno.EIO, os.strerror(errno.EIO)))
    gevent.joinall([get_q, get_dead], timeout=STALL_S)
    assert get_q.ready() and get_dead.ready()
    taken = settled(get_q) + settled(get_dead)  # (nothing from a get that failed)
    left = drain(coll, "q") + drain(coll, "dead")
    assert not set(taken) & set(left) and sorted(set(taken + left)) == [b"e", b"f", b"h", b"x", b"y"]
    coll.close()


def test_a_kestrel2_change_going_on_after_its_fsync_packs_nothing_while_a_get_hands_an_item_over(
        tmp_path: Path, writes: HeldWrites, syncs: HeldSyncs, monkeypatch: pytest.MonkeyPatch) -> None:
    """A get of `q`'s backlog waits for its fsync, its refill having caught the cursor up: its end
    packs what the backlog left behind. It goes on while another get moves `h` to `dead` (waiting
    its turn behind a large append of `dead`, whose disk is then full), and leaves that pack to a
    later change: its rotation wrote the other get's pending REMOVE of `h`, its pack held `h` no
    more, and the get's undo, a replay, lost `h`."""
    coll, clock = expiring(tmp_path, "kestrel2", {"max_memory_size": "1000", "sync_journal": "always"})
    backlog = [b"%02d" % n + b"." * 298 for n in range(10)]
    coll.flush("q")
    coll.put("q", backlog)  # read-behind, a rotated file
    coll.put("q", [b"h"], T0 + 10)
    coll.put("q", [b"x"])
    syncs.hold("q")
    drained = gevent.spawn(partial(coll.remove, "q", len(backlog)))
    syncs.wait_held("q", drained)
    clock.advance(100)
    large = gevent.spawn(partial(coll.put, "dead", [LARGE]))
    writes.wait_started(large)
    get = gevent.spawn(partial(coll.remove, "q"))
    gevent.sleep(0.01)
    syncs.release("q")
    assert [item.data for item in drained.get(timeout=60)] == backlog
    dead_fills(monkeypatch, writes, large, get)
    monkeypatch.undo()
    assert (drain(coll, "q"), drain(coll, "dead")) == ([b"x"], [b"h"])
    coll.close()
