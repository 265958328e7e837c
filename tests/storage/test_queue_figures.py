"""What the admin page reads of a queue, from the engine itself: how long the head item has waited,
its format, read-behind, its files with what its manifest records of each (told without waiting for
a manifest write under way), and where the readers of a Kestrel 3 writer journal stand."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import gevent
import pytest

from kestrel.storage import QueueCollection, QueueConfigs
from kestrel.storage.clock import FakeClock
from kestrel.storage.crc32c import file_crc32c
from kestrel.storage.queue import ReaderPosition
from tests.conftest import STALL_S
from tests.support.queues import load_strictly, one

ITEM = b"x" * 200


def collection(path: Path, clock: FakeClock | None = None, **settings: object) -> QueueCollection:
    coll = QueueCollection(str(path), QueueConfigs({}, {"q": dict(settings)}), clock=clock or FakeClock())
    return load_strictly(coll)


@pytest.mark.parametrize("fmt", ["kestrel2", "kestrel3"])
def test_stats_say_how_long_the_head_item_has_waited_and_in_which_format(tmp_path: Path, fmt: str) -> None:
    clock = FakeClock()
    coll = collection(tmp_path, clock, journal_format=fmt)
    assert coll.queue("q").stats()["head_wait_ms"] == 0  # empty
    coll.put("q", [b"first"])
    clock.advance(1500)
    coll.put("q", [b"second"])
    clock.advance(1000)
    stats = coll.queue("q").stats()
    assert stats["head_wait_ms"] == 2500 and stats["journal_format"] == int(fmt[-1])
    assert one(coll.remove("q")) is not None
    assert coll.queue("q").stats()["head_wait_ms"] == 1000  # the next item is the head now
    coll.close()


@pytest.mark.parametrize("fmt", ["kestrel2", "kestrel3"])
def test_an_age_is_zero_not_negative_once_the_wall_clock_is_stepped_back_past_the_items_add(
        tmp_path: Path, fmt: str) -> None:
    """An item's add time is a time of the wall clock (the journal keeps it): after a step back
    (NTP, a VM resumed) the head's wait and the last item's age (`age`, Thrift's `QueueInfo.age`)
    are 0 until the clock passes it again, as Kestrel's `max 0`; never negative."""
    clock = FakeClock()
    coll = collection(tmp_path, clock, journal_format=fmt)
    coll.put("q", [b"first", b"second"])
    clock.advance(1000)
    clock.step(-3_600_000)
    assert coll.queue("q").stats()["head_wait_ms"] == 0
    assert one(coll.remove("q")) is not None
    stats = coll.queue("q").stats()
    assert stats["age"] == stats["age_msec"] == stats["head_wait_ms"] == 0
    clock.step(3_600_000)
    assert coll.queue("q").stats()["head_wait_ms"] == 1000
    coll.close()


def test_stats_say_when_items_wait_on_disk(tmp_path: Path) -> None:
    coll = collection(tmp_path, max_memory_size=1000)
    coll.put("q", [ITEM])
    assert coll.queue("q").stats()["read_behind"] == 0
    for _ in range(10):
        coll.put("q", [ITEM])
    assert coll.queue("q").stats()["read_behind"] == 1
    while one(coll.remove("q")) is not None:
        pass
    assert coll.queue("q").stats()["read_behind"] == 0
    coll.close()


def test_a_kestrel2_queue_lists_its_journals_with_what_the_manifest_records(tmp_path: Path) -> None:
    coll = collection(tmp_path, max_memory_size=4096, max_journal_size=1 << 30)
    for i in range(300):
        coll.put("q", [b"%04d" % i + ITEM])
    for _ in range(50):
        assert one(coll.remove("q")) is not None
    coll.queue("q").wait_for_packing()  # every rotated journal is in the manifest
    files = coll.queue("q").journal_files()
    *rotated, live = files
    assert len(rotated) >= 2 and live.name == "q" and live.role == "live journal"
    assert live.size == os.path.getsize(tmp_path / "q")
    stats = coll.queue("q").stats()  # the guide's logsize is the live file, as Kestrel's; the total beside
    assert stats["logsize"] == live.size and stats["journal_size"] == sum(f.size for f in files)
    for f in rotated:
        assert f.role == "rotated journal" and f.size == os.path.getsize(tmp_path / f.name)
        assert f.manifest == f"{f.size} bytes with CRC32C {file_crc32c(str(tmp_path / f.name), f.size):08x}"
    coll.close()
    again = collection(tmp_path, max_memory_size=4096, max_journal_size=1 << 30)
    checked = again.queue("q").journal_files()
    assert [f.name for f in checked] == [f.name for f in files]
    assert all(f.manifest.endswith("; matched at start-up") for f in checked[:-1])
    again.close()


def test_a_kestrel3_queue_lists_its_readers_and_their_files(tmp_path: Path) -> None:
    coll = collection(tmp_path, journal_format="kestrel3", default_journal_size=2000)
    coll.queue("q+child")
    for i in range(1000):
        coll.put("q", [b"%04d" % i])
    for _ in range(100):
        assert one(coll.remove("q")) is not None
    opened = [one(coll.remove("q+child", transaction=True)) for _ in range(3)]
    assert all(opened)
    assert coll.confirm("q+child", [opened[2].xid])  # consumed above the two still open
    positions = coll.queue("q").reader_positions()
    assert positions == coll.queue("q+child").reader_positions() == [
        ReaderPosition("q", head=100, done_above=0, items=900, open_reads=0, tail=1000),
        ReaderPosition("q+child", head=0, done_above=1, items=997, open_reads=2, tail=1000)]
    coll.queue("q").wait_for_packing()  # every rotated writer file is sealed in the manifest
    files = coll.queue("q").journal_files()
    writers = [f for f in files if f.role == "writer file"]
    checkpoints = [f.name for f in files if f.role == "reader checkpoint"]
    assert len(writers) >= 3 and checkpoints == ["q.read.", "q.read.child"]
    assert all(f.size == os.path.getsize(tmp_path / f.name) for f in files)
    for f in writers[:-1]:
        assert f.manifest == f"{f.size} bytes with CRC32C {file_crc32c(str(tmp_path / f.name), f.size):08x}"
    assert writers[-1].manifest.startswith(("not listed yet", "listed, without a checksum"))  # it grows
    stats = coll.queue("q").stats()
    own = sum(f.size for f in files if f.name in ("q.read.", *(w.name for w in writers)))  # and its checkpoint
    assert stats["logsize"] == writers[-1].size and stats["journal_size"] == own
    # The writer files, which both read, count once: the child's figure is its checkpoint.
    assert coll.queue("q+child").stats()["journal_size"] == os.path.getsize(tmp_path / "q.read.child")
    coll.close()


@pytest.mark.parametrize("fmt", ["kestrel2", "kestrel3"])
def test_a_queue_s_files_are_told_while_a_thread_writes_its_manifest(tmp_path: Path, fmt: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A rotated file's seal lists it in the manifest from a thread, which holds the manifest's
    lock across its fsyncs (seconds on a disk that stalls). The queue's files are told meanwhile
    (the dashboard's queue page asks on the loop), from the manifest as last written: waiting for
    the lock there held every client until the write ended."""
    coll = collection(tmp_path, journal_format=fmt, default_journal_size=2000, max_memory_size=2000)
    coll.put("q", [ITEM])  # created, its manifest written
    loop_thread = threading.get_ident()
    real, held, released, ended = os.fsync, threading.Event(), threading.Event(), threading.Event()

    def slow(fd: int) -> None:
        if threading.get_ident() != loop_thread and ".kestrel" in os.readlink(f"/proc/self/fd/{fd}"):
            held.set()  # the manifest's temporary file, or its folder, written by the seal
            released.wait(STALL_S)
            ended.set()
        real(fd)

    monkeypatch.setattr(os, "fsync", slow)
    for i in range(30):  # 6 KB: the journal rotates, and the seal writes the manifest
        coll.put("q", [b"%04d" % i + ITEM])
    for _ in range(int(STALL_S / 0.01)):
        if held.is_set():
            break
        gevent.sleep(0.01)
    assert held.is_set(), "no manifest write was made from a thread"
    files = coll.queue("q").journal_files()
    answered_first = not ended.is_set()
    released.set()
    assert answered_first, "the figures waited for the manifest's fsync"
    assert files and sum(f.role != "live journal" and f.name != "q.read." for f in files) >= 2
    monkeypatch.undo()
    coll.queue("q").wait_for_packing()  # the seal listed, it is told as listed from now on
    rotated = coll.queue("q").journal_files()[0]
    assert rotated.manifest.endswith(f"CRC32C {file_crc32c(str(tmp_path / rotated.name), rotated.size):08x}")
    coll.close()


def on_disk(path: Path) -> int:
    """Bytes of the journal files in a queue path (the server's own folder aside)."""
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file() and not f.name.startswith("."))


@pytest.mark.parametrize("fanout_only", [False, True])
def test_the_queues_journal_sizes_sum_to_the_bytes_on_disk_whoever_reads_the_kestrel3_files(
        tmp_path: Path, fanout_only: bool) -> None:
    coll = collection(tmp_path, journal_format="kestrel3", default_journal_size=2000, fanout_only=fanout_only)
    for child in ("q+a", "q+b"):
        coll.queue(child)
    for i in range(300):
        coll.put("q", [b"%04d" % i])
    coll.queue("q").wait_for_packing()

    def sizes() -> dict[str, int]:
        return {q.name: q.journal_size for q in coll.queues()}

    writers = sum(f.size for f in coll.queue("q").journal_files() if f.role == "writer file")
    assert writers > 2000 and sizes()["q"] >= writers  # the parent counts the writer files
    assert sum(sizes().values()) == on_disk(tmp_path)  # and nothing counts them twice
    coll.delete("q")  # its children read on: the first of them counts the writer files now
    assert sizes()["q+a"] >= writers and sum(sizes().values()) == on_disk(tmp_path)
    coll.close()
