"""A closed connection is freed by reference counting alone, in every protocol: none of its objects
refer to each other in a cycle. The server freezes what lives long (src/kestrel/service/gc_pauses.py),
and a frozen cycle is never collected: a connection left in one would stay for good.

Each connection here is real (the listener, the protocol's connection, a client on a socket) and
served with the collector off; once it has closed, a collection that keeps what it finds
(`gc.DEBUG_SAVEALL`) must find nothing of it.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import gevent
import gevent.event
import gevent.socket
import pytest

from kestrel.service.buffered_connection import make_listener
from kestrel.service.memcache.handler import MemcacheConnection
from kestrel.service.session.server_state import ServerState
from kestrel.service.text.handler import TextConnection
from kestrel.service.thrift.handler import ThriftConnection
from tests.conftest import STALL_S
from tests.support.thrift_wire import encode_call, framed


def thrift(method: str, **args: Any) -> bytes:
    return framed(encode_call("binary", method, **args))


def thrift_get(timeout_ms: int, auto_abort_ms: int = 0) -> bytes:
    return thrift("get", queue_name="q", max_items=1, timeout_msec=timeout_ms, auto_abort_msec=auto_abort_ms)


# Each protocol's connection; requests that put, open a read, close it, wait in a get that an item
# ends and in one that times out (each answered before the next is sent); and a get left waiting.
PROTOCOLS: dict[str, tuple[Any, list[bytes], bytes]] = {
    "memcache": (MemcacheConnection,
                 [b"set q 0 0 1\r\nx\r\n", b"set q 0 0 1\r\ny\r\n", b"get q/open\r\n", b"get q/close/t=50\r\n",
                  b"get q/t=50\r\n"],
                 b"get q/t=60000\r\n"),
    "text": (TextConnection,
             [b"put q:\nx\ny\n\n", b"get q 50\n", b"get q 50\n", b"get q 50\n"],
             b"get q 60000\n"),
    "thrift": (ThriftConnection,
               [thrift("put", queue_name="q", items=[b"x", b"y"], expiration_msec=0),
                thrift_get(0, auto_abort_ms=60_000), thrift_get(50), thrift_get(50)],
               thrift_get(300)),  # a Thrift connection finds its client gone once the wait ends
}


@pytest.fixture
def collector_off() -> Iterator[None]:
    """The collector off, with nothing left for it: what it finds later is the test's."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def parts(connection: Any) -> dict[int, type]:
    """The connection's own objects, by address: it, its session, its replies and theirs (those
    the cycles were among)."""
    replies = getattr(connection, "replies", None) or connection.stream.replies
    objects = (connection, connection.session, connection.session.reads, replies, replies.acks, replies.io)
    return {id(o): type(o) for o in objects}


def cyclic_garbage(made: dict[int, type]) -> list[str]:
    """Those of `made` a collection finds unreachable (kept, not freed, to be named). Only those:
    another test's greenlet ending meanwhile may leave garbage of its own."""
    gc.set_debug(gc.DEBUG_SAVEALL)
    gc.collect()
    gc.set_debug(0)
    found = sorted(type(o).__qualname__ for o in gc.garbage if made.get(id(o)) is type(o))
    gc.garbage.clear()
    return found


@pytest.mark.parametrize("killed_mid_wait", [False, True], ids=["closed", "killed mid-wait"])
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_closed_connection_leaves_no_cycle(server_state: ServerState, collector_off: None, protocol: str,
                                            killed_mid_wait: bool) -> None:
    connection, requests, waiting_get = PROTOCOLS[protocol]
    handled = gevent.event.Event()
    made: dict[int, type] = {}

    def recorded(server: ServerState, sock: Any, peer: str) -> Any:
        served = connection(server, sock, peer)
        made.update(parts(served))
        return served

    recorded.protocol = connection.protocol  # type: ignore[attr-defined]
    listener = make_listener(recorded, server_state, ("127.0.0.1", 0))  # type: ignore[arg-type]
    serve = listener.handle

    def handle(sock: Any, address: tuple[str, int]) -> bool:
        try:
            return serve(sock, address)
        finally:
            gevent.get_hub().loop.run_callback(handled.set)

    listener.handle = handle
    listener.start()
    try:
        client = gevent.socket.create_connection(listener.address)
        client.settimeout(STALL_S)
        for request in requests:
            client.sendall(request)
            assert client.recv(65536)
        if killed_mid_wait:
            client.sendall(waiting_get)
            queue = server_state.collection.get("q")
            assert queue is not None
            with gevent.Timeout(STALL_S, AssertionError("the get never waited for an item")):
                while queue.stats()["waiters"] != 1:
                    gevent.sleep(0.005)  # the server runs here, in this process
        client.close()
        assert handled.wait(STALL_S)
        gevent.sleep(0)  # the listener's own end of the connection
        assert server_state.stats.curr_connections == 0
        assert len(made) == 6 and cyclic_garbage(made) == []
    finally:
        listener.stop_accepting()
        server_state.reads_by_id.cancel_timers()  # the Thrift read's auto-abort would hold the server
