"""The queue's journal pieces driven directly, without a queue: rotation and replay of the file
set (`QueueJournal`), pack scheduling and its states, and the read-behind cursor (`JournalCursor`)."""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from kestrel.storage import QueueConfigs, disk, manifest
from kestrel.storage.collection import QueueCollection
from kestrel.storage.disk import writev_all_python
from kestrel.storage.errors import JournalWriteError
from kestrel.storage.item import QItem
from kestrel.storage.kestrel2 import codec, packer
from kestrel.storage.kestrel2.journal import PackState, QueueJournal
from kestrel.storage.kestrel2.queue import WRITTEN_WHERE_THEY_ARE
from kestrel.storage.kestrel2.read_behind import LIVE, JournalCursor
from kestrel.storage.kestrel2.replay import QueueReplay
from kestrel.storage.queue_path import JournalFiles, list_journal_files
from kestrel.storage.runtime import ManualRuntime
from tests.support.crash_points import InlineRuntime
from tests.support.queues import drain


def _journal(path: Path, runtime: ManualRuntime) -> QueueJournal:
    j = QueueJournal(str(path), "q", None, 1 << 20, runtime, runtime.lock())
    j.replay(list_journal_files(str(path), "q"), True, QueueReplay())
    j.open_live()
    return j


def _add(j: QueueJournal, data: bytes) -> None:
    j.write(codec.encode_addx(1, 0, data))
    j.flush()
    j.sync()


def _replayed(path: Path, runtime: ManualRuntime) -> list[bytes]:
    replay = QueueReplay()
    QueueJournal(str(path), "q", None, 1 << 20, runtime, runtime.lock()).replay(
        list_journal_files(str(path), "q"), True, replay)
    return [item.data for item in replay.restart_order()]


def test_rotation_renames_the_live_journal_and_starts_a_new_one(tmp_path: Path) -> None:
    runtime = ManualRuntime()
    j = _journal(tmp_path, runtime)
    _add(j, b"a")
    first = j.rotate()
    assert first == runtime.clock.now_ms()
    _add(j, b"b")
    second = j.rotate()  # in the same millisecond: the timestamps still increase
    assert second == first + 1
    _add(j, b"c")
    assert sorted(os.listdir(tmp_path)) == sorted([".kestrel", "q", f"q.{first}", f"q.{second}"])
    assert os.listdir(tmp_path / ".kestrel") == ["q.manifest"]  # written before the first rotated file
    assert [ts for ts, _ in j.rotated] == [first, second]
    assert j.size == sum(os.path.getsize(p) for p in j.paths) and j.paths[-1] == str(tmp_path / "q")
    assert [k for k, _ in j.files()] == [first, second, LIVE]
    j.close()
    assert _replayed(tmp_path, runtime) == [b"a", b"b", b"c"]


def test_a_rotated_journal_s_writer_names_the_file_where_it_now_is(tmp_path: Path) -> None:
    """Its seal, in the background, fsyncs and closes it: an error there names the rotated file, not
    the live journal that took its old name."""
    runtime = ManualRuntime()
    j = _journal(tmp_path, runtime)
    j.write(codec.encode_addx(1, 0, b"a"))
    j.flush()
    old = j.writer
    stamp = j.rotate()
    assert old is not None and j.writer is not old
    assert old.path == str(tmp_path / f"q.{stamp}") and j.writer is not None and j.writer.path == str(tmp_path / "q")
    j.close()


def test_sync_says_when_the_live_journal_is_due_for_rotation(tmp_path: Path) -> None:
    runtime = ManualRuntime()
    j = QueueJournal(str(tmp_path), "q", None, 40, runtime, runtime.lock())
    j.open_live()
    j.write(codec.encode_addx(1, 0, b"x" * 10))
    j.flush()
    assert not j.sync()
    j.write(codec.encode_addx(1, 0, b"x" * 10))
    j.flush()
    assert j.sync()
    j.close()


def test_replay_cuts_a_torn_tail_keeping_a_copy(tmp_path: Path) -> None:
    runtime = ManualRuntime()
    j = _journal(tmp_path, runtime)
    _add(j, b"whole")
    j.close()
    torn = codec.encode_addx(1, 0, b"torn record")[:9]
    with open(tmp_path / "q", "ab") as f:
        f.write(torn)
    assert _replayed(tmp_path, runtime) == [b"whole"]
    aside = tmp_path / ".kestrel" / "aside"
    copies = [n for n in os.listdir(aside) if n.startswith("q.torn-")]
    assert len(copies) == 1 and (aside / copies[0]).read_bytes() == torn
    assert (tmp_path / "q").stat().st_size == len(codec.encode_addx(1, 0, b"whole"))


def _pack_of(j: QueueJournal, stamp: int, items: list[bytes]) -> packer.PackRequest:
    return packer.PackRequest(j.queue_path, j.name, stamp, 0, [], [QItem(1, 0, d) for d in items], 1)


def test_a_pack_is_written_in_the_background_and_replaces_the_files_it_covers(tmp_path: Path) -> None:
    runtime = ManualRuntime()
    j = _journal(tmp_path, runtime)
    _add(j, b"a")
    _add(j, b"b")
    j.write(codec.REMOVE_BYTES)
    j.flush()
    stamp = j.rotate()
    _add(j, b"c")
    j.take_pack(_pack_of(j, stamp, [b"b"]))
    assert j.pack_pending and j.pack_state is PackState.IDLE
    j.start_next_pack()  # a taken pack waits for its change to be kept
    assert j.pack_state is PackState.IDLE
    j.keep_taken_pack()
    j.start_next_pack()
    assert j.pack_state is PackState.WRITING
    j.wait_for_packing()
    assert j.pack_state is PackState.IDLE and not j.pack_pending
    assert j.rotated == [(stamp, str(tmp_path / f"q.{stamp}"))]
    j.close()
    assert _replayed(tmp_path, runtime) == [b"b", b"c"]


def test_a_pack_that_fails_after_its_file_is_complete_stops_packing(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    runtime = ManualRuntime()
    j = _journal(tmp_path, runtime)
    _add(j, b"a")
    stamp = j.rotate()

    def crash(step: str) -> None:
        if step == "delete":
            raise OSError("crash at delete")

    monkeypatch.setattr(packer, "failpoint", crash)
    j.queue_pack(_pack_of(j, stamp, [b"a"]))
    j.start_next_pack()
    j.wait_for_packing()
    assert j.pack_state is PackState.STOPPED
    _add(j, b"b")
    later = j.rotate()
    j.queue_pack(_pack_of(j, later, [b"a"]))
    j.start_next_pack()  # no pack may be written before start-up finishes the one left
    assert j.pack_state is PackState.STOPPED and j.pack_pending
    monkeypatch.setattr(packer, "failpoint", None)
    j.forget_packs()
    j.close()
    assert _replayed(tmp_path, runtime) == [b"a", b"b"]  # start-up finished the first pack


@pytest.mark.parametrize("step", ["fsync", "rename-pack"])
def test_a_pack_whose_cleanup_fails_too_raises_the_failure_that_stopped_it(tmp_path: Path, step: str,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A pack stopped while its temporary is open (its fsync) or once it is closed (its rename)
    raises that failure, not the one of deleting the temporary on a disk that fails again; the
    temporary left is deleted at the next start."""
    runtime = ManualRuntime()
    j = _journal(tmp_path, runtime)
    _add(j, b"a")
    stamp = j.rotate()
    temporary = str(tmp_path / f"q~~{stamp}")
    unlink, close = os.unlink, os.close
    closed: list[int] = []

    def stop(name: str) -> None:
        if name == step:
            raise OSError(errno.ENOSPC, f"no space left at {name}")

    def failing_unlink(path: Any, *args: Any, **kwargs: Any) -> None:
        if str(path) == temporary:
            raise OSError(errno.EIO, "input/output error deleting the temporary")
        unlink(path, *args, **kwargs)

    def counted_close(fd: int) -> None:
        closed.append(fd)
        close(fd)

    monkeypatch.setattr(packer, "failpoint", stop)
    monkeypatch.setattr(os, "unlink", failing_unlink)
    monkeypatch.setattr(os, "close", counted_close)
    with capture_logs() as logs, pytest.raises(OSError) as raised:
        packer.write_pack(_pack_of(j, stamp, [b"a"]), [f"{tmp_path}/q.{stamp}"])
    monkeypatch.setattr(os, "close", close)
    monkeypatch.setattr(os, "unlink", unlink)
    assert raised.value.errno == errno.ENOSPC and step in str(raised.value)
    assert len(closed) == 1  # the temporary's descriptor, closed once whichever way it failed
    assert [(e["event"], e["step"], e["file"]) for e in logs if e["log_level"] == "warning"] == [
        ("could not clean up after a failed pack", "delete", temporary)]
    assert os.path.exists(temporary)
    monkeypatch.setattr(packer, "failpoint", None)
    j.close()
    coll = QueueCollection(str(tmp_path), runtime=InlineRuntime())  # the next start
    coll.load()
    assert not os.path.exists(temporary)
    assert drain(coll, "q") == [b"a"]  # the rotated journal still holds the item
    coll.close()


def _write(path: Path, *records: bytes) -> str:
    with open(path, "ab") as f:
        f.write(b"".join(records))
    return str(path)


def test_the_read_behind_cursor_reads_adds_across_files_to_the_end_of_the_live_one(tmp_path: Path) -> None:
    add = lambda data: codec.encode_addx(1, 0, data)  # noqa: E731
    first = _write(tmp_path / "q.100", add(b"a"), codec.REMOVE_BYTES, add(b"b"))
    second = _write(tmp_path / "q.200", codec.encode_xid(codec.CONFIRM_REMOVE, 3), add(b"c"))
    live = _write(tmp_path / "q", add(b"d"))
    files = [(100, first), (200, second), (LIVE, live)]
    left: list[int] = []
    cursor = JournalCursor(lambda: files, 100, 0, left.append)
    read = [cursor.next_item(0) for _ in range(3)]
    assert [i.data for i in read if i] == [b"a", b"b", b"c"] and left == [100]
    item = cursor.next_item(0)
    assert item is not None and item.data == b"d" and left == [100, 200] and cursor.key == LIVE
    assert cursor.next_item(0) is None  # caught up with the live journal
    _write(tmp_path / "q", add(b"e"))
    item = cursor.next_item(0)
    assert item is not None and item.data == b"e"  # the live journal grew
    cursor.release()  # its queue idle: the file closed, the place kept
    assert not cursor.holds_file()
    rotated = str(tmp_path / "q.300")
    os.rename(live, rotated)  # a rotation: the live journal renamed, a new one begun
    files[:] = [(100, first), (200, second), (300, rotated), (LIVE, _write(tmp_path / "q", add(b"f")))]
    cursor.live_rotated(300)
    assert cursor.key == 300
    item = cursor.next_item(0)  # opened again by its key, at its place: on into the new live journal
    assert item is not None and item.data == b"f" and left == [100, 200, 300] and cursor.key == LIVE
    cursor.close()


def test_the_read_behind_cursor_does_not_pass_its_stop(tmp_path: Path) -> None:
    add = lambda data: codec.encode_addx(1, 0, data)  # noqa: E731
    first = _write(tmp_path / "q.100", add(b"a"))
    live = _write(tmp_path / "q", add(b"b"), add(b"c"))
    cursor = JournalCursor(lambda: [(100, first), (LIVE, live)], 100, 0)
    cursor.stop = (LIVE, len(add(b"b")))
    assert [getattr(cursor.next_item(0), "data", None) for _ in range(3)] == [b"a", b"b", None]
    cursor.stop = None
    item = cursor.next_item(0)
    assert item is not None and item.data == b"c"
    cursor.close()


def test_replaying_nothing_gives_an_empty_file_set(tmp_path: Path) -> None:
    runtime = ManualRuntime()
    j = QueueJournal(str(tmp_path), "q", None, 1 << 20, runtime, runtime.lock())
    assert j.replay(JournalFiles(), True, QueueReplay()) == 0
    assert j.rotated == [] and j.size == 0


def test_a_journal_append_from_pieces_that_fails_is_cut_back(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The gathering write of a large put: half of it reaching the disk before ENOSPC is cut off,
    and the put is refused with nothing changed."""
    coll = QueueCollection(str(tmp_path))
    coll.load()
    coll.put("q", [b"small"])
    size = os.path.getsize(tmp_path / "q")
    real = disk.writev_all

    def full(fd: int, pieces: list[bytes]) -> int:
        half = sum(map(len, pieces)) // 2
        os.write(fd, b"".join(pieces)[:half])
        raise OSError(28, os.strerror(28))

    monkeypatch.setattr(disk, "writev_all", full)  # the gathering writes an append makes, either build
    with pytest.raises(JournalWriteError):
        coll.put("q", [b"x" * WRITTEN_WHERE_THEY_ARE])
    monkeypatch.setattr(disk, "writev_all", real)
    assert os.path.getsize(tmp_path / "q") == size
    assert coll.put("q", [b"y" * WRITTEN_WHERE_THEY_ARE]) == 1
    assert [coll.remove("q")[0].data for _ in range(2)] == [b"small", b"y" * WRITTEN_WHERE_THEY_ARE]
    coll.close()


def test_pieces_written_whole_after_a_short_gathering_write(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.writev
    monkeypatch.setattr(os, "writev", lambda fd, pieces: real(fd, [bytes(pieces[0])[:3]]))
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        assert writev_all_python(fd, [b"head", b"item-bytes", b"", b"tail"]) == 18
    finally:
        os.close(fd)
    assert (tmp_path / "f").read_bytes() == b"headitem-bytestail"



@pytest.mark.parametrize("fails", ["rename", "manifest"])
def test_a_rotation_that_fails_fails_no_change_and_is_tried_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  fails: str) -> None:
    """A rotation comes after the change that made it due is journaled. One that fails (a disk
    error renaming the live journal, or writing the queue's first manifest) fails no change: a
    remove that emptied the queue was undone in memory only, its records kept, so its items were
    gone and never handed out. A later change rotates."""
    configs = QueueConfigs({}, {"q": {"sync_journal": "never", "default_journal_size": 4096,
                                      "max_memory_size": 1 << 20}})
    coll = QueueCollection(str(tmp_path), configs, runtime=InlineRuntime())
    coll.load()
    items = [b"%04d" % i + b"x" * 200 for i in range(40)]
    coll.put("q", items)

    def fail(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EIO, "Input/output error (simulated)")

    with monkeypatch.context() as m:
        if fails == "rename":
            real = os.rename
            m.setattr(os, "rename", lambda src, dst: fail() if os.path.basename(src) == "q" else real(src, dst))
        else:
            m.setattr(manifest, "write", fail)
        taken = coll.remove("q", 40)  # emptied past default_journal_size: due to rotate and pack
    assert [item.data for item in taken] == items
    assert not [n for n in os.listdir(tmp_path) if n.startswith("q.")]
    coll.put("q", [b"again"])
    assert len(coll.remove("q", 1)) == 1  # emptied again: rotated and packed now
    coll.queue("q").wait_for_packing()
    assert [n for n in os.listdir(tmp_path) if n.startswith("q.")] and manifest.read(str(tmp_path), "q")
    coll.put("q", [b"last"])
    coll.close()
    again = QueueCollection(str(tmp_path), configs, runtime=InlineRuntime())
    again.load()
    assert not again.refused and drain(again, "q") == [b"last"]
    again.close()
