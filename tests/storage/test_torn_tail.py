"""One torn-tail rule for every log the server reads (src/kestrel/storage/torn_tail.py): the same
shape gets the same answer in a Kestrel 2 journal, a Kestrel 3 writer file and the commit log.

- A record whose size field was damaged into running past the end of the last file, with whole
  records after it, is damage: refused, never cut off as a torn write (which would drop them).
- Zeros to the end of the last file (a power cut: the size reached the disk, the data did not) and
  the first bytes of one record are a torn write: cut off, a copy kept.
"""

from __future__ import annotations

import random
import re
import struct
import zlib
from pathlib import Path

import pytest

from kestrel.storage import QueueCollection, QueueConfigs, commit_log, torn_tail
from kestrel.storage.clock import FakeClock
from kestrel.storage.errors import CorruptJournalError
from kestrel.storage.kestrel2 import codec
from kestrel.storage.kestrel3.codec import FileKind, TailRecords
from tests.support.kestrel3_records import READER, WRITER, put6, read_head
from tests.support.queues import aside, drain, load_strictly

T0 = 1_700_000_000_000
FORMATS = ["kestrel2", "kestrel3", "commit log"]


def records(fmt: str, count: int) -> list[bytes]:
    """`count` records of one item each, in the format's own layout (each one's size at offset 1
    for the journals, 0 for the log)."""
    if fmt == "kestrel2":
        return [codec.encode_addx(T0, 0, b"item-%02d" % n) for n in range(count)]
    if fmt == "kestrel3":
        return [put6(n + 1, b"item-%02d" % n) for n in range(count)]
    return [commit_log.encode_record("q", 0, 12 * n, b"item-%02d" % n) for n in range(count)]


def lay_out(path: Path, fmt: str, body: bytes) -> Path:
    """A queue path whose last log file holds `body`; the file."""
    if fmt == "kestrel2":
        (path / "q").write_bytes(body)
        return path / "q"
    if fmt == "kestrel3":
        (path / f"q.{T0}").write_bytes(WRITER + body)
        (path / "q.read.").write_bytes(READER + read_head(0))  # the default reader, at its start
        return path / f"q.{T0}"
    folder = Path(commit_log.directory(str(path)))
    folder.mkdir(parents=True)
    (folder / "1").write_bytes(commit_log.MARK + body)
    return folder / "1"


def load(path: Path, fmt: str) -> list[bytes]:
    """What a start-up serves from the queue path (the log's records: what it holds)."""
    if fmt == "commit log":
        segment = commit_log.read_segment(commit_log.segment_paths(str(path))[0], last=True)
        if segment.damage:
            raise CorruptJournalError(segment.path, segment.damage[0].at, None, segment.damage[0].reason)
        return [r.data for _, r in segment.records]
    journal_format = "kestrel2" if fmt == "kestrel2" else "kestrel3"
    coll = load_strictly(QueueCollection(str(path), QueueConfigs({"journal_format": journal_format}),
                                         clock=FakeClock(T0)))
    got = drain(coll, "q")
    coll.close()
    return got


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("bit", [20, 27])
def test_a_size_field_damaged_past_the_end_with_whole_records_after_it_is_refused(
        tmp_path: Path, fmt: str, bit: int) -> None:
    parts = records(fmt, 12)
    field = 0 if fmt == "commit log" else 1
    at = sum(map(len, parts[:6])) + field
    body = bytearray(b"".join(parts))
    body[at + bit // 8] ^= 1 << (bit % 8)  # the record claims megabytes: it runs past the end
    path = lay_out(tmp_path, fmt, bytes(body))
    before = path.read_bytes()
    with pytest.raises(CorruptJournalError) as err:
        load(tmp_path, fmt)
    assert err.value.path == str(path) and err.value.offset == path.stat().st_size - len(body) + at - field
    assert path.read_bytes() == before and aside(tmp_path) == {}  # nothing cut


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tail", ["zeros", "torn"])
def test_zeros_or_a_torn_record_at_the_end_of_the_last_file_are_cut_off_keeping_a_copy(
        tmp_path: Path, fmt: str, tail: str) -> None:
    whole = records(fmt, 3)
    cut = bytes(37) if tail == "zeros" else records(fmt, 4)[3][:-3]
    lay_out(tmp_path, fmt, b"".join(whole) + cut)
    assert load(tmp_path, fmt) == [b"item-%02d" % n for n in range(3)]
    if fmt != "commit log":  # the log's own recovery cuts it (tests/storage/test_commit_log.py)
        assert list(aside(tmp_path).values()) == [cut]  # what was cut off, and nothing else


def record_bytes(fmt: str, megabytes: int) -> bytes:
    """Item data that reads as records from place after place, each failing late: the worst a torn
    record's data can do to the rule that looks for whole records inside it.

    Kestrel 2: REMOVE opcodes, a chain of records with no item from every place. Kestrel 3 and the
    log: every 64 bytes the header of a record of a quarter of the data, ending on nonsense (a
    PUT's next byte is no command; the log record's fields do not fit)."""
    size = megabytes << 20
    if fmt == "kestrel2":
        return bytes([codec.REMOVE]) * size
    quarter = size // 4
    if fmt == "kestrel3":
        block = put6(1, b"")[:1] + struct.pack("<iiQq", quarter, 0, 1, T0)
    else:
        block = struct.pack("<II", quarter, 0) + struct.pack("<H", 1) + b"q" + struct.pack("<QQ", 9 << 56, 0)
    return (block + bytes(64 - len(block))) * (size // 64)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_torn_record_whose_data_reads_as_records_everywhere_is_judged_in_linear_time(
        tmp_path: Path, fmt: str) -> None:
    """Judged place by place, such data took time quadratic in its size (hours for 1 MB of REMOVE
    opcodes): the rule reads each place's chain of records once. Nothing inside is evidence. (16 MB,
    and the time each format takes: `bench/bench_torn_tail.py`.)"""
    data = record_bytes(fmt, 1)
    if fmt == "kestrel2":
        whole = codec.encode_addx(T0, 0, data)
    elif fmt == "kestrel3":
        whole = put6(4, data)
    else:
        whole = commit_log.encode_record("q", 0, 36, data)
    cut = whole[:len(whole) - 1000]
    lay_out(tmp_path, fmt, b"".join(records(fmt, 3)) + cut)
    assert load(tmp_path, fmt) == [b"item-%02d" % n for n in range(3)]
    if fmt != "commit log":
        assert list(aside(tmp_path).values()) == [cut]


def fitting_log_tail(kilobytes: int) -> bytes:
    """A torn commit log record whose data holds, every 64 bytes, the head of a record of a quarter
    of the data whose fields fit (a JOURNAL record of queue `q`) and whose checksum fails: the
    bodies claimed overlap, and each must be checksummed before it is refused."""
    size = kilobytes << 10
    block = struct.pack("<IIH", size // 4, 0, 1) + b"q" + struct.pack("<QQ", 0, 0)
    data = (block + bytes(64 - len(block))) * (size // 64)
    return commit_log.encode_record("q", 0, 36, data)[:-1000]


def test_a_torn_log_record_claiming_overlapping_bodies_whose_fields_fit_is_checksummed_in_linear_work(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each place's claimed body was checksummed whole: work grew with places × body size, quadratic
    in the bytes judged. Bodies are checksummed from the tail's prefix checksums: twice the bytes,
    about twice the work (bench/bench_torn_tail.py: `fitting`, 16 MB)."""
    checksummed = [0]
    crc32 = zlib.crc32

    def counted(data: bytes | memoryview, value: int = 0) -> int:
        checksummed[0] += len(data)
        return crc32(data, value)

    monkeypatch.setattr(zlib, "crc32", counted)
    work = {}
    for kilobytes in (128, 256):
        cut = fitting_log_tail(kilobytes)
        folder = tmp_path / str(kilobytes)
        folder.mkdir()
        lay_out(folder, "commit log", b"".join(records("commit log", 3)) + cut)
        checksummed[0] = 0
        segment = commit_log.read_segment(commit_log.segment_paths(str(folder))[0], last=True)
        assert [r.data for _, r in segment.records] == [b"item-%02d" % n for n in range(3)]
        assert segment.torn_at == len(commit_log.MARK) + sum(map(len, records("commit log", 3)))  # cut
        assert not segment.damage
        work[kilobytes] = checksummed[0]
    assert work[256] < 2.5 * work[128]  # linear (each body checksummed whole: 4 times)
    assert work[256] < 40 * (256 << 10)


class Counted:
    """A format's records for the rule, counting the places read."""

    def __init__(self, records: torn_tail.Records) -> None:
        self.records = records
        self.evidence_at_end = records.evidence_at_end
        self.evidence_before_nonsense = records.evidence_before_nonsense
        self.read = 0

    def starts(self, data: bytes) -> re.Pattern[bytes] | None:
        return self.records.starts(data)

    def body_start(self, data: bytes, at: int) -> int:
        return self.records.body_start(data, at)

    def record_at(self, data: bytes, pos: int) -> tuple[int, int] | None:
        self.read += 1
        return self.records.record_at(data, pos)

    def explain(self, data: bytes, at: int, end: int, offset: int, chains: torn_tail.Chains) -> str | None:
        return self.records.explain(data, at, end, offset, chains)


@pytest.mark.parametrize("fmt", ["kestrel2", "commit log"])
def test_a_torn_record_whose_data_reads_as_records_is_read_at_most_once_a_place(fmt: str) -> None:
    """Kestrel 2: the chains read to account for a damaged size field are the search's too (each
    place was read twice). The log: only places whose bytes can be a record's head are read (each
    place was)."""
    data = record_bytes(fmt, 1)[:256 << 10]
    whole = codec.encode_addx(T0, 0, data) if fmt == "kestrel2" else commit_log.encode_record("q", 0, 36, data)
    tail = whole[:-1000]
    records = Counted(codec.TAIL_RECORDS if fmt == "kestrel2" else commit_log.LogRecords())
    assert torn_tail.judge("torn", 0, "an incomplete record", records, last=True,
                            held=torn_tail.Held(tail, records)) is None
    assert records.read <= (len(tail) if fmt == "kestrel2" else len(tail) // 8), records.read


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_search_finds_the_first_place_a_chain_read_alone_from_it_finds(fmt: str) -> None:
    """The search reads each chain once, skips places no head can be at and places already read:
    its answer is the first place whose chain, read alone, is evidence (random bytes of the
    format's small values with whole records among them, cut short or not)."""
    rng = random.Random(44)
    small = bytes(rng.choice([0, 1, 2, 3, 6, 7, 9, 0x13, 0x86, ord("q")]) for _ in range(256))
    for n in range(60):
        tail = bytearray(rng.randbytes(rng.randrange(1, 300)).translate(small))
        for _ in range(rng.randrange(3)):  # a run of records, the last perhaps cut short
            run = b"".join(records(fmt, rng.randrange(1, 4)))
            at = rng.choice([rng.randrange(len(tail) + 1), len(tail)])
            tail[at:at] = run[:rng.choice([len(run), rng.randrange(len(run))])]
        data = bytes(tail) + bytes(rng.choice([0, 0, 9]))
        end = len(data.rstrip(b"\0"))
        shape = {"kestrel2": codec.TAIL_RECORDS, "kestrel3": TailRecords(FileKind.WRITER),
                 "commit log": commit_log.LogRecords()}[fmt]
        alone = next((p for p in range(1, end) if torn_tail.Chains(data, end, shape).whole_records_at(p)), None)
        assert torn_tail.first_whole_records(data, 1, end, shape) == alone, n
        chains = torn_tail.Chains(data, end, shape)
        for p in rng.sample(range(end), min(end, 5)):  # some read first, as an account of damage does
            chains.whole_records_at(p)
        assert torn_tail.first_whole_records(data, 1, end, shape, chains) == alone, n


def test_the_log_s_record_heads_are_searched_for_wherever_a_record_reads() -> None:
    """The rule reads only the places the log's `starts` finds: every place where a record reads
    must be among them (names of 1 and 200 bytes, the longest a queue's; a body past 16 MB: a
    size's last byte not zero)."""
    rng = random.Random(43)
    small = bytes(rng.choice([0, 0, 0, 1, 2, 0x13, 0xFF, ord("q")]) for _ in range(256))
    for n in range(40):
        tail = bytearray(rng.randbytes(rng.randrange(1, 1500)).translate(small))
        for _ in range(rng.randrange(1, 4)):
            name = rng.choice(["q", "x" * 200, "é"])
            record = commit_log.encode_record(name, rng.getrandbits(8), 0, rng.randbytes(rng.choice([0, 5, 300])),
                                              rng.choice([commit_log.JOURNAL, commit_log.WRITER]))
            at = rng.randrange(len(tail) + 1)
            tail[at:at] = record
        data = bytes(tail)
        log_records = commit_log.LogRecords()
        starts = log_records.starts(data)
        reads = [p for p in range(len(data)) if log_records.record_at(data, p) is not None]
        assert reads, n
        assert all(starts.match(data, p) for p in reads), n
    large = commit_log.encode_record("q", 0, 0, bytes(1 << 24)) + b"more"
    log_records = commit_log.LogRecords()
    assert log_records.record_at(large, 0) is not None and log_records.starts(large).match(large, 0)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_torn_record_of_random_opcode_bytes_is_judged_as_the_rule_says(tmp_path: Path, fmt: str) -> None:
    """A megabyte of bytes 0x00 to 0x09: in a Kestrel 2 journal they happen to hold whole records
    (item records among them), so the torn record is damage; elsewhere they cannot, so it is cut."""
    data = random.Random(7).randbytes(1 << 20).translate(bytes(n % 10 for n in range(256)))
    if fmt == "kestrel2":
        whole = codec.encode_addx(T0, 0, data)
    elif fmt == "kestrel3":
        whole = put6(4, data)
    else:
        whole = commit_log.encode_record("q", 0, 36, data)
    cut = whole[:len(whole) // 2]
    path = lay_out(tmp_path, fmt, b"".join(records(fmt, 3)) + cut)
    if fmt == "kestrel2":
        with pytest.raises(CorruptJournalError) as err:
            load(tmp_path, fmt)
        assert err.value.path == str(path) and err.value.offset == path.stat().st_size - len(cut)
        assert "whole records start inside it" in err.value.reason and aside(tmp_path) == {}
        return
    assert load(tmp_path, fmt) == [b"item-%02d" % n for n in range(3)]
    if fmt != "commit log":
        assert list(aside(tmp_path).values()) == [cut]
