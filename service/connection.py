"""What the memcache and text connections share: a session, a receive buffer, batched replies."""

from __future__ import annotations

from gevent.socket import socket as gsocket

from service.listener import Listener
from service.server import KestrelServer
from service.session import Session

RECV_CHUNK = 64 * 1024


class CloseConnection(Exception):
    """Raised by a handler: close the connection once the replies so far are sent."""


class BufferedConnection:
    """One client of a line protocol. Subclasses answer what `process` finds complete in the buffer;
    the replies of one read burst go out in a single `sendall`."""

    protocol = ""

    def __init__(self, server: KestrelServer, sock: gsocket, peer: str) -> None:
        self.server = server
        self.sock = sock
        self.peer = peer
        self.session = Session(server, peer)
        self.max_line = server.config.max_line_length
        self.out: list[bytes] = []

    def process(self, buf: bytearray) -> int:
        """Answer every complete request in `buf`; return how many bytes were used."""
        raise NotImplementedError

    def send(self) -> None:
        if self.out:
            data = b"".join(self.out)
            self.out.clear()
            self.server.stats.bytes_written += len(data)
            self.sock.sendall(data)

    def run(self) -> None:
        buf = bytearray()
        try:
            while True:
                chunk = self.sock.recv(RECV_CHUNK)
                if not chunk:
                    return
                self.server.stats.bytes_read += len(chunk)
                buf += chunk
                del buf[:self.process(buf)]
                self.send()
        except CloseConnection:
            self.send()
        finally:
            self.session.close()


def make_line_server(connection: type[BufferedConnection], server: KestrelServer,
                     listener: tuple[str, int]) -> Listener:
    """A listener running one `connection` per client."""

    def handle(sock: gsocket, address: tuple[str, int]) -> None:
        try:
            connection(server, sock, f"{address[0]}:{address[1]}").run()
        except (ConnectionError, OSError):
            pass
        finally:
            sock.close()

    return Listener(connection.protocol, listener, handle, server.config.max_connections)
