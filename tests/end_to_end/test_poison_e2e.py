"""Poison items end to end: real clients abort an item until it leaves for its error queue."""

from __future__ import annotations

import json
import socket
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from pymemcache.client.base import Client as MemcacheClient

from tests.conftest import ServerProcess, wait_until
from tests.server.test_shutdown import _thrift_client
from tests.support.wire import memcache_stats, shared_server  # noqa: F401  (the module's `server`)

QUEUES = {"queues": {"jobs": {"max_errors": 3, "error_queue": "failed"}, "plain": {"max_errors": 2},
                     "auto": {"max_errors": 3, "error_queue": "auto_failed"},
                     "crash": {"max_errors": 3, "error_queue": "crash_failed"}}}
SHARED_SERVER_CONFIG = QUEUES  # the module's `server`, for the tests that do not restart it


def _queue_stats(srv: ServerProcess) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.admin_port}/stats.json") as reply:
        queues: dict[str, Any] = json.loads(reply.read())["queues"]
    return queues


def _poisoned_metric(srv: ServerProcess, queue: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.admin_port}/metrics/per-queue") as reply:
        text = reply.read().decode()
    family = next(f for f in text_string_to_metric_families(text) if f.name == "kestrel_queue_items_poisoned")
    assert family.type == "counter"
    return next(s.value for s in family.samples if s.labels["queue"] == queue)


def test_thrift_abort_max_errors_times_moves_the_item_to_the_error_queue(server: ServerProcess) -> None:
    c = _thrift_client(server.thrift_port)
    try:
        assert c.put("jobs", [b"bad", b"good"], 60_000) == 2
        for attempt in range(3):
            got = c.get("jobs", 1, 0, 30_000)
            assert [i.data for i in got] == [b"bad"], attempt
            assert c.abort("jobs", {got[0].id}) == 1
        assert c.peek("jobs").items == 1
        moved = c.get("failed", 10, 0, 0)
        assert [i.data for i in moved] == [b"bad"]
        assert [i.data for i in c.get("jobs", 10, 0, 0)] == [b"good"]
    finally:
        c.close()
    assert _queue_stats(server)["jobs"]["poisoned"] == 1
    assert _poisoned_metric(server, "jobs") == 1
    assert memcache_stats(server.memcache_port)["queue_jobs_poisoned"] == "1"


def test_thrift_auto_aborts_count_as_errors(server: ServerProcess) -> None:
    c = _thrift_client(server.thrift_port)
    try:
        c.put("auto", [b"slow"], 0)
        for _ in range(3):
            got = c.get("auto", 1, 2_000, 50)  # not confirmed: auto-aborted after 50 ms
            assert [i.data for i in got] == [b"slow"]
        wait_until(lambda: c.peek("auto_failed").items == 1, "the poison item on the error queue")
        assert c.peek("auto").items == 0 and c.peek("auto").open_transactions == 0
    finally:
        c.close()


def test_memcache_open_and_disconnect_max_errors_times_moves_the_item(server: ServerProcess) -> None:
    mc = MemcacheClient(("127.0.0.1", server.memcache_port), timeout=5, default_noreply=False)
    try:
        assert mc.set("crash", b"crashes its worker")
        for attempt in range(3):
            worker = MemcacheClient(("127.0.0.1", server.memcache_port), timeout=5)
            got = worker.get("crash/t=2000/open")
            assert got == b"crashes its worker", attempt
            worker.close()  # the worker dies holding the read
        wait_until(lambda: _queue_stats(server).get("crash_failed", {}).get("items") == 1, "the poison item on the error queue")
        assert mc.get("crash_failed") == b"crashes its worker"
        assert _queue_stats(server)["crash"]["items"] == 0
    finally:
        mc.close()


def test_without_error_queue_the_item_is_dropped_and_acknowledged_items_survive(server_factory: Any) -> None:
    srv = server_factory(QUEUES)
    text = socket.create_connection(("127.0.0.1", srv.text_port), timeout=5)
    try:
        text.sendall(b"put plain:\nbad\nkept\n\n")
        assert text.recv(100) == b"+2\n"
    finally:
        text.close()
    c = _thrift_client(srv.thrift_port)
    try:
        for _ in range(2):
            got = c.get("plain", 1, 0, 30_000)
            assert [i.data for i in got] == [b"bad"]
            c.abort("plain", {got[0].id})
        assert c.peek("plain").items == 1
    finally:
        c.close()
    assert _queue_stats(srv)["plain"]["poisoned"] == 1
    srv.kill()
    srv.start()
    c = _thrift_client(srv.thrift_port)
    try:
        assert [i.data for i in c.get("plain", 10, 0, 0)] == [b"kept"]
    finally:
        c.close()
    assert "failed" not in _queue_stats(srv)
