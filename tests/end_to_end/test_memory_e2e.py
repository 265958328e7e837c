"""The memory budget on a real server: 100 queues of 400 KB each (40 MB of items) put as fast as one
client can under `max_memory_total: 8MB` are paged out, the server's RSS grows by at most the budget
and a fixed overhead, and every item comes back once and in order. RSS at full size is
bench/bench_memory.py's."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from thriftpy2.rpc import make_client
from thriftpy2.thrift import TApplicationException
from thriftpy2.transport import TFramedTransportFactory

from kestrel.contract import kestrel_thrift as kestrel  # noqa: E402
from tests.conftest import ServerProcess, wait_until
from tests.support.wire import close_sockets, conn, exchange, memcache_stats  # noqa: F401

QUEUES = 100
ITEMS = 400  # of 1 KB: 400 KB a queue
BATCH = 50
MB = 1024 * 1024
# What RSS may grow by beyond the budget over the load and the drain (docs/memory.md, Measured):
# the items' objects (about 100 bytes each beside their 1 KB of data), what the allocator keeps of
# freed items, request frames, journal and cursor buffers. Measured: 0.8 MB at most in six runs,
# idle and beside two busy processes on two cores; without the budget RSS grows by 43 MB.
OVERHEAD = 4 * MB


def status_kb(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} for {pid}")


def payload(queue: int, n: int) -> bytes:
    return b"%04d:%06d:" % (queue, n) + b"x" * 1012


def fill_and_drain(srv: ServerProcess) -> tuple[int, int, dict[str, Any]]:
    """(KB of RSS before the load, peak KB during it, /stats.json after it); checks every item."""
    assert srv.proc is not None
    c = make_client(kestrel.Kestrel, "127.0.0.1", srv.thrift_port, timeout=30_000,
                    trans_factory=TFramedTransportFactory())
    try:
        for q in range(QUEUES):  # every code path warm, every queue created: the fixed overhead
            c.put(f"q{q}", [payload(q, -1)], 0)
            assert [i.data for i in c.get(f"q{q}", 1, 0, 0)] == [payload(q, -1)]
        before = status_kb(srv.proc.pid, "VmRSS")
        peak = before
        for start in range(0, ITEMS, BATCH):
            for q in range(QUEUES):
                assert c.put(f"q{q}", [payload(q, n) for n in range(start, start + BATCH)], 0) == BATCH
            peak = max(peak, status_kb(srv.proc.pid, "VmRSS"))
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.admin_port}/stats.json", timeout=10) as r:
            stats = json.loads(r.read())
        for q in range(QUEUES):
            got: list[bytes] = []
            while batch := c.get(f"q{q}", 100, 0, 0):
                got.extend(i.data for i in batch)
            assert got == [payload(q, n) for n in range(ITEMS)], f"q{q}"
        return before, max(peak, status_kb(srv.proc.pid, "VmHWM")), stats
    finally:
        c.close()


@pytest.mark.xdist_group("memory_e2e")
def test_a_budget_pages_queues_out_and_every_item_comes_back_in_order(server_factory: Any) -> None:
    srv = server_factory({"max_memory_total": "8MB", "default_queue": {"max_memory_size": "4MB"}})
    before, peak, stats = fill_and_drain(srv)
    assert (peak - before) * 1024 <= 8 * MB + OVERHEAD, f"RSS grew by {(peak - before) // 1024} MB"
    server = stats["server"]
    assert server["max_memory_total"] == 8 * MB and server["memory_total"] <= 8 * MB
    assert server["flow_control"] == 0
    paged = [s for s in stats["queues"].values() if s["paged_out"] > 0]
    assert len(paged) > QUEUES // 2
    assert all(s["memory_target"] <= 4 * MB and s["mem_bytes"] <= s["bytes"] for s in stats["queues"].values())


@pytest.mark.xdist_group("memory_e2e")
def test_without_a_budget_rss_grows_with_the_queues(server_factory: Any) -> None:
    srv = server_factory({"max_memory_total": "0", "default_queue": {"max_memory_size": "4MB"}})
    before, peak, stats = fill_and_drain(srv)
    assert (peak - before) * 1024 > 30 * MB  # 40 MB of items held: the bound above is not vacuous
    assert "max_memory_total" not in stats["server"]


def test_stats_name_the_budget_in_every_format(server_factory: Any, tmp_path: Path) -> None:
    srv = server_factory({"max_memory_total": "8MB"})
    c = make_client(kestrel.Kestrel, "127.0.0.1", srv.thrift_port, timeout=10_000,
                    trans_factory=TFramedTransportFactory())
    try:
        c.put("jobs", [b"x" * 100], 0)
    finally:
        c.close()
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.admin_port}/metrics", timeout=10) as r:
        metrics = r.read().decode()
    assert "kestrel_memory_budget_bytes 8.388608e+06" in metrics
    assert "kestrel_flow_control_seconds_total" in metrics
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.admin_port}/metrics/per-queue", timeout=10) as r:
        metrics = r.read().decode()
    assert 'kestrel_queue_memory_target_bytes{queue="jobs"}' in metrics
    assert 'kestrel_queue_paged_out_bytes{queue="jobs"} 0.0' in metrics


def test_flow_control_refuses_puts_on_every_protocol_and_serves_reads(server_factory: Any) -> None:
    srv = server_factory({"max_memory_total": "1MB"})
    c = make_client(kestrel.Kestrel, "127.0.0.1", srv.thrift_port, timeout=10_000,
                    trans_factory=TFramedTransportFactory())
    try:
        c.put("held", [b"h" * 15_000] * 100, 0)
        opened: list[Any] = []  # 1.5 MB of open reads: nothing to page out
        while len(opened) < 100:  # (a get's items stop once their bytes reach 512 KB)
            opened += c.get("held", 100 - len(opened), 0, 60_000)
        assert len(opened) == 100
        wait_until(lambda: memcache_stats(srv.memcache_port).get("flow_control") == "1", "flow control to start")
        with conn(srv.memcache_port) as s:
            reply = exchange(s, b"set jobs 0 0 3\r\nabc\r\n")
            assert reply.startswith(b"SERVER_ERROR") and b"max_memory_total" in reply, reply
            assert exchange(s, b"get held\r\n", b"END\r\n") == b"END\r\n"  # gets answer at once
        with conn(srv.text_port) as s:
            reply = exchange(s, b"put jobs:\nabc\n\n", b"\n")
            assert reply.startswith(b"-") and b"max_memory_total" in reply, reply
        with pytest.raises(TApplicationException, match="max_memory_total"):
            c.put("jobs", [b"abc"], 0)
        assert c.confirm("held", {i.id for i in opened}) == 100  # confirms go on
        wait_until(lambda: memcache_stats(srv.memcache_port).get("flow_control") == "0", "flow control to end")
        assert c.put("jobs", [b"abc"], 0) == 1
        assert int(memcache_stats(srv.memcache_port)["flow_control_ms"]) > 0
    finally:
        c.close()
    log = srv.log()
    assert "memory over budget that paging cannot release" in log and "memory back under budget" in log


@pytest.mark.xdist_group("memory_e2e")
@pytest.mark.parametrize("journal_format", ["kestrel2", "kestrel3"])
def test_big_items_past_the_budget_page_out_and_puts_go_on(server_factory: Any, journal_format: str) -> None:
    """An item of nearly max_memory_size in each of four queues, a second into two of them, over
    memcache: the server paged down to the heads, at 95% of the budget, and refused every put since."""
    from pymemcache.client.base import Client

    srv = server_factory({"max_memory_total": "16MB",
                          "default_queue": {"max_memory_size": "4MB", "journal_format": journal_format}})
    big = [b"%d" % n + b"m" * (3_900_000 - 1) for n in range(2)]
    client = Client(("127.0.0.1", srv.memcache_port), timeout=30)
    try:
        for q in range(4):
            assert client.set(f"q{q}", big[0], noreply=False)
        for q in range(2):
            assert client.set(f"q{q}", big[1], noreply=False)
        time.sleep(1)  # ticks of the governor
        assert memcache_stats(srv.memcache_port)["flow_control"] == "0"
        assert client.set("q3", big[1], noreply=False)  # puts go on
        for q in range(4):
            assert [client.get(f"q{q}"), client.get(f"q{q}")] == [big[0], big[1] if q != 2 else None]
    finally:
        client.close()


RESTART_QUEUES = 8
RESTART_ITEMS = 512  # of 16 KB: 8 MB a queue, 64 MB of backlog against a budget of 8 MB


def restart_payload(queue: int, n: int) -> bytes:
    return b"%04d:%06d:" % (queue, n) + b"r" * (16 * 1024 - 12)


@pytest.mark.xdist_group("memory_e2e")
@pytest.mark.parametrize("journal_format", ["kestrel2", "kestrel3"])
def test_a_restart_replays_its_backlog_in_the_memory_it_ran_in(server_factory: Any, journal_format: str) -> None:
    """The budget holds while the journals replay: the restarted server's peak RSS is no more than
    what it ran in (the whole backlog used to be read into memory: 64 MB over an 8 MB budget)."""
    srv = server_factory({"max_memory_total": "8MB", "default_queue": {"journal_format": journal_format}})
    assert srv.proc is not None
    c = make_client(kestrel.Kestrel, "127.0.0.1", srv.thrift_port, timeout=30_000,
                    trans_factory=TFramedTransportFactory())
    try:
        for start in range(0, RESTART_ITEMS, 32):
            for q in range(RESTART_QUEUES):
                items = [restart_payload(q, n) for n in range(start, start + 32)]
                assert c.put(f"backlog{q}", items, 0) == 32
    finally:
        c.close()
    ran_in = status_kb(srv.proc.pid, "VmHWM")
    srv.restart()
    started_in = status_kb(srv.proc.pid, "VmHWM")
    assert started_in <= ran_in + 4 * 1024, f"RSS peaked at {started_in // 1024} MB at start-up, " \
                                            f"{ran_in // 1024} MB while it ran"
    # Each replay may pass its share by the item that filled it; the governor's first tick pages that out.
    wait_until(lambda: int(memcache_stats(srv.memcache_port)["memory_total"]) <= 8 * MB, "memory under the budget")
    c = make_client(kestrel.Kestrel, "127.0.0.1", srv.thrift_port, timeout=30_000,
                    trans_factory=TFramedTransportFactory())
    try:
        for q in range(RESTART_QUEUES):
            got: list[bytes] = []
            while batch := c.get(f"backlog{q}", 64, 0, 0):
                got.extend(i.data for i in batch)
            assert got == [restart_payload(q, n) for n in range(RESTART_ITEMS)], f"backlog{q}"
    finally:
        c.close()
