"""Raw Thrift messages for tests: calls encoded by thriftpy2 (binary or compact), sent framed or not,
and replies decoded, so that a test can send exactly the bytes it means (and mutate them)."""

from __future__ import annotations

import socket
import struct
from typing import Any

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
