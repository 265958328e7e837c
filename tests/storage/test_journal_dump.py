"""`kestrel journal dump --queue` on a directory a running server is changing: a reading that lost a
file or saw the queue's files change is read again, so the dump shows one state the queue was in."""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kestrel.storage import settled_read
from kestrel.storage.kestrel2 import codec
from kestrel.storage.kestrel2 import replay as kestrel2_replay
from kestrel.storage.kestrel3 import files as kestrel3_files
from kestrel.storage.tools import check, dump
from tests.support.kestrel3_records import WRITER, put6

T0 = 1_700_000_000_000


@pytest.fixture(autouse=True)
def no_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(settled_read, "SETTLE_PAUSE_S", 0)


def adds(*items: bytes) -> bytes:
    return b"".join(codec.encode_addx(T0, 0, data) for data in items)


def dumped(path: Path, queue: str = "q") -> tuple[int, list[str], str]:
    out, err = io.StringIO(), io.StringIO()
    status = dump.dump_queue(str(path), queue, out, err)
    return status, [line.rsplit(":", 1)[1] for line in out.getvalue().splitlines()[:-1]], err.getvalue()


def listing_then(monkeypatch: pytest.MonkeyPatch, change: Callable[[int], None]) -> list[int]:
    """Make each Kestrel 2 replay list the files, then run `change(reading)` before reading them, as
    a server rotating or packing between the two would; the readings made."""
    readings: list[int] = []
    real = kestrel2_replay.replay_files

    def listed_then_changed(queue_path: str, queue: str) -> list[str]:
        paths = real(queue_path, queue)
        readings.append(len(readings) + 1)
        change(len(readings))
        return paths

    monkeypatch.setattr(kestrel2_replay, "replay_files", listed_then_changed)
    return readings


def test_a_rotation_between_listing_and_reading_is_read_again(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "q").write_bytes(adds(b"one", b"two"))

    def rotate(reading: int) -> None:
        if reading == 1:  # the live journal becomes a rotated one; a new live journal takes the next put
            os.rename(tmp_path / "q", tmp_path / f"q.{T0}")
            (tmp_path / "q").write_bytes(adds(b"three"))

    readings = listing_then(monkeypatch, rotate)
    assert dumped(tmp_path) == (0, ["one", "two", "three"], "")
    assert readings == [1, 2]


def test_a_pack_that_deleted_a_listed_journal_is_read_again(tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / f"q.{T0}").write_bytes(adds(b"one"))
    (tmp_path / f"q.{T0 + 1}").write_bytes(adds(b"two"))
    (tmp_path / "q").write_bytes(adds(b"three"))

    def pack(reading: int) -> None:
        if reading == 1:  # both rotated journals become one pack, and go
            (tmp_path / f"q.{T0 + 1}.pack").write_bytes(adds(b"one", b"two"))
            os.remove(tmp_path / f"q.{T0}")
            os.remove(tmp_path / f"q.{T0 + 1}")

    readings = listing_then(monkeypatch, pack)
    assert dumped(tmp_path) == (0, ["one", "two", "three"], "")
    assert readings == [1, 2]


def test_files_that_never_hold_still_are_named_not_half_printed(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "q").write_bytes(adds(b"one"))

    def rotate_every_time(reading: int) -> None:
        os.rename(tmp_path / "q", tmp_path / f"q.{T0 + reading}")
        (tmp_path / "q").write_bytes(b"")

    readings = listing_then(monkeypatch, rotate_every_time)
    status, lines, said = dumped(tmp_path)
    assert (status, lines) == (1, [])
    assert said == (f"{tmp_path}: the files of queue 'q' changed during each of {settled_read.READINGS} readings "
                    "(a busy server rotating or packing them); try again\n")
    assert len(readings) == settled_read.READINGS


def kestrel3_readings(monkeypatch: pytest.MonkeyPatch, during_first: Callable[[], None]) -> list[int]:
    """Run `during_first()` once the first reading of a Kestrel 3 queue's writer files is under way."""
    readings: list[int] = []
    real = kestrel3_files.pending_items

    def pending_items(*args: Any, **kwargs: Any) -> Iterator[Any]:
        readings.append(len(readings) + 1)
        try:
            yield from real(*args, **kwargs)
        finally:
            if len(readings) == 1:
                during_first()

    monkeypatch.setattr(kestrel3_files, "pending_items", pending_items)
    return readings


def test_a_kestrel3_append_read_half_written_is_the_queue_before_it(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Half written, the append is a torn tail of the newest file: a start would cut it off, so the
    queue without it is one state it was in (as a Kestrel 2 journal's is)."""
    record = put6(2, b"two")
    writer = tmp_path / "q.1"
    writer.write_bytes(WRITER + put6(1, b"one") + record[:9])

    def finish_the_append() -> None:
        with open(writer, "ab") as f:
            f.write(record[9:])

    readings = kestrel3_readings(monkeypatch, finish_the_append)
    torn = f"note: q.1 ends in a torn write at offset {4 + len(put6(1, b'one'))}: the next start cuts it off"
    status, lines, said = dumped(tmp_path)
    assert (status, lines) == (0, ["one"]) and said.startswith(torn)
    assert readings == [1]
    assert dumped(tmp_path) == (0, ["one", "two"], "")


def test_damage_in_files_that_held_still_is_reported_after_one_reading(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "q.1").write_bytes(WRITER + put6(1, b"one") + b"\x56" + bytes(24))  # a byte no record starts with
    (tmp_path / "q.2").write_bytes(WRITER + put6(3, b"three"))
    readings = kestrel3_readings(monkeypatch, lambda: None)
    status, lines, said = dumped(tmp_path)
    assert (status, lines) == (1, []) and said.startswith(f"{tmp_path / 'q.1'}: corrupt record at offset ")
    assert "unknown command" in said, said
    assert readings == [1]


def test_a_kestrel3_torn_tail_is_dumped_as_check_and_a_start_take_it(tmp_path: Path) -> None:
    """The torn-tail rule was told every writer file had a next one: a torn write at the end of the
    newest made `dump --queue` print nothing and fail, where `check` and a start cut it off."""
    whole = WRITER + put6(1, b"one") + put6(2, b"two")
    (tmp_path / "q.1700000000000").write_bytes(whole + put6(3, b"three")[:10])
    torn = f"q.1700000000000 ends in a torn write at offset {len(whole)}: the next start cuts it off, a copy kept"
    assert dumped(tmp_path) == (0, ["one", "two"], f"note: {torn}\n")
    out = io.StringIO()
    assert check.check(str(tmp_path), ["q"], out) == 0
    assert out.getvalue() == f"q (kestrel3): ok; {torn}; 2 items written, 0 readers\n"


def test_a_newest_kestrel3_file_whose_header_never_reached_the_disk_is_dumped_as_a_start_takes_it(
        tmp_path: Path) -> None:
    """A start writes such a file's header (`check`: "the next start writes it"); `dump --queue`
    called it corrupt at offset 0 and printed nothing."""
    (tmp_path / "q.1700000000000").write_bytes(WRITER + put6(1, b"one"))
    (tmp_path / "q.1700000000001").write_bytes(WRITER[:2])
    assert dumped(tmp_path)[:2] == (0, ["one"])


def test_a_queue_with_no_journal_is_named_not_shown_empty(tmp_path: Path) -> None:
    (tmp_path / "other").write_bytes(adds(b"one"))
    assert dumped(tmp_path, "q") == (1, [], f"{tmp_path}: holds no journal of queue 'q'\n")
    assert dumped(tmp_path, "other") == (0, ["one"], "")


def test_a_fifo_named_on_the_command_line_is_refused_not_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / "q"
    os.mkfifo(fifo)
    (tmp_path / "r").write_bytes(adds(b"one"))
    out, err = io.StringIO(), io.StringIO()
    assert dump.dump_files([str(fifo), str(tmp_path / "r")], out, err) == 1
    assert err.getvalue().endswith(f"{fifo}: cannot read: not a regular file but a FIFO\n")
    assert out.getvalue().endswith(f"{tmp_path / 'r'}: 1 records, 24 bytes\n")  # the next one is read


@pytest.mark.parametrize("segment", ["fifo", "directory"])
def test_a_commit_log_segment_that_cannot_be_read_is_one_note_and_the_journals_are_still_dumped(
        tmp_path: Path, segment: str) -> None:
    """The commit log is only looked at for a note: a segment that could not be opened ended each
    dump in a traceback, printing none of the journal's records."""
    segments = tmp_path / ".kestrel" / "commit-log"
    segments.mkdir(parents=True)
    os.mkfifo(segments / "1") if segment == "fifo" else (segments / "1").mkdir()
    (tmp_path / "q").write_bytes(adds(b"one"))
    out, err = io.StringIO(), io.StringIO()
    assert dump.dump_files([str(tmp_path / "q")], out, err) == 0
    assert out.getvalue().endswith(f"{tmp_path / 'q'}: 1 records, 24 bytes\n")
    note = err.getvalue()
    assert note.startswith(f"note: cannot read {segments / '1'}: not a regular file but a ") and note.count("\n") == 1
    assert dumped(tmp_path) == (0, ["one"], note)
