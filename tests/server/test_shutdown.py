"""Stopping: SIGTERM ends the server without waiting for its clients (idle ones are closed, waiting
reads answered, only a client that stops reading is given the shutdown timeout), with nothing lost
and no traceback in the log. How long a stop takes is bench/bench_responsiveness.py's figure; here a
shutdown timeout far longer than STALL_S tells a stop that waited for a client from one that did not."""

from __future__ import annotations

import json
import signal
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

from pymemcache.client.base import Client as MemcacheClient

from tests.conftest import STALL_S, ServerProcess, wait_until
from tests.support.clients import thrift_client
from tests.support.queues import one
from tests.support.wire import memcache_stats

_thrift_client = thrift_client


def _log_events(srv: ServerProcess) -> list[dict[str, Any]]:
    return [json.loads(line) for line in srv.log().splitlines() if line.startswith("{")]


def _assert_clean_log(srv: ServerProcess) -> None:
    log = srv.log()
    assert "Traceback" not in log and "QueueClosed" not in log, log
    assert not [e for e in _log_events(srv) if e.get("level") == "error"], log


BUSY_AT_TIMEOUT = "closing connections still busy at the shutdown timeout"


def _stop_timed(srv: ServerProcess) -> float:
    """Stop with SIGTERM; the seconds the stop took by the server's own clock (its "kestrel stopped"
    line). The exit that follows is the interpreter's, which on a loaded machine can wait seconds for
    a CPU; a stop that hangs fails here all the same (killed after 30 s, so not exit code 0)."""
    code = srv.stop(timeout=30)
    assert code == 0, srv.log()
    stopped = [e for e in _log_events(srv) if e.get("event") == "kestrel stopped"]
    assert stopped, srv.log()
    return float(stopped[-1]["seconds"])


def test_sigterm_with_idle_clients_on_every_port_stops_at_once(server_factory: Any) -> None:
    srv = server_factory({"shutdown_timeout": "60s"})
    thrift = _thrift_client(srv.thrift_port)
    assert thrift.put("jobs", [b"one"], 0) == 1
    mc = MemcacheClient(("127.0.0.1", srv.memcache_port), timeout=5)
    assert mc.get("jobs/open") == b"one"  # an open read, idle: the stop must hand it back
    text = socket.create_connection(("127.0.0.1", srv.text_port), timeout=5)
    text.sendall(b"peek jobs\n")
    assert text.recv(100) == b"*\n"
    try:
        elapsed = _stop_timed(srv)
    finally:
        thrift.close()
        mc.close()
        text.close()
    assert elapsed < STALL_S, f"stop took {elapsed:.2f}s\n{srv.log()}"
    assert BUSY_AT_TIMEOUT not in srv.log()  # every idle client was closed, none waited for
    _assert_clean_log(srv)
    srv.start()  # the open read went back to the queue before the queue closed
    mc = MemcacheClient(("127.0.0.1", srv.memcache_port), timeout=5)
    try:
        assert mc.get("jobs") == b"one"
    finally:
        mc.close()


def test_sigterm_answers_waiting_reads_and_keeps_open_reads(server_factory: Any) -> None:
    srv = server_factory({"shutdown_timeout": "60s"})
    thrift = _thrift_client(srv.thrift_port)
    assert thrift.put("work", [b"a", b"b"], 0) == 2
    held = thrift.get("work", 1, 0, 60_000)  # an open read with an auto-abort timer still running
    assert [i.data for i in held] == [b"a"]
    waiter = socket.create_connection(("127.0.0.1", srv.memcache_port), timeout=5)
    waiter.sendall(b"get empty/t=30000\r\n")
    text = socket.create_connection(("127.0.0.1", srv.text_port), timeout=5)
    text.sendall(b"get empty 30000\n")
    wait_until(lambda: memcache_stats(srv.memcache_port).get("queue_empty_waiters") == "2", "both gets to wait")
    try:
        elapsed = _stop_timed(srv)
        assert waiter.recv(100) == b"END\r\n"  # answered, not cut off
        assert text.recv(100) == b"*\n"
    finally:
        thrift.close()
        waiter.close()
        text.close()
    assert elapsed < STALL_S, f"stop took {elapsed:.2f}s\n{srv.log()}"
    assert BUSY_AT_TIMEOUT not in srv.log()  # the waits were ended, not waited for
    _assert_clean_log(srv)
    srv.start()  # the open Thrift read was neither lost nor confirmed: it is handed out again
    thrift = _thrift_client(srv.thrift_port)
    try:
        assert sorted(i.data for i in thrift.get("work", 10, 0, 0)) == [b"a", b"b"]
    finally:
        thrift.close()


@contextmanager
def client_that_stops_reading(srv: ServerProcess) -> Iterator[None]:
    """A memcache client that asks for 80 MB of replies and reads none: the server blocks sending."""
    hog = socket.create_connection(("127.0.0.1", srv.memcache_port), timeout=5)
    try:
        hog.sendall(b"set big 0 0 4000000\r\n" + b"x" * 4_000_000 + b"\r\n")
        assert hog.recv(100) == b"STORED\r\n"
        hog.sendall(b"get big/peek\r\n" * 20)
        assert hog.recv(1, socket.MSG_PEEK) == b"V"  # the replies have begun
        yield
    finally:
        hog.close()


def closed_busy(srv: ServerProcess, event: str) -> None:
    """The stop closed the one busy memcache connection (logged as `event`), and, started again, the
    server holds the item it was sending (a peek takes nothing; the journal was closed cleanly)."""
    busy = [e for e in _log_events(srv) if e.get("event") == event]
    assert [(e["listener"], e["connections"]) for e in busy] == [("memcache", 1)]
    assert "Traceback" not in srv.log()
    srv.start()
    mc = MemcacheClient(("127.0.0.1", srv.memcache_port), timeout=5)
    try:
        assert mc.get("big") == b"x" * 4_000_000
    finally:
        mc.close()


def test_a_client_that_stops_reading_is_cut_off_at_the_shutdown_timeout(server_factory: Any) -> None:
    srv = server_factory({"shutdown_timeout": "200ms"})
    with client_that_stops_reading(srv):
        elapsed = _stop_timed(srv)
    assert 0.2 <= elapsed < STALL_S, f"stop took {elapsed:.2f}s\n{srv.log()}"
    closed_busy(srv, BUSY_AT_TIMEOUT)


def test_a_second_sigterm_closes_the_connections_still_busy_at_once(server_factory: Any) -> None:
    """A second SIGTERM did nothing: the stop waited the whole `shutdown_timeout` for a client that
    stops reading (here a minute, where a service manager kills the server first)."""
    srv = server_factory({"shutdown_timeout": "60s"})
    assert srv.proc is not None
    with client_that_stops_reading(srv):
        srv.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: "kestrel shutting down" in srv.log(), "the stop to begin")
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(timeout=STALL_S) == 0
    assert "stop asked again: connections still busy are closed now" in srv.log()
    assert BUSY_AT_TIMEOUT not in srv.log()
    closed_busy(srv, "closing connections still busy: stop asked again")


def test_end_waits_answers_waiting_readers_and_later_reads_do_not_wait(tmp_path: Any) -> None:
    import gevent

    from kestrel.storage import QueueCollection

    coll = QueueCollection(str(tmp_path))
    coll.put("full", [b"item"])
    waiter = gevent.spawn(partial(coll.remove, "empty", 1, False, 30.0))
    gevent.sleep(0)
    assert coll.get("empty") is not None and coll.get("empty").waiters == 1  # type: ignore[union-attr]
    started = time.monotonic()
    coll.end_waits()
    assert waiter.get(timeout=1) == []
    assert coll.remove("other", 1, False, 30.0) == []  # a queue created afterwards does not wait either
    assert time.monotonic() - started < STALL_S  # not the 30 s asked for
    assert one(coll.remove("full", 1, False, 30.0)).data == b"item"  # type: ignore[union-attr]
    coll.close()
