"""Raw Thrift messages for tests: calls encoded by thriftpy2 (binary or compact), or field by field by
Apache Thrift's own writers, sent framed or not, and replies decoded, so that a test can send
exactly the bytes it means (and mutate them)."""

from __future__ import annotations

import socket
import struct
from typing import Any

from thrift.protocol import TBinaryProtocol as ApacheBinary
from thrift.protocol import TCompactProtocol as ApacheCompact
from thrift.Thrift import TType
from thrift.transport import TTransport
from thriftpy2.protocol import TBinaryProtocol, TCompactProtocol
from thriftpy2.thrift import TApplicationException, TMessageType
from thriftpy2.transport import TMemoryBuffer

from kestrel.contract import kestrel_thrift

PROTOCOLS = {"binary": TBinaryProtocol, "compact": TCompactProtocol}


def encode_call(protocol: str, method: str, seqid: int = 1, **args: Any) -> bytes:
    buf = TMemoryBuffer()
    proto = PROTOCOLS[protocol](buf)
    proto.write_message_begin(method, TMessageType.CALL, seqid)
    getattr(kestrel_thrift.Kestrel, f"{method}_args")(**args).write(proto)
    proto.write_message_end()
    return bytes(buf.getvalue())


def framed(payload: bytes) -> bytes:
    return struct.pack("!i", len(payload)) + payload


def unframed(frame: bytes) -> bytes:
    """The payload of one whole frame, its size checked."""
    (size,) = struct.unpack_from("!i", frame)
    assert size == len(frame) - 4, f"a frame announcing {size} bytes holds {len(frame) - 4}"
    return frame[4:]


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError(f"connection closed after {len(data)} of {n} bytes")
        data += chunk
    return bytes(data)


def read_framed_reply(sock: socket.socket, protocol: str, method: str) -> Any:
    """The result of one framed reply, or the TApplicationException it carries (returned, not raised)."""
    (size,) = struct.unpack("!i", recv_exactly(sock, 4))
    return decode_reply(recv_exactly(sock, size), protocol, method)


def decode_reply(payload: bytes, protocol: str, method: str) -> Any:
    proto = PROTOCOLS[protocol](TMemoryBuffer(payload))
    _, mtype, _ = proto.read_message_begin()
    if mtype == TMessageType.EXCEPTION:
        exc = TApplicationException()
        exc.read(proto)
        return exc
    result = getattr(kestrel_thrift.Kestrel, f"{method}_result")()
    result.read(proto)
    return result.success


def closed_or_silent(sock: socket.socket, timeout: float = 30.0) -> bool:
    """True when the server closes the connection (reading nothing more) within `timeout`."""
    sock.settimeout(timeout)
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for {pid}")


# A field as `encode_message` writes it: (id, Thrift type code, value). A struct's value is a list
# of fields; a list's or set's (element type, [values]); a map's (key type, value type, [(k, v)]).
Field = tuple[int, int, Any]


def encode_message(protocol: str, name: str, fields: list[Field], mtype: int = TMessageType.CALL,
                   seqid: int = 1, strict: bool = True) -> bytes:
    """A message laid out field by field, in the order given, by Apache Thrift's own protocol
    writers: any field, of any type, any number of times (what no generated client sends), with the
    binary protocol's unversioned header where not `strict`."""
    buf = TTransport.TMemoryBuffer()
    proto = (ApacheBinary.TBinaryProtocol(buf, strictWrite=strict) if protocol == "binary"
             else ApacheCompact.TCompactProtocol(buf))
    proto.writeMessageBegin(name, mtype, seqid)
    _write_struct(proto, fields)
    proto.writeMessageEnd()
    return bytes(buf.getvalue())


def _write_struct(proto: Any, fields: list[Field]) -> None:
    proto.writeStructBegin("args")
    for fid, ttype, value in fields:
        proto.writeFieldBegin("", ttype, fid)
        _write_value(proto, ttype, value)
        proto.writeFieldEnd()
    proto.writeFieldStop()
    proto.writeStructEnd()


def _write_value(proto: Any, ttype: int, value: Any) -> None:
    if ttype == TType.STRUCT:
        _write_struct(proto, value)
    elif ttype in (TType.LIST, TType.SET):
        etype, values = value
        (proto.writeListBegin if ttype == TType.LIST else proto.writeSetBegin)(etype, len(values))
        for v in values:
            _write_value(proto, etype, v)
        (proto.writeListEnd if ttype == TType.LIST else proto.writeSetEnd)()
    elif ttype == TType.MAP:
        ktype, vtype, pairs = value
        proto.writeMapBegin(ktype, vtype, len(pairs))
        for k, v in pairs:
            _write_value(proto, ktype, k)
            _write_value(proto, vtype, v)
        proto.writeMapEnd()
    else:
        write = {TType.BOOL: proto.writeBool, TType.BYTE: proto.writeByte, TType.I16: proto.writeI16,
                 TType.I32: proto.writeI32, TType.I64: proto.writeI64, TType.DOUBLE: proto.writeDouble,
                 TType.STRING: proto.writeBinary}[ttype]
        write(value)


def varint(n: int) -> bytes:
    """`n` (not negative) as the compact protocol's unsigned varint, written here apart from the
    server's writer so that a test's bytes do not come from the code under test."""
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    return bytes([*out, n])


def zigzag_varint(n: int, bits: int = 64) -> bytes:
    """`n` as the compact protocol writes an integer of `bits` bits: zigzag, then a varint."""
    return varint((n << 1) ^ (n >> (bits - 1)))
