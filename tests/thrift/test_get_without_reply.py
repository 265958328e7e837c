"""A Thrift get that took items and then waits for more: when it ends without a reply (its client
hangs up, the server stops), what it took is back at the head of its queue, in order, for the next
client and after a restart; nothing taken is lost and nothing is both handed out and kept. So is
what a get with auto-abort took for a client that hung up before the server read its request."""

from __future__ import annotations

import os
import signal
import socket
from typing import Any

import pytest

from tests.conftest import STALL_S, ServerProcess, wait_until
from tests.support.clients import thrift as client
from tests.support.thrift_wire import encode_call, framed, read_framed_reply
from tests.support.wire import memcache_stats

ITEMS = [b"first", b"second", b"third"]


def _raw(srv: ServerProcess) -> socket.socket:
    return socket.create_connection(("127.0.0.1", srv.thrift_port), timeout=5)


def _send_waiting_get(srv: ServerProcess, c: Any, sock: socket.socket, queue: str, method: str,
                      auto_abort_msec: int, then: bytes = b"") -> None:
    """A get of more than `queue` holds, with a long time-out: it takes every item, then waits
    (`then`: frames sent behind it, in the same write)."""
    call = encode_call("binary", method, queue_name=queue, max_items=10, timeout_msec=600_000,
                       auto_abort_msec=auto_abort_msec)
    sock.sendall(framed(call) + then)
    wait_until(lambda: c.peek(queue).waiters == 1, "the get to take the items and wait for more")
    info = c.peek(queue)
    assert info.items == 0  # taken by the waiting get


@pytest.mark.parametrize("journal_format", ["kestrel2", "kestrel3"])
@pytest.mark.parametrize(("method", "auto_abort_msec"), [("get", 0), ("get", 60_000), ("get_timed", 0)])
def test_a_get_whose_client_hangs_up_while_it_waits_for_more_puts_back_what_it_took(
        server_factory: Any, journal_format: str, method: str, auto_abort_msec: int) -> None:
    srv = server_factory({"default_queue": {"journal_format": journal_format}})
    queue = "taken"
    with client(srv) as c:
        assert c.put(queue, ITEMS, 0) == len(ITEMS)
        with _raw(srv) as gone:
            _send_waiting_get(srv, c, gone, queue, method, auto_abort_msec)
        wait_until(lambda: c.peek(queue).waiters == 0, "the hung-up get's wait to end", timeout=STALL_S)
        info = c.peek(queue)
        assert (info.items, info.open_transactions) == (len(ITEMS), 0)
    srv.kill()  # the journal says so too
    srv.start()
    with client(srv) as c:
        assert [item.data for item in c.get(queue, 10, 0, 0)] == ITEMS
    log = srv.log()
    assert "Traceback" not in log and '"level": "error"' not in log


@pytest.mark.parametrize("journal_format", ["kestrel2", "kestrel3"])
@pytest.mark.parametrize("auto_abort_msec", [0, 60_000])
def test_a_get_waiting_for_more_when_the_server_stops_replies_with_what_it_took(
        server_factory: Any, journal_format: str, auto_abort_msec: int) -> None:
    """The stop ends the wait and the get replies with what it took, as do the calls its client sent
    behind it: the end of the stream the server itself makes as it stops is not the client's
    hang-up. Reads opened for auto-abort and never confirmed are back at the head after the
    restart; without auto-abort the reply confirmed them."""
    srv = server_factory({"default_queue": {"journal_format": journal_format}})
    queue = "stopping"
    with client(srv) as c, _raw(srv) as waiting:
        assert c.put(queue, ITEMS, 0) == len(ITEMS)
        _send_waiting_get(srv, c, waiting, queue, "get", auto_abort_msec,
                          then=framed(encode_call("binary", "get_version")))
        srv.stop()
        assert [item.data for item in read_framed_reply(waiting, "binary", "get")] == ITEMS
        assert read_framed_reply(waiting, "binary", "get_version").startswith("2.4.1")
    srv.start()
    with client(srv) as c:
        kept = [item.data for item in c.get(queue, 10, 0, 0)]
    assert kept == (ITEMS if auto_abort_msec else [])
    log = srv.log()
    assert "Traceback" not in log and '"level": "error"' not in log


@pytest.mark.parametrize("journal_format", ["kestrel2", "kestrel3"])
@pytest.mark.parametrize(("transport", "protocol", "method"), [
    ("framed", "binary", "get"), ("framed", "compact", "get_timed"), ("buffered", "binary", "get")])
def test_a_get_with_auto_abort_read_after_its_client_hung_up_opens_no_reads(
        server_factory: Any, journal_format: str, transport: str, protocol: str, method: str) -> None:
    """A client that timed out on a stalled server and closed leaves its request in the socket,
    followed by the end of its stream. Read ids outlive their connection, so reads opened for it
    stayed open until their auto-abort, whose ids nobody could learn; its items stay in the queue."""
    srv = server_factory({"thrift_transport": transport, "thrift_protocol": protocol,
                          "default_queue": {"journal_format": journal_format}})
    queue = "stalled"
    with client(srv, protocol, transport) as c:
        assert c.put(queue, ITEMS, 0) == len(ITEMS)
        connected = int(memcache_stats(srv.memcache_port)["curr_connections"])
        assert srv.proc is not None
        call = encode_call(protocol, method, queue_name=queue, max_items=10, timeout_msec=0,
                           auto_abort_msec=600_000)
        with _raw(srv) as gone:
            os.kill(srv.proc.pid, signal.SIGSTOP)  # stalled: the request waits in the socket
            try:
                gone.sendall(framed(call) if transport == "framed" else call)
            finally:
                gone.close()
                os.kill(srv.proc.pid, signal.SIGCONT)
        wait_until(lambda: int(memcache_stats(srv.memcache_port)["curr_connections"]) == connected,
                   "the server to read the request and close its connection", timeout=STALL_S)
        info = c.peek(queue)
        assert (info.items, info.open_transactions) == (len(ITEMS), 0)
        assert [item.data for item in c.get(queue, 10, 0, 0)] == ITEMS  # in order, at the head
    log = srv.log()
    assert "Traceback" not in log and '"level": "error"' not in log
