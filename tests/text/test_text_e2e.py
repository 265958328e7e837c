"""The text port end to end: Kestrel's commands and replies, bounded put blocks, vanishing clients."""

from __future__ import annotations

import threading
import time
from typing import Any

from tests.conftest import STALL_S, ServerProcess, wait_until
from tests.support.wire import (
    close_sockets,  # noqa: F401  (autouse: closes the sockets before the servers stop)
    closed_by_server,
    conn,
    exchange,
    memcache_stats,
    shared_server,  # noqa: F401  (the module's `server`)
)


def text(port: int, request: bytes) -> bytes:
    with conn(port) as s:
        return exchange(s, request, b"\n")


def test_refused_put_block_is_never_run_as_commands(server: ServerProcess) -> None:
    assert text(server.text_port, b"put victim:\nprecious\n\n") == b"+1\n"
    s = conn(server.text_port)
    reply = exchange(s, b"put my queue:\nflush victim\nshutdown\n\nversion\n", b"py0.1.0\n")
    assert reply == b"-Error parsing expiration time.\n:2.4.1-py0.1.0\n"
    assert server.proc is not None and server.proc.poll() is None
    assert text(server.text_port, b"peek victim\n") == b":precious\n"


def test_put_without_its_colon_is_refused_with_its_block(server: ServerProcess) -> None:
    s = conn(server.text_port)
    reply = exchange(s, b"put nocolon\nshutdown\n\nget nocolon\n", b"*\n")
    assert reply == b"-usage: put <queue> [expiry-ms]: then one item per line, then an empty line\n*\n"


def test_put_block_is_bounded_by_batch_limits(server_factory: Any) -> None:
    srv = server_factory({"max_batch_items": 10, "max_batch_bytes": "100"})
    port = srv.text_port
    assert text(port, b"put q:\n" + b"x\n" * 10 + b"\n") == b"+10\n"
    s = conn(port)
    assert exchange(s, b"put q:\n" + b"y\n" * 11 + b"\n", b"\n") == b"-put of more than max_batch_items (10) items\n"
    assert exchange(s, b"put q:\n" + b"z" * 101 + b"\n\n", b"\n") == b"-put of more than max_batch_bytes (100) bytes\n"
    assert exchange(s, b"put q:\nlast\n\n", b"\n") == b"+1\n"
    assert memcache_stats(srv.memcache_port)["queue_q_items"] == "11"


def test_large_put_does_not_hold_up_other_clients(server_factory: Any) -> None:
    server = server_factory({"max_batch_items": 1_000_000})
    items = 400_000
    block = b"put big:\n" + b"ab\n" * items + b"\n"
    other = conn(server.text_port)
    assert exchange(other, b"version\n", b"\n").startswith(b":")
    delays: list[float] = []
    done = threading.Event()

    def probe() -> None:
        while not done.is_set():
            start = time.monotonic()
            assert exchange(other, b"version\n", b"\n").startswith(b":")
            delays.append(time.monotonic() - start)

    prober = threading.Thread(target=probe)
    prober.start()
    try:
        putter = conn(server.text_port)
        putter.settimeout(60)  # the reply comes once all 400,000 items are in
        start = time.monotonic()
        reply = exchange(putter, block, b"\n", wait=60)
        took = time.monotonic() - start
    finally:
        done.set()
        prober.join()
    assert reply == b"+%d\n" % items
    assert len(delays) > 5, f"the other client was answered {len(delays)} times in {took:.2f}s"
    # A server that held the others up would keep them waiting about as long as the put takes; on a
    # loaded machine the put and every wait stretch together, so the bound grows with the put.
    # A server that read the block without letting others in would keep the other client waiting about
    # as long as the put takes; one that lets them in keeps it waiting for the last step (adding the
    # items, a tenth of the put on an idle machine). A loaded machine stretches both alike, so the
    # bound is a share of the put, not a time. How long the other client waits is
    # bench/bench_responsiveness.py's figure.
    assert max(delays) < took / 2, f"the other client waited up to {max(delays):.3f}s during a {took:.2f}s put"


def test_put_expiry_in_milliseconds(server_factory: Any) -> None:
    srv = server_factory({"expiration_timer_frequency": 0})
    port = srv.text_port
    assert text(port, b"put e -1:\ngone\n\n") == b"+1\n"
    assert text(port, b"put e 60000:\nkept\n\n") == b"+1\n"
    assert text(port, b"put e 0:\nforever\n\n") == b"+1\n"
    s = conn(port)
    assert exchange(s, b"get e\n", b"\n") == b":kept\n"
    assert exchange(s, b"get e\n", b"\n") == b":forever\n"


def test_kestrel_commands_and_replies(server: ServerProcess) -> None:
    s = conn(server.text_port)
    assert exchange(s, b"version\n", b"\n") == b":2.4.1-py0.1.0\n"
    assert exchange(s, b"status\n", b"\n") == b":UP\n"
    assert exchange(s, b"status readonly\n", b"\n") == b"+0\n"
    assert exchange(s, b"put q:\nx\n\n", b"\n").startswith(b"-put refused: server is ReadOnly")
    assert exchange(s, b"status up\n", b"\n") == b"+0\n"
    assert exchange(s, b"status sideways\n", b"\n").startswith(b"-unknown status 'sideways'")
    assert exchange(s, b"confirm q 1\n", b"\n") == b"-Not that many transactions open.\n"
    assert exchange(s, b"put q:\na\nb\n\n", b"\n") == b"+2\n"
    assert exchange(s, b"delete q\n", b"\n") == b"+0\n"
    assert not (server.queue_path / "q").exists()
    assert exchange(s, b"get q\n", b"\n") == b"*\n"
    assert exchange(s, b"dance\n", b"\n") == b"-Unknown command: dance\n"
    assert exchange(s, b"\n", b"\n") == b"-Unknown command: \n"  # every line answered, a blank one too
    assert exchange(s, b"flush ghost\n", b"\n") == b"+0\n"
    assert not (server.queue_path / "ghost").exists()


def test_extra_words_are_ignored_and_numbers_may_be_negative_as_in_kestrel(server: ServerProcess) -> None:
    s = conn(server.text_port)
    assert exchange(s, b"put q 0 extra:\na\nb\nc\n\n", b"\n") == b"+3\n"
    assert exchange(s, b"get q -5\n", b"\n") == b":a\n"  # a deadline already past: no wait
    assert exchange(s, b"get q 0 extra\n", b"\n") == b":b\n"
    assert exchange(s, b"confirm q -1\n", b"\n") == b"-Not that many transactions open.\n"
    assert exchange(s, b"confirm q 1 extra\n", b"\n") == b"+1\n"
    assert exchange(s, b"peek q -1 extra\n", b"\n") == b":c\n"
    assert exchange(s, b"monitor q -100 5 extra\n", b"*\n") == b"*\n"  # its time is up at once
    assert exchange(s, b"status up now\n", b"\n") == b"+0\n"
    assert exchange(s, b"version please\n", b"\n") == b":2.4.1-py0.1.0\n"
    assert exchange(s, b"flush q extra\n", b"\n") == b"+0\n"
    assert exchange(s, b"peek q\n", b"\n") == b"*\n"
    assert exchange(s, b"delete q extra\n", b"\n") == b"+0\n"
    assert not (server.queue_path / "q").exists()


def test_status_not_configured(server_factory: Any) -> None:
    srv = server_factory({"status_file": None})
    assert text(srv.text_port, b"status\n") == b"-Server status not configured.\n"


def test_get_confirms_the_previous_read_on_that_queue_only(server: ServerProcess) -> None:
    port = server.text_port
    text(port, b"put a:\na1\na2\n\n")
    text(port, b"put b:\nb1\n\n")
    s = conn(port)
    assert exchange(s, b"get a\n", b"\n") == b":a1\n"
    assert exchange(s, b"get b\n", b"\n") == b":b1\n"
    assert exchange(s, b"get a\n", b"\n") == b":a2\n"  # confirms a1; b1 stays open
    assert exchange(s, b"confirm a 2\n", b"\n") == b"-Not that many transactions open.\n"  # 1 is
    assert exchange(s, b"confirm a 0\n", b"\n") == b"-Not that many transactions open.\n"  # (Kestrel's)
    assert exchange(s, b"confirm b 1\n", b"\n") == b"+1\n"
    s.close()  # a2 was open: it comes back
    wait_until(lambda: text(port, b"peek a\n") == b":a2\n", "the open read to come back", timeout=STALL_S)


def test_monitor_takes_milliseconds(server_factory: Any) -> None:
    srv = server_factory({"max_open_reads": 2})
    port = srv.text_port
    text(port, b"put m:\n1\n2\n3\n\n")
    s = conn(port)
    start = time.monotonic()
    assert exchange(s, b"monitor m 200\n", b"*\n") == b":1\n:2\n*\n"  # stops at max_open_reads
    assert exchange(s, b"monitor m 50 1\n", b"*\n") == b":3\n*\n"  # the first monitor's reads confirmed
    assert exchange(s, b"monitor m 100\n", b"*\n") == b"*\n"
    assert 0.09 < time.monotonic() - start < STALL_S


def test_hang_up_during_a_wait_withdraws_the_waiter(server: ServerProcess) -> None:
    waiter = conn(server.text_port)
    waiter.sendall(b"get t 60000\n")
    wait_until(lambda: memcache_stats(server.memcache_port).get("queue_t_waiters") == "1", "the get to wait")
    waiter.close()
    # At once, not at the end of its minute: within STALL_S (how soon is bench/bench_responsiveness.py's).
    wait_until(lambda: memcache_stats(server.memcache_port).get("queue_t_waiters") == "0", "the waiter to be withdrawn",
               timeout=STALL_S)
    assert text(server.text_port, b"put t:\nalive\n\n") == b"+1\n"
    assert text(server.text_port, b"get t\n") == b":alive\n"


def test_slow_put_block_is_closed_and_not_stored(server_factory: Any) -> None:
    srv = server_factory({"request_timeout": "100ms"})
    s = conn(srv.text_port)
    s.sendall(b"put slow:\none\n")
    assert closed_by_server(s)
    assert text(srv.text_port, b"peek slow\n") == b"*\n"


def test_a_read_of_a_deleted_queue_closes_nothing_of_the_queue_created_under_its_name(
        server: ServerProcess) -> None:
    port = server.text_port
    assert text(port, b"put renewed:\nold\n\n") == b"+1\n"
    stale = conn(port)
    assert exchange(stale, b"get renewed\n", b"\n") == b":old\n"
    assert text(port, b"delete renewed\n") == b"+0\n"
    assert text(port, b"put renewed:\nnew\n\n") == b"+1\n"
    holder = conn(port)
    assert exchange(holder, b"get renewed\n", b"\n") == b":new\n"
    assert exchange(stale, b"confirm renewed 1\n", b"\n") == b"-Not that many transactions open.\n"
    stale.close()  # a disconnect aborts nothing of the new queue either
    assert text(port, b"get renewed\n") == b"*\n"  # `new` is still the holder's
    holder.close()
    wait_until(lambda: text(port, b"peek renewed\n") == b":new\n", "the holder's read to come back")
