"""Clients for fairness checks: a light one timing single rounds, flooders pipelining without end."""

from __future__ import annotations

import socket
import struct
import threading
import time

from tests.support.thrift_wire import recv_exactly

PIPELINE = 2000  # requests in one flooder's send
LIGHT_TIMEOUT = 10.0  # seconds: a light round not answered by then counts as starved


class Light:
    """A client of one protocol making single rounds: the request and the end of its reply."""

    def __init__(self, port: int, request: bytes, reply_end: bytes, framed_reply: bool = False) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=LIGHT_TIMEOUT)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.request, self.reply_end, self.framed_reply = request, reply_end, framed_reply

    def round(self) -> float:
        started = time.perf_counter()
        self.sock.sendall(self.request)
        if self.framed_reply:
            (size,) = struct.unpack("!i", recv_exactly(self.sock, 4))
            recv_exactly(self.sock, size)
        else:
            data = b""
            while not data.endswith(self.reply_end):
                data += self.sock.recv(65536)
        return time.perf_counter() - started

    def close(self) -> None:
        self.sock.close()


class Flooder:
    """Sends `request` PIPELINE at a time, without end, and reads every reply, until stopped."""

    def __init__(self, port: int, request: bytes) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        self.chunk = request * PIPELINE
        self.received = 0  # bytes of replies so far
        self.stopped = threading.Event()
        self.threads = [threading.Thread(target=self._send, daemon=True),
                        threading.Thread(target=self._drain, daemon=True)]
        for t in self.threads:
            t.start()

    def _send(self) -> None:
        while not self.stopped.is_set():
            try:
                self.sock.sendall(self.chunk)
            except OSError:
                return

    def _drain(self) -> None:
        while not self.stopped.is_set():
            try:
                got = len(self.sock.recv(1 << 20))
            except OSError:
                return
            if not got:
                return
            self.received += got

    def stop(self) -> None:
        self.stopped.set()
        self.sock.close()
