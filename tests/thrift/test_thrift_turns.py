"""A Thrift message as large as the limits allow is read in pieces, other clients served between them.

Each element and field of a message costs the event loop a step of Python, read or skipped: the
largest message the limits let through (max_batch_items elements) took 6-20 ms of the compiled
build and 21-58 ms of the pure one (bench/README.md), during which no other client was served. Here two
connections are served in this process on socket pairs, each request already waiting when the
loop first runs them; the one of the large message runs first. How long anything takes is
bench/bench_fairness.py's to measure; this checks the order, which the loop's turns decide.
"""

from __future__ import annotations

import functools
from typing import Any

import gevent
import gevent.socket
import pytest
from thrift.Thrift import TType

from kestrel.service.socket_io import accepted
from kestrel.service.thrift.handler import ThriftConnection
from kestrel.service.thrift.messages import METHODS, read_args
from kestrel.service.thrift.protocol import PAUSE_EVERY, PROTOCOLS
from tests.conftest import STALL_S
from tests.support.thrift_wire import encode_call, encode_message, framed, read_framed_reply
from tests.support.wire import readable_now

MAX_ITEMS = 100_000  # max_batch_items, the default
# The slowest values for the bytes they take, within a socket's buffer: an empty struct is one byte
# in either protocol, an i64 of -1 one byte in the compact protocol.
LARGEST = {
    "binary": (TType.LIST, (TType.STRUCT, [[]] * MAX_ITEMS)),
    "compact": (TType.LIST, (TType.I64, [-1] * MAX_ITEMS)),
}


@pytest.mark.parametrize("protocol", ["binary", "compact"])
def test_another_client_is_answered_while_a_large_message_is_being_read(server_state: Any, protocol: str) -> None:
    server_state.config.thrift_protocol = protocol
    large = framed(encode_message(protocol, "get_version", [(9, *LARGEST[protocol])]))
    assert len(large) < 200_000  # the whole message waits in the socket before the loop runs
    (large_end, large_client), (light_end, light_client) = (gevent.socket.socketpair() for _ in range(2))
    large_client.sendall(large)
    light_client.sendall(framed(encode_call(protocol, "get_version")))
    light_client.settimeout(STALL_S)

    def light() -> tuple[Any, bool]:
        reply = read_framed_reply(light_client, protocol, "get_version")
        return reply, not readable_now(large_client)

    reading = gevent.spawn(light)
    gevent.idle()  # the light client waits for its reply before the server runs
    serving = [gevent.spawn(ThriftConnection(server_state, accepted(end), f"peer:{n}").run)
               for n, end in enumerate((large_end, light_end))]
    try:
        version, large_unanswered = reading.get()
        assert isinstance(version, str)
        assert large_unanswered, "the large message was read whole before the other client's"
        large_client.settimeout(STALL_S)
        assert read_framed_reply(large_client, protocol, "get_version") == version
    finally:
        for sock in (large_client, light_client):
            sock.close()
        gevent.joinall(serving, timeout=STALL_S)


@functools.cache
def _messages(protocol: str) -> dict[str, tuple[bytes, int]]:
    """Messages read or skipped value by value, and how many values each holds."""
    lists = (TType.LIST, (TType.LIST, [(TType.BOOL, [True] * 99)] * 1000))
    messages = {
        "skipped structs": (encode_message(protocol, "get_version", [(9, *LARGEST["binary"])]), MAX_ITEMS),
        "skipped lists": (encode_message(protocol, "peek", [(9, *lists), (1, TType.STRING, b"q")]), 100_000),
        "skipped fields": (encode_message(protocol, "get_version",
                                          [(9, TType.STRUCT, [(n, TType.I32, n) for n in range(1, 1000)])]), 1000),
        "ids": (encode_call(protocol, "confirm", queue_name="q", ids=set(range(50_000))), 50_000),
    }
    if protocol == "compact":  # the binary protocol's list of items is one compiled step
        messages["items"] = (encode_call(protocol, "put", queue_name="q", items=[b"i"] * 50_000,
                                         expiration_msec=0), 50_000)
    return messages


@pytest.mark.parametrize(("protocol", "kind"), [(p, k) for p in ("binary", "compact") for k in _messages(p)])
def test_the_readers_offer_a_pause_every_so_many_values(protocol: str, kind: str) -> None:
    message, values = _messages(protocol)[kind]
    at: list[int] = []  # where the reader was at each pause
    reader = PROTOCOLS[protocol][0](message, len(message), len(message), MAX_ITEMS, 16 << 20,
                                    pause=lambda: at.append(reader.pos))
    method, _, _ = reader.read_message_begin()
    read_args(reader, METHODS[method])
    assert reader.pos == len(message)
    assert len(at) >= values // PAUSE_EVERY
    assert at == sorted(at)


def test_the_binary_readers_python_list_of_items_offers_pauses_too() -> None:
    """The list of a put's items where the compiled loop declines (or the build has none)."""
    put = encode_call("binary", "put", queue_name="q", items=[b"i"] * 50_000, expiration_msec=0)
    at: list[int] = []
    reader = PROTOCOLS["binary"][0](put, len(put), len(put), MAX_ITEMS, 16 << 20,
                                    pause=lambda: at.append(reader.pos))
    start = put.index(b"\x0f\x00\x02\x0b") + 8  # the items list's header
    reader.pos = start
    assert reader.read_binary_list_python(50_000, "items") == [b"i"] * 50_000
    assert len(at) >= 50_000 // PAUSE_EVERY
