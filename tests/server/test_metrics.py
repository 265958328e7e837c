"""`/metrics` as Prometheus reads it: parsed with prometheus-client's own text parser."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from pymemcache.client.base import Client as MemcacheClient

from kestrel import SERVER_VERSION
from kestrel.service.metrics import QUEUE_FIGURES, QUEUE_SUMS, SERVER_FIGURES
from tests.conftest import ROOT, ServerProcess, wait_until
from tests.server.test_shutdown import _thrift_client
from tests.support.system import tool


def _text(srv: ServerProcess, path: str = "/metrics") -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.admin_port}{path}") as reply:
        assert reply.headers["Content-Type"].startswith("text/plain; version=")
        return str(reply.read().decode())


def _scrape(srv: ServerProcess, path: str = "/metrics") -> dict[str, Any]:
    return {family.name: family for family in text_string_to_metric_families(_text(srv, path))}


def _get(srv: ServerProcess, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.admin_port}{path}", timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _sample(family: Any, name: str, **labels: str) -> float:
    values = [s.value for s in family.samples if s.name == name and all(s.labels.get(k) == v
                                                                          for k, v in labels.items())]
    assert len(values) == 1, (name, labels, family.samples)
    return float(values[0])


def test_metrics_parse_with_help_types_and_latency_histograms(server_factory: Any) -> None:
    srv = server_factory({"default_queue": {"sync_journal": "always", "default_journal_size": "1KB"}})
    mc = MemcacheClient(("127.0.0.1", srv.memcache_port), timeout=5, default_noreply=False)
    thrift = _thrift_client(srv.thrift_port)
    text = socket.create_connection(("127.0.0.1", srv.text_port), timeout=5)
    try:
        for _ in range(20):
            assert mc.set("packed", b"x" * 100)
        for _ in range(20):
            assert mc.get("packed") == b"x" * 100  # empty with a journal past 1KB: rotated and packed
        assert thrift.put("rpc", [b"a", b"b"], 0) == 2
        text.sendall(b"put lines:\none\n\n")
        assert text.recv(100) == b"+1\n"
        # One version on every face of the server.
        text.sendall(b"version\n")
        assert text.recv(100) == b":%s\n" % SERVER_VERSION.encode()
        assert thrift.get_version() == mc.version().decode() == SERVER_VERSION
        assert mc.stats()[b"version"] == SERVER_VERSION.encode()

        def packed() -> bool:
            nonlocal families
            families = _scrape(srv)
            return _sample(families["kestrel_journal_pack_duration_seconds"],
                           "kestrel_journal_pack_duration_seconds_count") >= 1

        families: dict[str, Any] = {}
        wait_until(packed, "a journal pack in the metrics")
        stats = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{srv.admin_port}/stats.json").read())
    finally:
        mc.close()
        thrift.close()
        text.close()

    # Kestrel's figures by Prometheus's names: counters end in _total, every family has its help text;
    # /stats.json keeps Kestrel's names.
    put_items = families["kestrel_put_items"]
    assert put_items.type == "counter" and put_items.documentation
    assert _sample(put_items, "kestrel_put_items_total") == stats["server"]["cmd_set"] == 23
    assert _sample(families["kestrel_get_hits"], "kestrel_get_hits_total") == 20
    assert _sample(families["kestrel_queues"], "kestrel_queues") == len(stats["queues"]) == 3
    assert _sample(families["kestrel_build_info"], "kestrel_build_info", version=SERVER_VERSION) == 1
    assert _sample(families["process_open_fds"], "process_open_fds") > 0
    assert all(f.documentation for f in families.values())
    # No series per queue here: each queue's are on a path of their own.
    assert not any("queue" in s.labels for f in families.values() for s in f.samples)
    per_queue = _scrape(srv, "/metrics/per-queue")
    items = per_queue["kestrel_queue_items"]
    assert items.type == "gauge"
    assert _sample(items, "kestrel_queue_items", queue="rpc") == 2
    assert _sample(items, "kestrel_queue_items", queue="packed") == 0
    assert _sample(per_queue["kestrel_queue_items_added"], "kestrel_queue_items_added_total", queue="packed") == 20
    created = _sample(per_queue["kestrel_queue_created_timestamp_seconds"],
                      "kestrel_queue_created_timestamp_seconds", queue="rpc")
    # seconds, from Kestrel's milliseconds (the text format's float may differ in its last digit)
    assert created == pytest.approx(stats["queues"]["rpc"]["create_time"] / 1000, abs=1e-3)

    # Request latency per protocol and command.
    requests = families["kestrel_request_duration_seconds"]
    assert requests.type == "histogram"
    count = "kestrel_request_duration_seconds_count"
    assert _sample(requests, count, protocol="memcache", command="set") == 20
    assert _sample(requests, count, protocol="memcache", command="get") == 20
    assert _sample(requests, count, protocol="thrift", command="put") == 1
    assert _sample(requests, count, protocol="text", command="put") == 1  # one block, timed as it is stored
    assert _sample(requests, "kestrel_request_duration_seconds_bucket", protocol="memcache", command="set",
                   le="+Inf") == 20

    # Journal writes and fsyncs (sync_journal: always), and the pack.
    writes = _sample(families["kestrel_journal_write_duration_seconds"],
                     "kestrel_journal_write_duration_seconds_count")
    fsyncs = _sample(families["kestrel_journal_fsync_duration_seconds"],
                     "kestrel_journal_fsync_duration_seconds_count")
    # One append per get and put; pymemcache sends its 20 sets with noreply, without waiting for
    # each, so they arrive pipelined and are stored in as few puts as bursts (at least one).
    assert writes >= 23 and 1 <= fsyncs <= writes
    assert _sample(families["kestrel_journal_pack_duration_seconds"],
                   "kestrel_journal_pack_duration_seconds_count") == 1
    assert _sample(families["kestrel_journal_pack_duration_seconds"],
                   "kestrel_journal_pack_duration_seconds_sum") > 0


def test_an_observation_lands_in_the_bucket_bisect_left_finds() -> None:
    """The compiled search from the lowest bound up answers as `bisect_left` does, bounds, values
    between them, infinity and NaN included."""
    import bisect
    import math

    from kestrel.service.histogram_series import HistogramSeries

    bounds = (0.00001, 0.000025, 0.0001, 0.001, 0.5, 1.0, 300.0, math.inf)
    series = HistogramSeries(bounds)
    values = [-1.0, 0.0, 5e-6, *bounds, *(b * 1.5 for b in bounds[:-1]), 1e9, math.nan]
    assert [series.bucket(v) for v in values] == [bisect.bisect_left(bounds, v) for v in values]
    for v in values:
        series.observe(v)
    assert series.counts == [sum(bisect.bisect_left(bounds, v) == i for v in values) for i in range(len(bounds))]
    before = series.counts
    series.observe_many(0.0, 3)  # the first bucket's count, kept apart, and the others alike
    series.observe_many(0.75, 2)
    assert series.counts == [before[0] + 3, *before[1:5], before[5] + 2, *before[6:]]


def test_loop_histograms_expose_what_prometheus_clients_own_histogram_does() -> None:
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from kestrel.service.metrics import LoopHistogram

    buckets = (0.001, 0.01, 0.1, 1.0)
    observations = [0.0, 0.0005, 0.001, 0.001, 0.0011, 0.05, 0.1, 0.99, 1.0, 1.5, 300.0]
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    loop = LoopHistogram("t_seconds", "help text", buckets, ("protocol", "command"))
    ours.register(loop)
    reference = Histogram("t_seconds", "help text", ["protocol", "command"], buckets=buckets, registry=theirs)
    for n, seconds in enumerate(observations):
        labels = ("thrift", "get") if n % 3 else ("memcache", "set")
        loop.labels(*labels).observe(seconds)
        reference.labels(*labels).observe(seconds)

    def exposition(registry: CollectorRegistry) -> list[str]:
        return sorted(line for line in generate_latest(registry).decode().splitlines() if "_created" not in line)

    assert exposition(ours) == exposition(theirs)
    assert 'le="+Inf"' in generate_latest(ours).decode()


def test_promtool_accepts_both_pages(server_factory: Any, tmp_path: Path) -> None:
    """Prometheus's own linter: names, units, `_total` on counters only, help on every family."""
    promtool = tool("promtool")
    # A Kestrel 2 queue whose journal's name is not UTF-8 (a lone surrogate in its name, which
    # used to fail the whole per-queue page), and one with a quote that a label escapes.
    queues = tmp_path / "server" / "queues"
    queues.mkdir(parents=True)
    (queues / os.fsdecode(b"caf\xe9")).write_bytes(b"")
    server = server_factory()
    mc = MemcacheClient(("127.0.0.1", server.memcache_port), timeout=5, default_noreply=False)
    try:
        assert mc.set("linted", b"x") and mc.get("linted") == b"x" and mc.get("linted/open") is None
        assert mc.set('say"hi', b"x")
    finally:
        mc.close()
    for path in ("/metrics", "/metrics/per-queue"):
        text = _text(server, path)
        assert "kestrel_" in text
        if path == "/metrics/per-queue":
            assert 'queue="caf\\\\udce9"' in text and 'queue="say\\"hi"' in text
        done = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0 and not done.stdout.strip() and not done.stderr.strip(), (
            path, done.stdout, done.stderr)
    # Kestrel's text figures name it as /stats.json does (they failed with a UnicodeEncodeError)
    assert "queue_caf\\udce9_items: 0" in _get(server, "/stats.txt")[1]
    with socket.create_connection(("127.0.0.1", server.memcache_port), timeout=10) as s:
        for command, shown in ((b"stats", b"STAT queue_caf\\udce9_items 0\r\n"),
                               (b"dump_stats", b"queue 'caf\\udce9' {\r\n"),
                               (b"dump_config", b"queue 'caf\\udce9' {\r\n")):
            s.sendall(command + b"\r\n")
            reply = b""
            while not reply.endswith(b"END\r\n"):
                chunk = s.recv(65536)
                assert chunk and not reply.startswith(b"SERVER_ERROR"), reply[:300]
                reply += chunk
            assert shown in reply, (command, reply[:300])


def test_every_kestrel_figure_is_placed_in_the_metrics(server: ServerProcess) -> None:
    """A figure added to /stats.json gets a Prometheus name, or is left out on purpose."""
    mc = MemcacheClient(("127.0.0.1", server.memcache_port), timeout=5, default_noreply=False)
    try:
        assert mc.set("placed", b"x")
    finally:
        mc.close()
    stats = json.loads(_get(server, "/stats.json")[1])
    assert set(stats["server"]) == set(SERVER_FIGURES)
    assert set(stats["queues"]["placed"]) == set(QUEUE_FIGURES)
    names = [f.name for f in (*SERVER_FIGURES.values(), *QUEUE_FIGURES.values(), *QUEUE_SUMS.values()) if f]
    assert len(names) == len(set(names))
    for figure in (*SERVER_FIGURES.values(), *QUEUE_FIGURES.values(), *QUEUE_SUMS.values()):
        if figure is not None:
            assert figure.name.endswith("_total") == (figure.kind == "counter"), figure.name
            assert not figure.name.endswith(("_ms", "_msec")), figure.name


def test_the_series_docs_memory_md_names_are_served_and_the_bytes_paged_since_start_a_counter(
        server: ServerProcess) -> None:
    """docs/memory.md's "Figures" names the series of each memory figure; the bytes paged out since
    start are a running count, a counter (`kestrel_paged_out_bytes` is what is paged out now)."""
    mc = MemcacheClient(("127.0.0.1", server.memcache_port), timeout=5, default_noreply=False)
    try:
        assert mc.set("held", b"x")
    finally:
        mc.close()
    named = set(re.findall(r"`(kestrel_\w+)", (ROOT / "docs" / "memory.md").read_text()))
    assert {"kestrel_memory_held_bytes", "kestrel_queue_memory_target_bytes"} <= named
    served = {sample.name for path in ("/metrics", "/metrics/per-queue")
              for family in _scrape(server, path).values() for sample in family.samples}
    assert named <= served, named - served
    families = _scrape(server)
    assert families["kestrel_memory_paged_out_bytes"].type == "counter"
    assert "since start" in families["kestrel_memory_paged_out_bytes"].documentation


def test_status_shows_in_stats_metrics_and_readiness(server: ServerProcess) -> None:
    """`/ready` answers writers' load balancers, `/ready/read` readers'; `/ping` is liveness alone."""
    expected = {"up": (200, 200), "readonly": (503, 200), "quiescent": (503, 503)}
    for status, label in (("readonly", "ReadOnly"), ("quiescent", "Quiescent"), ("up", "Up")):
        with socket.create_connection(("127.0.0.1", server.memcache_port), timeout=5) as s:
            s.sendall(f"status {status}\r\n".encode())
            assert s.recv(100) == b"END\r\n"
        stats = json.loads(_get(server, "/stats.json")[1])
        assert stats["status"] == stats["enforced_status"] == label
        assert stats["server_sets"] is None  # no zookeeper setting
        states = {s.labels["status"]: s.value for s in _scrape(server)["kestrel_status"].samples}
        assert states == {"Up": float(label == "Up"), "ReadOnly": float(label == "ReadOnly"),
                          "Quiescent": float(label == "Quiescent")}
        write, read = expected[status]
        assert _get(server, "/ready") == (write, f"{label}\n")
        assert _get(server, "/ready/read") == (read, f"{label}\n")
        assert _get(server, "/ping") == (200, "pong\n")


def test_a_request_the_admin_port_refuses_is_one_warning_in_the_log(server_factory: Any) -> None:
    srv = server_factory()
    requests = [b"GET /ping HTTP/1.1\r\n" + b"X: y\r\n" * 200 + b"\r\n",  # http.client's header limit
                b"GARBAGE\r\n\r\n", b"GET /ping HTTP/9.9\r\n\r\n"]
    for request in requests:
        with socket.create_connection(("127.0.0.1", srv.admin_port), timeout=10) as s:
            s.sendall(request)
            assert s.recv(4096).startswith(b"HTTP/1.1 400 ")
    assert _get(srv, "/ping") == (200, "pong\n")  # and the port serves on
    srv.stop()
    events = [json.loads(line) for line in srv.log().splitlines()]  # every line a JSON event: no bare text
    refused = [e for e in events if e["event"] == "admin request refused"]
    assert len(refused) == len(requests)
    for e in refused:  # the client as every port's lines write it, `host:port`, in the reason too
        assert re.fullmatch(r"127\.0\.0\.1:\d+", e["client"]) and "('127.0.0.1'" not in e["reason"], e
    assert "got more than 100 headers" in refused[0]["reason"]
    assert not any("Traceback" in str(e) for e in events)


def test_a_head_request_is_answered_with_headers_alone(server: ServerProcess) -> None:
    """A keep-alive client reads a HEAD's answer, then the next one's: a body after the headers of a
    HEAD would be read as the next answer's status line."""
    for path in ("/ready", "/stats.json", "/"):
        with socket.create_connection(("127.0.0.1", server.admin_port), timeout=10) as s:
            s.sendall(f"HEAD {path} HTTP/1.1\r\nHost: localhost\r\n\r\nGET /ping HTTP/1.1\r\nHost: localhost\r\n\r\n".encode())
            answers = b""
            while not answers.endswith(b"pong\n"):
                chunk = s.recv(65536)
                assert chunk, answers
                answers += chunk
        head, ping = answers.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 200 ") and ping.startswith(b"HTTP/1.1 200 OK\r\n"), answers


def test_a_head_says_the_length_a_get_would_and_other_methods_are_refused(server: ServerProcess) -> None:
    """A HEAD's Content-Length is its GET's (it was 0 where the length came from the body sent);
    a method the port does not take is 405 with the ones it does, wherever it is sent."""
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", server.admin_port, timeout=10)
    try:
        for path in ("/", "/ping", "/nosuch", "/dashboard/queue.json?name=nosuch"):
            connection.request("GET", path)
            got = connection.getresponse()
            body = got.read()
            connection.request("HEAD", path)
            head = connection.getresponse()
            assert head.read() == b"" and head.status == got.status, path
            assert head.getheader("Content-Length") == got.getheader("Content-Length") == str(len(body)), path
        for method in ("POST", "PUT", "DELETE", "PATCH"):
            for path in ("/ping", "/", "/nosuch"):
                connection.request(method, path, body=b"x")
                refused = connection.getresponse()
                assert (refused.status, refused.getheader("Allow")) == (405, "GET, HEAD"), (method, path)
                assert refused.read() == b"the admin port answers GET and HEAD only\n"
        connection.request("GET", "/ping")
        assert connection.getresponse().read() == b"pong\n"  # the connection still serves
    finally:
        connection.close()


def test_a_client_pipelining_admin_requests_does_not_hold_the_queue_ports(server: ServerProcess) -> None:
    """gevent's handler answers a connection's pipelined requests one after another; between two it
    now steps aside. Before, a memcache client waited for the whole stream (2.7 s for 3,000 /stats.json)."""
    import threading
    import time

    rounds: list[float] = []
    done = threading.Event()

    def probe() -> None:
        with socket.create_connection(("127.0.0.1", server.memcache_port), timeout=60) as s:
            while not done.is_set():
                s.sendall(b"version\r\n")
                assert s.recv(100).startswith(b"VERSION ")
                rounds.append(time.monotonic())
                time.sleep(0.01)

    prober = threading.Thread(target=probe)
    prober.start()
    wait_until(lambda: len(rounds) >= 3, "the probe's first rounds")
    request = b"GET /stats.json HTTP/1.1\r\nHost: localhost\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.admin_port), timeout=60) as s:
        s.sendall(request * 2_999 + request.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n"))
        first = 0.0
        while s.recv(1 << 20):
            first = first or time.monotonic()
        last = time.monotonic()
    done.set()
    prober.join()
    during = [at for at in rounds if first <= at <= last]
    assert len(during) >= 5, (len(during), last - first)


def test_an_answer_read_too_slowly_closes_at_request_timeout_without_a_traceback(server_factory: Any) -> None:
    """A client that asks and never reads: its answer's write runs out of `request_timeout`, which
    gevent's handler logged as an uncaught error with a traceback, one a connection."""
    import time

    srv = server_factory({"request_timeout": "1s"})
    clients = []
    for _ in range(3):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        s.connect(("127.0.0.1", srv.admin_port))
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n" * 400)
        clients.append(s)
    time.sleep(2.5)
    for s in clients:
        s.close()
    assert _get(srv, "/ping") == (200, "pong\n")
    srv.stop()
    events = [json.loads(line) for line in srv.log().splitlines()]
    assert not [e for e in events if e["event"] == "uncaught error" or "Traceback" in str(e)]


def test_probes_are_answered_while_every_admin_connection_is_stalled(server: ServerProcess) -> None:
    """Stalled clients (a request line begun, never ended) once held every admin connection until
    their `request_timeout` (30 s), /ping and /ready unanswered: the one that has waited longest for a
    request gives way to a client waiting to connect."""
    from kestrel.service.admin import ADMIN_CONNECTIONS

    stalled = []
    for _ in range(ADMIN_CONNECTIONS + 10):
        s = socket.create_connection(("127.0.0.1", server.admin_port), timeout=10)
        s.sendall(b"GET /ping HTTP/1.1\r\n")
        stalled.append(s)
    try:
        for _ in range(3):
            with urllib.request.urlopen(f"http://127.0.0.1:{server.admin_port}/ping", timeout=10) as reply:
                assert reply.read() == b"pong\n"
            with urllib.request.urlopen(f"http://127.0.0.1:{server.admin_port}/ready", timeout=10) as reply:
                assert reply.status == 200
        closed = 0
        for s in stalled[:10]:  # the oldest made room (for the 10 waiting, then the probes): closed
            s.settimeout(5)
            try:
                closed += s.recv(1) == b""
            except ConnectionResetError:
                closed += 1
            except TimeoutError:
                pass
        assert closed == 10
    finally:
        for s in stalled:
            s.close()


def test_probes_are_answered_while_every_admin_connection_is_read_too_slowly(server: ServerProcess) -> None:
    """Clients that ask for pages and read the answers a few bytes at a time held every admin
    connection (and each a copy of its page) until their `request_timeout`: the one answering
    longest gives way to a client waiting to connect, once none waits for a request."""
    from kestrel.service.admin import ADMIN_CONNECTIONS

    slow = []
    for _ in range(ADMIN_CONNECTIONS + 10):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
        s.settimeout(10)
        s.connect(("127.0.0.1", server.admin_port))
        s.sendall(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n" * 400)  # then never read
        slow.append(s)
    try:
        for _ in range(3):
            with urllib.request.urlopen(f"http://127.0.0.1:{server.admin_port}/ping", timeout=10) as reply:
                assert reply.read() == b"pong\n"
    finally:
        for s in slow:
            s.close()


def test_a_page_that_waits_a_second_for_a_turn_takes_the_one_held_longest() -> None:
    """The pages that pass over every queue are answered PAGES_AT_ONCE at a time: clients reading
    theirs a few bytes at a time held every turn, and every other page waited their `request_timeout`
    (30 s). One that waits PAGE_TURN_WAIT_S takes the turn held longest, whose answer is given up."""
    from functools import partial

    import gevent

    from kestrel.service.admin import PAGES_AT_ONCE, _PageTurns

    turns = _PageTurns()
    given_back: list[int] = []

    def slow_reader(n: int) -> None:
        worker = turns.take()
        try:
            gevent.sleep(60)  # sending its answer to a client that does not read
        finally:
            given_back.append(n)
            turns.give_back(worker)  # as its answer's close does

    holders = [gevent.spawn(partial(slow_reader, n)) for n in range(PAGES_AT_ONCE)]
    gevent.sleep(0.01)
    with gevent.Timeout(10):
        worker = turns.take()
    assert given_back == [0] and holders[0].dead and not any(h.dead for h in holders[1:])
    turns.give_back(worker)
    gevent.killall(holders)


def test_the_admin_port_holds_at_most_its_connections_and_the_rest_wait(server: ServerProcess) -> None:
    """Idle admin connections once took the descriptors the queue ports' clients needed: the port
    holds `ADMIN_CONNECTIONS` at once; the others wait in the listen backlog, as any port's do when
    descriptors run out."""
    import time

    from kestrel.service.admin import ADMIN_CONNECTIONS

    assert server.proc is not None
    descriptors = Path(f"/proc/{server.proc.pid}/fd")
    before = len(list(descriptors.iterdir()))
    idle = [socket.create_connection(("127.0.0.1", server.admin_port), timeout=10)
            for _ in range(ADMIN_CONNECTIONS + 100)]
    try:
        wait_until(lambda: len(list(descriptors.iterdir())) >= before + ADMIN_CONNECTIONS - 5,
                   "the port's connections")
        time.sleep(0.5)  # the rest wait in the backlog, unaccepted
        assert len(list(descriptors.iterdir())) <= before + ADMIN_CONNECTIONS + 5
    finally:
        for s in idle:
            s.close()
    assert _get(server, "/ping") == (200, "pong\n")
