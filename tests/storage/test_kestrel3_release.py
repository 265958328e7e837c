"""The release of Kestrel 3 writer files every reader has passed: deleted off the event loop, one
release at a time per journal, after the heads that passed them are on disk, marked in the manifest
before they go; a close or a delete of the queue waits for a release under way."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import gevent
import pytest
from gevent import monkey

from kestrel.storage import QueueCollection, manifest
from kestrel.storage.clock import FakeClock
from kestrel.storage.kestrel3.journal import DELETING
from kestrel.storage.kestrel3.queue import Kestrel3Queue
from tests.support.queues import drain, one, open_collection

thread_id: Callable[[], int] = monkey.get_original("_thread", "get_ident")
OsEvent: Any = monkey.get_original("threading", "Event")


def collection(path: Path, **settings: Any) -> QueueCollection:
    return open_collection(path, queues={"q": {"journal_format": "kestrel3", "default_journal_size": 300,
                                               **settings}}, clock=FakeClock())


def k3(coll: QueueCollection) -> Kestrel3Queue:
    q = coll.queue("q")
    assert isinstance(q, Kestrel3Queue)
    return q


def writer_files(path: Path) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.startswith("q.") and n[2:].isdigit())


def fill(coll: QueueCollection, items: int = 40) -> None:
    for i in range(items):
        coll.put("q", [b"item-%02d" % i + b"x" * 40])  # about 5 items a file


class Calls:
    """`os.fsync` and `os.unlink` as the engine calls them, each with the thread it ran on; an unlink
    of one of the test's writer files off the loop may be held (`hold`) until `go` is set."""

    def __init__(self, path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.path = path
        self.loop = thread_id()
        self.fsyncs: list[int] = []  # thread of each
        self.unlinks: list[tuple[str, int, manifest.Entry | None]] = []  # name, thread, its manifest entry
        self.hold = False
        self.held = OsEvent()  # an unlink of a writer file is being held
        self.go = OsEvent()
        fsync, unlink = os.fsync, os.unlink

        def recorded_fsync(fd: int) -> None:
            self.fsyncs.append(thread_id())
            fsync(fd)

        def recorded_unlink(path: str, *args: Any, **kwargs: Any) -> None:
            name = os.path.basename(path)
            # This test's writer files alone: an earlier test's queue "q", whose files have the same
            # names (the same clock), may still be deleting its own on the pool.
            if name.startswith("q.") and name[2:].isdigit() and os.path.dirname(path) == str(self.path):
                record = manifest.read(str(self.path), "q")
                self.unlinks.append((name, thread_id(), record.files.get(name) if record else None))
                if self.hold and thread_id() != self.loop:
                    self.held.set()
                    self.go.wait(30)
            unlink(path, *args, **kwargs)

        monkeypatch.setattr(os, "fsync", recorded_fsync)
        monkeypatch.setattr(os, "unlink", recorded_unlink)

    def on_loop(self) -> tuple[int, int]:
        """(fsyncs, unlinks) made on the event loop's thread."""
        return (sum(1 for t in self.fsyncs if t == self.loop),
                sum(1 for _, t, _ in self.unlinks if t == self.loop))

    def wait_held(self) -> None:
        """Let the loop run until an unlink is held off it (failing after some 10,000 turns)."""
        for _ in range(10_000):
            if self.held.is_set():
                return
            gevent.sleep(0.001)
        raise AssertionError("no unlink of a writer file was made off the loop")


@pytest.fixture
def calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Calls]:
    calls = Calls(tmp_path, monkeypatch)
    yield calls
    calls.go.set()


def test_gets_passing_writer_files_make_no_fsync_or_unlink_on_the_loop(tmp_path: Path, calls: Calls) -> None:
    coll = collection(tmp_path)
    fill(coll)
    k3(coll).wait_for_packing()  # the rotated files sealed
    files = writer_files(tmp_path)
    assert len(files) > 4
    calls.fsyncs.clear()
    for _ in range(40):
        assert one(coll.remove("q")) is not None
    assert calls.on_loop() == (0, 0)
    k3(coll).wait_for_packing()
    assert writer_files(tmp_path) == files[-1:]  # deleted all the same, off the loop
    assert sorted(name for name, _, _ in calls.unlinks) == files[:-1]
    assert calls.on_loop() == (0, 0) and calls.fsyncs  # the folder and the manifest fsynced on the pool
    # Each was marked as being deleted in the manifest on disk before it went.
    assert all(entry is not None and entry.size == DELETING for _, _, entry in calls.unlinks)
    coll.close()
    record = manifest.read(str(tmp_path), "q")
    assert record is not None and sorted(n for n in record.files if n[2:].isdigit()) == files[-1:]


def test_one_release_runs_at_a_time_and_the_files_passed_meanwhile_go_in_one_more(
        tmp_path: Path, calls: Calls, monkeypatch: pytest.MonkeyPatch) -> None:
    coll = collection(tmp_path)
    fill(coll)
    k3(coll).wait_for_packing()  # the rotated files sealed: no manifest write left but the releases'
    files = writer_files(tmp_path)
    writes: list[list[str]] = []  # the writer files each manifest write marks as being deleted
    write = manifest.write

    def recorded_write(queue_path: str, queue: str, record: manifest.Manifest) -> None:
        writes.append(sorted(n for n, e in record.files.items() if e.size == DELETING))
        write(queue_path, queue, record)

    monkeypatch.setattr(manifest, "write", recorded_write)
    calls.hold = True
    journal = k3(coll)._journal
    assert journal is not None
    while os.path.basename(journal.writer.files[0].path) == files[0]:
        assert one(coll.remove("q")) is not None  # until the first file is passed
    calls.wait_held()  # its release holds in the unlink, off the loop
    drain(coll, "q")  # every other file passed meanwhile: the gets do not wait
    assert len(calls.unlinks) == 1 and writer_files(tmp_path) == files
    calls.go.set()
    k3(coll).wait_for_packing()
    assert writer_files(tmp_path) == files[-1:]
    assert writes[0] == files[:1]
    assert writes[1] == files[1:-1]  # the rest in one batch: one manifest write (the first dropped)
    assert len(writes) == 2
    coll.close()


def test_the_files_go_only_once_the_heads_that_passed_them_are_on_disk(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    coll = collection(tmp_path, sync_journal="always")
    fill(coll)
    q = k3(coll)
    assert q._file is not None
    checkpoint = q._file.writer
    at_unlink: dict[int, int] = {}  # by a deleted file's last id: how far the checkpoint was on disk
    unlink = os.unlink

    def watched(path: str, *args: Any, **kwargs: Any) -> None:
        ours = os.path.dirname(path) == str(tmp_path)  # not an earlier test's file of the same name
        entry = manifest.read(str(tmp_path), "q").files.get(os.path.basename(path)) if ours else None  # type: ignore[union-attr]
        if entry is not None and entry.size == DELETING:
            at_unlink[entry.last_id] = checkpoint.synced
        unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", watched)
    passed: dict[int, int] = {}  # by id: the checkpoint's size once the get of that item returned
    while (item := one(coll.remove("q"))) is not None:
        passed[item.xid] = checkpoint.size
    q.wait_for_packing()
    assert len(writer_files(tmp_path)) == 1 and len(at_unlink) > 4  # every file passed went
    assert all(synced >= passed[last_id] for last_id, synced in at_unlink.items())
    coll.close()


@pytest.mark.parametrize("action", ["close", "delete"])
def test_a_close_or_a_delete_waits_for_a_release_under_way(tmp_path: Path, calls: Calls, action: str) -> None:
    calls.hold = True
    coll = collection(tmp_path)
    fill(coll)
    files = writer_files(tmp_path)
    drain(coll, "q")
    calls.wait_held()
    task = gevent.spawn(coll.close if action == "close" else partial(coll.delete, "q"))
    gevent.sleep(0.05)
    assert not task.dead  # waiting for the release, which cannot end while its unlink is held
    calls.go.set()
    task.get()
    assert writer_files(tmp_path) == (files[-1:] if action == "close" else [])
    record = manifest.read(str(tmp_path), "q")
    if action == "close":  # the manifest lists just the files there are
        assert record is not None and sorted(n for n in record.files if n[2:].isdigit()) == files[-1:]
    else:
        assert record is None  # not written again by the release once the queue was deleted
        coll.close()


def test_the_files_a_release_lists_are_told_from_the_manifest_as_last_written(tmp_path: Path) -> None:
    """A release lists the rotated files not yet sealed with its marks (`_unlisted`), as does a
    checkpoint's rewrite from the thread pool. They are told from the manifest's copy as last
    written (`Keeper.listed`), never from the entries a seal changes in place under the keeper's
    lock from its thread: read meanwhile, as they changed."""
    coll = collection(tmp_path)
    for i in range(6):  # past default_journal_size: rotated files
        coll.put("q", [b"%03d" % i + b"." * 100])
    k3(coll).wait_for_packing()  # every rotated file sealed and listed
    journal = k3(coll)._journal
    assert journal is not None
    keeper = journal._keeper
    read: list[str] = []

    class Watched(dict[str, manifest.Entry]):
        def __contains__(self, name: object) -> bool:
            read.append(str(name))
            return super().__contains__(name)

    keeper.manifest.files = Watched(keeper.manifest.files)
    with keeper.lock:  # as a seal's thread holds it, its write under way
        told = list(journal._unlisted())
    assert told == [os.path.basename(journal.writer.current.path)]  # the newest alone grows unlisted
    assert read == []
    coll.close()
