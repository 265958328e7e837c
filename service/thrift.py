"""Kestrel's Thrift service on a gevent StreamServer.

Framed transport (the default, what Finagle and most clients use) is read here frame by frame: the
4-byte length is checked against `max_frame_size` before anything is allocated, and each frame is
decoded with thriftpy2's Cython binary codec from memory. Buffered transport reads the socket
through a transport that refuses any single read larger than `max_frame_size`.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable
from typing import Any, TypeVar

import structlog
from gevent.socket import socket as gsocket
from thriftpy2.protocol import TBinaryProtocolFactory, TCompactProtocolFactory, TCyBinaryProtocolFactory
from thriftpy2.thrift import TApplicationException, TProcessor
from thriftpy2.transport import TCyMemoryBuffer, TMemoryBuffer, TTransportBase, TTransportException

from contract import kestrel_thrift
from service import metrics
from service.listener import Listener
from service.server import KestrelServer
from service.session import Session
from storage.errors import KestrelError

log = structlog.get_logger("kestrel.thrift")

_FRAME_HEADER = struct.Struct("!i")
RECV_CHUNK = 256 * 1024
F = TypeVar("F", bound=Callable[..., Any])


def _reply_errors(method: F) -> F:
    """Every error reaches the client as a TApplicationException with a message, never a dropped socket."""

    @functools.wraps(method)
    def wrapper(self: ThriftHandler, *args: Any) -> Any:
        try:
            return metrics.timed("thrift", method.__name__, method, self, *args)
        except KestrelError as e:
            raise TApplicationException(TApplicationException.UNKNOWN, str(e)) from None
        except TApplicationException:
            raise
        except Exception as e:
            log.exception("thrift call failed", method=method.__name__, client=self.session.peer)
            raise TApplicationException(TApplicationException.INTERNAL_ERROR,
                                        f"internal error in {method.__name__}: {e!r}") from None

    return wrapper  # type: ignore[return-value]


class ThriftHandler:
    """The Kestrel service methods, each a thin shell over the session layer."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.clock = session.coll.clock

    @_reply_errors
    def put(self, queue_name: str, items: list[bytes] | None, expiration_msec: int | None = 0) -> int:
        expiry = self.clock.now_ms() + expiration_msec if expiration_msec and expiration_msec > 0 else 0
        return self.session.put(queue_name, list(items or []), expiry)

    @_reply_errors
    def get(self, queue_name: str, max_items: int, timeout_msec: int | None = 0,
            auto_abort_msec: int | None = 0) -> list[Any]:
        got = self.session.get_items(queue_name, max_items or 0, timeout_msec or 0, auto_abort_msec or 0)
        return [kestrel_thrift.Item(data=data, id=read_id) for read_id, data in got]

    @_reply_errors
    def confirm(self, queue_name: str, ids: set[int] | None) -> int:
        return self.session.confirm_ids(queue_name, set(ids or ()))

    @_reply_errors
    def abort(self, queue_name: str, ids: set[int] | None) -> int:
        return self.session.abort_ids(queue_name, set(ids or ()))

    @_reply_errors
    def peek(self, queue_name: str) -> Any:
        return kestrel_thrift.QueueInfo(**self.session.queue_info(queue_name))

    @_reply_errors
    def flush_queue(self, queue_name: str) -> None:
        self.session.flush(queue_name)

    @_reply_errors
    def flush_all_queues(self) -> None:
        self.session.flush_all()

    @_reply_errors
    def delete_queue(self, queue_name: str) -> None:
        self.session.delete(queue_name)

    @_reply_errors
    def current_status(self) -> int:
        return int(self.session.current_status())

    @_reply_errors
    def set_status(self, status: int) -> None:
        self.session.set_status(status)

    @_reply_errors
    def get_version(self) -> str:
        return self.session.server.version


class FrameTooLarge(Exception):
    """A client announced a frame over `max_frame_size`."""


class _FramedConnection:
    """Reads length-prefixed frames from a socket with one receive buffer for many frames."""

    def __init__(self, sock: gsocket, max_frame: int) -> None:
        self.sock = sock
        self.max_frame = max_frame
        self.buf = bytearray()
        self.bytes_read = 0

    def _fill(self, need: int) -> bool:
        while len(self.buf) < need:
            chunk = self.sock.recv(max(RECV_CHUNK, need - len(self.buf)))
            if not chunk:
                return False
            self.bytes_read += len(chunk)
            self.buf += chunk
        return True

    def next_frame(self) -> bytes | None:
        if not self._fill(4):
            return None
        (size,) = _FRAME_HEADER.unpack_from(self.buf, 0)
        if size < 0 or size > self.max_frame:
            raise FrameTooLarge(f"frame of {size} bytes (max_frame_size is {self.max_frame})")
        if not self._fill(4 + size):
            return None
        frame = bytes(self.buf[4:4 + size])
        del self.buf[:4 + size]
        return frame


class _BoundedSocket(TTransportBase):
    """A socket transport for buffered Thrift that refuses to read more than `limit` at once."""

    def __init__(self, sock: gsocket, limit: int, session: Session) -> None:
        self.sock = sock
        self.limit = limit
        self.session = session
        self.rbuf = bytearray()

    def read(self, sz: int) -> bytes:
        if sz > self.limit:
            raise FrameTooLarge(f"a field of {sz} bytes (max_frame_size is {self.limit})")
        while len(self.rbuf) < sz:
            chunk = self.sock.recv(RECV_CHUNK)
            if not chunk:
                raise TTransportException(TTransportException.END_OF_FILE, "connection closed")
            self.session.stats.bytes_read += len(chunk)
            self.rbuf += chunk
        out = bytes(self.rbuf[:sz])
        del self.rbuf[:sz]
        return out

    _read = read

    def write(self, buf: bytes) -> None:
        self.session.stats.bytes_written += len(buf)
        self.sock.sendall(buf)

    def flush(self) -> None:
        pass

    def is_open(self) -> bool:
        return True

    def close(self) -> None:
        pass


def make_thrift_server(server: KestrelServer, listener: tuple[str, int]) -> Listener:
    """A listener speaking Kestrel's Thrift service with the configured transport and protocol."""
    cfg = server.config
    compact = cfg.thrift_protocol == "compact"
    framed = cfg.thrift_transport == "framed"
    max_frame = cfg.max_frame_size

    def serve_framed(sock: gsocket, session: Session, processor: TProcessor) -> None:
        factory: Any = TCompactProtocolFactory() if compact else TCyBinaryProtocolFactory()
        buffer_cls: Any = TMemoryBuffer if compact else TCyMemoryBuffer
        conn = _FramedConnection(sock, max_frame)
        while True:
            frame = conn.next_frame()
            if frame is None:
                return
            out = buffer_cls()
            processor.process(factory.get_protocol(buffer_cls(frame)), factory.get_protocol(out))
            reply = out.getvalue()
            session.stats.bytes_read, conn.bytes_read = session.stats.bytes_read + conn.bytes_read, 0
            session.stats.bytes_written += 4 + len(reply)
            sock.sendall(_FRAME_HEADER.pack(len(reply)) + reply)

    def serve_buffered(sock: gsocket, session: Session, processor: TProcessor) -> None:
        factory: Any = TCompactProtocolFactory() if compact else TBinaryProtocolFactory()
        trans = _BoundedSocket(sock, max_frame, session)
        iprot, oprot = factory.get_protocol(trans), factory.get_protocol(trans)
        while True:
            try:
                processor.process(iprot, oprot)
            except TTransportException:
                return

    serve = serve_framed if framed else serve_buffered

    def handle(sock: gsocket, address: tuple[str, int]) -> None:
        peer = f"{address[0]}:{address[1]}"
        session = Session(server, peer)
        processor = TProcessor(kestrel_thrift.Kestrel, ThriftHandler(session))
        try:
            serve(sock, session, processor)
        except FrameTooLarge as e:
            log.warning("closing thrift connection: frame too large", client=peer, reason=str(e))
        except (ConnectionError, OSError):
            pass
        except Exception as e:
            log.warning("closing thrift connection after a malformed request", client=peer, error=repr(e))
        finally:
            session.close()
            sock.close()

    return Listener("thrift", listener, handle, cfg.max_connections)
