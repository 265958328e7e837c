"""`kestrel journal convert`: queues between the Kestrel 2 and Kestrel 3 formats, on the files."""

from __future__ import annotations

import argparse
import errno
import io
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kestrel.storage import QueueCollection, formats
from kestrel.storage.clock import FakeClock
from kestrel.storage.errors import (
    ConfigError,
    ConvertError,
    CorruptJournalError,
    JournalWriteError,
    QueueDamaged,
    QueuePathInUse,
)
from kestrel.storage.kestrel2.codec import encode_addx
from kestrel.storage.kestrel2.replay import replay_queue
from kestrel.storage.kestrel3.codec import WRITER_MAGIC
from kestrel.storage.kestrel3.files import (
    ReaderCheckpoint,
    WriterJournal,
    list_queue_files,
    replay,
    write_checkpoint,
)
from kestrel.storage.lock import QueuePathLock
from kestrel.storage.queue_path import delete_temporaries, scan_queue_dir
from kestrel.storage.tools import check, convert, recover
from tests.support.queues import drain, one, open_collection

T0 = 1_700_000_000_000
Item = tuple[bytes, int, int]  # data, add time, expiry (0 = never)


class Crash(BaseException):
    """Stands for the process dying at a failpoint: nothing after it runs, no clean-up either."""


def k2_collection(path: Path, clock: FakeClock | None = None, fmt: str = "kestrel2") -> QueueCollection:
    return open_collection(path, {"journal_format": fmt}, clock=clock or FakeClock(T0))


def make_k2(path: Path) -> list[Item]:
    """A Kestrel 2 queue `jobs` with expiring items and two open reads; what a restart would serve."""
    clock = FakeClock(T0)
    coll = k2_collection(path, clock)
    coll.put("jobs", [b"one"], T0 + 50_000)
    clock.advance(10)
    coll.put("jobs", [b"two", b"three", b"four"])
    clock.advance(10)
    coll.put("jobs", [b"five"], T0 + 90_000)
    first = one(coll.remove("jobs", transaction=True))
    second = one(coll.remove("jobs", transaction=True))
    assert first is not None and second is not None
    coll.confirm("jobs", [first.xid])
    third = one(coll.remove("jobs", transaction=True))  # "three" stays open, as does "two"
    assert third is not None and one(coll.remove("jobs")) is not None  # "four" is gone for good
    coll.close()
    return [(b"two", T0 + 10, 0), (b"three", T0 + 10, 0), (b"five", T0 + 20, T0 + 90_000)]


def k2_items(path: Path, queue: str = "jobs") -> list[Item]:
    return [(i.data, i.add_time, i.expiry) for i in replay_queue(str(path), queue).restart_order()]


def k3_items(path: Path, queue: str = "jobs", reader: str = "") -> list[Item]:
    return [(p.data, p.add_time, p.expire_time or 0) for p in replay(str(path), queue, reader)]


def make_k3(path: Path) -> list[Item]:
    """A Kestrel 3 queue `jobs`: five items, the first and the third consumed."""
    writer = WriterJournal(str(path), "jobs", 1 << 20, clock=FakeClock(T0))
    for n, data in enumerate([b"a", b"b", b"c", b"d", b"e"]):
        writer.put(data, T0 + n, T0 + 100_000 if n % 2 else None, error_count=n % 3)
    writer.close()
    write_checkpoint(str(path), "jobs", "", ReaderCheckpoint(1, frozenset({3})))
    return [(b"b", T0 + 1, T0 + 100_000), (b"d", T0 + 3, T0 + 100_000), (b"e", T0 + 4, 0)]


def file_names(path: Path) -> list[str]:
    """The queue path's files, and those of the server's own directory (`.kestrel/...`) but for the
    lock file (it stays, empty, once its owner is gone)."""
    own = path / ".kestrel"
    mine = [f".kestrel/{n}" for n in os.listdir(own) if n != "lock"] if own.exists() else []
    return sorted([n for n in os.listdir(path) if n != ".kestrel"] + mine)


def run(path: Path, to: str, *queues: str) -> str:
    out = io.StringIO()
    convert.convert(str(path), to, list(queues), out, FakeClock(T0 + 1_000))
    return out.getvalue()


def test_kestrel2_to_kestrel3_keeps_items_order_expiry_and_open_reads_at_the_head(tmp_path: Path) -> None:
    expected = make_k2(tmp_path)
    assert k2_items(tmp_path) == expected
    output = run(tmp_path, "kestrel3")
    assert k3_items(tmp_path) == expected
    assert [p.id for p in replay(str(tmp_path), "jobs")] == [1, 2, 3]
    assert scan_queue_dir(str(tmp_path)).queues["jobs"].live is None  # no Kestrel 2 file is left
    assert file_names(tmp_path) == [".kestrel/jobs.manifest", "jobs.1700000001000", "jobs.read."]
    assert "jobs: converted to kestrel3: jobs 3 items (2 open reads back at the head)" in output
    assert output.splitlines()[-1].startswith("converted 1 queues (3 items) to kestrel3")


def test_kestrel3_to_kestrel2_keeps_the_default_readers_pending_items(tmp_path: Path) -> None:
    expected = make_k3(tmp_path)
    output = run(tmp_path, "kestrel2")
    assert k2_items(tmp_path) == expected
    assert file_names(tmp_path) == ["jobs"]
    assert "jobs: converted to kestrel2: jobs 3 items" in output
    assert "error counts of 2 items are not kept" in output
    coll = k2_collection(tmp_path)
    assert drain(coll, "jobs") == [b"b", b"d", b"e"]


def test_round_trip_kestrel2_kestrel3_kestrel2_gives_the_same_items(tmp_path: Path) -> None:
    expected = make_k2(tmp_path)
    run(tmp_path, "kestrel3")
    run(tmp_path, "kestrel2")
    assert k2_items(tmp_path) == expected
    assert replay_queue(str(tmp_path), "jobs").opens == {}  # the open reads are plain items now


def test_fanout_children_become_readers_and_back(tmp_path: Path) -> None:
    coll = k2_collection(tmp_path)
    coll.put("feed+audit", [b"old"])  # created first: it gets every later item too
    coll.put("feed", [b"x", b"y", b"z"])
    assert one(coll.remove("feed")) is not None
    coll.put("solo", [b"s"])
    coll.close()
    before = {q: k2_items(tmp_path, q) for q in ("feed", "feed+audit", "solo")}
    run(tmp_path, "kestrel3", "feed")
    assert [d for d, _, _ in k3_items(tmp_path, "feed")] == [b"y", b"z"]
    assert [d for d, _, _ in k3_items(tmp_path, "feed", "audit")] == [b"old", b"x", b"y", b"z"]
    assert sorted(list_queue_files(str(tmp_path), "feed").readers) == ["", "audit"]
    assert k2_items(tmp_path, "solo") == before["solo"]  # not named: left as it was
    run(tmp_path, "kestrel2")
    assert {q: k2_items(tmp_path, q) for q in before} == before


def test_a_fanout_only_parent_gets_an_empty_default_reader(tmp_path: Path) -> None:
    coll = k2_collection(tmp_path)
    coll.put("feed+only", [b"x"])
    coll.close()
    assert not (tmp_path / "feed").exists()  # a Kestrel 2 child stands alone: its parent is not created
    run(tmp_path, "kestrel3")
    assert k3_items(tmp_path, "feed") == [] and [d for d, _, _ in k3_items(tmp_path, "feed", "only")] == [b"x"]
    run(tmp_path, "kestrel2")
    assert k2_items(tmp_path, "feed") == [] and [d for d, _, _ in k2_items(tmp_path, "feed+only")] == [b"x"]


def test_queues_named_up_to_the_longest_name_convert_both_ways(tmp_path: Path) -> None:
    """A temporary repeated the queue's name (`<queue>~~convert-<queue>.<ms>`): past about 115 bytes
    it was longer than a file name may be, and the conversion failed with "File name too long"."""
    long = "é" * 98 + "xx"  # 198 bytes: its child "+c" reaches the 200 a name may have
    coll = k2_collection(tmp_path)
    coll.put(f"{long}+c", [b"first"])
    coll.put(long, [b"a", b"b"])
    coll.close()
    before = {q: k2_items(tmp_path, q) for q in (long, f"{long}+c")}
    run(tmp_path, "kestrel3")
    assert [d for d, _, _ in k3_items(tmp_path, long, "c")] == [b"first", b"a", b"b"]
    run(tmp_path, "kestrel2")
    assert {q: k2_items(tmp_path, q) for q in before} == before


STEPS = ["written", "switched", "renamed", "deleted", "finished"]


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize("to", ["kestrel3", "kestrel2"])
def test_a_crash_at_any_step_leaves_one_complete_format(tmp_path: Path, to: str, step: str) -> None:
    expected = make_k2(tmp_path) if to == "kestrel3" else make_k3(tmp_path)
    old_files = file_names(tmp_path)

    def crash(name: str) -> None:
        if name == step:
            raise Crash(name)

    formats.failpoint = crash
    try:
        with pytest.raises(Crash):
            run(tmp_path, to)
    finally:
        formats.failpoint = None
    switched = (tmp_path / convert.INTENT_NAME).exists()
    assert switched == (step != "written")
    if not switched:  # the old format is whole, and only temporaries were added
        assert [n for n in file_names(tmp_path) if "~~" not in n] == old_files
    # What the next start-up does before it reads anything: finish, then drop temporaries.
    convert.finish_interrupted(str(tmp_path))
    delete_temporaries(scan_queue_dir(str(tmp_path)).temporaries)
    now = "kestrel2" if (to == "kestrel3") != switched else "kestrel3"
    assert convert.queues_on_disk(str(tmp_path)) == {"jobs": now}
    if now == "kestrel3":
        assert k3_items(tmp_path) == expected
        assert scan_queue_dir(str(tmp_path)).queues["jobs"].live is None
    else:
        assert k2_items(tmp_path) == expected
        assert not list_queue_files(str(tmp_path), "jobs").readers
    assert not (tmp_path / convert.INTENT_NAME).exists()


def test_server_start_up_finishes_an_interrupted_conversion(tmp_path: Path) -> None:
    expected = make_k3(tmp_path)

    def crash(name: str) -> None:
        if name == "renamed":
            raise Crash(name)

    formats.failpoint = crash
    try:
        with pytest.raises(Crash):
            run(tmp_path, "kestrel2")
    finally:
        formats.failpoint = None
    coll = k2_collection(tmp_path)
    assert [(i.data, i.add_time, i.expiry) for i in coll.queue("jobs").open_reads()] == []
    assert drain(coll, "jobs") == [d for d, _, _ in expected]
    assert file_names(tmp_path) == ["jobs"]


def test_converter_refuses_a_locked_queue_path(tmp_path: Path) -> None:
    make_k2(tmp_path)
    with QueuePathLock(str(tmp_path)) as lock:
        lock.acquire("kestrel serve")
        with pytest.raises(QueuePathInUse, match=r"is in use by kestrel serve \(pid \d+\)"):
            run(tmp_path, "kestrel3")
    assert k2_items(tmp_path)  # untouched
    run(tmp_path, "kestrel3")


def test_start_up_refuses_files_in_the_other_format_naming_the_convert_command(tmp_path: Path) -> None:
    make_k3(tmp_path)
    with pytest.raises(ConfigError, match=r"queues.jobs.journal_format: queue 'jobs' has Kestrel 3 journal "
                                          r"files .* `kestrel journal convert --to kestrel2 .* jobs`"):
        k2_collection(tmp_path)
    run(tmp_path, "kestrel2")
    with pytest.raises(ConfigError, match=r"has Kestrel 2 journal files .* --to kestrel3 .* jobs`"):
        k2_collection(tmp_path, fmt="kestrel3")
    assert drain(k2_collection(tmp_path), "jobs") == [b"b", b"d", b"e"]


@pytest.mark.parametrize(("fmt", "stray"), [("kestrel3", "jobs.1234.pack"), ("kestrel3", "jobs"),
                                             ("kestrel3", "jobs.1234"), ("kestrel2", "jobs.9999999999999")])
def test_a_file_of_the_other_format_beside_a_queue_s_files_refuses_that_queue_alone_naming_it(
        tmp_path: Path, fmt: str, stray: str) -> None:
    """A stray or copied file of the other format beside a queue's files: the start refused the whole
    server, naming a convert command that refused in turn ("the manifest lists kestrel3 files where
    the queue's files are kestrel2"), and neither named the file. Now the queue is refused alone,
    the files of both formats named, by the start, `check` and `convert`; moved out, it serves."""
    expected = make_k3(tmp_path) if fmt == "kestrel3" else make_k2(tmp_path)
    coll = k2_collection(tmp_path, fmt=fmt)
    coll.put("other", [b"kept"])
    coll.close()
    (tmp_path / stray).write_bytes(WRITER_MAGIC + b"copied" if fmt == "kestrel2" else b"\x01junk")
    coll = k2_collection(tmp_path, fmt=fmt)
    assert drain(coll, "other") == [b"kept"]
    with pytest.raises(QueueDamaged, match=r"Kestrel 2 journal files \(.+\) beside Kestrel 3 writer files") as refused:
        coll.queue("jobs")
    assert f"{stray})" in str(refused.value) or f"{stray}," in str(refused.value)
    coll.close()
    out = io.StringIO()
    assert check.check(str(tmp_path), [], out) == 1
    assert f"jobs: refused: journal file {tmp_path}/" in out.getvalue() and "move the others out" in out.getvalue()
    output = run(tmp_path, "kestrel2" if fmt == "kestrel3" else "kestrel3")
    assert "jobs: not converted: " in output and stray in output and "jobs: converted" not in output
    run(tmp_path, fmt, "other")  # back, so that `other` loads under `fmt` again
    (tmp_path / stray).unlink()
    coll = k2_collection(tmp_path, fmt=fmt)
    assert [d for d, _, _ in expected] == drain(coll, "jobs")
    coll.close()


@pytest.mark.parametrize("fmt", ["kestrel2", "kestrel3"])
@pytest.mark.parametrize(("stray", "data"), [
    pytest.param(stray, data, id=stray) for stray, data in (
        ("core", b"\x7fELF\x02\x01\x01" + bytes(64) + b"stack"), ("README", b"Queues live here.\n"),
        ("r", b"junk"), ("jobs.1234", b"junk"))])
def test_a_file_in_neither_format_refuses_its_queue_alone_under_either_format(
        tmp_path: Path, fmt: str, stray: str, data: bytes) -> None:
    """A stray file named as a journal is (`core`, `README`) that begins with neither a Kestrel 2
    record nor a Kestrel 3 header: under kestrel3 it stopped the whole start with a `journal_format`
    error naming a convert command, which failed on it in turn; under kestrel2 it was called a
    damaged journal. Now, in both formats, its queue alone is refused naming the file and what it
    begins with, by the start, `check` and `convert`; moved out, the queue loads."""
    expected = [d for d, _, _ in (make_k3(tmp_path) if fmt == "kestrel3" else make_k2(tmp_path))]
    coll = k2_collection(tmp_path, fmt=fmt)
    coll.put("other", [b"kept"])
    coll.close()
    (tmp_path / stray).write_bytes(data)
    queue = stray.partition(".")[0]
    coll = k2_collection(tmp_path, fmt=fmt)  # the start goes on
    assert drain(coll, "other") == [b"kept"]
    with pytest.raises(QueueDamaged, match=r"is in neither journal format") as refused:
        coll.queue(queue)
    assert f"file {tmp_path / stray} " in str(refused.value) and data[:4].hex(" ") in str(refused.value)
    assert "move " in str(refused.value) and "--salvage does not apply" in str(refused.value)
    coll.close()
    out = io.StringIO()
    assert check.check(str(tmp_path), [], out) == 1
    assert f"{queue}: refused: file {tmp_path / stray} is in neither journal format" in out.getvalue()
    output = run(tmp_path, "kestrel2" if fmt == "kestrel3" else "kestrel3")
    assert f"{queue}: not converted: file {tmp_path / stray}" in output and "other: converted" in output
    assert (tmp_path / stray).read_bytes() == data  # nothing changed
    run(tmp_path, fmt)  # back, so that the queues load under `fmt` again
    (tmp_path / stray).unlink()
    coll = k2_collection(tmp_path, fmt=fmt)
    assert drain(coll, "jobs") == expected and not coll.refused
    coll.close()


def convert_args(path: Path, to: str, *queues: str) -> argparse.Namespace:
    return argparse.Namespace(queue_path=str(path), to=to, queues=list(queues))


def test_a_queue_left_unconverted_makes_the_run_exit_1_saying_how_many(tmp_path: Path) -> None:
    """A stray file (or a link to one) named as a journal was said to be `not converted` and the
    run still exited 0, as if every queue were in the new format: `convert && <switch
    journal_format>` switched with a queue left behind. Now it exits 1, as a damaged journal does,
    and the summary says how many were left; a run naming only other queues is not concerned."""
    coll = k2_collection(tmp_path)
    coll.put("jobs", [b"1"])
    coll.close()
    (tmp_path / "stray").write_bytes(b"hello\n")
    (tmp_path / "notes.txt").write_bytes(b"hello\n")
    os.symlink(tmp_path / "notes.txt", tmp_path / "linked")
    out, err = io.StringIO(), io.StringIO()
    assert convert.run(convert_args(tmp_path, "kestrel3"), out, err) == 1
    assert "linked: not converted: " in out.getvalue() and "stray: not converted: " in out.getvalue()
    assert "converted 1 queues (1 items) to kestrel3 in " in out.getvalue()
    assert f"in {tmp_path}, 2 not converted (said above); set journal_format" in out.getvalue()
    assert convert.run(convert_args(tmp_path, "kestrel2", "jobs"), io.StringIO(), err) == 0
    assert err.getvalue() == "" and formats.queues_on_disk(str(tmp_path))["jobs"] == "kestrel2"


def every_path(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


def test_a_folder_that_is_no_queue_path_is_left_as_it_is_by_convert_and_recover(tmp_path: Path) -> None:
    """Run on a folder of other files (no journal, no `.kestrel/`), `convert` and `recover` made
    `.kestrel/lock` in it and said all was done. Now they leave it as they find it, saying there is
    nothing there, and still refuse while a process holds the directory as a server does."""
    (tmp_path / "notes.txt").write_text("hello\n")
    (tmp_path / "subdir").mkdir()
    before = every_path(tmp_path)
    out = io.StringIO()
    args = argparse.Namespace(queue_path=str(tmp_path))
    assert recover.run(args, out, io.StringIO()) == 0
    assert every_path(tmp_path) == before
    assert out.getvalue() == f"{tmp_path}: no commit log: nothing to recover\n"
    out = io.StringIO()
    assert convert.run(convert_args(tmp_path, "kestrel3"), out, io.StringIO()) == 0
    assert every_path(tmp_path) == before
    assert f"{tmp_path}: no queue journals found\nconverted 0 queues (0 items)" in out.getvalue()
    with QueuePathLock(str(tmp_path)) as lock:  # a server whose `.kestrel/` was removed from under it
        lock.acquire("kestrel serve")
        os.unlink(lock.path)
        os.rmdir(tmp_path / ".kestrel")
        with pytest.raises(QueuePathInUse, match="holds the directory's lock"):
            run(tmp_path, "kestrel3")
        assert recover.run(args, io.StringIO(), io.StringIO()) == 3
    assert every_path(tmp_path) == before


ELF = b"\x7fELF\x02\x01\x01" + bytes(64)  # what a `core` begins with: neither format


@pytest.mark.parametrize("fmt", ["kestrel2", "kestrel3"])
def test_a_file_named_as_a_queue_s_journal_put_there_after_start_up_refuses_it_as_a_start_does(
        tmp_path: Path, fmt: str) -> None:
    """A file in neither format named as queue `jobs`'s live journal, put in the queue path after
    start-up and before `jobs` was first named: under kestrel3 the queue was made beside it (its items
    then refused by the next start), under kestrel2 it was called a journal damaged at offset 0. Now
    the creation refuses the queue as a start does, naming the file, and it stays refused (in
    `refused`), the other queues serving; nothing is changed, and once the file is moved out the next
    start serves the queue."""
    coll = open_collection(tmp_path, {"journal_format": fmt})
    coll.put("other", [b"kept"])
    (tmp_path / "jobs").write_bytes(ELF)
    for _ in range(2):
        with pytest.raises(QueueDamaged, match=r"refused as it was first named after start-up: file "
                                               r".*/jobs is in neither journal format.*move "):
            coll.put("jobs", [b"x"])
    assert list(coll.refused) == ["jobs"] and coll.get("jobs") is None
    assert coll.put("other", [b"more"]) == 1 and drain(coll, "other") == [b"kept", b"more"]
    coll.close()
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("jobs")) == ["jobs"]
    assert (tmp_path / "jobs").read_bytes() == ELF
    (tmp_path / "jobs").unlink()
    again = open_collection(tmp_path, {"journal_format": fmt})
    assert again.put("jobs", [b"y"]) == 1 and drain(again, "jobs") == [b"y"] and again.refused == {}
    again.close()


@pytest.mark.parametrize(("fmt", "stray", "data", "refusal"), [
    ("kestrel3", "jobs.1234.pack", b"\x01junk",
     r"Kestrel 2 journal files \(jobs.1234.pack\) beside Kestrel 3 writer files \(jobs\.\d+\)"),
    ("kestrel2", "jobs.1234", ELF, r"file .*/jobs.1234 is in neither journal format")], ids=["other-format", "neither-format"])
def test_a_stray_file_beside_what_a_failed_creation_left_refuses_the_queue_at_its_next_try(
        tmp_path: Path, fmt: str, stray: str, data: bytes, refusal: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A queue whose creation the disk failed (an fsync) owns the files it left, which its next try
    reads: a stray put there meanwhile, of the other format or of neither, was taken for a journal to
    convert (kestrel3) or a damaged one (kestrel2). It is refused as a start refuses it, naming the
    files, before anything opens them."""
    coll = open_collection(tmp_path, {"journal_format": fmt, "sync_journal": "always"})

    def failing(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing)
    with pytest.raises(JournalWriteError):
        coll.put("jobs", [b"one"])
    monkeypatch.undo()
    left = sorted(os.listdir(tmp_path))
    (tmp_path / stray).write_bytes(data)
    with pytest.raises(QueueDamaged, match=refusal):
        coll.put("jobs", [b"two"])
    assert list(coll.refused) == ["jobs"]
    coll.close()
    assert sorted(os.listdir(tmp_path)) == sorted([*left, stray])  # nothing changed


def test_a_journal_that_begins_with_an_opcode_stays_kestrel2_s_however_damaged(tmp_path: Path) -> None:
    """A file that begins with a Kestrel 2 opcode is a Kestrel 2 journal by its first record: damaged
    at offset 0 under kestrel2 (--salvage applies), a journal to convert under kestrel3."""
    addx = [encode_addx(T0, 0, data) for data in (b"one", b"two", b"three")]
    (tmp_path / "jobs").write_bytes(addx[0][:2] + b"\x10" + addx[0][3:] + addx[1] + addx[2])  # a size too large
    coll = k2_collection(tmp_path)
    with pytest.raises(QueueDamaged, match=r"corrupt journal .*jobs at offset 0 \(opcode 2\).*--salvage would"):
        coll.queue("jobs")
    coll.close()
    with pytest.raises(ConfigError, match=r"has Kestrel 2 journal files .* --to kestrel3 .* jobs`"):
        k2_collection(tmp_path, fmt="kestrel3")


def test_a_writer_file_of_zeros_is_judged_as_the_kestrel3_queue_s_damage_not_as_another_format(tmp_path: Path) -> None:
    """Zeros are what a power cut leaves of a file's unwritten start: no format's mark, so the queue's
    own loader judges the file (and names its header), rather than call it a Kestrel 2 file."""
    make_k3(tmp_path)
    (tmp_path / "jobs.1999999999999").write_bytes(bytes(16))
    coll = k2_collection(tmp_path, fmt="kestrel3")
    with pytest.raises(QueueDamaged, match=r"header 00 00 00 00 is neither a Kestrel 3 writer journal"):
        coll.queue("jobs")
    coll.close()


def test_a_stray_reader_checkpoint_beside_kestrel2_journals_leaves_the_queue_kestrel2_for_tools_and_start(
        tmp_path: Path) -> None:
    """A checkpoint with no writer file is no Kestrel 3 queue: the tools called the queue Kestrel 3 with
    no items while a start loaded its journal, and the convert command a start named did nothing."""
    coll = k2_collection(tmp_path)
    coll.put("jobs", [b"one", b"two"])
    coll.close()
    write_checkpoint(str(tmp_path), "jobs", "x", ReaderCheckpoint(0))
    assert convert.queues_on_disk(str(tmp_path)) == {"jobs": "kestrel2"}
    out = io.StringIO()
    assert check.check(str(tmp_path), [], out) == 0
    assert "jobs (kestrel2): ok; 2 items, 0 of them open reads; jobs.read.x is a Kestrel 3 reader" in out.getvalue()
    with pytest.raises(ConfigError, match=r"has Kestrel 2 journal files .* --to kestrel3 .* jobs`"):
        k2_collection(tmp_path, fmt="kestrel3")
    output = run(tmp_path, "kestrel3", "jobs")
    assert "jobs: converted to kestrel3: jobs 2 items" in output and "jobs.read.x: a Kestrel 3 reader" in output
    assert sorted(list_queue_files(str(tmp_path), "jobs").readers) == [""]  # set aside: not a reader now
    coll = k2_collection(tmp_path, fmt="kestrel3")
    assert drain(coll, "jobs") == [b"one", b"two"] and coll.queue_names() == ["jobs"]
    coll.close()


@pytest.mark.parametrize("header", [b"", WRITER_MAGIC[:1], WRITER_MAGIC[:3]])
def test_a_lone_writer_file_whose_header_never_reached_the_disk_loads_in_the_configured_format(
        tmp_path: Path, header: bytes) -> None:
    coll = k2_collection(tmp_path, fmt="kestrel3")
    coll.put("other", [b"kept"])
    coll.remove("jobs")  # creates jobs's writer file
    coll.close()
    (writer,) = list_queue_files(str(tmp_path), "jobs").writers
    Path(writer[1]).write_bytes(header)  # a crash before its header reached the disk
    assert convert.queues_on_disk(str(tmp_path))["jobs"] == "kestrel3"
    coll = k2_collection(tmp_path, fmt="kestrel3")
    coll.put("jobs", [b"new"])
    assert drain(coll, "jobs") == [b"new"] and drain(coll, "other") == [b"kept"]
    coll.close()


def test_an_empty_file_named_like_a_rotated_journal_is_still_kestrel2_s_under_kestrel2(tmp_path: Path) -> None:
    (tmp_path / "jobs.1796209255114").write_bytes(b"")
    coll = k2_collection(tmp_path)
    coll.put("jobs", [b"a"])
    assert drain(coll, "jobs") == [b"a"]
    coll.close()


def test_naming_queues_converts_only_those_and_says_what_it_skipped(tmp_path: Path) -> None:
    coll = k2_collection(tmp_path)
    coll.put("a", [b"1"])
    coll.put("b", [b"2"])
    coll.close()
    output = run(tmp_path, "kestrel3", "a")
    assert convert.queues_on_disk(str(tmp_path)) == {"a": "kestrel3", "b": "kestrel2"}
    output = run(tmp_path, "kestrel3", "a", "b")
    assert "a: already kestrel3, nothing to do" in output and "b: converted to kestrel3: b 1 items" in output
    with pytest.raises(ConvertError, match="no queue 'nope'"):
        run(tmp_path, "kestrel3", "nope")


@pytest.mark.parametrize("source", ["kestrel2", "kestrel3"])
def test_a_torn_tail_is_refused_and_nothing_changes(tmp_path: Path, source: str) -> None:
    if source == "kestrel2":
        make_k2(tmp_path)
        journal, torn = tmp_path / "jobs", b"\x02\x10\x00"  # the start of an ADDX never finished
    else:
        make_k3(tmp_path)
        (_number, writer), = list_queue_files(str(tmp_path), "jobs").writers
        journal, torn = Path(writer), b"\x86\x01\x00"  # the start of a PUT never finished
    with open(journal, "ab") as f:
        f.write(torn)
    before = file_names(tmp_path)
    with pytest.raises(CorruptJournalError, match="did not finish writing"):
        run(tmp_path, "kestrel3" if source == "kestrel2" else "kestrel2")
    assert file_names(tmp_path) == before


OPS = st.lists(st.one_of(
    st.tuples(st.just("add"), st.binary(max_size=8), st.sampled_from([0, T0 + 5_000])),
    st.tuples(st.sampled_from(["remove", "open", "confirm", "abort", "child"]), st.just(b""), st.just(0)),
), max_size=40)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_any_kestrel2_history_round_trips_through_kestrel3(tmp_path_factory: pytest.TempPathFactory,
                                                           ops: list[tuple[str, bytes, int]]) -> None:
    path = tmp_path_factory.mktemp("history")
    clock = FakeClock(T0)
    coll = k2_collection(path, clock)
    opened: list[int] = []
    for op, data, expiry in ops:
        clock.advance(1)
        if op == "add":
            coll.put("q", [data], expiry)
        elif op == "child":
            coll.queue("q+c")
        elif op == "remove":
            coll.remove("q")
        elif op == "open" and (item := one(coll.remove("q", transaction=True))) is not None:
            opened.append(item.xid)
        elif op in ("confirm", "abort") and opened:
            xid = opened.pop(0)
            coll.confirm("q", [xid]) if op == "confirm" else coll.unremove("q", [xid])
    coll.queue("q")
    coll.close()
    before = {name: k2_items(path, name) for name in convert.queues_on_disk(str(path))}
    run(path, "kestrel3")
    assert k3_items(path, "q") == before.get("q", [])
    if "q+c" in before:  # a reader with no checkpoint would see every item: only a child becomes one
        assert k3_items(path, "q", "c") == before["q+c"]
    run(path, "kestrel2")
    after = {name: k2_items(path, name) for name in convert.queues_on_disk(str(path))}
    for name in set(before) | set(after):  # a queue that never wrote a journal comes back as an empty one
        assert after.get(name, []) == before.get(name, []), name


def test_the_benchmark_runs_from_a_clone() -> None:
    import subprocess
    import sys

    from tests.conftest import ROOT

    done = subprocess.run([sys.executable, "-m", "bench.bench_convert", "--megabytes", "1"], cwd=str(ROOT),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "×" in line]
    assert len(rows) == 2 and all(row.count("(") == 2 for row in rows)


def test_files_named_after_an_invalid_queue_name_are_left_as_a_start_leaves_them(tmp_path: Path) -> None:
    coll = k2_collection(tmp_path)
    coll.put("a", [b"1"])
    coll.put("b", [b"2"])
    coll.close()
    os.rename(tmp_path / "b", tmp_path / "my jobs")
    output = run(tmp_path, "kestrel3")
    assert "'my jobs': not converted: its files are named after an invalid queue name (" in output
    assert "a: converted to kestrel3: a 1 items" in output
    assert (tmp_path / "my jobs").read_bytes() and convert.queues_on_disk(str(tmp_path))["a"] == "kestrel3"


def test_a_queue_whose_journal_is_another_queue_s_file_is_left_as_a_start_leaves_it(tmp_path: Path) -> None:
    """A start refuses a queue whose file is a link to another queue's (formats.shared_files): the
    converter leaves it as it is too, rather than convert the other queue's items as its own, and
    `journal check` says what a start would."""
    coll = k2_collection(tmp_path)
    coll.put("a", [b"1", b"2"])
    coll.close()
    os.symlink("a", tmp_path / "b")
    checked = io.StringIO()
    args = type("Args", (), {"queue_path": str(tmp_path), "queues": []})()
    assert check.run(args, checked, io.StringIO()) == 1  # type: ignore[arg-type]
    assert f"b: refused: journal file {tmp_path / 'b'} is the same file as {tmp_path / 'a'}, a file of queue 'a'" \
        in checked.getvalue() and "a (kestrel2): ok; 2 items" in checked.getvalue()
    output = run(tmp_path, "kestrel3")
    assert f"b: not converted: journal file {tmp_path / 'b'} is the same file as" in output
    assert "a: converted to kestrel3: a 2 items" in output and "b: converted" not in output
    assert (tmp_path / "b").is_symlink()  # left as it was, dangling now that a's journal is converted
