"""Sections documented never to yield to other greenlets, held to it: each runs inside
`never_switches` while every log line pauses for a turn of the loop (as it does in the server when
a thread holds the logger's lock), so a log line, a wait or a lock inside one fails the test."""

from __future__ import annotations

import errno
import os
from functools import partial
from pathlib import Path
from typing import Any

import gevent
import pytest
from structlog.testing import capture_logs

from kestrel.storage import JournalWriteError, QueueCollection, acknowledgements
from kestrel.storage.acknowledgements import Acknowledgements
from kestrel.storage.clock import FakeClock
from kestrel.storage.commit_log import CommitLog
from kestrel.storage.fsync.group_commit import GroupCommit
from kestrel.storage.journal_file import JournalWriter
from kestrel.storage.kestrel2 import packer
from kestrel.storage.kestrel2.journal import QueueJournal
from kestrel.storage.kestrel3 import files as k3files
from kestrel.storage.kestrel3.journal import ReaderFile
from kestrel.storage.kestrel3.queue import Kestrel3Queue
from kestrel.storage.runtime import GeventRuntime
from tests.end_to_end.test_disk_full import FailingDisk
from tests.end_to_end.test_disk_full import disk as disk  # the fixture
from tests.support.queues import drain, load_strictly, one, open_collection
from tests.support.switches import SwitchedGreenlets, hold_to_never_switching, logs_that_pause, never_switches

# Every section the engine documents as never yielding.
SECTIONS: list[tuple[type, str]] = [
    (k3files.WriterJournal, "append"), (k3files.WriterJournal, "rotate"), (ReaderFile, "save"),
    (ReaderFile, "replace"), (JournalWriter, "append"), (QueueJournal, "flush"), (CommitLog, "add"),
    (GroupCommit, "join"),
]

T0 = 1_700_000_000_000


def collection(path: Path, **queue: Any) -> QueueCollection:
    return open_collection(path, queue, clock=FakeClock(T0))


def test_the_helper_sees_a_switch_and_where_it_happened() -> None:
    with pytest.raises(SwitchedGreenlets, match="sleep"), never_switches("a sleep"):
        gevent.sleep(0)
    with never_switches("arithmetic"):
        assert sum(range(10)) == 45


def test_the_helper_sees_a_log_line_that_pauses() -> None:
    import structlog

    with logs_that_pause(), pytest.raises(SwitchedGreenlets), never_switches("a log line"):
        structlog.get_logger("test").info("a line")


# ---------------------------------------------------------------------------------------------
# Kestrel 3: the writer journal's append, and two puts at a rotation


def test_two_kestrel3_puts_at_a_rotation_take_distinct_ids_and_every_item_comes_back(tmp_path: Path) -> None:
    """The first put rotates the writer journal; while its rotation's log line waits, the second
    put runs. Each must still get ids of its own, written in order, and a restart read them all."""
    coll = collection(tmp_path, journal_format="kestrel3", default_journal_size=200)
    coll.put("q", [b"first"])
    batches = [[b"a%02d" % i + b"." * 40 for i in range(6)], [b"b%02d" % i + b"." * 40 for i in range(6)]]
    with logs_that_pause():
        puts = [gevent.spawn(partial(coll.put, "q", batch)) for batch in batches]
        gevent.joinall(puts, raise_error=True)
    assert [p.value for p in puts] == [6, 6]
    q = coll.queue("q")
    assert isinstance(q, Kestrel3Queue)
    ids = [item.xid for item in q._mem]
    assert len(set(ids)) == len(ids) == 13
    coll.close()
    again = load_strictly(QueueCollection(str(tmp_path), coll.configs, clock=FakeClock(T0)))
    got = []
    while (item := one(again.remove("q"))) is not None:
        got.append(item.data)
    assert sorted(got) == sorted([b"first", *batches[0], *batches[1]])
    assert got[0] == b"first" and got[1:7] in (batches[0], batches[1])


def test_the_kestrel3_writer_journal_appends_across_rotations_without_yielding(tmp_path: Path) -> None:
    writer = k3files.WriterJournal(str(tmp_path), "q", 100, None, FakeClock(T0), runtime=GeventRuntime())
    with logs_that_pause():
        for i in range(10):
            with never_switches("WriterJournal.append"):
                records = writer.append([b"item-%d" % i + b"." * 40], T0)
            assert records[0].id == i + 1 == writer.tail_id
    assert len(writer.files) > 3
    writer.close()


# ---------------------------------------------------------------------------------------------
# Whole changes, where nothing waits for the disk (`sync_journal: never`): from start to end


@pytest.mark.parametrize("journal_format", ["kestrel2", "kestrel3"])
def test_changes_through_rotation_and_read_behind_never_yield(tmp_path: Path, journal_format: str) -> None:
    """Puts that start read-behind and rotate the journal, reads that end read-behind and let
    files go, aborts and confirms: each change is one stretch of the caller's greenlet."""
    coll = collection(tmp_path, journal_format=journal_format, max_memory_size=300, default_journal_size=400)
    q = coll.queue("q")
    items = [b"%03d" % i + b"." * 60 for i in range(40)]
    got = []
    with logs_that_pause():
        for i in range(0, 40, 2):
            with never_switches(f"put {i}"):
                assert coll.put("q", items[i:i + 2]) == 2
        assert q.in_read_behind
        for i in range(40):
            with never_switches(f"read {i}"):
                item = one(coll.remove("q", transaction=True))
            assert item is not None
            if i % 3 == 0:
                with never_switches(f"abort {i}"):
                    assert coll.unremove("q", [item.xid])
                with never_switches(f"read {i} again"):
                    item = one(coll.remove("q", transaction=True))
                assert item is not None
            with never_switches(f"confirm {i}"):
                assert coll.confirm("q", [item.xid])
            got.append(item.data)
        assert not q.in_read_behind
        gevent.sleep(0.1)  # the packs, and the lines logged meanwhile
    assert got == items



@pytest.mark.parametrize("journal_format", ["kestrel2", "kestrel3"])
def test_a_change_whose_write_fails_is_undone_without_yielding(tmp_path: Path, journal_format: str,
                                                              disk: FailingDisk) -> None:
    """The failed write is cut off the journal and memory brought back to what it holds before any
    other greenlet runs; what it logs comes after."""
    coll = collection(tmp_path, journal_format=journal_format)
    coll.put("q", [b"kept"])
    disk.full = True
    with logs_that_pause():
        with pytest.raises(JournalWriteError), never_switches("a put whose write fails"):
            coll.put("q", [b"refused"])
        with pytest.raises(JournalWriteError), never_switches("a read whose write fails"):
            coll.remove("q")
        gevent.sleep(0)
    disk.full = False
    assert drain(coll, "q") == [b"kept"]
    coll.close()


@pytest.mark.parametrize("journal_format", ["kestrel2", "kestrel3"])
def test_an_abort_that_drops_a_poison_item_does_not_yield(tmp_path: Path, journal_format: str) -> None:
    """The drop is said in the log after the abort's change (a reliable reader's abort is answered
    in the hub's callback, where a pause would end its connection)."""
    coll = collection(tmp_path, journal_format=journal_format, max_errors=1)
    coll.put("q", [b"poison", b"next"])
    [item] = coll.remove("q", transaction=True)
    with capture_logs() as logs, logs_that_pause():
        with never_switches("an abort that drops a poison item"):
            coll.unremove("q", [item.xid])
        with gevent.Timeout(10):
            while not any(line["event"] == "poison item dropped: no error_queue" for line in logs):
                gevent.sleep(0.001)
    assert drain(coll, "q") == [b"next"]
    coll.close()


def test_an_append_whose_failed_part_cannot_be_cut_off_does_not_yield(tmp_path: Path, disk: FailingDisk,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    writer = JournalWriter(str(tmp_path / "q"), None, GeventRuntime())
    writer.append(b"whole")
    disk.full = True
    monkeypatch.setattr(os, "ftruncate", lambda fd, size: (_ for _ in ()).throw(OSError(errno.EIO, "no")))
    with capture_logs() as logs, logs_that_pause():
        with pytest.raises(OSError), never_switches("a failed append"):
            writer.append(b"half of it")
        gevent.idle()
    assert writer.damaged
    assert [line["event"] for line in logs if line.get("file") == writer.path] == [
        "cannot cut a failed append off the journal"]
    with pytest.raises(OSError, match="restart to repair"):
        writer.append(b"more")


# ---------------------------------------------------------------------------------------------
# Whole changes where the sync policy waits for no fsync: the rule (`never_waits`) held to its word


def test_a_change_waits_for_no_fsync_under_never_a_periodic_sync_or_always_through_the_log_where_held(
        tmp_path: Path) -> None:
    """`always` waits for the disk inside the change unless its journal logs to the commit log and
    the caller holds its acknowledgements; `never` and a periodic sync wait for it nowhere."""
    held = Acknowledgements(lambda: None)
    for commit_log in (False, True):
        coll = open_collection(tmp_path / str(commit_log), {"sync_journal": "always"},
                               {"never": {"sync_journal": "never"}, "periodic": {"sync_journal": "10ms"},
                                "k3": {"journal_format": "kestrel3"}}, commit_log=commit_log)
        for name in ("always", "never", "periodic", "k3"):
            coll.put(name, [b"created"])
        token = acknowledgements.hold(held)
        try:
            waits_not = {(name, removing): coll.never_waits(name, removing)
                         for name in ("always", "k3", "never", "periodic") for removing in (False, True)}
        finally:
            acknowledgements.release(token)
        assert waits_not == {key: commit_log or key[0] in ("never", "periodic") for key in waits_not}
        assert not coll.never_waits("always") and not coll.never_waits("k3")  # held by nobody
        assert coll.never_waits("periodic") and coll.never_waits("never")
        coll.close()


@pytest.mark.parametrize("journal_format", ["kestrel2", "kestrel3"])
def test_a_change_that_may_read_items_back_from_disk_is_not_one_that_never_waits(
        tmp_path: Path, journal_format: str) -> None:
    """In read-behind, what the page cache does not hold is read back off the loop: a remove may
    wait, and so may a put that takes items from the head (one expired there, or old ones it
    discards to make room), any change before a Kestrel 3 cursor's file is open (opening reads its
    header) and any change of a Kestrel 2 queue (its undo of a failed write waits for the
    journal's packs, then refills); a Kestrel 3 put that takes none, its cursor ready, does not."""
    clock = FakeClock(T0)
    coll = open_collection(tmp_path, {"journal_format": journal_format, "max_memory_size": 300},
                           {"full": {"max_items": 10, "discard_old_when_full": True}}, clock=clock)
    items = [b"%03d" % i + b"." * 60 for i in range(10)]
    for name in ("q", "full"):
        assert coll.put(name, items, expiry_ms=T0 + 1000) == 10
        assert coll.get(name).in_read_behind  # type: ignore[union-attr]
    assert not coll.never_waits("q", removing=True) and not coll.never_waits("q")
    assert not coll.never_waits("full")  # full: its next put discards the head
    assert coll.put("q", [b"x"], expiry_ms=T0 + 1000) == 1  # made where it may wait: the cursor's file opens
    assert coll.never_waits("q") == (journal_format == "kestrel3")
    clock.advance(2000)
    assert not coll.never_waits("q")  # its next put drops the expired head first
    coll.close()


def at_once(coll: QueueCollection, name: str, removing: bool = False) -> None:
    """Return once the rule says a change of queue `name` never waits (`QueueCollection.never_waits`),
    as the server's hub waits for it before it answers a request at once: a Kestrel 2 rotation's
    new live journal is named meanwhile, its queue's changes waiting at its gate."""
    for _ in range(5000):
        if coll.never_waits(name, removing):
            return
        gevent.sleep(0.001)
    raise AssertionError(f"a change of {name!r} still waits")


@pytest.mark.parametrize(("journal_format", "sync"), [("kestrel2", "always"), ("kestrel3", "always"),
                                                      ("kestrel2", "10ms"), ("kestrel3", "10ms")])
def test_changes_through_the_commit_log_where_acknowledgements_are_held_never_yield(
        tmp_path: Path, journal_format: str, sync: str) -> None:
    """Puts and reads through rotations and the log's turns, each made where the rule says it never
    waits: one stretch of the caller's greenlet each; every item comes back after a restart."""
    settings = {"sync_journal": sync, "journal_format": journal_format, "default_journal_size": 400,
                "max_memory_size": 2000}
    coll = open_collection(tmp_path, settings, commit_log=True)
    coll.put("q", [b"created"])
    assert one(coll.remove("q")) is not None
    told: list[int] = []
    held = Acknowledgements(lambda: told.append(1))
    token = acknowledgements.hold(held)
    items = [b"%03d" % i + b"." * 60 for i in range(60)]
    got = []
    try:
        with logs_that_pause():
            for i in range(0, 60, 3):
                at_once(coll, "q")
                with never_switches(f"put {i}"):
                    assert coll.put("q", items[i:i + 3]) == 3
                for _ in range(2):
                    at_once(coll, "q", removing=True)
                    with never_switches(f"read after {i}"):
                        item = one(coll.remove("q"))
                    assert item is not None
                    got.append(item.data)
            gevent.sleep(0.1)  # the log's rounds, and the lines logged meanwhile
    finally:
        acknowledgements.release(token)
    # under `always` each change left its turn to the holder, which was told once they settled
    assert bool(told) == (held.last is not None) == (sync == "always")
    assert not held.pending and held.failed is None
    coll.close()
    again = open_collection(tmp_path, settings, commit_log=True)
    assert got + drain(again, "q") == items
    again.close()


# ---------------------------------------------------------------------------------------------
# Under load: puts and reads in many greenlets, fsyncs shared, the commit log on, packs in threads


@pytest.mark.pure_build
def test_no_section_documented_never_to_yield_yields_under_load(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    failures = hold_to_never_switching(monkeypatch, SECTIONS)
    packs: list[str] = []
    write_pack = packer.write_pack

    def counted(request: packer.PackRequest, *args: Any) -> Any:
        packs.append(request.name)
        return write_pack(request, *args)

    monkeypatch.setattr(packer, "write_pack", counted)
    queues: dict[str, dict[str, Any]] = {"k3": {"journal_format": "kestrel3", "default_journal_size": 1500},
                                         "k2": {"default_journal_size": 1500, "max_memory_size": 600}}
    coll = open_collection(tmp_path, {"sync_journal": "always"}, queues, commit_log=True)
    coll.queue("k3+audit")
    sent: dict[str, list[bytes]] = {"k3": [], "k2": []}
    taken: dict[str, list[bytes]] = {"k3": [], "k2": []}

    def produce(name: str, who: int) -> None:
        for n in range(25):
            batch = [b"%s-%d-%02d-%d" % (name.encode(), who, n, i) + b"." * 30 for i in range(4)]
            assert coll.put(name, batch) == 4
            sent[name].extend(batch)

    def consume(name: str) -> None:
        while len(taken[name]) < 200:
            item = one(coll.remove(name, transaction=True, timeout=1.0))
            assert item is not None
            assert coll.confirm(name, [item.xid])
            taken[name].append(item.data)

    with logs_that_pause():
        tasks = [gevent.spawn(partial(produce, name, who)) for who in range(2) for name in ("k3", "k2")]
        tasks += [gevent.spawn(partial(consume, "k3")), gevent.spawn(partial(consume, "k2"))]
        gevent.joinall(tasks, raise_error=True)
        coll.close()
    assert failures == []
    assert packs  # Kestrel 2 packed in a thread meanwhile
    for name in ("k3", "k2"):
        assert sorted(taken[name]) == sorted(sent[name]) and len(set(taken[name])) == 200
    again = load_strictly(QueueCollection(str(tmp_path), coll.configs))
    assert len(drain(again, "k3+audit")) == 200 and drain(again, "k3") == drain(again, "k2") == []
    again.close()
