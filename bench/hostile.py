"""Hostile neighbours for bench/bench_fairness.py: clients that send, in a loop, the largest requests
the server's limits let through, or that drop their connections mid-request; and the light clients
whose put + get rounds are timed beside them.

Each neighbour runs in a process of its own (a thread would share the interpreter lock with the
light client, which would then measure that wait instead of the server's) until told to stop.
"""

from __future__ import annotations

import multiprocessing
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from thrift.Thrift import TType
from thriftpy2.protocol import TBinaryProtocol, TCompactProtocol
from thriftpy2.transport import TBufferedTransport, TFramedTransport, TSocket

from kestrel.service.config import ServerConfig
from kestrel.service.thrift.protocol import MAX_DEPTH, MAX_FIELDS
from tests.support.clients import thrift_client
from tests.support.thrift_wire import encode_message, framed

ITEM = b"x" * 128  # a light client's item
# The limits of a server on the defaults, which the benchmark's servers keep.
MAX_ITEMS = ServerConfig.max_batch_items
MAX_BYTES = min(ServerConfig.max_frame_size, ServerConfig.max_batch_bytes)
MAX_LINE = ServerConfig.max_line_length


def thrift_frames(protocol: str) -> dict[str, bytes]:
    """`get_version` calls (whose reply is small and whose work is all in the reading) carrying, in a
    field the contract lacks, as much as one message may hold: max_batch_items elements in all,
    MAX_FIELDS fields, MAX_DEPTH levels of nesting, max_frame_size bytes."""
    def call(value: tuple[int, Any]) -> bytes:
        return encode_message(protocol, "get_version", [(9, *value)])
    strings = (MAX_BYTES - 1024) // MAX_ITEMS - 4
    nested: tuple[int, Any] = (TType.LIST, (TType.I32, [7] * (MAX_ITEMS - MAX_DEPTH)))
    for _ in range(MAX_DEPTH - 2):
        nested = (TType.LIST, (nested[0], [nested[1]]))
    per_field = MAX_ITEMS // (MAX_FIELDS - 1)
    return {
        "empty structs": call((TType.LIST, (TType.STRUCT, [[]] * MAX_ITEMS))),
        "i64s": call((TType.LIST, (TType.I64, [-1] * MAX_ITEMS))),
        "strings": call((TType.LIST, (TType.STRING, [b"s" * strings] * MAX_ITEMS))),
        "map of lists": call((TType.MAP, (TType.I32, TType.LIST, [(n, (TType.BOOL, [True] * 98))
                                                                  for n in range(MAX_ITEMS // 100)]))),
        "nested lists": call(nested),
        "fields": call((TType.STRUCT, [(n, TType.LIST, (TType.STRUCT, [[]] * per_field))
                                       for n in range(1, MAX_FIELDS - 1)])),
    }


def send_thrift(port: int, protocol: str, transport: str, messages: list[bytes]) -> Callable[[], None]:
    """A client sending `messages` in turn, each once its reply to the last is read."""
    def run() -> None:
        sock = socket.create_connection(("127.0.0.1", port), timeout=120)
        trans = TSocket()
        trans.sock = sock
        reader = (TFramedTransport if transport == "framed" else TBufferedTransport)(trans)
        proto = (TBinaryProtocol if protocol == "binary" else TCompactProtocol)(reader)
        wire = [framed(m) if transport == "framed" else m for m in messages]
        while True:
            for request in wire:
                sock.sendall(request)
                proto.read_message_begin()
                proto.skip(TType.STRUCT)
                proto.read_message_end()
    return run


def memcache_lines(port: int) -> Callable[[], None]:
    """A client sending `get` lines of max_line_length bytes, each once the last is answered."""
    line = b"get " + b"q" * (MAX_LINE - 6) + b"\r\n"
    return _memcache(port, [line])


def memcache_values(port: int) -> Callable[[], None]:
    """A client setting an item of max_frame_size bytes and getting it back, again and again."""
    size = MAX_BYTES
    return _memcache(port, [b"set big 0 0 %d\r\n" % size + b"v" * size + b"\r\n", b"get big\r\n"])


def _memcache(port: int, requests: list[bytes]) -> Callable[[], None]:
    def run() -> None:
        sock = socket.create_connection(("127.0.0.1", port), timeout=120)
        while True:
            for request in requests:
                sock.sendall(request)
                reply, end = b"", b"END\r\n" if request.startswith(b"get big") else b"\r\n"
                while not reply.endswith(end):
                    got = sock.recv(1 << 20)
                    if not got:
                        raise EOFError(f"the server closed the connection after {request[:20]!r}")
                    reply += got
    return run


def drop_mid_frame(port: int, request_start: bytes) -> Callable[[], None]:
    """A client connecting, sending `request_start` (a request cut short) and closing, again and
    again: each connection accepted, read and ended by the server."""
    def run() -> None:
        while True:
            with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
                sock.sendall(request_start)
    return run


def thrift_cut(protocol: str, transport: str) -> bytes:
    """The first half of a put of 64 KB: its frame announces all of it."""
    message = encode_message(protocol, "put", [(1, TType.STRING, b"cut"),
                                                (2, TType.LIST, (TType.STRING, [b"c" * 1024] * 64))])
    whole = framed(message) if transport == "framed" else message
    return whole[:len(whole) // 2]


MEMCACHE_CUT = b"set cut 0 0 65536\r\n" + b"c" * 32768


@contextmanager
def neighbour(run: Callable[[], None] | None) -> Iterator[None]:
    """`run` in a process of its own for the block (nothing with None)."""
    if run is None:
        yield
        return
    proc = multiprocessing.get_context("fork").Process(target=run, daemon=True)
    proc.start()
    try:
        time.sleep(0.5)  # under way
        if not proc.is_alive():
            raise RuntimeError(f"the neighbour exited with {proc.exitcode}")
        yield
        if not proc.is_alive():
            raise RuntimeError(f"the neighbour exited with {proc.exitcode} during the rounds")
    finally:
        proc.kill()
        proc.join()


class ThriftLight:
    """A client putting one item and getting it back, one call at a time."""

    def __init__(self, port: int, protocol: str, transport: str) -> None:
        self.client = thrift_client(port, protocol=protocol, transport=transport, timeout_ms=30_000)

    def round(self) -> float:
        started = time.perf_counter()
        self.client.put("light", [ITEM], 0)
        items = self.client.get("light", 1, 0, 0)
        elapsed = time.perf_counter() - started
        assert [i.data for i in items] == [ITEM], items
        return elapsed

    def close(self) -> None:
        self.client.close()


class MemcacheLight:
    """A client setting one item and getting it back, one command at a time."""

    SET = b"set light 0 0 %d\r\n%s\r\n" % (len(ITEM), ITEM)
    GET = b"get light\r\n"
    VALUE = b"VALUE light 0 %d\r\n%s\r\nEND\r\n" % (len(ITEM), ITEM)

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def _exchange(self, request: bytes, reply: bytes) -> None:
        self.sock.sendall(request)
        got = b""
        while len(got) < len(reply):
            chunk = self.sock.recv(65536)
            if not chunk:
                raise EOFError("the server closed the connection")
            got += chunk
        assert got == reply, got

    def round(self) -> float:
        started = time.perf_counter()
        self._exchange(self.SET, b"STORED\r\n")
        self._exchange(self.GET, self.VALUE)
        return time.perf_counter() - started

    def close(self) -> None:
        self.sock.close()
