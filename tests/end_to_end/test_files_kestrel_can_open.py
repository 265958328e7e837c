"""Files Kestrel can open: a queue path this server has written, whatever it went through, is one
Kestrel 2.4.1's start-up scan opens, finding the journals and nothing else of ours
(tests/support/kestrel24.py models that scan from its sources); an earlier layout's files, which
break that scan, are moved out of its way."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from kestrel.service.config import ServerConfig
from kestrel.service.session.read_ids import ReadIds
from kestrel.service.session.status import Status, StatusKeeper
from kestrel.storage import QueueCollection, QueueConfigs, commit_log
from kestrel.storage.clock import FakeClock
from kestrel.storage.kestrel2 import codec
from kestrel.storage.lock import QueuePathLock
from kestrel.storage.runtime import ManualRuntime
from tests.support import kestrel24
from tests.support.queues import aside, drain, journal_files

T0 = 1_700_000_000_000
ITEM = b"x" * 200


def addx(data: bytes) -> bytes:
    return codec.encode_addx(T0, 0, data)


@pytest.mark.parametrize(("name", "why"), [
    (".lock", "NumberFormatException"), (".read_ids", "NumberFormatException"),
    ("q.manifest", "NumberFormatException"), ("q.torn-1700000000000", "NumberFormatException"),
    ("q.", "ArrayIndexOutOfBounds")])
def test_the_model_refuses_what_kestrel_241_refuses(tmp_path: Path, name: str, why: str) -> None:
    (tmp_path / "q").write_bytes(addx(b"a"))
    (tmp_path / name).write_bytes(b"")
    with pytest.raises(kestrel24.KestrelCannotStart, match=why):
        kestrel24.open_queue_path(str(tmp_path))


def test_the_model_takes_a_copy_kept_beside_a_rotated_journal_for_a_journal(tmp_path: Path) -> None:
    (tmp_path / "q").write_bytes(b"")
    (tmp_path / "q.100").write_bytes(addx(b"a"))
    (tmp_path / "q.100.corrupt-1700000000000").write_bytes(addx(b"stale"))
    assert kestrel24.open_queue_path(str(tmp_path)) == {
        "q": ["q.100", "q.100.corrupt-1700000000000", "q"]}  # Kestrel would replay the copy


def test_the_model_skips_directories_and_temporaries_and_finishes_packs(tmp_path: Path) -> None:
    (tmp_path / "commit-log").mkdir()
    (tmp_path / ".hidden").mkdir()
    (tmp_path / "q~~123").write_bytes(b"")
    for name in ("q", "q.100", "q.200", "q.200.pack", "q.300"):
        (tmp_path / name).write_bytes(b"")
    assert kestrel24.open_queue_path(str(tmp_path)) == {"q": ["q.200", "q.300", "q"]}


def lived_in(path: Path) -> dict[str, list[str]]:
    """A queue path after what this server does to one: rotations and packs (with manifests), the
    commit log (left by a crash), a torn tail cut off and damage salvaged (copies kept), Thrift read
    ids, the server's status set (where the default `status_file` keeps it), the lock held. Returns
    the journals each queue should be found with."""
    lock = QueuePathLock(str(path))
    lock.acquire("test")
    ReadIds(str(path), FakeClock(T0)).take()
    StatusKeeper(status_file(path), Status.UP, 0).set(Status.READ_ONLY)
    configs = QueueConfigs({"max_memory_size": 4096, "max_journal_size": 8192, "sync_journal": "always"})
    coll = QueueCollection(str(path), configs, runtime=ManualRuntime(clock=FakeClock(T0)), commit_log=True)
    coll.load()
    for round_ in range(4):
        for i in range(60):
            coll.put("packed", [b"%d-%04d" % (round_, i) + ITEM])
        for _ in range(50):
            coll.remove("packed")
        coll.queue("packed").wait_for_packing()
    coll.put("logged", [b"in the log"])
    # Killed here: the commit log stays; a torn write is left on another queue, damage on a third.
    (path / "torn").write_bytes(addx(b"kept") + addx(b"torn")[:9])
    (path / "damaged").write_bytes(addx(b"kept") + b"\x42" + addx(b"lost"))
    assert commit_log.pending(str(path))
    lock.release()
    again = QueueCollection(str(path), configs, runtime=ManualRuntime(clock=FakeClock(T0 + 1)), salvage=True)
    again.load()
    assert drain(again, "logged") == [b"in the log"] and drain(again, "torn") == [b"kept"]
    again.close()
    return {q: [n for n in journal_files(path) if n == q or n.startswith(q + ".")]
            for q in ("damaged", "logged", "packed", "torn")}


def status_file(path: Path, setting: str | None = None) -> str | None:
    """The status file a server on `path` keeps, with the default `status_file` or `setting`."""
    config = ServerConfig(queue_path=str(path))
    if setting is not None:
        config.status_file = setting
    return config.resolved_status_file()


def test_a_queue_path_this_server_has_written_is_one_kestrel_241_opens(tmp_path: Path) -> None:
    expected = lived_in(tmp_path)
    lock = QueuePathLock(str(tmp_path))
    lock.acquire("kestrel serve")  # a server running on it: its own files in place
    ReadIds(str(tmp_path), FakeClock(T0))
    found = kestrel24.open_queue_path(str(tmp_path))
    lock.release()
    assert {q: sorted(files) for q, files in found.items()} == {q: sorted(f) for q, f in expected.items()}
    assert len(expected["packed"]) > 1  # rotated journals and packs among them
    assert {n.split(".")[0] for n in aside(tmp_path)} == {"torn", "damaged"}  # the copies are kept


def test_an_earlier_layout_is_moved_out_of_kestrels_way_and_loads_as_before(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    template = tmp_path / "template"
    template.mkdir()
    lived_in(template)
    earlier = tmp_path / "earlier"  # the same files where versions before `.kestrel/` kept them
    earlier.mkdir()
    for name in journal_files(template):
        shutil.copy(template / name, earlier / name)
    own = template / ".kestrel"
    for manifest in own.glob("*.manifest"):
        shutil.copy(manifest, earlier / manifest.name)
    shutil.copy(own / "read_ids", earlier / ".read_ids")
    shutil.copy(own / "status", earlier / ".status")
    for copy in (own / "aside").iterdir():
        shutil.copy(copy, earlier / copy.name)
    (earlier / ".lock").write_bytes(b"")
    (earlier / "commit-log").mkdir()
    (earlier / "commit-log" / "1").write_bytes(commit_log.MARK + commit_log.encode_record(
        "logged", 0, os.path.getsize(earlier / "logged"), addx(b"logged before")))
    with pytest.raises(kestrel24.KestrelCannotStart):
        kestrel24.open_queue_path(str(earlier))
    capsys.readouterr()
    lock = QueuePathLock(str(earlier))
    lock.acquire("kestrel serve")  # the owner moves the earlier layout's files
    coll = QueueCollection(str(earlier), QueueConfigs({"max_memory_size": 4096}))
    coll.load()
    assert drain(coll, "logged") == [b"logged before"]  # the moved commit log was recovered
    assert len(drain(coll, "packed")) == 40
    coll.close()
    lock.release()
    assert "NO MANIFEST" not in capsys.readouterr().out  # the manifests were found where they went
    assert sorted(kestrel24.open_queue_path(str(earlier))) == ["damaged", "logged", "packed", "torn"]
    assert sorted(os.listdir(earlier / ".kestrel" / "aside")) == sorted(os.listdir(own / "aside"))
    # The status, moved, is found by the default setting and by the earlier one, which names its old place.
    for setting in (None, "{queue_path}/.status", str(earlier / ".status")):
        assert StatusKeeper(status_file(earlier, setting), Status.UP, 0).current == Status.READ_ONLY
