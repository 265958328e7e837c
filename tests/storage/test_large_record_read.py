"""A record larger than the reader's buffer, in either format (src/kestrel/storage/kestrel2/reader.py,
src/kestrel/storage/kestrel3/files.py): read whole in one read of the size its header gives, its
item read as itself; from `LARGE_APPEND` bytes on the thread pool while the queue's other changes
(in Kestrel 3, every reader's of its writer journal) wait at its gate; a size the file does not
hold allocating nothing. A read-behind cursor's read the page cache cannot answer goes to the thread
pool the same way, and so do the reads that place a Kestrel 2 page-out's cursor (inside a put,
only what the page cache holds is read). Observed through the reads made and the threads they run
on, never timing."""

from __future__ import annotations

import os
import threading
import tracemalloc
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import gevent
import pytest

from kestrel.storage import CorruptJournalError, QueueCollection, disk
from kestrel.storage.journal_file import CURSOR_CHUNK, READ_CHUNK
from kestrel.storage.kestrel2 import codec
from kestrel.storage.kestrel2.reader import JournalReader, read_journal
from kestrel.storage.kestrel3 import codec as k3
from kestrel.storage.kestrel3.files import RecordReader
from kestrel.storage.runtime import ManualRuntime
from kestrel.storage.write_gate import LARGE_APPEND
from tests.support.queues import aside, drain, journal_files, open_collection, reopen
from tests.support.slow_disk import held_fdatasyncs, until_begun
from tests.support.switches import never_switches

SETTINGS = {"journal_format": "kestrel2", "max_memory_size": "1MB"}
FORMATS = pytest.mark.parametrize("journal_format", ["kestrel2", "kestrel3"])


def settings(journal_format: str) -> dict[str, str]:
    return {**SETTINGS, "journal_format": journal_format}


def large(n: int, size: int = LARGE_APPEND + 1000) -> bytes:
    return bytes([n]) * size


class Reads:
    """`disk.pread` (a reader's one read of a large record, or what a read-behind cursor's read
    found the page cache not to hold), `os.pread` (the buffer's fills of a reader without a gate)
    and `disk.pread_cached` (a read-behind cursor's reads of the page cache), each call noted with
    whether it ran on the loop thread and how many bytes it asked for; a `disk.pread` off the loop
    thread waits for `release` once `hold` is set; with `uncached` the page cache holds nothing."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.loop_thread = threading.get_ident()
        self.records: list[tuple[bool, int]] = []
        self.fills: list[int] = []
        self.cached: list[tuple[bool, int]] = []
        self.hold = False
        self.uncached = False
        self.started = threading.Event()
        self.release = threading.Event()
        fill = os.pread
        pread = disk.pread
        pread_cached = disk.pread_cached

        def record(fd: int, size: int, at: int) -> bytes:
            on_loop = threading.get_ident() == self.loop_thread
            self.records.append((on_loop, size))
            if self.hold and not on_loop:
                self.started.set()
                self.release.wait(60)
            return pread(fd, size, at)

        def chunk(fd: int, size: int, at: int) -> bytes:
            self.fills.append(size)
            return fill(fd, size, at)

        def from_cache(fd: int, size: int, at: int) -> bytes:
            self.cached.append((threading.get_ident() == self.loop_thread, size))
            return b"" if self.uncached else pread_cached(fd, size, at)

        monkeypatch.setattr(disk, "pread", record)
        monkeypatch.setattr(os, "pread", chunk)
        monkeypatch.setattr(disk, "pread_cached", from_cache)

    def wait_started(self, get: gevent.Greenlet) -> None:
        while not self.started.is_set() and not get.ready():
            gevent.sleep(0.001)


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[Reads]:
    noted = Reads(monkeypatch)
    yield noted
    noted.release.set()


@FORMATS
def test_read_behind_reads_a_large_item_once_off_the_loop(tmp_path: Path, reads: Reads,
                                                          journal_format: str) -> None:
    coll = open_collection(tmp_path, settings(journal_format))
    items = [large(n) for n in range(4)]
    for item in items:
        coll.put("q", [item])  # the first fills memory: the others are in the journal only
    assert coll.get("q").in_read_behind  # type: ignore[union-attr]
    reads.cached.clear()
    assert drain(coll, "q") == items
    # Each item read back: one read of exactly its size, on the thread pool; the buffer's own
    # fills read no more than a chunk at a time (no record gathered in doubling pieces), from the
    # page cache on the loop.
    assert reads.cached and max(size for _, size in reads.cached) <= CURSOR_CHUNK
    assert all(on_loop for on_loop, _ in reads.cached)
    assert reads.records == [(False, len(item)) for item in items[1:]]
    coll.close()


@FORMATS
def test_a_record_under_large_append_is_read_once_on_the_loop(tmp_path: Path, reads: Reads,
                                                              journal_format: str) -> None:
    coll = open_collection(tmp_path, settings(journal_format))
    items = [large(n, 3 * CURSOR_CHUNK) for n in range(12)]  # 192 KB each: 4 fill memory
    coll.put("q", items)
    assert drain(coll, "q") == items
    # each in one read, on the loop: the page cache holds it, so the disk is not waited for
    large_reads = [(on_loop, size) for on_loop, size in reads.cached if size > CURSOR_CHUNK]
    assert large_reads and all(on_loop and size == len(items[0]) for on_loop, size in large_reads)
    assert reads.records == []
    coll.close()


@FORMATS
def test_the_queue_waits_while_its_record_is_read_and_keeps_its_order(tmp_path: Path, reads: Reads,
                                                                      journal_format: str) -> None:
    coll = open_collection(tmp_path, settings(journal_format))
    items = [large(n) for n in range(3)]
    for item in items:
        coll.put("q", [item])
    reads.hold = True
    get = gevent.spawn(partial(coll.remove, "q", 1))  # takes the first, and reads the second back
    reads.wait_started(get)
    assert reads.started.is_set(), "the record was not read off the loop"
    # The loop serves other queues meanwhile; this queue's next change waits for the read.
    put = gevent.spawn(partial(coll.put, "q", [b"after"]))
    assert coll.put("other", [b"meanwhile"]) == 1
    gevent.sleep(0.01)
    assert not get.ready() and not put.ready()
    reads.release.set()
    assert [item.data for item in get.get(timeout=60)] == items[:1]
    assert put.get(timeout=60) == 1
    assert drain(coll, "q") == [*items[1:], b"after"]
    coll.put("q", [b"last"])
    again = reopen(coll)
    assert drain(again, "q") == [b"last"]
    assert drain(again, "other") == [b"meanwhile"]
    again.close()


@FORMATS
def test_items_survive_a_restart_in_read_behind(tmp_path: Path, journal_format: str) -> None:
    coll = open_collection(tmp_path, settings(journal_format))
    items = [large(n, READ_CHUNK + n) for n in range(4)]  # over replay's buffer too
    for item in items:
        coll.put("q", [item])
    assert [i.data for i in coll.remove("q", 1)] == items[:1]
    again = reopen(coll)
    assert drain(again, "q") == items[1:]
    again.close()


def _file_system(path: Path) -> str:
    """The type of the file system holding `path` (its mount point's, the longest above it)."""
    best, kind = "", ""
    with open("/proc/self/mounts") as mounts:
        for line in mounts:
            _, point, fs_type = line.split()[:3]
            inside = str(path) == point or str(path).startswith(point.rstrip("/") + "/")
            if inside and len(point) > len(best):
                best, kind = point, fs_type
    return kind


@pytest.mark.skipif(not hasattr(os, "RWF_NOWAIT"), reason="this system's preadv2 has no RWF_NOWAIT")
def test_a_read_of_the_page_cache_takes_only_what_it_holds(tmp_path: Path) -> None:
    """`disk.pread_cached` answers from the page cache alone, never waiting for the disk: what was
    just written, whole, or up to the file's end; nothing once the file's pages are dropped."""
    path = tmp_path / "journal"
    data = os.urandom(256 * 1024)
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert disk.pread_cached(fd, CURSOR_CHUNK, 4096) == data[4096:4096 + CURSOR_CHUNK]
        assert disk.pread_cached(fd, CURSOR_CHUNK, len(data) - 100) == data[-100:]
        if _file_system(tmp_path) in ("tmpfs", "ramfs"):
            pytest.skip("a file system in memory keeps every page of its files")
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert disk.pread_cached(fd, CURSOR_CHUNK, 128 * 1024) == b""
    finally:
        os.close(fd)


@FORMATS
def test_a_refill_the_page_cache_cannot_answer_is_read_off_the_loop(tmp_path: Path, reads: Reads,
                                                                    journal_format: str) -> None:
    """A read-behind cursor's fill of its buffer that would wait for the disk (seconds, on one that
    stalls) is read on the thread pool, the queue's next change waiting for it and other queues
    served; what the page cache holds is read on the loop (above)."""
    coll = open_collection(tmp_path, {"journal_format": journal_format, "max_memory_size": 2000})
    items = [b"%04d" % n + b"." * 396 for n in range(400)]
    coll.put("q", items)
    assert coll.get("q").in_read_behind  # type: ignore[union-attr]
    reads.uncached = reads.hold = True
    get = gevent.spawn(partial(drain, coll, "q"))
    reads.wait_started(get)
    assert reads.started.is_set(), "the refill was not read off the loop"
    put = gevent.spawn(partial(coll.put, "q", [b"after"]))
    assert coll.put("other", [b"meanwhile"]) == 1
    gevent.sleep(0.01)
    assert not put.ready()
    reads.release.set()
    assert get.get(timeout=60) + drain(coll, "q") == [*items, b"after"]
    assert reads.records and not any(on_loop for on_loop, _ in reads.records)
    coll.close()


@FORMATS
def test_a_refill_is_read_on_the_loop_while_another_change_of_its_journal_is_in_progress(
        tmp_path: Path, reads: Reads, journal_format: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A change waiting for its fsync is still in progress: it would go on while the refill waited
    off the loop, and find that change half made (its items taken, their records not yet written).
    So the refill is read on the loop then, as before, and every item keeps its place."""
    coll = open_collection(tmp_path, {"journal_format": journal_format, "max_memory_size": 2000,
                                      "sync_journal": "always"}, runtime=ManualRuntime())
    items = [b"%04d" % n + b"." * 396 for n in range(40)]
    coll.put("q", items)
    assert coll.get("q").in_read_behind  # type: ignore[union-attr]
    syncing, synced = held_fdatasyncs(monkeypatch)
    put = gevent.spawn(partial(coll.put, "q", [b"after"]))  # in progress until its fsync ends
    until_begun(syncing)
    reads.uncached = True
    get = gevent.spawn(partial(coll.remove, "q", 20))  # its commit waits for the fsync in flight too
    for _ in range(5000):  # until it has read from the disk, whichever way
        if reads.records or reads.fills:
            break
        gevent.sleep(0.001)
    synced.set()
    assert put.get(timeout=60) == 1
    taken = [item.data for item in get.get(timeout=60)]
    assert all(on_loop for on_loop, _ in reads.records)
    monkeypatch.undo()
    assert taken + drain(coll, "q") == [*items, b"after"]
    coll.close()


def _journal(path: Path, *records: bytes) -> Path:
    journal = path / "q"
    journal.write_bytes(b"".join(records))
    return journal


BACKLOG = [b"%04d" % n + b"." * 396 for n in range(400)]  # 160 KB of journal: three buffers of it
PAGED = len(BACKLOG) * 400 - 2000  # what paging out to a target of 2000 bytes drops (5 items stay)


def backlog(tmp_path: Path) -> QueueCollection:
    """A Kestrel 2 queue `q` holding BACKLOG in memory, its target lowered to 2000 bytes for a
    page-out (`shed`, as the memory governor's tick calls it)."""
    coll = open_collection(tmp_path, {"max_memory_size": "64MB"})
    coll.put("q", BACKLOG)
    coll.queue("q").set_memory_target(2000)
    return coll


def test_a_page_out_reads_what_the_page_cache_cannot_answer_off_the_loop(tmp_path: Path,
                                                                         reads: Reads) -> None:
    """Paging a Kestrel 2 queue out reads its journal to find the record of the first item it
    drops; from the memory governor's tick, what the page cache does not hold is read on the thread
    pool, the queue's changes waiting meanwhile and other queues served (on a disk that stalls, read
    on the loop it held every client)."""
    coll = backlog(tmp_path)
    q = coll.queue("q")
    reads.uncached = reads.hold = True
    shed = gevent.spawn(q.shed)
    reads.wait_started(shed)
    assert reads.started.is_set(), "the page-out's read was not made off the loop"
    put = gevent.spawn(partial(coll.put, "q", [b"after"]))
    assert coll.put("other", [b"meanwhile"]) == 1
    gevent.sleep(0.01)
    assert not put.ready()
    reads.release.set()
    assert shed.get(timeout=60) == PAGED and q.in_read_behind
    assert put.get(timeout=60) == 1
    assert reads.records and not any(on_loop for on_loop, _ in reads.records) and not reads.fills
    assert drain(coll, "q") == [*BACKLOG, b"after"]
    coll.close()


@pytest.mark.parametrize("cached", [True, False], ids=["cached", "uncached"])
def test_a_page_out_inside_a_put_reads_only_what_the_page_cache_holds(tmp_path: Path, reads: Reads,
                                                                       cached: bool) -> None:
    """A put over the server's budget pages another queue out at once (`make_room`: `shed` without
    `wait`), inside its own change, which must not pause: that page-out reads what the page cache
    holds, on the loop, and nothing from the disk. Where the cache does not hold what it would
    read, it frees nothing, and the tick's page-out reads the rest off the loop (read on the loop,
    on a disk that stalls it held every client)."""
    coll = backlog(tmp_path)
    q = coll.queue("q")
    reads.uncached = not cached
    with never_switches("a page-out inside a put"):
        assert q.shed(wait=False) == (PAGED if cached else 0)
    assert reads.cached and all(on_loop for on_loop, _ in reads.cached)
    assert not reads.fills and not reads.records and q.in_read_behind == cached
    if not cached:
        assert q.shed() == PAGED  # as the tick does it
        assert reads.records and not any(on_loop for on_loop, _ in reads.records)
    assert drain(coll, "q") == BACKLOG
    coll.close()


def test_a_page_out_reads_on_the_loop_while_a_change_of_its_queue_is_in_progress(
        tmp_path: Path, reads: Reads, monkeypatch: pytest.MonkeyPatch) -> None:
    """A change waiting for its fsync is still in progress: it would go on while the page-out's
    read waited off the loop (a rotation, a pack, a rebuild of memory under the cursor being
    placed). So the page-out reads on the loop then, as a refill does, and every item keeps its
    place."""
    coll = open_collection(tmp_path, {"max_memory_size": "64MB", "sync_journal": "always"},
                           runtime=ManualRuntime())
    coll.put("q", BACKLOG)
    q = coll.queue("q")
    q.set_memory_target(2000)
    syncing, synced = held_fdatasyncs(monkeypatch)
    put = gevent.spawn(partial(coll.put, "q", [b"after"]))  # in progress until its fsync ends
    until_begun(syncing)
    reads.uncached = True
    paged = q.shed()
    synced.set()
    assert put.get(timeout=60) == 1
    assert paged == PAGED + len(b"after")
    assert reads.records and all(on_loop for on_loop, _ in reads.records)  # through the gate, on the loop
    monkeypatch.undo()
    assert drain(coll, "q") == [*BACKLOG, b"after"]
    coll.close()


@pytest.mark.parametrize("check_sizes", [False, True], ids=["read-behind", "replay"])
def test_a_reader_reads_each_large_record_in_one_read(tmp_path: Path, reads: Reads, check_sizes: bool) -> None:
    items = [large(1, READ_CHUNK + 5), b"small", large(2, 3 * READ_CHUNK), b""]
    journal = _journal(tmp_path, *(codec.encode_addx(7, 9, item) for item in items), b"\x01")
    reader = JournalReader(str(journal), check_sizes=check_sizes)
    records = [record for _, record in reader]
    reader.close()
    assert records == [codec.AddX(7, 9, item) for item in items] + [codec.Remove()]
    assert max(reads.fills) <= READ_CHUNK
    record_sizes = [size for _, size in reads.records]
    # Read-behind reads the large items alone; replay reads each whole record (its sizes checked).
    assert record_sizes == [len(items[0]) + 21 * check_sizes, len(items[2]) + 21 * check_sizes]


def test_a_size_the_file_does_not_hold_allocates_nothing_and_is_refused(tmp_path: Path) -> None:
    """A size field damaged to near 2 GB, whole records after it: refused at start, as before,
    without the reader allocating the size it claims; salvage sets the damage aside."""
    head = codec.encode_addx(1, 0, b"kept")
    damaged = bytearray(codec.encode_addx(1, 0, b"d" * 100))
    damaged[1:5] = (codec.MAX_BLOCK - 1).to_bytes(4, "little")
    after = [codec.encode_addx(1, 0, b"x" * 40) for _ in range(3)]
    journal = _journal(tmp_path, head, bytes(damaged), *after)
    for check_sizes in (False, True):
        reader = JournalReader(str(journal), check_sizes=check_sizes)
        tracemalloc.start()
        try:
            assert [record for _, record in reader] == [codec.AddX(1, 0, b"kept")]
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 4 << 20
        error = reader.tail_damage(last=True)
        reader.close()
        assert isinstance(error, CorruptJournalError) and error.offset == len(head)
    refused = open_collection(tmp_path, SETTINGS)
    assert f"offset {len(head)}" in refused.refused_queues()["q"]
    refused.close()
    coll = open_collection(tmp_path, SETTINGS, salvage=True)
    assert drain(coll, "q") == [b"kept"]
    assert aside(tmp_path), "the damaged bytes were not set aside"
    coll.close()


def test_a_torn_large_record_is_cut_off_as_before(tmp_path: Path) -> None:
    """A large item's record cut short at the end of the live journal is a torn write: cut off
    with a copy kept, the items before it kept."""
    record = codec.encode_addx(1, 0, b"Z" * (2 * READ_CHUNK))
    journal = _journal(tmp_path, codec.encode_addx(1, 0, b"before"), record[:READ_CHUNK + 100])
    torn = journal.stat().st_size
    coll = open_collection(tmp_path, SETTINGS)
    assert drain(coll, "q") == [b"before"]
    coll.close()
    assert journal.stat().st_size < torn and "q" in journal_files(tmp_path)
    assert any(len(copy) == READ_CHUNK + 100 for copy in aside(tmp_path).values())
    assert [record for _, record in read_journal(str(journal))][0] == codec.AddX(1, 0, b"before")


def test_a_large_opcode_8_record_is_read_in_one_read(tmp_path: Path, reads: Reads) -> None:
    """Released Kestrel 2.4's CONTINUE (opcode 8, a CONTINUE or a STATE_DUMP by what follows it)
    larger than the buffer: the whole record and the byte after it in one read, not a buffer grown
    by doubling fills; a STATE_DUMP and its ADD_XID records after it read as before."""
    item = large(3, 3 * READ_CHUNK)
    t = 1_700_000_000_000
    records = [codec.Continue(5, t, 0, item), codec.StateDump(6, 1), codec.AddXid(6, t, 0, b"x"),
               codec.RemoveTentative(), codec.Continue(6, t, t + 60_000, large(4, 2 * READ_CHUNK))]
    journal = _journal(tmp_path, *map(codec.encode, records))
    for check_sizes in (False, True):
        reads.records.clear()
        reads.fills.clear()
        reader = JournalReader(str(journal), check_sizes=check_sizes)
        assert [record for _, record in reader] == records
        reader.close()
        assert max(reads.fills) <= READ_CHUNK
        # each with the byte after it asked for (the last, at the end of the file, has none)
        assert [size for _, size in reads.records] == [len(item) + 26, 2 * READ_CHUNK + 26]


def _writer_file(path: Path, *records: k3.Put, raw: bytes = b"") -> Path:
    """Writer file `q.1` holding `records`, then `raw`; the queue's reader has consumed nothing."""
    journal = path / "q.1"
    journal.write_bytes(k3.WRITER_MAGIC + b"".join(map(k3.encode, records)) + raw)
    (path / "q.read.").write_bytes(k3.READER_MAGIC + k3.encode(k3.ReadHead(0)))
    return journal


def test_a_kestrel3_reader_reads_each_large_put_in_one_read(tmp_path: Path, reads: Reads) -> None:
    """PUTs with and without an expiry (8 and 6 header words): each item larger than the buffer read
    on its own in one read of its size, never in the buffer's fills."""
    records = [k3.Put(1, 0, 7, 9, large(1, READ_CHUNK + 5)), k3.Put(2, 1, 7, None, b"small"),
               k3.Put(3, 2, 7, None, large(2, 3 * READ_CHUNK)), k3.Put(4, 0, 7, 9, b"")]
    reader = RecordReader(str(_writer_file(tmp_path, *records)))
    assert [record for _, record in reader] == records
    assert reader.torn is None
    reader.close()
    assert max(reads.fills) <= READ_CHUNK
    assert reads.records == [(True, READ_CHUNK + 5), (True, 3 * READ_CHUNK)]


def test_a_kestrel3_put_damaged_in_its_header_is_refused_before_its_item_is_read(
        tmp_path: Path, reads: Reads) -> None:
    kept = k3.Put(1, 0, 7, None, b"kept")
    damaged = bytearray(k3.encode(k3.Put(2, 0, 7, None, large(2, 2 * READ_CHUNK))))
    damaged[9:17] = bytes(8)  # item id 0
    journal = _writer_file(tmp_path, kept, raw=bytes(damaged))
    reader = RecordReader(str(journal))
    assert reader.next() == (4, kept)
    with pytest.raises(CorruptJournalError, match="PUT of item id 0") as caught:
        reader.next()
    reader.close()
    assert caught.value.offset == 4 + len(k3.encode(kept))
    assert not reads.records and max(reads.fills) <= READ_CHUNK


def test_a_kestrel3_size_the_file_does_not_hold_allocates_nothing_and_is_refused(tmp_path: Path) -> None:
    """A PUT's size damaged to near 2 GB, whole records after it: refused at start as damage, naming
    its offset, without the reader allocating the size it claims; salvage sets it aside."""
    head = k3.encode(k3.Put(1, 0, 7, None, b"kept"))
    damaged = bytearray(k3.encode(k3.Put(2, 0, 7, None, b"d" * 100)))
    damaged[1:5] = (k3.MAX_DATA - 1).to_bytes(4, "little")
    after = [k3.encode(k3.Put(n, 0, 7, None, b"x" * 40)) for n in (3, 4, 5)]
    journal = _writer_file(tmp_path, raw=head + bytes(damaged) + b"".join(after))
    reader = RecordReader(str(journal))
    tracemalloc.start()
    try:
        assert [record for _, record in reader] == [k3.Put(1, 0, 7, None, b"kept")]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20 and reader.torn is not None
    error = reader.tail_damage()
    reader.close()
    assert isinstance(error, CorruptJournalError) and error.offset == 4 + len(head)
    refused = open_collection(tmp_path, settings("kestrel3"))
    assert f"offset {4 + len(head)}" in refused.refused_queues()["q"]
    refused.close()
    coll = open_collection(tmp_path, settings("kestrel3"), salvage=True)
    assert drain(coll, "q") == [b"kept"]
    assert aside(tmp_path), "the damaged bytes were not set aside"
    coll.close()


def test_a_torn_large_kestrel3_put_is_cut_off_as_before(tmp_path: Path) -> None:
    record = k3.encode(k3.Put(2, 0, 7, None, b"Z" * (2 * READ_CHUNK)))
    journal = _writer_file(tmp_path, k3.Put(1, 0, 7, None, b"before"), raw=record[:READ_CHUNK + 100])
    torn = journal.stat().st_size
    coll = open_collection(tmp_path, settings("kestrel3"))
    assert drain(coll, "q") == [b"before"]
    coll.close()
    assert journal.stat().st_size < torn
    assert any(len(copy) == READ_CHUNK + 100 for copy in aside(tmp_path).values())
