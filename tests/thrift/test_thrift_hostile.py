"""Hostile Thrift requests: lengths and counts that lie, batches too large, names that are not UTF-8.

Each is answered with a clear TApplicationException (or a closed connection), allocates nothing it
was not sent, and leaves other clients served.
"""

from __future__ import annotations

import socket
import struct
import time
from typing import Any

import pytest
from thriftpy2.thrift import TApplicationException

from tests.conftest import STALL_S, ServerProcess, wait_until
from tests.support.clients import thrift
from tests.support.thrift_wire import closed_or_silent, encode_call, framed, read_framed_reply, rss_kb
from tests.support.wire import shared_server  # noqa: F401  (the module's `server`)

BIG = 0x7FFFFFFF


client = thrift


def raw(srv: ServerProcess) -> socket.socket:
    return socket.create_connection(("127.0.0.1", srv.thrift_port), timeout=5)


def exchange(srv: ServerProcess, payload: bytes, protocol: str, method: str) -> Any:
    with raw(srv) as s:
        s.sendall(framed(payload))
        return read_framed_reply(s, protocol, method)


def assert_good_client_served(srv: ServerProcess, protocol: str = "binary") -> None:
    with client(srv, protocol) as c:
        started = time.monotonic()
        assert c.put("good", [b"g"], 0) == 1
        assert [i.data for i in c.get("good", 1, 0, 0)] == [b"g"]
        assert time.monotonic() - started < STALL_S


@pytest.mark.parametrize("protocol", ["binary", "compact"])
def test_an_item_longer_than_its_frame_is_refused_not_padded_with_server_memory(
        server_factory: Any, protocol: str) -> None:
    srv = server_factory({"thrift_protocol": protocol})
    with client(srv, protocol) as other:
        other.put("secret", [b"S3CRET-OF-ANOTHER-CLIENT" * 40], 0)
    honest = encode_call(protocol, "put", queue_name="leak", items=[b"ABCDEFGH"], expiration_msec=0)
    announced_8 = b"\x00\x00\x00\x08ABCDEFGH" if protocol == "binary" else b"\x08ABCDEFGH"
    announced_1000 = b"\x00\x00\x03\xe8ABCDEFGH" if protocol == "binary" else b"\xe8\x07ABCDEFGH"
    assert announced_8 in honest
    reply = exchange(srv, honest.replace(announced_8, announced_1000), protocol, "put")
    assert isinstance(reply, TApplicationException)
    assert "1000 bytes" in reply.message and "left in the frame" in reply.message
    with client(srv, protocol) as c:
        assert c.peek("leak").items == 0
        assert c.get("leak", 10, 0, 0) == []


def binary_header(method: bytes) -> bytes:
    return b"\x80\x01\x00\x01" + struct.pack("!i", len(method)) + method + b"\x00\x00\x00\x01"


TINY_FRAMES = {
    # 42 bytes: a put announcing 2^31-1 items.
    "put-list-count": (b"put", binary_header(b"put") + b"\x0b\x00\x01\x00\x00\x00\x01q"
                       + b"\x0f\x00\x02\x0b" + struct.pack("!i", BIG) + b"\x00\x00\x00\x01x\x00\x00",
                       "announces 2147483647 elements"),
    # 49 bytes: a confirm whose set of ids announces 2^31-1 ids.
    "confirm-set-count": (b"confirm", binary_header(b"confirm") + b"\x0b\x00\x01\x00\x00\x00\x01q"
                          + b"\x0e\x00\x02\x0a" + struct.pack("!i", BIG) + struct.pack("!q", 5) + b"\x00\x00",
                          "announces 2147483647 elements"),
    # 30 bytes: a peek whose queue name announces 2^31-1 bytes.
    "peek-name-length": (b"peek", binary_header(b"peek") + b"\x0b\x00\x01" + struct.pack("!i", BIG) + b"abc",
                         "needs 2147483647 bytes"),
}


@pytest.mark.parametrize("case", sorted(TINY_FRAMES))
def test_tiny_frames_announcing_huge_counts_cost_nothing(server: ServerProcess, case: str) -> None:
    method, payload, reason = TINY_FRAMES[case]
    assert len(framed(payload)) == {"put-list-count": 42, "confirm-set-count": 49, "peek-name-length": 30}[case]
    assert server.proc is not None
    before = rss_kb(server.proc.pid)
    started = time.monotonic()
    reply = exchange(server, payload, "binary", method.decode())
    # Refused at once, not after waiting request_timeout (30 s) for elements that never come.
    assert time.monotonic() - started < STALL_S
    assert isinstance(reply, TApplicationException) and reason in reply.message
    assert rss_kb(server.proc.pid) - before < 20_000
    assert_good_client_served(server)


def test_compact_list_count_is_bounded_by_the_frame(server_factory: Any) -> None:
    srv = server_factory({"thrift_protocol": "compact"})
    honest = encode_call("compact", "put", queue_name="q", items=[b"x"], expiration_msec=0)
    one_binary = b"\x19\x18\x01x"  # field 2 list, header: 1 element of binary, then b"x"
    assert one_binary in honest
    huge = b"\x19\xf8\xff\xff\xff\xff\x07\x01x"  # the same list announcing 2^31-1 elements
    reply = exchange(srv, honest.replace(one_binary, huge), "compact", "put")
    assert isinstance(reply, TApplicationException) and "2147483647" in reply.message
    assert_good_client_served(srv, "compact")


def test_batches_are_bounded_by_max_batch_items_and_max_batch_bytes(server_factory: Any) -> None:
    srv = server_factory({"max_batch_items": 10, "max_batch_bytes": 100})
    with client(srv) as c:
        with pytest.raises(TApplicationException, match="over max_batch_items 10"):
            c.put("batch", [b""] * 11, 0)
        with pytest.raises(TApplicationException, match="max_batch_bytes 100"):
            c.put("batch", [b"x" * 60, b"y" * 60], 0)
        with pytest.raises(TApplicationException, match="over max_batch_items 10"):
            c.confirm("batch", set(range(1, 12)))
        assert c.put("batch", [b"z" * 10] * 10, 0) == 10  # at the limits: accepted
        assert len(c.get("batch", 1000, 0, 0)) == 10  # one get hands out at most max_batch_items
        assert c.peek("batch").items == 0


def test_a_queue_name_that_is_not_utf8_gets_an_error_naming_the_rule(server: ServerProcess) -> None:
    payload = encode_call("binary", "peek", queue_name="ab").replace(b"\x00\x00\x00\x02ab", b"\x00\x00\x00\x02\xff\xfe")
    with raw(server) as s:
        s.sendall(framed(payload))
        reply = read_framed_reply(s, "binary", "peek")
        assert isinstance(reply, TApplicationException)
        assert "not valid UTF-8" in reply.message and "queue_name" in reply.message
        s.sendall(framed(encode_call("binary", "peek", queue_name="ab")))  # the connection goes on
        assert read_framed_reply(s, "binary", "peek").items == 0
    log = server.log()
    assert "Traceback" not in log and '"level": "error"' not in log


def test_an_unframed_client_on_the_framed_port_is_told_so(server: ServerProcess) -> None:
    with raw(server) as s:
        s.sendall(encode_call("binary", "get_version"))
        assert closed_or_silent(s)
    wait_until(lambda: "looks like an unframed (buffered) binary-protocol client" in server.log(), "the server to log the unframed client")
    assert "-2147418111" not in server.log()
    assert_good_client_served(server)


@pytest.mark.parametrize("protocol", ["binary", "compact"])
def test_a_framed_client_on_the_buffered_binary_port_is_told_so(server_factory: Any, protocol: str) -> None:
    """A frame's size is read as an unversioned binary header's name length; the name it announces
    is the client's whole message, which a compact one begins with its protocol id, not `\x80\x01`."""
    srv = server_factory({"thrift_transport": "buffered"})
    with raw(srv) as s:
        s.sendall(framed(encode_call(protocol, "get_version")))
        assert closed_or_silent(s)
    wait_until(lambda: f"looks like a framed {protocol}-protocol client" in srv.log(),
               "the server to log the framed client")


@pytest.mark.parametrize("protocol", ["binary", "compact"])
def test_buffered_transport_refuses_a_lying_length_and_closes(server_factory: Any, protocol: str) -> None:
    srv = server_factory({"thrift_transport": "buffered", "thrift_protocol": protocol,
                          "max_frame_size": "64KB"})
    honest = encode_call(protocol, "put", queue_name="leak", items=[b"ABCDEFGH"], expiration_msec=0)
    announced_8 = b"\x00\x00\x00\x08ABCDEFGH" if protocol == "binary" else b"\x08ABCDEFGH"
    too_long = b"\x00\x0f\x42\x40ABCDEFGH" if protocol == "binary" else b"\xc0\x84\x3dABCDEFGH"  # 1,000,000
    with raw(srv) as s:
        s.sendall(honest.replace(announced_8, too_long))
        reply = s.recv(65536)
        assert b"left in the request (max_frame_size)" in reply
        assert closed_or_silent(s)
    with client(srv, protocol, "buffered") as c:
        assert c.peek("leak").items == 0
