"""A journal's rotation never fsyncs on the event loop: a Kestrel 2 queue's first manifest, its
rotated journal's bytes and its new live journal's name are made durable on the thread pool while
the queue's changes wait at its gate; a Kestrel 3 writer file started by a rotation has its name made durable by
its first fsync, and no manifest lists it before. Observed through the threads the fsyncs run on and the greenlets
that are done, never through timing."""

from __future__ import annotations

import errno
import itertools
import os
import shutil
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import gevent
import pytest
from structlog.testing import capture_logs

from kestrel.storage import QueueCollection, QueueConfigs, acknowledgements, disk, manifest
from kestrel.storage.journal_file import JournalWriter
from kestrel.storage.kestrel2 import packer
from kestrel.storage.kestrel2.queue import Kestrel2Queue
from kestrel.storage.kestrel3 import files as k3files
from kestrel.storage.kestrel3.queue import Kestrel3Queue
from kestrel.storage.runtime import GeventRuntime, ThreadsRuntime
from tests.storage.test_commit_log import GeventWithFsyncs, Held
from tests.support.power_loss import Disk
from tests.support.queues import drain, open_collection, opened, reopen
from tests.support.slow_disk import HeldFileWrites, slow_fsyncs, until_begun

ITEM = b"." * 96


def put_until(coll: QueueCollection, done: Callable[[], bool], items: list[bytes]) -> None:
    """Puts to `q` one item at a time until `done()` (or 2,000 items), the loop turning between
    them as it does between a server's clients; `items` gets each."""
    while not done() and len(items) < 2000:
        items.append(b"%04d" % len(items) + ITEM)
        assert coll.put("q", [items[-1]]) == 1
        gevent.sleep(0.001)


@pytest.mark.parametrize(("journal_format", "sync", "commit_log"), [
    ("kestrel2", "never", False), ("kestrel2", "always", False), ("kestrel2", "always", True),
    ("kestrel2", "10ms", True), ("kestrel2", "10ms", False), ("kestrel3", "always", False),
    ("kestrel3", "always", True), ("kestrel3", "10ms", True)])
def test_a_rotation_fsyncs_nothing_on_the_loop(tmp_path: Path, journal_format: str, sync: str,
                                               commit_log: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Puts through rotations (Kestrel 2: its first manifest, each new live journal's name; Kestrel
    3: each new writer file's) make every fsync of a folder or a manifest off the loop's thread,
    and every item is there after a restart."""
    settings = {"journal_format": journal_format, "sync_journal": sync, "default_journal_size": 2000,
                "max_memory_size": 2000}
    coll = open_collection(tmp_path, settings, commit_log=commit_log)
    coll.put("q", [b"first"])
    fsynced_in = slow_fsyncs(monkeypatch, 0.01)
    items: list[bytes] = []

    def rotated_twice() -> bool:
        return len([n for n in os.listdir(tmp_path) if n.startswith("q.")]) >= 3

    gevent.spawn(partial(put_until, coll, rotated_twice, items)).get(timeout=60)
    coll.get("q").wait_for_packing()  # type: ignore[union-attr]
    monkeypatch.undo()
    assert len([n for n in os.listdir(tmp_path) if n.startswith("q.")]) >= 3  # it rotated
    assert fsynced_in and threading.get_ident() not in fsynced_in
    again = reopen(coll)
    assert again.refused == {} and drain(again, "q") == [b"first", *items]
    again.close()


def test_a_kestrel2_queue_waits_at_its_gate_while_its_new_live_journal_is_named(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rotation renames the live journal in the change that made it due; the new one's name
    (and the rename) is made durable on the thread pool while the queue's next change waits, and
    the other queues are served."""
    coll = open_collection(tmp_path, {"sync_journal": "always", "max_memory_size": 2000,
                                      "default_journal_size": 2000})
    coll.put("q", [b"first"])
    coll.queue("other")  # (created now: a creation makes its journal's name durable in the same folder)
    real, naming, named = os.fsync, threading.Event(), threading.Event()

    def held(fd: int) -> None:
        if os.path.samefile(f"/proc/self/fd/{fd}", tmp_path) and [n for n in os.listdir(tmp_path)
                                                                 if n.startswith("q.")]:
            naming.set()  # the queue path's folder, once a journal rotated: the new live journal's name
            named.wait(60)
        real(fd)

    monkeypatch.setattr(os, "fsync", held)
    items: list[bytes] = []

    producing = gevent.spawn(partial(put_until, coll, naming.is_set, items))
    while not naming.is_set() and not producing.ready():
        gevent.sleep(0.001)
    assert naming.is_set(), "no rotation"
    waiting = gevent.spawn(partial(coll.put, "q", [b"after"]))
    assert coll.put("other", [b"meanwhile"]) == 1
    gevent.sleep(0.01)
    assert not waiting.ready()
    named.set()
    producing.get(timeout=60)
    assert waiting.get(timeout=60) == 1
    monkeypatch.undo()
    q = coll.get("q")
    assert isinstance(q, Kestrel2Queue) and q._journal.writer is not None and not q._journal.writer.unnamed
    again = reopen(coll)
    assert drain(again, "q") == [b"first", *items, b"after"] and drain(again, "other") == [b"meanwhile"]
    again.close()


def test_under_a_periodic_sync_a_kestrel2_rotation_names_the_new_journal_once_the_rotated_one_is_durable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the commit log a periodic sync acknowledges no change after an fsync, yet the new
    live journal is created only once the rotated journal's bytes are durable, and named then, on
    the thread pool while the queue's changes wait at its gate, no fsync on the loop: created
    first, its name (made durable by any fsync of the folder) could outlive the rotated journal's
    last bytes in a power cut, and the start refused the rotated journal, no longer the last, as
    damaged (test_a_power_cut_once_a_rotation_named_its_new_journal_finds_the_rotated_one_whole)."""
    loop = threading.get_ident()
    naming, named = threading.Event(), threading.Event()
    synced: dict[int, int] = {}  # inode -> the size an fdatasync of it covered
    unsynced_when_named: list[str] = []  # rotated journals not durable to their end as the live one was named
    folder_fsyncs_on_loop: list[int] = []
    real_fsync, real_fdatasync = os.fsync, os.fdatasync

    def held(fd: int) -> None:
        if os.path.samefile(f"/proc/self/fd/{fd}", tmp_path):
            if threading.get_ident() == loop:
                folder_fsyncs_on_loop.append(fd)
            if (tmp_path / "q").exists() and [n for n in os.listdir(tmp_path) if n.startswith("q.")]:
                unsynced_when_named.extend(n for n in os.listdir(tmp_path) if n.startswith("q.")
                                           and synced.get(os.stat(tmp_path / n).st_ino) != os.stat(tmp_path / n).st_size)
                naming.set()  # the new live journal's name, or a rotated one's seal
                named.wait(60)
        real_fsync(fd)

    def datasync(fd: int) -> None:
        found = os.fstat(fd)
        real_fdatasync(fd)
        synced[found.st_ino] = max(synced.get(found.st_ino, 0), found.st_size)

    coll = open_collection(tmp_path, {"sync_journal": "20ms", "max_memory_size": 2000,
                                      "default_journal_size": 2000}, runtime=GeventWithFsyncs(datasync))
    coll.put("q", [b"first"])
    monkeypatch.setattr(os, "fsync", held)
    items: list[bytes] = []
    filling = gevent.spawn(partial(put_until, coll, naming.is_set, items))
    deadline = time.monotonic() + 60
    while not naming.is_set() and not filling.ready() and time.monotonic() < deadline:
        gevent.sleep(0.001)
    assert naming.is_set(), "no rotation"
    after = gevent.spawn(partial(coll.put, "q", [b"after"]))
    gevent.sleep(0.2)
    assert not after.ready() and not folder_fsyncs_on_loop  # at the gate, the fsync held off the loop
    named.set()
    assert after.get(timeout=60) == 1
    filling.get(timeout=60)
    assert unsynced_when_named == [] and not folder_fsyncs_on_loop
    monkeypatch.undo()
    again = reopen(coll)
    got = drain(again, "q")  # (the put that rotated may have had one more after it, at the gate too)
    assert again.refused == {} and sorted(got) == sorted([b"first", *items, b"after"]) and got[0] == b"first"
    again.close()


def test_an_append_to_a_file_whose_name_is_being_made_durable_makes_it_durable_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A change already in progress when a rotation started the new live journal may append to it
    before the name's fsync on the thread pool has ended: it makes the name durable itself, on the
    loop, before it writes, so that no record goes to a file a power cut may lose."""
    writer = JournalWriter(str(tmp_path / "q"), 0, GeventRuntime())
    events: list[tuple[str, bool]] = []
    loop = threading.get_ident()
    real_fsync, real_write = os.fsync, disk.write
    started = threading.Event()

    def fsync(fd: int) -> None:
        events.append(("fsync", threading.get_ident() == loop))
        if threading.get_ident() != loop:
            started.set()
            time.sleep(0.2)
        real_fsync(fd)

    def write(fd: int, data: Any) -> int:
        events.append(("write", threading.get_ident() == loop))
        return real_write(fd, data)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(disk, "write", write)
    creating = gevent.spawn(writer.create)
    while not started.is_set():
        gevent.sleep(0.001)
    assert writer.unnamed
    writer.append(b"record")
    assert events == [("fsync", False), ("fsync", True), ("write", True)]
    creating.get(timeout=60)
    assert not writer.unnamed
    writer.close()


def test_no_manifest_lists_a_kestrel3_writer_file_until_its_name_is_durable(tmp_path: Path) -> None:
    """A writer file a rotation starts has its name made durable by its first fsync; a manifest
    written before (a reader's checkpoint rewritten, consumed files deleted) lists neither it nor
    any file after it, so that a power cut cannot leave a manifest naming a file it lost."""
    writer = k3files.WriterJournal(str(tmp_path), "q", 200, 0, runtime=GeventRuntime())
    first = writer.current
    assert [f.path for f in writer.listable()] == [first.path]  # a new queue's: named by its creation
    while len(writer.files) < 3:
        writer.append([ITEM], 1)  # rotates, and waits for nothing
    assert [f.path for f in writer.listable()] == [first.path]
    writer.commit()  # the newest file's first fsync: its name first
    writer.wait_for_sealing()  # the ones before, fsynced as they are closed: their names first
    assert writer.listable() == writer.files
    writer.close()


def test_a_kestrel3_writer_file_whose_name_a_power_cut_lost_is_made_again_from_the_commit_log(
        tmp_path: Path) -> None:
    """With the commit log a new writer file's records are logged before its name is durable: a
    power cut that loses the file loses none of them, recovery making it again from its logged
    header and records before the queue loads."""
    settings = {"journal_format": "kestrel3", "sync_journal": "always", "default_journal_size": 600}
    coll = open_collection(tmp_path / "live", settings, commit_log=True)
    items = [b"%04d" % i + ITEM for i in range(12)]
    for item in items:
        assert coll.put("q", [item]) == 1  # acknowledged: in the log
    q = coll.get("q")
    assert isinstance(q, Kestrel3Queue) and q._journal is not None
    newest = q._journal.writer.current.path
    assert not [f for f in q._journal.writer.listable() if f.path == newest]  # not named yet
    q.wait_for_packing()  # (no manifest written meanwhile: its temporary would come and go under the copy)
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "live", cut)  # a SIGKILL's files; then a power cut loses the new name
    os.unlink(cut / os.path.basename(newest))
    again = open_collection(cut, settings, commit_log=True)
    assert again.refused == {} and drain(again, "q") == items
    again.close()
    coll.close()


@pytest.mark.parametrize("journal_format", ["kestrel2", "kestrel3"])
@pytest.mark.parametrize("commit_log", [True, False], ids=["commit_log-on", "commit_log-off"])
@pytest.mark.parametrize("changes", [120, 240, 360])
def test_a_power_cut_amid_rotations_off_the_loop_loses_no_change_a_client_was_told_of(
        tmp_path: Path, journal_format: str, commit_log: bool, changes: int) -> None:
    """Six clients, each on a queue whose journal rotates every few items, on the server's runtime:
    fsyncs, the first manifest and the new files' names made durable on threads while the loop
    turns. A power cut with changes in flight (what it would leave is copied aside: the queues go on
    meanwhile, as a dead machine's would not; tests/support/power_loss.py) keeps every change a
    client was told of, and the start refuses nothing."""
    settings = {"sync_journal": "always", "journal_format": journal_format, "default_journal_size": "400",
                "max_memory_size": "600"}
    live, cut = tmp_path / "live", tmp_path / "cut"
    live.mkdir()
    with Disk(live) as power:
        coll = QueueCollection(str(live), QueueConfigs(settings), runtime=GeventWithFsyncs(os.fdatasync),
                               commit_log=commit_log)
        coll.load()
        told: dict[str, list[bytes]] = {f"q{n}": [] for n in range(6)}
        made = [0]

        def client(name: str) -> None:
            held = Held() if commit_log else None  # (without the log a change waits for its fsync)

            def change(do: Callable[[], object]) -> None:
                if held is not None:
                    held.change(do)
                else:
                    do()
                made[0] += 1

            for n in itertools.count():
                item = b"%s-%d" % (name.encode(), n) + ITEM
                change(partial(coll.put, name, [item]))
                told[name] = told[name] + [item]
                if n % 3 == 2:
                    change(partial(coll.remove, name))
                    told[name] = told[name][1:]

        clients = [gevent.spawn(partial(client, name)) for name in told]
        while made[0] < changes:
            gevent.sleep(0.001)
        power.left_by_cut(str(live), str(cut), keep=3)  # with changes in flight
        expected = {name: list(items) for name, items in told.items()}
        gevent.killall(clients)
        coll.close()
    again = open_collection(cut, settings, commit_log=commit_log)
    try:
        assert again.refused == {}
        for name, items in expected.items():
            got = drain(again, name)
            # What was told is there in order, then perhaps a change in flight: an add, or a remove
            # of the first item (its reply never sent).
            assert got[:len(items)] == items or got[:len(items) - 1] == items[1:], (name, got, items)
    finally:
        again.close()



FIRST_MANIFEST = {"default_journal_size": 4096, "max_memory_size": 1 << 20}


def _rotated(path: Path) -> list[str]:
    return sorted(n for n in os.listdir(path) if n.startswith("q."))


@pytest.mark.parametrize("ends", ["written", "failed"])
@pytest.mark.parametrize(("sync", "commit_log"), [("never", False), ("always", False), ("always", True)])
def test_a_kestrel2_queue_emptied_while_its_first_manifest_is_written_rotates_and_packs_once_it_is(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sync: str, commit_log: bool, ends: str) -> None:
    """A queue that empties with its live journal past `default_journal_size` rotates and packs at
    once; while its first manifest, written ahead on the thread pool, is still being written the
    rotation is refused. Once that write has ended (or failed: the rotation writes it then) the
    queue rotates and packs, with no further change: it waited for a later change, and an idle
    queue kept its whole live journal meanwhile."""
    coll = opened(open_collection(tmp_path, {**FIRST_MANIFEST, "sync_journal": sync}, commit_log=commit_log))
    items = [b"%04d" % i + ITEM for i in range(60)]
    with HeldFileWrites(monkeypatch, "q~~manifest") as manifest_write, capture_logs() as logs:
        assert coll.put("q", items) == 60  # past half way to the rotation: its manifest is written ahead
        until_begun(manifest_write.started)
        q = coll.get("q")
        assert isinstance(q, Kestrel2Queue)
        assert [item.data for item in coll.remove("q", 60)] == items  # emptied: due to rotate and pack
        assert _rotated(tmp_path) == [] and q.live_journal_size >= FIRST_MANIFEST["default_journal_size"]
        manifest_write.release(OSError(errno.EIO, "Input/output error (simulated)") if ends == "failed" else None)
        q.wait_for_packing()
    (pack,) = _rotated(tmp_path)
    assert packer.is_our_pack(str(tmp_path / pack)) and q.live_journal_size == 0
    record = manifest.read(str(tmp_path), "q")
    assert record is not None and sorted(record.files) == [pack] and record.files[pack].pack
    warned = [e["event"] for e in logs if e["log_level"] in ("warning", "error")]
    assert warned == ([] if ends == "written" else
                      ["cannot write the queue's first manifest ahead of its rotation; the rotation writes it"])
    again = reopen(coll)
    assert again.refused == {} and drain(again, "q") == []
    again.close()


def test_a_kestrel2_queue_closed_while_its_first_manifest_is_written_rotates_nothing_after(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The close waits for the manifest being written ahead; the rotation and pack refused
    meanwhile (the queue emptied into open reads) are not made once the close has begun, and the
    reads open are back at the head after a restart."""
    coll = opened(open_collection(tmp_path, {**FIRST_MANIFEST, "sync_journal": "never"}))
    items = [b"%04d" % i + ITEM for i in range(60)]
    with HeldFileWrites(monkeypatch, "q~~manifest") as manifest_write:
        assert coll.put("q", items) == 60
        until_begun(manifest_write.started)
        q = coll.get("q")
        assert isinstance(q, Kestrel2Queue)
        assert len(coll.remove("q", 60, transaction=True)) == 60  # due to rotate and pack its open reads
        closing = gevent.spawn(partial(q.close))
        gevent.sleep(0)  # into its wait for the manifest
        assert not closing.ready()
        manifest_write.release()
        closing.get(timeout=60)
    assert q.closed and _rotated(tmp_path) == []
    record = manifest.read(str(tmp_path), "q")
    assert record is not None and record.files == {}
    again = reopen(coll)
    assert again.refused == {} and drain(again, "q") == items
    again.close()


class _TasksOnCue(ThreadsRuntime):
    """Plain threads; a task spawned while `cue` is clear starts once it is set (60 s at most)."""

    def __init__(self) -> None:
        super().__init__()
        self.cue = threading.Event()
        self.cue.set()

    def spawn(self, fn: Callable[[], None]) -> Any:
        if self.cue.is_set():
            return super().spawn(fn)

        def on_cue() -> None:
            self.cue.wait(60)
            fn()
        return super().spawn(on_cue)


class _Contended:
    """A lock that sets `contended` when a thread has to wait for it."""

    def __init__(self, lock: Any, contended: threading.Event) -> None:
        self.lock = lock
        self.contended = contended

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self.lock.acquire(blocking=False):
            return True
        self.contended.set()
        return bool(self.lock.acquire(blocking, timeout))

    def release(self) -> None:
        self.lock.release()

    def __enter__(self) -> _Contended:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def test_under_plain_threads_one_writer_writes_a_kestrel2_queues_first_manifest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under plain threads (the engine embedded without gevent) a change that takes the live
    journal past half way to its rotation and past the rotation itself both starts the first
    manifest's write ahead, on a thread of its own, and rotates, which writes it where that write
    has not begun. The thread starts here as the rotation's write begins: it waits for that write
    and skips its own, where it wrote an empty manifest of another Keeper (the same temporary file
    as the rotation's) and took its place once the first rotated file was listed, which the
    manifest then no longer listed."""
    runtime = _TasksOnCue()
    coll = opened(open_collection(tmp_path, {"default_journal_size": 2048, "max_memory_size": 4096},
                                  runtime=runtime))
    assert coll.put("q", [b"first"]) == 1
    q = coll.get("q")
    assert isinstance(q, Kestrel2Queue)
    journal = q._journal
    main = threading.get_ident()
    waiting = threading.Event()  # the thread writing ahead waits for the rotation's write, or writes
    released = threading.Event()
    journal._handoff = _Contended(journal._handoff, waiting)
    wrote: list[tuple[int, bool]] = []  # each Keeper.update's Keeper, and whether on the change's thread
    real = manifest.Keeper.update

    def update(keeper: manifest.Keeper, *args: Any, **kwargs: Any) -> None:
        wrote.append((id(keeper), threading.get_ident() == main))
        if threading.get_ident() == main and not runtime.cue.is_set():
            runtime.cue.set()  # the rotation writes the first manifest: the thread writing ahead starts
            assert waiting.wait(60), "the thread writing ahead neither waited nor wrote"
        elif threading.get_ident() != main and not released.is_set():
            waiting.set()
            released.wait(60)
        real(keeper, *args, **kwargs)

    monkeypatch.setattr(manifest.Keeper, "update", update)
    items = [b"%04d" % i + ITEM for i in range(40)]
    try:
        runtime.cue.clear()
        assert coll.put("q", items) == 40  # past half way, and past the rotation
        (rotated,) = _rotated(tmp_path)
        journal._sealer.wait()  # the rotated file is listed
    finally:
        released.set()
    q.wait_for_packing()
    monkeypatch.undo()
    assert len({keeper for keeper, _ in wrote}) == 1 and wrote[0][1]  # the rotation's Keeper alone
    record = manifest.read(str(tmp_path), "q")
    assert record is not None and sorted(record.files) == [rotated]
    assert journal._manifest is not None and sorted(journal._manifest.listed) == [rotated]
    again = reopen(coll)
    assert again.refused == {} and drain(again, "q") == [b"first", *items]
    again.close()


def cut_beside(tmp_path: Path) -> tuple[Path, list[Path]]:
    """The queue path a power-cut test runs on (`live`, made) and the list of the cuts it takes."""
    live = tmp_path / "live"
    live.mkdir()
    return live, []


def slowed_fdatasync(seconds: float, at_least: int = 0) -> Callable[[int], None]:
    """An fdatasync for the group commit's thread that first sleeps `seconds` for a file of
    `at_least` bytes or more, so that what runs beside it on the thread pool ends first."""
    real_sleep = gevent.monkey.get_original("time", "sleep")

    def fdatasync(fd: int) -> None:
        if os.fstat(fd).st_size >= at_least:
            real_sleep(seconds)
        os.fdatasync(fd)
    return fdatasync


@pytest.mark.parametrize(("sync", "commit_log"), [("10ms", False), ("10ms", True), ("always", True)])
def test_a_power_cut_once_a_rotation_named_its_new_journal_finds_the_rotated_one_whole(
        tmp_path: Path, sync: str, commit_log: bool) -> None:
    """A Kestrel 2 rotation creates the new live journal once the rotated one's bytes are durable,
    so that a power cut can tear the log's last file only. Created first (under a periodic sync
    without the commit log, the rotated journal's fsync still to come), a cut once the new name was
    durable and a change written to it left a torn write in the rotated journal, which the next
    start refused as damaged. Each cut is taken just after a rotation's new journal is named and
    a change appended to it, the fsyncs of files slowed so that the rotated journal's seal (and the
    log's round) is still running."""
    from kestrel.storage.kestrel2.journal import QueueJournal

    settings = {"sync_journal": sync, "default_journal_size": "400", "max_memory_size": "600"}
    live, cuts = cut_beside(tmp_path)
    items: list[bytes] = []
    slow_fsync = slowed_fdatasync(0.2)  # the rotation's naming ends first

    def put(held: Held) -> None:
        items.append(b"%04d" % len(items) + ITEM)
        if commit_log:
            acknowledgements.hold(held.acks)
        assert coll.put("q", [items[-1]]) == 1

    with Disk(live) as power:
        create_live = QueueJournal._create_live

        def cut_once_named(journal: QueueJournal, *args: Any, **kwargs: Any) -> None:
            create_live(journal, *args, **kwargs)
            if len(cuts) < 3:
                put(Held())  # into the new journal, not waiting for its round
                cuts.append(tmp_path / f"cut{len(cuts)}")
                power.left_by_cut(str(live), str(cuts[-1]), keep=3)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(QueueJournal, "_create_live", cut_once_named)
            coll = open_collection(live, settings, runtime=GeventWithFsyncs(slow_fsync), commit_log=commit_log)

            def fill() -> None:  # in a greenlet of its own: what it holds of acknowledgements ends with it
                while len(cuts) < 3 and len(items) < 100:
                    held = Held()
                    put(held)
                    if commit_log and sync == "always":
                        held.told.wait()
                    gevent.sleep(0.05)

            gevent.spawn(fill).get(timeout=120)
            coll.close()
    assert len(cuts) == 3
    for cut in cuts:
        again = open_collection(cut, settings, commit_log=commit_log)
        try:
            assert again.refused == {}, cut
            got = drain(again, "q")  # (the put in the new journal may have gone ahead of one at its gate)
            assert len(set(got)) == len(got) >= 3 and set(got) <= set(items), (cut, got)
        finally:
            again.close()


def test_a_power_cut_once_a_kestrel3_writer_file_is_named_keeps_the_queue(tmp_path: Path) -> None:
    """A Kestrel 3 rotation starts the next writer file on the loop while the previous one's seal
    (its fsync) runs; the new file's first fsync names it, and can end before that seal (16 MB of
    a file's pages take longer to reach the disk than a folder's fsync). A power cut then left the
    previous file ending in a torn write before the last file, which the start refused as damage,
    the queue with it. Each cut here is taken as a new file is named, a full file's seal slowed."""
    settings = {"sync_journal": "10ms", "journal_format": "kestrel3", "default_journal_size": "400",
                "max_memory_size": "600"}
    live, cuts = cut_beside(tmp_path)
    items: list[bytes] = []
    slow_seals = slowed_fdatasync(0.5, at_least=370)  # a full file's seal, slow as a large file's would be

    with Disk(live) as power:
        fsync_folder = JournalWriter._fsync_folder

        def cut_once_named(writer: JournalWriter) -> None:
            fsync_folder(writer)
            if len(cuts) < 3:
                cuts.append(tmp_path / f"cut{len(cuts)}")
                power.left_by_cut(str(live), str(cuts[-1]), keep=3)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(JournalWriter, "_fsync_folder", cut_once_named)
            coll = open_collection(live, settings, runtime=GeventWithFsyncs(slow_seals))

            def fill() -> None:
                while len(cuts) < 3 and len(items) < 300:
                    items.append(b"%04d" % len(items) + ITEM)
                    assert coll.put("q", [items[-1]]) == 1
                    gevent.sleep(0.03)

            gevent.spawn(fill).get(timeout=120)
            coll.close()
    assert len(cuts) == 3
    for cut in cuts:
        again = open_collection(cut, settings)
        try:
            assert again.refused == {}, cut
            got = drain(again, "q")  # what the periodic fsyncs had covered, in order; no more than was put
            assert got == items[:len(got)], cut
        finally:
            again.close()
