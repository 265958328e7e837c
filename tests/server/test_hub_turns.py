"""Requests answered in the hub's callback (docs/architecture.md, *Requests answered in the hub*):
a ready put or get costs the connection's greenlet no switch, anything that may wait is answered in
that greenlet as before, replies keep their order across the two, and an error in the callback
ends its connection, never the hub. Under `sync_journal: always` with the commit log, the same
requests are answered in the hub, their replies held until the log's fsync round has run.
Connections served on a socket pair in this process."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import gevent
import gevent.event
import gevent.socket
import greenlet
import pytest
import structlog.testing

from kestrel.service import socket_io, turns
from kestrel.service.config import from_mapping
from kestrel.service.memcache.handler import MemcacheConnection
from kestrel.service.session.server_state import ServerState
from kestrel.service.session.session import Session
from kestrel.service.thrift.handler import ThriftConnection
from kestrel.storage import disk
from kestrel.storage.errors import JournalWriteError
from kestrel.storage.fsync.group_commit import shared
from tests.conftest import STALL_S
from tests.support.thrift_wire import encode_call, framed, read_framed_reply


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """(the connection's socket, the client's)."""
    ours, theirs = gevent.socket.socketpair()
    theirs.settimeout(STALL_S)
    yield ours, theirs
    ours.close()
    theirs.close()


def received(client: socket.socket, expected: bytes) -> bytes:
    """What the client reads until it has as many bytes as `expected` (or the stream ends)."""
    data = b""
    while len(data) < len(expected):
        chunk = client.recv(len(expected) - len(data))
        if not chunk:
            break
        data += chunk
    return data


def memcache_round(client: socket.socket, queue: str, data: bytes) -> None:
    client.sendall(b"set %s 0 0 %d\r\n%s\r\n" % (queue.encode(), len(data), data))
    assert received(client, b"STORED\r\n") == b"STORED\r\n"
    client.sendall(b"get %s\r\n" % queue.encode())
    value = b"VALUE %s 0 %d\r\n%s\r\nEND\r\n" % (queue.encode(), len(data), data)
    assert received(client, value) == value


def thrift_round(client: socket.socket, queue: str, data: bytes) -> None:
    client.sendall(framed(encode_call("binary", "put", queue_name=queue, items=[data], expiration_msec=0)))
    assert read_framed_reply(client, "binary", "put") == 1
    client.sendall(framed(encode_call("binary", "get", queue_name=queue, max_items=1, timeout_msec=0,
                                      auto_abort_msec=0)))
    assert [item.data for item in read_framed_reply(client, "binary", "get")] == [data]


ROUNDS: dict[str, tuple[Any, Callable[[socket.socket, str, bytes], None]]] = {
    "memcache": (MemcacheConnection, memcache_round), "thrift": (ThriftConnection, thrift_round)}


def serve(state: Any, pair: tuple[socket.socket, socket.socket], protocol: str, *queues: str) -> gevent.Greenlet:
    """A connection of `protocol` on the pair's first socket, in a greenlet of its own, after a
    first round on each of `queues` (a queue's creation may wait: in the greenlet)."""
    connection_type, one_round = ROUNDS[protocol]
    ours, client = pair
    serving = gevent.spawn(connection_type(state, ours, "test").run)
    for queue in queues:
        one_round(client, queue, b"0")
    return serving


@contextlib.contextmanager
def served(state: Any, pair: tuple[socket.socket, socket.socket], protocol: str,
           *queues: str) -> Iterator[gevent.Greenlet]:
    """`serve`; once the block has run, the client ends the stream and the connection must end
    cleanly, all of it read."""
    serving = serve(state, pair, protocol, *queues)
    yield serving
    pair[1].shutdown(socket.SHUT_WR)
    assert serving.get(timeout=STALL_S) is True


@contextlib.contextmanager
def switches_into(serving: gevent.Greenlet) -> Iterator[list[str]]:
    """The switches into (or throws at) the connection's greenlet while the block runs, with its
    turns made an hour long: a turn also ends after TURN of work (src/kestrel/service/turns.py),
    which a busy machine's pause of the process reaches, and the connection then steps aside
    through its greenlet."""
    switches: list[str] = []

    def trace(event: str, args: Any) -> None:
        if event in ("switch", "throw") and args[1] is serving:
            switches.append(event)

    turn = turns.TURN
    turns.TURN = 3600.0
    previous = greenlet.settrace(trace)
    try:
        yield switches
    finally:
        greenlet.settrace(previous)
        turns.TURN = turn


def thrift_call(client: socket.socket, method: str, **args: Any) -> Any:
    client.sendall(framed(encode_call("binary", method, **args)))
    return read_framed_reply(client, "binary", method)


def thrift_get(client: socket.socket, queue: str, auto_abort_msec: int, timeout_msec: int = 0) -> Any:
    return thrift_call(client, "get", queue_name=queue, max_items=1, timeout_msec=timeout_msec,
                       auto_abort_msec=auto_abort_msec)


def memcache_ask(client: socket.socket, request: bytes, expected: bytes) -> None:
    client.sendall(request)
    assert received(client, expected) == expected


def rounds_without_switching(state: Any, pair: Any, protocol: str, queue: str) -> None:
    """20 put and get rounds on `queue` after its first, none switching to the connection's
    greenlet; the connection then ends cleanly, every round counted."""
    _, one_round = ROUNDS[protocol]
    with served(state, pair, protocol, queue) as serving, switches_into(serving) as switches:
        for i in range(20):
            one_round(pair[1], queue, b"item %d" % i)
        assert switches == []
    assert state.stats.cmd_set == 21 and state.stats.get_hits == 21


@pytest.mark.parametrize("protocol", sorted(ROUNDS))
def test_ready_puts_and_gets_are_answered_without_switching_to_the_connection(
        server_state: Any, pair: Any, protocol: str) -> None:
    rounds_without_switching(server_state, pair, protocol, "ready")


def burst(client: socket.socket, protocol: str, queue: str, count: int, data: bytes) -> None:
    """`count` puts of `data` on `queue` sent in one piece, then their replies read."""
    if protocol == "memcache":
        memcache_ask(client, b"set %s 0 0 %d\r\n%s\r\n" % (queue.encode(), len(data), data) * count,
                     b"STORED\r\n" * count)
        return
    client.sendall(framed(encode_call("binary", "put", queue_name=queue, items=[data], expiration_msec=0)) * count)
    assert [read_framed_reply(client, "binary", "put") for _ in range(count)] == [1] * count


LARGE = b"L" * 4096
MARK = 0xA5


@pytest.mark.parametrize("first", ["a 4 KB item", "a burst of small puts"])
@pytest.mark.parametrize("protocol", sorted(ROUNDS))
def test_after_a_large_receive_requests_are_answered_in_the_hub_and_large_items_received_in_place(
        server_state: Any, pair: Any, protocol: str, first: str) -> None:
    """A receive of `IN_PLACE_FROM` bytes or more makes the connection receive in place from then on
    (one copy of an item's bytes); small requests and large ones are still answered in the hub."""
    _, one_round = ROUNDS[protocol]
    client = pair[1]
    with served(server_state, pair, protocol, "mixed", "burst") as serving:
        if first == "a 4 KB item":
            one_round(client, "mixed", LARGE)
        else:
            burst(client, protocol, "burst", 16, b"b" * 100)
        with switches_into(serving) as switches:
            for i in range(20):
                one_round(client, "mixed", b"item %d" % i)
            socket_io._SCRATCH[:] = bytes([MARK]) * len(socket_io._SCRATCH)
            one_round(client, "mixed", LARGE)
            assert switches == []
        if socket_io.receive_in_place is not None:
            assert socket_io._SCRATCH.tobytes() == bytes([MARK]) * len(socket_io._SCRATCH), (
                "the large item went through the scratch buffer: a copy more")


# ---------------------------------------------------------------------------------------------
# Under a `client_timeout`: one timer checks the idle time, the requests stay in the hub


@contextlib.contextmanager
def state_with_client_timeout(path: Path, client_timeout: str) -> Iterator[Any]:
    state = ServerState(from_mapping({"queue_path": str(path), "client_timeout": client_timeout}, str(path)))
    state.collection.load()
    try:
        yield state
    finally:
        state.close()


IDLE_CLOSES = {"memcache": {"event": "closing a slow or idle client", "limit": "client_timeout"},
               "thrift": {"event": "closing thrift connection",
                          "reason": "idle for longer than client_timeout (2000 ms)"}}


@pytest.mark.parametrize("protocol", sorted(ROUNDS))
def test_under_a_client_timeout_ready_puts_and_gets_are_answered_without_switching_to_the_connection(
        tmp_path: Path, pair: Any, protocol: str) -> None:
    _, one_round = ROUNDS[protocol]
    client = pair[1]
    with state_with_client_timeout(tmp_path, "60s") as state:
        with served(state, pair, protocol, "ready") as serving, switches_into(serving) as switches:
            for i in range(20):
                one_round(client, "ready", b"item %d" % i)
            assert switches == []
        assert state.stats.cmd_set == 21 and state.stats.get_hits == 21


@pytest.mark.parametrize("protocol", sorted(ROUNDS))
def test_under_a_client_timeout_a_connection_answered_in_the_hub_is_closed_once_idle_and_not_before(
        tmp_path: Path, pair: Any, protocol: str) -> None:
    """Requests every 0.1 s for 2.4 s keep a 2 s client_timeout's connection past its first deadline
    (real time: only a stall of the machine near 2 s would close it); once it is idle it is closed,
    no sooner than client_timeout after its last request, logged as the greenlet's wait logs it."""
    _, one_round = ROUNDS[protocol]
    client = pair[1]
    with state_with_client_timeout(tmp_path, "2s") as state, structlog.testing.capture_logs() as logs:
        serving = serve(state, pair, protocol, "active")
        started = time.monotonic()
        with switches_into(serving) as switches:
            while time.monotonic() - started < 2.4:
                gevent.sleep(0.1)
                last = time.monotonic()  # before the request: the idle time starts after it
                one_round(client, "active", b"again")
        assert switches == []  # all answered in the hub, the idle timer re-armed there
        assert serving.get(timeout=2 + STALL_S) is False  # closed by the server: the stream did not end
        assert time.monotonic() - last >= 2.0
    assert [entry for entry in logs if IDLE_CLOSES[protocol].items() <= entry.items()]


def test_under_a_client_timeout_a_connection_served_in_its_greenlet_is_closed_once_idle_and_not_before(
        tmp_path: Path, pair: Any) -> None:
    """The text protocol's requests are answered in the connection's greenlet, whose waits the same
    timer checks: kept past its first deadline while active, closed once idle, as above."""
    from kestrel.service.text.handler import TextConnection

    ours, client = pair
    with state_with_client_timeout(tmp_path, "2s") as state, structlog.testing.capture_logs() as logs:
        serving = gevent.spawn(TextConnection(state, ours, "test").run)
        started = time.monotonic()
        while time.monotonic() - started < 2.4:
            gevent.sleep(0.1)
            last = time.monotonic()
            client.sendall(b"put active:\nx\n\n")
            assert received(client, b"+1\n") == b"+1\n"
        assert serving.get(timeout=2 + STALL_S) is False
        assert time.monotonic() - last >= 2.0
    assert [entry for entry in logs if {"event": "closing a slow or idle client", "protocol": "text",
                                        "limit": "client_timeout"}.items() <= entry.items()]


@pytest.fixture(params=["kestrel2", "kestrel3"])
def any_format_state(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """`server_state` with its queues in each journal format."""
    state = ServerState(from_mapping({"queue_path": str(tmp_path),
                                      "default_queue": {"journal_format": request.param}}, str(tmp_path)))
    state.collection.load()
    yield state
    state.close()


def test_a_reliable_thrift_read_loop_is_answered_without_switching_to_the_connection(
        any_format_state: Any, pair: Any) -> None:
    """get with auto-abort, then confirm or abort by id: the reliable reader's every call in the hub."""
    server_state = any_format_state
    client = pair[1]
    with served(server_state, pair, "thrift", "reliable") as serving, switches_into(serving) as switches:
        for i in range(10):
            assert thrift_call(client, "put", queue_name="reliable", items=[b"item %d" % i], expiration_msec=0) == 1
            (item,) = thrift_get(client, "reliable", auto_abort_msec=60_000)
            assert item.data == b"item %d" % i and item.id > 0
            if i % 2:
                assert thrift_call(client, "abort", queue_name="reliable", ids={item.id}) == 1
                (again,) = thrift_get(client, "reliable", auto_abort_msec=60_000)  # back at the head
                assert again.data == item.data and again.id != item.id
                item = again
            assert thrift_call(client, "confirm", queue_name="reliable", ids={item.id}) == 1
            assert thrift_call(client, "confirm", queue_name="reliable", ids={item.id}) == 0  # closed once
        assert switches == []
        reliable = server_state.collection.get("reliable")
        assert reliable.length == 0 and reliable.open_transactions == 0


def test_a_read_opened_in_the_hub_is_aborted_by_its_timer(server_state: Any, pair: Any) -> None:
    client = pair[1]
    with served(server_state, pair, "thrift", "timed") as serving:
        assert thrift_call(client, "put", queue_name="timed", items=[b"a", b"b"], expiration_msec=0) == 2
        with switches_into(serving) as switches:
            (opened,) = thrift_get(client, "timed", auto_abort_msec=1)
        assert switches == [] and opened.data == b"a"
        timed = server_state.collection.get("timed")
        with gevent.Timeout(STALL_S):
            while timed.open_transactions:  # until the timer has run
                gevent.sleep(0.001)
        # "a" is back at the head, before "b".
        assert [item.data for item in thrift_call(client, "get", queue_name="timed", max_items=2, timeout_msec=0,
                                                  auto_abort_msec=0)] == [b"a", b"b"]
        assert thrift_call(client, "confirm", queue_name="timed", ids={opened.id}) == 0  # no longer open


def test_memcache_reliable_reads_are_answered_without_switching_to_the_connection(
        any_format_state: Any, pair: Any) -> None:
    """`/open`, `/close/open`, `/close`, `/abort` and `/peek` gets: each in the hub."""
    server_state = any_format_state
    client = pair[1]
    with served(server_state, pair, "memcache", "work") as serving:
        with switches_into(serving) as switches:
            for data in (b"a", b"b", b"c"):
                memcache_ask(client, b"set work 0 0 1\r\n%s\r\n" % data, b"STORED\r\n")
            memcache_ask(client, b"get work/open\r\n", b"VALUE work/open 0 1\r\na\r\nEND\r\n")
            memcache_ask(client, b"get work/close/open\r\n", b"VALUE work/close/open 0 1\r\nb\r\nEND\r\n")
            memcache_ask(client, b"get work/abort\r\n", b"END\r\n")  # "b" back at the head
            memcache_ask(client, b"get work/peek\r\n", b"VALUE work/peek 0 1\r\nb\r\nEND\r\n")
            memcache_ask(client, b"get work/t=1000/open\r\n", b"VALUE work/t=1000/open 0 1\r\nb\r\nEND\r\n")
            memcache_ask(client, b"get work/close\r\n", b"END\r\n")
        assert switches == []
        work = server_state.collection.get("work")
        assert work.length == 1 and work.open_transactions == 0  # "a" and "b" confirmed, "c" left
        # A read that must wait for its item is the greenlet's, and its reply comes in order.
        gevent.spawn_later(0.05, partial(server_state.collection.put, "work", [b"late"]))
        memcache_ask(client, b"get work/open\r\nget work/close/t=10000/open\r\n",
                     b"VALUE work/open 0 1\r\nc\r\nEND\r\nVALUE work/close/t=10000/open 0 4\r\nlate\r\nEND\r\n")
    assert work.length == 1 and work.open_transactions == 0  # its open read went back to the queue


def test_pipelined_memcache_requests_keep_their_order_across_a_get_that_waits(server_state: Any, pair: Any) -> None:
    client = pair[1]
    # both queues held: their plain sets and gets are answered in the hub
    with served(server_state, pair, "memcache", "a", "b"):
        client.sendall(b"set a 0 0 1\r\n1\r\nget a\r\nget b/t=10000\r\nset a 0 0 1\r\n2\r\nget a\r\nget a\r\n")
        gevent.sleep(0.05)
        assert server_state.collection.put("b", [b"late"]) == 1  # ends the wait of `get b/t=10000`
        expected = (b"STORED\r\nVALUE a 0 1\r\n1\r\nEND\r\nVALUE b/t=10000 0 4\r\nlate\r\nEND\r\n"
                    b"STORED\r\nVALUE a 0 1\r\n2\r\nEND\r\nEND\r\n")
        assert received(client, expected) == expected
        memcache_round(client, "a", b"3")  # back in the hub after the wait


def test_pipelined_thrift_calls_keep_their_order_across_a_get_that_waits(server_state: Any, pair: Any) -> None:
    client = pair[1]
    with served(server_state, pair, "thrift", "a", "b"):
        calls = [encode_call("binary", "put", seqid=1, queue_name="a", items=[b"1"], expiration_msec=0),
                 encode_call("binary", "get", seqid=2, queue_name="b", max_items=1, timeout_msec=10_000,
                             auto_abort_msec=0),
                 encode_call("binary", "get", seqid=3, queue_name="a", max_items=1, timeout_msec=0,
                             auto_abort_msec=0)]
        client.sendall(b"".join(framed(call) for call in calls))
        gevent.sleep(0.05)
        assert server_state.collection.put("b", [b"late"]) == 1
        assert read_framed_reply(client, "binary", "put") == 1
        assert [item.data for item in read_framed_reply(client, "binary", "get")] == [b"late"]
        assert [item.data for item in read_framed_reply(client, "binary", "get")] == [b"1"]
        thrift_round(client, "a", b"2")


# A burst mixing requests the hub answers with requests its greenlet answers; each leaves the
# queue as it found it (empty, no read open), so that every connection's replies are the same.
MIXED_BURSTS = {
    "memcache": b"".join([
        b"set s 0 0 1\r\na\r\nset s 0 0 1\r\nb\r\nget s/open\r\nversion\r\nget s/close/open\r\n",
        b"get s/abort\r\nget s/peek\r\ndelete other\r\nget s\r\nget s\r\n"]),
    "thrift": b"".join(framed(call) for call in [
        encode_call("binary", "put", seqid=1, queue_name="s", items=[b"a", b"b"], expiration_msec=0),
        encode_call("binary", "get", seqid=2, queue_name="s", max_items=1, timeout_msec=0, auto_abort_msec=0),
        encode_call("binary", "confirm", seqid=3, queue_name="s", ids={1}),
        encode_call("binary", "get_version", seqid=4),
        encode_call("binary", "abort", seqid=5, queue_name="s", ids={2}),
        encode_call("binary", "get", seqid=6, queue_name="s", max_items=2, timeout_msec=0, auto_abort_msec=0),
        encode_call("binary", "delete_queue", seqid=7, queue_name="other"),
        encode_call("binary", "get", seqid=8, queue_name="s", max_items=1, timeout_msec=0, auto_abort_msec=0)])}


def mixed_burst_replies(state: Any, protocol: str, at: int, expected: bytes | None = None) -> bytes:
    """The replies to `protocol`'s mixed burst sent in two parts, the first `at` bytes read by the
    connection before the rest is sent; as many bytes as `expected` (all of them, without it)."""
    ours, client = gevent.socket.socketpair()
    client.settimeout(STALL_S)
    try:
        serving = serve(state, (ours, client), protocol, "s")
        burst = MIXED_BURSTS[protocol]
        read_before = state.stats.bytes_read
        client.sendall(burst[:at])
        with gevent.Timeout(STALL_S):
            while state.stats.bytes_read < read_before + at:
                gevent.sleep(0.001)
        client.sendall(burst[at:])
        replies = received(client, expected) if expected is not None else b""
        client.shutdown(socket.SHUT_WR)
        assert serving.get(timeout=STALL_S) is True
        ours.close()  # as the listener closes it
        while chunk := client.recv(65536):
            replies += chunk
        return replies
    finally:
        ours.close()
        client.close()


@pytest.mark.parametrize("protocol", sorted(ROUNDS))
def test_a_mixed_burst_split_at_any_byte_gets_the_replies_it_gets_whole(server_state: Any, protocol: str) -> None:
    """Requests cut anywhere (a line, an item, a frame's size or body) between what the hub reads
    and what follows: the hub hands the partial request to the greenlet, which reads it whole and
    hands the next ones back; every reply as the burst sent in one piece gets, in order."""
    whole = mixed_burst_replies(server_state, protocol, len(MIXED_BURSTS[protocol]))
    found = b"VALUE s" if protocol == "memcache" else b"\x0b\x00\x01\x00\x00\x00\x01"  # an item's data
    assert whole.count(found) == {"memcache": 4, "thrift": 2}[protocol]
    for at in range(1, len(MIXED_BURSTS[protocol])):
        assert mixed_burst_replies(server_state, protocol, at, whole) == whole, at


@pytest.mark.parametrize("protocol, from_hub", [("memcache", True), ("thrift", True), ("thrift", False)])
def test_a_client_that_reads_no_replies_is_read_no_more_once_its_socket_is_full(
        server_state: Any, pair: Any, protocol: str, from_hub: bool) -> None:
    """1,000 gets of 16 KB items pipelined in bursts, their replies not read: once a reply waits for room
    in the socket, the connection reads no more requests, so the queue keeps most of its items
    rather than their replies piling up in the server's memory. Once the client reads, every get
    is answered, in order. Whether the hub answers the gets or the connection's greenlet does (as
    when the hub's turn runs out on a busy machine; `from_hub` False makes it so for every get)."""
    connection_type, _ = ROUNDS[protocol]
    ours, client = pair
    count, size = 1000, 16 * 1024
    items = [b"%05d" % i + b"x" * (size - 5) for i in range(count)]
    connection = connection_type(server_state, ours, "test")
    if not from_hub:
        connection.hub_serves = False
    serving = gevent.spawn(connection.run)
    if protocol == "memcache":
        client.sendall(b"set unread 0 0 1\r\n0\r\nget unread\r\n")
        request = b"get unread\r\n"
    else:
        client.sendall(framed(encode_call("binary", "put", queue_name="unread", items=[b"0"], expiration_msec=0)))
        client.sendall(framed(encode_call("binary", "get", queue_name="unread", max_items=1, timeout_msec=0,
                                          auto_abort_msec=0)))
        request = framed(encode_call("binary", "get", queue_name="unread", max_items=1, timeout_msec=0,
                                     auto_abort_msec=0))
    gevent.sleep(0.1)  # (the queue's creation, in the connection's greenlet)
    queue = server_state.collection.get("unread")
    with gevent.Timeout(STALL_S):
        while queue is None:
            gevent.sleep(0.01)
            queue = server_state.collection.get("unread")
    assert server_state.collection.put("unread", items) == count
    replies = connection.replies if protocol == "memcache" else connection.stream.replies
    for burst in range(10):  # (a burst of memcache gets is one run: one remove of them all)
        client.sendall(request * (count // 10))
        # until it reads no more (a reply waits for room: sent from the hub, or from the greenlet when
        # the hub's turn ran out), or has answered the burst
        with gevent.Timeout(STALL_S):
            while not (replies.full or queue.length <= count - (burst + 1) * count // 10):
                gevent.sleep(0.01)
    assert queue.length > count // 2
    if protocol == "memcache":
        first = received(client, b"STORED\r\nVALUE unread 0 1\r\n0\r\nEND\r\n")
        assert first.endswith(b"0\r\nEND\r\n")
        for item in items:
            value = b"VALUE unread 0 %d\r\n%s\r\nEND\r\n" % (size, item)
            assert received(client, value) == value
    else:
        assert read_framed_reply(client, "binary", "put") == 1
        assert [got.data for got in read_framed_reply(client, "binary", "get")] == [b"0"]
        for item in items:
            assert [got.data for got in read_framed_reply(client, "binary", "get")] == [item]
    client.shutdown(socket.SHUT_WR)
    assert serving.get(timeout=STALL_S) is True


@pytest.mark.parametrize("protocol", sorted(ROUNDS))
def test_a_client_that_hangs_up_behind_pipelined_puts_loses_none_acknowledged(
        server_state: Any, pair: Any, protocol: str) -> None:
    client = pair[1]
    serving = serve(server_state, pair, protocol, "flood")
    if protocol == "memcache":
        client.sendall(b"set flood 0 0 1\r\nx\r\n" * 500)
        assert client.recv(1)  # the first put is acknowledged
    else:
        client.sendall(framed(encode_call("binary", "put", queue_name="flood", items=[b"x"],
                                          expiration_msec=0)) * 500)
        assert read_framed_reply(client, "binary", "put") == 1
    client.close()  # without reading the other replies
    serving.join(timeout=STALL_S)  # (ended by the end of the stream, or by a send that fails: the
    assert serving.ready()         # listener takes an OSError as the client gone)
    flood = server_state.collection.get("flood")
    assert flood is not None and 1 <= flood.length <= 500


@pytest.mark.parametrize("protocol", sorted(ROUNDS))
def test_a_request_that_must_wait_is_answered_in_the_connection_s_greenlet(
        server_state: Any, pair: Any, protocol: str) -> None:
    """A get that waits for an item on a held queue: the hub hands it over rather than fail."""
    _, one_round = ROUNDS[protocol]
    client = pair[1]
    with served(server_state, pair, protocol, "slow"):
        gevent.spawn_later(0.05, partial(server_state.collection.put, "slow", [b"late"]))
        if protocol == "memcache":
            client.sendall(b"get slow/t=10000\r\n")
            value = b"VALUE slow/t=10000 0 4\r\nlate\r\nEND\r\n"
            assert received(client, value) == value
        else:
            client.sendall(framed(encode_call("binary", "get", queue_name="slow", max_items=1, timeout_msec=10_000,
                                              auto_abort_msec=0)))
            assert [item.data for item in read_framed_reply(client, "binary", "get")] == [b"late"]
        one_round(client, "slow", b"after")


@pytest.mark.pure_build
@pytest.mark.parametrize("protocol", sorted(ROUNDS))
def test_an_error_in_the_hub_s_callback_ends_its_connection_not_the_hub(
        server_state: Any, pair: Any, protocol: str, monkeypatch: pytest.MonkeyPatch) -> None:
    client = pair[1]
    serving = serve(server_state, pair, protocol, "broken")

    def fails(*args: Any) -> bool:
        raise RuntimeError("the rule failed")

    monkeypatch.setattr(Session, "answers_at_once", fails)
    if protocol == "memcache":
        client.sendall(b"get broken\r\n")
    else:
        client.sendall(framed(encode_call("binary", "get", queue_name="broken", max_items=1, timeout_msec=0,
                                          auto_abort_msec=0)))
    with pytest.raises(RuntimeError, match="the rule failed"):
        serving.get(timeout=STALL_S)  # raised in the connection's greenlet, which ends
    assert not gevent.get_hub().dead
    monkeypatch.undo()
    other, other_client = gevent.socket.socketpair()
    other_client.settimeout(STALL_S)
    try:
        with served(server_state, (other, other_client), protocol, "broken"):
            pass  # the loop serves the next connection
    finally:
        other.close()
        other_client.close()


# ---------------------------------------------------------------------------------------------
# Under `sync_journal: always`: the commit log's turn holds the change, the reply waits for its round


def server_state_with(path: Path, commit_log: bool = True, **queue: Any) -> Any:
    """A server's state as `server_state`'s, every queue under `always` and `queue`'s settings."""
    from kestrel.service.config import from_mapping
    from kestrel.service.session.server_state import ServerState

    config = {"queue_path": str(path), "commit_log": commit_log,
              "default_queue": {"sync_journal": "always", **queue}}
    state = ServerState(from_mapping(config, str(path)))
    state.collection.load()
    return state


@pytest.fixture(params=["kestrel2", "kestrel3"])
def always_state(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Any]:
    """A server's state whose queues are under `always`, with the commit log (the default), in
    each journal format."""
    state = server_state_with(tmp_path, journal_format=request.param)
    yield state
    state.close()


class Fsyncs:
    """The fsync rounds of the process's group commit, run by the test in a greenlet of their own:
    each waits until `go` is set, and fails with EIO while `failing`, or for the files under the
    queue path whose names begin with one of `failing_files`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.go = gevent.event.Event()
        self.go.set()
        self.failing = False
        self.failing_files: tuple[str, ...] = ()
        self.rounds = 0
        # rounds through this (not the C threads): a runner greenlet runs them, calling `fsync_all`
        monkeypatch.setattr(shared(), "_fsync_many", self)

    def fsync_all(self, fds: list[int]) -> list[OSError | None]:
        self.rounds += 1
        self.go.wait()
        return [self._fsync(fd) for fd in fds]

    def _fsync(self, fd: int) -> OSError | None:
        name = os.readlink(f"/proc/self/fd/{fd}")
        if self.failing or any(f"{os.sep}{part}" in name for part in self.failing_files):
            return OSError(errno.EIO, "Input/output error")
        os.fdatasync(fd)
        return None


@pytest.mark.parametrize("protocol", sorted(ROUNDS))
def test_under_always_with_the_commit_log_ready_puts_and_gets_are_answered_in_the_hub(
        always_state: Any, pair: Any, protocol: str) -> None:
    rounds_without_switching(always_state, pair, protocol, "durable")
    assert always_state.collection.commit_log.rounds >= 20  # each reply waited for a round of the log


@pytest.mark.parametrize("commit_log", [True, False])
@pytest.mark.parametrize("protocol", sorted(ROUNDS))
def test_under_a_periodic_sync_ready_puts_and_gets_are_answered_in_the_hub(
        tmp_path: Path, pair: Any, protocol: str, commit_log: bool) -> None:
    """A periodic sync's change waits for no fsync, with the log or without: a timer fsyncs later."""
    _, one_round = ROUNDS[protocol]
    state = server_state_with(tmp_path, commit_log=commit_log, sync_journal="10ms")
    try:
        client = pair[1]
        with served(state, pair, protocol, "periodic") as serving, switches_into(serving) as switches:
            for i in range(10):
                one_round(client, "periodic", b"item %d" % i)
            assert switches == []
    finally:
        state.close()


@pytest.mark.parametrize("protocol", sorted(ROUNDS))
def test_under_always_a_reply_answered_in_the_hub_waits_for_its_fsync_round_and_replies_keep_their_order(
        always_state: Any, pair: Any, protocol: str, monkeypatch: pytest.MonkeyPatch) -> None:
    client = pair[1]
    fsyncs = Fsyncs(monkeypatch)
    with served(always_state, pair, protocol, "held") as serving:
        fsyncs.go.clear()  # from now on each round's fsyncs wait
        with switches_into(serving) as switches:
            if protocol == "memcache":
                client.sendall(b"set held 0 0 1\r\n1\r\nset held 0 0 1\r\n2\r\nget held\r\n")
            else:
                calls = [encode_call("binary", "put", seqid=1, queue_name="held", items=[b"1"], expiration_msec=0),
                         encode_call("binary", "put", seqid=2, queue_name="held", items=[b"2"], expiration_msec=0),
                         encode_call("binary", "get", seqid=3, queue_name="held", max_items=1, timeout_msec=0,
                                     auto_abort_msec=0)]
                client.sendall(b"".join(framed(call) for call in calls))
            with gevent.Timeout(STALL_S):
                while always_state.stats.cmd_get < 2:  # the three answered, their replies held
                    gevent.sleep(0.01)
            client.setblocking(False)
            with pytest.raises(BlockingIOError):
                client.recv(1)  # no acknowledgement before its change is durable
            client.settimeout(STALL_S)
            fsyncs.go.set()
            if protocol == "memcache":
                expected = b"STORED\r\nSTORED\r\nVALUE held 0 1\r\n1\r\nEND\r\n"
                assert received(client, expected) == expected
            else:
                assert read_framed_reply(client, "binary", "put") == 1
                assert read_framed_reply(client, "binary", "put") == 1
                assert [item.data for item in read_framed_reply(client, "binary", "get")] == [b"1"]
        assert switches == []
        assert [item.data for item in always_state.collection.remove("held", 3)] == [b"2"]


@pytest.mark.parametrize("protocol", sorted(ROUNDS))
def test_under_always_a_change_answered_in_the_hub_that_the_disk_cannot_keep_cuts_the_connection_off(
        always_state: Any, pair: Any, protocol: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The log's fsync fails, then its journal's: the client reads the end of the stream, never
    the acknowledgement."""
    client = pair[1]
    fsyncs = Fsyncs(monkeypatch)
    serving = serve(always_state, pair, protocol, "lost")
    fsyncs.failing = True
    if protocol == "memcache":
        client.sendall(b"set lost 0 0 1\r\n1\r\n")
    else:
        client.sendall(framed(encode_call("binary", "put", queue_name="lost", items=[b"1"], expiration_msec=0)))
    assert client.recv(100) == b""
    serving.join(timeout=STALL_S)
    assert serving.ready() and always_state.stats.cmd_set == 2
    fsyncs.failing = False


@pytest.mark.parametrize("protocol", sorted(ROUNDS))
def test_under_always_a_journal_that_cannot_keep_a_change_cuts_off_its_own_connection_only(
        always_state: Any, pair: Any, protocol: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two connections' puts answered in the hub, their replies held for one round; the log's fsync
    fails, then one queue's journal's: that put's client reads the end of the stream, never the
    acknowledgement; the other's journal keeps its put, its client reads the reply and goes on."""
    other_protocol = next(name for name in ROUNDS if name != protocol)
    other, other_client = gevent.socket.socketpair()
    other_client.settimeout(STALL_S)
    try:
        fsyncs = Fsyncs(monkeypatch)
        serving = serve(always_state, pair, protocol, "doomed")
        serve(always_state, (other, other_client), other_protocol, "kept")
        fsyncs.go.clear()
        for client, name, queue in ((pair[1], protocol, b"doomed"), (other_client, other_protocol, b"kept")):
            if name == "memcache":
                client.sendall(b"set %s 0 0 1\r\n1\r\n" % queue)
            else:
                client.sendall(framed(encode_call("binary", "put", queue_name=queue.decode(), items=[b"1"],
                                                  expiration_msec=0)))
        with gevent.Timeout(STALL_S):
            while always_state.stats.cmd_set < 4:  # both answered, their replies held
                gevent.sleep(0.01)
        fsyncs.failing_files = ("commit-log", "doomed")
        fsyncs.go.set()
        assert pair[1].recv(100) == b""
        serving.join(timeout=STALL_S)
        assert serving.ready()
        if other_protocol == "memcache":
            assert received(other_client, b"STORED\r\n") == b"STORED\r\n"
        else:
            assert read_framed_reply(other_client, "binary", "put") == 1
        assert [item.data for item in always_state.collection.remove("kept", 2)] == [b"1"]
        fsyncs.failing_files = ()
        ROUNDS[other_protocol][1](other_client, "kept", b"2")  # and its connection goes on
    finally:
        other.close()
        other_client.close()


@pytest.mark.parametrize("protocol", sorted(ROUNDS))
def test_under_always_a_change_behind_a_turn_the_log_failed_waits_for_its_journal_in_the_greenlet(
        always_state: Any, pair: Any, protocol: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A disk with room for a probe's record but not an item's: a put fails and the queue goes
    read-only; the next put's probe writes, its item does not, and the log's fsync fails for that
    turn, which no change waited for. The put after, once the disk has room, must wait for the
    journal's own fsync of the probe's bytes: answered in the greenlet, acknowledged, the connection
    goes on (in the hub it raised BlockingSwitchOutError)."""
    _, one_round = ROUNDS[protocol]
    client = pair[1]
    fsyncs = Fsyncs(monkeypatch)
    item = b"x" * 4096
    write, writev_all = disk.write, disk.writev_all

    def refuse(fd: int, size: int) -> None:
        if size >= len(item) and os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith("behind"):
            raise OSError(errno.ENOSPC, "No space left on device")

    def full_write(fd: int, data: bytes | memoryview) -> int:
        refuse(fd, len(data))
        return write(fd, data)

    def full_writev_all(fd: int, parts: list[bytes]) -> int:
        refuse(fd, sum(map(len, parts)))
        return writev_all(fd, parts)

    with served(always_state, pair, protocol, "behind") as serving:
        monkeypatch.setattr(disk, "write", full_write)
        monkeypatch.setattr(disk, "writev_all", full_writev_all)
        with pytest.raises(JournalWriteError):
            always_state.collection.put("behind", [item])  # the queue goes read-only
        fsyncs.failing = True
        with pytest.raises(JournalWriteError):
            always_state.collection.put("behind", [item])  # the probe's record written, the item's not
        log = always_state.collection.commit_log
        with gevent.Timeout(STALL_S):
            while log._turn is not None or log._unsettled:  # the probe's turn ended, settled, not durable
                gevent.sleep(0.01)
        fsyncs.failing = False
        monkeypatch.setattr(disk, "write", write)
        monkeypatch.setattr(disk, "writev_all", writev_all)
        with switches_into(serving) as switches:
            one_round(client, "behind", b"1")
        assert switches  # the put waited for its journal's fsync in the greenlet
        with switches_into(serving) as switches:
            one_round(client, "behind", b"2")
        assert switches == []  # and the queue's changes are the hub's again


@pytest.mark.parametrize("protocol", sorted(ROUNDS))
def test_under_always_without_the_commit_log_changes_wait_in_the_connection_s_greenlet(
        tmp_path: Path, pair: Any, protocol: str) -> None:
    """Each change waits for its journal's fsync there: the hub hands every put over."""
    _, one_round = ROUNDS[protocol]
    state = server_state_with(tmp_path, commit_log=False)
    try:
        client = pair[1]
        with served(state, pair, protocol, "waits") as serving, switches_into(serving) as switches:
            one_round(client, "waits", b"1")
            assert switches
    finally:
        state.close()


@pytest.mark.parametrize("method", ["abort", "confirm"])
def test_a_thrift_close_naming_a_queue_of_the_hub_closes_a_read_of_one_that_waits_in_the_greenlet(
        tmp_path: Path, pair: Any, method: str) -> None:
    """A Thrift confirm or abort closes each read in the queue it was read from, whatever queue it
    names: it was answered in the hub's callback when the queue named answered at once, and a read
    of a queue whose changes wait for their fsync failed there ("internal error in abort:
    BlockingSwitchOutError"), its change made all the same."""
    config = {"queue_path": str(tmp_path), "commit_log": False, "default_queue": {"sync_journal": "never"},
              "queues": {"waits": {"sync_journal": "always"}}}
    state = ServerState(from_mapping(config, str(tmp_path)))
    state.collection.load()
    try:
        client = pair[1]
        with served(state, pair, "thrift", "hub", "waits") as serving:
            thrift_call(client, "put", queue_name="waits", items=[b"1", b"2"], expiration_msec=0)
            (read,) = thrift_get(client, "waits", auto_abort_msec=60_000)
            with switches_into(serving) as switches:
                assert thrift_call(client, method, queue_name="hub", ids={read.id}) == 1
            assert switches  # in the greenlet, where the change waits for its fsync
            head = [item.data for item in thrift_call(client, "get", queue_name="waits", max_items=2,
                                                      timeout_msec=0, auto_abort_msec=0)]
            assert head == ([b"1", b"2"] if method == "abort" else [b"2"])
    finally:
        state.close()


@pytest.mark.parametrize("protocol", sorted(ROUNDS))
def test_under_always_a_client_that_half_closes_during_a_get_s_wait_reads_the_replies_held_before_it(
        always_state: Any, pair: Any, protocol: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A put answered in the hub, its reply held for its round, then a get that waits; the client
    ends its side of the stream (it sends nothing more, it still reads). Its end cancels the wait,
    and the put's acknowledgement goes out once durable, as under `never` it went out before the
    wait, then the stream ends."""
    connection_type, one_round = ROUNDS[protocol]
    ours, client = pair
    fsyncs = Fsyncs(monkeypatch)
    connection = connection_type(always_state, ours, "test")
    serving = gevent.spawn(connection.run)
    one_round(client, "held", b"0")
    one_round(client, "empty", b"0")
    fsyncs.go.clear()  # the put's round waits
    if protocol == "memcache":
        client.sendall(b"set held 0 0 1\r\n1\r\nget empty/t=60000\r\n")
    else:
        client.sendall(framed(encode_call("binary", "put", queue_name="held", items=[b"1"], expiration_msec=0))
                       + framed(encode_call("binary", "get", queue_name="empty", max_items=1, timeout_msec=60_000,
                                            auto_abort_msec=0)))
    client.shutdown(socket.SHUT_WR)
    replies = connection.replies if protocol == "memcache" else connection.stream.replies
    with gevent.Timeout(STALL_S):
        while not connection.session.gone:  # the wait saw the end of the stream
            gevent.sleep(0.01)
        while not (serving.dead or replies._idle is not None):  # ended, or waiting for its replies
            gevent.sleep(0.01)
    fsyncs.go.set()
    assert serving.get(timeout=STALL_S) is True
    ours.close()  # as the listener closes it
    if protocol == "memcache":
        assert received(client, b"STORED\r\n") == b"STORED\r\n"
    else:
        assert read_framed_reply(client, "binary", "put") == 1
    assert client.recv(1) == b""
    assert always_state.collection.get("held").length == 1


@pytest.mark.parametrize("ends", ["closes", "resets"])
@pytest.mark.parametrize("waits", [False, True])
def test_under_always_a_get_with_auto_abort_whose_client_left_while_its_reply_waited_for_the_disk_puts_back(
        tmp_path: Path, pair: Any, monkeypatch: pytest.MonkeyPatch, waits: bool, ends: str) -> None:
    """A Kestrel 2 get with auto-abort journals its reads, so its reply waits for the log's fsync
    round; its client times out meanwhile (a slow disk, a server stopped during the round) and
    closes, or resets (a reply before the get left unread makes its close one). Its ids would reach
    nobody: the reply is not sent and its reads go back to the head, in order, with no error
    counted, rather than stay open until `auto_abort_msec`. Answered in the hub (every item there),
    or in the greenlet after a wait for more."""
    state = server_state_with(tmp_path, journal_format="kestrel2", max_errors=1)
    try:
        ours, client = pair
        fsyncs = Fsyncs(monkeypatch)
        connection = ThriftConnection(state, ours, "test")
        serving = gevent.spawn(connection.run)
        items = [b"a", b"b", b"c"]
        assert thrift_call(client, "put", queue_name="stalled", items=items, expiration_msec=0) == 3
        queue = state.collection.get("stalled")
        fsyncs.go.clear()  # from now on each round's fsyncs wait
        unread = framed(encode_call("binary", "get_version")) if ends == "resets" else b""
        client.sendall(unread + framed(encode_call("binary", "get", queue_name="stalled",
                                                   max_items=10 if waits else 3, timeout_msec=200 if waits else 0,
                                                   auto_abort_msec=600_000)))
        with gevent.Timeout(STALL_S):
            while len(state.reads_by_id.auto_aborts) == 0:  # answered: its reads have ids, its reply waits
                gevent.sleep(0.01)
        client.close()
        with gevent.Timeout(STALL_S):
            while ends == "resets" and not connection.session.closed:  # the reset ended the connection
                gevent.sleep(0.01)
        fsyncs.go.set()
        serving.join(timeout=STALL_S)
        assert serving.dead
        assert queue.stats()["open_transactions"] == 0
        assert [item.data for item in state.collection.remove("stalled", 10)] == items  # none poisoned
    finally:
        state.close()
