"""A get's items bounded by their bytes as well as by their count (`session.GET_BYTES`): a memcache
run of pipelined gets, or a Thrift get of `max_items`, of large items takes a few of them, sends
their replies, and only then the next ones, so that what the server holds in replies at once stays
bounded; every get is still answered, whole and in order. Connections served on a socket pair in
this process; the client reads nothing until the server stops taking items, then everything."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gevent
import gevent.socket
import pytest

from kestrel.service.config import from_mapping
from kestrel.service.memcache.handler import MemcacheConnection
from kestrel.service.replies import HELD_BYTES
from kestrel.service.session.server_state import ServerState
from kestrel.service.session.session import GET_BYTES
from kestrel.service.thrift.handler import ThriftConnection
from tests.conftest import STALL_S
from tests.server.test_hub_turns import received
from tests.support.thrift_wire import encode_call, framed, read_framed_reply

COUNT, SIZE = 200, 256 * 1024
# Items taken before the client reads: the run's own (its bytes reach GET_BYTES) and those of the
# runs whose replies the socket pair's buffers took, or (under `always`) the replies held for the
# disk (HELD_BYTES); a get of them all (before the bound) took 200.
MOST_TAKEN = max(4 * GET_BYTES, 2 * HELD_BYTES) // SIZE


@pytest.fixture(params=[(held, journal, "never") for held in ("memory", "read-behind")
                        for journal in ("kestrel2", "kestrel3")]
                + [("memory", journal, "always") for journal in ("kestrel2", "kestrel3")],
                ids="-".join)
def state(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """A server's state whose queue holds its items in memory, or pages them out (read-behind), in
    each journal format; or, under `always` with the commit log, holds each reply until its round
    (then the replies held for the disk, not the socket's room, stop the reading: `HELD_BYTES`)."""
    held, journal, sync = request.param
    queue: dict[str, Any] = {"journal_format": journal}
    if held == "read-behind":
        queue["max_memory_size"] = "1MB"
    if sync == "always":
        queue["sync_journal"] = "always"
    config = from_mapping({"queue_path": str(tmp_path), "default_queue": queue}, str(tmp_path))
    server_state = ServerState(config)
    server_state.collection.load()
    yield server_state
    server_state.collection.close()


def items() -> list[bytes]:
    return [b"%05d" % i + bytes([65 + i % 26]) * (SIZE - 5) for i in range(COUNT)]


def filled(state: Any, connection: Any, client: socket.socket, first: bytes) -> tuple[Any, gevent.Greenlet]:
    """The connection served, its queue `q` created by the client's `first` request (answered
    before this returns) then given COUNT large items."""
    serving = gevent.spawn(connection.run)
    client.sendall(first)
    with gevent.Timeout(STALL_S):
        while state.collection.get("q") is None:
            gevent.sleep(0.01)
    queue = state.collection.get("q")
    assert state.collection.put("q", items()) == COUNT
    return queue, serving


def held_back(queue: Any, replies: Any) -> None:
    """Once a reply waits for room in the socket (or the disk), the server takes no more items: few
    were taken."""
    with gevent.Timeout(STALL_S):
        while not replies.full:
            gevent.sleep(0.01)
    assert queue.length >= COUNT - MOST_TAKEN


def test_a_run_of_memcache_gets_of_large_items_takes_them_a_few_at_a_time(state: Any) -> None:
    ours, client = gevent.socket.socketpair()
    client.settimeout(STALL_S)
    connection = MemcacheConnection(state, ours, "test")
    queue, serving = filled(state, connection, client, b"get q\r\n")
    assert received(client, b"END\r\n") == b"END\r\n"
    client.sendall(b"get q\r\n" * COUNT)
    held_back(queue, connection.replies)
    for item in items():
        value = b"VALUE q 0 %d\r\n%s\r\nEND\r\n" % (SIZE, item)
        assert received(client, value) == value
    client.sendall(b"get q\r\n")
    assert received(client, b"END\r\n") == b"END\r\n"
    client.shutdown(socket.SHUT_WR)
    assert serving.get(timeout=STALL_S) is True
    assert state.stats.cmd_get == COUNT + 2
    assert state.stats.get_misses == 2
    ours.close()
    client.close()


def thrift_get(max_items: int, timeout_msec: int = 0) -> bytes:
    return framed(encode_call("binary", "get", queue_name="q", max_items=max_items, timeout_msec=timeout_msec,
                              auto_abort_msec=0))


@pytest.mark.parametrize("timeout_msec", [0, 1])
def test_a_thrift_get_of_large_items_returns_those_within_its_bytes(state: Any, timeout_msec: int) -> None:
    """Kestrel's get returns up to `max_items`: fewer is allowed. Each get of them all takes the
    items until their bytes reach the bound (in one remove, or with a time-out a slice at a time);
    the gets that follow take the rest, in order."""
    ours, client = gevent.socket.socketpair()
    client.settimeout(STALL_S)
    connection = ThriftConnection(state, ours, "test")
    queue, serving = filled(state, connection, client, thrift_get(1))
    assert read_framed_reply(client, "binary", "get") == []
    client.sendall(thrift_get(COUNT, timeout_msec) * COUNT)
    held_back(queue, connection.stream.replies)
    got: list[bytes] = []
    while len(got) < COUNT:
        taken = [item.data for item in read_framed_reply(client, "binary", "get")]
        assert 0 < len(taken) <= GET_BYTES // SIZE
        got += taken
    assert got == items()
    for _ in range(COUNT - (COUNT * SIZE) // GET_BYTES):  # the gets left find the queue empty
        assert read_framed_reply(client, "binary", "get") == []
    client.shutdown(socket.SHUT_WR)
    assert serving.get(timeout=STALL_S) is True
    ours.close()
    client.close()


@pytest.mark.parametrize("protocol, request_, answer", [
    ("memcache", b"get q/peek\r\n", b"VALUE q/peek 0 %d\r\n%s\r\nEND\r\n"),
    ("memcache", b"get q/open\r\nget q/abort\r\n", b"VALUE q/open 0 %d\r\n%s\r\nEND\r\nEND\r\n"),
    ("text", b"peek q\n", b":%s\n"),
])
def test_a_burst_of_gets_of_one_large_item_sends_their_replies_a_few_at_a_time(
        state: Any, protocol: str, request_: bytes, answer: bytes) -> None:
    """Gets that leave the item where it is (a peek, an open read aborted) answer it again and again:
    their replies, joined to be sent, held the item as many times as the burst asked (4.2 KB of
    `/peek`s of a 1 MB item made 569 MB). Past GET_BYTES of items the replies go out before the next
    get is answered, so a client that does not read has no more built for it."""
    from kestrel.service.text.handler import TextConnection

    ours, client = gevent.socket.socketpair()
    client.settimeout(STALL_S)
    kind = MemcacheConnection if protocol == "memcache" else TextConnection
    connection = kind(state, ours, "test")
    serving = gevent.spawn(connection.run)
    data = items()[0]
    assert state.collection.put("q", [data]) == 1
    client.sendall(request_ * COUNT)
    with gevent.Timeout(STALL_S):
        while not connection.replies.full:
            gevent.sleep(0.01)
    answered = state.stats.cmd_peek + state.stats.cmd_get
    assert answered <= MOST_TAKEN * request_.count(b"\n"), answered
    reply = answer % ((SIZE, data) if protocol == "memcache" else (data,))
    for _ in range(COUNT):
        assert received(client, reply) == reply
    client.shutdown(socket.SHUT_WR)
    assert serving.get(timeout=STALL_S) is True
    ours.close()
    client.close()
