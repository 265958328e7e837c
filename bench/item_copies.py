"""Copies of a 1 KB or 64 KB item's bytes in user space, from the socket to the journal and from the
queue back to the socket, counted on each protocol: tests/server/test_item_copies.py holds the server
to one each way, bench/bench_aims.py reports the count beside the aim.

Each connection runs in this process on one end of a socket pair, against a real server state,
its queue and its journal. The copies are counted two ways:
- the receive lands in place: the scratch buffer receives go through (src/kestrel/service/socket_io.py),
  filled with a mark before the put, still holds it after, so no byte of the request passed there;
- what a put or a get allocates while it runs (tracemalloc's peak, the client's side made
  beforehand, the least of three pairs): the receive buffer the kernel fills, and one item's size,
  for the one copy (the item, or the reply that carries it), within a small bound. A second copy
  anywhere (a slice of a slice, the journal record made as one string, a reply joined to its frame
  header) is another item's size.

    python -m bench.item_copies     (one JSON line: each protocol and size; on the build PYTHONPATH names)
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import tempfile
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import gevent
import gevent.socket

from kestrel.service import socket_io
from kestrel.service.buffered_connection import Connection
from kestrel.service.config import from_mapping
from kestrel.service.memcache.handler import MemcacheConnection
from kestrel.service.session.server_state import ServerState
from kestrel.service.text.handler import TextConnection
from kestrel.service.thrift.handler import ThriftConnection
from kestrel.storage import disk
from kestrel.storage.kestrel2 import codec
from tests.support.thrift_wire import encode_call, framed

SIZES = (1024, 64 * 1024)
# What a request allocates besides its buffers: the session's and the queue's small objects.
SLACK = 24 * 1024
MARK = 0xA5


def item(n: int, size: int) -> bytes:
    """Item `n` of `size` bytes, with no line end in it (the text protocol's items are lines)."""
    return bytes(97 + i % 26 for i in range(size - 8)) + b"%08d" % n


class Client:
    """One connection of `kind` served in this process; replies are read into a buffer made
    beforehand, so that the client's own side allocates nothing while a request is measured."""

    def __init__(self, server: ServerState, kind: type[Connection], size: int) -> None:
        server_side, self.sock = gevent.socket.socketpair()
        self.sock.settimeout(10)
        self.connection = gevent.spawn(kind(server, socket_io.accepted(server_side), "test").run)
        self.reply = memoryview(bytearray(2 * size + 1024))

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
            if not n:
                raise ConnectionError("the server closed the connection")
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

    return int(gevent.spawn(measure).get())


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


# Each protocol: its connection, its put and get, and the server settings it is served with.
PROTOCOLS: dict[str, tuple[type[Connection], Exchange, Exchange, dict[str, str]]] = {
    "memcache": (MemcacheConnection, memcache_put, memcache_get, {}),
    "text": (TextConnection, text_put, text_get, {}),
    "thrift": (ThriftConnection, thrift_put, thrift_get, {}),
    "thrift compact": (ThriftConnection, compact_put, compact_get, {"thrift_protocol": "compact"}),
}


@dataclass(frozen=True)
class Copies:
    """What one put and one get of an item did with its bytes: each check that fails is a copy more."""

    size: int
    received_in_place: bool  # the scratch buffer still holds its mark: no byte passed through it
    stored_intact: bool  # the queue holds the item as sent
    journal_from_item: bool  # the journal was written from the very bytes the queue holds
    record_intact: bool  # the journal's last record is the item's ADDX, its bytes at the end
    reply_intact: bool  # the get's reply carried the item
    put_peak: int  # bytes the put held at once
    get_peak: int  # bytes the get held at once

    @property
    def put_bound(self) -> int:
        """The receive's room, one item, and the small objects of a request."""
        return socket_io.IN_PLACE_ROOM + self.size + SLACK

    @property
    def get_bound(self) -> int:
        """The get's request is small; its reply carries the one copy of the item (already counted
        in the queue's item): the room and the small objects."""
        return socket_io.IN_PLACE_ROOM + SLACK

    @property
    def socket_to_journal(self) -> int:
        """Copies found between the socket and the journal: the item itself, and one more for each
        check that failed (so a lower bound once above one)."""
        over = self.put_peak > self.put_bound
        return 1 + (not self.received_in_place) + (not self.journal_from_item) + over

    @property
    def queue_to_socket(self) -> int:
        """Copies found between the queue and the socket: the reply, and one more past the bound."""
        return 1 + (self.get_peak > self.get_bound)


# Put and get pairs measured: tracemalloc counts every thread of the process, so a block another
# thread holds meanwhile (a test's leftover work) lands in one pair's peak; the least of three is the
# request's own, where a copy more would show in each.
TRIES = 3


def count(server: ServerState, protocol: str, size: int, tries: int = TRIES) -> Copies:
    """`tries` puts and gets of a `size`-byte item over `protocol`, after a first put and get that
    make the queue and its journal and show the connection a large request: each check must hold
    every time, and each peak is the least of them."""
    kind, put, get, settings = PROTOCOLS[protocol]
    for name, value in settings.items():  # read by each connection as it starts
        setattr(server.config, name, value)
    client = Client(server, kind, size)
    try:
        first = item(1, size)
        client.ask(*put(first, True))
        if first not in client.answer(*get(first, True)):
            raise ValueError(f"{protocol}: the first item did not come back")
        measured = []
        for n in range(tries):
            measured.append(_put_and_get(server, client, put, get, item(2 + n, size)))
            server.collection.remove("q", 1)  # what a look left (memcache's peek): the next put is the head
    finally:
        client.close()
    checks = [f.name for f in dataclasses.fields(Copies) if f.type == "bool"]
    held = {name: all(getattr(m, name) for m in measured) for name in checks}
    return Copies(size=size, **held, put_peak=min(m.put_peak for m in measured),
                  get_peak=min(m.get_peak for m in measured))


def _put_and_get(server: ServerState, client: Client, put: Exchange, get: Exchange, data: bytes) -> Copies:
    """One put of `data` and one get of it, counted."""
    writev_all = disk.writev_all
    put_request, put_reply = put(data, False)
    get_request, get_reply = get(data, False)
    socket_io._SCRATCH[:] = bytes([MARK]) * len(socket_io._SCRATCH)
    written: list[bytes] = []

    def watched(fd: int, pieces: list[bytes]) -> int:
        written.extend(pieces)
        return writev_all(fd, pieces)

    # The get's first bytes come with the put (a client pipelining its next request), so the
    # receive buffer keeps its room while the put is read: a copy of the request beside it shows.
    put_request += get_request[:3]
    disk.writev_all = watched  # the journal's gathering writes, watched
    try:
        put_peak = allocated(lambda: client.ask(put_request, put_reply))
    finally:
        disk.writev_all = writev_all
    received_in_place = socket_io._SCRATCH.tobytes() == bytes([MARK]) * len(socket_io._SCRATCH)
    stored = server.collection.peek("q")
    stored_intact = stored is not None and stored.data == data
    journal_from_item = stored is not None and any(piece is stored.data for piece in written)
    record = journal_tail(server, "q", 1 + codec.ITEM_HEADER + 4 + len(data))
    record_intact = (record[0] == codec.ADDX and record.endswith(data)
                     and record[1:5] == (codec.ITEM_HEADER + len(data)).to_bytes(4, "little"))

    replies: list[int] = []
    get_peak = allocated(lambda: replies.append(client.ask(get_request[3:], get_reply)))
    reply_intact = data in client.reply[:replies[0]].tobytes()
    return Copies(len(data), received_in_place, stored_intact, journal_from_item, record_intact, reply_intact,
                  put_peak, get_peak)


def counted(protocols: tuple[str, ...] = ("thrift", "thrift compact", "memcache", "text")
            ) -> Iterator[tuple[str, Copies]]:
    """(protocol, copies) of each protocol and size, each on a server state of its own."""
    for protocol in protocols:
        for size in SIZES:
            with tempfile.TemporaryDirectory(prefix="kestrel-copies-") as home:
                server = ServerState(from_mapping({"queue_path": home}, home))
                server.collection.load()
                try:
                    yield protocol, count(server, protocol, size)
                finally:
                    server.close()


def main() -> None:
    from kestrel.service.logs import configure_logging

    configure_logging("warning")
    if socket_io.receive_in_place is None:
        print(json.dumps({"error": "built without a C compiler: receives go through the scratch buffer"}))
        return
    print(json.dumps([{"protocol": protocol, **dataclasses.asdict(copies),
                       "socket_to_journal": copies.socket_to_journal,
                       "queue_to_socket": copies.queue_to_socket} for protocol, copies in counted()]))


if __name__ == "__main__":
    main()
