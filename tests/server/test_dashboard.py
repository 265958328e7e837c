"""The admin page's server side without a browser: its figures come from the sources `/stats.json`
reads, cost nothing while no page asks, are shared by the pages that do, and its files are
served read-only under a Content-Security-Policy that keeps the page to its own origin."""

from __future__ import annotations

import json
import re
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
import structlog

from kestrel.service.admin import HEADERS, POLICY
from kestrel.service.config import ServerConfig
from kestrel.service.dashboard import Dashboard
from kestrel.service.dashboard.figures import SNAPSHOT_S, queue_state
from kestrel.service.dashboard.pages import load_static
from kestrel.service.session.server_state import ServerState
from kestrel.storage.config import QueueConfig, QueueConfigs
from kestrel.storage.runtime import ManualRuntime
from tests.conftest import STALL_S, ServerProcess
from tests.end_to_end.test_refused_queue import _damage
from tests.support.queues import one

STATIC = resources.files("kestrel.service.dashboard").joinpath("static")


@pytest.fixture
def runtime() -> ManualRuntime:
    return ManualRuntime()


@pytest.fixture
def server(tmp_path: Path, runtime: ManualRuntime) -> Iterator[ServerState]:
    state = ServerState(ServerConfig(queue_path=str(tmp_path / "queues")), runtime=runtime)
    state.collection.load()
    yield state
    state.close()
    structlog.contextvars.clear_contextvars()


def overview(dashboard: Dashboard) -> dict[str, Any]:
    reply = dashboard.respond("/dashboard/overview.json", "", None)
    assert reply is not None and reply[0] == "200 OK"
    return dict(json.loads(reply[2]))


def rows(document: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {row[0]: dict(zip(document["columns"], row, strict=True)) for row in document["rows"]}


def test_rates_come_from_two_snapshots_and_a_snapshot_serves_every_page_for_a_second(
        server: ServerState, runtime: ManualRuntime) -> None:
    dashboard = Dashboard(server)
    coll = server.collection
    coll.put("jobs", [b"x"] * 10)
    first = overview(dashboard)
    assert first["rates"] is None and rows(first)["jobs"]["in"] is None  # one snapshot: no rate yet
    runtime.clock.advance(1000)
    coll.put("jobs", [b"x"] * 30)
    for _ in range(5):
        assert one(coll.remove("jobs")) is not None
    second = overview(dashboard)
    assert rows(second)["jobs"] | {"state": "serving", "items": 35, "in": 30.0, "out": 5.0} == rows(second)["jobs"]
    assert second["rates"] == {"in": 30.0, "out": 5.0}
    assert second["history"]["in"] == [None, 30.0] and second["history"]["items"] == [None, 35]
    # Within SNAPSHOT_S every page gets the same snapshot, however many ask.
    body = dashboard.figures.snapshot().body
    coll.put("jobs", [b"x"] * 7)
    runtime.clock.advance(int(SNAPSHOT_S * 1000) - 1)
    assert all(dashboard.figures.snapshot().body is body for _ in range(10))
    runtime.clock.advance(1)
    assert rows(overview(dashboard))["jobs"]["items"] == 42


def test_the_figures_are_those_of_stats_json(server: ServerState, runtime: ManualRuntime) -> None:
    from kestrel.service.stats_render import stats_json

    dashboard = Dashboard(server)
    server.collection.put("jobs", [b"abc"] * 4)
    runtime.clock.advance(2000)
    page = overview(dashboard)
    stats = json.loads(b"".join(stats_json(server)))
    assert {key: page[key] for key in stats if key != "queues"} == {k: v for k, v in stats.items() if k != "queues"}
    row = rows(page)["jobs"]
    queue = stats["queues"]["jobs"]
    assert (row["items"], row["bytes"], row["open_reads"], row["head_wait_ms"], row["poisoned"], row["format"]) == (
        queue["items"], queue["bytes"], queue["open_transactions"], 2000, queue["poisoned"], 2)
    reply = dashboard.respond("/dashboard/queue.json", "name=jobs", None)
    assert reply is not None and json.loads(reply[2])["stats"] == stats["queues"]["jobs"]


def test_a_costly_snapshot_serves_longer_to_keep_its_share_of_the_server(
        server: ServerState, runtime: ManualRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    from kestrel.service.dashboard import figures

    dashboard = Dashboard(server)
    server.collection.put("jobs", [b"x"])
    monkeypatch.setattr(figures, "SHARE", 1e-12)  # as if the server had queues beyond counting
    first = dashboard.figures.snapshot()
    assert first.fresh_for > 3600
    runtime.clock.advance(60_000)
    assert dashboard.figures.snapshot() is first


@pytest.mark.pure_build
def test_nothing_runs_and_no_queue_is_read_while_no_page_asks(
        server: ServerState, runtime: ManualRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    server.collection.put("jobs", [b"x"])
    reads = []
    queue = server.collection.get("jobs")
    assert queue is not None
    real = queue.stats
    monkeypatch.setattr(queue, "stats", lambda: reads.append(1) or real())
    timers = runtime.timers
    dashboard = Dashboard(server)
    runtime.clock.advance(60_000)
    assert runtime.timers == timers and reads == []  # no timer, no sampling
    overview(dashboard)
    assert runtime.timers == timers and len(reads) == 1


def test_a_queue_page_keeps_its_history_while_it_is_asked_for(server: ServerState, runtime: ManualRuntime) -> None:
    dashboard = Dashboard(server)
    server.collection.put("jobs", [b"x"])

    def history() -> dict[str, Any]:
        reply = dashboard.respond("/dashboard/queue.json", "name=jobs", None)
        assert reply is not None
        return dict(json.loads(reply[2])["history"])

    assert history()["items"] == []  # nothing kept before its page asked
    for _ in range(3):
        runtime.clock.advance(1000)
        server.collection.put("jobs", [b"x"] * 10)
        latest = history()
    assert latest["items"][-2:] == [21, 31] and latest["in"][-1] == 10.0


def test_the_charts_times_stay_in_order_and_apart_as_the_samples_were_through_a_wall_clock_step(
        server: ServerState, runtime: ManualRuntime) -> None:
    """The charts take an ascending time axis: each sample's time is told back from the latest
    snapshot's by the monotonic time since, so a step back of the wall clock (NTP, a VM resumed)
    shifts the history with it rather than sending the lines back an hour."""
    dashboard = Dashboard(server)
    server.collection.put("jobs", [b"x"])

    def histories() -> tuple[list[int], list[int], int]:
        reply = dashboard.respond("/dashboard/queue.json", "name=jobs", None)
        assert reply is not None
        document = overview(dashboard)
        return document["history"]["time"], json.loads(reply[2])["history"]["time"], document["time_ms"]

    for step in (0, 0, -3_600_000, 0, 7_200_000):
        runtime.clock.step(step)
        runtime.clock.advance(1000)
        times, queue_times, now = histories()
    assert [now - t for t in times] == [4000, 3000, 2000, 1000, 0]
    assert [now - t for t in queue_times] == [3000, 2000, 1000, 0]  # kept from its page's first ask
    assert now == runtime.clock.now_ms()


def test_the_state_of_a_queue() -> None:
    config = QueueConfig(max_memory_size=1000)
    plain = {"read_only": 0, "read_behind": 0, "memory_target": 1000}
    assert queue_state(plain, config, flow_control=False) == "serving"
    assert queue_state(plain | {"read_behind": 1}, config, False) == "read-behind"
    assert queue_state(plain | {"read_behind": 1, "memory_target": 200}, config, False) == "paged out"
    assert queue_state(plain, config, flow_control=True) == "flow-controlled"
    assert queue_state(plain | {"read_only": 1}, config, flow_control=True) == "read-only"


def test_a_queue_paged_out_by_the_memory_budget_and_one_in_read_behind(tmp_path: Path,
                                                                         runtime: ManualRuntime) -> None:
    config = ServerConfig(queue_path=str(tmp_path / "queues"), max_memory_total=1 << 20,
                          queues=QueueConfigs({}, {"small": {"max_memory_size": 2000}}))
    state = ServerState(config, runtime=runtime)
    state.collection.load()
    try:
        coll = state.collection
        coll.put("paged", [b"x" * 1000] * 50)
        coll.put("small", [b"x" * 1000] * 5)  # past its own max_memory_size
        paged = coll.queue("paged")
        paged.set_memory_target(4000)  # the governor's share for it, under its max_memory_size
        assert paged.shed() > 0
        page = overview(Dashboard(state))
        assert rows(page)["paged"]["state"] == "paged out" and rows(page)["small"]["state"] == "read-behind"
        assert page["server"]["max_memory_total"] == 1 << 20  # the budget, for the page's memory card
    finally:
        state.close()


def test_the_commit_log_shows_when_it_is_on(tmp_path: Path, runtime: ManualRuntime) -> None:
    state = ServerState(ServerConfig(queue_path=str(tmp_path / "queues"), commit_log=True), runtime=runtime)
    state.collection.load()
    try:
        log = overview(Dashboard(state))["commit_log"]
        assert log is not None and log["segments"] == 1 and log["checkpoints"] == 0
    finally:
        state.close()


def test_a_refused_queue_has_a_row_and_a_page_with_its_damage_and_remedy(tmp_path: Path, runtime: ManualRuntime) -> None:
    _damage(tmp_path / "queues")
    state = ServerState(ServerConfig(queue_path=str(tmp_path / "queues")), runtime=runtime)
    state.collection.load()
    try:
        dashboard = Dashboard(state)
        page = overview(dashboard)
        assert rows(page)["bad"]["state"] == "refused" and rows(page)["good"]["items"] == 2
        error = state.collection.refused["bad"]
        assert page["refused_queues"] == {"bad": str(error)} and page["refused_remedies"] == {"bad": error.remedy()}
        reply = dashboard.respond("/dashboard/queue.json", "name=bad", None)
        assert reply is not None
        document = json.loads(reply[2])
        assert document["refused"]["damage"] == str(error) and document["refused"]["remedy"] == error.remedy()
    finally:
        state.close()


def test_the_page_and_its_files_are_served_under_a_policy_that_keeps_it_to_its_origin(server: ServerState) -> None:
    dashboard = Dashboard(server)
    index = dashboard.respond("/", "", None)
    assert index is not None
    status, headers, body = index
    assert status == "200 OK" and dict(headers)["Content-Type"].startswith("text/html")
    assert "default-src 'none'" in POLICY and "script-src 'self'" in POLICY and "connect-src 'self'" in POLICY
    for path in re.findall(rb'(?:src|href)="([^"#]+)"', body):  # every file the page loads is served here
        if path == b"/stats.json":
            continue  # the link to the JSON for a browser without JavaScript
        reply = dashboard.respond(path.decode(), "", None)
        assert reply is not None and reply[0] == "200 OK", path
        assert path.startswith(b"/dashboard/")
    js = dashboard.respond("/dashboard/dashboard.js", "", None)
    assert js is not None
    etag = dict(js[1])["ETag"]
    again = dashboard.respond("/dashboard/dashboard.js", "", etag)
    assert again is not None and again[0] == "304 Not Modified" and again[2] == b"" and dict(again[1])["ETag"] == etag
    for outside in ("/dashboard/../pages.py", "/dashboard/pages.py", "/dashboard/uplot/LICENSE", "/index.html",
                    "/dashboard/uplot/README.md", "/dashboard/"):
        assert dashboard.respond(outside, "", None) is None, outside
    missing = dashboard.respond("/dashboard/queue.json", "name=nowhere", None)
    assert missing is not None and missing[0] == "404 Not Found"


def test_every_reply_of_the_admin_port_carries_the_policy_and_refuses_framing(server_factory: Any) -> None:
    """The page's, the figures' (a queue name holding `<script>` is in /stats.txt as it is), the
    probes', a 404's, a 405's and gevent's own 400: each with the policy, nosniff and no framing."""
    srv: ServerProcess = server_factory()
    with socket.create_connection(("127.0.0.1", srv.memcache_port), timeout=10) as mc:
        mc.sendall(b"set <script>x 0 0 1\r\nx\r\n")
        assert mc.recv(100) == b"STORED\r\n"
    requests = [f"GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n".encode()
                for path in ("/", "/dashboard/dashboard.js", "/dashboard/overview.json", "/stats.json",
                             "/stats.txt", "/metrics", "/metrics/per-queue", "/ping", "/ready", "/ready/read",
                             "/no-such-page", "/dashboard/queue.json?name=nowhere")]
    requests += [b"POST /ping HTTP/1.1\r\nHost: localhost\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
                 b"GARBAGE\r\n\r\n"]
    statuses = []
    for request in requests:
        with socket.create_connection(("127.0.0.1", srv.admin_port), timeout=10) as s:
            s.sendall(request)
            answer = b""
            while b"\r\n\r\n" not in answer and (chunk := s.recv(65536)):
                answer += chunk
        head = answer.split(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")
        statuses.append(head[0].split()[1])
        headers = [tuple(line.split(": ", 1)) for line in head[1:]]
        for header in HEADERS:
            assert headers.count(header) == 1, (request, header, headers)
    assert statuses == ["200"] * 10 + ["404", "404", "405", "400"]
    assert dict(HEADERS)["X-Frame-Options"] == "DENY" and "frame-ancestors 'none'" in POLICY


def test_the_page_names_no_other_origin() -> None:
    """No URL with a scheme or a host in the page's own files (the charting library's one comment,
    naming where it comes from, aside): it loads nothing from elsewhere, whatever the network."""
    files = load_static()
    assert set(files) == {"/", "/dashboard/dashboard.js", "/dashboard/dashboard.css", "/dashboard/favicon.svg",
                          "/dashboard/uplot/uPlot.iife.min.js", "/dashboard/uplot/uPlot.min.css"}
    for path, served in files.items():
        text = served.body.decode()
        if path.endswith("uPlot.iife.min.js"):
            text = text.replace("/*! https://github.com/leeoniya/uPlot (v1.6.32) */", "")
        if path.endswith(".svg"):
            text = text.replace('xmlns="http://www.w3.org/2000/svg"', "")  # a namespace, not a request
        assert not re.search(r"(https?:|wss?:)?//[a-z0-9.-]+\.[a-z]{2,}", text, re.IGNORECASE), path


def test_the_charting_library_is_the_version_recorded_beside_it() -> None:
    recorded = STATIC.joinpath("uplot", "README.md").read_text()
    version = re.search(r"\| version \| ([\d.]+) \|", recorded)
    assert version is not None
    banner = STATIC.joinpath("uplot", "uPlot.iife.min.js").read_text()[:100]
    assert f"(v{version.group(1)})" in banner
    assert "MIT" in recorded and "Permission is hereby granted" in STATIC.joinpath("uplot", "LICENSE").read_text()


def test_the_admin_port_serves_the_page_and_json_counting_connections_by_protocol(server_factory: Any) -> None:
    srv: ServerProcess = server_factory()
    admin = f"http://127.0.0.1:{srv.admin_port}"
    with urllib.request.urlopen(admin + "/") as reply:
        assert reply.headers["Content-Security-Policy"] == POLICY and b"dashboard.js" in reply.read()
    with socket.create_connection(("127.0.0.1", srv.memcache_port)) as mc, \
            socket.create_connection(("127.0.0.1", srv.text_port)) as text:
        for s, request in ((mc, b"version\r\n"), (text, b"status\n")):
            s.sendall(request)
            assert s.recv(100)  # each connection has its session now
        with urllib.request.urlopen(admin + "/stats.json") as reply:
            stats = json.loads(reply.read())
        with urllib.request.urlopen(admin + "/dashboard/overview.json") as reply:
            page = json.loads(reply.read())
    assert stats["connections"] == page["connections"] == {"memcache": 1, "text": 1}
    assert stats["status"] == page["status"] == stats["enforced_status"] == "Up"
    assert stats["server_sets"] is None and stats["commit_log"]["segments"] == 1  # the log is on by default
    request = urllib.request.Request(admin + "/dashboard/overview.json", method="POST", data=b"")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request)
    assert refused.value.code == 405 and refused.value.headers["Allow"] == "GET, HEAD"  # read-only


def test_a_queue_page_gives_its_settings_as_the_server_holds_them(server: ServerState) -> None:
    # Sizes in bytes, times in ms and None for none: the page words them (`dump_config` writes them
    # as the config file does, which a page cannot read back as numbers).
    dashboard = Dashboard(server)
    server.collection.put("jobs", [b"abc"])
    reply = dashboard.respond("/dashboard/queue.json", "name=jobs", None)
    assert reply is not None
    settings = {s["name"]: s["value"] for s in json.loads(reply[2])["settings"]}
    config = server.collection.config_for("jobs")
    assert settings["sync_journal"] == config.sync_journal and settings["max_age"] == config.max_age
    assert settings["error_queue"] is None and settings["max_memory_size"] == config.max_memory_size


def test_the_admin_port_closes_a_connection_that_sends_nothing_or_trickles_its_request(server_factory: Any) -> None:
    """Each request, from the wait for it to its answer, has `request_timeout`: a client that
    connects and says nothing, or sends half a request, holds no connection of the port for good.
    One that asks in time is answered, and its connection kept for the next request."""
    srv: ServerProcess = server_factory({"request_timeout": "2s"})  # ample for a loaded machine
    silent = socket.create_connection(("127.0.0.1", srv.admin_port))
    half = socket.create_connection(("127.0.0.1", srv.admin_port))
    prompt = socket.create_connection(("127.0.0.1", srv.admin_port))
    try:
        for sock in (silent, half, prompt):
            sock.settimeout(STALL_S)
        half.sendall(b"GET /ping HTTP/1.1\r\nHost: localhost\r\n")  # the blank line that ends it never comes
        for _ in range(2):
            prompt.sendall(b"GET /ping HTTP/1.1\r\nHost: localhost\r\n\r\n")
            answer = b""
            while not answer.endswith(b"pong\n") and (chunk := prompt.recv(1000)):
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200 OK") and answer.endswith(b"pong\n")
        assert silent.recv(100) == b"" and half.recv(100) == b""  # closed by the server
    finally:
        for sock in (silent, half, prompt):
            sock.close()
