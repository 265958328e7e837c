"""Kestrel's memcache protocol on a gevent StreamServer.

Each connection reads into one buffer, answers every complete command in it, and sends the replies
of a burst with one `sendall`, so pipelined clients cost one system call per burst. Lines are
bounded by `max_line_length` and items by `max_frame_size` before anything is allocated for them.
"""

from __future__ import annotations

import structlog
from gevent.socket import socket as gsocket

from service import metrics
from service.connection import BufferedConnection, CloseConnection, make_line_server
from service.listener import Listener
from service.memcache_protocol import Command, ProtocolError, absolute_expiry_ms, parse_line
from service.server import KestrelServer
from service.session import SessionError
from service.stats_render import dump_stats, memcache_stats, queue_blocks
from storage.errors import InvalidQueueName, ItemTooLarge, KestrelError, Refused

log = structlog.get_logger("kestrel.memcache")

CRLF = b"\r\n"
END = b"END\r\n"
STORED = b"STORED\r\n"
NOT_STORED = b"NOT_STORED\r\n"


class MemcacheConnection(BufferedConnection):
    """One memcache client; an item being swallowed or skipped spans read bursts."""

    protocol = "memcache"

    def __init__(self, server: KestrelServer, sock: gsocket, peer: str) -> None:
        super().__init__(server, sock, peer)
        self.max_item = server.config.max_frame_size
        self.discard = 0  # bytes of an oversized item still to swallow
        self.skip_line = False  # after a bad data chunk: drop input up to the next line end

    def process(self, buf: bytearray) -> int:
        """Answer every complete command in `buf`; return how many bytes were used."""
        pos = 0
        end = len(buf)
        while pos < end:
            if self.discard:
                step = min(self.discard, end - pos)
                self.discard -= step
                pos += step
                if not self.discard:
                    self.out.append(b"SERVER_ERROR object too large for cache\r\n")
                continue
            nl = buf.find(b"\n", pos)
            if nl < 0:
                if end - pos > self.max_line:
                    self.out.append(b"CLIENT_ERROR line too long\r\n")
                    raise CloseConnection
                return pos
            if self.skip_line:
                self.skip_line = False
                pos = nl + 1
                continue
            if nl - pos > self.max_line:
                self.out.append(b"CLIENT_ERROR line too long\r\n")
                raise CloseConnection
            line = bytes(buf[pos:nl - 1 if nl > pos and buf[nl - 1] == 13 else nl])
            try:
                command = parse_line(line)
            except ProtocolError as e:
                self.out.append(e.reply.encode() + CRLF)
                pos = nl + 1
                continue
            if command.name != "set":
                pos = nl + 1
                self.execute(command)
                continue
            if command.size > self.max_item:
                self.discard = command.size + 2
                pos = nl + 1
                continue
            data_end = nl + 1 + command.size
            if data_end + 2 > end:
                return pos  # wait for the rest of the item
            if buf[data_end:data_end + 2] != CRLF:
                self.out.append(b"CLIENT_ERROR bad data chunk\r\n")
                resync = buf.find(b"\n", data_end)
                if resync < 0:
                    self.skip_line = True
                    return end
                pos = resync + 1
                continue
            metrics.timed("memcache", "set", self.store, command, bytes(buf[nl + 1:data_end]))
            pos = data_end + 2
        return pos

    def store(self, command: Command, data: bytes) -> None:
        try:
            expiry = absolute_expiry_ms(command.expiry, self.session.coll.clock.now_ms())
            stored = self.session.put(command.key, [data], expiry) == 1
            reply = STORED if stored else NOT_STORED
        except ItemTooLarge:
            reply = NOT_STORED
        except KestrelError as e:
            reply = self._error(e)
        if not command.noreply:
            self.out.append(reply)

    def _error(self, e: Exception) -> bytes:
        if isinstance(e, InvalidQueueName | SessionError):
            return f"CLIENT_ERROR {e}\r\n".encode()
        if isinstance(e, Refused | KestrelError):
            return f"SERVER_ERROR {e}\r\n".encode()
        log.exception("memcache command failed", client=self.peer)
        return f"SERVER_ERROR internal error: {e!r}\r\n".encode()

    def execute(self, command: Command) -> None:
        try:
            metrics.timed("memcache", command.name, getattr(self, f"do_{command.name}"), command)
        except (CloseConnection, ConnectionError):
            raise
        except ProtocolError as e:
            self.out.append(e.reply.encode() + CRLF)
        except Exception as e:
            self.out.append(self._error(e))

    def _value(self, key: str, data: bytes) -> None:
        self.out.append(b"VALUE %s 0 %d\r\n" % (key.encode(), len(data)))
        self.out.append(data + CRLF)

    def do_get(self, command: Command) -> None:
        options = command.get
        assert options is not None
        if options.timeout_ms:
            self.send()  # earlier replies go out before this one waits
        data = self.session.get_one(options.queue, timeout_ms=options.timeout_ms, open=options.open,
                                    close=options.close, abort=options.abort, peek=options.peek)
        if data is not None:
            self._value(command.key, data)
        self.out.append(END)

    def do_delete(self, command: Command) -> None:
        self.session.delete(command.key)
        if not command.noreply:
            self.out.append(b"DELETED\r\n")

    def do_flush(self, command: Command) -> None:
        self.session.flush(command.key)
        if not command.noreply:
            self.out.append(END)

    def do_flush_all(self, command: Command) -> None:
        self.session.flush_all()
        self.out.append(b"Flushed all queues.\r\n")

    def do_version(self, command: Command) -> None:
        self.out.append(f"VERSION {self.server.version}\r\n".encode())

    def do_shutdown(self, command: Command) -> None:
        log.info("shutdown requested", client=self.peer)
        self.server.request_shutdown()
        raise CloseConnection

    def do_quit(self, command: Command) -> None:
        raise CloseConnection

    def do_reload(self, command: Command) -> None:
        self.server.reload()
        self.out.append(b"Reloaded config.\r\n")

    def do_stats(self, command: Command) -> None:
        self.out.append(memcache_stats(self.server))

    def do_dump_stats(self, command: Command) -> None:
        self.out.append(dump_stats(self.server))

    def do_dump_config(self, command: Command) -> None:
        coll = self.session.coll
        configs = {name: q.config.describe() for name in coll.queue_names() if (q := coll.get(name))}
        self.out.append(queue_blocks(configs))

    def do_monitor(self, command: Command) -> None:
        try:
            seconds = float(command.args[0])
            max_items = int(command.args[1]) if len(command.args) > 1 else None
        except ValueError:
            raise ProtocolError("CLIENT_ERROR bad monitor arguments") from None
        self.send()
        for data in self.session.monitor(command.key, seconds, max_items):
            self._value(command.key, data)
            self.send()
        self.out.append(END)

    def do_confirm(self, command: Command) -> None:
        closed = self.session.confirm_count(command.key, int(command.args[0]))
        self.out.append(END if closed else b"ERROR\r\n")

    def do_status(self, command: Command) -> None:
        if not command.args:
            label = self.session.current_status().label.upper()
            self.out.append(label.encode() + CRLF)
            return
        self.session.set_status(command.args[0])
        self.out.append(END)


def make_memcache_server(server: KestrelServer, listener: tuple[str, int]) -> Listener:
    """A StreamServer speaking Kestrel's memcache dialect."""
    return make_line_server(MemcacheConnection, server, listener)
