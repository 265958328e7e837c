"""A queue whose journal is damaged is refused alone: the other queues serve, and the refused one
answers every request, on every protocol, with an error naming it, the damage and the remedy."""

from __future__ import annotations

import json
import re
import signal
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from thriftpy2.thrift import TApplicationException

from kestrel.storage import QueueCollection
from kestrel.storage.errors import QueueDamaged
from kestrel.storage.kestrel2.codec import AddX, encode
from tests.conftest import ServerProcess
from tests.server.test_shutdown import _thrift_client
from tests.support.queues import drain
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
    for call in (lambda: coll.queue("bad"), lambda: coll.add("bad", b"x"), lambda: coll.flush("bad"),
                 lambda: coll.remove("bad"), lambda: coll.peek("bad"), lambda: coll.delete("bad"),
                 lambda: coll.add("bad+child", b"x")):
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
