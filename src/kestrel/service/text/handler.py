"""Kestrel's text protocol: one command per line, items one per line.

Replies: `+<n>` a count, `:<item>` an item (or the status, or the version), `*` nothing,
`-<error>` an error. `get` and `monitor` open reads that the connection's next fetch on the same
queue confirms (and a disconnect aborts); `confirm <queue> <n>` confirms them explicitly.
A `put` block is bounded by `max_batch_items` and `max_batch_bytes`; a refused block is read to
its empty line and dropped, so its items never run as commands.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import ClassVar

import structlog

from kestrel import SERVER_VERSION
from kestrel.service import metrics
from kestrel.service.buffered_connection import (
    BufferedConnection,
    CloseConnection,
    line_end,
    make_listener,
    take,
)
from kestrel.service.listener import Listener
from kestrel.service.session.server_state import ServerState
from kestrel.service.session.session import ClientGone
from kestrel.service.session.status import Status
from kestrel.service.text.commands import TextCommand, TextError, parse_line
from kestrel.storage.errors import KestrelError

log = structlog.get_logger("kestrel.text")

# Items stored per step of a large put; the loop serves other clients between steps.
PUT_STEP = 1000


@dataclass
class PutBlock:
    """A put whose items are still arriving; `refusal` is set once the block is refused."""

    queue: str
    expiry_ms: int | None
    items: list[bytes] = field(default_factory=list)
    size: int = 0
    refusal: str | None = None


def item(data: bytes | None) -> bytes:
    return b"*\n" if data is None else b":%s\n" % data  # the item copied once


class TextConnection(BufferedConnection):
    protocol: ClassVar[str] = "text"

    def __init__(self, server: ServerState, sock: socket.socket, peer: str) -> None:
        super().__init__(server, sock, peer)
        self.block: PutBlock | None = None

    def mid_request(self) -> bool:
        return self.block is not None

    def process(self, buf: bytearray) -> int:
        pos = 0
        while (nl := buf.find(b"\n", pos)) >= 0:
            if pos:
                self.take_turns()
            line = take(buf, pos, line_end(buf, pos, nl))
            pos = nl + 1
            if len(line) > self.max_line:
                self.out.append(b"-line too long\n")
                raise CloseConnection
            if self.block is not None:
                self.item_line(self.block, line)
            else:
                self.line(line)
        if self.unended_line_too_long(buf, pos):
            self.out.append(b"-line too long\n")
            raise CloseConnection
        return pos

    def item_line(self, block: PutBlock, line: bytes) -> None:
        if line:
            if block.refusal is None:
                block.items.append(line)
                block.size += len(line)
                config = self.server.config
                if len(block.items) > config.max_batch_items:
                    self._refuse(block, f"put of more than max_batch_items ({config.max_batch_items}) items")
                elif block.size > config.max_batch_bytes:
                    self._refuse(block, f"put of more than max_batch_bytes ({config.max_batch_bytes}) bytes")
            return
        self.block = None
        if block.refusal is not None:
            self.out.append(b"-%s\n" % block.refusal.encode()[:512])
            return
        self.answer(lambda: metrics.timed("text", "put", self.store, block))

    def _begin(self, block: PutBlock) -> None:
        """A put block begins: one request until its empty line, however many receives it spans."""
        self.block = block
        self.requests_begun += 1

    @staticmethod
    def _refuse(block: PutBlock, reason: str) -> None:
        block.refusal = reason
        block.items = []

    def store(self, block: PutBlock) -> bytes:
        """Store a block in steps, letting other clients in between; `+<items accepted>`."""
        expiry = self.session.expiry_after(block.expiry_ms or 0)  # none or 0: never expires
        accepted = 0
        for start in range(0, len(block.items), PUT_STEP):
            if start:
                self.take_turns()
            step = block.items[start:start + PUT_STEP]
            try:
                stored = self.session.put(block.queue, step, expiry)
            except KestrelError:
                if not accepted:
                    raise
                # Refused after the first steps were stored (a status change, the memory budget, a
                # failed write in between): the answer counts those, and a retry of the rest is told why.
                break
            accepted += stored
            if stored < len(step):
                break
        return b"+%d\n" % accepted

    def line(self, line: bytes) -> None:
        try:
            command = parse_line(line)
        except TextError as e:
            if e.close:
                self.out.append(b"-%s\n" % e.message.encode())
                raise CloseConnection(e.message) from None
            if e.opens_block:
                self._begin(PutBlock("", None, refusal=e.message))
            else:
                self.out.append(b"-%s\n" % e.message.encode()[:512])
            return
        if command.name == "put":
            self._begin(PutBlock(command.queue, command.expiry_ms))
            return
        handler = getattr(self, f"do_{command.name}")
        self.answer(lambda: metrics.timed("text", command.name, handler, command))

    def answer(self, produce: object) -> None:
        try:
            self.out.append(produce())  # type: ignore[operator]
        except (CloseConnection, ConnectionError, ClientGone):
            raise
        except KestrelError as e:
            self.out.append(b"-%s\n" % str(e).encode()[:512])
        except Exception as unexpected:
            log.exception("text command failed", client=self.peer)
            self.out.append(b"-internal error: %s\n" % repr(unexpected).encode()[:512])

    def _fetch(self, command: TextCommand, *, open: bool = False, peek: bool = False) -> bytes:
        """One item, after confirming this connection's reads on the queue (Kestrel's rule)."""
        self.session.confirm_reads(command.queue)
        if command.timeout_ms:
            self.send()  # earlier replies go out before this one waits
        datas = self.session.get(command.queue, timeout_ms=command.timeout_ms, open=open, peek=peek)
        reply = item(datas[0] if datas else None)
        self.reply_bytes += len(reply)
        return reply

    def do_get(self, command: TextCommand) -> bytes:
        return self._fetch(command, open=True)

    def do_peek(self, command: TextCommand) -> bytes:
        return self._fetch(command, peek=True)

    def do_monitor(self, command: TextCommand) -> bytes:
        self.session.confirm_reads(command.queue)
        self.send()
        items = self.session.monitor(command.queue, command.timeout_ms, command.count)
        while (data := next(items, None)) is not None:
            self.out.append(item(data))
            self.send()
        return item(None)

    def do_confirm(self, command: TextCommand) -> bytes:
        assert command.count is not None
        confirmed = self.session.confirm_reads(command.queue, command.count)
        if not confirmed:  # the count is that of the reads open, or none is confirmed
            return b"-Not that many transactions open.\n"
        return b"+%d\n" % confirmed

    def do_flush(self, command: TextCommand) -> bytes:
        self.session.flush(command.queue)
        return b"+0\n"

    def do_delete(self, command: TextCommand) -> bytes:
        self.session.delete(command.queue)
        return b"+0\n"

    def do_status(self, command: TextCommand) -> bytes:
        if self.session.current_status() == Status.NOT_CONFIGURED:
            return b"-Server status not configured.\n"
        if command.status is None:
            return b":%s\n" % self.session.current_status().label.upper().encode()
        self.session.set_status(command.status)
        return b"+0\n"

    def do_version(self, command: TextCommand) -> bytes:
        return b":%s\n" % SERVER_VERSION.encode()

    def do_quit(self, command: TextCommand) -> bytes:
        raise CloseConnection

    def do_shutdown(self, command: TextCommand) -> bytes:
        log.info("shutdown requested", client=self.peer)
        self.server.request_shutdown()
        self.out.append(b"+0\n")
        raise CloseConnection


def make_text_server(server: ServerState, listener: tuple[str, int]) -> Listener:
    return make_listener(TextConnection, server, listener)
