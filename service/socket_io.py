"""Socket reads and writes with the fewest system calls and no fresh buffer per read."""

from __future__ import annotations

from typing import Any

import gevent
import gevent.socket
from gevent.socket import socket as gsocket


class Receiver:
    """A connection's receives: each lands in a buffer the connection keeps (a `recv` of a fresh
    bytes object would allocate the full chunk size each time), then is appended to the input.

    Between requests it first waits for the socket to be readable. A request/response client's next
    request is seldom there the moment its reply has gone out, and a `recv` that finds nothing costs
    a system call and an exception before gevent waits for input anyway: under 4 such clients the
    server made two `recvfrom` per request. It receives at once when the last receive filled the
    buffer, as more is then likely waiting.
    """

    def __init__(self, sock: gsocket, chunk: int) -> None:
        self.sock = sock
        self.scratch = memoryview(bytearray(chunk))
        self.drained = True  # the last receive took all there was (it did not fill `scratch`)
        self._timeout: float | None = -1.0  # no timeout set yet (-1 is none a receive asks for)
        self._readable: Any = None  # the loop's watcher of the socket's input, made at the first wait

    def receive(self, buf: bytearray, timeout: float | None, between_requests: bool = False) -> int:
        """Append the next input to `buf`, waiting at most `timeout` seconds (None: without limit);
        how many bytes came (0: the client closed). Raises TimeoutError."""
        if between_requests and self.drained:
            if self._readable is None:
                self._readable = gevent.get_hub().loop.io(self.sock.fileno(), 1)
            gevent.socket.wait(self._readable, timeout)
        self.settimeout(timeout)
        n: int = self.sock.recv_into(self.scratch)
        buf += self.scratch[:n]
        self.drained = n < len(self.scratch)
        return n

    def settimeout(self, timeout: float | None) -> None:
        """The socket's timeout, set only when it changes (gevent's `settimeout` is Python code)."""
        if timeout != self._timeout:
            self.sock.settimeout(timeout)
            self._timeout = timeout

    def close(self) -> None:
        if self._readable is not None:
            self._readable.close()


def send_all(sock: gsocket, data: bytes) -> None:
    """Send all of `data`, in one `send` system call when the socket takes it all (gevent's own
    `sendall` first asks the kernel for the send buffer's size, a second system call per reply)."""
    sent: int = sock.send(data)
    if sent < len(data):
        sock.sendall(memoryview(data)[sent:])
