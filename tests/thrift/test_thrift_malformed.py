"""Calls no generated client sends, from outside, against the real server in each transport and
protocol: names that share a prefix with a method's, fields out of order, repeated, missing or of
another type, unknown fields holding nested containers, unversioned headers, one-way and reply
messages, integers past their type's range, and messages cut at every byte or sent in two pieces
split at every byte.

Each is answered as the contract and Apache Thrift's processors say (an unknown field or one of
another type skipped, the last of a repeated field taken, a left-out one at its default) or with a
TApplicationException naming what was wrong, or, where the message cannot be read to its end on an
unframed connection, a clean close; the connection goes on wherever the message was read to its
end, and another client is served throughout.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable
from typing import Any

import pytest
from thrift.Thrift import TMessageType, TType
from thriftpy2.thrift import TApplicationException
from thriftpy2.transport import TMemoryBuffer

from kestrel.contract import kestrel_thrift
from kestrel.service.thrift.protocol import MAX_FIELDS
from tests.conftest import STALL_S, ServerProcess
from tests.support.clients import thrift
from tests.support.thrift_wire import (
    PROTOCOLS,
    Field,
    closed_or_silent,
    encode_message,
    framed,
    varint,
    zigzag_varint,
)

UNKNOWN_METHOD = TApplicationException.UNKNOWN_METHOD
INVALID_MESSAGE_TYPE = TApplicationException.INVALID_MESSAGE_TYPE
PROTOCOL_ERROR = TApplicationException.PROTOCOL_ERROR
UNKNOWN = TApplicationException.UNKNOWN
SETTINGS = [(t, p) for t in ("framed", "buffered") for p in ("binary", "compact")]
MAX_BATCH_ITEMS = 1000  # small, so that a message past it is small too


@pytest.fixture(scope="module", params=SETTINGS, ids=[f"{t}-{p}" for t, p in SETTINGS])
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    transport, protocol = request.param
    srv = ServerProcess(tmp_path_factory.mktemp(f"{transport}-{protocol}"),
                        {"thrift_transport": transport, "thrift_protocol": protocol,
                         "max_batch_items": MAX_BATCH_ITEMS}).start()
    yield srv, transport, protocol
    srv.stop()


def put_fields(queue: bytes, *items: bytes) -> list[Field]:
    return [(1, TType.STRING, queue), (2, TType.LIST, (TType.STRING, list(items))), (3, TType.I32, 0)]


def get_fields(queue: bytes, max_items: int = 5) -> list[Field]:
    return [(1, TType.STRING, queue), (2, TType.I32, max_items)]


# An unknown field holding a map of lists of structs, each with a set, a double, a bool and a byte.
NESTED = (9, TType.MAP, (TType.STRING, TType.LIST, [
    (b"k", (TType.STRUCT, [[(1, TType.SET, (TType.I64, [1, 2])), (2, TType.DOUBLE, 0.5), (3, TType.BOOL, True),
                            (4, TType.BYTE, -1)]]))]))

Check = Callable[[Any], bool]


def error(kind: int, text: str) -> Check:
    return lambda reply: (isinstance(reply, TApplicationException) and reply.type == kind
                          and text in reply.message)


def equal(value: Any) -> Check:
    return lambda reply: reply == value


def datas(*expected: bytes) -> Check:
    return lambda reply: [item.data for item in reply] == list(expected)


def conversation(protocol: str, queue: bytes) -> list[tuple[str, bytes, Check]]:
    """(method whose result the reply carries, message, what the reply must be): every message is
    read to its end, so the connection goes on after each, framed or not."""
    calls: list[tuple[str, list[Field], int, bool, Check]] = [
        # names a byte short of a method's, a byte over, a byte off: unknown, as Thrift answers them
        *[(name, get_fields(queue), TMessageType.CALL, True, error(UNKNOWN_METHOD, f"unknown method {name!r}"))
          for name in ("ge", "gett", "get_", "get_versio", "get_versionn", "put\x00", "Put", "peek_item")],
        ("put", put_fields(queue, b"a")[::-1], TMessageType.CALL, True, equal(1)),  # fields in reverse order
        ("get", get_fields(queue), TMessageType.CALL, True, datas(b"a")),
        # a repeated field: the last one counts, as Apache Thrift's generated readers take it
        ("put", [*put_fields(queue, b"first"), (2, TType.LIST, (TType.STRING, [b"last"]))], TMessageType.CALL,
         True, equal(1)),
        ("get", get_fields(queue), TMessageType.CALL, True, datas(b"last")),
        ("put", put_fields(queue, b"x")[1:], TMessageType.CALL, True, error(UNKNOWN, "queue_name is missing")),
        ("put", [(1, TType.I32, 7), *put_fields(queue, b"x")[1:]], TMessageType.CALL, True,  # another type: skipped
         error(UNKNOWN, "queue_name is missing")),
        ("get", get_fields(queue)[:1], TMessageType.CALL, True, datas()),  # max_items left out: none
        ("put", [NESTED, *put_fields(queue, b"b"), NESTED], TMessageType.CALL, True, equal(1)),  # skipped
        # a one-way message or a reply is not a call of this contract: refused, nothing stored
        ("put", put_fields(queue, b"oneway"), TMessageType.ONEWAY, True,
         error(INVALID_MESSAGE_TYPE, "message type 4 is not a call")),
        ("get_version", [], TMessageType.REPLY, True, error(INVALID_MESSAGE_TYPE, "message type 2 is not a call")),
        ("put", put_fields(queue, b"c"), TMessageType.CALL, False, equal(1)),  # an unversioned header (binary)
        ("get", get_fields(queue), TMessageType.CALL, True, datas(b"b", b"c")),
        ("get_version", [(1, TType.STRING, b"no arguments")], TMessageType.CALL, True, lambda r: isinstance(r, str)),
    ]
    return [(name, encode_message(protocol, name, fields, mtype, seqid, strict), check)
            for seqid, (name, fields, mtype, strict, check) in enumerate(calls, start=1)]


def send_all(srv: ServerProcess, stream: bytes, cut: int | None = None) -> bytes:
    """Everything the server sends on a connection that sent `stream` (in two pieces split at
    `cut`, a moment apart) and closed for writing, up to the server's close."""
    with socket.create_connection(("127.0.0.1", srv.thrift_port), timeout=30) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if cut is not None:
            sock.sendall(stream[:cut])
            time.sleep(0.001)
            stream = stream[cut:]
        sock.sendall(stream)
        sock.shutdown(socket.SHUT_WR)
        received = bytearray()
        while chunk := sock.recv(65536):
            received += chunk
    return bytes(received)


def exchange(srv: ServerProcess, transport: str, protocol: str, calls: list[tuple[str, bytes, Check]],
             cut: int | None = None) -> list[tuple[int, Any]]:
    """Each call's (sequence id, result or TApplicationException): the messages sent pipelined on
    one connection (in two pieces split at `cut`, a moment apart), which is then closed for
    writing, and everything the server sends before it closes read and decoded in turn."""
    received = send_all(srv, b"".join(framed(m) if transport == "framed" else m for _, m, _ in calls), cut)
    proto = PROTOCOLS[protocol](TMemoryBuffer(received))
    replies = []
    for method, _, _ in calls:
        if transport == "framed":
            proto.trans.read(4)  # the frame's size: the decoder reads exactly the message after it
        _, mtype, seqid = proto.read_message_begin()
        if mtype == TMessageType.EXCEPTION:
            reply: Any = TApplicationException()
            reply.read(proto)
        else:
            result = getattr(kestrel_thrift.Kestrel, f"{method}_result")()
            result.read(proto)
            reply = result.success
        replies.append((seqid, reply))
    assert not proto.trans.read(1), "bytes after the last reply"
    return replies


def assert_good_client_served(srv: ServerProcess, transport: str, protocol: str) -> None:
    with thrift(srv, protocol, transport) as c:
        started = time.monotonic()
        assert c.put("good", [b"g"], 0) == 1
        assert [item.data for item in c.get("good", 1, 0, 0)] == [b"g"]
        assert time.monotonic() - started < STALL_S
    log = srv.log()
    assert "Traceback" not in log and '"level": "error"' not in log, log[-3000:]


def test_odd_calls_are_answered_as_thrift_answers_them_and_the_connection_goes_on(served: Any) -> None:
    srv, transport, protocol = served
    calls = conversation(protocol, b"odd")
    replies = exchange(srv, transport, protocol, calls)
    for seqid, ((method, message, check), (got_seqid, reply)) in enumerate(zip(calls, replies, strict=True), 1):
        assert got_seqid == seqid and check(reply), (method, message, reply)
    assert_good_client_served(srv, transport, protocol)


def test_pipelined_odd_calls_split_at_every_byte_get_the_same_replies(served: Any) -> None:
    srv, transport, protocol = served
    calls = conversation(protocol, b"split")
    whole = exchange(srv, transport, protocol, calls)
    size = sum(len(m) + (4 if transport == "framed" else 0) for _, m, _ in calls)
    for cut in range(1, size):
        assert list(map(repr, exchange(srv, transport, protocol, calls, cut))) == list(map(repr, whole)), cut
    assert_good_client_served(srv, transport, protocol)


MARK = 0x5A5A5A5A  # an i32 whose bytes are found in a message to change what precedes it


def _huge_inner_list(protocol: str) -> bytes:
    """A put whose unknown field 9, a list of lists of i32, has an inner list announcing 2^31-1."""
    call = encode_message(protocol, "put", [(9, TType.LIST, (TType.LIST, [(TType.I32, [MARK])])),
                                            *put_fields(b"cut", b"x")])
    if protocol == "binary":
        one = b"\x08\x00\x00\x00\x01" + struct.pack("!i", MARK)
        return call.replace(one, b"\x08\x7f\xff\xff\xff" + struct.pack("!i", MARK))
    one = b"\x15" + zigzag_varint(MARK)
    return call.replace(one, b"\xf5\xff\xff\xff\xff\x07" + zigzag_varint(MARK))


def _deep(depth: int) -> Field:
    field: Field = (1, TType.I32, 0)
    for _ in range(depth):
        field = (1, TType.STRUCT, [field])
    return (9, *field[1:])


def unreadable(protocol: str) -> list[tuple[str, bytes, str]]:
    """(method, message, what the error names) of messages that cannot be read to their end."""
    cases = [
        ("put", _huge_inner_list(protocol), "announces 2147483647 elements"),
        ("put", encode_message(protocol, "put", [_deep(40), *put_fields(b"cut", b"x")]), "nested deeper than 32"),
        ("put", encode_message(protocol, "put", [(1, TType.STRING, b"cut"), (2, TType.LIST, (TType.I32, [1, 2]))]),
         "items: expected elements of type 11, got 8"),
    ]
    # Each element and field costs a step of Python whether it is read or skipped, during which no
    # other client is served: a message's containers hold max_batch_items elements in all, its
    # structs MAX_FIELDS fields (with the default limits, 16 MB of empty structs took seconds).
    empty_structs = (TType.STRUCT, [[]] * (MAX_BATCH_ITEMS // 2 + 1))
    cases += [
        ("put", encode_message(protocol, "put", [(9, TType.LIST, (TType.LIST, [empty_structs] * 2)),
                                                 *put_fields(b"cut", b"x")]),
         f"the message's containers hold more than max_batch_items {MAX_BATCH_ITEMS} elements in all"),
        ("put", encode_message(protocol, "put", [(1, TType.STRING, b"cut"),
                                                 *[(2, TType.LIST, (TType.STRING, [b""] * (MAX_BATCH_ITEMS // 2 + 1)))] * 2]),
         f"the message's containers hold more than max_batch_items {MAX_BATCH_ITEMS} elements in all"),
        ("put", encode_message(protocol, "put", [*put_fields(b"cut", b"x"), *[(3, TType.I32, 0)] * MAX_FIELDS]),
         f"a message of more than {MAX_FIELDS} fields"),
        ("put", encode_message(protocol, "put", [(9, TType.STRUCT, [(n, TType.BOOL, True) for n in range(1100)]),
                                                 *put_fields(b"cut", b"x")]),
         f"a message of more than {MAX_FIELDS} fields"),
    ]
    unknown_type = encode_message(protocol, "put", [(9, TType.LIST, (TType.I32, [MARK])), *put_fields(b"cut", b"x")])
    if protocol == "binary":  # 5 is no type of the binary protocol's, 14 none of the compact's
        one = b"\x08\x00\x00\x00\x01" + struct.pack("!i", MARK)
        cases.append(("put", unknown_type.replace(one, b"\x05" + one[1:]), "has elements of unknown type 5"))
    else:
        one = b"\x15" + zigzag_varint(MARK)
        cases.append(("put", unknown_type.replace(one, b"\x1e" + one[1:]), "has the unknown compact type 14"))
    if protocol == "compact":  # ten varint bytes hold 70 bits: past an i64, refused as the i32 is
        peek = encode_message(protocol, "peek_items", [(1, TType.STRING, b"cut"), (2, TType.I64, 1 << 40),
                                                       (3, TType.I32, 5)])
        confirm = encode_message(protocol, "confirm", [(1, TType.STRING, b"cut"), (2, TType.SET, (TType.I64, [1 << 40]))])
        past = b"\xfe\xff\xff\xff\xff\xff\xff\xff\xff\x7f"  # zigzag: 2^69 - 1
        cases += [("peek_items", peek.replace(zigzag_varint(1 << 40), past), "an i64 of 590295810358705651711 is out of range"),
                  ("confirm", confirm.replace(zigzag_varint(1 << 40), past), "is out of range")]
    return cases


def test_a_message_that_cannot_be_read_to_its_end_is_refused_by_name(served: Any) -> None:
    """Framed, the frame says where the next call starts and the connection goes on; unframed, it
    cannot, so the connection closes after the reply."""
    srv, transport, protocol = served
    with thrift(srv, protocol, transport) as c:
        c.put("cut", [b"z"], 0)  # a queue to peek into
    for method, message, reason in unreadable(protocol):
        version = encode_message(protocol, "get_version", [], seqid=2)
        stream = framed(message) + framed(version) if transport == "framed" else message + version
        received = send_all(srv, stream)
        proto = PROTOCOLS[protocol](TMemoryBuffer(received))
        if transport == "framed":
            proto.trans.read(4)
        assert proto.read_message_begin() == (method, TMessageType.EXCEPTION, 1)
        reply = TApplicationException()
        reply.read(proto)
        assert reply.type == PROTOCOL_ERROR and reason in reply.message, (method, reply)
        if transport == "framed":  # the next call is answered
            proto.trans.read(4)
            assert proto.read_message_begin()[:2] == ("get_version", TMessageType.REPLY)
        else:
            assert not proto.trans.read(1)
    with thrift(srv, protocol, transport) as c:
        assert [item.data for item in c.get("cut", 10, 0, 0)] == [b"z"]  # none of the puts stored
    assert_good_client_served(srv, transport, protocol)


def test_a_call_cut_at_every_byte_is_refused_or_closed_and_stores_nothing(served: Any) -> None:
    """Framed, a frame holding the call up to the cut is answered with the shortfall named, where
    the message header is whole (else the connection closes), and the next frame is answered;
    unframed, the client's close in the middle of the call closes the connection, unanswered."""
    srv, transport, protocol = served
    call = encode_message(protocol, "put", [*put_fields(b"cut-put", b"abc"), NESTED])
    version = encode_message(protocol, "get_version", [], seqid=2)
    header_size = len(encode_message(protocol, "put", [])) - 1  # the message header: the empty struct's STOP off
    for cut in range(len(call)):
        stream = framed(call[:cut]) + framed(version) if transport == "framed" else call[:cut]
        received = send_all(srv, stream)
        if transport == "buffered" or cut < header_size:
            assert received == b"", cut
            continue
        proto = PROTOCOLS[protocol](TMemoryBuffer(received))
        proto.trans.read(4)
        assert proto.read_message_begin() == ("put", TMessageType.EXCEPTION, 1), cut
        reply = TApplicationException()
        reply.read(proto)
        assert reply.type == PROTOCOL_ERROR and "left in the frame" in reply.message, (cut, reply)
        proto.trans.read(4)
        assert proto.read_message_begin()[:2] == ("get_version", TMessageType.REPLY), cut
    with thrift(srv, protocol, transport) as c:
        assert c.get("cut-put", 10, 0, 0) == []
    assert_good_client_served(srv, transport, protocol)


@pytest.mark.parametrize("announced", [-1, 257, 1 << 30])
def test_a_method_name_of_an_impossible_length_closes_the_connection(served: Any, announced: int) -> None:
    srv, transport, protocol = served
    call = encode_message(protocol, "put", put_fields(b"cut-name", b"n"))
    if protocol == "binary":
        lied = call[:4] + struct.pack("!i", announced) + call[8:]
    else:  # after the protocol id, the version and type, and the one-byte sequence id: an unsigned varint
        lied = call[:3] + varint(announced & 0xFFFFFFFF) + call[4:]
    with socket.create_connection(("127.0.0.1", srv.thrift_port), timeout=30) as sock:
        sock.sendall(framed(lied) if transport == "framed" else lied)
        assert closed_or_silent(sock, STALL_S)
    assert_good_client_served(srv, transport, protocol)


@pytest.mark.parametrize("change", [-1, 1])
def test_a_method_name_a_byte_shorter_or_longer_than_announced_gets_an_error_or_a_close(
        served: Any, change: int) -> None:
    srv, transport, protocol = served
    call = encode_message(protocol, "put", put_fields(b"cut-name", b"n"))
    lied = (call[:4] + struct.pack("!i", 3 + change) + call[8:] if protocol == "binary"
            else call[:3] + bytes([3 + change]) + call[4:])
    received = send_all(srv, framed(lied) if transport == "framed" else lied)
    if received:
        proto = PROTOCOLS[protocol](TMemoryBuffer(received))
        if transport == "framed":
            proto.trans.read(4)
        assert proto.read_message_begin()[1] == TMessageType.EXCEPTION
    with thrift(srv, protocol, transport) as c:
        assert c.get("cut-name", 10, 0, 0) == []
    assert_good_client_served(srv, transport, protocol)
