"""The memcache, text and admin ports end to end, with real clients and exact bytes."""

from __future__ import annotations

import json
import re
import resource
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from pymemcache.client.base import Client

from tests.conftest import ServerProcess, wait_until
from tests.support.system import tool
from tests.support.wire import (
    close_sockets,  # noqa: F401  (autouse: closes the sockets before the servers stop)
    conn,
    exchange,
    memcache_stats,
    shared_server,  # noqa: F401  (the module's `server`)
)


@pytest.fixture
def mc(server: ServerProcess) -> Iterator[Client]:
    client = Client(("127.0.0.1", server.memcache_port), timeout=10, default_noreply=False)
    yield client
    client.close()


def test_pymemcache_set_get_delete_stats_version(server: ServerProcess, mc: Client) -> None:
    assert mc.set("jobs", b"one")
    assert mc.set("jobs", b"two")
    assert mc.get("jobs") == b"one"
    assert mc.get("jobs/open") == b"two"
    assert mc.get("jobs/close") is None
    assert mc.get("jobs") is None
    assert mc.set("gone", b"x")
    assert b"queue_gone_items" in mc.stats()
    assert mc.delete("gone")
    assert b"queue_gone_items" not in mc.stats()
    stats = mc.stats()
    assert stats[b"cmd_set"] >= 3 and stats[b"queue_jobs_items"] == 0
    assert mc.version()


def test_exact_reply_bytes(server: ServerProcess) -> None:
    s = conn(server.memcache_port)
    assert exchange(s, b"set work 0 0 5\r\nhello\r\n") == b"STORED\r\n"
    assert exchange(s, b"get work/t=500/open\r\n", b"END\r\n") == b"VALUE work/t=500/open 0 5\r\nhello\r\nEND\r\n"
    assert exchange(s, b"get work/close\r\n", b"END\r\n") == b"END\r\n"
    assert exchange(s, b"get work\r\n", b"END\r\n") == b"END\r\n"
    assert exchange(s, b"delete work\r\n") == b"DELETED\r\n"
    assert exchange(s, b"flush work\r\n") == b"END\r\n"
    assert exchange(s, b"flush_all\r\n") == b"Flushed all queues.\r\n"
    assert exchange(s, b"version\r\n").startswith(b"VERSION ")
    assert exchange(s, b"status\r\n") == b"UP\r\n"
    assert exchange(s, b"bogus\r\n").startswith(b"CLIENT_ERROR unknown command 'bogus' (closing")


@pytest.mark.parametrize("key, ok", [
    ("w/close/open", True), ("w/open/close", True), ("w/t=10/open", True), ("w/t=10/peek", True),
    ("w/abort", True), ("w/peek", True), ("w/close", True), ("w/t=10", True),
    ("w/peek/open", False), ("w/peek/close", False), ("w/abort/open", False), ("w/abort/close", False),
    ("w/open/open", False), ("w/t=x", False), ("w/wat", False), ("/open", False),
])
def test_option_grammar(server: ServerProcess, key: str, ok: bool) -> None:
    s = conn(server.memcache_port)
    reply = exchange(s, f"get {key}\r\n".encode(), b"\r\n")
    assert reply.endswith(b"END\r\n") if ok else reply.startswith(b"CLIENT_ERROR")


def test_second_open_is_refused_and_close_open_moves_on(server: ServerProcess) -> None:
    s = conn(server.memcache_port)
    exchange(s, b"set d 0 0 1\r\n1\r\nset d 0 0 1\r\n2\r\n", b"STORED\r\nSTORED\r\n")
    assert exchange(s, b"get d/open\r\n", b"END\r\n") == b"VALUE d/open 0 1\r\n1\r\nEND\r\n"
    assert exchange(s, b"get d/open\r\n").startswith(b"CLIENT_ERROR")
    assert exchange(s, b"get d/close/open\r\n", b"END\r\n") == b"VALUE d/close/open 0 1\r\n2\r\nEND\r\n"
    assert exchange(s, b"get d/abort\r\n", b"END\r\n") == b"END\r\n"
    assert exchange(s, b"get d\r\n", b"END\r\n") == b"VALUE d 0 1\r\n2\r\nEND\r\n"


def test_disconnect_with_an_open_read_puts_the_item_back(server: ServerProcess) -> None:
    s = conn(server.memcache_port)
    exchange(s, b"set r 0 0 4\r\nkeep\r\n")
    assert b"keep" in exchange(s, b"get r/open\r\n", b"END\r\n")
    s.close()
    wait_until(lambda: memcache_stats(server.memcache_port)["queue_r_open_transactions"] == "0", "the open read to be aborted")
    other = conn(server.memcache_port)
    assert exchange(other, b"get r\r\n", b"END\r\n") == b"VALUE r 0 4\r\nkeep\r\nEND\r\n"


@pytest.mark.parametrize("max_frame_size, behind", [(None, 200_000), ("128KB", 200_000)],
                         ids=["within the input kept", "past it, the rest in the socket"])
def test_a_client_that_hangs_up_waiting_behind_a_long_pipeline_takes_no_item(
        server_factory: Any, max_frame_size: str | None, behind: int) -> None:
    """The watch of a waiting get read one line's worth of the requests that follow, then read no
    more, and so never saw the client hang up: the next item went to the dead connection and was
    lost (a plain get's), its `waiters` stayed until the wait's end. Input is kept up to what one
    request may hold (`max_frame_size`), and past it the end of the stream is looked for."""
    srv = server_factory({} if max_frame_size is None else {"max_frame_size": max_frame_size})
    waiter = socket.create_connection(("127.0.0.1", srv.memcache_port), timeout=10)
    waiter.sendall(b"get gone/t=60000\r\n")
    wait_until(lambda: memcache_stats(srv.memcache_port).get("queue_gone_waiters") == "1", "the get to wait")
    waiter.sendall(b"version\r\n" * (behind // 9))
    waiter.close()
    wait_until(lambda: memcache_stats(srv.memcache_port).get("queue_gone_waiters") == "0",
               "the waiter to be withdrawn")
    live = conn(srv.memcache_port)
    assert exchange(live, b"set gone 0 0 4\r\nkept\r\nget gone\r\n", b"END\r\n") == \
        b"STORED\r\nVALUE gone 0 4\r\nkept\r\nEND\r\n"


def test_monitor_and_confirm(server: ServerProcess) -> None:
    s = conn(server.memcache_port)
    exchange(s, b"set m 0 0 1\r\na\r\nset m 0 0 1\r\nb\r\nset m 0 0 1\r\nc\r\n", b"STORED\r\n" * 3)
    reply = exchange(s, b"monitor m 1 2\r\n", b"END\r\n")
    assert reply == b"VALUE m 0 1\r\na\r\nVALUE m 0 1\r\nb\r\nEND\r\n"
    assert exchange(s, b"confirm m 3\r\n") == b"ERROR\r\n"  # more than are open: none (Kestrel's rule)
    assert exchange(s, b"confirm m 0\r\n") == b"ERROR\r\n"
    assert exchange(s, b"confirm m 2\r\n") == b"END\r\n"
    assert exchange(s, b"confirm m 1\r\n") == b"ERROR\r\n"
    assert exchange(s, b"get m\r\n", b"END\r\n") == b"VALUE m 0 1\r\nc\r\nEND\r\n"
    exchange(s, b"set m 0 0 1\r\nd\r\n", b"STORED\r\n")
    assert exchange(s, b"monitor m 1 1\r\n", b"END\r\n") == b"VALUE m 0 1\r\nd\r\nEND\r\n"
    assert exchange(s, b"confirm m 2\r\n") == b"ERROR\r\n"  # the one read stays open...
    s.close()
    again = conn(server.memcache_port)  # ...and comes back when the connection goes
    assert exchange(again, b"get m/t=2000\r\n", b"END\r\n") == b"VALUE m/t=2000 0 1\r\nd\r\nEND\r\n"


def test_monitors_of_one_queue_share_its_items(server: ServerProcess) -> None:
    """Waiters are served first come first: a monitor that took an item waits behind the other."""
    monitors = [conn(server.memcache_port) for _ in range(2)]
    for s in monitors:
        s.sendall(b"monitor shared 2 6\r\n")
    wait_until(lambda: memcache_stats(server.memcache_port).get("queue_shared_waiters") == "2", "both monitors to wait")
    producer = conn(server.memcache_port)
    for n in range(6):
        assert exchange(producer, b"set shared 0 0 1\r\n%d\r\n" % n) == b"STORED\r\n"
        time.sleep(0.1)
    taken = [exchange(s, b"", b"END\r\n").count(b"VALUE") for s in monitors]
    assert sum(taken) == 6 and min(taken) >= 2, taken  # in turn (before: the first took all six)


def test_pipelined_commands_are_answered_in_order(server: ServerProcess) -> None:
    s = conn(server.memcache_port)
    request = b"".join(b"set p 0 0 %d\r\n%d\r\n" % (len(str(i)), i) for i in range(50))
    request += b"get p\r\n" * 50
    expected = b"STORED\r\n" * 50 + b"".join(b"VALUE p 0 %d\r\n%d\r\nEND\r\n" % (len(str(i)), i) for i in range(50))
    assert exchange(s, request, expected[-20:]) == expected


def test_one_megabyte_item(server: ServerProcess, mc: Client) -> None:
    big = bytes(range(256)) * 4096
    assert mc.set("big", big)
    assert mc.get("big") == big


def test_wrong_byte_count_never_desynchronises(server: ServerProcess) -> None:
    s = conn(server.memcache_port)
    assert exchange(s, b"set w 0 0 3\r\nabcdef\r\n") == b"CLIENT_ERROR bad data chunk\r\n"
    assert exchange(s, b"set w 0 0 2\r\nok\r\n") == b"STORED\r\n"
    assert exchange(s, b"get w\r\n", b"END\r\n") == b"VALUE w 0 2\r\nok\r\nEND\r\n"


def test_a_set_whose_line_is_not_utf8_never_has_its_data_run_as_commands(server: ServerProcess,
                                                                          mc: Client) -> None:
    s = conn(server.memcache_port)
    assert exchange(s, b"set victim 0 0 9\r\nimportant\r\n") == b"STORED\r\n"
    for line in (b"set jobs\xff 0 0 13", b"set jobs\xc0\x80 0 0 13", b"add \xed\xa0\x80 0 0 13"):
        assert exchange(s, line + b"\r\ndelete victim\r\n").startswith(b"CLIENT_ERROR command line is not valid")
    pymemcache_error = None
    try:
        mc.set(b"jobs\xff", b"delete victim")
    except Exception as e:  # pymemcache refuses the reply's CLIENT_ERROR
        pymemcache_error = e
    assert pymemcache_error is not None
    assert exchange(s, b"get victim\r\n", b"END\r\n") == b"VALUE victim 0 9\r\nimportant\r\nEND\r\n"


def test_full_queue_and_oversized_item(server_factory: Any) -> None:
    srv = server_factory({"queues": {"tiny": {"max_items": 1, "max_item_size": "4"}}, "max_frame_size": "1KB"})
    s = conn(srv.memcache_port)
    assert exchange(s, b"set tiny 0 0 5\r\n12345\r\n") == b"NOT_STORED\r\n"
    assert exchange(s, b"set tiny 0 0 1\r\n1\r\n") == b"STORED\r\n"
    assert exchange(s, b"set tiny 0 0 1\r\n2\r\n") == b"NOT_STORED\r\n"
    reply = exchange(s, b"set other 0 0 2000\r\n" + b"x" * 2000 + b"\r\n")
    assert reply.startswith(b"SERVER_ERROR object too large")
    assert exchange(s, b"get tiny\r\n", b"END\r\n") == b"VALUE tiny 0 1\r\n1\r\nEND\r\n"
    # With noreply it answers nothing, as every refusal of a well-formed set: the client reads no reply.
    assert exchange(s, b"set other 0 0 2000 noreply\r\n" + b"x" * 2000 + b"\r\nversion\r\n").startswith(b"VERSION ")


def test_status_applies_to_memcache(server: ServerProcess) -> None:
    s = conn(server.memcache_port)
    assert exchange(s, b"status readonly\r\n") == b"END\r\n"
    assert exchange(s, b"set x 0 0 1\r\n1\r\n").startswith(b"SERVER_ERROR")
    assert exchange(s, b"get x\r\n", b"END\r\n") == b"END\r\n"
    assert exchange(s, b"status quiescent\r\n") == b"END\r\n"
    assert exchange(s, b"get x\r\n").startswith(b"SERVER_ERROR")
    assert exchange(s, b"status up\r\n") == b"END\r\n"
    assert exchange(s, b"status sideways\r\n").startswith(b"CLIENT_ERROR")


def test_stats_and_dump_stats_name_every_figure(server: ServerProcess) -> None:
    s = conn(server.memcache_port)
    exchange(s, b"set st 0 0 1\r\n1\r\n")
    stats = exchange(s, b"stats\r\n", b"END\r\n").decode()
    names = {line.split()[1] for line in stats.splitlines() if line.startswith("STAT ")}
    for name in ("uptime", "time", "version", "curr_items", "total_items", "bytes", "curr_connections",
                 "total_connections", "cmd_get", "cmd_set", "cmd_peek", "get_hits", "get_misses",
                 "bytes_read", "bytes_written", "queue_creates", "queue_deletes", "queue_expires"):
        assert name in names, name
    for stat in ("items", "bytes", "total_items", "logsize", "expired_items", "mem_items", "mem_bytes", "age",
                 "discarded", "waiters", "open_transactions", "transactions", "canceled_transactions",
                 "total_flushes", "age_msec", "create_time"):
        assert f"queue_st_{stat}" in names, stat
    dump = exchange(s, b"dump_stats\r\n", b"END\r\n").decode()
    assert "queue 'st' {" in dump and "  items=1" in dump
    # Kestrel's line ending on every line: its clients read lines up to END and wait forever otherwise
    assert dump.endswith("}\r\nEND\r\n") and "\n" not in dump.replace("\r\n", "")


def test_text_protocol(server: ServerProcess) -> None:
    s = conn(server.text_port)
    assert exchange(s, b"put tq:\none\ntwo\n\n", b"\n") == b"+2\n"
    assert exchange(s, b"get tq\n", b"\n") == b":one\n"
    assert exchange(s, b"peek tq\n", b"\n") == b":two\n"
    assert exchange(s, b"get tq\n", b"\n") == b":two\n"
    assert exchange(s, b"get tq\n", b"\n") == b"*\n"
    assert exchange(s, b"confirm tq 1\n", b"\n") == b"-Not that many transactions open.\n"
    assert exchange(s, b"flush tq\n", b"\n") == b"+0\n"
    assert exchange(s, b"dance\n", b"\n").startswith(b"-")
    exchange(s, b"put tq:\nlast\n\n", b"\n")
    assert exchange(s, b"get tq\n", b"\n") == b":last\n"
    s.close()  # the read was open: it comes back
    wait_until(lambda: memcache_stats(server.memcache_port)["queue_tq_open_transactions"] == "0", "the open read to be aborted")
    other = conn(server.text_port)
    assert exchange(other, b"get tq\n", b"\n") == b":last\n"


def test_admin_http(server: ServerProcess, mc: Client) -> None:
    mc.set("adm", b"x")
    base = f"http://127.0.0.1:{server.admin_port}"
    assert urllib.request.urlopen(f"{base}/ping").read() == b"pong\n"
    data = json.loads(urllib.request.urlopen(f"{base}/stats.json").read())
    assert data["queues"]["adm"]["items"] == 1 and data["server"]["cmd_set"] >= 1
    assert b"queue_adm_items: 1" in urllib.request.urlopen(f"{base}/stats.txt").read()
    per_queue = urllib.request.urlopen(f"{base}/metrics/per-queue").read().decode()
    assert 'kestrel_queue_items{queue="adm"} 1.0' in per_queue
    metrics = urllib.request.urlopen(f"{base}/metrics").read().decode()
    cmd_set = re.search(r"^kestrel_put_items_total (\S+)$", metrics, re.M)
    assert cmd_set is not None and float(cmd_set.group(1)) >= 1  # the module's server is shared


def test_libmemcached_tools_client(server: ServerProcess, mc: Client, tmp_path: Any) -> None:
    memcat = tool("memccat")
    mc.set("fromc", b"hello from pymemcache")
    done = subprocess.run([memcat, f"--servers=127.0.0.1:{server.memcache_port}", "fromc"],
                          capture_output=True, timeout=30)
    assert done.stdout.strip() == b"hello from pymemcache"


def test_ten_thousand_connections(server: ServerProcess, mc: Client) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 10_000
    if hard < want + 500:
        pytest.skip(f"the open-file hard limit is {hard}, below {want + 500}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    socks = []
    try:
        for _ in range(want):
            socks.append(socket.create_connection(("127.0.0.1", server.memcache_port), timeout=10))
        assert mc.set("many", b"x")
        last = socks[-1]
        assert exchange(last, b"get many\r\n", b"END\r\n") == b"VALUE many 0 1\r\nx\r\nEND\r\n"
        stats = mc.stats()
        assert stats[b"curr_connections"] >= want
    finally:
        for s in socks:
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_dump_config_writes_settings_as_the_config_file_does(server_factory: Any) -> None:
    srv = server_factory({"queues": {"fsynced": {"sync_journal": "always"}, "batched": {"sync_journal": "10ms"}}},
                         name="dump_config")
    with socket.create_connection(("127.0.0.1", srv.memcache_port), timeout=10) as s:
        s.sendall(b"set lazy 0 0 1\r\nx\r\nset fsynced 0 0 1\r\nx\r\nset batched 0 0 1\r\nx\r\ndump_config\r\n")
        reply = b""
        while not reply.endswith(b"END\r\n"):
            reply += s.recv(65536)
    blocks = dict(re.findall(r"queue '(\w+)' \{\r\n(.*?)\}", reply.decode(), re.S))
    settings = {name: dict(line.strip().split("=", 1) for line in body.splitlines()) for name, body in blocks.items()}
    assert settings["lazy"]["sync_journal"] == "never"
    assert settings["fsynced"]["sync_journal"] == "always"
    assert settings["batched"]["sync_journal"] == "10ms"
    assert settings["lazy"]["max_age"] == "null" and "None" not in reply.decode()
