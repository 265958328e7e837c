"""The server's Thrift readers and writers against thriftpy2's own encoding, and against garbage."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kestrel.contract import kestrel_thrift
from kestrel.service.thrift.messages import METHODS, encode_reply, read_args
from kestrel.service.thrift.protocol import PROTOCOLS, ThriftProtocolError
from tests.support.thrift_wire import decode_reply, encode_call

NAMES = st.text(min_size=1, max_size=20)
ITEMS = st.lists(st.binary(max_size=50), max_size=20)
I32 = st.integers(-(2**31), 2**31 - 1)
IDS = st.sets(st.integers(-(2**63), 2**63 - 1), max_size=20)
CALLS = st.one_of(
    st.builds(lambda q, i, e: ("put", {"queue_name": q, "items": i, "expiration_msec": e}), NAMES, ITEMS, I32),
    st.builds(lambda q, m, t, a: ("get", {"queue_name": q, "max_items": m, "timeout_msec": t,
                                          "auto_abort_msec": a}), NAMES, I32, I32, I32),
    st.builds(lambda q, i: ("confirm", {"queue_name": q, "ids": i}), NAMES, IDS),
    st.builds(lambda q, i: ("abort", {"queue_name": q, "ids": i}), NAMES, IDS),
    st.builds(lambda q: ("peek", {"queue_name": q}), NAMES),
    st.just(("get_version", {})),
)
PROTOCOL = st.sampled_from(["binary", "compact"])


def reader(protocol: str, data: bytes, **limits: Any) -> Any:
    return PROTOCOLS[protocol][0](data, len(data), len(data), limits.get("items", 100_000),
                                  limits.get("bytes", 16 << 20))


def decode(protocol: str, data: bytes, **limits: Any) -> tuple[str, int, dict[str, Any]]:
    """The call's name, message type and arguments by their names in the contract."""
    r = reader(protocol, data, **limits)
    name, mtype, _ = r.read_message_begin()
    args, problem = read_args(r, METHODS.get(name))
    assert problem is None
    return name, mtype, dict(zip(METHODS[name].names, args, strict=True))


@settings(max_examples=300, deadline=None)
@given(PROTOCOL, CALLS)
def test_calls_encoded_by_thriftpy2_decode_to_the_same_arguments(protocol: str, call: tuple[str, Any]) -> None:
    method, args = call
    name, mtype, decoded = decode(protocol, encode_call(protocol, method, seqid=77, **args))
    assert (name, mtype) == (method, 1)
    for key, value in args.items():
        got = decoded[key]
        assert (set(got) if isinstance(value, set) else got) == value


@settings(max_examples=300, deadline=None)
@given(PROTOCOL, CALLS, st.data())
def test_any_damage_is_a_protocol_error_never_a_crash(protocol: str, call: tuple[str, Any], data: Any) -> None:
    raw = bytearray(encode_call(protocol, call[0], **call[1]))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    try:
        r = reader(protocol, bytes(raw[:cut]))
        r.read_message_begin()
        read_args(r, METHODS.get(call[0]))
    except ThriftProtocolError:
        pass


@pytest.mark.parametrize("protocol", ["binary", "compact"])
def test_replies_decode_with_thriftpy2(protocol: str) -> None:
    writer = PROTOCOLS[protocol][1]
    items = [kestrel_thrift.Item(data=b"a" * n, id=(1 << 62) + n) for n in range(20)]
    assert [(i.data, i.id) for i in decode_reply(encode_reply(writer, METHODS["get"], 5, items),
                                                  protocol, "get")] == [(i.data, i.id) for i in items]
    info = kestrel_thrift.QueueInfo(head_item=None, items=3, bytes=-1, journal_bytes=2**40, age=0, waiters=1,
                                    open_transactions=2)
    assert decode_reply(encode_reply(writer, METHODS["peek"], 5, info), protocol, "peek") == info
    assert decode_reply(encode_reply(writer, METHODS["put"], 5, -7), protocol, "put") == -7
    assert decode_reply(encode_reply(writer, METHODS["get_version"], 5, "1.0 é"), protocol,
                        "get_version") == "1.0 é"


@pytest.mark.parametrize("protocol", ["binary", "compact"])
def test_unknown_fields_are_skipped(protocol: str) -> None:
    from thrift.protocol import TBinaryProtocol, TCompactProtocol
    from thrift.transport.TTransport import TMemoryBuffer

    buf = TMemoryBuffer()
    proto = (TBinaryProtocol.TBinaryProtocol if protocol == "binary" else TCompactProtocol.TCompactProtocol)(buf)
    proto.writeMessageBegin("peek", 1, 1)
    proto.writeStructBegin("peek_args")
    proto.writeFieldBegin("extra", 15, 9)  # a list of lists nobody asked for
    proto.writeListBegin(15, 2)
    for _ in range(2):
        proto.writeListBegin(10, 1)
        proto.writeI64(5)
        proto.writeListEnd()
    proto.writeListEnd()
    proto.writeFieldEnd()
    proto.writeFieldBegin("flag", 2, 4)  # a bool (folded into the field header in compact)
    proto.writeBool(True)
    proto.writeFieldEnd()
    proto.writeFieldBegin("queue_name", 11, 1)
    proto.writeString("q")
    proto.writeFieldEnd()
    proto.writeFieldBegin("queue_name_as_i32", 8, 1)  # a known id with the wrong type: skipped
    proto.writeI32(3)
    proto.writeFieldEnd()
    proto.writeFieldStop()
    proto.writeStructEnd()
    assert decode(protocol, buf.getvalue()) == ("peek", 1, {"queue_name": "q"})


def test_counts_and_lengths_are_checked_before_reading() -> None:
    put = encode_call("binary", "put", queue_name="q", items=[b"x"] * 5, expiration_msec=0)
    with pytest.raises(ThriftProtocolError, match="over max_batch_items 4"):
        decode("binary", put, items=4)
    with pytest.raises(ThriftProtocolError, match="max_batch_bytes 4"):
        decode("binary", put, bytes=4)
    assert decode("binary", put, items=5, bytes=5)[2]["items"] == [b"x"] * 5
    with pytest.raises(ThriftProtocolError, match="element 4 needs 10 bytes but only 9 are left in the frame"):
        decode("binary", put.replace(b"\x00\x00\x00\x01x\x08", b"\x00\x00\x00\x0ax\x08"))
    nested = b"\x80\x01\x00\x01\x00\x00\x00\x04peek\x00\x00\x00\x01" + b"\x0c\x00\x09" * 40 + b"\x00" * 41
    with pytest.raises(ThriftProtocolError, match="nested deeper"):
        decode("binary", nested)


@settings(max_examples=200, deadline=None)
@given(PROTOCOL, st.lists(st.tuples(st.binary(max_size=300), st.sampled_from([0, 1, -1, 2**63 - 1, -(2**63)])),
                          max_size=30))
def test_get_replies_from_tuples_are_the_bytes_of_items(protocol: str, got: list[tuple[bytes, int]]) -> None:
    """The handler's (data, id) tuples take the joined fast path; Item objects the general one."""
    writer = PROTOCOLS[protocol][1]
    items = [kestrel_thrift.Item(data=data, id=read_id) for data, read_id in got]
    fast = encode_reply(writer, METHODS["get"], 9, got)
    assert fast == encode_reply(writer, METHODS["get"], 9, items)
    assert [(i.data, i.id) for i in decode_reply(fast, protocol, "get")] == got


def _read_both(data: bytes, method: str) -> list[Any]:
    """`read_args` of a whole binary frame (the one-loop path) and of the same bytes read field by
    field (as unframed transport reads them): each the arguments and position, or the error."""
    from kestrel.service.thrift.protocol import BinaryReader

    answers: list[Any] = []
    for more in (None, lambda need: len(data)):
        r = BinaryReader(data, len(data), len(data), 100_000, 16 << 20, more=more)
        try:
            r.read_message_begin()
            answers.append((read_args(r, METHODS[method]), r.pos))
        except ThriftProtocolError as e:
            answers.append(str(e))
    return answers


@settings(max_examples=300, deadline=None)
@given(CALLS, st.data())
def test_whole_binary_frames_read_as_the_field_by_field_reader_reads_them(call: tuple[str, Any],
                                                                          data: Any) -> None:
    raw = bytearray(encode_call("binary", call[0], **call[1]))
    fast, general = _read_both(bytes(raw), call[0])
    assert fast == general
    for _ in range(data.draw(st.integers(1, 3))):  # and damaged ones fail, or not, alike
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    fast, general = _read_both(bytes(raw), call[0])
    assert fast == general
