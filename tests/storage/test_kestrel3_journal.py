"""Kestrel 3 journal files: the codec against the format document, our files read back independently,
damaged input, file names, the writer journal, reader checkpoints, replay and the dump command."""

from __future__ import annotations

import io
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kestrel.storage import QueueCollection, QueueConfigs, filenames
from kestrel.storage.clock import FakeClock
from kestrel.storage.errors import CorruptJournalError, InvalidQueueName
from kestrel.storage.kestrel2.codec import encode_addx
from kestrel.storage.kestrel3 import codec as k3
from kestrel.storage.kestrel3 import files
from kestrel.storage.queue_path import remove_temporaries
from kestrel.storage.tools.dump import dump_files, dump_queue
from tests.conftest import ROOT
from tests.support.kestrel3_records import READER, WRITER, put6, put8, read_done, read_head
from tests.support.queues import load_strictly

SEED = ROOT.parent / "shared" / "seeds" / "kestrel3-journal-format.md"
T0 = 1_700_000_000_000


# ---------------------------------------------------------------------------------------------
# The format document


@pytest.mark.skipif(not SEED.exists(), reason=f"the format document is not at {SEED}")
def test_headers_and_command_numbers_are_the_documents() -> None:
    text = SEED.read_text()
    sections = dict(re.findall(r"^## (Write journal|Read checkpoint)\n\nheader: ([0-9A-F ]+)$", text, re.M))
    assert bytes.fromhex(sections["Write journal"]) == k3.WRITER_MAGIC == WRITER
    assert bytes.fromhex(sections["Read checkpoint"]) == k3.READER_MAGIC == READER
    commands = {name: int(n) for name, n in re.findall(r"^### ([A-Z_]+) \((\d+)\)$", text, re.M)}
    assert commands == {"PUT": k3.PUT, "READ_HEAD": k3.READ_HEAD, "READ_DONE": k3.READ_DONE}
    # "command byte 0x73 represents command 7, which has no data block and 12 bytes of header"
    assert "command byte 0x73 represents command 7" in text and k3.command_byte(7, 3) == 0x73


def test_records_built_by_hand_decode_and_ours_encode_to_the_same_bytes() -> None:
    cases = [
        (put6(1, b"hello"), k3.FileKind.WRITER, k3.Put(1, 0, T0, None, b"hello")),
        (put8(2**63 + 5, b"", T0 + 9, errors=3), k3.FileKind.WRITER, k3.Put(2**63 + 5, 3, T0, T0 + 9, b"")),
        (read_head(0), k3.FileKind.READER, k3.ReadHead(0)),
        (read_head(77), k3.FileKind.READER, k3.ReadHead(77)),
        (read_done(), k3.FileKind.READER, k3.ReadDone(())),
        (read_done(80, 82), k3.FileKind.READER, k3.ReadDone((80, 82))),
    ]
    for raw, kind, record in cases:
        assert k3.decode(raw, 0, kind) == (record, len(raw))
        assert k3.encode(record) == raw
    assert put6(1, b"")[0] == 0x86 and put8(1, b"", 0)[0] == 0x88
    assert read_head(1)[0] == 0x02 and read_done(1)[0] == 0x91


def test_a_queue_directory_built_by_hand_replays(tmp_path: Path) -> None:
    (tmp_path / "jobs.1321401903634").write_bytes(WRITER + put6(1, b"a") + put6(2, b"b") + put8(3, b"c", T0 + 60_000))
    (tmp_path / "jobs.1321401903700").write_bytes(WRITER + put6(4, b"d", errors=2) + put6(5, b"e"))
    (tmp_path / "jobs.read.").write_bytes(READER + read_head(1) + read_done(3))
    (tmp_path / "jobs.read.indexer").write_bytes(READER + read_head(0) + read_done(2, 5))
    (tmp_path / "other.5").write_bytes(WRITER + put6(1, b"not jobs"))

    listed = files.list_queue_files(str(tmp_path), "jobs")
    assert [n for n, _ in listed.writers] == [1321401903634, 1321401903700]
    assert sorted(listed.readers) == ["", "indexer"]

    default = list(files.replay(str(tmp_path), "jobs"))
    assert [(p.id, p.data, p.error_count) for p in default] == [(2, b"b", 0), (4, b"d", 2), (5, b"e", 0)]
    indexer = list(files.replay(str(tmp_path), "jobs", "indexer"))
    assert [p.data for p in indexer] == [b"a", b"c", b"d"]
    assert indexer[1].expire_time == T0 + 60_000 and indexer[0].expire_time is None
    # A reader without a checkpoint has consumed nothing.
    assert [p.id for p in files.replay(str(tmp_path), "jobs", "new")] == [1, 2, 3, 4, 5]


def test_checkpoint_built_by_hand(tmp_path: Path) -> None:
    path = tmp_path / "jobs.read.x"
    path.write_bytes(READER + read_head(10) + read_done(14, 12) + read_done(20))
    assert files.read_checkpoint(str(path)) == files.ReaderCheckpoint(10, frozenset({12, 14, 20}))
    # The last head wins; done ids it passes are folded into it.
    path.write_bytes(READER + read_head(3) + read_done(5, 9) + read_head(4))
    assert files.read_checkpoint(str(path)) == files.ReaderCheckpoint(5, frozenset({9}))
    assert files.read_checkpoint(str(tmp_path / "jobs.read.missing")) == files.ReaderCheckpoint(0, frozenset())


# ---------------------------------------------------------------------------------------------
# Our files, read back by a reader written here from the document alone


def minimal_read(path: Path) -> tuple[bytes, list[tuple[int, tuple[int, ...], bytes]]]:
    """(header, [(command, header words, data)]) of one Kestrel 3 file."""
    raw = path.read_bytes()
    header, pos, out = raw[:4], 4, []
    while pos < len(raw):
        command, words = raw[pos] >> 4, raw[pos] & 15
        head = raw[pos + 1:pos + 1 + 4 * words]
        pos += 1 + 4 * words
        size = struct.unpack_from("<i", head)[0] if command >= 8 else 0
        fields = struct.unpack("<iiqq" + ("q" if words == 8 else ""), head) if command == 8 else (
            struct.unpack("<q", head) if command == 0 else (size,))
        out.append((command, fields, raw[pos:pos + size]))
        pos += size
    assert pos == len(raw)
    return header, out


def test_writer_journal_and_checkpoints_read_back_independently(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    journal = files.WriterJournal(str(tmp_path), "jobs", max_file_size=60, clock=clock)
    journal.put(b"first", T0)  # 4 header bytes + 1 + 24 + 5
    journal.put(b"second", T0 + 1, expire_time=T0 + 5000, error_count=2)  # 34 + (1 + 32 + 6) > 60: rotates
    clock.advance(10)
    journal.put(b"third", T0 + 2)
    journal.close()
    files.write_checkpoint(str(tmp_path), "jobs", "", files.ReaderCheckpoint(1, frozenset({3})))
    files.write_checkpoint(str(tmp_path), "jobs", "indexer", files.ReaderCheckpoint(0, frozenset()))

    names = sorted(os.listdir(tmp_path))
    assert names == [f"jobs.{T0}", f"jobs.{T0 + 1}", f"jobs.{T0 + 10}", "jobs.read.", "jobs.read.indexer"]
    puts = []
    for name in names[:3]:
        header, records = minimal_read(tmp_path / name)
        assert header == WRITER
        puts += records
    assert puts == [
        (8, (5, 0, 1, T0), b"first"),
        (8, (6, 2, 2, T0 + 1, T0 + 5000), b"second"),
        (8, (5, 0, 3, T0 + 2), b"third"),
    ]
    header, records = minimal_read(tmp_path / "jobs.read.")
    assert header == READER
    assert records == [(0, (1,), b""), (9, (8,), (3).to_bytes(8, "little"))]
    assert minimal_read(tmp_path / "jobs.read.indexer") == (READER, [(0, (0,), b""), (9, (0,), b"")])


# ---------------------------------------------------------------------------------------------
# Damaged input: a clear error naming file and offset, and never a large allocation


DAMAGE = [
    ("empty file", b"", 0, "header nothing is neither"),
    ("short header", WRITER[:2], 0, "header 27 64 is neither"),
    ("bad magic", b"\x27\x64\x26\x04" + put6(1, b"x"), 0, "is neither a Kestrel 3 writer journal"),
    ("kestrel 2 journal", encode_addx(T0, 0, b"k2"), 0, "is neither"),
    ("unknown command", WRITER + put6(1, b"x") + b"\x56" + bytes(24), 30, "unknown command 5 (command byte 0x56)"),
    ("reader record in a writer file", WRITER + read_head(1), 4, "READ_HEAD (command byte 0x02) does not belong in a writer journal"),
    ("writer record in a reader file", READER + put6(1, b"x"), 4, "PUT (command byte 0x86) does not belong in a reader checkpoint"),
    ("PUT with 7 header words", WRITER + b"\x87" + bytes(28), 4, "PUT takes 6 or 8 header words, not 7"),
    ("READ_HEAD with 3 words", READER + b"\x03" + bytes(12), 4, "READ_HEAD takes 2 header words, not 3"),
    ("negative data size", WRITER + b"\x86" + struct.pack("<i", -1) + bytes(20), 4, "negative data size -1"),
    ("item id 0", WRITER + put6(0, b"x"), 4, "item id 0"),
    ("negative error count", WRITER + put6(1, b"x", errors=2**32 - 1), 4, "negative error count -1"),
    ("READ_DONE of 12 bytes", READER + b"\x91" + struct.pack("<i", 12) + bytes(12), 4, "not a whole number of 8-byte ids"),
    ("READ_DONE of id 0", READER + read_done(5, 0), 4, "READ_DONE lists item id 0"),
]


@pytest.mark.parametrize(("raw", "offset", "reason"), [d[1:] for d in DAMAGE], ids=[d[0] for d in DAMAGE])
def test_damage_names_file_and_offset_without_large_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          raw: bytes, offset: int, reason: str) -> None:
    path = tmp_path / "jobs.1"
    path.write_bytes(raw)
    asked: list[int] = []
    real_pread = os.pread

    def spy(fd: int, n: int, at: int) -> bytes:
        asked.append(n)
        return real_pread(fd, n, at)

    monkeypatch.setattr(files.os, "pread", spy)
    with pytest.raises(CorruptJournalError) as caught:
        list(files.read_records(str(path)))
    assert caught.value.path == str(path) and caught.value.offset == offset
    assert reason in caught.value.reason
    assert f"{path} at offset {offset}" in str(caught.value)
    assert max(asked, default=0) <= max(len(raw), 4)


def test_checkpoint_of_the_wrong_kind_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "jobs.read."
    path.write_bytes(WRITER + put6(1, b"x"))
    with pytest.raises(CorruptJournalError, match="a writer journal where a reader checkpoint belongs"):
        files.read_checkpoint(str(path))


def test_replay_refuses_ids_that_go_backwards(tmp_path: Path) -> None:
    (tmp_path / "jobs.1").write_bytes(WRITER + put6(1, b"a") + put6(2, b"b"))
    (tmp_path / "jobs.2").write_bytes(WRITER + put6(2, b"again"))
    with pytest.raises(CorruptJournalError, match=r"jobs\.2 at offset 4 .*item id 2 does not follow id 2"):
        list(files.replay(str(tmp_path), "jobs"))


def test_a_writer_file_whose_ids_go_backwards_mid_run_is_refused_at_that_record(tmp_path: Path) -> None:
    records = [put6(1, b"a"), put8(2, b"bb", T0), put6(3, b""), put8(3, b"ccc", T0), put6(4, b"d")]
    (tmp_path / "jobs.1").write_bytes(WRITER + b"".join(records))
    offset = 4 + sum(len(r) for r in records[:3])
    with pytest.raises(CorruptJournalError, match=rf"jobs\.1 at offset {offset} .*item id 3 does not follow id 3"):
        files.scan_writer_file(1, str(tmp_path / "jobs.1"), 0)
    with pytest.raises(CorruptJournalError, match=r"jobs\.1 at offset 4 .*item id 1 does not follow id 7"):
        files.scan_writer_file(1, str(tmp_path / "jobs.1"), 7)


@pytest.mark.parametrize("tail", [put6(2, b"hello")[:-2], b"\x86\x05", b"\x00" * 9],
                         ids=["torn PUT", "torn header", "zeros"])
def test_a_torn_write_ends_any_writer_file_a_later_one_follows(tmp_path: Path, tail: bytes) -> None:
    """A rotation starts the next file while the previous one's fsync runs: a power cut can tear a
    file before the last. Its end was refused as damage, and with it the queue."""
    (tmp_path / "jobs.1").write_bytes(WRITER + put6(1, b"x") + tail)
    (tmp_path / "jobs.2").write_bytes(WRITER + put6(3, b"later"))
    assert [r.data for _, r in files.read_records(str(tmp_path / "jobs.1"))] == [b"x"]
    assert [(f.first_id, f.last_id) for f in [files.scan_writer_file(1, str(tmp_path / "jobs.1"), 0),
                                              files.scan_writer_file(2, str(tmp_path / "jobs.2"), 1)]] == [
        (1, 1), (3, 3)]
    assert (tmp_path / "jobs.1").read_bytes() == WRITER + put6(1, b"x")  # cut off, a copy kept
    assert [p.name for p in (tmp_path / ".kestrel" / "aside").iterdir()][0].startswith("jobs.1.torn-")


def valid_file() -> bytes:
    return WRITER + put6(1, b"abc") + put8(2, b"de", T0) + put6(3, b"")


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_any_damage_is_a_corrupt_journal_error_or_a_clean_prefix(tmp_path_factory: pytest.TempPathFactory,
                                                                 data: st.DataObject) -> None:
    kind = data.draw(st.sampled_from([WRITER, READER]))
    raw = bytearray(data.draw(st.sampled_from([valid_file(), READER + read_head(4) + read_done(6, 9)])))
    raw[:4] = kind
    for _ in range(data.draw(st.integers(0, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    raw = raw[:data.draw(st.integers(0, len(raw)))] + data.draw(st.binary(max_size=40))
    path = tmp_path_factory.mktemp("fuzz") / "q.1"
    path.write_bytes(bytes(raw))
    reader = None
    try:
        reader = files.RecordReader(str(path))
        records = list(reader)
    except CorruptJournalError as e:
        assert e.path == str(path) and 0 <= e.offset <= len(raw)
        return
    finally:
        if reader is not None:
            reader.close()
    # What was read re-encodes to exactly the bytes it came from.
    encoded = b"".join(k3.encode(r) for _, r in records)
    assert bytes(raw[4:4 + len(encoded)]) == encoded
    assert reader.offset == 4 + len(encoded)
    assert (reader.torn is None) == (reader.offset == len(raw))


# ---------------------------------------------------------------------------------------------
# File names


@pytest.mark.parametrize("queue", ["", ".", "..", "../jobs", "a/b", "/abs", "a\\b", "a\0b", "a.b", "a~b", "a b", "a\nb", "a\ud800"])
def test_queue_names_that_could_escape_or_collide_are_refused(queue: str) -> None:
    with pytest.raises(InvalidQueueName):
        filenames.writer_file_name(queue, 1)
    with pytest.raises(InvalidQueueName):
        filenames.reader_file_name(queue, "r")


@pytest.mark.parametrize("reader", [".", "..", "../../etc/passwd", "x/y", "/", "a.b", "~", "a\0", "tab\t"])
def test_reader_names_that_could_escape_or_collide_are_refused(reader: str) -> None:
    with pytest.raises(InvalidQueueName, match="reader name"):
        filenames.reader_file_name("jobs", reader)


def test_file_names_are_the_documents() -> None:
    assert filenames.writer_file_name("jobs", 1321401903634) == "jobs.1321401903634"
    assert filenames.reader_file_name("jobs") == "jobs.read."
    assert filenames.reader_file_name("jobs", "indexer") == "jobs.read.indexer"
    with pytest.raises(InvalidQueueName, match="longer than 255 bytes"):
        filenames.reader_file_name("q" * 200, "r" * 60)


@settings(max_examples=200, deadline=None)
@given(queue=st.text(max_size=20), reader=st.text(max_size=20))
def test_every_accepted_name_stays_inside_the_queue_path(queue: str, reader: str) -> None:
    base = "/var/spool/kestrel"
    for build in (lambda: filenames.reader_file_name(queue, reader), lambda: filenames.writer_file_name(queue, 7)):
        try:
            name = build()
        except InvalidQueueName:
            continue
        full = os.path.normpath(os.path.join(base, name))
        assert os.path.dirname(full) == base and os.path.basename(full) == name
        assert name.startswith(queue + ".") and "~" not in name


# ---------------------------------------------------------------------------------------------
# The writer journal


def test_rotation_numbers_increase_even_when_the_clock_does_not(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    journal = files.WriterJournal(str(tmp_path), "jobs", max_file_size=1 << 20, clock=clock)
    journal.rotate()
    journal.rotate()
    clock.ms = T0 - 500  # clock stepped back
    journal.rotate()
    assert [f.number for f in journal.files] == [T0, T0 + 1, T0 + 2, T0 + 3]
    journal.close()


def test_reopening_continues_ids_in_the_newest_file(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    journal = files.WriterJournal(str(tmp_path), "jobs", max_file_size=1 << 20, clock=clock)
    assert [journal.put(d, T0).id for d in (b"a", b"b")] == [1, 2]
    journal.close()
    again = files.WriterJournal(str(tmp_path), "jobs", max_file_size=1 << 20, clock=clock)
    assert again.tail_id == 2 and len(again.files) == 1
    assert again.put(b"c", T0).id == 3
    again.close()
    assert [p.data for p in files.replay(str(tmp_path), "jobs")] == [b"a", b"b", b"c"]


def test_opening_cuts_a_torn_final_record_and_keeps_what_precedes_it(tmp_path: Path) -> None:
    (tmp_path / "jobs.1").write_bytes(WRITER + put6(1, b"a"))
    (tmp_path / "jobs.2").write_bytes(WRITER + put6(2, b"b") + put6(3, b"torn")[:-1])
    journal = files.WriterJournal(str(tmp_path), "jobs", max_file_size=1 << 20)
    assert (tmp_path / "jobs.2").stat().st_size == 4 + 26
    assert journal.put(b"c", T0).id == 3
    journal.close()
    assert [p.data for p in files.replay(str(tmp_path), "jobs")] == [b"a", b"b", b"c"]


def test_a_torn_record_before_the_newest_file_is_cut_off_and_the_files_after_it_load(tmp_path: Path) -> None:
    """What a power cut leaves when a rotation's new file was named before the previous one's seal:
    refused as corruption, the queue with it."""
    (tmp_path / "jobs.1").write_bytes(WRITER + put6(1, b"a") + b"\x86")
    (tmp_path / "jobs.2").write_bytes(WRITER + put6(2, b"b"))
    journal = files.WriterJournal(str(tmp_path), "jobs", max_file_size=1 << 20)
    journal.close()
    assert (tmp_path / "jobs.1").stat().st_size == 30  # cut, a copy kept
    assert [p.data for p in files.replay(str(tmp_path), "jobs")] == [b"a", b"b"]


def test_a_newest_file_without_its_header_gets_one(tmp_path: Path) -> None:
    (tmp_path / "jobs.1").write_bytes(WRITER + put6(1, b"a"))
    (tmp_path / "jobs.2").write_bytes(WRITER[:1])  # the process stopped while creating it
    journal = files.WriterJournal(str(tmp_path), "jobs", max_file_size=1 << 20)
    assert journal.put(b"b", T0).id == 2 and journal.current.number == 2
    journal.close()
    assert (tmp_path / "jobs.2").read_bytes() == WRITER + put6(2, b"b")


def test_an_older_file_without_its_header_gets_one_and_holds_no_item(tmp_path: Path) -> None:
    """A power cut kept its name (a folder's fsync for another file made it durable) and none of
    its bytes: no item of it was acknowledged, and the files after it load."""
    (tmp_path / "jobs.1").write_bytes(WRITER + put6(1, b"a"))
    (tmp_path / "jobs.2").write_bytes(b"")
    (tmp_path / "jobs.3").write_bytes(WRITER[:2])
    (tmp_path / "jobs.4").write_bytes(WRITER + put6(4, b"d"))
    journal = files.WriterJournal(str(tmp_path), "jobs", max_file_size=1 << 20)
    assert [(f.number, f.first_id, f.last_id) for f in journal.files] == [(1, 1, 1), (2, 0, 0), (3, 0, 0),
                                                                          (4, 4, 4)]
    assert journal.put(b"e", T0).id == 5
    journal.close()
    assert (tmp_path / "jobs.2").read_bytes() == (tmp_path / "jobs.3").read_bytes() == WRITER
    assert [p.data for p in files.replay(str(tmp_path), "jobs")] == [b"a", b"d", b"e"]


def test_a_sealed_file_the_manifest_lists_found_without_its_header_is_refused_as_cut_short(
        tmp_path: Path) -> None:
    configs = QueueConfigs({}, {"q": {"journal_format": "kestrel3", "default_journal_size": 256}})
    coll = load_strictly(QueueCollection(str(tmp_path), configs))
    for _ in range(8):
        coll.put("q", [b"x" * 100])
    coll.close()
    writers = files.list_queue_files(str(tmp_path), "q").writers
    assert len(writers) > 2
    Path(writers[1][1]).write_bytes(b"")
    coll = QueueCollection(str(tmp_path), configs)
    coll.load()
    assert "cut short" in str(coll.refused["q"])
    coll.close()


def test_a_newest_file_too_short_for_a_header_that_does_not_begin_one_is_refused_not_rewritten(
        tmp_path: Path) -> None:
    (tmp_path / "jobs.1").write_bytes(WRITER + put6(1, b"a"))
    (tmp_path / "jobs.2").write_bytes(b"\x00\x07")
    with pytest.raises(CorruptJournalError, match=r"jobs\.2 at offset 0 .*header 00 07 is neither"):
        files.WriterJournal(str(tmp_path), "jobs", max_file_size=1 << 20)
    assert (tmp_path / "jobs.2").read_bytes() == b"\x00\x07"


def test_files_are_taken_only_once_every_head_passed_them(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    journal = files.WriterJournal(str(tmp_path), "jobs", max_file_size=40, clock=clock)
    for d in (b"1", b"2", b"3", b"4"):
        clock.advance(1)
        journal.put(d, T0)  # one item per file: 4 + 26 = 30 bytes, a second would pass 40
    assert [(f.first_id, f.last_id) for f in journal.files] == [(1, 1), (2, 2), (3, 3), (4, 4)]
    assert journal.take_consumed_files([]) == []
    assert journal.take_consumed_files([0, 3]) == []
    taken = journal.take_consumed_files([2, 3])
    assert [os.path.basename(f.path) for f in taken] == [f"jobs.{T0}", f"jobs.{T0 + 2}"]
    assert all(os.path.exists(f.path) for f in taken)  # taken out of the journal, not yet deleted
    files.delete_writer_files(str(tmp_path), taken)
    assert not any(os.path.exists(f.path) for f in taken)
    assert [f.path for f in journal.take_consumed_files([9])] == [str(tmp_path / f"jobs.{T0 + 3}")]  # never the current file
    assert [f.last_id for f in journal.files] == [4]
    journal.close()


def test_an_item_larger_than_a_file_still_gets_one(tmp_path: Path) -> None:
    journal = files.WriterJournal(str(tmp_path), "jobs", max_file_size=16, clock=FakeClock(T0))
    journal.put(b"x" * 100, T0)
    journal.put(b"y" * 100, T0)
    assert [(f.first_id, f.last_id) for f in journal.files] == [(1, 1), (2, 2)]
    journal.close()


# ---------------------------------------------------------------------------------------------
# Checkpoints


def test_checkpoint_round_trip_and_replay_after_it(tmp_path: Path) -> None:
    journal = files.WriterJournal(str(tmp_path), "jobs", max_file_size=1 << 20, clock=FakeClock(T0))
    for i in range(1, 8):
        journal.put(str(i).encode(), T0)
    journal.close()
    files.write_checkpoint(str(tmp_path), "jobs", "a", files.ReaderCheckpoint(2, frozenset({3, 4, 6, 1})))
    back = files.read_checkpoint(str(tmp_path / "jobs.read.a"))
    assert back == files.ReaderCheckpoint(4, frozenset({6}))
    assert [p.data for p in files.replay(str(tmp_path), "jobs", "a")] == [b"5", b"7"]
    assert [p.data for p in files.replay(str(tmp_path), "jobs", "b")] == [str(i).encode() for i in range(1, 8)]


def test_checkpoint_is_replaced_in_one_step_and_its_temporary_is_cleaned_up(tmp_path: Path) -> None:
    files.write_checkpoint(str(tmp_path), "jobs", "", files.ReaderCheckpoint(5))
    # A crash while writing the next one leaves a temporary beside the old, intact checkpoint.
    (tmp_path / filenames.checkpoint_temporary_name("jobs", "")).write_bytes(READER + b"\x02\x01")
    assert filenames.checkpoint_temporary_name("jobs", "") == "jobs~~read."
    assert files.read_checkpoint(str(tmp_path / "jobs.read.")).head == 5
    assert files.list_queue_files(str(tmp_path), "jobs").readers == {"": str(tmp_path / "jobs.read.")}
    remove_temporaries(str(tmp_path), "jobs")
    assert sorted(os.listdir(tmp_path)) == ["jobs.read."]


# ---------------------------------------------------------------------------------------------
# The dump command


def test_journal_dump_prints_both_formats(tmp_path: Path) -> None:
    writer = tmp_path / "jobs.1"
    writer.write_bytes(WRITER + put6(1, b"hi") + put8(2, b"yo", T0 + 5, errors=1))
    reader = tmp_path / "jobs.read."
    reader.write_bytes(READER + read_head(1) + read_done(3, 4))
    old = tmp_path / "old"
    old.write_bytes(encode_addx(T0, 0, b"k2"))
    torn = tmp_path / "jobs.2"
    torn.write_bytes(WRITER + put6(3, b"abc")[:-1])
    run = subprocess.run([sys.executable, "-m", "kestrel", "journal", "dump", str(writer), str(reader), str(old)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    lines = [line.split(None, 1) for line in run.stdout.splitlines()]
    assert lines[:4] == [
        ["0", "header: Kestrel 3 writer journal (27 64 26 03)"],
        ["4", f"put(id=1 errors=0 add={T0} expire=- 2:hi)"],
        ["31", f"put(id=2 errors=1 add={T0} expire={T0 + 5} 2:yo)"],
        [f"{writer}:", "2 records, 66 bytes"],
    ]
    assert lines[4:8] == [
        ["0", "header: Kestrel 3 reader checkpoint (26 3c 26 03)"],
        ["4", "read-head(1)"],
        ["13", "read-done(3,4)"],
        [f"{reader}:", "2 records, 34 bytes"],
    ]
    assert lines[8:] == [["0", "addx(2:0:k2)"], [f"{old}:", "1 records, 23 bytes"]]

    # The older entry point prints the same, and says where a file is torn.
    run = subprocess.run([sys.executable, "-m", "kestrel.storage.tools.dump", str(torn)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 1
    assert run.stdout.splitlines()[1:] == [
        "           4  torn: record of 28 bytes runs past the end of the file (27 bytes left)",
        f"{torn}: torn record at offset 4 after 0 records",
    ]


def test_dump_of_a_kestrel3_queue_prints_what_each_reader_would_load_and_changes_nothing(tmp_path: Path) -> None:
    (tmp_path / "jobs.1").write_bytes(WRITER + b"".join(put6(i, b"item %d" % i) for i in (1, 2, 3)))
    (tmp_path / "jobs.2").write_bytes(WRITER + put8(4, b"item 4", T0 + 5, errors=2))
    (tmp_path / "jobs.read.").write_bytes(READER + read_head(1) + read_done(3))
    (tmp_path / "jobs.read.audit").write_bytes(READER + read_head(0) + read_done(7)[:-1])  # torn: left as it is
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def dumped(queue: str) -> tuple[int, list[str], str]:
        out, err = io.StringIO(), io.StringIO()
        status = dump_queue(str(tmp_path), queue, out, err)
        return status, [line.split(None, 1)[1] for line in out.getvalue().splitlines()[:-1]], err.getvalue()

    assert dumped("jobs") == (0, [f"queued id=2 add={T0} expire=- 6:item 2",
                                  f"queued id=4 add={T0} expire={T0 + 5} 6:item 4"], "")
    status, lines, _ = dumped("jobs+audit")
    assert status == 0 and [line.split()[1] for line in lines] == ["id=1", "id=2", "id=3", "id=4"]
    assert dumped("jobs+nobody") == (1, [], f"{tmp_path}: Kestrel 3 queue 'jobs' has no reader 'nobody'\n")
    status, _, said = dumped("../jobs")
    assert status == 2 and said.startswith("--queue: ") and "'/'" in said  # no name that leaves the path
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before

    run = subprocess.run([sys.executable, "-m", "kestrel", "journal", "dump", "--queue", "jobs", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1] == "jobs: 2 items (Kestrel 3)"


def test_dump_names_a_file_it_cannot_read_and_goes_on(tmp_path: Path) -> None:
    good = tmp_path / "jobs.read."
    good.write_bytes(READER + read_head(0))
    out, err = io.StringIO(), io.StringIO()
    assert dump_files([str(tmp_path / "missing"), str(good)], out, err) == 1
    assert f"{tmp_path / 'missing'}: cannot read" in err.getvalue()
    assert out.getvalue().splitlines()[-1] == f"{good}: 1 records, 13 bytes"
