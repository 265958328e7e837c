"""A call's arguments as the handler takes them: in the contract's order, read by the compiled reader
and by `read_args` (binary and compact) to what thriftpy2's own decode of the same bytes gives, for
every method of the contract, any field left out; the handler's methods named and ordered as the
contract's arguments; and calls with a field unknown, left out or of another type answered as a
Thrift server answers them."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from thrift.Thrift import TMessageType, TType
from thriftpy2.protocol import TBinaryProtocol, TCompactProtocol
from thriftpy2.thrift import TApplicationException
from thriftpy2.transport import TMemoryBuffer

from kestrel.contract import kestrel_thrift
from kestrel.service.session.server_state import ServerState
from kestrel.service.thrift.handler import ThriftConnection, ThriftHandler, method_calls, parameter_names
from kestrel.service.thrift.messages import METHODS, ValueType, read_args, read_plain_frame
from kestrel.service.thrift.protocol import PROTOCOLS, ThriftProtocolError
from tests.support.thrift_wire import (
    Field,
    decode_reply,
    encode_call,
    encode_message,
    unframed,
    zigzag_varint,
)

THRIFTPY = {"binary": TBinaryProtocol, "compact": TCompactProtocol}
I32 = st.integers(-(2**31), 2**31 - 1)
I64 = st.integers(-(2**63), 2**63 - 1)
_THRIFTPY_BINARY = 18


def _values(spec: tuple[Any, ...]) -> st.SearchStrategy[Any]:
    """Values of an argument's type: (wire type, element type) as thriftpy2's `thrift_spec` gives them."""
    ttype = spec[0]
    if ttype == 11:
        return st.text(max_size=20)
    if ttype == _THRIFTPY_BINARY:
        return st.binary(max_size=20)
    if ttype == 8:
        return I32
    if ttype == 10:
        return I64
    if ttype == 15:
        return st.lists(_values((spec[1],)), max_size=5)
    if ttype == 14:
        return st.sets(_values((spec[1],)), max_size=5)
    raise AssertionError(f"no values for {spec}")


@st.composite
def _calls(draw: Any) -> tuple[str, dict[str, Any]]:
    """A method of the contract and some of its arguments (any may be left out)."""
    name = draw(st.sampled_from(sorted(METHODS)))
    spec = getattr(kestrel_thrift.Kestrel, f"{name}_args").thrift_spec
    args = {s[1]: draw(_values((s[0], *s[2:-1]))) for s in spec.values() if draw(st.booleans())}
    return name, args


def thriftpy_decode(protocol: str, data: bytes) -> tuple[str, tuple[Any, ...]]:
    """The method and its arguments in the contract's order, as thriftpy2 decodes the call."""
    proto = THRIFTPY[protocol](TMemoryBuffer(data))
    name, _, _ = proto.read_message_begin()
    args = getattr(kestrel_thrift.Kestrel, f"{name}_args")()
    args.read(proto)
    return name, tuple(getattr(args, arg) for arg in METHODS[name].names)


def ours(protocol: str, data: bytes) -> tuple[str, tuple[Any, ...]]:
    reader = PROTOCOLS[protocol][0](data, len(data), len(data), 100_000, 16 << 20)
    name, _, _ = reader.read_message_begin()
    args, problem = read_args(reader, METHODS[name])
    assert problem is None and reader.pos == len(data)
    return name, args


def same(ours: tuple[Any, ...], theirs: tuple[Any, ...]) -> bool:
    """A set of ids reads as a list here (the session takes either); all else is equal as it is."""
    return len(ours) == len(theirs) and all(
        (set(a) == b if isinstance(b, set) and a is not None else a == b) for a, b in zip(ours, theirs, strict=True))


@settings(max_examples=400, deadline=None)
@given(_calls(), st.sampled_from(["binary", "compact"]), st.integers(0, 2**31 - 1))  # thriftpy2's compact
# writer loops for ever on a negative sequence id
def test_every_method_reads_as_thriftpy2_decodes_it(call: tuple[str, dict[str, Any]], protocol: str,
                                                    seqid: int) -> None:
    name, args = call
    data = encode_call(protocol, name, seqid=seqid, **args)
    theirs = thriftpy_decode(protocol, data)
    read = ours(protocol, data)
    assert read[0] == theirs[0] and same(read[1], theirs[1])
    if protocol == "binary":
        plain = read_plain_frame(data, 100_000, 16 << 20)
        if plain is not None:  # the compiled reader, where the build has it
            assert plain[0] is METHODS[name] and plain[1] == seqid and same(plain[2], theirs[1])


def test_the_compiled_reader_reads_every_call_of_kestrels_clients() -> None:
    """Every call whose arguments are all given or left to their defaults is read in one step."""
    from kestrel.service.thrift.messages import compiled_binary

    if compiled_binary is None:
        pytest.skip("built without a C compiler")
    given_args = {"queue_name": "q", "items": [b"x"], "expiration_msec": 5, "max_items": 2, "timeout_msec": 1,
                  "auto_abort_msec": 3, "ids": {1, 2}, "status": 3, "first": 4}
    for name, method in METHODS.items():
        data = encode_call("binary", name, seqid=9, **{arg: given_args[arg] for arg in method.names})
        plain = read_plain_frame(data, 100_000, 16 << 20)
        assert plain is not None and plain[0] is method and same(plain[2], thriftpy_decode("binary", data)[1])


def test_the_handler_takes_each_method_s_arguments_by_the_contract_s_names_in_its_order() -> None:
    calls = method_calls()
    assert [method.name for _, method, _ in calls] == list(METHODS)
    for function, method, _ in calls:
        assert function is getattr(ThriftHandler, method.name)
        assert parameter_names(function) == method.names == tuple(
            name for name, _ in getattr(kestrel_thrift.Kestrel, f"{method.name}_args").default_spec)


class _Unused:
    def fileno(self) -> int:
        return -1


@pytest.mark.parametrize("protocol", ["binary", "compact"])
def test_unknown_missing_and_mistyped_fields_are_answered_as_thrift_answers_them(server_state: ServerState,
                                                                                 protocol: str) -> None:
    """An unknown field is skipped; a left-out one takes the contract's default (none: the handler's
    error names it); a field of another type is skipped as unknown, whichever reader reads it."""
    server_state.config.thrift_protocol = protocol
    conn = ThriftConnection(server_state, _Unused(), "test")  # type: ignore[arg-type]

    def answer(data: bytes, method: str) -> Any:
        reply = conn.answer_frame(data)
        assert reply is not None
        return decode_reply(unframed(reply), protocol, method)

    put = encode_call(protocol, "put", queue_name="q", items=[b"a"], expiration_msec=0)
    assert answer(_with_field(put, protocol, 99, 7), "put") == 1  # an unknown i32 field 99
    assert answer(encode_call(protocol, "put", queue_name="q", items=[b"b"]), "put") == 1  # no expiry: never
    missing = answer(encode_call(protocol, "put", items=[b"c"], expiration_msec=0), "put")
    assert isinstance(missing, TApplicationException) and missing.message == "queue_name is missing"
    # the queue name as an i32 (field 1 of another type): skipped, so the name is missing
    mistyped = _with_field(encode_call(protocol, "put", items=[b"d"]), protocol, 1, 5)
    reply = answer(mistyped, "put")
    assert isinstance(reply, TApplicationException) and reply.message == "queue_name is missing"
    got = answer(encode_call(protocol, "get", queue_name="q", max_items=5), "get")  # timeouts default to 0
    assert [item.data for item in got] == [b"a", b"b"]
    # Arguments without a default, left out: named, never taken as empty (a put of nothing, status -1).
    for method, sent, field in (("put", {"queue_name": "q"}, "items"), ("confirm", {"queue_name": "q"}, "ids"),
                                ("abort", {"queue_name": "q"}, "ids"), ("set_status", {}, "status")):
        refused = answer(encode_call(protocol, method, **sent), method)
        assert isinstance(refused, TApplicationException) and refused.message == f"{field} is missing"


def _with_field(call: bytes, protocol: str, fid: int, number: int) -> bytes:
    """`call` with one more field before its STOP: an i32 `number` under id `fid` (compact: its
    id spelt out whole, a zigzag varint, and the value one too)."""
    if protocol == "binary":
        field = bytes([8, fid >> 8, fid & 0xFF]) + number.to_bytes(4, "big", signed=True)
    else:
        field = bytes([5]) + zigzag_varint(fid, 16) + zigzag_varint(number, 32)
    return call[:-1] + field + b"\x00"


@pytest.mark.pure_build
def test_a_handler_not_taking_its_method_s_arguments_is_refused_by_name_and_no_table_is_kept(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kestrel.service.thrift import handler

    def peek_items(self: ThriftHandler, first: int | None, queue_name: str | None, max_items: int | None) -> Any:
        return None

    monkeypatch.setattr(handler, "_calls", [])
    monkeypatch.setattr(ThriftHandler, "peek_items", peek_items)  # the contract's last method
    with pytest.raises(TypeError, match=r"ThriftHandler.peek_items takes \('first', 'queue_name', 'max_items'\)"):
        handler.method_calls()
    assert handler._calls == []  # not the methods before it: the next connection is refused too


# Calls no generated client sends, each read here and by Apache Thrift's own generated reader.

_SCALARS = {TType.BOOL: st.booleans(), TType.BYTE: st.integers(-128, 127), TType.I16: st.integers(-(2**15), 2**15 - 1),
            TType.I32: I32, TType.I64: I64, TType.DOUBLE: st.floats(allow_nan=False),
            TType.STRING: st.text(max_size=6).map(str.encode)}  # UTF-8: Apache's Python decodes a skipped string
_CONTAINERS = (TType.STRUCT, TType.LIST, TType.SET, TType.MAP)


def _any_value(ttype: int, depth: int) -> st.SearchStrategy[Any]:
    """A value of any type, containers nested up to `depth` more levels, a few elements each."""
    if ttype in _SCALARS:
        return _SCALARS[ttype]
    inner = st.sampled_from(sorted(_SCALARS) + (list(_CONTAINERS) if depth else []))
    if ttype == TType.STRUCT:
        return st.lists(_any_field(depth - 1), max_size=3)
    if ttype == TType.MAP:
        return st.tuples(inner, inner).flatmap(lambda kv: st.tuples(
            st.just(kv[0]), st.just(kv[1]),
            st.lists(st.tuples(_any_value(kv[0], depth - 1), _any_value(kv[1], depth - 1)), max_size=3)))
    return inner.flatmap(lambda e: st.tuples(st.just(e), st.lists(_any_value(e, depth - 1), max_size=3)))


def _any_field(depth: int) -> st.SearchStrategy[Field]:
    types = sorted(_SCALARS) + (list(_CONTAINERS) if depth > 0 else [])
    return st.tuples(st.integers(-3, 12), st.sampled_from(types)).flatmap(
        lambda f: st.tuples(st.just(f[0]), st.just(f[1]), _any_value(f[1], depth)))


def _argument(vtype: ValueType) -> st.SearchStrategy[Any]:
    """A value of an argument's own type, as `encode_message` writes it."""
    if vtype.ttype == TType.STRING:
        return st.text(max_size=8).map(str.encode) if vtype.utf8 else st.binary(max_size=8)
    if vtype.ttype in (TType.LIST, TType.SET):
        assert vtype.elem is not None
        return st.tuples(st.just(vtype.elem.ttype), st.lists(_argument(vtype.elem), max_size=4))
    return _SCALARS[vtype.ttype]


@st.composite
def _hostile_calls(draw: Any) -> tuple[str, list[Field], int, int, bool]:
    """(method, fields, message type, sequence id, strict header): each argument left out, given
    once or twice, fields of unknown ids or of another type than their id's argument, with nested
    containers, all in any order."""
    name = draw(st.sampled_from(sorted(METHODS)))
    method = METHODS[name]
    fields: list[Field] = []
    for fid, (_, _, vtype) in method.args.items():
        for _ in range(draw(st.sampled_from([0, 1, 1, 2]))):
            fields.append((fid, vtype.ttype, draw(_argument(vtype))))
    for fid, ttype, value in draw(st.lists(_any_field(2), max_size=3)):
        if fid in method.args and method.args[fid][2].ttype == ttype:
            fid += 100  # not one of the method's own: that would be an argument of its type
        fields.append((fid, ttype, value))
    mtype = draw(st.sampled_from([TMessageType.CALL, TMessageType.CALL, TMessageType.ONEWAY]))
    return name, draw(st.permutations(fields)), mtype, draw(I32), draw(st.booleans())


def apache_read(service: Any, protocol: str, data: bytes) -> tuple[tuple[str, int, int], dict[str, Any]]:
    """The message header and the arguments by name, as Apache Thrift's generated code reads them."""
    from thrift.protocol import TBinaryProtocol as ApacheBinary
    from thrift.protocol import TCompactProtocol as ApacheCompact
    from thrift.transport import TTransport

    buf = TTransport.TMemoryBuffer(data)
    proto = ApacheBinary.TBinaryProtocol(buf) if protocol == "binary" else ApacheCompact.TCompactProtocol(buf)
    header = proto.readMessageBegin()
    args = getattr(service, f"{header[0]}_args")()
    args.read(proto)
    return header, vars(args)


@settings(max_examples=600, deadline=None, derandomize=True)
@given(call=_hostile_calls(), cut=st.floats(0, 1, exclude_max=True))
def test_calls_no_client_sends_read_as_apache_thrift_reads_them(apache_generated: Any,
                                                                call: tuple[str, list[Field], int, int, bool],
                                                                cut: float) -> None:
    """Every argument as Apache Thrift's generated reader takes it (the last of a repeated field, its
    default where left out, unknown and mistyped fields skipped, however deep); the compiled reader,
    where it reads a call at all (never one repeating an argument: the Python reader counts what a
    message holds), the same; and the message cut anywhere refused by name, by both."""
    service, _ = apache_generated
    name, fields, mtype, seqid, strict = call
    method = METHODS[name]
    for protocol in ("binary", "compact"):
        data = encode_message(protocol, name, fields, mtype, seqid, strict)
        header, theirs = apache_read(service, protocol, data)
        reader = PROTOCOLS[protocol][0](data, len(data), len(data), 100_000, 16 << 20)
        assert reader.read_message_begin() == header == (name, mtype, seqid)
        args, problem = read_args(reader, method)
        assert problem is None and reader.pos == len(data)
        assert same(args, tuple(theirs[arg] for arg in method.names)), (protocol, fields)
        if protocol == "binary":
            plain = read_plain_frame(data, 100_000, 16 << 20)
            if plain is not None:  # the compiled reader, where the build has it: strict calls, each argument once
                given = [fid for fid, ttype, _ in fields if fid in method.args and method.args[fid][2].ttype == ttype]
                assert strict and mtype == TMessageType.CALL and len(set(given)) == len(given)
                assert plain[0] is method and plain[1] == seqid and same(plain[2], args)
        short = data[:int(cut * len(data))]
        with pytest.raises(Exception):  # noqa: B017  (Apache's transport raises its own)
            apache_read(service, protocol, short)
        with pytest.raises(ThriftProtocolError, match="left in the frame"):
            reader = PROTOCOLS[protocol][0](short, len(short), len(short), 100_000, 16 << 20)
            reader.read_message_begin()
            read_args(reader, method)
        assert read_plain_frame(short, 100_000, 16 << 20) is None
