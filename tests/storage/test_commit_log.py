"""The commit log (`commit_log: on`): its records, recovery at start-up, and the live log under a
queue collection: what a reply acknowledged is in the log, and recovery puts it in the journals."""

from __future__ import annotations

import errno
import io
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gevent
import pytest

from kestrel.storage import QueueCollection, QueueConfigs, commit_log, disk
from kestrel.storage.clock import FakeClock
from kestrel.storage.commit_log import MARK, encode_record, read_segment, recover
from kestrel.storage.errors import QueueDamaged
from kestrel.storage.fsync.group_commit import GroupCommit, ThreadFsync
from kestrel.storage.queue_path import list_journal_files
from kestrel.storage.runtime import GeventRuntime, ManualRuntime
from kestrel.storage.tools import convert, dump
from tests.support.power_loss import Disk
from tests.support.queues import drain, one, open_collection

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


def test_a_last_write_torn_at_every_offset_is_a_torn_tail_and_the_records_before_it_stay(tmp_path: Path) -> None:
    kept = encode_record("q", 0, 0, b"kept")
    write = encode_record("q", 0, 4, b"one") + encode_record("q", 0, 7, b"two")  # one turn's write
    for cut in range(1, len(write)):
        seg = read_segment(str(segment(tmp_path, kept, write[:cut])), last=True)
        whole = 1 if cut >= len(write) // 2 else 0
        assert [r.data for _, r in seg.records] == [b"kept", b"one"][:1 + whole], cut
        torn_at = len(MARK) + len(kept) + whole * (len(write) // 2)
        assert seg.torn_at == (None if cut == len(write) // 2 else torn_at), cut


def test_zeros_after_the_last_record_are_a_torn_tail(tmp_path: Path) -> None:
    seg = read_segment(str(segment(tmp_path, encode_record("q", 0, 0, b"x"), bytes(40))), last=True)
    assert len(seg.records) == 1 and seg.torn_at is not None


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


def test_a_torn_record_in_a_segment_that_is_not_the_last_is_damage(tmp_path: Path) -> None:
    path = segment(tmp_path, encode_record("q", 0, 0, b"x")[:-1])
    seg = read_segment(str(path), last=False)
    assert seg.torn_at is None and "before the next file" in seg.damage[0].reason


def test_a_file_without_the_mark_is_damage(tmp_path: Path) -> None:
    path = segment(tmp_path)
    path.write_bytes(b"not a segment at all")
    (damage,) = read_segment(str(path), last=True).damage
    assert "no mark" in damage.reason


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


def test_the_torn_tail_of_the_log_is_cut_keeping_a_copy_and_what_precedes_it_applied(tmp_path: Path) -> None:
    whole = encode_record("q", 0, 0, b"whole")
    torn = encode_record("q", 0, 5, b"torn")[:-2]
    path = segment(tmp_path, whole, torn)
    recover(str(tmp_path), T0)
    assert (tmp_path / "q").read_bytes() == b"whole"
    assert Path(f"{path}.torn-{T0}").read_bytes() == torn
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


@pytest.mark.parametrize("on", [True, False], ids=["commit_log-on", "commit_log-off"])
@pytest.mark.parametrize("keep", [0, 5])
def test_a_power_cut_loses_no_acknowledged_change_across_rotations_and_packs(tmp_path: Path, on: bool,
                                                                             keep: int) -> None:
    with Disk() as disk:
        coll = collection(tmp_path, on, max_memory_size="300", default_journal_size="200")
        expected = []
        for n in range(60):
            coll.put("q", [b"item-%02d" % n + b"." * 20])
            expected.append(b"item-%02d" % n + b"." * 20)
            if n % 3 == 2:
                assert one(coll.remove("q")) is not None
                expected.pop(0)
        coll.queue("q").wait_for_packing()
        disk.power_cut(str(tmp_path), keep)
        again = collection(tmp_path, on)
        assert drain(again, "q") == expected
        again.close()


def power_cut_under_load(path: Path) -> tuple[list[bytes], str]:
    """Queues `q` and `other` under `commit_log: on`: adds, reliable reads confirmed, then a power
    cut (every journal back to what an fsync covered; the log, fsynced each turn, whole). Returns
    the items `q` must hold, and the log's segment."""
    with Disk() as disk:
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
    with Disk() as disk:
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

    def full_log(fd: int, data: Any) -> int:
        if os.readlink(f"/proc/self/fd/{fd}").startswith(log_dir):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    def fdatasync(fd: int) -> None:
        synced.append(os.fstat(fd).st_ino)
        real_fdatasync(fd)

    monkeypatch.setattr(os, "write", full_log)
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
    with Disk() as disk:
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


def test_a_queue_reloaded_out_of_always_still_logs_and_its_new_journals_names_are_durable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    coll = collection(tmp_path, default_journal_size="1KB")
    coll.put("q", [b"first"])  # the queue is created under always
    assert one(coll.remove("q")) is not None
    coll.reload(QueueConfigs({"sync_journal": "never", "default_journal_size": "1KB"}), {})
    synced_dirs: list[str] = []
    real = disk.fsync_path

    def fsync_path(path: str) -> None:
        synced_dirs.append(path)
        real(path)

    monkeypatch.setattr(disk, "fsync_path", fsync_path)
    for _ in range(40):  # the journal passes 1KB empty and is packed: a new live journal starts
        coll.put("q", [b"x" * 40])
        assert one(coll.remove("q")) is not None
    coll.queue("q").wait_for_packing()
    assert list_journal_files(str(tmp_path), "q").rotated  # it rotated
    assert str(tmp_path) in synced_dirs
    coll.put("q", [b"last"])
    (seg,) = commit_log.segment_paths(str(tmp_path))
    assert [r.data[-4:] for _, r in read_segment(seg, last=True).records] == [b"last"]  # it still logs
    coll.close()


class GeventWithFsyncs(GeventRuntime):
    """The server's runtime, whose group commit's fsyncs go through `fsync` (on Python threads)."""

    def __init__(self, fsync: Callable[[int], None]) -> None:
        super().__init__(FakeClock(T0))
        self._group_commit = GroupCommit(ThreadFsync(fsync))

    def group_commit(self) -> GroupCommit:
        return self._group_commit


@pytest.mark.parametrize("log_fsync_fails", [False, True])
def test_under_gevent_a_turns_changes_share_one_write_and_one_fsync_of_the_log(
        tmp_path: Path, log_fsync_fails: bool) -> None:
    log_dir = commit_log.directory(str(tmp_path))
    synced: list[str] = []

    def fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if log_fsync_fails and path.startswith(log_dir):
            raise OSError(errno.EIO, "Input/output error")
        synced.append(path)
        os.fdatasync(fd)

    coll = QueueCollection(str(tmp_path), QueueConfigs({"sync_journal": "always"}),
                           runtime=GeventWithFsyncs(fsync), commit_log=True)
    coll.load()
    for name in ("a", "b", "c", "d"):
        coll.put(name, [b"created"])
    synced.clear()
    gevent.joinall([gevent.spawn(coll.put, name, [b"item"]) for name in ("a", "b", "c", "d")],
                   raise_error=True)  # each added in the same turn, all acknowledged
    (seg,) = commit_log.segment_paths(str(tmp_path))
    writes = [r.queue for _, r in read_segment(seg, last=True).records]
    assert writes[-4:] == ["a", "b", "c", "d"]
    journals = sorted(os.path.basename(p) for p in synced if not p.startswith(log_dir))
    if log_fsync_fails:
        assert journals == ["a", "b", "c", "d"]  # each fell back on its own journal's fsync
    else:
        assert (journals, len(synced)) == ([], 1)  # one fsync of the log for the four
    synced.clear()
    gevent.joinall([gevent.spawn(coll.put, name, [b"later"]) for name in ("a", "b")], raise_error=True)
    journals = sorted(os.path.basename(p) for p in synced if not p.startswith(log_dir))
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
    size = os.path.getsize(seg)
    real_write = os.write
    written: list[int] = []

    def full_log(fd: int, data: Any) -> int:
        if os.readlink(f"/proc/self/fd/{fd}").startswith(log_dir):
            written.append(real_write(fd, bytes(data)[:7]))  # a short write, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full_log)
    synced.clear()
    gevent.joinall([gevent.spawn(coll.put, name, [b"item"]) for name in ("a", "b", "c")],
                   raise_error=True)  # one turn: its one write of the log fails, every change is acknowledged
    monkeypatch.undo()
    assert written == [7]
    assert os.path.getsize(seg) == size  # the failed write was cut back off the log
    assert sorted(os.path.basename(p) for p in synced) == ["a", "b", "c"]  # each journal's own fsync
    coll.put("a", [b"after"])  # the segment took no fsync that failed: the log carries the next turn
    assert [r.data[-5:] for _, r in read_segment(seg, last=True).records][-1] == b"after"
    coll.close()
    again = collection(tmp_path)
    assert drain(again, "a") == [b"created", b"item", b"after"]
    assert [drain(again, n) for n in ("b", "c")] == [[b"created", b"item"]] * 2
    again.close()
