"""A connection's replies on their way out, each held until the changes it acknowledges are durable.

Under `sync_journal: always` with the commit log, a change made by a connection does not wait for
the disk (src/kestrel/storage/acknowledgements.py): the connection builds its reply at once and
goes back to reading its socket, and the reply waits here for the turn of the log that holds the
change. When that turn's fsync round has run, the log tells every connection of the turn on the
event loop, and each sends what it holds with one non-blocking `send` on its descriptor (as the
connection's own sends are made: `ClientSocket.send_some`); no greenlet is switched to
for it, and the socket's watcher is never stopped across a loop turn (which cost two `epoll_ctl`
calls a request). Replies go out in order: one built while an earlier one is held waits behind it,
changes or not. A reply that does not fit the socket at once is finished by a greenlet of its own,
which gives up after `client_timeout` as the connection's own sends do. Meanwhile, and while the
replies held for the disk reach `HELD_BYTES`, the connection reads no more requests (`wait_sent`),
as when it waits for room itself: a client that does not read its replies, or a burst of gets of
large items under `always`, does not have them pile up in the server.

If the log and a change's journal both fail to make it durable, no reply from then on is sent:
the connection is cut off, so the client never reads an acknowledgement the disk did not keep.

A held reply that hands out read ids (a Thrift get with auto-abort) is asked about as it is
released, or dropped unsent (`withhold`): one whose client has ended its stream meanwhile (it timed
out while the round ran, and closed) is not sent, nor anything after it, and its reads go back to
their queue rather than stay open with ids nobody learns (docs/sessions.md, *A get's items until
it replies*).
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from contextvars import Token
from functools import partial
from typing import Final

import gevent
import gevent.event
import structlog

from kestrel.service.session.stats import ServerStats
from kestrel.service.socket_io import ClientSocket, SendTimeout
from kestrel.storage import acknowledgements
from kestrel.storage.acknowledgements import Acknowledgements, Settled

# The bytes of replies held for the disk past which a connection reads no more requests until a
# round releases them: twice a get's bound (src/kestrel/service/session/session.py, `GET_BYTES`).
HELD_BYTES: Final = 1 << 20

log = structlog.get_logger("kestrel.connection")


def _nothing_to_send() -> None:
    """What a turn settled after its connection ended calls: its replies can go nowhere."""


class Replies:
    """The replies of one connection: sent at once when nothing holds them, else held in order.

    `hold` is called in the connection's greenlet before it serves requests; `finish` when it ends,
    to wait until what it holds has gone out (or can never go), and `release` last.
    """

    __slots__ = ("io", "stats", "peer", "acks", "_first_turn", "_first", "_first_reads", "_more",
                 "_held_bytes", "_sending", "_idle", "_room", "cut_off", "_holding", "_reads", "_withhold")

    def __init__(self, io: ClientSocket, stats: ServerStats, peer: str = "") -> None:
        self.io = io
        self.stats = stats
        self.peer = peer
        self.acks = Acknowledgements(self._settled)
        # The replies held, oldest first, each with the turn it waits for and the read ids it hands
        # out (None: none): the first in fields of its own, any after it (a client's pipelined
        # requests) in a list of (turn, reply, ids). A client waiting for each reply before its next
        # request, the usual case, holds one a round: no tuple and list entry made for it, nor a
        # list made and freed when it goes.
        self._first_turn: Settled | None = None
        self._first: bytes | None = None  # None: nothing held
        self._first_reads: list[int] | None = None
        self._more: list[tuple[Settled | None, bytes, list[int] | None]] = []
        self._held_bytes = 0  # the bytes held
        self._sending = False  # a send waits for room: later replies queue behind it
        self._idle: gevent.event.Event | None = None  # `finish` waits on it
        self._room: gevent.event.Event | None = None  # `wait_sent` waits on it
        self.cut_off = False  # a reply could not be made durable or sent: nothing more goes out
        self._holding: Token[Acknowledgements | None] | None = None
        self._reads: list[int] | None = None  # the read ids the next reply hands out (`hands_out`)
        # Between `hold` and `release`, asked with the read ids of a held reply as it is released or
        # dropped: True when it must not go out, its client gone (`Session.unsent`).
        self._withhold: Callable[[list[int]], bool] | None = None

    def hold(self, withhold: Callable[[list[int]], bool] | None = None) -> None:
        """Changes made from now on in the calling greenlet (the connection's) do not wait for the
        disk; their replies wait here instead (until `release`). `withhold` is asked about each held
        reply that hands out read ids as it is released or dropped (the module's doc)."""
        self._holding = acknowledgements.hold(self.acks)
        self._withhold = withhold

    def hands_out(self, read_ids: list[int]) -> None:
        """The next reply hands out `read_ids`: held, it is asked about before it goes out."""
        self._reads = read_ids

    def release(self) -> None:
        """The connection has ended: changes in its greenlet wait for the disk again, and turns
        settled later call nothing here. That call was a reference back from `acks` to these
        replies: left, the cycle outlives the connection until a full collection, and for good
        once a freeze caught it (src/kestrel/service/gc_pauses.py); so would `withhold`, a method of
        the session, which refers to these replies. Replies still held (the connection ended on
        an error, its client reset) are cut off first: none will go out."""
        if self._first is not None:
            self._cut(None)
        self.acks.settled = _nothing_to_send
        self._withhold = None
        holding, self._holding = self._holding, None
        if holding is not None:
            acknowledgements.release(holding)

    def send(self, data: bytes) -> None:
        """Send `data` after every earlier reply, once the changes made so far are durable: at once
        when nothing holds it (waiting, in the connection's greenlet, for room as
        `ClientSocket.send_all` does, or for a reply before it to get room: `wait_sent`). Raises
        SendTimeout, OSError from that send."""
        if not self._goes_now(data):
            self.wait_sent()
            return
        self._sending = True
        try:
            self.io.send_all(data)
            if self._first is not None:  # (most sends find none: nothing joined for nothing)
                self._send_released()
        finally:
            self._sending = False
            self._check_idle()

    @property
    def full(self) -> bool:
        """Whether a reply waits for room in the socket (a greenlet of its own finishes it), or the
        replies held for the disk reach `HELD_BYTES`: the connection reads no more meanwhile."""
        return self._sending or self._held_bytes >= HELD_BYTES

    def wait_sent(self) -> None:
        """Return once the replies are no longer `full`: what a connection calls before it reads more
        requests, so that a client that stops reading is read no more either."""
        while self.full:
            self._room = gevent.event.Event()
            try:
                self._room.wait()
            finally:
                self._room = None

    def send_at_once(self, data: bytes) -> None:
        """`send` that never waits, for a request answered in the hub's callback: what the socket
        does not take at once is finished by a greenlet of its own, as a released reply's is."""
        if self._goes_now(data):
            self._send_some(data)

    def _goes_now(self, data: bytes) -> bool:
        """Whether `data` goes out now (counted as written): else it is held behind the replies held
        or being sent and the changes not yet settled, or dropped once the connection is cut off."""
        reads = self._reads
        if reads is not None:
            self._reads = None
        if self.cut_off:
            if reads is not None:
                self._unsent(reads)
            return False
        last = self.acks.last
        if self._first is not None:
            self._more.append((last, data, reads))
        elif self._sending or (last is not None and not last.settled):
            self._first_turn = last
            self._first = data
            self._first_reads = reads
            self.io.owed = True
        else:
            self.stats.bytes_written += len(data)
            return True
        self._held_bytes += len(data)
        return False

    def _released(self) -> bytes:
        """The held replies whose changes are all settled, in order, taken out of the queue; up to
        the first handing out read ids to a client gone meanwhile, which, with all after it, is
        withheld (`_unsent`)."""
        data = self._first
        turn = self._first_turn
        if data is None or (turn is not None and not turn.settled):
            return b""
        if self._first_reads is not None and self._unsent(self._first_reads):
            self._first_reads = None
            self._withheld()
            return b""
        more = self._more
        count = 0
        gone = False
        for turn, _, reads in more:
            if turn is not None and not turn.settled:
                break
            if reads is not None and self._unsent(reads):
                gone = True
                break
            count += 1
        if count:
            data = b"".join([data, *[reply for _, reply, _ in more[:count]]])
        if count < len(more):  # the first still held
            turn, first, reads = more[count]
            self._first_turn, self._first, self._first_reads = turn, first, None if gone else reads
            del more[:count + 1]
        else:
            self._first_turn = self._first = self._first_reads = None
            more.clear()
            self.io.replied()
        self._held_bytes -= len(data)
        self.stats.bytes_written += len(data)
        if gone:
            self._withheld()
        return data

    def _unsent(self, reads: list[int]) -> bool:
        """Whether a held reply handing out `reads` must not go out, its client gone (`withhold`)."""
        withhold = self._withhold
        return withhold is not None and withhold(reads)

    def _withheld(self) -> None:
        """The first reply held goes out no more, its client gone, nor do those after it: nothing is
        sent from now on, and the connection ends as it reads the end of its client's stream."""
        self.cut_off = True
        self._drop_held()
        self._check_idle()

    def _drop_held(self) -> None:
        """Let go of every reply held, never to be sent; the read ids any of them hands out are
        asked about (`_unsent`), so that those of a client gone go back to their queue."""
        reads = [self._first_reads, *[reads for _, _, reads in self._more]]
        self._first_turn = self._first = self._first_reads = None
        self._more.clear()
        self._held_bytes = 0
        self.io.replied()
        for held in reads:
            if held is not None:
                self._unsent(held)

    def _send_released(self) -> None:
        """Send what was released while this greenlet sent (waiting for room as it goes)."""
        while data := self._released():
            self.io.send_all(data)

    def _settled(self) -> None:
        """From the commit log, on the event loop: a turn of this connection's changes is settled."""
        if self.acks.failed is not None:
            self._cut("a change could not be made durable")
            return
        if self._sending or self.cut_off:
            return  # the greenlet sending takes what was released when it is done
        data = self._released()
        if data:
            self._send_some(data)

    def _send_some(self, data: bytes) -> None:
        """On the event loop: send what the socket takes at once, and the rest from a greenlet."""
        try:
            sent = self.io.send_some(data)
        except OSError:  # the client is gone: its connection finds out when it reads
            self._cut(None)
            return
        if sent < len(data):
            self._sending = True
            gevent.spawn(partial(self._finish_sending, memoryview(data)[sent:]))
        else:
            self._check_idle()

    def _finish_sending(self, rest: memoryview) -> None:
        """A greenlet of its own: the rest of a released reply, then what was released meanwhile."""
        try:
            self.io.send_all(bytes(rest))
            self._send_released()
        except SendTimeout:
            log.info("closing a client that stopped reading its replies", client=self.peer,
                     limit="client_timeout")
            self._cut(None)
        except OSError:
            self._cut(None)
        finally:
            self._sending = False
            self._check_idle()

    def _cut(self, why: str | None) -> None:
        """Send nothing more and end the connection: its greenlet reads the end of the stream."""
        if why is not None and not self.cut_off:
            log.error(f"closing a client: {why}; its replies since are not sent", client=self.peer,
                      error=str(self.acks.failed))
        self.cut_off = True
        try:
            self.io.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._drop_held()  # (after the shutdown: a client that can read nothing more is gone)
        self._check_idle()

    def _check_idle(self) -> None:
        if self._sending:
            return
        room = self._room
        if room is not None:
            room.set()
        idle = self._idle
        if idle is not None and self._first is None:
            idle.set()

    def finish(self) -> None:
        """Return once every reply has gone out, or can never go (the connection ends)."""
        if self._first is not None or self._sending:
            self._idle = gevent.event.Event()
            self._idle.wait()
