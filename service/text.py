"""Kestrel's text protocol: one command per line, items one per line.

Replies: `+<n>` a count, `:<item>` an item, `*` nothing, `-<error>` an error. A get is a read that
the connection's next fetch confirms (and a disconnect aborts); there are no other reliable reads.
"""

from __future__ import annotations

import structlog
from gevent.socket import socket as gsocket

from service import metrics
from service.connection import BufferedConnection, CloseConnection, make_line_server
from service.listener import Listener
from service.server import KestrelServer
from storage.errors import KestrelError

log = structlog.get_logger("kestrel.text")

class TextConnection(BufferedConnection):
    protocol = "text"

    def __init__(self, server: KestrelServer, sock: gsocket, peer: str) -> None:
        super().__init__(server, sock, peer)
        self.putting: str | None = None  # queue of a put in progress
        self.batch: list[bytes] = []

    def process(self, buf: bytearray) -> int:
        pos = 0
        while (nl := buf.find(b"\n", pos)) >= 0:
            line = bytes(buf[pos:nl]).rstrip(b"\r")
            pos = nl + 1
            if len(line) > self.max_line:
                self.out.append(b"-line too long\n")
                raise CloseConnection
            self.line(line)
        if len(buf) - pos > self.max_line:
            self.out.append(b"-line too long\n")
            raise CloseConnection
        return pos

    def line(self, line: bytes) -> None:
        if self.putting is not None:
            if line:
                self.batch.append(line)
                return
            queue, items = self.putting, self.batch
            self.putting, self.batch = None, []
            self.reply(lambda: b"+%d\n" % metrics.timed("text", "put_items", self.session.put, queue, items))
            return
        try:
            words = line.decode("utf-8").split()
        except UnicodeDecodeError:
            self.out.append(b"-command is not valid UTF-8\n")
            return
        if not words:
            return
        command, args = words[0].lower(), words[1:]
        handler = getattr(self, f"do_{command}", None)
        if handler is None:
            self.out.append(b"-unknown command %s\n" % command.encode()[:64])
            return
        self.reply(lambda: metrics.timed("text", command, handler, args))

    def reply(self, produce: object) -> None:
        try:
            self.out.append(produce())  # type: ignore[operator]
        except (CloseConnection, ConnectionError):
            raise
        except (KestrelError, ValueError, IndexError) as e:
            self.out.append(b"-%s\n" % str(e).encode()[:512])
        except Exception as e:
            log.exception("text command failed", client=self.peer)
            self.out.append(b"-internal error: %s\n" % repr(e).encode()[:512])

    def _close_previous(self) -> None:
        for queue in list(self.session.pending):
            self.session.confirm_count(queue, len(self.session.pending[queue]))

    @staticmethod
    def _timeout_ms(args: list[str], at: int) -> int:
        if len(args) <= at:
            return 0
        if not args[at].isdigit():
            raise ValueError(f"bad timeout {args[at]!r}: expected milliseconds")
        return int(args[at])

    def do_put(self, args: list[str]) -> bytes:
        if len(args) != 1 or not args[0].endswith(":"):
            raise ValueError("usage: put <queue>: then one item per line, then an empty line")
        self.putting = args[0][:-1]
        return b""

    def do_get(self, args: list[str]) -> bytes:
        if len(args) not in (1, 2):
            raise ValueError("usage: get <queue> [timeout-ms]")
        self._close_previous()
        wait = self._timeout_ms(args, 1)
        if wait:
            self.send()
        data = self.session.get_one(args[0], timeout_ms=wait, open=True)
        return b"*\n" if data is None else b":" + data + b"\n"

    def do_peek(self, args: list[str]) -> bytes:
        if len(args) not in (1, 2):
            raise ValueError("usage: peek <queue> [timeout-ms]")
        self._close_previous()
        data = self.session.get_one(args[0], timeout_ms=self._timeout_ms(args, 1), peek=True)
        return b"*\n" if data is None else b":" + data + b"\n"

    def do_monitor(self, args: list[str]) -> bytes:
        if len(args) not in (2, 3):
            raise ValueError("usage: monitor <queue> <seconds> [max-items]")
        self._close_previous()
        self.send()
        max_items = int(args[2]) if len(args) == 3 else None
        for data in self.session.monitor(args[0], float(args[1]), max_items):
            self.out.append(b":" + data + b"\n")
            self.send()
        return b"*\n"

    def do_confirm(self, args: list[str]) -> bytes:
        if len(args) != 2 or not args[1].isdigit():
            raise ValueError("usage: confirm <queue> <count>")
        pending = len(self.session.pending.get(args[0], []))
        count = min(int(args[1]), pending)
        self.session.confirm_count(args[0], count)
        return b"+%d\n" % count

    def do_flush(self, args: list[str]) -> bytes:
        if len(args) != 1:
            raise ValueError("usage: flush <queue>")
        self.session.flush(args[0])
        return b"+0\n"

    def do_quit(self, args: list[str]) -> bytes:
        raise CloseConnection

    def do_shutdown(self, args: list[str]) -> bytes:
        self.server.request_shutdown()
        self.out.append(b"+0\n")
        raise CloseConnection


def make_text_server(server: KestrelServer, listener: tuple[str, int]) -> Listener:
    return make_line_server(TextConnection, server, listener)
