"""A 1 KB or 64 KB item's bytes are copied once in user space on their way from the socket to the journal,
and once from the queue to the socket, on every protocol.

Each connection runs in this process on one end of a socket pair, against a real server state,
its queue and its journal. The copies are counted two ways:
- the receive lands in place: the scratch buffer receives go through (src/kestrel/service/socket_io.py),
  filled with a mark before the put, still holds it after, so no byte of the request passed there;
- what a put or a get allocates while it runs (tracemalloc's peak, the client's side made
  beforehand): the receive buffer the kernel fills, and one item's size, for the one copy (the
  item, or the reply that carries it), within a small bound. A second copy anywhere (a slice of a
  slice, the journal record made as one string, a reply joined to its frame header) is another
  item's size.
"""

from __future__ import annotations

import gc
import os
import tracemalloc
from collections.abc import Callable

import gevent
import gevent.socket
import pytest

from kestrel.service import socket_io
from kestrel.service.buffered_connection import Connection
from kestrel.service.memcache.handler import MemcacheConnection
from kestrel.service.session.server_state import ServerState
from kestrel.service.text.handler import TextConnection
from kestrel.service.thrift.handler import ThriftConnection
from kestrel.storage.kestrel2 import codec
from tests.support.thrift_wire import encode_call, framed

pytestmark = pytest.mark.skipif(socket_io.lengthen is None,
                                reason="built without a C compiler: receives go through the scratch buffer")

SIZE = 64 * 1024
# What a request allocates besides its buffers: the session's and the queue's small objects.
SLACK = 24 * 1024
MARK = 0xA5


def item(n: int, size: int = SIZE) -> bytes:
    """Item `n` of `size` bytes, with no line end in it (the text protocol's items are lines)."""
    return bytes(97 + i % 26 for i in range(size - 8)) + b"%08d" % n


class Client:
    """One connection of `kind` served in this process; replies are read into a buffer made
    beforehand, so that the client's own side allocates nothing while a request is measured."""

    def __init__(self, server: ServerState, kind: type[Connection]) -> None:
        server_side, self.sock = gevent.socket.socketpair()
        self.sock.settimeout(10)
        self.connection = gevent.spawn(kind(server, socket_io.accepted(server_side), "test").run)
        self.reply = memoryview(bytearray(2 * SIZE))

    def ask(self, request: bytes, reply_size: int | None) -> int:
        """Send `request`, read a reply of `reply_size` bytes (None: one Thrift frame) into `reply`;
        its size."""
        self.sock.sendall(request)
        got = 0
        if reply_size is None:
            got = self._read(0, 4)
            reply_size = 4 + int.from_bytes(self.reply[:4], "big")
        return self._read(got, reply_size)

    def answer(self, request: bytes, reply_size: int | None) -> bytes:
        return self.reply[:self.ask(request, reply_size)].tobytes()

    def _read(self, got: int, size: int) -> int:
        while got < size:
            n = self.sock.recv_into(self.reply[got:], size - got)
            assert n, "the server closed the connection"
            got += n
        return got

    def close(self) -> None:
        self.sock.close()
        self.connection.join(5)


def allocated(action: Callable[[], object]) -> int:
    """The most memory `action` held at once beyond what was there before it. It runs in a greenlet
    of its own, as shallow as the connection's: switching between them then saves little of either
    stack (greenlet keeps a switched-out stack's part in memory tracemalloc sees)."""

    def measure() -> int:
        gc.collect()
        tracemalloc.start()
        try:
            tracemalloc.reset_peak()
            action()
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    return gevent.spawn(measure).get()


def journal_tail(server: ServerState, queue: str, n: int) -> bytes:
    with open(os.path.join(server.config.queue_path, queue), "rb") as f:
        f.seek(-n, os.SEEK_END)
        return f.read()


# Each protocol's put and get of one item: the request and the reply's size (None: a Thrift frame).
# A memcache get of the second item is one the pipelined scanner leaves to the command parser.
Exchange = Callable[[bytes, bool], tuple[bytes, int | None]]


def memcache_put(data: bytes, first: bool) -> tuple[bytes, int | None]:
    return b"set q 0 0 %d\r\n%s\r\n" % (len(data), data), len(b"STORED\r\n")


def memcache_get(data: bytes, first: bool) -> tuple[bytes, int | None]:
    key = b"q" if first else b"q/peek"
    return b"get %s\r\n" % key, len(b"VALUE %s 0 %d\r\n%s\r\nEND\r\n" % (key, len(data), data))


def text_put(data: bytes, first: bool) -> tuple[bytes, int | None]:
    return b"put q:\n%s\n\n" % data, len(b"+1\n")


def text_get(data: bytes, first: bool) -> tuple[bytes, int | None]:
    return b"get q\n", len(data) + 2


def thrift_put(data: bytes, first: bool) -> tuple[bytes, int | None]:
    return framed(encode_call("binary", "put", queue_name="q", items=[data], expiration_msec=0)), None


def thrift_get(data: bytes, first: bool) -> tuple[bytes, int | None]:
    call = encode_call("binary", "get", queue_name="q", max_items=1, timeout_msec=0, auto_abort_msec=0)
    return framed(call), None


def compact_put(data: bytes, first: bool) -> tuple[bytes, int | None]:
    return framed(encode_call("compact", "put", queue_name="q", items=[data], expiration_msec=0)), None


def compact_get(data: bytes, first: bool) -> tuple[bytes, int | None]:
    call = encode_call("compact", "get", queue_name="q", max_items=1, timeout_msec=0, auto_abort_msec=0)
    return framed(call), None


PROTOCOLS: dict[str, tuple[type[Connection], Exchange, Exchange]] = {
    "memcache": (MemcacheConnection, memcache_put, memcache_get),
    "text": (TextConnection, text_put, text_get),
    "thrift": (ThriftConnection, thrift_put, thrift_get),
    "thrift compact": (ThriftConnection, compact_put, compact_get),
}


@pytest.mark.parametrize("size", [1024, SIZE])
@pytest.mark.parametrize("protocol", sorted(PROTOCOLS))
def test_a_1_kb_or_64_kb_item_is_copied_once_from_the_socket_to_the_journal_and_once_back(
        server_state: ServerState, protocol: str, size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The peak's bound tells one copy from two at 64 KB; at 1 KB the other checks count."""
    kind, put, get = PROTOCOLS[protocol]
    if protocol == "thrift compact":
        monkeypatch.setattr(server_state.config, "thrift_protocol", "compact")
    client = Client(server_state, kind)
    try:
        # A first item: the queue and its journal are made, and the connection has seen a large request.
        first = item(1, size)
        client.ask(*put(first, True))
        assert first in client.answer(*get(first, True))

        second = item(2, size)
        put_request, put_reply = put(second, False)
        get_request, get_reply = get(second, False)
        socket_io._SCRATCH[:] = bytes([MARK]) * len(socket_io._SCRATCH)
        written: list[bytes] = []
        writev = os.writev
        monkeypatch.setattr(os, "writev", lambda fd, pieces: writev(fd, written.extend(pieces) or pieces))
        # The get's first bytes come with the put (a client pipelining its next request), so the
        # receive buffer keeps its room while the put is read: a copy of the request beside it shows.
        put_request += get_request[:3]
        put_peak = allocated(lambda: client.ask(put_request, put_reply))
        monkeypatch.setattr(os, "writev", writev)
        # The request was received in place, parsed into one new item, which the journal was written from.
        assert socket_io._SCRATCH.tobytes() == bytes([MARK]) * len(socket_io._SCRATCH), \
            "the request went through the scratch buffer: a copy more"
        assert put_peak <= socket_io.IN_PLACE_ROOM + size + SLACK, f"{put_peak:,} bytes held at once"
        stored = server_state.collection.peek("q")
        assert stored is not None and stored.data == second
        assert any(piece is stored.data for piece in written), "the journal was written from a copy"
        record = journal_tail(server_state, "q", 1 + codec.ITEM_HEADER + 4 + size)
        assert record[0] == codec.ADDX and record[1:5] == (codec.ITEM_HEADER + size).to_bytes(4, "little")
        assert record.endswith(second)

        replies: list[int] = []
        get_peak = allocated(lambda: replies.append(client.ask(get_request[3:], get_reply)))
        assert second in client.reply[:replies[0]].tobytes()
        # The get's request is small; its reply carries the one copy of the item.
        assert get_peak <= socket_io.IN_PLACE_ROOM + SLACK, f"{get_peak:,} bytes held at once"
    finally:
        client.close()
