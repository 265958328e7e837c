"""`kestrel journal check`: what a start-up would find and what --salvage would set aside, told
before anything moves, and nothing changed by telling it."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kestrel.storage import QueueCollection, QueueConfigs, commit_log
from kestrel.storage.clock import FakeClock
from kestrel.storage.kestrel2 import codec
from kestrel.storage.kestrel2.reader import read_journal
from kestrel.storage.kestrel3 import codec as k3
from kestrel.storage.kestrel3.files import list_queue_files
from kestrel.storage.lock import QueuePathLock
from kestrel.storage.runtime import ManualRuntime
from kestrel.storage.tools import check
from tests.conftest import ROOT
from tests.support.kestrel3_records import WRITER, put6
from tests.support.queues import aside, drain

T0 = 1_700_000_000_000
ITEM = b"x" * 200


def every_file(path: Path) -> dict[str, bytes | None]:
    """Every file and directory under `path`, with the bytes of each file."""
    return {str(f.relative_to(path)): (f.read_bytes() if f.is_file() else None) for f in sorted(path.rglob("*"))}


def run(path: Path, *queues: str) -> tuple[int, str]:
    out = io.StringIO()
    args = type("Args", (), {"queue_path": str(path), "queues": list(queues)})()
    return check.run(args, out, io.StringIO()), out.getvalue()  # type: ignore[arg-type]


def rotated_queue(path: Path, **settings: object) -> None:
    coll = QueueCollection(str(path), QueueConfigs({}, {"q": {"max_memory_size": 4096,
                                                               "max_journal_size": 1 << 30, **settings}}))
    coll.load()
    for i in range(300):
        coll.put("q", [b"%04d" % i + ITEM])
    coll.put("other", [b"fine"])
    coll.close()


def test_a_clean_queue_path_is_ok(tmp_path: Path) -> None:
    rotated_queue(tmp_path)
    before = every_file(tmp_path)
    code, out = run(tmp_path)
    assert code == 0 and "q (kestrel2): ok; 300 items" in out and "other (kestrel2): ok; 1 items" in out
    assert every_file(tmp_path) == before


def test_a_path_with_no_queues_says_so(tmp_path: Path) -> None:
    """A mistyped path that exists passed with no word at all."""
    assert run(tmp_path) == (0, f"{tmp_path}: no queue journals found\n")
    (tmp_path / "q").write_bytes(b"")
    code, out = run(tmp_path)
    assert code == 0 and "no queue journals found" not in out


def test_damage_is_reported_with_what_salvage_would_set_aside_and_salvage_does_just_that(tmp_path: Path) -> None:
    rotated_queue(tmp_path)
    rotated = sorted(p for p in tmp_path.iterdir() if p.name[2:].isdigit())
    damaged = rotated[1]
    count = sum(isinstance(r, codec.AddX) for _, r in read_journal(str(damaged)))
    data = bytearray(damaged.read_bytes())
    data[40] ^= 0x20
    damaged.write_bytes(bytes(data))
    before = every_file(tmp_path)
    code, out = run(tmp_path)
    assert code == 1
    assert "q (kestrel2): damaged" in out and f"{damaged} at offset 0: changed" in out
    assert f"--salvage would set aside {damaged.name} ({count} items), and keep every other file" in out
    assert "other (kestrel2): ok" in out
    assert every_file(tmp_path) == before  # nothing changed, not even a directory created
    coll = QueueCollection(str(tmp_path), salvage=True)
    coll.load()
    assert len(drain(coll, "q")) == 300 - count
    coll.close()
    assert [n.partition(".corrupt-")[0] for n in aside(tmp_path)] == [damaged.name]


def test_a_commit_log_left_by_a_crash_is_reported_and_left_for_recovery(tmp_path: Path) -> None:
    coll = QueueCollection(str(tmp_path), QueueConfigs({"sync_journal": "always"}), commit_log=True,
                           runtime=ManualRuntime(clock=FakeClock(T0)))
    coll.load()
    for n in range(5):
        coll.put("q", [b"item-%d" % n])
    journal = tmp_path / "q"
    journal.write_bytes(bytes(journal.stat().st_size))  # a power cut left zeros where the data was
    before = every_file(tmp_path)
    code, out = run(tmp_path, "q")
    assert code == 0
    assert "commit log: 5 records to write into the journals" in out
    assert "a journal is repaired from the log, what it held kept as" in out and "q.replaced-" in out
    assert every_file(tmp_path) == before
    assert commit_log.pending(str(tmp_path))


def test_a_queue_path_in_use_is_refused(tmp_path: Path) -> None:
    rotated_queue(tmp_path)
    lock = QueuePathLock(str(tmp_path))
    lock.acquire("kestrel serve")
    try:
        code, _ = run(tmp_path)
        assert code == 3
    finally:
        lock.release()


def test_a_queue_path_in_use_is_refused_naming_the_holder_and_its_pid_as_convert_and_recover_do(
        tmp_path: Path) -> None:
    """check only looks at the locks (it takes none), and named only the lock file held; convert and
    recover, which take the lock, named the process and its pid. One lookup names it for all three."""
    from kestrel.storage.errors import QueuePathInUse
    from kestrel.storage.tools import recover

    rotated_queue(tmp_path)
    lock = QueuePathLock(str(tmp_path))
    lock.acquire("kestrel serve")
    try:
        err = io.StringIO()
        args = type("Args", (), {"queue_path": str(tmp_path), "queues": []})()
        assert check.run(args, io.StringIO(), err) == 3  # type: ignore[arg-type]
        said = err.getvalue().removeprefix("kestrel journal check: ").strip()
        assert f"is in use by kestrel serve (pid {os.getpid()})" in said and lock.path in said
        recover_err = io.StringIO()
        assert recover.run(args, io.StringIO(), recover_err) == 3  # type: ignore[arg-type]
        assert recover_err.getvalue().removeprefix("kestrel journal recover: ").strip() == said
        with pytest.raises(QueuePathInUse) as refused:
            QueuePathLock(str(tmp_path)).acquire("kestrel journal convert --to kestrel3")
        assert str(refused.value) == said
        os.unlink(lock.path)  # taken for a stale file: the directory's lock still says who holds it
        err = io.StringIO()
        assert check.run(args, io.StringIO(), err) == 3  # type: ignore[arg-type]
        assert "holds the directory's lock although its lock file" in err.getvalue()
    finally:
        lock.release()
    assert check.run(args, io.StringIO(), io.StringIO()) == 0  # type: ignore[arg-type]


def test_kestrel_journal_check_on_the_command_line(tmp_path: Path) -> None:
    rotated_queue(tmp_path)
    done = subprocess.run([sys.executable, "-m", "kestrel", "journal", "check", str(tmp_path), "q"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("q (kestrel2): ok")


def test_a_kestrel3_writer_file_whose_header_never_reached_the_disk_is_what_a_start_writes(tmp_path: Path) -> None:
    coll = QueueCollection(str(tmp_path), QueueConfigs({"journal_format": "kestrel3"}))
    coll.load()
    coll.remove("jobs")
    coll.close()
    (writer,) = list_queue_files(str(tmp_path), "jobs").writers
    Path(writer[1]).write_bytes(b"")
    status, out = run(tmp_path)
    assert status == 0, out
    assert "jobs (kestrel3): ok; " in out and "header never reached the disk: the next start writes it" in out


def test_an_older_kestrel3_writer_file_whose_header_never_reached_the_disk_is_told_as_a_start_reads_it(
        tmp_path: Path) -> None:
    """A power cut kept its name (a folder's fsync for a newer file made it durable) and none of its
    bytes: the check says what a start then does, and the start loads the queue, writing its header."""
    (tmp_path / "jobs.1").write_bytes(WRITER + put6(1, b"a"))
    (tmp_path / "jobs.2").write_bytes(b"")
    (tmp_path / "jobs.3").write_bytes(WRITER + put6(3, b"c"))
    before = every_file(tmp_path)
    status, out = run(tmp_path)
    assert status == 0, out
    assert out.startswith("jobs (kestrel3): ok; jobs.2 was created but its header never reached the disk"), out
    assert "2 items written" in out
    assert every_file(tmp_path) == before
    coll = QueueCollection(str(tmp_path), QueueConfigs({"journal_format": "kestrel3"}))
    coll.load()
    assert not coll.refused
    assert (tmp_path / "jobs.2").read_bytes() == WRITER
    coll.put("jobs", [b"d"])
    assert drain(coll, "jobs") == [b"d"]  # (a queue found without its reader's file reads from its end)
    coll.close()


def test_files_named_after_an_invalid_queue_name_are_said_to_be_ignored_as_a_start_ignores_them(
        tmp_path: Path) -> None:
    rotated_queue(tmp_path)
    coll = QueueCollection(str(tmp_path))
    coll.load()
    coll.put("good", [b"x"])
    coll.close()
    os.rename(tmp_path / "good", tmp_path / "my jobs")
    status, out = run(tmp_path)
    assert status == 1
    assert "'my jobs': not loaded: its files are named after an invalid queue name (" in out
    assert "the server ignores them" in out and "q (kestrel2): ok" in out


def test_a_queue_path_that_cannot_be_listed_is_an_error_line_not_a_traceback(tmp_path: Path) -> None:
    os.symlink("loop", tmp_path / "loop")
    done = subprocess.run([sys.executable, "-m", "kestrel", "journal", "check", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 1
    assert done.stderr == f"kestrel journal check: cannot read {tmp_path / 'loop'}: Too many levels of symbolic links\n"


def test_a_torn_reader_checkpoint_is_told_as_the_start_cuts_it(tmp_path: Path) -> None:
    """A start cuts a reader checkpoint's torn final record, a copy kept, and serves again what it
    consumed; the check said `ok` and nothing of it, where it tells a writer file's."""
    coll = QueueCollection(str(tmp_path), QueueConfigs({"journal_format": "kestrel3"}))
    coll.load()
    coll.put("jobs", [b"one", b"two", b"three"])
    assert [item.data for item in coll.remove("jobs", 2)] == [b"one", b"two"]
    coll.close()
    (checkpoint,) = list_queue_files(str(tmp_path), "jobs").readers.values()
    size = os.path.getsize(checkpoint)
    os.truncate(checkpoint, size - 3)
    status, out = run(tmp_path)
    assert status == 0, out
    assert "ends in a torn write at offset" in out and "is served again what the cut records consumed" in out
    coll = QueueCollection(str(tmp_path), QueueConfigs({"journal_format": "kestrel3"}))
    coll.load()
    assert drain(coll, "jobs")[-1] == b"three" and len(aside(tmp_path)) == 1  # as told: cut, a copy kept
    coll.close()


def test_damage_the_commit_log_repairs_is_told_so(tmp_path: Path) -> None:
    """A byte of a Kestrel 3 writer file changed after a crash that left the log: the check judges
    the file as it stands, and says that recovery writes the log's records over it first."""
    coll = QueueCollection(str(tmp_path), QueueConfigs({"sync_journal": "always", "journal_format": "kestrel3"}),
                           commit_log=True, runtime=ManualRuntime(clock=FakeClock(T0)))
    coll.load()
    for n in range(5):
        coll.put("q", [b"item-%d" % n + ITEM])
    ((_, writer),) = list_queue_files(str(tmp_path), "q").writers
    data = bytearray(Path(writer).read_bytes())
    data[k3.MAGIC_SIZE] ^= 0x10  # the first record's command byte
    Path(writer).write_bytes(bytes(data))
    code, out = run(tmp_path, "q")
    assert code == 1 and "q (kestrel3): damaged" in out
    assert "q:   judged before the commit log's records are written into its files" in out
    recovered = QueueCollection(str(tmp_path), QueueConfigs({"sync_journal": "always",
                                                             "journal_format": "kestrel3"}),
                                commit_log=True, runtime=ManualRuntime(clock=FakeClock(T0)))
    recovered.load()  # as a start: the log's record written over the changed byte
    assert len(drain(recovered, "q")) == 5
    recovered.close()


def test_a_conversion_record_a_start_stops_on_is_told_as_damage(tmp_path: Path) -> None:
    """A start stops (exit 3) on a conversion's record it cannot read; the check said the path held
    no queue journals and exited 0. The start's one line says what and what to do."""
    from tests.conftest import PACKAGE_ROOT

    (tmp_path / ".kestrel").mkdir()
    (tmp_path / ".kestrel" / "convert").write_bytes(b"{not json")
    code, out = run(tmp_path)
    assert code == 1 and f"{tmp_path}: damaged: {tmp_path}/.kestrel/convert: unreadable conversion record" in out
    assert "restore it from a copy" in out
    ports = [f"--{name}-port=0" for name in ("thrift", "memcache", "text", "admin")]
    done = subprocess.run([sys.executable, "-m", "kestrel", "serve", "--queue-path", str(tmp_path), *ports],
                          capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=str(PACKAGE_ROOT)))
    assert done.returncode == 3
    assert done.stderr.startswith(f"kestrel: cannot start: {tmp_path}/.kestrel/convert: unreadable conversion "
                                  "record") and done.stderr.count("\n") == 1 and "opcode" not in done.stderr


def test_a_conversion_that_stopped_part_way_is_told(tmp_path: Path) -> None:
    import json

    rotated_queue(tmp_path)
    (tmp_path / ".kestrel" / "convert").write_text(json.dumps({"to": "kestrel3", "queue": "q", "renames": [],
                                                              "deletes": []}))
    code, out = run(tmp_path)
    assert code == 0 and "a conversion of queue 'q' to kestrel3 stopped part way: the next start completes it" in out


def test_a_path_or_queue_mistyped_is_not_damage(tmp_path: Path) -> None:
    """Exit 1 said damage for a typo too: a monitoring script could not tell them apart."""
    rotated_queue(tmp_path)
    assert run(tmp_path / "spol")[0] == 2
    code, out = run(tmp_path, "q", "nope")
    assert code == 2 and "nope: no such queue in" in out and "q (kestrel2): ok" in out
    (tmp_path / "q").write_bytes(b"\x42" + (tmp_path / "q").read_bytes())  # damaged: 1 wins over a typo
    assert run(tmp_path, "q", "nope")[0] == 1
