"""Kestrel3Queue through the collection: read-behind, file deletion, limits per reader, poison,
expiry, and writes that fail."""

from __future__ import annotations

import gc
import io
import os
import threading
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import gevent
import pytest

from kestrel.storage import JournalWriteError, QueueCollection, QueueConfigs
from kestrel.storage.clock import FakeClock
from kestrel.storage.errors import ConfigError
from kestrel.storage.item import QItem
from kestrel.storage.kestrel3.journal import COMPACT_AT
from kestrel.storage.kestrel3.queue import Kestrel3Queue
from kestrel.storage.runtime import ManualRuntime, Runtime, ThreadsRuntime
from kestrel.storage.tools import convert
from tests.end_to_end.test_disk_full import FailingDisk
from tests.end_to_end.test_disk_full import disk as disk  # the fixture
from tests.support.queues import drain, one, open_collection, reopen
from tests.support.slow_disk import slow_fsyncs, until_begun


def collection(path: Path, clock: FakeClock | None = None, **settings: Any) -> QueueCollection:
    queues = {"q": {"journal_format": "kestrel3", **settings.pop("q", {})}, **settings}
    return open_collection(path, queues=queues, clock=clock or FakeClock())


def k3(coll: QueueCollection, name: str) -> Kestrel3Queue:
    q = coll.queue(name)
    assert isinstance(q, Kestrel3Queue)
    return q


def writer_files(path: Path) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.startswith("q.") and n[2:].isdigit())


def released(coll: QueueCollection, path: Path) -> list[str]:
    """The writer files once the files every reader has passed are deleted (off the loop)."""
    k3(coll, "q").wait_for_packing()
    return writer_files(path)


def test_read_behind_holds_at_most_max_memory_size_and_serves_everything_in_order(tmp_path: Path) -> None:
    coll = collection(tmp_path, q={"max_memory_size": 1000, "default_journal_size": 2000})
    items = [b"%04d" % i + b"." * 96 for i in range(200)]
    for i in range(0, 200, 7):
        coll.put("q", items[i:i + 7])
    q = k3(coll, "q")
    assert q.in_read_behind and q.length == 200 and q.bytes == 20_000
    assert q.memory_bytes <= 1000 + 100
    assert len(writer_files(tmp_path)) > 5
    coll = reopen(coll)
    q = k3(coll, "q")
    assert q.in_read_behind and q.length == 200 and q.memory_bytes <= 1100
    got = []
    while (item := one(coll.remove("q"))) is not None:
        got.append(item.data)
        assert q.memory_bytes <= 1100
    assert got == items and not q.in_read_behind
    assert len(released(coll, tmp_path)) == 1  # every reader passed the others: deleted


def test_writer_files_stay_until_every_reader_has_passed_them(tmp_path: Path) -> None:
    coll = collection(tmp_path, q={"default_journal_size": 300})
    coll.queue("q+slow")
    for i in range(20):
        coll.put("q", [b"item-%02d" % i + b"x" * 40])
    files = writer_files(tmp_path)
    assert len(files) > 3
    assert len(drain(coll, "q")) == 20
    assert released(coll, tmp_path) == files  # q+slow still needs them
    first = one(coll.remove("q+slow", transaction=True))
    assert first is not None
    assert len(drain(coll, "q+slow")) == 19
    assert released(coll, tmp_path) == files  # the open read holds the head at the first file
    assert coll.confirm("q+slow", [first.xid])
    assert released(coll, tmp_path) == files[-1:]


def test_a_new_reader_starts_empty_and_each_reader_keeps_its_own_limits(tmp_path: Path) -> None:
    limits = {"q+small": {"max_items": 2}, "q+recent": {"max_items": 2, "discard_old_when_full": True}}
    coll = collection(tmp_path, **limits)
    coll.put("q", [b"before"])
    coll.queue("q+small")
    coll.queue("q+recent")
    assert coll.put("q", [b"a", b"b", b"c"]) == 3  # the parent took all of them
    assert coll.put("q+small", [b"d"]) == 0  # full: refused
    assert coll.queue("q+recent").stats()["discarded"] == 1
    coll = reopen(coll)
    assert drain(coll, "q+small") == [b"a", b"b"]
    assert drain(coll, "q+recent") == [b"b", b"c"]
    assert drain(coll, "q") == [b"before", b"a", b"b", b"c"]


def test_poison_after_max_errors_aborts_is_removed_for_good_and_handed_over(tmp_path: Path) -> None:
    coll = collection(tmp_path, q={"max_errors": 3})
    q = k3(coll, "q")
    poisoned: list[QItem] = []
    q.on_poison = lambda _queue, _error_queue, item: poisoned.append(item)
    coll.put("q", [b"bad", b"good"])
    for attempt in range(1, 4):
        item = one(coll.remove("q", transaction=True))
        assert item is not None and item.data == b"bad" and item.errors == attempt - 1
        assert coll.unremove("q", [item.xid])
    assert [(i.data, i.errors) for i in poisoned] == [(b"bad", 3)]
    assert q.stats()["poisoned"] == 1 and q.stats()["canceled_transactions"] == 3
    coll = reopen(coll)
    assert drain(coll, "q") == [b"good"]  # the poison item was journaled as consumed


def test_expired_items_move_to_expire_to_queue_and_are_consumed(tmp_path: Path) -> None:
    clock = FakeClock()
    coll = collection(tmp_path, clock, q={"expire_to_queue": "late"})
    coll.queue("q+c")
    coll.put("q", [b"old"], clock.now_ms() + 100)
    coll.put("q", [b"new"])
    clock.advance(200)
    assert coll.sweep() == 2  # from q and from q+c
    assert drain(coll, "late") == [b"old", b"old"]
    coll = reopen(coll)
    assert drain(coll, "q") == [b"new"] and drain(coll, "q+c") == [b"new"]


def test_failed_checkpoint_writes_refuse_and_change_nothing(tmp_path: Path, disk: FailingDisk) -> None:
    coll = collection(tmp_path)
    coll.put("q", [b"one", b"two", b"three"])
    opened = one(coll.remove("q", transaction=True))
    assert opened is not None
    disk.full = True
    with pytest.raises(JournalWriteError, match="the disk is full"):
        coll.remove("q")
    with pytest.raises(JournalWriteError):
        coll.confirm("q", [opened.xid])
    with pytest.raises(JournalWriteError):
        coll.put("q", [b"never"])
    with pytest.raises(JournalWriteError):
        coll.flush("q")
    q = coll.queue("q")
    assert (q.length, q.open_transactions) == (2, 1)
    disk.full = False
    assert one(coll.remove("q")) is not None and one(coll.remove("q")) is not None
    coll = reopen(coll)
    assert drain(coll, "q") == [b"one"]  # the open read, never confirmed; nothing else came back


def test_a_queue_whose_first_file_cannot_be_written_leaves_nothing_and_says_why(
        tmp_path: Path, disk: FailingDisk) -> None:
    """A new queue on a full disk: each put is refused as a journal write, and no empty writer file
    is left behind to be a stray at the next start (the queue is made at the first put after)."""
    coll = collection(tmp_path)
    disk.full = True
    for _ in range(3):
        with pytest.raises(JournalWriteError, match="the disk is full"):
            coll.put("q", [b"never"])
    assert not [name for name in os.listdir(tmp_path) if name.startswith("q")]
    disk.full = False
    assert coll.put("q", [b"kept"]) == 1
    coll = reopen(coll)
    assert drain(coll, "q") == [b"kept"]


@pytest.mark.pure_build
def test_at_start_up_one_reading_of_each_sealed_writer_file_serves_every_reader(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each reader found on disk loads the items it has still to consume; the runs of PUTs of a
    sealed file are read once for all of them (the newest file, still written, by each), and the
    readers share the items' bytes as live puts do."""
    from kestrel.storage.kestrel3 import journal as kestrel3_journal

    coll = collection(tmp_path, q={"default_journal_size": 300})
    for child in ("a", "b"):
        coll.queue(f"q+{child}")
    items = [b"%04d" % i + b"." * 40 for i in range(40)]
    for i in range(0, 40, 4):
        coll.put("q", items[i:i + 4])
    assert drain(coll, "q+a") == items  # reader a has nothing left to load
    assert len(writer_files(tmp_path)) > 4
    readings: list[str] = []
    real = kestrel3_journal.RecordReader

    def counted(path: str, *args: Any) -> Any:
        readings.append(os.path.basename(path))
        return real(path, *args)

    monkeypatch.setattr(kestrel3_journal, "RecordReader", counted)
    coll = reopen(coll)
    newest = writer_files(tmp_path)[-1]
    assert sorted(set(readings) - {newest}) == writer_files(tmp_path)[:-1]
    assert all(readings.count(name) == 1 for name in writer_files(tmp_path)[:-1])
    assert drain(coll, "q") == items and drain(coll, "q+b") == items
    assert coll.queue("q+a").length == 0


def test_a_kestrel2_journal_is_not_read_as_kestrel3(tmp_path: Path) -> None:
    plain = QueueCollection(str(tmp_path))
    plain.put("q", [b"kept"])
    plain.close()
    with pytest.raises(ConfigError, match="has Kestrel 2 journal files .* convert them"):
        collection(tmp_path)  # at start-up
    later = QueueCollection(str(tmp_path), QueueConfigs({}, {"q": {"journal_format": "kestrel3"}}))
    with pytest.raises(ConfigError, match="has Kestrel 2 journal files"):
        later.queue("q")  # created on first use


def test_fanout_only_parent_keeps_no_reader_and_counts_what_fits(tmp_path: Path) -> None:
    coll = collection(tmp_path, q={"fanout_only": True})
    coll.queue("q+a")
    assert coll.put("q", [b"one", b"two"]) == 2
    assert coll.queue("q").length == 0 and "q.read." not in os.listdir(tmp_path)
    coll = reopen(coll)
    assert drain(coll, "q+a") == [b"one", b"two"]


def test_discarding_in_read_behind_loads_each_new_item_once(tmp_path: Path) -> None:
    coll = collection(tmp_path, q={"max_memory_size": 100, "max_items": 4, "discard_old_when_full": True})
    coll.put("q", [b"A" * 60, b"B" * 60, b"C" * 60, b"D" * 60])  # two of them behind
    assert coll.queue("q").in_read_behind
    coll.put("q", [b"e", b"f", b"g"])  # each discards a big one: the rest fits in memory
    q = coll.queue("q")
    assert (q.length, q.stats()["discarded"]) == (4, 3)
    assert drain(coll, "q") == [b"D" * 60, b"e", b"f", b"g"]
    coll = reopen(coll)
    assert drain(coll, "q") == []


def test_a_deleted_reader_is_not_made_anew_when_its_parent_is(tmp_path: Path) -> None:
    """The readers a writer journal found on disk were made again with their parent: a child deleted
    after a start came back, fed every put after, once its parent was deleted (another child kept
    the journal open) and a put made the parent anew."""
    coll = collection(tmp_path)
    for name in ("q", "q+a", "q+b"):
        coll.queue(name)
    coll.put("q", [b"one"])
    coll = reopen(coll)
    coll.delete("q+b")
    coll.delete("q")
    coll.put("q", [b"two"])
    assert coll.queue_names() == ["q", "q+a"] and "q.read.b" not in os.listdir(tmp_path)
    assert drain(coll, "q+a") == [b"one", b"two"] and drain(coll, "q") == [b"two"]
    coll = reopen(coll)
    assert coll.queue_names() == ["q", "q+a"]
    coll.close()


def test_a_waiting_reader_is_woken_by_a_put_to_the_parent(tmp_path: Path) -> None:
    coll = collection(tmp_path)
    coll.queue("q+c")
    waiter = gevent.spawn(partial(coll.remove, "q+c", 1, True, 5.0))
    gevent.sleep(0)  # the waiter is waiting
    assert coll.queue("q+c").waiters == 1
    coll.put("q", [b"wake"])
    item = one(waiter.get(timeout=5))
    assert item is not None and item.data == b"wake" and item.xid
    assert coll.queue("q+c").waiters == 0 and coll.queue("q").length == 1


def test_a_checkpoint_appended_to_is_rewritten_once_large_and_reads_back(tmp_path: Path) -> None:
    coll = collection(tmp_path)
    coll.put("q", [b"%d" % i for i in range(20_000)])
    checkpoint = tmp_path / "q.read."
    sizes = []
    for _ in range(9_000):  # each moves the head: one small record appended
        coll.remove("q")
        gevent.sleep(0)  # the rewrite runs after the change, in a greenlet of its own
        sizes.append(checkpoint.stat().st_size)
    assert max(sizes) < 64 * 1024 + 64
    assert any(b < a for a, b in zip(sizes, sizes[1:], strict=False))  # rewritten at least once
    held = one(coll.remove("q", transaction=True))  # holds the head: the rest are done out of order
    assert held is not None
    for _ in range(9_000):
        coll.remove("q")
        gevent.sleep(0)
    assert checkpoint.stat().st_size < 4 * 8 * 9_000  # never far above its state's own size
    coll = reopen(coll)
    assert drain(coll, "q") == [b"9000"] + [b"%d" % i for i in range(18_001, 20_000)]


class HeldRewrites:
    """`os.replace` and `os.fsync` noting whether each ran on the loop thread (a rename by the name
    it gives, an fsync by the file or folder it syncs); once `hold` is called, the rename of queue
    `q`'s checkpoint off the loop waits for `release` (not the one that creates it with the queue,
    off the loop as well). On the loop thread nothing waits (the test would hang)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.loop_thread = threading.get_ident()
        self.calls: list[tuple[str, bool, str]] = []  # (call, on the loop thread, name)
        self.started = threading.Event()
        self.release = threading.Event()
        self.holding = False
        rename, fsync = os.replace, os.fsync

        def held_rename(src: str, dst: str) -> None:
            on_loop = threading.get_ident() == self.loop_thread
            self.calls.append(("rename", on_loop, os.path.basename(dst)))
            if self.holding and not on_loop and os.path.basename(dst) == "q.read.":
                self.started.set()
                self.release.wait(60)
            rename(src, dst)

        def noted_fsync(fd: int) -> None:
            name = os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))
            self.calls.append(("fsync", threading.get_ident() == self.loop_thread, name))
            fsync(fd)

        monkeypatch.setattr(os, "replace", held_rename)
        monkeypatch.setattr(os, "fsync", noted_fsync)

    def hold(self) -> None:
        """From now on, note calls afresh and hold the checkpoint's rename."""
        self.calls.clear()
        self.holding = True

    def wait_started(self, task: gevent.Greenlet) -> None:
        """Let the loop run until the rename of the checkpoint is under way on its thread (or `task` ended)."""
        until_begun(self.started, task)

    def on_loop(self, *names: str) -> list[tuple[str, str]]:
        """The calls that ran on the loop thread for a file whose name starts with one of `names`."""
        return [(call, name) for call, on_loop, name in self.calls if on_loop and name.startswith(names)]


@pytest.fixture
def rewrites(monkeypatch: pytest.MonkeyPatch) -> Iterator[HeldRewrites]:
    held = HeldRewrites(monkeypatch)
    yield held
    held.release.set()


def test_a_flush_rewrites_the_checkpoint_off_the_loop_while_other_queues_are_served(
        tmp_path: Path, rewrites: HeldRewrites) -> None:
    """Under `always` a rewrite is two writes of a file in one step, each with two fsyncs (the
    manifest listing the new checkpoint, then the checkpoint): none of them on the loop thread,
    other queues served meanwhile, the readers of the journal waiting their turn."""
    coll = collection(tmp_path, q={"sync_journal": "always"})
    coll.queue("q+c")
    coll.put("q", [b"a", b"b", b"c", b"d"])
    rewrites.hold()
    flush = gevent.spawn(partial(coll.flush, "q"))
    rewrites.wait_started(flush)
    assert rewrites.on_loop("q.read.", "q.manifest") == []
    assert not flush.ready()
    assert coll.put("other", [b"meanwhile"]) == 1  # another queue is served
    get = gevent.spawn(partial(coll.remove, "q+c", 1))  # a reader of the same journal waits
    gevent.sleep(0)
    assert not get.ready()
    rewrites.release.set()
    flush.get(timeout=60)
    assert [item.data for item in get.get(timeout=60)] == [b"a"]
    assert rewrites.on_loop("q.read.", "q.manifest") == []
    coll = reopen(coll)
    assert drain(coll, "q") == []
    assert drain(coll, "q+c") == [b"b", b"c", b"d"]
    assert drain(coll, "other") == [b"meanwhile"]


def test_a_checkpoint_grown_large_is_rewritten_after_the_change_and_off_the_loop(
        tmp_path: Path, rewrites: HeldRewrites) -> None:
    """The change that grows the checkpoint past `COMPACT_AT` neither rewrites it nor yields (it may
    be one answered in the hub's callback); the rewrite follows in a change of its own, off the loop."""
    coll = collection(tmp_path)
    coll.put("q", [b"%d" % i for i in range(8_000)])
    checkpoint = tmp_path / "q.read."
    removes = 0
    while checkpoint.stat().st_size <= COMPACT_AT and removes < 8_000:  # each appends a small record
        assert coll.remove("q")
        removes += 1
    assert checkpoint.stat().st_size > COMPACT_AT, "rewritten in the change that grew it"
    rewrites.hold()
    task = gevent.spawn(partial(coll.remove, "q"))
    rewrites.wait_started(task)
    assert rewrites.started.is_set(), "the checkpoint was not rewritten off the loop"
    assert rewrites.on_loop("q.read.", "q.manifest") == []
    assert not task.ready()  # the next change of the reader waits for the rewrite
    rewrites.release.set()
    assert [item.data for item in task.get(timeout=60)] == [b"%d" % removes]
    assert checkpoint.stat().st_size < 1024
    assert rewrites.on_loop("q.read.", "q.manifest") == []
    coll = reopen(coll)
    assert drain(coll, "q") == [b"%d" % i for i in range(removes + 1, 8_000)]


def test_a_queue_deleted_while_its_checkpoint_rewrite_waits_is_freed_at_its_delete(tmp_path: Path) -> None:
    """The rewrite after the change that grew the checkpoint runs before the delete's close, which
    then holds nothing of the queue (docs/queue-lifetime.md)."""
    coll = collection(tmp_path)
    coll.queue("q+c")
    coll.put("q", [b"%d" % i for i in range(8_000)])
    checkpoint = tmp_path / "q.read.c"
    while checkpoint.stat().st_size <= COMPACT_AT:
        assert coll.remove("q+c")
    coll.delete("q+c")
    assert not [o for o in gc.get_objects() if isinstance(o, Kestrel3Queue) and o.name == "q+c"
                and o.queue_path == coll.path], "a deleted queue is still referred to"
    assert not checkpoint.exists()
    assert drain(reopen(coll), "q") == [b"%d" % i for i in range(8_000)]


def test_a_reload_changes_rotation_size_and_limits(tmp_path: Path) -> None:
    coll = collection(tmp_path)
    coll.put("q", [b"x" * 100] * 5)
    assert len(writer_files(tmp_path)) == 1
    coll.reload(QueueConfigs({}, {"q": {"journal_format": "kestrel3", "default_journal_size": 300,
                                        "max_items": 8}}), {})
    assert coll.put("q", [b"y" * 100] * 5) == 3
    assert len(writer_files(tmp_path)) == 2


def test_poison_goes_to_its_error_queue_or_back_to_the_head_when_that_refuses(tmp_path: Path) -> None:
    coll = collection(tmp_path, q={"max_errors": 1, "error_queue": "dead"}, dead={"max_items": 1})
    coll.put("dead", [b"filler"])
    coll.put("q", [b"bad"])
    item = one(coll.remove("q", transaction=True))
    assert item is not None and coll.unremove("q", [item.xid])
    assert coll.queue("q").length == 1 and coll.queue("q").stats()["poisoned"] == 0  # refused
    assert drain(coll, "dead") == [b"filler"]
    item = one(coll.remove("q", transaction=True))
    assert item is not None and coll.unremove("q", [item.xid])
    assert coll.queue("q").length == 0 and coll.queue("q").stats()["poisoned"] == 1
    coll = reopen(coll)
    assert drain(coll, "dead") == [b"bad"] and drain(coll, "q") == []


def test_a_queue_converted_to_kestrel3_is_served_by_its_readers_and_back(tmp_path: Path) -> None:
    plain = QueueCollection(str(tmp_path))
    plain.queue("q+c")
    plain.put("q", [b"one", b"two", b"three"])
    plain.put("q+c", [b"child only"])
    opened = one(plain.remove("q", transaction=True))  # open at the stop: served again, first
    assert opened is not None and drain(plain, "q+c")[:1] == [b"one"]
    plain.close()
    convert.convert(str(tmp_path), "kestrel3", [], out=io.StringIO())
    coll = collection(tmp_path)
    assert drain(coll, "q") == [b"one", b"two", b"three"]
    assert drain(coll, "q+c") == []  # what the child had consumed stays consumed
    coll.put("q", [b"after"])
    coll.close()
    convert.convert(str(tmp_path), "kestrel2", [], out=io.StringIO())
    back = QueueCollection(str(tmp_path))
    back.load()
    assert drain(back, "q") == [b"after"] and drain(back, "q+c") == [b"after"]


def filled_in_sealed_files(path: Path) -> tuple[list[bytes], list[tuple[int, str]]]:
    """A Kestrel 3 queue closed with its items in several writer files, all but the newest sealed."""
    from kestrel.storage.kestrel3 import files

    coll = collection(path, q={"default_journal_size": 1024})
    items = [b"%04d" % n * 8 for n in range(400)]
    for n in range(0, len(items), 10):
        coll.put("q", items[n:n + 10])
    coll.close()
    writers = files.list_queue_files(str(path), "q").writers
    assert len(writers) > 5
    return items, writers


@pytest.mark.pure_build
def test_a_start_reads_only_the_writer_files_the_manifest_has_not_verified_for_their_ids(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sealed file whose checksum the manifest verified keeps the ids it was sealed with: start-up
    takes them from there rather than reading the file once for them and again for its items."""
    from kestrel.storage.kestrel3 import files

    items, writers = filled_in_sealed_files(tmp_path)
    scanned: list[str] = []
    real = files.scan_writer_file

    def scan(number: int, path: str, *args: Any) -> files.WriterFile:
        scanned.append(os.path.basename(path))
        return real(number, path, *args)

    monkeypatch.setattr(files, "scan_writer_file", scan)
    coll = collection(tmp_path, q={"default_journal_size": 1024})
    assert scanned == [os.path.basename(writers[-1][1])]  # the newest, still written to: unsealed
    assert drain(coll, "q") == items
    coll.close()


def test_a_sealed_writer_file_changed_since_is_refused_not_taken_on_its_manifest_ids(tmp_path: Path) -> None:
    _, writers = filled_in_sealed_files(tmp_path)
    with open(writers[1][1], "r+b") as f:
        f.seek(-1, os.SEEK_END)
        f.write(b"?")
    coll = collection(tmp_path, q={"default_journal_size": 1024})
    assert "q" in coll.refused and "manifest" in str(coll.refused["q"])
    coll.close()


def test_a_reader_created_beside_another_gets_none_of_what_that_one_was_put(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two fanout children created at once: the second waits at the gate while the first writes its
    checkpoint (an fsync), and the first is then put an item. The second starts at the tail as it
    stands once its turn comes: the item, never offered to it, is not its own, now or after a restart."""
    coll = open_collection(tmp_path, {"journal_format": "kestrel3"})
    coll.put("jobs", [b"parent"])
    slow_fsyncs(monkeypatch, 0.2)
    first = gevent.spawn(partial(coll.put, "jobs+a", [b"for a"]))
    gevent.sleep(0.05)
    second = gevent.spawn(partial(coll.peek, "jobs+b"))
    gevent.joinall([first, second], raise_error=True)
    monkeypatch.undo()
    assert first.get() == 1 and second.get() is None
    assert drain(coll, "jobs+b") == []
    again = reopen(coll)
    assert drain(again, "jobs+b") == [] and drain(again, "jobs+a") == [b"for a"]
    again.close()


@pytest.mark.parametrize("runtime", [ThreadsRuntime, ManualRuntime])
def test_a_close_makes_its_final_fsyncs_side_by_side(tmp_path: Path, runtime: type[Runtime],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A queue's close makes its reader checkpoint, its newest writer file and the manifest's drop
    of the files deleted last durable at once (a thread each, or the runtime's pool): in turn, a
    stop on a slow disk waited for each. What they made durable is all there after."""
    coll = open_collection(tmp_path, queues={"q": {"journal_format": "kestrel3", "default_journal_size": 300}},
                           runtime=runtime())
    coll.put("q", [b"%03d" % i + b"." * 97 for i in range(6)])  # a writer file each
    assert len(drain(coll, "q")) == 6  # every file but the newest deleted, still in the manifest
    coll.put("q", [b"kept"])
    assert one(coll.remove("q")) is not None and coll.put("q", [b"last"]) == 1  # unsynced: both files
    q = k3(coll, "q")
    q.wait_for_packing()
    fsyncs = slow_fsyncs(monkeypatch, 0.3, data=True)
    coll.close()
    monkeypatch.undo()
    # the checkpoint's and the writer file's fdatasyncs and the manifest's first fsync in flight at once
    assert len(fsyncs) == 4 and fsyncs.peak == 3
    again = reopen(coll)
    assert again.refused == {} and drain(again, "q") == [b"last"]
    again.close()
