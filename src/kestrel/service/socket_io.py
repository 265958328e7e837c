"""A client connection's socket I/O: system calls made straight on the OS socket, waits on the loop.

The listener hands each connection the OS socket itself, non-blocking (`accepted`), rather than
gevent's cooperative wrapper: that wrapper runs every `recv_into` and `send` through a Python method
with a timeout lookup and an exception handler, on every request. Here a call that would block
raises BlockingIOError and the greenlet waits on a watcher of the socket, which is all gevent's
wrapper does too.
"""

from __future__ import annotations

import os
import select
import socket
import time
import weakref
from collections.abc import Callable
from contextvars import copy_context
from typing import Any, Final

import gevent
import gevent.socket
from gevent import get_hub, getcurrent, monkey
from gevent.exceptions import BlockingSwitchOutError, ConcurrentObjectUseError
from gevent.socket import socket as gsocket
from greenlet import greenlet
from mypy_extensions import mypyc_attr

_c_receive_in_place: Callable[[int, bytearray, int], int] | None
_c_receive: Callable[[int, bytearray, int], int] | None
_c_send: Callable[[int, bytes | memoryview], int] | None
_c_drop_answered: Callable[[bytearray, int], None] | None
try:
    from kestrel.service._receive import drop_answered as _c_drop_answered
    from kestrel.service._receive import receive as _c_receive
    from kestrel.service._receive import receive_in_place as _c_receive_in_place
    from kestrel.service._receive import send as _c_send
except ImportError:  # built without a C compiler: every receive goes through the scratch buffer
    _c_receive_in_place = _c_receive = _c_send = _c_drop_answered = None
# (bound `Final`: the compiled build reads it from a C static, not the module's dictionary)
receive_in_place: Final = _c_receive_in_place


def _drop_answered(buf: bytearray, end: int) -> None:
    """The Python twin of the C helper's `drop_answered`, which keeps a small emptied buffer's block."""
    del buf[:end]


# The answered requests' bytes taken off the front of a connection's input, every protocol's: where
# that empties it, the C helper keeps a small request's block for the next receive (`del` gives it
# back and the receive allocates it again: about 390 instructions a request, 2026-11-30).
drop_answered: Final[Callable[[bytearray, int], None]] = (
    _drop_answered if _c_drop_answered is None else _c_drop_answered)

# The OS socket class, whatever monkey patching put in the `socket` module.
OSSocket: type[socket.socket] = monkey.get_original("socket", "socket")
# The OS `poll`, never gevent's (`ClientSocket.ended_now` looks, it never waits), and what it asks:
# the client's end of its stream (POLLRDHUP, seen behind input not yet read) or a reset.
_poll: Final[Callable[[], Any]] = monkey.get_original("select", "poll")
_ENDED: Final = select.POLLRDHUP | select.POLLHUP | select.POLLERR
_RESET: Final = select.POLLHUP | select.POLLERR
# The connections whose reading the server itself ended (`end_reading`): the end of the stream they
# show from then on is the server's, not their client's.
_reading_ended: Final[weakref.WeakSet[Any]] = weakref.WeakSet()


def end_reading(sock: socket.socket | gsocket) -> None:
    """End the reading of a connection, at a clean shutdown: it answers what it has read, then reads
    the end of its stream and closes. A get answered meanwhile (woken empty-handed, or with what it
    took) still replies: its client has not hung up, though the socket now says so."""
    _reading_ended.add(sock)
    try:
        sock.shutdown(socket.SHUT_RD)
    except OSError:
        pass


MAX_CHUNK: Final = 256 * 1024  # the largest receive any connection asks for

# A closing connection reads and drops what its client still sends for at most this long and this
# much (`close_lingering`): enough for what a client pipelined behind a request that ends the
# connection, too little for one that keeps sending to hold it.
LINGER_S = 2.0
LINGER_BYTES = 1 << 20


# A connection receives in place from its first receive of this many bytes on (1 KB items).
IN_PLACE_FROM: Final = 1024
# The most an in-place receive asks for: under glibc's threshold for mapping a block of its own
# (128 KiB), which would cost a map, page faults and an unmap each receive (16 µs against 2.6 µs
# for a 128-byte request, 2026-11-28); a 64 KB item's request fits.
IN_PLACE_ROOM: Final = 96 * 1024
# The least: the room follows what the connection receives, twice the receive that turned it to
# receiving in place and doubled each time a receive fills it, up to IN_PLACE_ROOM. A connection of
# 1 KB items so keeps a block the C helper's `drop_answered` keeps for the next request (up to 16
# KiB), where 96 KiB of room was a block allocated and given back twice an item (about 2,800
# instructions an item of 1 KB, 2026-12-01).
IN_PLACE_LEAST_ROOM: Final = 8 * 1024

# The buffer every connection's receives land in until it receives in place. Connections run on the
# one thread of the event loop, and a receive copies out of it before its greenlet can yield, so one
# is enough: 10,000 idle connections held 10,000 of them (256 KiB each for Thrift), and glibc kept
# most of that memory after they closed.
_SCRATCH: Final = memoryview(bytearray(MAX_CHUNK))


def receive_appending(fd: int, buf: bytearray, chunk: int) -> int:
    """Up to `chunk` bytes from socket `fd` appended to `buf`; how many (0: the end of the stream),
    or -1 when nothing is there yet. Raises OSError. The Python twin of the C helper's `receive`
    (src/kestrel/service/_receive.c), which a build with a C compiler calls instead."""
    if not 0 < chunk <= MAX_CHUNK:
        raise ValueError(f"receive chunk {chunk} is not within 1..{MAX_CHUNK}")
    try:
        n = os.readv(fd, [_SCRATCH[:chunk]])
    except BlockingIOError:
        return -1
    buf += _SCRATCH[:n]
    return n


def send_some(fd: int, data: bytes | memoryview) -> int:
    """How many bytes of `data` socket `fd` took at once (0: it had no room). Raises OSError. The
    Python twin of the C helper's `send`."""
    try:
        return os.write(fd, data)
    except BlockingIOError:
        return 0


# The two system calls of every request, made by the C helper where the build has one. Not `Final`:
# a stand-in replaces them where no socket is wanted (bench/bench_answer.py's serve loop, tests),
# before the connection is made: each `ClientSocket` binds them once.
_receive_appending: Callable[[int, bytearray, int], int] = (
    receive_appending if _c_receive is None else _c_receive)
_send_some: Callable[[int, bytes | memoryview], int] = send_some if _c_send is None else _c_send

# An int handed to a C helper on every request (a connection's limits, its receive size), held as
# the Python object it is: an `int` is kept unboxed by the compiled build and boxed again for each
# call of C, which allocates for any value past Python's small ints (256), about 130 instructions a
# value a call.
BoxedInt = Any

# Called on every wait, bound once: the compiled build calls a `Final` name from a C static, where a
# module global costs a lookup in the module's dictionary (so does every `Final` above).
_getcurrent: Final = getcurrent
# The clock of the idle time-out's stamps (`ClientSocket._check_idle`): the loop's timers run on the
# monotonic clock, its cached `now()` on the wall clock, which a step forward would make close a
# connection early.
_monotonic: Final = time.monotonic


class Readable:
    """A socket's wait for input on the loop of this thread's hub, which it keeps beside its watcher
    (`get_hub` looks it up in the thread's locals, 0.1 µs a wait).

    gevent's own wait makes a `Waiter` for each wait and goes through its checks; this one
    switches to the hub with the watcher set to switch straight back, 0.3–0.7 µs less a wait
    (alternated with gevent's on an always-readable socket, 2026-11-27), and a request waits
    once. The watcher's `start` and `stop` and the waiting greenlet's `switch` are bound once (by
    name, each was a method or attribute looked up in a Cython type's dictionary every wait), and
    whether a wait is under way is a flag of its own rather than the watcher's `callback`. It
    switches with greenlet's own `switch`, not the hub's method, whose one check (that the hub is
    not the one waiting: its `switch_out`, the only one a greenlet here can have) is made here;
    that `switch` is bound to the hub once too (called unbound, it checked each time that the hub
    is a greenlet, through the five classes of the hub's type). A
    wake-up that is not the socket's (a stray switch) only costs a receive that finds nothing and
    waits again; an exception thrown in (a kill) stops the watcher on its way out, as gevent's does.
    """

    def __init__(self, fd: int) -> None:
        self.hub: Any = get_hub()
        self._to_hub: Callable[[], Any] = greenlet.switch.__get__(self.hub)
        self.watcher: Any = self.hub.loop.io(fd, 1)
        self._start: Callable[..., None] = self.watcher.start
        self._stop: Callable[[], None] = self.watcher.stop
        self.waiting = False  # a greenlet waits, here or in a wait with a time limit
        # The greenlet that waited last and its bound `switch` (a connection's greenlet, each time
        # but while a get's wait has its watcher (`wait_watching`) read the socket); let go at `close`.
        self._waiter: Any = None
        self._wake: Callable[[], Any] | None = None

    def wait(self) -> None:
        """Wait for input; raises ConcurrentObjectUseError when another greenlet waits for it
        already, BlockingSwitchOutError in the hub's own greenlet."""
        self._claim()
        self._start(self._waking())
        self._park()

    def _claim(self) -> None:
        """Raises ConcurrentObjectUseError when a greenlet waits for this socket already."""
        if self.waiting:
            raise ConcurrentObjectUseError(f"this socket is already waited for by {self.watcher.callback!r}")

    def _park(self) -> None:
        """To the hub until the started watcher's callback resumes this greenlet; the watcher stopped
        whatever ends the wait."""
        self.waiting = True
        try:
            self._to_hub()
        finally:
            self.waiting = False
            self._stop()

    def _waking(self) -> Callable[[], Any]:
        """The calling greenlet's `switch`, for the watcher to end its wait; raises
        BlockingSwitchOutError in the hub's own greenlet (what the hub's `switch` refuses). Apart
        from `wait`, whose frame a traceback through it keeps, so that the frame holds no greenlet:
        a greenlet keeps the traceback it ended with, and the two would make a cycle."""
        current = _getcurrent()
        if current is self.hub:
            raise BlockingSwitchOutError("a socket cannot be waited for from the event loop's own greenlet")
        if current is not self._waiter:
            self._waiter = current
            self._wake = current.switch
        wake = self._wake
        assert wake is not None
        return wake

    def serve(self, serving: Callable[[Any], Any], argument: Any) -> None:
        """Leave the socket's input to `serving(argument)`, called in the hub whenever the socket is
        readable (the watcher stays started between its calls), until it calls `wake`; raises as `wait`."""
        self._claim()
        self._waking()
        self._start(serving, argument)
        self._park()

    def wake(self) -> None:
        """From `serve`'s callback, in the hub: resume the greenlet that serves (it stops the watcher)."""
        wake = self._wake
        assert wake is not None
        wake()

    def wait_at_most(self, timeout: float) -> None:
        """Wait for input at most `timeout` seconds (gevent's wait); raises TimeoutError."""
        self._claim()
        self.waiting = True
        try:
            gevent.socket.wait(self.watcher, timeout)
        finally:
            self.waiting = False

    def close(self) -> None:
        self.watcher.close()
        self._waiter = self._wake = None


@mypyc_attr(native_class=False)  # compiled classes derive from Exception only
class SendTimeout(TimeoutError):
    """A reply waited longer than the connection's `send_timeout` for the client to take it."""


def accepted(sock: gsocket) -> socket.socket:
    """The OS socket of a connection gevent's listening socket accepted, in non-blocking mode; it
    takes over the descriptor (the gevent socket is left closed) and is what the connection uses.
    Its family, type and protocol are passed on, else the new socket asks the kernel for them (three
    system calls a connection)."""
    os_socket = OSSocket(sock.family, sock.type, sock.proto, sock.detach())
    os_socket.setblocking(False)
    return os_socket


class ClientSocket:
    """A connection's receives and sends.

    Each receive of up to `chunk` bytes lands in the thread's scratch buffer (a `recv` of a fresh
    bytes object would allocate the full chunk size each time), then is appended to the input, so an
    idle connection holds no receive buffer at all. From its first receive of `IN_PLACE_FROM` bytes
    or more on, a connection receives in place instead, in its greenlet and in the hub's callback
    alike: straight into room made at the end of its input (room that follows what it receives,
    `IN_PLACE_LEAST_ROOM`), so that an item's bytes are copied once on their way to the journal
    (into the item), not twice; for small items the copy costs less than making the room, so they
    keep the scratch buffer. Between requests it first waits for the socket to be readable: a
    request/response client's next request is seldom there the moment its reply has gone out, and a
    `recv` that finds nothing costs a system call and an exception before the wait happens anyway
    (under 4 such clients the server made two `recvfrom` per request). It receives at once when the
    last receive filled the buffer, as more is then likely waiting.

    A reply goes out in one `send` when the socket takes it all; the rest waits for room, at most
    `send_timeout` seconds (None: without limit) for a client that stopped reading. Both calls are
    made on the descriptor (`receive_appending`, `send_some`: the C helper's where the build has
    one), which answers "nothing yet" and "no room" with a number rather than an exception.
    """

    def __init__(self, sock: socket.socket, chunk: int, send_timeout: float | None = None,
                 idle_timeout: float | None = None) -> None:
        if not 0 < chunk <= MAX_CHUNK:
            raise ValueError(f"receive chunk {chunk} is not within 1..{MAX_CHUNK}")
        self.sock = sock
        # its descriptor, for the system calls of each request; -1 once closed, so that a late call
        # fails with EBADF rather than reach a connection that reused the number
        self.fd = sock.fileno()
        self.chunk = chunk
        self._chunk: BoxedInt = chunk  # what each receive asks the C helper for
        self._receive_appending = _receive_appending  # (a module global would be looked up each call)
        self._send_some = _send_some
        self.drained = True  # the last receive took all there was (it did not fill its room)
        # a receive found the end of the stream: the client closed its side and all it sent was read
        self.ended = False
        self.in_place = False  # receives land in the input itself (a large receive was seen)
        self._room = 0  # what each receive in place asks for (`IN_PLACE_LEAST_ROOM`)
        # a receive waited for input since this was last cleared (src/kestrel/service/turns.py)
        self.waited = False
        self.send_timeout = send_timeout
        # the longest wait between requests (`client_timeout`; None: without limit), which one timer
        # of the loop checks (`_check_idle`), whether the greenlet waits or the hub serves
        self.idle_timeout = idle_timeout
        self._idle: Any = None  # that timer, from the first wait between requests on
        self._idle_waiting = False  # a wait between requests is under way
        self._active = 0.0  # when that wait began, or input last came to the hub meanwhile
        self._idle_over = False  # the timer found the connection idle for idle_timeout: ending its wait
        # A reply is held for the disk (src/kestrel/service/replies.py): the client waits for the
        # server, not the server for it, so the connection is not idle until it has gone out (`replied`).
        self.owed = False
        self._readable: Readable | None = None  # the waits for input, made at the first
        self._serving: Callable[[int], bool] | None = None  # `serve_from_hub`'s, while it waits
        self._serving_into: bytearray | None = None  # the input it receives into meanwhile
        self._handed: Exception | None = None  # what `_serving` raised, for the greenlet to raise
        self._writable: Any = None  # the loop's watcher for room to send, made at its first wait
        self._poller: Any = None  # `ended_now`'s look at the socket, made at its first

    def receive(self, buf: bytearray, timeout: float | None = None, between_requests: bool = False) -> int:
        """Append the next input to `buf`, waiting at most `timeout` seconds (None: without limit),
        or between requests at most `idle_timeout`; how many bytes came (0: the client closed).
        Raises TimeoutError."""
        if between_requests and self.drained:
            self.waited = True
            self._wait_readable(timeout, between_requests)
        while (n := self._receive_now(buf)) < 0:
            self.waited = True
            self._wait_readable(timeout, between_requests)
        return n

    def receive_ready(self, buf: bytearray) -> int:
        """Append what input is there to `buf`, never waiting: how many bytes (0: the client closed),
        or -1 when nothing is there yet (what a hub's callback receives, `serve_from_hub`)."""
        n = self._receive_now(buf)
        if n >= 0:
            self.waited = True  # the callback's call was the connection's wait for its client
        return n

    def ended_now(self) -> bool:
        """Whether the client has ended its stream (or reset it), found without waiting and without
        receiving: what it sent before the end stays in the socket, for the connection to read in
        its turn. A client that timed out on a stalled server and closed leaves its request followed
        by the end of its stream, both there once the server runs. Receiving nothing, the look may
        be made from the event loop outside the connection's reads (a reply released by the disk,
        src/kestrel/service/replies.py), where input taken in would wait unanswered."""
        if self.fd < 0:
            return True
        by_server = self.reading_ended_by_server()
        if self.ended and not by_server:
            return True
        poller = self._poller
        if poller is None:
            poller = self._poller = _poll()
            poller.register(self.fd, _ENDED)
        found = poller.poll(0)
        if by_server:  # only a reset is the client's
            return bool(found) and bool(found[0][1] & _RESET)
        return bool(found)

    def reading_ended_by_server(self) -> bool:
        """Whether the server ended this connection's reading (`end_reading`), so that the end of the
        stream it reads is not its client's hang-up. (The set is empty until a clean shutdown: a
        look at it costs a request nothing before.)"""
        return bool(_reading_ended) and self.sock in _reading_ended

    def _receive_now(self, buf: bytearray) -> int:
        """One receive appended to `buf`, in place once a large one was seen, through the scratch
        buffer before: how many bytes (0: the end of the stream), -1 when nothing is there yet."""
        if self.in_place:
            return self._receive_in_place(buf)
        n = self._receive_appending(self.fd, buf, self._chunk)
        if n >= 0:
            self.ended = n == 0
            self.drained = n < self.chunk
            if n >= IN_PLACE_FROM and receive_in_place is not None:
                self.in_place = True
                self._room = self._room_for(2 * n)
        return n

    def _receive_in_place(self, buf: bytearray) -> int:
        """`_receive_now` straight into room made at the end of `buf` (the C helper's), the room
        doubled when it filled."""
        assert receive_in_place is not None
        room = self._room
        n = receive_in_place(self.fd, buf, room)
        if n >= 0:
            self.ended = n == 0
            self.drained = n < room
            if n == room:
                self._room = self._room_for(2 * room)
        return n

    def _room_for(self, wanted: int) -> int:
        """The room a receive in place asks for where `wanted` would do: at least
        `IN_PLACE_LEAST_ROOM`, at most the chunk and `IN_PLACE_ROOM`."""
        return min(max(wanted, IN_PLACE_LEAST_ROOM), self.chunk, IN_PLACE_ROOM)

    def serve_from_hub(self, buf: bytearray, serving: Callable[[int], bool]) -> None:
        """Wait for input: each time the socket is readable, in the hub, what is there is appended to
        `buf` and `serving` called with how many bytes came, until it returns False or the client
        closes; then this greenlet goes on with its input. What `serving` raises is raised here, in
        this greenlet, never in the hub (docs/architecture.md, *Requests answered in the hub*); so is
        TimeoutError, when no input came for `idle_timeout`."""
        readable = self._begin_idle()
        self._serving, self._serving_into = serving, buf
        try:
            # The watcher's callback is `_serve_input` run in a copy of this greenlet's context, so
            # that the requests answered see its context variables as its own code does (a
            # connection's held acknowledgements: src/kestrel/storage/acknowledgements.py); the
            # context's own `run` is the callback (a layer of Python between them cost about 550
            # instructions a request with the `partial` it called, 2026-11-30).
            readable.serve(copy_context().run, self._serve_input)
        finally:
            # not held between waits: the connection's own method and input
            self._serving = self._serving_into = None
            self._idle_waiting = False
        handed, self._handed = self._handed, None
        if handed is not None:
            raise handed
        self._end_idle()

    def _serve_input(self) -> None:
        """The watcher's callback while `serve_from_hub` waits, in the hub, in the waiting greenlet's
        context: what is there received and served, the greenlet woken when it is to take over (with
        what `serving` raised, if anything). The switch leaves that context to the hub, which has it
        back when it resumes here and leaves it as the callback returns."""
        try:
            buf, serving = self._serving_into, self._serving
            assert buf is not None and serving is not None
            received = self.receive_ready(buf)
            if received > 0 and self._idle is not None:
                self._active = _monotonic()  # the one cost of the idle time-out a request
            if received < 0 or (received and serving(received)):
                return  # nothing there after all, or all of it answered
        except Exception as e:  # never the hub's: raised in the waiting greenlet
            self._handed = e
        assert self._readable is not None
        self._readable.wake()

    def _wait_readable(self, timeout: float | None, between_requests: bool) -> None:
        if between_requests:
            readable = self._begin_idle()
            try:
                readable.wait()
            finally:
                self._idle_waiting = False
            self._end_idle()
            return
        if self._readable is None:
            self._readable = Readable(self.fd)
        if timeout is None:
            self._readable.wait()
        else:
            self._readable.wait_at_most(timeout)

    def _begin_idle(self) -> Readable:
        """A wait between requests begins: its idle time starts now (the timer is started at the
        first and left running: a wait costs no timer of its own)."""
        if self._readable is None:
            self._readable = Readable(self.fd)
        if self.idle_timeout is not None:
            self._active = _monotonic()
            self._idle_waiting = True
            if self._idle is None:
                self._arm_idle(self.idle_timeout)
        return self._readable

    def _end_idle(self) -> None:
        """After a wait between requests: TimeoutError if the timer ended it."""
        if self._idle_over:
            self._idle_over = False
            raise TimeoutError(f"no request for {self.idle_timeout} s")

    def _arm_idle(self, seconds: float) -> None:
        assert self._readable is not None
        self._idle = self._readable.hub.loop.timer(seconds)
        self._idle.start(self._check_idle)

    def _check_idle(self) -> None:
        """The idle timer's callback, in the hub: a connection waiting between requests with no
        input for `idle_timeout` has its wait ended (TimeoutError in its greenlet); else the timer
        is armed again for what is left of the time-out (all of it, for a connection in a request,
        whose wait has yet to begin, or owing a reply held for the disk), as Redis checks a
        client's last interaction in its cron."""
        timeout = self.idle_timeout
        assert timeout is not None and self._readable is not None
        self._idle.close()
        self._idle = None
        left = timeout
        if self._idle_waiting and not self.owed:
            left = self._active + timeout - _monotonic()
            if left <= 0:
                self._idle_over = True
                self._readable.wake()
                return
        self._arm_idle(left)

    def replied(self) -> None:
        """The replies held for the disk have gone out (or never will): the client owes the next
        request from now on, and its idle time starts now."""
        self.owed = False
        self._active = _monotonic()

    def send_some(self, data: bytes | memoryview) -> int:
        """How much of `data` the socket takes at once (0: no room), never waiting: what a reply
        released on the event loop sends (src/kestrel/service/replies.py). Raises OSError."""
        return self._send_some(self.fd, data)

    def send_all(self, data: bytes | memoryview) -> None:
        """Send all of `data`, in one system call when the socket takes it all. Raises SendTimeout
        when the client takes none of it for `send_timeout`, OSError when it is gone."""
        sent = self._send_some(self.fd, data)
        while sent < len(data):
            if self._writable is None:
                self._writable = gevent.get_hub().loop.io(self.fd, 2)
            gevent.socket.wait(self._writable, self.send_timeout,
                               SendTimeout(f"the client took no reply for {self.send_timeout} s"))
            sent += self._send_some(self.fd, memoryview(data)[sent:])

    def close(self) -> None:
        """Release the watchers and the idle timer (the socket itself is the listener's to close); no
        call reaches its descriptor after this."""
        if self._idle is not None:
            self._idle.close()
            self._idle = None
        if self._readable is not None:
            self._readable.close()
        if self._writable is not None:
            self._writable.close()
        self._readable = self._writable = self._poller = None
        self.fd = -1


def close_lingering(sock: socket.socket | gsocket, seconds: float = LINGER_S,
                    most: int = LINGER_BYTES) -> None:
    """Close a client's connection without losing the replies sent last.

    A socket closed with input it has not read makes the kernel reset the connection rather than
    end it (as input arriving after the close does), and a reset drops what was not yet delivered:
    the error reply explaining why the server closes, behind the requests a client pipelined after
    the one at fault. So the sending side is shut first (the client reads every reply, then the end
    of the stream) and input is read and dropped until the client closes too, for at most `seconds`
    and `most` bytes, as web servers close (a client that ended first costs one `recv`). Then the
    socket is closed.
    """
    if sock.fileno() < 0:
        return
    os_socket = accepted(sock) if isinstance(sock, gsocket) else sock
    try:
        os_socket.shutdown(socket.SHUT_WR)
        _drop_input(os_socket, seconds, most)
    except OSError:
        pass  # reset or gone: nothing left to deliver
    finally:
        os_socket.close()


def _drop_input(sock: socket.socket, seconds: float, most: int) -> None:
    deadline = time.monotonic() + seconds
    left = most
    readable: Any = None
    try:
        while left > 0:
            try:
                received = sock.recv_into(_SCRATCH, min(left, MAX_CHUNK))
            except BlockingIOError:
                rest = deadline - time.monotonic()
                if rest <= 0:
                    return
                if readable is None:
                    readable = get_hub().loop.io(sock.fileno(), 1)
                try:
                    gevent.socket.wait(readable, rest)
                except TimeoutError:
                    return
                continue
            if not received:
                return  # the client closed its side too
            left -= received
    finally:
        if readable is not None:
            readable.close()
