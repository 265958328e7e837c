"""A queue whose journal is damaged is refused alone: the other queues serve, and the refused one
answers every request, on every protocol, with an error naming it, the damage and the remedy."""

from __future__ import annotations

import errno
import json
import os
import re
import signal
import urllib.request
from pathlib import Path
from typing import Any

import gevent
import pytest
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs
from thriftpy2.thrift import TApplicationException

from kestrel.storage import QueueCollection
from kestrel.storage.errors import JournalWriteError, QueueDamaged
from kestrel.storage.kestrel2.codec import AddX, encode
from tests.conftest import ServerProcess
from tests.server.test_shutdown import _thrift_client
from tests.support.privileges import as_plain_user, unwritable
from tests.support.queues import drain, one, open_collection
from tests.support.wire import conn, exchange, memcache_stats

T0 = 1_700_000_000_000


def _addx(data: bytes) -> bytes:
    return encode(AddX(T0, 0, data))


def _damage(queue_path: Path) -> bytes:
    """`good` holds two items; `bad` has a record that cannot be read in its middle."""
    queue_path.mkdir(parents=True, exist_ok=True)
    (queue_path / "good").write_bytes(_addx(b"one") + _addx(b"two"))
    bad = _addx(b"first") + bytes([0x42]) + b"\x00" * 8 + _addx(b"after")
    (queue_path / "bad").write_bytes(bad)
    return bad


def test_the_collection_refuses_one_damaged_queue_and_loads_the_others(tmp_path: Path) -> None:
    bad = _damage(tmp_path)
    (tmp_path / "bad+child").write_bytes(_addx(b"fanned"))
    coll = QueueCollection(str(tmp_path))
    coll.load()
    assert drain(coll, "good") == [b"one", b"two"]
    assert sorted(coll.refused) == ["bad"] and coll.queue_names() == ["good"]
    for call in (lambda: coll.queue("bad"), lambda: coll.put("bad", [b"x"]), lambda: coll.flush("bad"),
                 lambda: one(coll.remove("bad")), lambda: coll.peek("bad"), lambda: coll.delete("bad"),
                 lambda: coll.put("bad+child", [b"x"])):
        with pytest.raises(QueueDamaged, match="--salvage") as err:
            call()
        assert "'bad" in str(err.value) and "opcode 66" in str(err.value)
    coll.close()
    assert (tmp_path / "bad").read_bytes() == bad  # nothing changed on disk


def _metric(srv: ServerProcess, name: str, path: str = "/metrics") -> list[Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.admin_port}{path}") as reply:
        text = reply.read().decode()
    return [s for f in text_string_to_metric_families(text) if f.name == name for s in f.samples]


def test_a_server_serves_every_queue_but_the_damaged_one_and_says_why(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path)
    bad = _damage(srv.queue_path)
    srv.start()
    try:
        assert "QUEUE REFUSED" in srv.log() and "bad" in srv.log()
        # memcache: the good queue serves, the damaged one answers SERVER_ERROR naming it.
        with conn(srv.memcache_port) as s:
            assert exchange(s, b"get good\r\n", b"END\r\n") == b"VALUE good 0 3\r\none\r\nEND\r\n"
            for request in (b"get bad\r\n", b"set bad 0 0 1\r\nx\r\n", b"flush bad\r\n", b"delete bad\r\n"):
                reply = exchange(s, request, b"\r\n").decode()
                assert reply.startswith("SERVER_ERROR queue 'bad' is not served"), (request, reply)
                assert "opcode 66" in reply and "--salvage" in reply
        # Thrift: the same, as an application exception.
        client = _thrift_client(srv.thrift_port)
        try:
            assert [i.data for i in client.get("good", 1, 0, 0)] == [b"two"]
            for call in (lambda: client.get("bad", 1, 0, 0), lambda: client.put("bad", [b"x"], 0),
                         lambda: client.peek("bad")):
                with pytest.raises(TApplicationException, match="queue 'bad' is not served.*--salvage"):
                    call()
        finally:
            client.close()
        # Stats, JSON stats and metrics report it.
        stats = memcache_stats(srv.memcache_port)
        assert stats["refused_queues"] == "1" and stats["refused_queue_bad"] == "1"
        assert not any(key.startswith("queue_bad_") for key in stats)
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.admin_port}/stats.json") as reply:
            body = json.loads(reply.read())
        assert "bad" not in body["queues"] and "opcode 66" in body["refused_queues"]["bad"]
        assert body["server"]["refused_queues"] == 1
        refused = _metric(srv, "kestrel_queue_refused", "/metrics/per-queue")
        assert [(s.labels, s.value) for s in refused] == [({"queue": "bad"}, 1)]  # the reason in /stats.json
        assert [s.value for s in _metric(srv, "kestrel_refused_queues")] == [1]
    finally:
        assert srv.stop(signal.SIGTERM) == 0
    assert (srv.queue_path / "bad").read_bytes() == bad  # kept as it was, for repair


# The Ruby kestrel-client reads per-queue figures from STATS with this pattern (the guide's
# per-queue stats); anything else it matches is taken for a queue. Unanchored, as the client has it,
# and anchored at the line's end, as a stricter client would.
KESTREL_QUEUE_STATS = ("items|bytes|total_items|logsize|expired_items|mem_items|mem_bytes|age|discarded|"
                       "waiters|open_transactions|transactions|canceled_transactions|total_flushes|age_msec|"
                       "create_time")
CLIENT_PATTERNS = [re.compile(rf"^STAT queue_(\S+?)_({KESTREL_QUEUE_STATS})"),
                   re.compile(rf"^STAT queue_(\S+?)_({KESTREL_QUEUE_STATS}) \S+$")]


def test_a_kestrel_client_reading_stats_finds_only_real_queue_names(server_factory: Any) -> None:
    srv = server_factory({"queues": {"jobs": {"max_errors": 1, "error_queue": "failed_jobs"}}})
    queues = {"jobs", "failed_jobs", "jobs+audit", "plain-queue"}
    with conn(srv.memcache_port) as s:
        for name in sorted(queues):
            assert exchange(s, f"set {name} 0 0 1\r\nx\r\n".encode()) == b"STORED\r\n"
        assert exchange(s, b"get jobs/open\r\n", b"END\r\n").startswith(b"VALUE jobs")
        assert exchange(s, b"get jobs/abort\r\n", b"END\r\n") == b"END\r\n"  # poisoned: to failed_jobs
        stats = exchange(s, b"stats\r\n", b"END\r\n").decode()
    lines = stats.splitlines()
    assert any(line.startswith("STAT queue_jobs_poisoned ") for line in lines)
    for pattern in CLIENT_PATTERNS:
        found = {m.group(1) for line in lines if (m := pattern.match(line))}
        assert found == queues, pattern.pattern


# ---------------------------------------------------------------------------------------------
# A file of the queue path that is another queue's file (a symbolic or hard link): refused alone


def _files(path: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(path.iterdir()) if f.is_file()}


@pytest.mark.parametrize("fmt, link, real, linked", [
    ("kestrel2", os.symlink, "a", "b"),
    ("kestrel2", os.link, "a", "b"),
    ("kestrel2", os.symlink, "z", "a"),  # the link's name loads first: the file stays with z all the same
    ("kestrel2", os.symlink, "a", "b.1700000000000"),  # a rotated journal
    ("kestrel2", os.symlink, "a", "a+child"),  # a fanout child's journal
    ("kestrel3", os.symlink, "a.*", "b.*"),  # a writer file (its number as the queue's)
    ("kestrel3", os.link, "a.*", "b.*"),
])
def test_a_queue_whose_file_is_another_queue_s_file_is_refused_naming_both(
        tmp_path: Path, fmt: str, link: Any, real: str, linked: str) -> None:
    """Two queues appending to one file damage both: each replays the other's records as its own.
    The queue whose name for the file is a link (a hard link: the later to load) is refused at the
    start, both files named; the one the file is kept for serves; nothing on disk changes."""
    owner, other = real.partition(".")[0], linked.partition(".")[0]
    coll = open_collection(tmp_path, {"journal_format": fmt})
    coll.put(owner, [b"one", b"two"])
    coll.close()
    if real.endswith(".*"):
        (writer,) = tmp_path.glob(f"{owner}.[0-9]*")
        real, linked = writer.name, writer.name.replace(owner, other, 1)
    link(tmp_path / real, tmp_path / linked)
    before = _files(tmp_path)
    coll = open_collection(tmp_path, {"journal_format": fmt})
    try:
        assert sorted(coll.refused) == [other]
        assert _files(tmp_path) == before  # the refused queue opened nothing, wrote nothing
        assert str(coll.refused[other]) == (
            f"journal file {tmp_path / linked} is the same file as {tmp_path / real}, a file of queue "
            f"{owner!r} (a symbolic or hard link): two queues would write one file")
        with pytest.raises(QueueDamaged, match=f"queue {re.escape(repr(other))} is not served: .* remove the link"):
            coll.put(other, [b"x"])
        assert drain(coll, owner) == [b"one", b"two"]  # the queue the file is kept for serves
    finally:
        coll.close()


@pytest.mark.parametrize("reader", ["", "audit"])
def test_a_kestrel3_queue_whose_reader_checkpoint_is_another_queue_s_is_refused(tmp_path: Path, reader: str) -> None:
    """A reader's checkpoint is appended to between rewrites: a link to another queue's would have
    both readers write it. A Kestrel 2 queue reads no checkpoint: a link among its strays refuses nothing."""
    configs = ({"journal_format": "kestrel3"}, {})
    coll = open_collection(tmp_path, *configs)
    for name in ("a", "b"):
        coll.put(name, [b"one"])
        if reader:
            coll.put(f"{name}+{reader}", [b"x"])  # creates the reader
    coll.close()
    checkpoint = f".read.{reader}"
    (tmp_path / f"b{checkpoint}").unlink()
    os.symlink(f"a{checkpoint}", tmp_path / f"b{checkpoint}")
    coll = open_collection(tmp_path, *configs)
    try:
        assert sorted(coll.refused) == ["b"]
        assert f"journal file {tmp_path / f'b{checkpoint}'} is the same file as {tmp_path / f'a{checkpoint}'}" \
            in str(coll.refused["b"])
        assert drain(coll, "a") == [b"one"]
    finally:
        coll.close()
    kestrel2 = tmp_path / "k2"
    coll = open_collection(kestrel2)
    coll.put("a", [b"one"])
    coll.put("b", [b"two"])
    coll.close()
    (kestrel2 / "a.read.x").write_bytes(b"")
    os.symlink("a.read.x", kestrel2 / "b.read.x")
    coll = open_collection(kestrel2)
    try:
        assert not coll.refused and drain(coll, "b") == [b"two"]
    finally:
        coll.close()


def test_a_server_refuses_a_queue_linked_to_another_s_journal_and_says_why(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path)
    srv.queue_path.mkdir(parents=True)
    (srv.queue_path / "jobs").write_bytes(_addx(b"one"))
    os.symlink("jobs", srv.queue_path / "copy")
    srv.start()
    try:
        line = json.loads(next(line for line in srv.log().splitlines() if "QUEUE REFUSED" in line))
        assert line["queue"] == "copy" and "its journal file is another queue's" in line["event"]
        assert line["file"] == str(srv.queue_path / "copy") and "remove the link" in line["remedy"]
        with conn(srv.memcache_port) as s:
            reply = exchange(s, b"set copy 0 0 1\r\nx\r\n", b"\r\n").decode()
            assert reply.startswith("SERVER_ERROR queue 'copy' is not served") and "same file as" in reply
            assert exchange(s, b"get jobs\r\n", b"END\r\n") == b"VALUE jobs 0 3\r\none\r\nEND\r\n"
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.admin_port}/stats.json") as reply:
            body = json.loads(reply.read())
        assert str(srv.queue_path / "jobs") in body["refused_queues"]["copy"]
    finally:
        assert srv.stop(signal.SIGTERM) == 0
    assert (srv.queue_path / "copy").is_symlink()


# ---------------------------------------------------------------------------------------------
# A journal the server cannot write: refused alone at start-up, as a damaged one is


@pytest.mark.parametrize("fmt", ["kestrel2", "kestrel3"])
def test_a_journal_the_collection_cannot_write_is_refused_at_load_and_left_as_it_is(tmp_path: Path,
                                                                                     fmt: str) -> None:
    coll = open_collection(tmp_path, {"journal_format": fmt})
    coll.put("locked", [b"kept"])
    coll.put("open", [b"served"])
    coll.close()
    journal = tmp_path / ("locked" if fmt == "kestrel2" else
                          next(n for n in sorted(os.listdir(tmp_path)) if n.startswith("locked.")
                               and n[len("locked."):].isdigit()))
    before = journal.read_bytes()
    with unwritable(journal):
        coll = open_collection(tmp_path, {"journal_format": fmt})
        assert sorted(coll.refused) == ["locked"] and drain(coll, "open") == [b"served"]
        with pytest.raises(QueueDamaged, match=r"cannot be written.*write access") as refused:
            coll.put("locked", [b"x"])
        assert str(journal) in str(refused.value)
        with pytest.raises(QueueDamaged):
            coll.remove("locked+child")
        coll.close()
    assert journal.read_bytes() == before
    coll = open_collection(tmp_path, {"journal_format": fmt})  # write access back: served again
    assert drain(coll, "locked") == [b"kept"]
    coll.close()


@pytest.mark.parametrize("fmt", ["kestrel2", "kestrel3"])
def test_a_torn_tail_that_cannot_be_cut_refuses_its_queue_alone_and_changes_nothing(
        tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    coll = open_collection(tmp_path, {"journal_format": fmt})
    coll.put("torn", [b"kept"])
    coll.put("open", [b"served"])
    coll.close()
    journal = tmp_path / ("torn" if fmt == "kestrel2" else
                          next(n for n in os.listdir(tmp_path) if n.startswith("torn.") and n[5:].isdigit()))
    with open(journal, "ab") as f:
        f.write(b"\x02\x11\x00\x00" if fmt == "kestrel2" else b"\x86\x05\x00")  # a record begun
    before = journal.read_bytes()

    def append_only(path: object, length: int) -> None:  # as `chattr +a` answers
        raise PermissionError(errno.EPERM, "Operation not permitted", str(path))

    monkeypatch.setattr(os, "truncate", append_only)
    coll = open_collection(tmp_path, {"journal_format": fmt})
    assert sorted(coll.refused) == ["torn"] and drain(coll, "open") == [b"served"]
    with pytest.raises(QueueDamaged, match=r"torn\S* cannot be written: Operation not permitted.*chattr -i -a"):
        coll.put("torn", [b"x"])
    coll.close()
    assert journal.read_bytes() == before
    assert not list((tmp_path / ".kestrel").glob("aside/*"))  # the copy made for the cut removed again
    monkeypatch.undo()
    coll = open_collection(tmp_path, {"journal_format": fmt})
    assert drain(coll, "torn") == [b"kept"]
    coll.close()


def test_a_journal_that_stops_being_writable_makes_its_queue_read_only_counted_and_logged(tmp_path: Path) -> None:
    """Found by a change rather than at start-up (the journal is opened by the first change): the
    queue is read-only, the failure counted and logged, until a change finds it writable again."""
    coll = open_collection(tmp_path)
    coll.put("q", [b"one"])
    coll.close()
    coll = open_collection(tmp_path)
    q = coll.queue("q")
    with unwritable(tmp_path / "q"), capture_logs() as logs:
        with pytest.raises(JournalWriteError):
            coll.put("q", [b"refused"])
        gevent.idle()
        assert (q.read_only, q.journal_write_errors) == (True, 1)
        assert [e["event"] for e in logs if e["log_level"] == "error"] == [
            "cannot write the journal; the queue is read-only until it can"]
    assert coll.put("q", [b"two"]) == 1 and not q.read_only
    assert drain(coll, "q") == [b"one", b"two"]
    coll.close()


def test_a_server_refuses_the_queue_whose_journal_another_user_owns_and_says_so_everywhere(
        tmp_path: Path) -> None:
    """A journal owned by another user, mode 644: the server (without root's power over files)
    serves every other queue; this one is refused, in the log, stats, /stats.json, /metrics and
    every protocol's error, naming the file and what to do."""
    srv = ServerProcess(tmp_path)
    srv.queue_path.mkdir(parents=True)
    (srv.queue_path / "good").write_bytes(_addx(b"one"))
    locked = srv.queue_path / "locked"
    locked.write_bytes(_addx(b"kept"))
    os.chown(locked, 65534, 65534)  # nobody
    locked.chmod(0o644)
    srv.wrapper = as_plain_user()
    srv.start()
    try:
        assert "QUEUE REFUSED: its journal cannot be written" in srv.log() and str(locked) in srv.log()
        with conn(srv.memcache_port) as s:
            assert exchange(s, b"get good\r\n", b"END\r\n") == b"VALUE good 0 3\r\none\r\nEND\r\n"
            for request in (b"get locked\r\n", b"set locked 0 0 1\r\nx\r\n"):
                reply = exchange(s, request, b"\r\n").decode()
                assert reply.startswith("SERVER_ERROR queue 'locked' is not served"), (request, reply)
                assert "Permission denied" in reply and "write access" in reply
        client = _thrift_client(srv.thrift_port)
        try:
            with pytest.raises(TApplicationException, match="queue 'locked' is not served.*write access"):
                client.put("locked", [b"x"], 0)
        finally:
            client.close()
        stats = memcache_stats(srv.memcache_port)
        assert stats["refused_queues"] == "1" and stats["refused_queue_locked"] == "1"
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.admin_port}/stats.json") as reply:
            body = json.loads(reply.read())
        assert "Permission denied" in body["refused_queues"]["locked"]
        refused = _metric(srv, "kestrel_queue_refused", "/metrics/per-queue")
        assert [(s.labels["queue"], s.value) for s in refused] == [("locked", 1)]
        assert [s.value for s in _metric(srv, "kestrel_refused_queues")] == [1]
    finally:
        assert srv.stop(signal.SIGTERM) == 0
    assert locked.read_bytes() == _addx(b"kept")
