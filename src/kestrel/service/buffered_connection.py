"""What the memcache and text connections share: a session, a receive buffer, batched replies,
idle and slow-client limits, and waits that end the moment the client goes away; and the listener
that runs every protocol's connections, Thrift's too."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from functools import partial
from typing import ClassVar, Protocol, TypeVar

import gevent
import structlog

from kestrel.service.listener import Listener, peer_text
from kestrel.service.replies import Replies
from kestrel.service.session.server_state import ServerState
from kestrel.service.session.session import GET_BYTES, ClientGone, Session
from kestrel.service.socket_io import ClientSocket, SendTimeout, drop_answered
from kestrel.service.turns import Turns

log = structlog.get_logger("kestrel.connection")

RECV_CHUNK = 96 * 1024  # a 64 KB item's set in one receive
T = TypeVar("T")


def take(buf: bytearray, start: int, end: int) -> bytes:
    """The bytes of `buf[start:end]`, copied once: a bytearray's own slice is a copy, and `bytes` of
    it a second."""
    with memoryview(buf) as view:
        return bytes(view[start:end])


def line_end(buf: bytearray, start: int, nl: int) -> int:
    """Where the line from `start` to its LF at `nl` ends: before its CR, if it has one (a line's
    length, which `max_line_length` bounds, never counts its line end)."""
    return nl - 1 if nl > start and buf[nl - 1] == 13 else nl


class CloseConnection(Exception):
    """Raised by a handler: close the connection once the replies so far are sent. With a `refusal`
    (what was refused, as its reply said), the close is a warning in the log."""

    def __init__(self, refusal: str | None = None) -> None:
        super().__init__(refusal)
        self.refusal = refusal


class BufferedConnection:
    """One client of a line protocol. Subclasses answer what `process` finds complete in the buffer;
    the replies of one read burst go out in a single `send`."""

    protocol: ClassVar[str] = ""
    # Whether `process` stops before a request that may wait when `in_hub` is set, so that the
    # requests that cannot wait are answered in the hub's callback (`_served_in_hub`).
    answers_in_hub: ClassVar[bool] = False

    def __init__(self, server: ServerState, sock: socket.socket, peer: str) -> None:
        self.server = server
        self.peer = peer
        self.max_line = server.config.max_line_length
        self.out: list[bytes] = []
        self.inbox = bytearray()  # input that arrived while a blocking read was waiting
        idle = server.config.client_timeout
        self.idle_timeout = None if idle is None else idle / 1000.0
        self.io = ClientSocket(sock, RECV_CHUNK, send_timeout=self.idle_timeout,
                               idle_timeout=self.idle_timeout)
        # A get's wait watches the socket once it does wait (`wait_watching`), input that arrives
        # meanwhile kept for after the call up to what one request may hold (`max_frame_size`; the
        # watch holds no reference to the connection: no cycle through its session).
        watch = partial(wait_watching, self.io, self.inbox, server.config.max_frame_size)
        self.session = Session(server, peer, protocol=self.protocol, watch=watch)
        self.replies = Replies(self.io, server.stats, peer)
        self.turns = Turns(self.io)
        self.buf = bytearray()  # input received and not yet answered
        # Requests begun that span several receives (a text put block, a memcache item skipped): one
        # still under way after a receive keeps its `request_timeout` deadline, any other restarts it.
        self.requests_begun = 0
        # Item bytes in the replies built since the last send: past GET_BYTES they go out before the
        # next request is answered (`replies_due`), so a burst of gets of a large item holds no more.
        self.reply_bytes = 0
        self.in_hub = False  # `process` runs in the hub: it stops before a request that may wait

    def process(self, buf: bytearray) -> int:
        """Answer every complete request in `buf`; return how many bytes were used. Between two
        requests it calls `take_turns`, so that a pipelining client lets the others in."""
        raise NotImplementedError

    def take_turns(self) -> None:
        """Between two requests: send the replies built once they hold `GET_BYTES` of items, waiting
        for room (`replies_due`); and step aside when this connection has worked a whole turn, its
        replies so far sent."""
        if self.replies_due():
            self.send()
            self.replies.wait_sent()
        if self.turns.over():
            self.send()
            self.turns.step_aside()

    def mid_request(self) -> bool:
        """Whether a request spans what has been processed so far (an item still to come)."""
        return False

    def send(self) -> None:
        """Send the replies so far (they wait for the changes they acknowledge: `Replies`)."""
        self.reply_bytes = 0
        if self.out:
            data = b"".join(self.out)
            self.out.clear()
            self.replies.send(data)

    def send_pieces(self, pieces: list[bytes]) -> None:
        """Send the replies so far, then a page of every queue's figures one piece after another,
        never joined (`stats_render.Pieces`)."""
        self.send()
        for piece in pieces:
            self.replies.send(piece)

    def replies_due(self) -> bool:
        """Whether the replies built hold `GET_BYTES` of items, to be sent (in the connection's
        greenlet, waiting for room) before the next request is answered. Replies are joined to be
        sent, so a burst of 300 gets of a 1 MB item, each a reference to the item, was joined into
        300 MB before any went out."""
        return self.reply_bytes >= GET_BYTES

    def unended_line_too_long(self, buf: bytearray, start: int) -> bool:
        """Whether the bytes from `start`, no LF among them yet, are a line over `max_line_length`
        already (a CR at their end may be the first half of its line end, which is not counted)."""
        end = len(buf)
        return end > start and end - start - (buf[end - 1] == 13) > self.max_line

    def _receive(self, buf: bytearray, deadline: float | None) -> int:
        """Append the next input to `buf`: what arrived during a wait, else a recv bounded by
        `deadline` or, between requests, by `client_timeout`; how many bytes (0: the client closed).
        Raises TimeoutError when the client is too slow or idle."""
        if self.inbox:
            n = len(self.inbox)
            buf += self.inbox
            self.inbox.clear()
            return n
        if deadline is None:
            return self.io.receive(buf, between_requests=True)
        return self.io.receive(buf, max(deadline - time.monotonic(), 0.001))

    def run(self) -> bool:
        """Serve the client until it leaves; True when it ended the stream and all of it was read."""
        buf = self.buf
        request_timeout = self.server.config.request_timeout / 1000.0
        deadline: float | None = None  # the request in progress must be complete by then
        # between requests, the requests that cannot wait are answered in the hub's callback
        hub_serves = self.answers_in_hub
        self.replies.hold()
        replies = self.replies
        try:
            while True:
                if replies.full:
                    replies.wait_sent()  # no more requests read while a reply waits for room or the disk
                try:
                    if deadline is None and hub_serves and not (buf or self.inbox):
                        self.io.serve_from_hub(buf, self._served_in_hub)
                        ended = self.io.ended
                    else:
                        received = self._receive(buf, deadline)
                        self.server.stats.bytes_read += received
                        ended = not received
                except TimeoutError:
                    reason = "request_timeout" if deadline is not None else "client_timeout"
                    log.info("closing a slow or idle client", client=self.peer, protocol=self.protocol,
                             limit=reason)
                    raise CloseConnection from None
                if ended:
                    self.replies.finish()
                    break
                was_mid, begun = self.mid_request(), self.requests_begun
                used = self.process(buf)
                drop_answered(buf, used)
                self.send()
                mid = self.mid_request()
                if not buf and not mid:
                    deadline = None
                elif deadline is None or (used and not (was_mid and mid and begun == self.requests_begun)):
                    # The request in progress began in what was just received: its time starts now.
                    deadline = time.monotonic() + request_timeout
                self.take_turns()  # a client streaming a large request lets the others in too
        except CloseConnection as e:
            if e.refusal is not None:
                log.warning("connection closed", reason=e.refusal, client=self.peer, protocol=self.protocol)
            self.send()
            self.replies.finish()
        except ClientGone:  # its end of the stream ended a get's wait: a half-closed client still
            self.replies.finish()  # reads the replies held for the changes made before it
        finally:
            self.replies.release()
            self.io.close()
            self.session.close()
        return self.io.ended

    def _served_in_hub(self, received: int) -> bool:
        """In the hub, `received` bytes come: answer the requests that cannot wait (`process` stops
        before any other), their replies sent without waiting; False to wake the connection's
        greenlet for the rest (`ClientSocket.serve_from_hub`), or to wait there while a reply
        waits for room."""
        buf = self.buf
        self.server.stats.bytes_read += received
        self.in_hub = True
        try:
            drop_answered(buf, self.process(buf))
        finally:
            self.in_hub = False
        self.reply_bytes = 0
        if self.out:
            data = b"".join(self.out)
            self.out.clear()
            self.replies.send_at_once(data)
        return not buf and not self.mid_request() and not self.replies.full


# Once the input kept during a wait reaches its limit, the client's hang-up is looked for this often
# (by the kernel's note of the end of its stream, behind input not read).
ENDED_LOOK_S = 0.05


def wait_watching(io: ClientSocket, inbox: bytearray, most: int, session: Session,
                  call: Callable[[], T]) -> T:
    """Run a session call that waits for items while watching the client's socket, every
    protocol's: input that arrives meanwhile is appended to `inbox` (up to `most` bytes, what one
    request may hold; beyond, the client waits, and its hang-up is seen only once the end of its
    stream reaches the socket: behind input the server no longer reads, TCP holds it back). When
    the client hangs up, the session's wait is cancelled at once (ClientGone is raised in the
    caller), so the dead connection takes no item, which would be lost with it, and its waiter and
    open reads are withdrawn. (The watch stopped at one line's worth of input: a client that
    pipelined more, then hung up, was handed the next item.)"""
    waiter = gevent.getcurrent()
    watcher = gevent.spawn(partial(_watch, io, inbox, most, session, waiter))
    try:
        return call()
    finally:
        watcher.kill()  # before the caller reads the socket again


def _watch(io: ClientSocket, inbox: bytearray, most: int, session: Session, waiter: gevent.Greenlet) -> None:
    while True:
        if len(inbox) <= most:
            try:
                received = io.receive(inbox, None)
            except OSError:
                received = 0
            if received:
                continue
            if io.reading_ended_by_server():
                return  # a clean shutdown's: it wakes the wait itself, which then replies
        elif not io.ended_now():  # (the watch stopped here: the wait took an item for a client gone)
            gevent.sleep(ENDED_LOOK_S)
            continue
        session.client_gone()
        gevent.get_hub().loop.run_callback(_cancel_wait, session, waiter)
        return


def _cancel_wait(session: Session, waiter: gevent.Greenlet) -> None:
    """From the hub, once the watcher is done: end `waiter`'s wait for an item if it is in one (the
    session says when; anywhere else, an item could be taken half way)."""
    if session.waiting and not waiter.dead:
        waiter.throw(ClientGone())


class Connection(Protocol):
    """One client of any protocol, served by `run` until it leaves."""

    protocol: ClassVar[str]  # its name in logs and metrics

    def __init__(self, server: ServerState, sock: socket.socket, peer: str) -> None: ...

    def run(self) -> bool:
        """Serve the client until it leaves; True when it ended the stream and all of it was read
        (the socket then closes without lingering)."""


def make_listener(connection: type[Connection], server: ServerState, listener: tuple[str, int]) -> Listener:
    """A listener running one `connection` per client (every protocol's)."""

    def handle(sock: socket.socket, address: tuple[str, int]) -> bool:
        peer = peer_text(address)
        try:
            return connection(server, sock, peer).run()
        except SendTimeout:
            log.info("closing a client that stopped reading its replies", client=peer,
                     protocol=connection.protocol, limit="client_timeout")
        except (ConnectionError, OSError):
            pass  # the listener closes the socket
        return False

    return Listener(connection.protocol, listener, handle, server.config.max_connections,
                    server.config.tcp_keepalive)
