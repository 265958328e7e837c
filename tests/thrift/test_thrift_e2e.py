"""The Thrift service end to end: `kestrel serve` as a subprocess, thriftpy2 clients over real sockets."""

from __future__ import annotations

import socket
import struct
import time
from typing import Any

import pytest
import thriftpy2
from thriftpy2.rpc import make_client
from thriftpy2.thrift import TApplicationException
from thriftpy2.transport import TFramedTransportFactory, TTransportException

from kestrel.contract import kestrel_thrift as kestrel  # noqa: E402
from kestrel.service.session.session import GET_BYTES, GET_SLICE
from tests.conftest import STALL_S, ServerProcess, wait_until
from tests.support.clients import thrift
from tests.support.wire import memcache_stats, shared_server  # noqa: F401  (the module's `server`)

# The module's `server`: queue settings its tests need, each queue one test's.
SHARED_SERVER_CONFIG = {"queues": {"small": {"max_items": 2}}}


client = thrift


def test_put_get_peek_and_version(server: ServerProcess) -> None:
    with client(server) as c:
        assert c.put("work", [b"one", b"two", b"three"], 0) == 3
        info = c.peek("work")
        assert (info.head_item, info.items, info.bytes) == (b"one", 3, 11)
        assert info.journal_bytes > 0
        got = c.get("work", 2, 0, 0)
        assert [(i.data, i.id) for i in got] == [(b"one", 0), (b"two", 0)]
        assert [i.data for i in c.get("work", 10, 0, 0)] == [b"three"]
        assert c.get("work", 10, 0, 0) == []
        assert c.get_version()


def test_get_waits_for_max_items_or_the_timeout(server: ServerProcess) -> None:
    with client(server) as c:
        started = time.monotonic()
        assert c.get("slow", 1, 300, 0) == []
        assert 0.25 <= time.monotonic() - started < STALL_S
        c.put("slow", [b"a"], 0)
        started = time.monotonic()
        got = c.get("slow", 3, 300, 0)
        assert [i.data for i in got] == [b"a"] and time.monotonic() - started >= 0.25


def test_waiting_get_is_woken_by_a_put_from_another_connection(server: ServerProcess) -> None:
    import threading

    result: list[Any] = []
    with client(server) as waiter, client(server) as producer:
        t = threading.Thread(target=lambda: result.extend(waiter.get("wake", 1, 5000, 0)))
        t.start()
        wait_until(lambda: producer.peek("wake").waiters == 1, "the get to wait")
        producer.put("wake", [b"hello"], 0)
        t.join(5)
    assert [i.data for i in result] == [b"hello"]


def test_auto_abort_returns_the_item_to_the_head(server: ServerProcess) -> None:
    with client(server) as c:
        c.put("jobs", [b"first", b"second"], 0)
        started = time.monotonic()
        opened = c.get("jobs", 1, 0, 200)
        assert opened[0].data == b"first" and opened[0].id != 0
        assert c.peek("jobs").open_transactions == 1
        wait_until(lambda: c.peek("jobs").open_transactions == 0, "the auto-abort")
        assert time.monotonic() - started >= 0.2
        info = c.peek("jobs")
        assert info.head_item == b"first" and info.open_transactions == 0
        assert c.confirm("jobs", {opened[0].id}) == 0  # too late: it was aborted


def test_auto_abort_of_a_batch_returns_its_items_in_read_order_once(server: ServerProcess) -> None:
    with client(server) as c:
        c.put("batch", [b"%d" % i for i in range(50)], 0)
        first = c.get("batch", 20, 0, 150)
        kept = c.get("batch", 10, 0, 60_000)  # a later deadline: still open after the first batch
        assert c.confirm("batch", {first[0].id}) == 1  # confirmed in time: never comes back
        wait_until(lambda: c.peek("batch").open_transactions == 10, "the first batch's auto-abort")
        info = c.peek("batch")
        assert info.open_transactions == 10 and info.items == 49 - 10
        again = c.get("batch", 50, 0, 0)
        assert [i.data for i in again] == [b"%d" % i for i in [*range(1, 20), *range(30, 50)]]
        assert c.confirm("batch", {i.id for i in first}) == 0  # aborted reads are closed
        assert c.confirm("batch", {i.id for i in kept}) == 10


def test_confirm_and_abort_count_what_they_closed(server: ServerProcess) -> None:
    with client(server) as c:
        c.put("q", [b"a", b"b", b"c"], 0)
        got = c.get("q", 3, 0, 60_000)
        ids = [i.id for i in got]
        assert len(set(ids)) == 3 and 0 not in ids
        assert c.confirm("q", {ids[0], 999_999}) == 1
        assert c.abort("q", {ids[1], ids[2]}) == 2
        assert [i.data for i in c.get("q", 5, 0, 0)] == [b"b", b"c"]


def test_confirm_from_a_second_connection_after_the_first_closed(server: ServerProcess) -> None:
    before = int(memcache_stats(server.memcache_port)["curr_connections"])
    with client(server) as first:
        first.put("handoff", [b"x"], 0)
        item = first.get("handoff", 1, 0, 60_000)[0]
    wait_until(lambda: int(memcache_stats(server.memcache_port)["curr_connections"]) == before,
               "the server to close the first connection's session")
    with client(server) as second:
        assert second.peek("handoff").open_transactions == 1  # not aborted by the disconnect
        assert second.confirm("handoff", {item.id}) == 1
        assert second.peek("handoff").items == 0


def test_max_open_reads_per_connection(server_factory: Any) -> None:
    srv = server_factory({"max_open_reads": 3})
    with client(srv) as c, client(srv) as other:
        c.put("cap", [b"%d" % i for i in range(10)], 0)
        got = c.get("cap", 5, 0, 60_000)
        assert len(got) == 3
        assert c.get("cap", 1, 0, 60_000) == []
        assert len(other.get("cap", 2, 0, 60_000)) == 2  # the cap is per connection
        c.confirm("cap", {got[0].id})
        assert len(c.get("cap", 5, 0, 60_000)) == 1


def test_get_timed_is_not_capped_per_connection(server_factory: Any) -> None:
    """Kestrel's `get` keeps its cap; `get_timed`, whose reads outlive their connection, takes what
    it asks for (up to `max_batch_items`) whatever the connection holds."""
    srv = server_factory({"max_open_reads": 3, "max_batch_items": 8})
    with client(srv) as c:
        for first in (0, 8, 16):
            c.put("cap", [b"%d" % i for i in range(first, min(first + 8, 20))], 0)
        assert len(c.get("cap", 5, 0, 60_000)) == 3
        got = c.get_timed("cap", 10, 0, 60_000)
        assert [i.data for i in got] == [b"%d" % i for i in range(3, 11)]  # max_batch_items: 8
        assert len(c.get_timed("cap", 10, 0, 60_000)) == 8
        assert len(c.get_timed("cap", 10, 0, 60_000)) == 1
        assert c.get("cap", 1, 0, 60_000) == []  # the connection is past Kestrel's cap
        assert c.peek("cap").open_transactions == 20


def test_expiration_is_relative(server: ServerProcess) -> None:
    with client(server) as c:
        started = time.monotonic()
        c.put("exp", [b"short"], 100)
        c.put("exp", [b"long"], 60_000)
        wait_until(lambda: c.peek("exp").head_item == b"long", "the short item to expire")
        # Expiry times are whole milliseconds (as Kestrel's): a put received 0.3 ms into a millisecond
        # expires 99.7 ms later.
        assert time.monotonic() - started >= 0.099
        assert [i.data for i in c.get("exp", 5, 0, 0)] == [b"long"]


def test_flush_delete_and_flush_all(server_factory: Any) -> None:
    server = server_factory()  # its own: flush_all reaches every queue
    with client(server) as c:
        c.put("a", [b"1", b"2"], 0)
        c.put("b", [b"3"], 0)
        c.flush_queue("a")
        assert c.peek("a").items == 0
        c.put("a", [b"4"], 0)
        c.flush_all_queues()
        assert c.peek("a").items == 0 and c.peek("b").items == 0
        c.delete_queue("b")
    assert not (server.queue_path / "b").exists()


def test_queue_names_and_get_timed_create_no_queue(server_factory: Any) -> None:
    server = server_factory()  # its own: the test asserts the whole queue list
    with client(server) as c:
        c.put("held", [b"x"], 0)
        assert c.queue_names() == ["held"]
        assert c.get_timed("missing", 5, 0, 0) == []
        assert c.get_timed("missing", 5, 50, 30_000) == []
        assert c.queue_names() == ["held"]
    assert not (server.queue_path / "missing").exists()


def counters(server: ServerProcess) -> dict[str, str]:
    """The stats a read would move: the server's request counts and every figure of queue `jobs` but
    those time moves (how long the head has waited)."""
    stats = memcache_stats(server.memcache_port)
    return {k: v for k, v in stats.items()
            if k.startswith(("queue_jobs_", "cmd_", "get_")) and not k.endswith("_wait_ms")}


def test_peek_items_shows_items_in_place_and_counts_nothing(server_factory: Any) -> None:
    server = server_factory({"queues": {"jobs": {"max_errors": 1, "error_queue": "failed"}}})
    with client(server) as c:
        c.put("jobs", [b"%d" % i for i in range(5)], 0)
        before = counters(server)
        for _ in range(3):  # each look past max_errors: none is a failed delivery
            looked = c.peek_items("jobs", 0, 3)
        assert [i.data for i in looked.shown] == [b"0", b"1", b"2"] and all(i.id == 0 for i in looked.shown)
        assert (looked.head, looked.items, looked.after) == (0, 5, 3) and looked.opened_at > 0
        assert looked.shown[0].add_time_msec >= looked.opened_at and looked.shown[0].expiry_msec is None
        assert [i.data for i in c.peek_items("jobs", looked.after, 10).shown] == [b"3", b"4"]
        assert counters(server) == before
        assert c.queue_names() == ["jobs"]  # the error queue was never needed
        assert c.peek_items("missing", 0, 5) == kestrel.ItemsAt(0, 0, 0, 0, [])
        assert c.queue_names() == ["jobs"]
    assert not (server.queue_path / "missing").exists()


def test_peek_items_of_large_items_shows_those_within_a_gets_bytes(server: ServerProcess) -> None:
    """A look is bounded by its items' bytes as a get is (`GET_BYTES`), whatever `max_items` asks:
    looks from `after` on show the rest, in order, and an item over the bound is shown alone."""
    size = 256 * 1024
    items = [b"%02d" % i + bytes([65 + i]) * (size - 2) for i in range(20)] + [b"x" * (2 * GET_BYTES)]
    with client(server) as c:
        assert c.put("large_looks", items, 0) == len(items)
        seen: list[bytes] = []
        position = 0
        while position < len(items):
            looked = c.peek_items("large_looks", position, len(items))
            shown = [i.data for i in looked.shown]
            sizes = [len(data) for data in shown]
            assert sizes and sum(sizes[:-1]) < GET_BYTES, sizes
            assert looked.after == position + len(shown)
            seen += shown
            position = looked.after
        assert seen == items
        assert c.peek("large_looks").items == len(items)  # nothing taken


def test_a_look_shows_at_most_a_gets_slice_of_items_and_goes_on_from_after(server: ServerProcess) -> None:
    """A look is one step of the loop: however many small items it asks for, it shows a slice's."""
    count = GET_SLICE + 100
    with client(server) as c:
        assert c.put("many_looks", [b""] * count, 0) == count
        first = c.peek_items("many_looks", 0, count)
        assert (len(first.shown), first.after, first.items) == (GET_SLICE, GET_SLICE, count)
        rest = c.peek_items("many_looks", first.after, count)
        assert (len(rest.shown), rest.after) == (100, count)


def test_get_timed_gives_each_items_add_time_and_expiry(server: ServerProcess) -> None:
    with client(server) as c:
        before = int(time.time() * 1000)
        c.put("timed", [b"forever"], 0)
        c.put("timed", [b"brief"], 600_000)
        after = int(time.time() * 1000)
        got = c.get_timed("timed", 5, 0, 30_000)
        assert [i.data for i in got] == [b"forever", b"brief"]
        assert all(before <= i.add_time_msec <= after for i in got)
        assert got[0].expiry_msec is None
        assert before + 600_000 <= got[1].expiry_msec <= after + 600_000
        assert all(i.id > 0 for i in got)  # open reads, closed like get's
        assert c.abort("timed", {i.id for i in got}) == 2
        plain = c.get("timed", 5, 0, 0)  # `get` answers Kestrel's Item, times left out
        assert [(i.data, i.id) for i in plain] == [(b"forever", 0), (b"brief", 0)]


def test_full_queue_accepts_fewer(server: ServerProcess) -> None:
    with client(server) as c:
        assert c.put("small", [b"a", b"b", b"c"], 0) == 2


def test_bad_queue_name_is_an_application_error_with_the_reason(server: ServerProcess) -> None:
    with client(server) as c:
        with pytest.raises(TApplicationException, match="not allowed"):
            c.put("../etc", [b"x"], 0)
        assert c.put("fine", [b"x"], 0) == 1  # the connection still works


def test_status_refusals_and_persistence_across_restart(server_factory: Any) -> None:
    srv = server_factory()
    with client(srv) as c:
        assert c.current_status() == kestrel.Status.UP
        c.put("s", [b"a", b"b"], 0)
        opened = c.get("s", 1, 0, 60_000)[0]
        c.set_status(kestrel.Status.READ_ONLY)
        with pytest.raises(TApplicationException, match="ReadOnly"):
            c.put("s", [b"x"], 0)
        with pytest.raises(TApplicationException, match="ReadOnly"):
            c.flush_queue("s")
        assert c.get("s", 1, 0, 0)[0].data == b"b"
        c.set_status(kestrel.Status.QUIESCENT)
        with pytest.raises(TApplicationException, match="Quiescent"):
            c.get("s", 1, 0, 0)
        assert c.confirm("s", {opened.id}) == 1  # opened before: may still be confirmed
    srv.restart()
    with client(srv) as c:
        assert c.current_status() == kestrel.Status.QUIESCENT
        c.set_status(kestrel.Status.UP)
        assert c.put("s", [b"back"], 0) == 1


def test_set_status_without_a_status_file_fails_clearly(server_factory: Any) -> None:
    srv = server_factory({"status_file": None})
    with client(srv) as c:
        assert c.current_status() == kestrel.Status.NOT_CONFIGURED
        with pytest.raises(TApplicationException, match="not configured"):
            c.set_status(kestrel.Status.READ_ONLY)
        assert c.put("q", [b"still up"], 0) == 1


@pytest.mark.parametrize("journal_format", ["kestrel2", "kestrel3"])
@pytest.mark.parametrize("commit_log", ["off", "on"])
def test_sigkill_loses_no_item_put_with_sync_always(server_factory: Any, commit_log: str,
                                                    journal_format: str) -> None:
    srv = server_factory({"default_queue": {"sync_journal": "always", "journal_format": journal_format},
                          "commit_log": commit_log})
    acknowledged = 0
    with client(srv) as c:
        for n in range(50):
            acknowledged += c.put("durable", [b"item-%d-%d" % (n, i) for i in range(4)], 0)
    srv.kill()
    srv.start()
    assert ("commit log recovered" in srv.log()) == (commit_log == "on")
    with client(srv) as c:
        got = c.get("durable", 1000, 0, 0)
    assert len(got) == acknowledged == 200
    assert got[0].data == b"item-0-0" and got[-1].data == b"item-49-3"


def test_sigterm_shuts_down_cleanly_and_keeps_items(server_factory: Any) -> None:
    server = server_factory()
    with client(server) as c:
        c.put("keep", [b"a", b"b"], 0)
    assert server.stop() == 0
    assert "kestrel stopped" in server.log()
    server.start()
    with client(server) as c:
        assert [i.data for i in c.get("keep", 5, 0, 0)] == [b"a", b"b"]


def raw_connection(srv: ServerProcess) -> socket.socket:
    return socket.create_connection(("127.0.0.1", srv.thrift_port), timeout=5)


def assert_closed(sock: socket.socket) -> None:
    sock.settimeout(5)
    try:
        assert sock.recv(100) == b""
    except ConnectionResetError:
        pass


def test_oversized_frame_closes_only_that_connection(server_factory: Any) -> None:
    srv = server_factory({"max_frame_size": "1MB"})
    with client(srv) as healthy:
        bad = raw_connection(srv)
        bad.sendall(struct.pack("!i", 2**30))  # announce 1 GB, send nothing more
        assert_closed(bad)
        assert healthy.put("ok", [b"x"], 0) == 1
        with pytest.raises((TTransportException, ConnectionError, OSError)):
            healthy.put("ok", [b"y" * (2 * 1024 * 1024)], 0)  # over the limit from a real client
    with client(srv) as again:
        assert again.peek("ok").items == 1


@pytest.mark.parametrize("payload", [
    b"\x00\x00\x00\x05hello",
    b"\x00\x00\x00\x08" + b"\x80\x01\x00\x01\xff\xff\xff\xff",
    b"\xff\xff\xff\xff",
    b"\x00\x00\x00\x0c\x80\x01\x00\x01\x00\x00\x00\x03put\x00",
])
def test_malformed_frames_close_that_connection(server: ServerProcess, payload: bytes) -> None:
    with client(server) as healthy:
        bad = raw_connection(server)
        bad.sendall(payload)
        bad.shutdown(socket.SHUT_WR)
        bad.settimeout(5)
        try:
            while bad.recv(4096):
                pass
        except ConnectionResetError:
            pass
        bad.close()
        assert healthy.put("after", [b"x"], 0) == 1


def test_unknown_method_gets_an_application_exception(server: ServerProcess) -> None:
    other = thriftpy2.load_fp(__import__("io").StringIO("service Other { i32 nothing() }"),
                              module_name="other_thrift")
    c = make_client(other.Other, "127.0.0.1", server.thrift_port, trans_factory=TFramedTransportFactory())
    with pytest.raises(TApplicationException):
        c.nothing()
    c.close()


def test_buffered_transport_and_compact_protocol(server_factory: Any) -> None:
    srv = server_factory({"thrift_transport": "buffered", "thrift_protocol": "compact"})
    with client(srv, protocol="compact", transport="buffered") as c:
        assert c.put("bc", [b"a", b"b"], 0) == 2
        got = c.get("bc", 2, 0, 10_000)
        assert c.confirm("bc", {got[0].id, got[1].id}) == 2
        assert c.peek("bc").items == 0


def test_many_idle_connections_do_not_block_others(server: ServerProcess) -> None:
    idle = [raw_connection(server) for _ in range(300)]
    try:
        with client(server) as c:
            assert c.put("busy", [b"x"], 0) == 1
            assert c.get("busy", 1, 0, 0)[0].data == b"x"
    finally:
        for s in idle:
            s.close()


def test_sighup_reloads_queue_settings(server_factory: Any) -> None:
    import signal

    import yaml

    srv = server_factory({"queues": {"limited": {"max_items": 1}}})
    with client(srv) as c:
        assert c.put("limited", [b"a", b"b"], 0) == 1
        config = yaml.safe_load(srv.config_path.read_text())
        config["queues"]["limited"]["max_items"] = 3
        srv.config_path.write_text(yaml.safe_dump(config))
        assert srv.proc is not None
        srv.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: "queue settings reloaded" in srv.log(), "the settings to be reloaded")
        assert c.put("limited", [b"b", b"c", b"d"], 0) == 2
