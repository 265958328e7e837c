"""A journal that cannot be written (disk full): nothing half-written, nothing changed, nothing lost.

Unit tests inject a failing write (part of the record reaches the file, then ENOSPC); the end-to-end
tests fill a real, small tmpfs under the real server.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kestrel.storage import JournalWriteError, QueueCollection, QueueConfigs, queue_path
from kestrel.storage import disk as disk_calls
from kestrel.storage.clock import FakeClock
from tests.conftest import PACKAGE_ROOT
from tests.support import kestrel24, system
from tests.support.clients import thrift
from tests.support.queues import aside, drain, journal_files, one


class FailingDisk:
    """Replaces the journal's write: while `full`, half the bytes land, then ENOSPC."""

    def __init__(self) -> None:
        self.full = False
        self.only: str | None = None  # fail only the journal of this queue
        self.failures = 0
        self._real = disk_calls.write
        self._real_all = disk_calls.write_all

    def _fail(self, fd: int, data: bytes | memoryview) -> None:
        if self.full and (self.only is None or os.readlink(f"/proc/self/fd/{fd}").endswith("/" + self.only)):
            self.failures += 1
            os.write(fd, data[: max(1, len(data) // 2)])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def write(self, fd: int, data: bytes | memoryview) -> int:
        self._fail(fd, data)
        return self._real(fd, data)

    def write_all(self, fd: int, data: bytes | memoryview) -> None:
        self._fail(fd, data)
        self._real_all(fd, data)


@pytest.fixture
def disk(monkeypatch: pytest.MonkeyPatch) -> Iterator[FailingDisk]:
    fake = FailingDisk()
    monkeypatch.setattr(disk_calls, "write", fake.write)
    monkeypatch.setattr(disk_calls, "write_all", fake.write_all)
    yield fake


def loaded(path: Path) -> QueueCollection:
    coll = QueueCollection(str(path))
    coll.load()
    return coll


def test_a_failed_put_leaves_journal_and_queue_as_they_were(tmp_path: Path, disk: FailingDisk) -> None:
    coll = loaded(tmp_path)
    coll.put("q", [b"one", b"two"])
    before = (tmp_path / "q").read_bytes()
    disk.full = True
    with pytest.raises(JournalWriteError, match="the disk is full") as err:
        coll.put("q", [b"three", b"four"])
    assert err.value.disk_full and err.value.queue == "q"
    assert disk.failures == 1
    assert (tmp_path / "q").read_bytes() == before  # the half-written record was cut off
    q = coll.queue("q")
    assert q.length == 2 and q.stats()["read_only"] == 1 and q.stats()["journal_write_errors"] == 1
    # Still full: refused again, without touching the journal.
    with pytest.raises(JournalWriteError):
        coll.put("q", [b"five"])
    assert (tmp_path / "q").read_bytes() == before
    # Space is back: writes succeed, and the queue says so.
    disk.full = False
    assert coll.put("q", [b"six"])
    assert q.stats()["read_only"] == 0
    coll.close()
    assert drain(loaded(tmp_path), "q") == [b"one", b"two", b"six"]


def test_an_expired_item_whose_expiry_queue_cannot_be_written_stays_where_it_was(tmp_path: Path,
                                                                                 disk: FailingDisk) -> None:
    """The move to `expire_to_queue` fails on the target's journal: the source queue replays its own
    journal, so its REMOVE, written but not committed, is dropped and the item is still there."""
    clock = FakeClock(1_700_000_000_000)
    configs = QueueConfigs(None, {"q": {"expire_to_queue": "dead"}})
    coll = QueueCollection(str(tmp_path), configs, None, clock)
    coll.load()
    coll.put("dead", [b"earlier"])
    coll.put("q", [b"expiring"], expiry_ms=clock.now_ms() + 1)
    coll.put("q", [b"kept"])
    clock.advance(2)
    disk.full, disk.only = True, "dead"
    with pytest.raises(JournalWriteError):
        coll.remove("q")
    assert coll.queue("q").length == 2 and coll.queue("dead").length == 1
    disk.full = False
    item = one(coll.remove("q"))
    assert item is not None and item.data == b"kept"
    coll.close()
    again = QueueCollection(str(tmp_path), configs, None, clock)
    again.load()
    assert drain(again, "q") == [] and drain(again, "dead") == [b"earlier", b"expiring"]


def test_a_reliable_get_that_cannot_be_journaled_takes_nothing(tmp_path: Path, disk: FailingDisk) -> None:
    coll = loaded(tmp_path)
    coll.put("q", [b"a", b"b"])
    held = one(coll.remove("q", transaction=True))
    assert held is not None and held.data == b"a"
    disk.full = True
    with pytest.raises(JournalWriteError):
        coll.remove("q", transaction=True)
    with pytest.raises(JournalWriteError):
        coll.remove("q", 5)
    q = coll.queue("q")
    assert q.length == 1 and q.open_transactions == 1
    assert q.peek() is not None and q.peek().data == b"b"  # type: ignore[union-attr]
    with pytest.raises(JournalWriteError):
        coll.confirm("q", [held.xid])
    assert q.open_transactions == 1  # still open: its confirm was not journaled
    disk.full = False
    assert coll.confirm("q", [held.xid])  # the same xid still names the same read
    again = one(coll.remove("q", transaction=True))
    assert again is not None and again.data == b"b"
    coll.close()
    assert drain(loaded(tmp_path), "q") == [b"b"]  # open at the stop: back at the head


def test_flush_and_abort_that_cannot_be_journaled_change_nothing(tmp_path: Path, disk: FailingDisk) -> None:
    coll = loaded(tmp_path)
    coll.put("q", [b"a", b"b", b"c"])
    held = one(coll.remove("q", transaction=True))
    assert held is not None
    disk.full = True
    with pytest.raises(JournalWriteError):
        coll.flush("q")
    with pytest.raises(JournalWriteError):
        coll.unremove("q", [held.xid])
    q = coll.queue("q")
    assert (q.length, q.open_transactions) == (2, 1)
    disk.full = False
    assert coll.unremove("q", [held.xid])
    assert drain(coll, "q") == [b"a", b"b", b"c"]


def test_one_unwritable_queue_does_not_stop_flush_all(tmp_path: Path, disk: FailingDisk) -> None:
    coll = loaded(tmp_path)
    for name in ("a", "b", "c"):
        coll.put(name, [b"1", b"2"])
    disk.full, disk.only = True, "b"
    with pytest.raises(JournalWriteError, match="queue 'b'"):
        coll.flush_all()
    assert [coll.queue(n).length for n in ("a", "b", "c")] == [0, 2, 0]
    disk.full = False
    coll.flush_all()
    assert coll.queue("b").length == 0


@pytest.mark.parametrize("memory", [10_000_000, 300])
def test_every_acknowledged_item_survives_a_disk_full_episode(tmp_path: Path, disk: FailingDisk,
                                                              memory: int) -> None:
    # memory 300: the queue is in read-behind, so the rebuild also re-reads rotated journals.
    configs = QueueConfigs({"max_memory_size": memory, "default_journal_size": 400})
    coll = QueueCollection(str(tmp_path), configs)
    coll.load()
    acknowledged = []
    for n in range(80):
        disk.full = 30 <= n < 50
        if n == 30:
            assert coll.queue("q").in_read_behind == (memory == 300)
        data = b"item-%d-" % n + b"." * 40
        try:
            coll.put("q", [data])
            acknowledged.append(data)
        except JournalWriteError:
            pass
        if n % 7 == 0:
            try:
                got = one(coll.remove("q"))
                if got is not None:
                    acknowledged.remove(got.data)
            except JournalWriteError:
                pass
    disk.full = False
    coll.queue("q").wait_for_packing()
    coll.close()
    files = queue_path.list_journal_files(str(tmp_path), "q").replay_order()
    assert kestrel24.load(b"".join(Path(p).read_bytes() for p in files)) == acknowledged
    again = QueueCollection(str(tmp_path), configs)
    again.load()
    assert drain(again, "q") == acknowledged


# ---------------------------------------------------------------------------------------------
# The real server on a real, small, full file system


def empty(disk: Path) -> None:
    for entry in disk.iterdir():
        if entry.is_dir():
            shutil.rmtree(entry)
        else:
            entry.unlink()


@pytest.fixture
def small_disk() -> Iterator[Path]:
    """A small tmpfs of the test set-up's (tests/support/system.py), held by this test alone (other
    test processes wait for another) and empty. Request it before `server_factory`."""
    disks = system.small_disks()
    if not disks:
        pytest.skip(f"no small file system is mounted to fill: {system.setup_hint()}")
    while True:
        for disk in disks:
            lock = open(f"{disk}.lock", "a")  # noqa: SIM115  # held for the test's length
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.close()
                continue
            try:
                empty(disk)
                yield disk
                empty(disk)
            finally:
                lock.close()
            return
        time.sleep(0.05)


def fill(disk: Path, leave: int) -> Path:
    """Fill the disk up to about `leave` free bytes with a file that can be deleted later."""
    filler = disk / "filler"
    st = os.statvfs(disk)
    filler.write_bytes(b"\0" * max(0, st.f_bavail * st.f_frsize - leave))
    return filler


def test_server_on_a_full_disk_refuses_clearly_and_loses_nothing(small_disk: Path, server_factory: Any) -> None:
    from pymemcache.client.base import Client
    from pymemcache.exceptions import MemcacheServerError
    from thriftpy2.rpc import make_client
    from thriftpy2.thrift import TApplicationException
    from thriftpy2.transport import TFramedTransportFactory

    from kestrel.contract import kestrel_thrift as kestrel

    queues = small_disk / "queues"
    srv = server_factory({"queue_path": str(queues)})
    mc = Client(("127.0.0.1", srv.memcache_port), timeout=10)
    filler = fill(small_disk, 64 * 1024)
    # Records of exactly one page: the journal ends on a page boundary, so no slack is left in its
    # last page once the disk is full, and even a one-byte record cannot be written.
    item = [b"%06d" % n + b"x" * (4096 - 21 - 6) for n in range(100)]
    acknowledged = 0
    with pytest.raises(MemcacheServerError, match="disk is full"):
        for n in range(100):
            assert mc.set("work", item[n], noreply=False)
            acknowledged += 1
    assert 0 < acknowledged < 100
    stats = mc.stats()
    assert stats[b"queue_work_read_only"] == 1 and stats[b"queue_work_items"] == acknowledged
    # A read that cannot be journaled takes nothing.
    with pytest.raises(MemcacheServerError, match="disk is full"):
        mc.get("work/open")
    with pytest.raises(MemcacheServerError, match="disk is full"):
        mc.get("work")
    thrift = make_client(kestrel.Kestrel, "127.0.0.1", srv.thrift_port, timeout=10_000,
                         trans_factory=TFramedTransportFactory())
    with pytest.raises(TApplicationException, match="disk is full"):
        thrift.put("work", [b"thrift item"], 0)
    with pytest.raises(TApplicationException, match="disk is full"):
        thrift.get("work", 1, 0, 60_000)
    thrift.close()
    assert mc.stats()[b"queue_work_items"] == acknowledged
    # Space comes back: the queue accepts writes again by itself.
    filler.unlink()
    assert mc.set("work", item[acknowledged], noreply=False)
    acknowledged += 1
    assert mc.stats()[b"queue_work_read_only"] == 0
    assert mc.get("work/open") == item[0]
    mc.close()
    assert "is read-only" in srv.log() and "written again" in srv.log()
    srv.restart()
    mc = Client(("127.0.0.1", srv.memcache_port), timeout=10)
    got = []
    while (value := mc.get("work")) is not None:
        got.append(value)
    mc.close()
    assert got == item[:acknowledged]  # the open read came back first


def test_salvage_on_a_full_disk_says_so_and_changes_nothing(small_disk: Path, server_factory: Any) -> None:
    from pymemcache.client.base import Client

    from kestrel.storage.kestrel2 import codec

    queues = small_disk / "queues"
    queues.mkdir()
    good = b"".join(codec.encode_addx(1, 0, b"kept-%d" % n) for n in range(3))
    lost = bytearray(b"".join(codec.encode_addx(1, 0, b"lost-%d" % n) for n in range(100)))
    lost[0] = 0x42  # an unknown opcode where the next record starts
    damaged = good + bytes(lost)
    (queues / "q").write_bytes(damaged)
    filler = fill(small_disk, 0)
    ports = [f"--{name}-port=0" for name in ("thrift", "memcache", "text", "admin")]
    done = subprocess.run([sys.executable, "-m", "kestrel", "serve", "--queue-path", str(queues),
                           "--salvage", *ports], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=str(PACKAGE_ROOT)))
    assert done.returncode == 4, done.stderr
    assert "disk is full; the server cannot start until it can" in done.stderr
    assert "read-only" not in done.stderr and "Traceback" not in done.stderr + done.stdout
    assert (queues / "q").read_bytes() == damaged
    assert journal_files(queues) == ["q"] and aside(queues) == {}  # nothing set aside
    filler.unlink()
    srv = server_factory({"queue_path": str(queues), "salvage": True})
    mc = Client(("127.0.0.1", srv.memcache_port), timeout=10)
    assert [mc.get("q") for _ in range(4)] == [b"kept-0", b"kept-1", b"kept-2", None]
    mc.close()


def test_a_torn_tail_on_a_full_disk_is_left_alone_with_a_clear_error(small_disk: Path) -> None:
    from kestrel.storage.kestrel2 import codec

    queues = small_disk / "queues"
    queues.mkdir()
    good = codec.encode_addx(1, 0, b"kept")
    torn = codec.encode_addx(1, 0, b"x" * 5000)[:3000]
    (queues / "q").write_bytes(good + torn)
    filler = fill(small_disk, 0)
    with pytest.raises(JournalWriteError, match="the disk is full"):
        loaded(queues)
    assert (queues / "q").read_bytes() == good + torn and journal_files(queues) == ["q"]
    assert aside(queues) == {}
    filler.unlink()
    assert drain(loaded(queues), "q") == [b"kept"]
    assert [n for n in aside(queues) if n.startswith("q.torn-")]


@pytest.mark.parametrize("journal_format", ["kestrel2", "kestrel3"])
def test_a_large_item_the_full_disk_takes_part_of_is_cut_back_and_the_server_goes_on(
        small_disk: Path, server_factory: Any, journal_format: str) -> None:
    """An item of LARGE_APPEND bytes or more is written on the thread pool
    (src/kestrel/storage/write_gate.py); on a real file system with room for half of it the kernel
    takes a part, then refuses the rest: the part is cut off the journal, only that put fails and
    says why, other queues and the same queue's later puts are served, and a restart reads back
    exactly what was acknowledged. Under the commit log (`always`), whose segments share the disk."""
    from thriftpy2.thrift import TApplicationException

    from kestrel.storage.write_gate import LARGE_APPEND

    queues = small_disk / "queues"
    srv = server_factory({"queue_path": str(queues),
                          "default_queue": {"journal_format": journal_format, "sync_journal": "always"}})
    large = b"L" * (LARGE_APPEND + LARGE_APPEND // 4)
    with thrift(srv) as client:
        assert client.put("q", [b"before"], 0) == 1
        sizes = {p.name: p.stat().st_size for p in queues.iterdir() if p.is_file()}
        filler = fill(small_disk, len(large) // 2)
        with pytest.raises(TApplicationException, match="the disk is full"):
            client.put("q", [large], 0)
        assert {p.name: p.stat().st_size for p in queues.iterdir() if p.is_file()} == sizes
        assert client.put("other", [b"meanwhile"], 0) == 1
        filler.unlink()
        assert client.put("q", [b"after"], 0) == 1
    srv.restart()
    with thrift(srv) as client:
        assert [item.data for item in client.get("q", 10, 0, 0)] == [b"before", b"after"]
        assert [item.data for item in client.get("other", 10, 0, 0)] == [b"meanwhile"]
