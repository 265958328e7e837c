"""A Thrift client's socket: one receive buffer, the idle and request timeouts, framing.

`client_timeout` bounds the silence between requests (None: forever); once the first byte of a
request has arrived, the whole request must arrive within `request_timeout`, so a frame header
followed by silence, or a partial frame, holds the connection no longer than that.
"""

from __future__ import annotations

import socket
import struct
import time
from typing import Final

from kestrel.service.replies import Replies
from kestrel.service.session.stats import ServerStats
from kestrel.service.socket_io import ClientSocket

RECV_CHUNK = 256 * 1024
_FRAME_HEADER: Final = struct.Struct("!i")


class ConnectionDone(Exception):
    """Raised when the connection must end: the client is gone, too slow, idle, or speaks wrongly."""


class ClientStream:
    """The socket with its receive buffer; reads wait at most as long as the timeouts allow."""

    def __init__(self, sock: socket.socket, stats: ServerStats, idle_timeout_ms: int | None,
                 request_timeout_ms: int, peer: str = "") -> None:
        self.stats = stats
        self.idle_timeout = None if idle_timeout_ms is None else idle_timeout_ms / 1000.0
        self.request_timeout = request_timeout_ms / 1000.0
        self.idle_timeout_ms = idle_timeout_ms
        self.request_timeout_ms = request_timeout_ms
        self.buf = bytearray()
        self.io = ClientSocket(sock, RECV_CHUNK, send_timeout=self.idle_timeout,
                               idle_timeout=self.idle_timeout)
        self.replies = Replies(self.io, stats, peer)  # each waits for the changes it acknowledges
        self.deadline: float | None = None  # the request in progress must be complete by then

    def _recv(self, timeout: float) -> None:
        """Append the next input to the buffer. Raises TimeoutError, EOFError (the client closed)."""
        n = self.io.receive(self.buf, timeout)
        if not n:
            raise EOFError
        self.stats.bytes_read += n

    def wait_request(self) -> bool:
        """Wait (up to `client_timeout`) for a request to begin; False when the client closed.

        The request's deadline is set by the first `fill` it needs, at once if the first receive
        brought only part of it: a whole request, the usual case, reads no clock."""
        self.deadline = None
        if self.buf:
            return True
        try:
            n = self.io.receive(self.buf, between_requests=True)
        except TimeoutError:
            raise self.idle_over() from None
        self.stats.bytes_read += n
        return n > 0

    def idle_over(self) -> ConnectionDone:
        """What ends a connection whose wait between requests ran out (`ClientSocket.idle_timeout`)."""
        return ConnectionDone(f"idle for longer than client_timeout ({self.idle_timeout_ms} ms)")

    def fill(self, need: int) -> int:
        """Read until the buffer holds `need` bytes, before the request's deadline; the new length."""
        if self.deadline is None:
            self.deadline = time.monotonic() + self.request_timeout
        while len(self.buf) < need:
            left = self.deadline - time.monotonic()
            try:
                if left <= 0:
                    raise TimeoutError
                self._recv(left)
            except TimeoutError:
                late = f"request not complete within request_timeout ({self.request_timeout_ms} ms)"
                raise ConnectionDone(late) from None
            except EOFError:
                raise ConnectionDone("closed in the middle of a request") from None
        return len(self.buf)

    def whole_frame(self, max_frame: int) -> int:
        """Read until the buffer holds the frame it starts with; where that frame ends. The frame
        is then read where it lies, so an item's bytes are copied once, into the item."""
        buf = self.buf
        if len(buf) < 4:
            self.fill(4)
        (size,) = _FRAME_HEADER.unpack_from(buf, 0)
        if size < 0 or size > max_frame:
            raise ConnectionDone(describe_bad_frame_header(bytes(buf[:4]), size, max_frame))
        if len(buf) < 4 + size:
            self.fill(4 + size)
        return 4 + int(size)

    def send(self, data: bytes) -> None:
        """Send `data` (a framed transport's reply comes made as one frame, its size first: the
        writers lay it out so) once the changes it acknowledges are durable (`Replies`), waiting at
        most `client_timeout` for a client that stopped reading."""
        self.replies.send(data)

    def close(self) -> None:
        self.io.close()


def describe_bad_frame_header(header: bytes, size: int, max_frame: int) -> str:
    """Why a frame header is refused, naming the likely mistake."""
    if header[:2] == b"\x80\x01":
        return ("this looks like an unframed (buffered) binary-protocol client: this port expects framed "
                "transport (thrift_transport: framed)")
    if header[0] == 0x82:
        return ("this looks like an unframed (buffered) compact-protocol client: this port expects framed "
                "transport (thrift_transport: framed)")
    if size < 0:
        return f"a frame header announcing a negative size ({size})"
    return f"a frame of {size} bytes is over max_frame_size ({max_frame})"
