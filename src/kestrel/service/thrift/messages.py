"""Kestrel's calls and replies, shaped by the contract and read with the checked protocol readers.

Each service method's arguments and result come from the loaded contract's specs, so the field ids,
types, order and defaults are the IDL's. A call's arguments are read into a tuple in the IDL's order
(its defaults for fields a client leaves out), what the handler's method takes positionally: no
dict is made and looked up per call. A field the method does not have, or of another type, is
skipped, as Thrift does.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Final

from thriftpy2.thrift import TApplicationException

from kestrel.contract import kestrel_thrift
from kestrel.service.socket_io import BoxedInt
from kestrel.service.thrift.protocol import (
    EXCEPTION,
    I32,
    I64,
    LIST,
    REPLY,
    SET,
    STOP,
    STRING,
    STRUCT,
    BinaryWriter,
    Reader,
    ThriftProtocolError,
    Writer,
    compiled_binary,
)
from kestrel.storage.taken_items import TakenItems


@dataclass(frozen=True)
class ValueType:
    """A Thrift type as it goes on the wire: `utf8` for strings, `elem` for containers, `fields`
    (id, name, type) for structs."""

    ttype: int
    utf8: bool = False
    elem: ValueType | None = None
    fields: tuple[tuple[int, str, ValueType], ...] = ()


@dataclass(frozen=True)
class Method:
    """A service method: `number`, its place in `METHODS`; `args`, each field id's argument as
    (position in `names`, name, type); `names` and `defaults`, the arguments in the IDL's order and
    the value of each a call leaves out; `reply_head`, a binary reply's message header up to its
    sequence id (the same every time); `item_fields`, for a result that is a list of structs of a
    binary then i64s (`get`'s Items, `get_timed`'s TimedItems), their field ids, for the compiled
    writer (else empty)."""

    name: str
    number: int
    args: dict[int, tuple[int, str, ValueType]]
    names: tuple[str, ...]
    defaults: tuple[Any, ...]
    result: ValueType | None
    reply_head: bytes
    item_fields: tuple[int, ...]


_THRIFTPY_BINARY = 18  # thriftpy2 marks `binary` with its own code; on the wire it is a string


def _value_type(ttype: int, extra: Any = None) -> ValueType:
    if ttype == _THRIFTPY_BINARY:
        return ValueType(STRING)
    if ttype == STRING:
        return ValueType(STRING, utf8=True)
    if ttype in (LIST, SET):
        elem = _value_type(*extra) if isinstance(extra, tuple) else _value_type(extra)
        return ValueType(ttype, elem=elem)
    if ttype == STRUCT:
        cls = extra[1] if isinstance(extra, tuple) else extra
        return ValueType(STRUCT, fields=_struct_fields(cls.thrift_spec))
    return ValueType(ttype)  # numbers and enums (an enum is an i32)


def _spec_type(spec: tuple[Any, ...]) -> ValueType:
    return _value_type(spec[0], spec[2] if len(spec) == 4 else None)


def _struct_fields(spec: dict[int, tuple[Any, ...]]) -> tuple[tuple[int, str, ValueType], ...]:
    return tuple((fid, s[1], _spec_type(s)) for fid, s in sorted(spec.items()))


def _item_fields(result: ValueType | None) -> tuple[int, ...]:
    if result is None or result.ttype != LIST or result.elem is None:
        return ()
    fields = result.elem.fields
    if (len(fields) in (2, 4) and (fields[0][2].ttype, fields[0][2].utf8) == (STRING, False)
            and all(f[2].ttype == I64 for f in fields[1:])):
        return tuple(fid for fid, _, _ in fields)
    return ()


def _methods() -> dict[str, Method]:
    service = kestrel_thrift.Kestrel
    methods = {}
    for number, name in enumerate(service.thrift_services):
        args_cls = getattr(service, f"{name}_args")
        result_spec = getattr(service, f"{name}_result").thrift_spec
        names = tuple(arg for arg, _ in args_cls.default_spec)  # the IDL's order
        args = {fid: (names.index(s[1]), s[1], _spec_type(s)) for fid, s in args_cls.thrift_spec.items()}
        result = _spec_type(result_spec[0]) if 0 in result_spec else None
        reply_head = struct.pack("!Ii", 0x80010000 | REPLY, len(name.encode())) + name.encode()
        methods[name] = Method(name, number, args, names, tuple(d for _, d in args_cls.default_spec), result,
                               reply_head, _item_fields(result))
    return methods


METHODS = _methods()

# The compiled reader's and writer's entry points, bound once: a `Final` name is a C static in the
# compiled build, where `compiled_binary.read_framed_call` costs two dictionary lookups a call.
_read_call: Final = None if compiled_binary is None else compiled_binary.read_call
_read_framed_call: Final = None if compiled_binary is None else compiled_binary.read_framed_call
_write_reply: Final = None if compiled_binary is None else compiled_binary.write_reply
_write_framed_reply: Final = None if compiled_binary is None else compiled_binary.write_framed_reply

# How the compiled call reader takes each argument: numbers, text, binary, a list of binaries, a list
# or set of i64.
_I32_ARG, _I64_ARG, _TEXT_ARG, _BINARY_ARG, _BINARY_LIST_ARG, _I64_LIST_ARG = range(6)


def _argument_kind(vtype: ValueType) -> int | None:
    """How the compiled reader reads a value of `vtype` (None: it leaves the call to `read_args`)."""
    if vtype.ttype == I32:
        return _I32_ARG
    if vtype.ttype == I64:
        return _I64_ARG
    if vtype.ttype == STRING:
        return _TEXT_ARG if vtype.utf8 else _BINARY_ARG
    if vtype.ttype == LIST and vtype.elem is not None and vtype.elem.ttype == STRING and not vtype.elem.utf8:
        return _BINARY_LIST_ARG
    if vtype.ttype in (LIST, SET) and vtype.elem is not None and vtype.elem.ttype == I64:
        return _I64_LIST_ARG
    return None


def field_rules(fields: tuple[tuple[int, int, int] | None, ...]) -> bytes:
    """Fields by id, each (position, wire type, kind) or None, as the compiled reader takes them:
    three bytes a field id, 0xff first for an id it does not have or reads otherwise."""
    return b"".join(b"\xff\x00\x00" if field is None else bytes(field) for field in fields)


def _plain_fields(method: Method) -> bytes:
    """A method's field rules (`field_rules`) for the compiled reader."""
    plain = {fid: (position, vtype.ttype, kind) for fid, (position, _, vtype) in method.args.items()
             if (kind := _argument_kind(vtype)) is not None}
    return field_rules(tuple(plain.get(fid) for fid in range(max(plain, default=0) + 1)))


# The methods as the compiled reader takes them: (name as UTF-8, the Method, defaults, field rules).
_PLAIN_CALLS: Final = tuple((method.name.encode(), method, method.defaults, _plain_fields(method))
                     for method in METHODS.values())


# ---------------------------------------------------------------------------------------------
# Reading calls

def read_value(reader: Reader, vtype: ValueType, what: str) -> Any:
    ttype = vtype.ttype
    if ttype == STRING:
        return reader.read_string(what) if vtype.utf8 else reader.read_binary(what)
    if ttype in (LIST, SET):
        assert vtype.elem is not None
        etype, count = reader.read_list_begin(what)
        if count and etype != vtype.elem.ttype:
            raise ThriftProtocolError(f"{what}: expected elements of type {vtype.elem.ttype}, got {etype}")
        if vtype.elem.ttype == STRING and not vtype.elem.utf8:
            return reader.read_binary_list(count, what)
        values = []
        for _ in range(count):
            reader.tick()
            values.append(read_value(reader, vtype.elem, what))
        return values
    if ttype == STRUCT:
        raise ThriftProtocolError(f"{what}: struct arguments are not part of this contract")
    return reader.read_value(ttype, what)


def read_plain_frame(frame: bytes, max_items: int,
                     max_bytes: int) -> tuple[Method, int, tuple[Any, ...]] | None:
    """A whole binary frame's call (method, sequence id, arguments) read in one compiled step
    (src/kestrel/service/thrift/_binary.c): a call of a known method whose every field is one of its
    own, of its type, and a number, a string, a list of binaries or a list or set of i64 (every
    request of the hot path). None for anything else, or without the compiled reader:
    `read_message_begin` and `read_args` then read the message and name what is wrong."""
    if _read_call is None:
        return None
    call = _read_call(frame, _PLAIN_CALLS, max_items, max_bytes)
    return None if call is None else (call[0], call[2], call[3])


# Whether `read_buffered_frame` reads plain calls (the build has the C helper), as a connection that
# answers them in the hub's callback needs.
READS_BUFFERED_FRAMES: Final = _read_framed_call is not None


def read_buffered_frame(buf: bytearray, max_frame: BoxedInt, max_items: BoxedInt,
                        max_bytes: BoxedInt) -> tuple[Method, int, tuple[Any, ...], int] | None:
    """`read_plain_frame` on the frame a receive buffer starts with, read where it lies (no copy of
    its payload): (method, sequence id, arguments, where the frame ends). None where the frame is not
    whole yet or is over `max_frame`, or `read_plain_frame` would decline: the connection then takes
    the frame out of the buffer and answers it as any other."""
    if _read_framed_call is None:
        return None
    return _read_framed_call(buf, max_frame, _PLAIN_CALLS, max_items, max_bytes)


def read_args(reader: Reader, method: Method | None) -> tuple[tuple[Any, ...], str | None]:
    """The call's arguments in the IDL's order, field by field (every protocol; the reference the
    compiled reader is compared with), and a problem that leaves the message readable (e.g. a name
    that is not UTF-8) to answer once the whole message is consumed. Raises ThriftProtocolError."""
    values = list(method.defaults) if method is not None else []
    problem = None
    reader.read_struct_begin()
    while True:
        ttype, fid = reader.read_field_begin()
        if ttype == STOP:
            break
        arg = method.args.get(fid) if method is not None else None
        if arg is None or arg[2].ttype != ttype:
            reader.skip(ttype)
            continue
        try:
            values[arg[0]] = read_value(reader, arg[2], arg[1])
        except ValueError as e:
            problem = str(e)
    reader.read_struct_end()
    return tuple(values), problem


# ---------------------------------------------------------------------------------------------
# Writing replies

def write_value(writer: Writer, vtype: ValueType, value: Any) -> None:
    ttype = vtype.ttype
    if ttype == STRUCT:  # an object with the fields as attributes, or a tuple of them in order
        writer.write_struct_begin()
        for i, (fid, name, ftype) in enumerate(vtype.fields):
            v = value[i] if isinstance(value, tuple) else getattr(value, name)
            if v is not None:
                writer.write_field(ftype.ttype, fid)
                write_value(writer, ftype, v)
        writer.write_struct_end()
    elif ttype in (LIST, SET):
        elem = vtype.elem
        assert elem is not None
        writer.write_list_begin(elem.ttype, len(value))
        for v in value:
            write_value(writer, elem, v)
    else:
        writer.write_value(ttype, value)


def encode_reply(protocol: type[Writer], method: Method, seqid: int, value: Any,
                 framed: bool = False) -> bytes:
    """The reply to `method` carrying `value` (None: a void method's, or no result), in the
    `protocol` of that writer class, `framed`: as one frame of the framed transport: a binary reply
    of the hot path (nothing, an i32, a get's items) laid out in one compiled step, its frame header
    with it (src/kestrel/service/thrift/_binary.c), anything else by `write_reply`. A get's items
    come as TakenItems."""
    if protocol is BinaryWriter and _write_reply is not None and _write_framed_reply is not None:
        head = method.reply_head
        write = _write_framed_reply if framed else _write_reply
        reply = None
        if method.result is None or value is None:
            reply = write(head, seqid)
        elif type(value) is int and method.result.ttype == I32:
            reply = write(head, seqid, value)
        elif type(value) is TakenItems and (fids := method.item_fields):
            # (no `*` in the calls: compiled, it builds a list and a tuple of the arguments each call)
            if len(fids) == 4:
                added, expiries = value.times()
                reply = write(head, seqid, fids, value.data(), value.ids, added, expiries)
            else:
                reply = write(head, seqid, fids, value.data(), value.ids)
        if reply is not None:
            return reply
    if type(value) is TakenItems:  # the writers take tuples of the fields in order
        value = value.pairs() if len(method.item_fields) == 2 else value.timed()
    return write_reply(protocol(framed), method, seqid, value)


def write_reply(writer: Writer, method: Method, seqid: int, value: Any) -> bytes:
    """A reply field by field through `writer` (every protocol; the reference the compiled writer
    is compared with)."""
    writer.write_message_begin(method.name, REPLY, seqid)
    writer.write_struct_begin()
    if method.result is not None and value is not None:
        writer.write_field(method.result.ttype, 0)
        write_value(writer, method.result, value)
    writer.write_struct_end()
    return writer.getvalue()


def encode_exception(writer: Writer, name: str, seqid: int, kind: int, message: str) -> bytes:
    """A TApplicationException: what every Thrift client raises with the message shown."""
    writer.write_message_begin(name, EXCEPTION, seqid)
    writer.write_struct_begin()
    writer.write_field(STRING, 1)
    writer.write_value(STRING, message)
    writer.write_field(I32, 2)
    writer.write_value(I32, kind)
    writer.write_struct_end()
    return writer.getvalue()


UNKNOWN = TApplicationException.UNKNOWN
UNKNOWN_METHOD = TApplicationException.UNKNOWN_METHOD
INVALID_MESSAGE_TYPE = TApplicationException.INVALID_MESSAGE_TYPE
INTERNAL_ERROR = TApplicationException.INTERNAL_ERROR
PROTOCOL_ERROR = TApplicationException.PROTOCOL_ERROR

__all__ = ["METHODS", "Method", "ValueType", "encode_exception", "encode_reply", "field_rules", "read_args",
           "read_buffered_frame", "read_plain_frame"]
