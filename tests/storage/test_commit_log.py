"""The commit log (`commit_log: on`): its records, recovery at start-up, and the live log under a
queue collection: what a reply acknowledged is in the log, and recovery puts it in the journals."""

from __future__ import annotations

import errno
import io
import itertools
import os
import random
import shutil
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import gevent
import gevent.event
import greenlet
import pytest

from kestrel.storage import QueueCollection, QueueConfigs, acknowledgements, commit_log, disk, torn_tail
from kestrel.storage.clock import FakeClock
from kestrel.storage.commit_log import MARK, encode_record, read_segment, recover
from kestrel.storage.errors import QueueDamaged
from kestrel.storage.fsync.group_commit import GroupCommit, ThreadFsync, native_threads
from kestrel.storage.journal_file import JournalWriter
from kestrel.storage.kestrel3 import codec as k3
from kestrel.storage.kestrel3 import files as kestrel3_files
from kestrel.storage.queue_path import list_journal_files
from kestrel.storage.runtime import GeventRuntime, ManualRuntime
from kestrel.storage.tools import convert, dump
from tests.conftest import STALL_S
from tests.support.power_loss import Disk
from tests.support.queues import drain, one, open_collection
from tests.support.slow_disk import slow_fdatasyncs, until_begun

T0 = 1_700_000_000_000


def segment(path: Path, *records: bytes, name: str = "1") -> Path:
    folder = Path(commit_log.directory(str(path)))
    folder.mkdir(parents=True, exist_ok=True)
    file = folder / name
    file.write_bytes(MARK + b"".join(records))
    return file


def aside(path: Path, name: str) -> Path:
    """A copy damage handling kept, in the server's own directory."""
    return path / ".kestrel" / "aside" / name


def collection(path: Path, on: bool = True, **queue: Any) -> QueueCollection:
    """A collection whose queues sync `always`, on a runtime whose timers only tests move and whose
    fsyncs go through `os` (no group commit: `tests/support/power_loss.py` sees them)."""
    return open_collection(path, {"sync_journal": "always", **queue}, runtime=ManualRuntime(clock=FakeClock(T0)),
                           commit_log=on)


# ---------------------------------------------------------------------------------------------
# Records and segments


def test_records_read_back_with_their_offsets(tmp_path: Path) -> None:
    first = encode_record("jobs", 0, 0, b"abc")
    second = encode_record("jobs+audit", 1_700_000_000_123, 3, b"")
    seg = read_segment(str(segment(tmp_path, first, second)), last=True)
    assert [(at, r.queue, r.epoch, r.offset, r.data) for at, r in seg.records] == [
        (len(MARK), "jobs", 0, 0, b"abc"), (len(MARK) + len(first), "jobs+audit", 1_700_000_000_123, 3, b"")]
    assert seg.torn_at is None


def test_a_record_is_laid_out_as_the_format_says() -> None:
    body = struct.pack("<H", 4) + b"jobs" + struct.pack("<QQ", commit_log.WRITER << 56 | 7, 3) + b"abc"
    assert encode_record("jobs", 7, 3, b"abc", commit_log.WRITER) == struct.pack("<II", len(body), zlib.crc32(body)) + body


def test_the_compiled_record_encoding_matches_its_python_reference() -> None:
    from kestrel.storage import _log_record  # built with the C helpers (src/kestrel/storage/_log_record.c)

    rng = random.Random(38)
    for n in range(300):
        head = commit_log.record_head(rng.choice(["q", "jobs+audit", "é" * 40, "x" * 1000]),
                                      rng.choice(commit_log._KINDS), rng.choice([0, rng.getrandbits(56), (1 << 56) - 1]))
        offset = rng.choice([0, rng.getrandbits(64)])
        data = [rng.randbytes(rng.choice([0, 1, 7, 128, 70_000])) for _ in range(rng.randrange(4))]
        start = rng.randbytes(rng.randrange(50))  # what the turn's buffer held already
        compiled, python = bytearray(start), bytearray(start)
        assert _log_record.append_record(compiled, head, offset, data) is True
        assert commit_log.append_record_python(python, head, offset, data)
        assert compiled == python, n
    out = bytearray(b"held")
    assert _log_record.append_record(out, commit_log.record_head("q", 0, 0), 0, [b"a", memoryview(b"b")]) is False
    assert out == b"held"  # declined (a part not bytes), nothing appended: left to the Python
    assert _log_record.append_record(out, commit_log.record_head("q", 0, 0), 0, bytearray(b"ab")) is False
    assert out == b"held"
    one, parts = bytearray(), bytearray()
    assert _log_record.append_record(one, commit_log.record_head("q", 0, 0), 3, b"ab") is True  # one piece
    assert commit_log.append_record_python(parts, commit_log.record_head("q", 0, 0), 3, [b"a", b"b"])
    assert one == parts


def test_the_compiled_records_crc_32_is_zlibs_at_every_short_length_seed_and_alignment() -> None:
    """The C helper takes short pieces' CRC-32 with its own tables, eight bytes a step, and leaves
    long ones to zlib: every length across that edge and the byte-wise tail, a head of any length
    (the queue's name), any alignment of the buffer's end, a body split into parts at random."""
    from kestrel.storage import _log_record  # built with the C helpers (src/kestrel/storage/_log_record.c)

    rng = random.Random(39)
    for size in range(700):
        body = rng.randbytes(size)
        cuts = sorted(rng.randrange(size + 1) for _ in range(rng.randrange(4)))
        data = [body[a:b] for a, b in zip([0, *cuts], [*cuts, size], strict=True)]
        head = commit_log.record_head("q" * rng.randrange(1, 40), rng.choice(commit_log._KINDS), rng.getrandbits(56))
        offset = rng.getrandbits(64)
        start = rng.randbytes(rng.randrange(16))
        compiled, python = bytearray(start), bytearray(start)
        assert _log_record.append_record(compiled, head, offset, data) is True
        assert commit_log.append_record_python(python, head, offset, data)
        assert compiled == python, size
        fields = head + struct.pack("<Q", offset)
        assert compiled[len(start) + 4:len(start) + 8] == struct.pack("<I", zlib.crc32(fields + body)), size


def test_crc32_combine_compiled_and_its_python_reference_join_checksums_as_zlib_does() -> None:
    from kestrel.storage import _log_record  # built with the C helpers (src/kestrel/storage/_log_record.c)

    rng = random.Random(41)
    for n in range(200):
        first, second = (rng.randbytes(rng.choice([0, 1, 3, 1000, rng.randrange(70_000)])) for _ in range(2))
        joined = zlib.crc32(first + second)
        assert _log_record.crc32_combine(zlib.crc32(first), zlib.crc32(second), len(second)) == joined, n
        assert commit_log.crc32_combine_python(zlib.crc32(first), zlib.crc32(second), len(second)) == joined, n
    assert commit_log.crc32_combine_python(5, 7, 1 << 39) == _log_record.crc32_combine(5, 7, 1 << 39)


def test_range_checksums_are_zlibs_crc32_of_every_range() -> None:
    rng = random.Random(42)
    data = rng.randbytes(10_000)
    checksums = commit_log.RangeChecksums(data)
    step = commit_log.RangeChecksums.STEP
    edges = [0, 1, step - 1, step, step + 1, 2 * step, 3 * step + 5, len(data) - 1, len(data)]
    ranges = [(a, b) for a in edges for b in edges if a <= b]
    ranges += [tuple(sorted((rng.randrange(len(data) + 1), rng.randrange(len(data) + 1)))) for _ in range(300)]
    for start, end in ranges:
        assert checksums.crc(start, end) == zlib.crc32(data[start:end]), (start, end)


def test_a_last_write_torn_at_every_offset_is_a_torn_tail_and_the_records_before_it_stay(tmp_path: Path) -> None:
    kept = encode_record("q", 0, 0, b"kept")
    write = encode_record("q", 0, 4, b"one") + encode_record("q", 0, 7, b"two")  # one turn's write
    for cut in range(1, len(write)):
        seg = read_segment(str(segment(tmp_path, kept, write[:cut])), last=True)
        whole = 1 if cut >= len(write) // 2 else 0
        assert [r.data for _, r in seg.records] == [b"kept", b"one"][:1 + whole], cut
        torn_at = len(MARK) + len(kept) + whole * (len(write) // 2)
        assert seg.torn_at == (None if cut == len(write) // 2 else torn_at), cut


def test_zeros_after_the_last_record_of_a_version_1_segment_are_a_torn_tail(tmp_path: Path) -> None:
    path = segment(tmp_path)
    path.write_bytes(commit_log.MARK_V1 + encode_record("q", 0, 0, b"x") + bytes(40))
    seg = read_segment(str(path), last=True)
    assert [r.data for _, r in seg.records] == [b"x"] and seg.torn_at is not None


@pytest.mark.parametrize("last", [True, False])
def test_zeros_to_the_end_of_a_segment_laid_down_ahead_are_its_clean_end(tmp_path: Path, last: bool) -> None:
    seg = read_segment(str(segment(tmp_path, encode_record("q", 0, 0, b"x"), bytes(4096))), last=last)
    assert [r.data for _, r in seg.records] == [b"x"]
    assert seg.torn_at is None and seg.damage == []


def test_a_record_torn_over_the_zeros_laid_down_is_a_torn_tail(tmp_path: Path) -> None:
    write = encode_record("q", 0, 1, b"never acknowledged")
    for cut in range(1, len(write)):
        torn = write[:cut] + bytes(len(write) - cut)  # what reached the disk, over the zeros
        seg = read_segment(str(segment(tmp_path, encode_record("q", 0, 0, b"x"), torn, bytes(4096))), last=True)
        assert [r.data for _, r in seg.records] == [b"x"], cut
        at = len(MARK) + len(encode_record("q", 0, 0, b"x"))
        assert seg.damage == [] and seg.torn_at in (None if not any(write[:cut]) else at,), cut


def test_a_byte_after_the_zeros_of_a_segment_laid_down_is_damage(tmp_path: Path) -> None:
    kept = encode_record("q", 0, 0, b"x")
    seg = read_segment(str(segment(tmp_path, kept, bytes(4096), b"\x01", bytes(100))), last=True)
    assert [r.data for _, r in seg.records] == [b"x"] and seg.torn_at is None
    (damage,) = seg.damage
    assert damage.at == len(MARK) + len(kept)


def test_a_damaged_record_with_records_after_it_is_damage_and_the_records_after_it_are_read(
        tmp_path: Path) -> None:
    first = encode_record("q", 0, 0, b"first")
    damaged = bytearray(encode_record("q", 0, 5, b"second"))
    damaged[-1] ^= 0x01
    path = segment(tmp_path, first, bytes(damaged), encode_record("q", 0, 11, b"third"))
    seg = read_segment(str(path), last=True)
    assert [r.data for _, r in seg.records] == [b"first", b"third"]
    (damage,) = seg.damage
    assert (damage.at, damage.end) == (len(MARK) + len(first), len(MARK) + len(first) + len(damaged))
    assert "checksum" in damage.reason and damage.record is None
    assert damage.claims is not None and damage.claims.queue == "q"  # whose it seems to be
    assert seg.torn_at is None


def memos(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The places each chain memo the torn-tail rule makes spans, as it makes them."""
    spans: list[int] = []

    class Counted(torn_tail.Chains):
        def __init__(self, data: bytes, end: int, records: torn_tail.Records, start: int = 0) -> None:
            spans.append(end - start)
            super().__init__(data, end, records, start)

    monkeypatch.setattr(torn_tail, "Chains", Counted)
    return spans


@pytest.mark.pure_build
@pytest.mark.parametrize("last", [True, False])
def test_a_segment_s_damaged_records_are_judged_with_one_memo_of_its_places(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, last: bool) -> None:
    """Reading on past damage judged each damaged record with a copy of the rest of the segment and
    a memo of its own, time growing with damaged records × bytes (4 MB of every other record
    damaged: 33 s to read). The places memoed for the whole segment are now at most twice its
    bytes, and every record and damaged span is found as before."""
    memoed = memos(monkeypatch)
    records = [bytearray(encode_record("q", 0, n, b"%064d" % n)) for n in range(400)]
    for record in records[1::2]:
        record[4] ^= 1  # its checksum
    path = segment(tmp_path, *map(bytes, records), bytes(4096))
    seg = read_segment(str(path), last=last)
    starts = list(itertools.accumulate(map(len, records), initial=len(MARK)))
    assert [at for at, _ in seg.records] == starts[:-1:2]
    spans = [(starts[n], starts[n + 1]) for n in range(1, 399, 2)]
    assert [(d.at, d.end) for d in seg.damage] == spans + ([] if last else [(starts[-2], starts[-1] + 4096)])
    assert seg.torn_at == (starts[-2] if last else None)  # the last one, zeros after it: a torn write
    assert sum(memoed) <= 2 * path.stat().st_size, sum(memoed)


@pytest.mark.pure_build
def test_a_torn_last_write_is_judged_with_memos_of_what_follows_it_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The memos span the torn write and the zeros after it, not the records before (a segment of
    64 MB torn at its end took two of 64 MB)."""
    memoed = memos(monkeypatch)
    kept = [encode_record("q", 0, n * 1000, bytes(1000)) for n in range(1000)]
    torn = encode_record("q", 0, 1_000_000, b"torn")[:-2]
    path = segment(tmp_path, *kept, torn, bytes(4096))
    seg = read_segment(str(path), last=True)
    assert len(seg.records) == 1000 and seg.torn_at == len(MARK) + sum(map(len, kept))
    assert memoed and sum(memoed) <= 2 * (len(torn) + 4096), memoed


def test_a_torn_record_in_a_segment_that_is_not_the_last_is_damage(tmp_path: Path) -> None:
    path = segment(tmp_path, encode_record("q", 0, 0, b"x")[:-1])
    seg = read_segment(str(path), last=False)
    assert seg.torn_at is None and "before the next file" in seg.damage[0].reason


def test_a_file_without_the_mark_is_damage(tmp_path: Path) -> None:
    path = segment(tmp_path)
    path.write_bytes(b"not a segment at all")
    mark, rest = read_segment(str(path), last=True).damage
    assert "mark b'not a se' is damaged" in mark.reason and not mark.hides
    assert (rest.at, rest.end, rest.hides) == (len(MARK), 20, True)  # no record found after it


@pytest.mark.parametrize("byte", range(len(MARK)))
def test_a_damaged_mark_hides_no_record_the_segment_holds(tmp_path: Path, byte: int) -> None:
    """A flipped byte in a segment's mark: its records are placed, no queue is refused, and the
    segment is kept as a copy like any damaged one."""
    (tmp_path / "q").write_bytes(b"aaa")
    path = segment(tmp_path, encode_record("q", 0, 3, b"bb"), encode_record("q", 0, 5, b"cc"))
    data = bytearray(path.read_bytes())
    data[byte] ^= 0x01
    path.write_bytes(bytes(data))
    assert [r.data for _, r in read_segment(str(path), last=True).records] == [b"bb", b"cc"]
    recovery = recover(str(tmp_path), T0)
    assert (recovery.written, recovery.refused) == (2, {})
    assert (tmp_path / "q").read_bytes() == b"aaabbcc"
    assert Path(f"{path}.damaged-{T0}").read_bytes() == bytes(data)


@pytest.mark.parametrize("bit", range(32))
def test_a_size_field_with_a_flipped_bit_in_the_middle_is_never_a_torn_tail(tmp_path: Path, bit: int) -> None:
    records = [encode_record("q", 0, 10 * n, b"%010d" % n) for n in range(40)]
    data = bytearray(b"".join(records))
    at = sum(map(len, records[:20]))
    data[at + bit // 8] ^= 1 << (bit % 8)
    seg = read_segment(str(segment(tmp_path, bytes(data))), last=True)
    assert seg.torn_at is None, bit
    # Only the size was damaged: the record is found again between its start and the next one.
    assert [r.data for _, r in seg.records] == [b"%010d" % n for n in range(40)], bit
    assert [d.at for d in seg.damage] == [len(MARK) + at], bit


# ---------------------------------------------------------------------------------------------
# Recovery by position


def journal_bytes(path: Path, name: str) -> dict[str, bytes]:
    files = list_journal_files(str(path), name)
    return {os.path.basename(p): Path(p).read_bytes() for p in files.replay_order()}


def test_recovery_appends_what_a_journal_lacks_and_skips_what_it_holds(tmp_path: Path) -> None:
    (tmp_path / "q").write_bytes(b"aaa")
    segment(tmp_path, encode_record("q", 0, 0, b"aaa"), encode_record("q", 0, 3, b"bb"),
            encode_record("new", 0, 0, b"c"))
    assert recover(str(tmp_path), T0).written == 2
    assert (tmp_path / "q").read_bytes() == b"aaabb"
    assert (tmp_path / "new").read_bytes() == b"c"
    assert commit_log.segment_paths(str(tmp_path)) == []
    assert recover(str(tmp_path), T0).written == 0


def test_a_journal_torn_inside_a_logged_record_is_cut_there_keeping_a_copy(tmp_path: Path) -> None:
    (tmp_path / "q").write_bytes(b"aaab")  # the torn start of "bb"
    segment(tmp_path, encode_record("q", 0, 3, b"bb"))
    recover(str(tmp_path), T0)
    assert (tmp_path / "q").read_bytes() == b"aaabb"
    assert aside(tmp_path, f"q.torn-{T0}").read_bytes() == b"b"


def test_a_journal_torn_at_every_offset_of_its_last_logged_write_is_completed(tmp_path: Path) -> None:
    last = b"\x02" + b"z" * 30  # the bytes of one change
    for cut in range(len(last) + 1):
        path = tmp_path / str(cut)
        path.mkdir()
        (path / "q").write_bytes(b"aaa" + last[:cut])
        segment(path, encode_record("q", 0, 0, b"aaa"), encode_record("q", 0, 3, last))
        recover(str(path), T0)
        assert (path / "q").read_bytes() == b"aaa" + last, cut
        assert aside(path, f"q.torn-{T0}").exists() == (0 < cut < len(last)), cut


@pytest.mark.parametrize("journal", [b"aaaXX", b"aaa\0\0", b"aaa\0\0\0\0\0"])
def test_a_journal_holding_other_bytes_where_a_logged_record_goes_takes_the_logs_keeping_a_copy(
        tmp_path: Path, journal: bytes) -> None:
    (tmp_path / "q").write_bytes(journal)  # a changed byte, a zero-filled tail
    segment(tmp_path, encode_record("q", 0, 3, b"bb"))
    recovery = recover(str(tmp_path), T0)
    assert (recovery.written, recovery.refused) == (1, {})
    assert (tmp_path / "q").read_bytes() == b"aaabb" + journal[5:]
    assert aside(tmp_path, f"q.replaced-{T0}").read_bytes() == journal[3:]


def test_a_dry_run_places_each_record_after_those_it_placed_before(tmp_path: Path) -> None:
    """What `kestrel journal check` predicts is what recovery does: a journal that lost several
    logged changes (a power cut) is appended all of them, the later ones after the earlier."""
    (tmp_path / "q").write_bytes(b"aaa")
    segment(tmp_path, encode_record("q", 0, 0, b"aaa"), encode_record("q", 0, 3, b"bb"),
            encode_record("q", 0, 5, b"cc"), encode_record("q", 0, 7, b"dd"))
    predicted = recover(str(tmp_path), T0, dry_run=True)
    assert (predicted.written, predicted.refused) == (3, {})
    assert (tmp_path / "q").read_bytes() == b"aaa"  # nothing changed
    done = recover(str(tmp_path), T0)
    assert (done.written, done.refused) == (3, {}) and (tmp_path / "q").read_bytes() == b"aaabbccdd"


def test_a_journal_ending_before_a_logged_record_refuses_its_queue_alone_and_keeps_the_records(
        tmp_path: Path) -> None:
    (tmp_path / "q").write_bytes(b"a")
    (tmp_path / "r").write_bytes(b"")
    path = segment(tmp_path, encode_record("q", 0, 3, b"bb"), encode_record("r", 0, 0, b"rr"))
    recovery = recover(str(tmp_path), T0)
    error = recovery.refused["q"]
    assert list(recovery.refused) == ["q"] and (error.path, error.offset) == (str(path), len(MARK))
    assert "ends at 1, before offset 3" in error.reason
    assert "--salvage" in error.remedy() and "set the log aside" not in error.remedy()
    assert (tmp_path / "q").read_bytes() == b"a" and (tmp_path / "r").read_bytes() == b"rr"
    assert commit_log.segment_paths(str(tmp_path)) == [] and list(commit_log.held_paths(str(tmp_path))) == ["q"]
    again = recover(str(tmp_path), T0 + 1)  # refused until the journal is repaired, its records kept
    assert list(again.refused) == ["q"] and (tmp_path / "q").read_bytes() == b"a"
    (tmp_path / "q").write_bytes(b"aaa")  # restored from a copy
    assert recover(str(tmp_path), T0 + 2).refused == {}
    assert (tmp_path / "q").read_bytes() == b"aaabb" and commit_log.held_paths(str(tmp_path)) == {}


def test_a_refused_kestrel3_queue_s_held_records_keep_their_kinds(tmp_path: Path) -> None:
    """A writer file ending before a logged record's offset refuses the queue; once the file is
    restored, its held records go where they went: a writer file's bytes into that file and a
    reader's into its checkpoint (they were held as Kestrel 2 journal records)."""
    put, second = (k3.encode(k3.Put(n, 0, T0, None, b"item")) for n in (1, 2))
    (tmp_path / "q.100").write_bytes(k3.WRITER_MAGIC)  # its first put lost, as no power cut does
    (tmp_path / "q.read.").write_bytes(k3.READER_MAGIC)
    done = k3.encode(k3.ReadDone((2,)))
    segment(tmp_path, encode_record("q", 100, len(k3.WRITER_MAGIC) + len(put), second, commit_log.WRITER),
            encode_record("q", 0, 0, done, commit_log.READER))
    assert list(recover(str(tmp_path), T0).refused) == ["q"]
    (tmp_path / "q.100").write_bytes(k3.WRITER_MAGIC + put)  # restored from a copy
    assert recover(str(tmp_path), T0 + 1).refused == {}
    assert (tmp_path / "q.100").read_bytes() == k3.WRITER_MAGIC + put + second
    assert (tmp_path / "q.read.").read_bytes().endswith(done) and not (tmp_path / "q").exists()


def test_a_queue_the_log_s_damage_refused_stays_refused_at_every_later_start(tmp_path: Path) -> None:
    """The damaged bytes are held with the queue's records and judged again at each recovery: the
    next start placed the held records and served the queue without the damaged one (its last),
    the refusal forgotten. Once the journal holds what the damaged record seems to, the queue is
    served; with salvage, the damaged bytes are set aside with the records."""
    (tmp_path / "q").write_bytes(b"first")
    (tmp_path / "r").write_bytes(b"")
    damaged = bytearray(encode_record("q", 0, 5, b"second"))
    damaged[-1] ^= 0x01
    segment(tmp_path, encode_record("q", 0, 0, b"first"), bytes(damaged), encode_record("r", 0, 0, b"rr"))
    assert list(recover(str(tmp_path), T0).refused) == ["q"] and (tmp_path / "r").read_bytes() == b"rr"
    for later in (1, 2):
        again = recover(str(tmp_path), T0 + later)
        assert list(again.refused) == ["q"] and "held with its records" in again.refused["q"].reason
        assert again.refused["q"].held == 1 and (tmp_path / "q").read_bytes() == b"first"
    salvaged = tmp_path / "salvaged"
    shutil.copytree(tmp_path, salvaged, ignore=shutil.ignore_patterns("salvaged"))
    assert recover(str(salvaged), T0 + 3, salvage=True).refused == {}
    (aside_copy,) = (salvaged / ".kestrel" / "aside").iterdir()
    kept = read_segment(str(aside_copy), last=True).records
    assert [(r.kind, r.data) for _, r in kept] == [(commit_log.JOURNAL, b"first"), (commit_log.DAMAGED, damaged)]
    (tmp_path / "q").write_bytes(b"first" + bytes(damaged[-6:]))  # restored, with what it seems to hold
    assert recover(str(tmp_path), T0 + 4).refused == {} and commit_log.held_paths(str(tmp_path)) == {}


def test_a_queue_refused_by_damage_alone_is_told_what_is_held_of_it(tmp_path: Path) -> None:
    """Its one record in the log damaged: the remedy said "the commit log's 0 records" were kept."""
    (tmp_path / "q").write_bytes(b"first")
    damaged = bytearray(encode_record("q", 0, 5, b"second"))
    damaged[-1] ^= 0x01
    segment(tmp_path, bytes(damaged), encode_record("r", 0, 0, b"rr"))
    refused = recover(str(tmp_path), T0).refused["q"]
    assert (refused.held, refused.damaged) == (0, 1)
    assert "what the commit log holds of queue 'q' (1 damaged span) is kept" in refused.remedy()
    assert "0 record" not in refused.remedy()


def test_salvage_keeps_a_refused_queues_journal_as_it_is_and_sets_its_records_aside(tmp_path: Path) -> None:
    (tmp_path / "q").write_bytes(b"a")
    segment(tmp_path, encode_record("q", 0, 3, b"bb"))
    recovery = recover(str(tmp_path), T0, salvage=True)
    assert recovery.refused == {} and (tmp_path / "q").read_bytes() == b"a"
    (copy,) = recovery.copies
    assert [r.data for _, r in read_segment(copy, last=True).records] == [b"bb"]
    assert not commit_log.pending(str(tmp_path))


def test_records_go_to_the_journal_of_their_epoch(tmp_path: Path) -> None:
    (tmp_path / "q.100").write_bytes(b"old")  # live from epoch 0 until the rotation at 100
    (tmp_path / "q.200").write_bytes(b"")  # live from 100 to 200
    (tmp_path / "q").write_bytes(b"")
    segment(tmp_path, encode_record("q", 0, 3, b"+0"), encode_record("q", 100, 0, b"100"),
            encode_record("q", 200, 0, b"200"))
    recover(str(tmp_path), T0)
    assert journal_bytes(tmp_path, "q") == {"q.100": b"old+0", "q.200": b"100", "q": b"200"}


def test_kestrel3_writer_records_go_to_the_file_of_their_number_and_a_new_file_is_made_from_its_header(
        tmp_path: Path) -> None:
    put = k3.encode(k3.Put(1, 0, T0, None, b"one"))
    (tmp_path / "q.100").write_bytes(k3.WRITER_MAGIC + put[:3])  # cut short by a power cut
    segment(tmp_path, encode_record("q", 100, 0, k3.WRITER_MAGIC, commit_log.WRITER),
            encode_record("q", 100, 4, put, commit_log.WRITER),
            encode_record("q", 101, 0, k3.WRITER_MAGIC, commit_log.WRITER))  # its creation was lost
    recovery = recover(str(tmp_path), T0)
    assert recovery.refused == {}
    assert (tmp_path / "q.100").read_bytes() == k3.WRITER_MAGIC + put
    assert (tmp_path / "q.101").read_bytes() == k3.WRITER_MAGIC
    assert aside(tmp_path, f"q.100.torn-{T0}").read_bytes() == put[:3]


def checkpoint_file(path: Path, name: str, *records: k3.Record) -> Path:
    file = path / name
    file.write_bytes(k3.READER_MAGIC + b"".join(map(k3.encode, records)))
    return file


def reader_record(queue: str, *records: k3.Record) -> bytes:
    return encode_record(queue, 0, 0, b"".join(map(k3.encode, records)), commit_log.READER)


def test_kestrel3_reader_records_are_applied_by_meaning_whatever_version_of_the_checkpoint_is_there(
        tmp_path: Path) -> None:
    # Logged while the checkpoint grew: ids 1 to 3 consumed, then 5; the checkpoint was then
    # rewritten whole (head 3, 5 done), and 7 was logged after.
    logged = [reader_record("q", k3.ReadHead(2)), reader_record("q", k3.ReadDone((5,)), k3.ReadHead(3)),
              reader_record("q", k3.ReadDone((7,)))]
    rewritten = checkpoint_file(tmp_path, "q.read.", k3.ReadHead(3), k3.ReadDone((5,)))
    lost = checkpoint_file(tmp_path, "q.read.a", k3.ReadHead(1))  # a child's, lacking all after 1
    segment(tmp_path, *logged, reader_record("q+a", k3.ReadHead(4)))
    before = rewritten.read_bytes()
    assert recover(str(tmp_path), T0).refused == {}
    assert rewritten.read_bytes() == before + k3.encode(k3.ReadDone((7,)))  # what it lacked, once
    assert kestrel3_files.read_checkpoint(str(rewritten)) == kestrel3_files.ReaderCheckpoint(3, frozenset({5, 7}))
    assert kestrel3_files.read_checkpoint(str(lost)).head == 4
    segment(tmp_path, *logged, name="2")  # recovered again (killed before the segment went): nothing new
    recover(str(tmp_path), T0 + 1)
    assert rewritten.read_bytes() == before + k3.encode(k3.ReadDone((7,)))


def test_a_torn_checkpoint_is_cut_keeping_a_copy_before_the_log_adds_to_it(tmp_path: Path) -> None:
    checkpoint = checkpoint_file(tmp_path, "q.read.", k3.ReadHead(1))
    whole = checkpoint.read_bytes()
    checkpoint.write_bytes(whole + bytes(6))  # a power cut's zeros where an append went
    segment(tmp_path, reader_record("q", k3.ReadHead(2)))
    assert recover(str(tmp_path), T0).refused == {}
    assert checkpoint.read_bytes() == whole + k3.encode(k3.ReadHead(2))
    assert any(p.name.startswith("q.read..torn-") for p in (tmp_path / ".kestrel" / "aside").iterdir())


def test_records_of_a_reader_whose_checkpoint_is_missing_refuse_that_queue_alone(tmp_path: Path) -> None:
    checkpoint_file(tmp_path, "q.read.")
    segment(tmp_path, reader_record("q+gone", k3.ReadHead(2)), reader_record("q", k3.ReadHead(1)))
    recovery = recover(str(tmp_path), T0)
    assert list(recovery.refused) == ["q+gone"] and "missing" in recovery.refused["q+gone"].reason
    assert kestrel3_files.read_checkpoint(str(tmp_path / "q.read.")).head == 1
    assert list(commit_log.held_paths(str(tmp_path))) == ["q+gone"]


@pytest.mark.parametrize("field, value", [
    (10, b"\x00"), (10, b"/"),  # the name "q": a NUL (a path of it raised), a slash (a directory's)
    (19, struct.pack("<Q", 1 << 63 | 5)), (19, struct.pack("<Q", 1 << 60)),  # offsets no seek takes
    (18, bytes([commit_log.READER])),  # a reader's record, whose bytes no reader records are
])
def test_a_damaged_record_claiming_what_no_file_can_hold_refuses_and_never_fails_recovery(
        tmp_path: Path, field: int, value: bytes) -> None:
    """Recovery asks a record whose checksum fails whether its journal holds what it claims: the
    claims are unverified, and a path or a seek made of them raised out of the server's start."""
    (tmp_path / "q").write_bytes(b"first")
    checkpoint_file(tmp_path, "q.read.", k3.ReadHead(0))
    damaged = bytearray(encode_record("q", 0, 5, b"second"))
    damaged[field:field + len(value)] = value
    segment(tmp_path, encode_record("q", 0, 0, b"first"), bytes(damaged), encode_record("q", 0, 11, b"third"))
    recovery = recover(str(tmp_path), T0)
    assert list(recovery.refused) == ["q"] and "the commit log is damaged" in recovery.refused["q"].reason
    assert list(commit_log.held_paths(str(tmp_path))) == ["q"]  # its records kept for the next start


def test_a_damaged_record_claiming_a_queue_nothing_else_knows_refuses_the_queues_of_the_log(
        tmp_path: Path) -> None:
    """Its name damaged into another ("q" into "5"): the queue refused was one no file and no record
    knows, and the queue whose record it was loaded without it."""
    (tmp_path / "q").write_bytes(b"first")
    damaged = bytearray(encode_record("q", 0, 5, b"second"))
    damaged[10:11] = b"5"
    segment(tmp_path, encode_record("q", 0, 0, b"first"), bytes(damaged), encode_record("other", 0, 0, b"x"))
    recovery = recover(str(tmp_path), T0)
    assert list(recovery.refused) == ["other", "q"] and "it may be this queue's" in recovery.refused["q"].reason
    assert (tmp_path / "q").read_bytes() == b"first"  # kept as it is, its records held for the next start
    # each holds the damage's place alone, which refuses it again (its bytes are the segment's copy's)
    again = recover(str(tmp_path), T0 + 1)
    assert list(again.refused) == ["other", "q"]
    for held in commit_log.held_paths(str(tmp_path)).values():
        (_, place), = [(at, r) for at, r in read_segment(held, last=True).records if r.kind == commit_log.DAMAGED]
        assert (place.offset, place.data) == (len(MARK) + len(encode_record("q", 0, 0, b"first")), b"")


def test_the_torn_tail_of_the_log_is_cut_keeping_a_copy_and_what_precedes_it_applied(tmp_path: Path) -> None:
    whole = encode_record("q", 0, 0, b"whole")
    torn = encode_record("q", 0, 5, b"torn")[:-2]
    path = segment(tmp_path, whole, torn)
    recover(str(tmp_path), T0)
    assert (tmp_path / "q").read_bytes() == b"whole"
    assert Path(f"{path}.torn-{T0}").read_bytes() == torn
    assert commit_log.segment_paths(str(tmp_path)) == []


def test_a_damaged_segment_that_also_ends_torn_is_kept_whole_as_its_copy(tmp_path: Path) -> None:
    """Damaged bytes are set aside with a copy: where the segment also ended in a torn write, the
    copy held the torn bytes alone and the damaged record went with the segment."""
    (tmp_path / "q").write_bytes(b"first")
    damaged = bytearray(encode_record("q", 0, 5, b"second"))
    damaged[-1] ^= 0x01
    torn = encode_record("q", 0, 11, b"third")[:-2]
    path = segment(tmp_path, encode_record("q", 0, 0, b"first"), bytes(damaged), encode_record("q", 0, 5, b"x"),
                   torn)
    whole = path.read_bytes()
    recovery = recover(str(tmp_path), T0)
    assert list(recovery.refused) == ["q"]
    assert Path(f"{path}.damaged-{T0}").read_bytes() == whole
    assert commit_log.segment_paths(str(tmp_path)) == []


class Crash(Exception):
    """Stands for the process dying at a failpoint."""


def test_recovery_killed_at_every_step_and_run_again_ends_as_one_run_does(tmp_path: Path) -> None:
    def lay_out(path: Path) -> None:
        path.mkdir()
        (path / "q.100").write_bytes(b"old")
        (path / "q").write_bytes(b"nnX")  # torn inside the second record of epoch 100
        segment(path, encode_record("q", 0, 3, b"+0"), encode_record("q", 100, 0, b"nn"),
                encode_record("q", 100, 2, b"nn"), encode_record("r", 0, 0, b"r"), name="1")
        segment(path, encode_record("r", 0, 1, b"rr"), encode_record("q", 100, 4, b"tail")[:-3], name="2")

    clean = tmp_path / "clean"
    lay_out(clean)
    recover(str(clean), T0)
    expected = {n: journal_bytes(clean, n) for n in ("q", "r")}
    steps = 0
    while True:
        steps += 1
        run = tmp_path / f"killed-{steps}"
        lay_out(run)
        seen = 0

        def fail(step: str, at: int = steps) -> None:
            nonlocal seen
            seen += 1
            if seen == at:
                raise Crash(step)

        commit_log.failpoint = fail
        try:
            recover(str(run), T0)
            finished = True
        except Crash:
            finished = False
        finally:
            commit_log.failpoint = None
        recover(str(run), T0 + 1)  # the next start
        assert {n: journal_bytes(run, n) for n in ("q", "r")} == expected, f"killed at step {steps}"
        assert commit_log.segment_paths(str(run)) == []
        if finished:
            break
    assert steps > 8  # appends, the cut, fsyncs, the segments' cut and deletions


# ---------------------------------------------------------------------------------------------
# The live log


def test_each_change_under_always_is_in_the_log_before_it_returns(tmp_path: Path) -> None:
    coll = collection(tmp_path)
    coll.put("a", [b"one"])
    coll.put("b", [b"two"])
    item = one(coll.remove("a", transaction=True))
    assert item is not None
    coll.confirm("a", [item.xid])
    (seg,) = commit_log.segment_paths(str(tmp_path))
    records = [r for _, r in read_segment(seg, last=True).records]
    assert [r.queue for r in records] == ["a", "b", "a", "a"]
    for queue in ("a", "b"):
        journal = (tmp_path / queue).read_bytes()
        assert b"".join(r.data for r in records if r.queue == queue) == journal
    coll.close()
    assert commit_log.segment_paths(str(tmp_path)) == []  # a clean stop leaves today's files alone
    assert sorted(os.listdir(tmp_path)) == [".kestrel", "a", "b"]
    assert os.listdir(tmp_path / ".kestrel") == []


def test_never_queues_and_commit_log_off_write_no_log(tmp_path: Path) -> None:
    coll = collection(tmp_path / "never", sync_journal="never")
    coll.put("q", [b"x"])
    assert not commit_log.pending(str(tmp_path / "never"))
    coll.close()
    coll = collection(tmp_path / "off", on=False)
    coll.put("q", [b"x"])
    assert not Path(commit_log.directory(str(tmp_path / "off"))).exists()
    coll.close()


def test_a_checkpoint_makes_the_journals_durable_and_drops_the_older_segments(tmp_path: Path) -> None:
    coll = collection(tmp_path)
    coll.put("q", [b"before"])
    assert coll.commit_log is not None
    coll.commit_log.checkpoint()
    coll.put("q", [b"after"])
    (seg,) = commit_log.segment_paths(str(tmp_path))
    assert [r.data[-5:] for _, r in read_segment(seg, last=True).records] == [b"after"]
    coll.close()


def test_records_are_written_over_a_segment_laid_down_ahead_and_its_size_does_not_grow(tmp_path: Path) -> None:
    coll = collection(tmp_path)
    (seg,) = commit_log.segment_paths(str(tmp_path))
    size = os.path.getsize(seg)
    assert size >= commit_log.PREALLOCATE_BYTES and Path(seg).read_bytes() == MARK + bytes(size - len(MARK))
    for n in range(50):
        coll.put("q", [b"item-%d" % n])
    assert os.path.getsize(seg) == size
    records = read_segment(seg, last=True)
    assert len(records.records) == 50 and records.torn_at is None and records.damage == []
    assert commit_log.pending(str(tmp_path))
    assert coll.commit_log is not None
    coll.commit_log.checkpoint()  # the next segment was laid down ahead, and the one after it is
    (seg,) = commit_log.segment_paths(str(tmp_path))
    laid_down = Path(commit_log.directory(str(tmp_path))) / commit_log.PREPARED_NAME
    assert os.path.getsize(seg) >= commit_log.PREALLOCATE_BYTES and laid_down.exists()
    assert not commit_log.pending(str(tmp_path))  # an empty segment laid down holds no record
    coll.close()
    assert not Path(commit_log.directory(str(tmp_path))).exists()


def test_a_kill_in_the_middle_of_a_write_over_the_zeros_loses_no_acknowledged_item(tmp_path: Path) -> None:
    coll = collection(tmp_path)
    for n in range(20):
        coll.put("q", [b"item-%d" % n])
    (seg,) = commit_log.segment_paths(str(tmp_path))
    end = max(at + len(encode_record(r.queue, r.epoch, r.offset, r.data))
              for at, r in read_segment(seg, last=True).records)
    with open(seg, "r+b") as f:  # the start of a write that was never acknowledged, over the zeros
        f.seek(end)
        f.write(encode_record("q", 0, 999, b"never acknowledged")[:11])
    journal = (tmp_path / "q").read_bytes()
    (tmp_path / "q").write_bytes(journal[:len(journal) // 2])  # lost with the page cache
    again = collection(tmp_path)
    assert drain(again, "q") == [b"item-%d" % n for n in range(20)]
    assert [p.name for p in Path(commit_log.directory(str(tmp_path))).iterdir()
            if p.name.startswith("1.torn-")], "the torn write is cut off, a copy kept"
    again.close()


def test_a_killed_process_is_recovered_at_the_next_start_even_with_the_log_off(tmp_path: Path) -> None:
    coll = collection(tmp_path)
    for n in range(20):
        coll.put("q", [b"item-%d" % n])
    journal = (tmp_path / "q").read_bytes()
    (tmp_path / "q").write_bytes(journal[:len(journal) // 2 + 3])  # lost with the page cache
    assert commit_log.pending(str(tmp_path))
    again = collection(tmp_path, on=False)
    assert drain(again, "q") == [b"item-%d" % n for n in range(20)]
    assert not commit_log.pending(str(tmp_path))
    again.close()


@pytest.mark.parametrize("journal_format", ["kestrel2", "kestrel3"])
@pytest.mark.parametrize("on", [True, False], ids=["commit_log-on", "commit_log-off"])
@pytest.mark.parametrize("keep", [0, 5])
def test_a_power_cut_loses_no_acknowledged_change_across_rotations_and_packs(tmp_path: Path, on: bool,
                                                                             keep: int, journal_format: str) -> None:
    with Disk(tmp_path) as disk:
        coll = collection(tmp_path, on, max_memory_size="300", default_journal_size="200",
                          journal_format=journal_format)
        expected = []
        for n in range(60):
            coll.put("q", [b"item-%02d" % n + b"." * 20])
            expected.append(b"item-%02d" % n + b"." * 20)
            if n % 3 == 2:
                assert one(coll.remove("q")) is not None
                expected.pop(0)
        coll.queue("q").wait_for_packing()
        disk.power_cut(str(tmp_path), keep)
        again = collection(tmp_path, on, journal_format=journal_format)
        assert drain(again, "q") == expected
        again.close()


def test_a_power_cut_after_the_first_change_the_log_holds_keeps_it(tmp_path: Path) -> None:
    """The log's folder, made in `.kestrel/` at its first segment, has its name made durable there
    (it was `.kestrel`'s parent that was fsynced): a power cut lost the folder and the change with it."""
    with Disk(tmp_path) as disk:
        collection(tmp_path).put("q", [b"acknowledged"])
        disk.power_cut(str(tmp_path))
    again = collection(tmp_path)
    assert drain(again, "q") == [b"acknowledged"]
    again.close()


def power_cut_under_load(path: Path) -> tuple[list[bytes], str]:
    """Queues `q` and `other` under `commit_log: on`: adds, reliable reads confirmed, then a power
    cut (every journal back to what an fsync covered; the log, fsynced each turn, whole). Returns
    the items `q` must hold, and the log's segment."""
    with Disk(path) as disk:
        coll = collection(path)
        expected = []
        for n in range(120):
            coll.put("q", [b"item-%03d" % n])
            coll.put("other", [b"x"])
            expected.append(b"item-%03d" % n)
            if n % 2:
                item = one(coll.remove("q", transaction=True))
                assert item is not None and item.data == expected.pop(0)
                coll.confirm("q", [item.xid])
        disk.power_cut(str(path))
    (seg,) = commit_log.segment_paths(str(path))
    return expected, seg


@pytest.mark.parametrize("bit", [0, 3, 9, 20, 30, 31])
def test_after_a_power_cut_a_flipped_size_bit_in_the_middle_of_the_log_loses_nothing(tmp_path: Path,
                                                                                     bit: int) -> None:
    expected, seg = power_cut_under_load(tmp_path)
    records = read_segment(seg, last=True).records
    at = records[len(records) // 2][0]
    data = bytearray(Path(seg).read_bytes())
    data[at + bit // 8] ^= 1 << (bit % 8)
    Path(seg).write_bytes(bytes(data))
    again = collection(tmp_path)
    assert again.refused == {}
    assert drain(again, "q") == expected  # no acknowledged item lost, no confirmed one back
    assert len(drain(again, "other")) == 120
    again.close()


def test_after_a_power_cut_a_zero_filled_journal_tail_is_repaired_from_the_log(tmp_path: Path) -> None:
    with Disk(tmp_path) as disk:
        coll = collection(tmp_path)
        expected = []
        for n in range(60):
            coll.put("q", [b"item-%03d" % n])
            expected.append(b"item-%03d" % n)
            if n % 3 == 2:
                item = one(coll.remove("q", transaction=True))
                assert item is not None
                coll.confirm("q", [item.xid])
                expected.remove(item.data)
        journal = tmp_path / "q"
        written = journal.read_bytes()
        durable = disk.durable.get(journal.stat().st_ino, 0)
        disk.power_cut(str(tmp_path))
    journal.write_bytes(written[:durable] + bytes(len(written) - durable))  # the size reached the disk, not the data
    again = collection(tmp_path)
    assert again.refused == {}
    assert drain(again, "q") == expected
    assert aside(tmp_path, f"q.replaced-{T0}").read_bytes() == bytes(len(written) - durable)
    again.close()


def test_a_byte_changed_in_a_logged_part_of_a_journal_is_repaired_and_never_served(tmp_path: Path) -> None:
    coll = collection(tmp_path)
    for n in range(10):
        coll.put("q", [b"item-%d" % n])
    coll.put("other", [b"fine"])
    journal = tmp_path / "q"
    data = bytearray(journal.read_bytes())
    data[-3] ^= 0x20  # inside the data of the last item: "item-9" -> "itEm-9"
    journal.write_bytes(bytes(data))
    # Killed (nothing else lost): the log still holds every change.
    again = collection(tmp_path)
    assert again.refused == {}
    assert drain(again, "q") == [b"item-%d" % n for n in range(10)]
    assert drain(again, "other") == [b"fine"]
    (copy,) = (tmp_path / ".kestrel" / "aside").iterdir()
    assert copy.name.startswith("q.replaced-") and bytes(data).endswith(copy.read_bytes())
    again.close()
    del coll


def test_a_journal_the_log_cannot_repair_refuses_that_queue_alone(tmp_path: Path) -> None:
    coll = collection(tmp_path)
    coll.put("q", [b"first"])
    assert coll.commit_log is not None
    coll.commit_log.checkpoint()  # "first" is in the journal only from now on
    coll.put("q", [b"second"])
    coll.put("other", [b"fine"])
    (tmp_path / "q").write_bytes(b"")  # the journal lost what precedes the log's records of it
    again = collection(tmp_path)
    assert list(again.refused) == ["q"]
    assert drain(again, "other") == [b"fine"]
    with pytest.raises(QueueDamaged, match="--salvage"):
        again.queue("q")
    again.close()
    salvaged = QueueCollection(str(tmp_path), QueueConfigs({"sync_journal": "always"}), salvage=True,
                               runtime=ManualRuntime(clock=FakeClock(T0)))
    salvaged.load()
    assert salvaged.refused == {} and drain(salvaged, "q") == []  # the journal as it is
    assert any(p.name.startswith("commit-log-q.unplaced-") for p in (tmp_path / ".kestrel" / "aside").iterdir())
    salvaged.close()


def test_a_failed_write_of_the_log_falls_back_on_the_journals_own_fsync(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    coll = collection(tmp_path)
    coll.put("q", [b"first"])
    synced: list[int] = []
    real_write, real_fdatasync = os.write, os.fdatasync
    log_dir = commit_log.directory(str(tmp_path))

    real_pwrite = os.pwrite

    def full_log(fd: int, data: Any) -> int:
        if os.readlink(f"/proc/self/fd/{fd}").startswith(log_dir):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    def full_log_at(fd: int, data: Any, offset: int) -> int:  # the segment, laid down, is written by position
        if os.readlink(f"/proc/self/fd/{fd}").startswith(log_dir):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    def fdatasync(fd: int) -> None:
        synced.append(os.fstat(fd).st_ino)
        real_fdatasync(fd)

    monkeypatch.setattr(os, "write", full_log)
    monkeypatch.setattr(disk, "write", full_log)  # the journal files' appends call it straight
    monkeypatch.setattr(os, "pwrite", full_log_at)
    monkeypatch.setattr(disk, "pwrite", full_log_at)
    monkeypatch.setattr(os, "fdatasync", fdatasync)
    coll.put("q", [b"second"])  # acknowledged: its journal was fsynced instead
    assert os.stat(tmp_path / "q").st_ino in synced
    monkeypatch.undo()
    (seg,) = commit_log.segment_paths(str(tmp_path))
    assert [r.data[-5:] for _, r in read_segment(seg, last=True).records] == [b"first"]
    coll.close()
    again = collection(tmp_path)
    assert drain(again, "q") == [b"first", b"second"]
    again.close()


def test_an_fsync_of_the_log_that_fails_falls_back_on_the_journal(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    coll = collection(tmp_path)
    log_dir = commit_log.directory(str(tmp_path))
    real_fdatasync = os.fdatasync
    journal_syncs = []

    def failing(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").startswith(log_dir):
            raise OSError(errno.EIO, "Input/output error")
        journal_syncs.append(fd)
        real_fdatasync(fd)

    monkeypatch.setattr(os, "fdatasync", failing)
    coll.put("q", [b"x"])
    coll.put("q", [b"y"])  # the log's segment failed once: its journal carries the promise now
    assert len(journal_syncs) == 2
    monkeypatch.undo()
    coll.close()


# ---------------------------------------------------------------------------------------------
# The offline tools


def crashed_after_a_power_cut(path: Path) -> list[bytes]:
    """A queue path as a power cut leaves it under `commit_log: on`: journals short, the log whole."""
    with Disk(path) as disk:
        coll = collection(path)
        items = [b"item-%d" % n for n in range(10)]
        for item in items:
            coll.put("q", [item])
        disk.power_cut(str(path))
    assert (path / "q").read_bytes() == b""
    return items


def test_kestrel_journal_recover_puts_the_log_into_the_journals_offline(tmp_path: Path) -> None:
    items = crashed_after_a_power_cut(tmp_path)
    command = [sys.executable, "-m", "kestrel", "journal", "recover", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "10 records written to the journals" in done.stdout
    assert not Path(commit_log.directory(str(tmp_path))).exists()
    coll = collection(tmp_path, on=False)
    assert drain(coll, "q") == items
    coll.close()
    again = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert (again.returncode, again.stdout.strip()) == (0, f"{tmp_path}: no commit log: nothing to recover")


def test_dump_says_recovery_is_pending(tmp_path: Path) -> None:
    crashed_after_a_power_cut(tmp_path)
    out, err = io.StringIO(), io.StringIO()
    assert dump.dump_queue(str(tmp_path), "q", out, err) == 0
    assert "recovery is pending" in err.getvalue() and "kestrel journal recover" in err.getvalue()
    err = io.StringIO()
    dump.dump_files([str(tmp_path / "q")], out, err)
    assert "recovery is pending" in err.getvalue()
    recover(str(tmp_path), T0)
    err = io.StringIO()
    dump.dump_files([str(tmp_path / "q")], out, err)
    assert err.getvalue() == ""


def test_convert_recovers_the_log_one(tmp_path: Path) -> None:
    items = crashed_after_a_power_cut(tmp_path)
    out = io.StringIO()
    convert.convert(str(tmp_path), "kestrel3", [], out)
    assert "put 10 records into the journals" in out.getvalue()
    coll = QueueCollection(str(tmp_path), QueueConfigs({"journal_format": "kestrel3"}),
                           runtime=ManualRuntime(clock=FakeClock(T0)))
    coll.load()
    assert drain(coll, "q") == items
    coll.close()


def synced_folders(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The folders fsynced from now on (`disk.fsync_path`), in order, as they are."""
    synced: list[str] = []
    real = disk.fsync_path

    def fsync_path(path: str) -> None:
        synced.append(path)
        real(path)

    monkeypatch.setattr(disk, "fsync_path", fsync_path)
    return synced


def test_a_queue_reloaded_out_of_always_still_logs_and_its_new_journals_names_are_durable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    coll = collection(tmp_path, default_journal_size="1KB")
    coll.put("q", [b"first"])  # the queue is created under always
    assert one(coll.remove("q")) is not None
    coll.reload(QueueConfigs({"sync_journal": "never", "default_journal_size": "1KB"}), {})
    synced_dirs = synced_folders(monkeypatch)
    for _ in range(40):  # the journal passes 1KB empty and is packed: a new live journal starts
        coll.put("q", [b"x" * 40])
        assert one(coll.remove("q")) is not None
    coll.queue("q").wait_for_packing()
    assert list_journal_files(str(tmp_path), "q").rotated  # it rotated
    assert str(tmp_path) in synced_dirs
    coll.put("q", [b"last"])
    # it still logs (how many records are logged before it depends on when the packs' checkpoints ran)
    newest = commit_log.segment_paths(str(tmp_path))[-1]
    assert read_segment(newest, last=True).records[-1][1].data[-4:] == b"last"
    coll.close()


@pytest.mark.parametrize("journal_format", ["kestrel2", "kestrel3"])
def test_a_queue_created_under_a_periodic_sync_has_its_journals_name_made_durable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, journal_format: str) -> None:
    """The log's records name the journal file, so its name must survive a power cut whatever the
    policy: a Kestrel 2 queue under a periodic sync had its file created without its folder's fsync,
    and then found there by the first change, which fsyncs only a folder it adds a name to."""
    synced_dirs = synced_folders(monkeypatch)
    coll = collection(tmp_path, sync_journal="1s", journal_format=journal_format)
    coll.put("q", [b"first"])
    assert str(tmp_path) in synced_dirs
    coll.close()


class GeventWithFsyncs(GeventRuntime):
    """The server's runtime, whose group commit's fsyncs go through `fsync` (on Python threads), and
    whose commit log checkpoints only when a test says (on a busy machine a test may outlast the
    log's second between checkpoints, which would add fsyncs it does not count)."""

    def __init__(self, fsync: Callable[[int], None]) -> None:
        super().__init__(FakeClock(T0))
        self._group_commit = GroupCommit(ThreadFsync(fsync))

    def group_commit(self) -> GroupCommit:
        return self._group_commit

    def call_later(self, seconds: float, fn: Callable[[], None]) -> Any:
        # Told by name and owner: a compiled log's bound method has no `__func__` to compare. Left
        # to fire, a checkpoint of a log abandoned by a simulated power cut deletes the segments of
        # the log the test opens next on the same path.
        if getattr(fn, "__name__", "") == "_tick" and isinstance(getattr(fn, "__self__", None),
                                                                 commit_log.CommitLog):
            return NeverFires()
        return super().call_later(seconds, fn)


class NeverFires:
    def cancel(self) -> None:
        pass


class HeldCheckpoints(GeventRuntime):
    """The server's runtime, whose commit log ticks every 10 ms and whose blocking calls wait while
    `go` is clear: a checkpoint held half done, where a close can come."""

    def __init__(self) -> None:
        super().__init__()
        self.go, self.held = gevent.event.Event(), gevent.event.Event()
        self.go.set()

    def call_later(self, seconds: float, fn: Callable[[], None]) -> Any:
        tick = getattr(fn, "__name__", "") == "_tick" and isinstance(getattr(fn, "__self__", None),
                                                                     commit_log.CommitLog)
        return super().call_later(0.01 if tick else seconds, fn)

    def run_blocking(self, fn: Callable[..., Any], *args: Any) -> Any:
        if not self.go.is_set():
            self.held.set()
            self.go.wait()
        return super().run_blocking(fn, *args)


def test_a_close_during_a_ticks_checkpoint_leaves_no_next_tick_on_the_hub(tmp_path: Path) -> None:
    """A tick's checkpoint yields (its fsyncs and unlinks run off the loop); a close meanwhile
    waits for it. The next tick was set once that checkpoint ended, after the close had cancelled
    the timer it found: it outlived the close, on the hub of whatever ran next."""
    from tests.support.hub_leftovers import no_hub_leftovers

    runtime = HeldCheckpoints()
    with no_hub_leftovers():  # fails naming CommitLog._tick if the close left it armed
        coll = QueueCollection(str(tmp_path), QueueConfigs({"sync_journal": "always"}), runtime=runtime,
                               commit_log=True)
        coll.load()
        coll.put("q", [b"logged"])  # a journal with records in the log: the next tick checkpoints
        runtime.go.clear()
        assert runtime.held.wait(STALL_S)  # a tick's checkpoint, half done
        closing = gevent.spawn(coll.close)
        gevent.sleep(0)  # the close runs until it waits for the checkpoint
        assert not closing.dead
        runtime.go.set()
        closing.get(timeout=STALL_S)
    again = open_collection(tmp_path, {"sync_journal": "always"})
    assert drain(again, "q") == [b"logged"]
    again.close()


class HeldSwitch(HeldCheckpoints):
    """A checkpoint held as it starts a new segment (before its other steps), where a close can come."""

    def run_blocking(self, fn: Callable[..., Any], *args: Any) -> Any:
        if getattr(fn, "__name__", "") == "_install":
            return super().run_blocking(fn, *args)
        return GeventRuntime.run_blocking(self, fn, *args)


def test_a_checkpoint_under_way_at_a_close_lays_no_next_segment_down(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint ends by laying the next segment down ahead (its zeros written and fsynced): one
    under way as the log closes leaves it, since the close deletes it, where a stop on a slow disk
    waited for that fsync too."""
    runtime = HeldSwitch()
    coll = QueueCollection(str(tmp_path), QueueConfigs({"sync_journal": "always"}), runtime=runtime,
                           commit_log=True)
    coll.load()
    runtime.go.clear()
    coll.put("q", [b"logged"])  # a journal with records in the log: the next tick checkpoints
    assert runtime.held.wait(STALL_S)  # a tick's checkpoint, starting its new segment
    real, fsynced = os.fsync, []

    def noting(fd: int) -> None:
        fsynced.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        real(fd)

    monkeypatch.setattr(os, "fsync", noting)
    closing = gevent.spawn(coll.close)
    gevent.sleep(0)  # the close runs until it waits for the checkpoint
    runtime.go.set()
    closing.get(timeout=STALL_S)
    monkeypatch.undo()
    # the new segment, laid down as it starts (none was laid down ahead yet), and none after it
    assert fsynced.count(commit_log.PREPARED_NAME) == 1 and fsynced[-1] == ".kestrel"
    again = open_collection(tmp_path, {"sync_journal": "always"})
    assert drain(again, "q") == [b"logged"]
    again.close()


def test_no_checkpoint_of_the_logs_own_starts_while_the_queues_close(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The queues' closes fsync every journal before the log's close deletes its segments: a
    checkpoint its timer began meanwhile made its own fsyncs one after another (a new segment's
    name, the journals, the folder, the next segment laid down), and the stop on a slow disk waited
    for each."""
    coll = collection(tmp_path)
    runtime, log = coll.runtime, coll.commit_log
    assert isinstance(runtime, ManualRuntime) and log is not None
    coll.put("q", [b"kept"])  # in the log, its journal unsynced: the queue's close fsyncs it
    closing = slow_fdatasyncs(monkeypatch, 0.2).begun
    stopping = gevent.spawn(coll.close)
    until_begun(closing)
    runtime.advance(5_000)  # the log's timer comes due while the queue's close waits for its fsync
    stopping.get(timeout=STALL_S)
    monkeypatch.undo()
    assert closing.is_set() and log.checkpoints == 0
    assert not os.path.isdir(log.directory)  # its segments deleted at its close, as ever
    again = collection(tmp_path)
    assert drain(again, "q") == [b"kept"]
    again.close()


@pytest.mark.parametrize("log_fsync_fails", [False, True])
def test_under_gevent_a_turns_changes_share_one_write_and_one_fsync_of_the_log(
        tmp_path: Path, log_fsync_fails: bool) -> None:
    fsyncs = Fsyncs(tmp_path, *(["log"] if log_fsync_fails else []))
    synced = fsyncs.synced
    coll = gevent_collection(tmp_path, fsyncs)
    for name in ("a", "b", "c", "d"):
        coll.put(name, [b"created"])
    synced.clear()
    gevent.joinall([gevent.spawn(partial(coll.put, name, [b"item"])) for name in ("a", "b", "c", "d")],
                   raise_error=True)  # each added in the same turn, all acknowledged
    (seg,) = commit_log.segment_paths(str(tmp_path))
    writes = [r.queue for _, r in read_segment(seg, last=True).records]
    assert writes[-4:] == ["a", "b", "c", "d"]
    journals = sorted(fsyncs.journals())
    if log_fsync_fails:
        assert journals == ["a", "b", "c", "d"]  # each fell back on its own journal's fsync
    else:
        assert (journals, len(synced)) == ([], 1)  # one fsync of the log for the four
    synced.clear()
    gevent.joinall([gevent.spawn(partial(coll.put, name, [b"later"])) for name in ("a", "b")], raise_error=True)
    journals = sorted(fsyncs.journals())
    if log_fsync_fails:  # no fsync of a segment that failed one vouches for it: the journals' do
        assert (journals, len(synced)) == (["a", "b"], 2)
    else:
        assert (journals, len(synced)) == ([], 1)
    coll.close()
    again = collection(tmp_path)
    assert [drain(again, n) for n in ("a", "b", "c", "d")] == [[b"created", b"item", b"later"]] * 2 + [
        [b"created", b"item"]] * 2
    again.close()


def test_under_gevent_a_turn_whose_log_write_fails_falls_back_on_each_journal_and_the_log_stays_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log_dir = commit_log.directory(str(tmp_path))
    synced: list[str] = []

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        os.fdatasync(fd)

    coll = QueueCollection(str(tmp_path), QueueConfigs({"sync_journal": "always"}),
                           runtime=GeventWithFsyncs(fsync), commit_log=True)
    coll.load()
    for name in ("a", "b", "c"):
        coll.put(name, [b"created"])
    (seg,) = commit_log.segment_paths(str(tmp_path))
    before = read_segment(seg, last=True).records
    real_pwrite = os.pwrite
    written: list[int] = []

    def full_log(fd: int, data: Any, offset: int) -> int:  # the segment, laid down, is written by position
        if os.readlink(f"/proc/self/fd/{fd}").startswith(log_dir):
            written.append(real_pwrite(fd, bytes(data)[:7], offset))  # a short write, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", full_log)
    monkeypatch.setattr(disk, "pwrite", full_log)  # the log's writer calls it straight
    synced.clear()
    gevent.joinall([gevent.spawn(partial(coll.put, name, [b"item"])) for name in ("a", "b", "c")],
                   raise_error=True)  # one turn: its one write of the log fails, every change is acknowledged
    monkeypatch.undo()
    assert written == [7]
    after = read_segment(seg, last=True)  # the failed write was cut back off the log
    assert after.records == before and after.torn_at is None and after.damage == []
    assert sorted(os.path.basename(p) for p in synced) == ["a", "b", "c"]  # each journal's own fsync
    coll.put("a", [b"after"])  # the segment took no fsync that failed: the log carries the next turn
    assert [r.data[-5:] for _, r in read_segment(seg, last=True).records][-1] == b"after"
    coll.close()
    again = collection(tmp_path)
    assert drain(again, "a") == [b"created", b"item", b"after"]
    assert [drain(again, n) for n in ("b", "c")] == [[b"created", b"item"]] * 2
    again.close()


# ---------------------------------------------------------------------------------------------
# Acknowledgements held by the caller (the server's connections): no wait in the change


class Held:
    """A greenlet's held acknowledgements, noting when the log told it that its turn settled and
    whether the log had been fsynced by then."""

    def __init__(self, synced: list[str] | None = None, log_dir: str = "") -> None:
        self.acks = acknowledgements.Acknowledgements(self._told)
        self.told = gevent.event.Event()
        self.synced = synced
        self.log_dir = log_dir
        self.log_fsyncs_when_told: list[int] = []

    def _told(self) -> None:
        if self.synced is not None:
            self.log_fsyncs_when_told.append(sum(p.startswith(self.log_dir) for p in self.synced))
        if not self.acks.pending:
            self.told.set()

    def change(self, do: Callable[[], object]) -> None:
        """In this greenlet: hold, make the change, check it did not wait, wait to be told."""
        acknowledgements.hold(self.acks)
        self.told.clear()
        do()
        assert self.acks.pending, "the change waited for the disk"
        self.told.wait()


def gevent_collection(path: Path, fsync: Callable[[int], None], **queue: Any) -> QueueCollection:
    coll = QueueCollection(str(path), QueueConfigs({"sync_journal": "always", **queue}),
                           runtime=GeventWithFsyncs(fsync), commit_log=True)
    coll.load()
    return coll


class Fsyncs:
    """The fsync a test gives its collection under `path`: it fails (EIO) on a file `failing` names,
    "log" for the commit log's segments, "journal" for every journal or a journal by its queue's
    name, and records the path of each fsync that succeeded in `synced`."""

    def __init__(self, path: Path, *failing: str) -> None:
        self.log_dir = commit_log.directory(str(path))
        self.failing = set(failing)
        self.synced: list[str] = []

    def __call__(self, fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        names = {"log"} if path.startswith(self.log_dir) else {"journal", os.path.basename(path)}
        if names & self.failing:
            raise OSError(errno.EIO, "Input/output error")
        os.fdatasync(fd)
        self.synced.append(path)

    def journals(self) -> list[str]:
        """The journals synced, by their queue's name, in order."""
        return [os.path.basename(p) for p in self.synced if not p.startswith(self.log_dir)]


def test_a_change_where_acknowledgements_are_held_does_not_wait_and_its_holder_is_told_after_the_fsync(
        tmp_path: Path) -> None:
    log_dir = commit_log.directory(str(tmp_path))
    synced: list[str] = []

    def fsync(fd: int) -> None:
        os.fdatasync(fd)
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))

    coll = gevent_collection(tmp_path, fsync)
    for name in ("a", "b", "c", "d"):
        coll.put(name, [b"created"])
    synced.clear()
    holders = {name: Held(synced, log_dir) for name in ("a", "b", "c", "d")}
    gevent.joinall([gevent.spawn(partial(h.change, partial(coll.put, name, [b"item"]))) for name, h in holders.items()],
                   raise_error=True)
    # One turn, one fsync of the log, and every holder told once it had run.
    assert [h.log_fsyncs_when_told for h in holders.values()] == [[1]] * 4
    assert [os.path.basename(p) for p in synced if not p.startswith(log_dir)] == []
    gevent.joinall([gevent.spawn(partial(h.change, partial(coll.remove, name))) for name, h in holders.items()],
                   raise_error=True)
    coll.close()
    again = collection(tmp_path)
    assert [drain(again, n) for n in holders] == [[b"item"]] * 4
    again.close()


@pytest.mark.parametrize("journal_fails", [False, True])
def test_a_turn_the_log_cannot_make_durable_has_its_holders_journals_fsynced_and_a_double_failure_fails_them(
        tmp_path: Path, journal_fails: bool) -> None:
    fsyncs = Fsyncs(tmp_path)
    coll = gevent_collection(tmp_path, fsyncs)
    coll.put("q", [b"created"])
    fsyncs.synced.clear()
    fsyncs.failing = {"log", "journal"} if journal_fails else {"log"}
    held = Held()
    gevent.spawn(partial(held.change, partial(coll.put, "q", [b"item"]))).join()
    assert (held.acks.failed is not None) == journal_fails  # its replies are withheld
    assert [os.path.basename(p) for p in fsyncs.synced] == ([] if journal_fails else ["q"])
    fsyncs.failing.clear()
    coll.close()


def test_a_failed_turns_fallback_fsyncs_only_the_journals_its_holder_wrote_since_its_turns_last_settled(
        tmp_path: Path) -> None:
    fsyncs = Fsyncs(tmp_path)
    synced = fsyncs.synced
    coll = gevent_collection(tmp_path, fsyncs)
    for name in ("old", "new", "other"):
        coll.put(name, [b"created"])
    held = Held()
    for _ in range(2):  # settled, durable in the log: the holder needs `old` no longer
        gevent.spawn(partial(held.change, partial(coll.put, "old", [b"item"]))).join()
    synced.clear()
    fsyncs.failing = {"log", "old"}
    gevent.spawn(partial(held.change, partial(coll.put, "new", [b"item"]))).join()
    assert held.acks.failed is None  # `old`, which would fail, is not among its journals
    assert [os.path.basename(p) for p in synced] == ["new"]
    fsyncs.failing = {"log"}
    synced.clear()

    def three() -> None:  # one turn: the same journal twice (its later end), and another
        coll.put("new", [b"again"])
        coll.put("other", [b"item"])
        coll.put("new", [b"last"])

    gevent.spawn(partial(held.change, three)).join()
    assert held.acks.failed is None and sorted(os.path.basename(p) for p in synced) == ["new", "other"]
    fsyncs.failing.clear()
    coll.close()
    again = collection(tmp_path)
    assert drain(again, "new") == [b"created", b"item", b"again", b"last"]
    assert drain(again, "other") == [b"created", b"item"]
    assert drain(again, "old") == [b"created", b"item", b"item"]
    again.close()


def test_turns_settle_in_order_a_later_turn_waits_for_an_earlier_ones_fallback(tmp_path: Path) -> None:
    log_dir = commit_log.directory(str(tmp_path))
    slow = threading.Event()
    failing = {"log": False}

    def fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if failing["log"] and path.startswith(log_dir):
            raise OSError(errno.EIO, "Input/output error")
        if failing["log"] and os.path.basename(path) == "slow":
            slow.wait(30)
        os.fdatasync(fd)

    coll = gevent_collection(tmp_path, fsync)
    coll.put("slow", [b"created"])
    coll.put("fast", [b"created"])
    failing["log"] = True
    first, second = Held(), Held()
    told: list[str] = []
    first.told.rawlink(lambda _: told.append("first"))
    second.told.rawlink(lambda _: told.append("second"))
    slow_one = gevent.spawn(partial(first.change, partial(coll.put, "slow", [b"item"])))
    gevent.sleep(0.05)  # its turn is written and its fallback waits on the slow journal
    fast_one = gevent.spawn(partial(second.change, partial(coll.put, "fast", [b"item"])))
    gevent.sleep(0.05)
    assert told == [] and second.acks.pending
    slow.set()
    gevent.joinall([slow_one, fast_one], raise_error=True)
    assert told == ["first", "second"]
    failing["log"] = False
    coll.close()


def turns_behind_a_round_in_flight(tmp_path: Path, pwrite: Callable[[int, Any, int], int],
                                   checkpoint: bool = False) -> tuple[
        QueueCollection, list[bytes], dict[str, Held]]:
    """Queue `a`'s change starts a round whose fsync of the log is held back; `b`, `c` and `d`
    each change in a loop turn of its own meanwhile, with the log's `pwrite` through `pwrite`;
    then the fsync runs. The collection, the log's records (their bytes) when `b` changed, and
    the holders."""
    log_dir = commit_log.directory(str(tmp_path))
    held_back = threading.Event()
    holding = {"log": False}

    def fsync(fd: int) -> None:
        if holding["log"] and os.readlink(f"/proc/self/fd/{fd}").startswith(log_dir):
            held_back.wait(30)
        os.fdatasync(fd)

    coll = gevent_collection(tmp_path, fsync)
    for name in ("a", "b", "c", "d"):
        coll.put(name, [b"created"])
    holders = {name: Held() for name in ("a", "b", "c", "d")}
    holding["log"] = True
    first = gevent.spawn(partial(holders["a"].change, partial(coll.put, "a", [b"item"])))
    gevent.sleep(0.05)  # its round runs, its fsync held back
    (seg,) = commit_log.segment_paths(str(tmp_path))
    before = [r.data for _, r in read_segment(seg, last=True).records]
    real_pwrite = disk.pwrite
    disk.pwrite = pwrite  # type: ignore[assignment]
    try:
        later = []
        for name in ("b", "c", "d"):
            later.append(gevent.spawn(partial(holders[name].change, partial(coll.put, name, [b"item"]))))
            gevent.sleep(0.01)  # a loop turn of its own
        assert not any(h.told.is_set() for h in holders.values())
        if checkpoint:  # a new segment starts while they wait: they go to the older one
            assert coll.commit_log is not None
            later.append(gevent.spawn(coll.commit_log.checkpoint))
            gevent.sleep(0.05)
        held_back.set()
        gevent.joinall([first, *later], raise_error=True)
    finally:
        disk.pwrite = real_pwrite  # type: ignore[assignment]
        holding["log"] = False
    return coll, before, holders


@pytest.mark.parametrize("checkpoint", [False, True])
def test_turns_gathered_behind_a_round_in_flight_are_written_to_the_log_in_one_write(
        tmp_path: Path, checkpoint: bool) -> None:
    log_dir = commit_log.directory(str(tmp_path))
    log_writes: list[str] = []
    real_pwrite = disk.pwrite

    def pwrite(fd: int, data: Any, offset: int) -> int:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if path.startswith(log_dir):
            log_writes.append(os.path.basename(path))
        return real_pwrite(fd, data, offset)

    coll, before, holders = turns_behind_a_round_in_flight(tmp_path, pwrite, checkpoint)
    assert log_writes == ["1"]  # three turns, one write of the log, to the segment they were logged in
    if not checkpoint:
        (seg,) = commit_log.segment_paths(str(tmp_path))
        records = [r for _, r in read_segment(seg, last=True).records]
        assert [r.queue for r in records[len(before):]] == ["b", "c", "d"]  # in the order of their turns
    assert all(h.acks.failed is None for h in holders.values())
    coll.close()
    again = collection(tmp_path)
    assert [drain(again, n) for n in ("a", "b", "c", "d")] == [[b"created", b"item"]] * 4
    again.close()


def test_a_failed_write_of_gathered_turns_leaves_the_log_as_it_was_and_each_falls_back_on_its_journal(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log_dir = commit_log.directory(str(tmp_path))
    attempts: list[int] = []
    real_pwrite = disk.pwrite

    def full_log(fd: int, data: Any, offset: int) -> int:
        if os.readlink(f"/proc/self/fd/{fd}").startswith(log_dir):
            attempts.append(real_pwrite(fd, bytes(data)[:7], offset))  # a short write, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, data, offset)

    journal_fsyncs: list[str] = []
    real_sync_to = JournalWriter.sync_to
    monkeypatch.setattr(JournalWriter, "sync_to", lambda self, position: (  # this test's journals only
        self.path.startswith(str(tmp_path)) and journal_fsyncs.append(os.path.basename(self.path)),
        real_sync_to(self, position))[1])
    coll, before, holders = turns_behind_a_round_in_flight(tmp_path, full_log)
    monkeypatch.undo()
    assert attempts == [7]  # one write for the three turns, failed and cut back
    (seg,) = commit_log.segment_paths(str(tmp_path))
    after = read_segment(seg, last=True)
    assert [r.data for _, r in after.records] == before  # `a`'s turn last, as before the write
    assert after.records[-1][1].queue == "a" and after.torn_at is None and after.damage == []
    assert sorted(n for n in journal_fsyncs if n != "1") == ["b", "c", "d"]  # each journal's own fsync
    assert all(h.acks.failed is None for h in holders.values())  # every change acknowledged
    coll.put("b", [b"after"])  # the log takes the next turn
    assert read_segment(seg, last=True).records[-1][1].data.endswith(b"after")
    coll.close()
    again = collection(tmp_path)
    assert drain(again, "b") == [b"created", b"item", b"after"]
    assert [drain(again, n) for n in ("a", "c", "d")] == [[b"created", b"item"]] * 3
    again.close()


class GatheringRuntime(GeventWithFsyncs):
    """`GeventWithFsyncs` whose group commit's timers (`GroupCommit.later`: the log's gathering)
    wait until a test fires them: a round that gathers changes waits for them, however slowly
    they come."""

    def __init__(self, fsync: Callable[[int], None]) -> None:
        super().__init__(fsync)
        self.timers: list[tuple[float, Callable[[], None]]] = []
        self._group_commit = GroupCommit(ThreadFsync(fsync), timer=self._held)

    def _held(self, seconds: float) -> Any:
        timers = self.timers

        class Timer:
            def start(self, fn: Callable[[], None]) -> None:
                self.index = len(timers)
                timers.append((seconds, fn))

            def stop(self) -> None:
                timers[self.index] = (seconds, lambda: None)

        return Timer()


def test_a_round_waits_for_as_many_changes_as_the_last_one_carried(tmp_path: Path) -> None:
    log_dir = commit_log.directory(str(tmp_path))
    log_fsyncs: list[int] = []

    def fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").startswith(log_dir):
            log_fsyncs.append(fd)
        os.fdatasync(fd)

    runtime = GatheringRuntime(fsync)
    coll = QueueCollection(str(tmp_path), QueueConfigs({"sync_journal": "always"}), runtime=runtime,
                           commit_log=True)
    coll.load()
    names = [f"q{n}" for n in range(8)]
    changes = [0]
    stop = gevent.event.Event()

    def client(index: int, name: str) -> None:
        held = Held()
        while not stop.is_set():
            for _ in range(index):  # the clients come back over several turns of the loop
                gevent.sleep(0)
            held.change(partial(coll.put, name, [b"x"]))
            changes[0] += 1

    def when(count: int) -> None:
        while changes[0] < count:
            gevent.sleep(0.001)

    clients = [gevent.spawn(partial(client, i, name)) for i, name in enumerate(names)]
    when(80)  # the rounds have settled into carrying every client
    log_fsyncs.clear()
    start = changes[0]
    when(start + 160)
    assert len(log_fsyncs) <= (changes[0] - start) // 8 + 2  # one round for the eight, every time
    assert all(0 < seconds <= commit_log.GATHER_SECONDS * 1.01 for seconds, _ in runtime.timers)
    stop.set()
    while not all(c.dead for c in clients):  # the last rounds wait for clients that have left: the
        for _, fire in runtime.timers[:]:  # timers end the wait
            fire()
        gevent.sleep(0.01)
    gevent.joinall(clients, raise_error=True)
    coll.close()


def test_a_round_the_gathering_timer_begins_runs_from_the_loop_with_no_greenlet(tmp_path: Path) -> None:
    """The timer that ends a round's wait for the changes it expects calls the log from the loop's
    own callback, and the round begins there: no greenlet is made or switched to for it (one a
    round was a spawn and two switches), and its holder is told once the fsync has run."""
    native = native_threads()
    if native is None:
        pytest.skip("the C helper was not built (no C compiler at install time)")
    runtime = GeventWithFsyncs(os.fdatasync)
    runtime._group_commit = GroupCommit(native)  # rounds begun and ended on the loop
    coll = QueueCollection(str(tmp_path), QueueConfigs({"sync_journal": "always"}), runtime=runtime,
                           commit_log=True)
    coll.load()
    log = coll.commit_log
    assert log is not None
    for name in ("a", "b"):
        coll.put(name, [b"created"])
    a, b = Held(), Held()
    gevent.joinall([gevent.spawn(partial(a.change, partial(coll.put, "a", [b"one"]))),
                    gevent.spawn(partial(b.change, partial(coll.put, "b", [b"one"])))], raise_error=True)
    rounds = log.rounds
    switched_to: set[Any] = set()

    def trace(event: str, args: tuple[Any, Any]) -> None:
        if event in ("switch", "throw"):
            switched_to.add(args[1])

    previous = greenlet.settrace(trace)
    try:  # one change where the last round carried two: the timer ends its wait for a second
        alone = gevent.spawn(partial(a.change, partial(coll.put, "a", [b"two"])))
        alone.join()
    finally:
        greenlet.settrace(previous)
    assert alone.successful() and log.rounds == rounds + 1
    assert switched_to - {gevent.get_hub(), alone, greenlet.getcurrent()} == set()
    coll.close()
    again = collection(tmp_path)
    assert drain(again, "a") == [b"created", b"one", b"two"]
    again.close()


def test_a_round_the_gathering_timer_begins_whose_log_fsync_fails_withholds_only_replies_no_journal_kept(
        tmp_path: Path) -> None:
    """Two changes where three were expected: the timer begins their round; the log's fsync fails,
    each change falls back on its journal's, and only the client whose journal failed too has its
    replies withheld (its connection is cut off), the other is told its change is durable."""
    fsyncs = Fsyncs(tmp_path)
    coll = gevent_collection(tmp_path, fsyncs)
    log = coll.commit_log
    assert log is not None
    holders = {name: Held() for name in ("a", "b", "c")}
    for name in holders:
        coll.put(name, [b"created"])
    gevent.joinall([gevent.spawn(partial(h.change, partial(coll.put, name, [b"one"]))) for name, h in holders.items()],
                   raise_error=True)
    rounds = log.rounds
    fsyncs.failing = {"log", "b"}
    gevent.joinall([gevent.spawn(partial(holders[name].change, partial(coll.put, name, [b"two"]))) for name in ("a", "b")],
                   raise_error=True)
    assert log.rounds == rounds + 1  # one round for both, begun by the timer
    assert holders["a"].acks.failed is None and holders["b"].acks.failed is not None
    fsyncs.failing.clear()
    coll.close()
    again = collection(tmp_path)
    assert drain(again, "a") == [b"created", b"one", b"two"]
    again.close()


@pytest.mark.parametrize("journal_format", ["kestrel2", "kestrel3"])
def test_a_power_cut_loses_no_change_whose_holder_was_told(tmp_path: Path, journal_format: str) -> None:
    with Disk(tmp_path) as disk:
        coll = gevent_collection(tmp_path, lambda fd: os.fdatasync(fd), journal_format=journal_format)
        told: dict[str, list[bytes]] = {f"q{n}": [] for n in range(6)}
        changes = [0]

        def client(name: str) -> None:
            held = Held()
            for n in itertools.count():
                item = b"%s-%d" % (name.encode(), n)
                held.change(partial(coll.put, name, [item]))
                told[name].append(item)
                if n % 3 == 2:
                    held.change(partial(coll.remove, name))
                    told[name].pop(0)
                changes[0] += 1

        clients = [gevent.spawn(partial(client, name)) for name in told]
        while changes[0] < 300:
            gevent.sleep(0.001)
        disk.power_cut(str(tmp_path), keep=3)  # with changes in flight: the greenlets stop here
        expected = {name: list(items) for name, items in told.items()}
        gevent.killall(clients)
    again = collection(tmp_path, journal_format=journal_format)
    for name, items in expected.items():
        got = drain(again, name)
        # What was told is there in order, then perhaps a change in flight: an add, or a remove of
        # the first item (its reply never sent).
        assert got[:len(items)] == items or got[:len(items) - 1] == items[1:], (name, got, items)
    again.close()


# ---------------------------------------------------------------------------------------------
# Kestrel 3 queues and periodic syncs under the log


def test_a_kestrel3_queue_logs_its_writer_files_by_position_and_its_readers_by_meaning(tmp_path: Path) -> None:
    coll = collection(tmp_path, journal_format="kestrel3")
    coll.queue("q+audit")
    coll.put("q", [b"one", b"two"])
    item = one(coll.remove("q", transaction=True))
    assert item is not None
    coll.confirm("q", [item.xid])
    (seg,) = commit_log.segment_paths(str(tmp_path))
    records = [r for _, r in read_segment(seg, last=True).records]
    writer = [r for r in records if r.kind == commit_log.WRITER]
    (number,) = {r.epoch for r in writer}
    assert b"".join(r.data for r in writer) == (tmp_path / f"q.{number}").read_bytes()
    readers = [r for r in records if r.kind == commit_log.READER]
    assert {r.queue for r in readers} == {"q"}  # the child consumed nothing
    assert (tmp_path / "q.read.").read_bytes().endswith(b"".join(r.data for r in readers))
    coll.close()
    assert commit_log.segment_paths(str(tmp_path)) == []


def test_a_writer_file_every_reader_passed_goes_once_a_checkpoint_dropped_its_records(tmp_path: Path) -> None:
    coll = collection(tmp_path, journal_format="kestrel3", default_journal_size="200")
    for n in range(20):
        coll.put("q", [b"item-%02d" % n + b"." * 20])
    assert len(kestrel3_files.list_queue_files(str(tmp_path), "q").writers) > 2
    assert drain(coll, "q") == [b"item-%02d" % n + b"." * 20 for n in range(20)]
    kept = kestrel3_files.list_queue_files(str(tmp_path), "q").writers
    assert len(kept) > 1  # consumed, but the log's records still name them
    assert coll.commit_log is not None
    coll.commit_log.checkpoint()
    coll.queue("q").wait_for_packing()  # the release the checkpoint started, deleting off the loop
    assert kestrel3_files.list_queue_files(str(tmp_path), "q").writers == kept[-1:]
    coll.close()


def test_deleting_a_kestrel3_queue_or_reader_waits_for_a_checkpoint(tmp_path: Path) -> None:
    coll = collection(tmp_path, journal_format="kestrel3")
    coll.put("q", [b"x"])
    coll.queue("q+a")
    coll.put("q", [b"y"])
    assert coll.remove("q+a") != []
    coll.delete("q+a")
    coll.delete("q")
    assert commit_log.pending(str(tmp_path)) is False  # no record names what was deleted
    coll.close()
    assert recover(str(tmp_path), T0).refused == {}
    assert kestrel3_files.list_queue_files(str(tmp_path), "q") == kestrel3_files.QueueFiles()


@pytest.mark.parametrize("journal_format", ["kestrel2", "kestrel3"])
def test_a_queue_under_a_periodic_sync_logs_and_the_log_is_fsynced_within_its_interval(
        tmp_path: Path, journal_format: str) -> None:
    log_dir = commit_log.directory(str(tmp_path))
    synced: list[str] = []

    def fsync(fd: int) -> None:
        os.fdatasync(fd)
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))

    coll = QueueCollection(str(tmp_path), QueueConfigs({"sync_journal": "20ms", "journal_format": journal_format}),
                           runtime=GeventWithFsyncs(fsync), commit_log=True)
    coll.load()
    coll.put("p", [b"created"])
    gevent.sleep(0.1)
    synced.clear()
    coll.put("p", [b"item"])
    assert synced == []  # no wait for the disk
    deadline = time.monotonic() + 5
    while not synced and time.monotonic() < deadline:
        gevent.sleep(0.005)
    assert synced and all(p.startswith(log_dir) for p in synced)  # the log's round, not the journal's
    coll.close()
    again = collection(tmp_path, journal_format=journal_format)
    assert drain(again, "p") == [b"created", b"item"]
    again.close()


def test_a_turn_of_periodic_syncs_alone_is_written_to_the_log_once_it_has_run_not_an_interval_later(
        tmp_path: Path) -> None:
    coll = QueueCollection(str(tmp_path), QueueConfigs({"sync_journal": "1s"}), runtime=GeventWithFsyncs(os.fdatasync),
                           commit_log=True)
    coll.load()
    coll.put("p", [b"created"])
    gevent.sleep(0)  # the turn has run: its round is up to a second away
    (seg,) = commit_log.segment_paths(str(tmp_path))
    assert [r.queue for _, r in read_segment(seg, last=True).records][-1:] == ["p"]  # a kill now finds it
    coll.close()


def test_when_the_log_cannot_take_a_periodic_syncs_turn_its_journal_fsyncs_itself(tmp_path: Path) -> None:
    fsyncs = Fsyncs(tmp_path)
    synced = fsyncs.synced
    coll = gevent_collection(tmp_path, fsyncs, sync_journal="20ms")
    coll.put("p", [b"created"])
    gevent.sleep(0.1)
    synced.clear()
    fsyncs.failing = {"log"}
    coll.put("p", [b"item"])
    deadline = time.monotonic() + 5
    while str(tmp_path / "p") not in synced and time.monotonic() < deadline:
        gevent.sleep(0.005)
    assert str(tmp_path / "p") in synced
    fsyncs.failing.clear()
    coll.close()


def test_a_queue_reloaded_to_never_still_logs_and_its_records_ride_the_next_round(tmp_path: Path) -> None:
    coll = gevent_collection(tmp_path, lambda fd: os.fdatasync(fd))
    coll.put("was-always", [b"created"])
    coll.reload(QueueConfigs({"sync_journal": "never"}, {"other": {"sync_journal": "always"}}), {})
    coll.put("was-always", [b"no wait"])  # logged (fixed at creation), waits for nothing
    gevent.sleep(0.05)
    coll.put("other", [b"always"])  # its round takes the record along
    (seg,) = commit_log.segment_paths(str(tmp_path))
    assert [r.data[-7:] for _, r in read_segment(seg, last=True).records][-2:] == [b"no wait", b"\x00always"]
    coll.close()


def test_a_collection_loaded_twice_is_refused_and_keeps_its_one_commit_log(tmp_path: Path) -> None:
    """A second `load` would open a second commit log and leave the first, its segment and its
    checkpoint timer, running with nothing to close them: it is refused, naming the path."""
    coll = collection(tmp_path)
    first = coll.commit_log
    assert first is not None
    with pytest.raises(RuntimeError, match="loaded already"):
        coll.load()
    assert coll.commit_log is first
    coll.put("jobs", [b"a"])
    coll.close()
    again = collection(tmp_path)
    assert [item.data for item in again.remove("jobs")] == [b"a"]
    again.close()
