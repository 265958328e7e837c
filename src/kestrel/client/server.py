"""One Kestrel server over Thrift: a small pool of connections, reopened when lost.

Safe to share between threads and greenlets: each call takes its own connection from the pool, and
all waiting is socket I/O (cooperative once gevent has patched the socket module). A connection
opened ahead of a call (`open_ahead`, for a Cluster) is opened in a thread of its own, or in a
greenlet of the caller's once gevent has patched sockets (`cooperation.py`). `close()` is final:
every call after it raises ClientClosed.
"""

from __future__ import annotations

import io
import socket
import threading
import time
import weakref
from collections.abc import Iterable
from functools import partial
from types import TracebackType
from typing import Any

from thriftpy2.protocol import TCyBinaryProtocol, TCyBinaryProtocolFactory
from thriftpy2.protocol.cybin import ProtocolError  # type: ignore[attr-defined]  # (a C module without stubs)
from thriftpy2.protocol.exc import TProtocolException
from thriftpy2.thrift import TApplicationException, TClient
from thriftpy2.transport import TCyBufferedTransport, TCyFramedTransportFactory, TSocket, TTransportException

from kestrel.client.checks import BytesLike, check_count, check_ids, check_items, check_queue
from kestrel.client.cooperation import Event, home, run_beside
from kestrel.client.errors import (
    ClientClosed,
    KestrelClientError,
    Refused,
    ServerClosing,
    ServerUnavailable,
    refusal,
)
from kestrel.client.packed import PackedItems, send_parts
from kestrel.contract import kestrel_thrift

# What a lost or unreachable server looks like from here.
CONNECTION_ERRORS = (TTransportException, OSError, EOFError)
# What thriftpy2 raises reading bytes that are no Thrift reply (its C reader's error, and its own).
NOT_A_REPLY = (ProtocolError, TProtocolException)
# A server that failed is avoided at least this many times as long as the failed try took (a connect
# or call timeout waited out), so that one which never answers costs its callers a tenth of their time.
AVOID_PER_COST = 10
MAX_AVOID_S = 60.0  # the longest avoidance that failures in a row grow to (unless retry_after is longer)
MAX_FRAME_SIZE = 16 * 1024 * 1024  # the servers' default `max_frame_size`
# The largest reply frame taken is the servers' `max_frame_size` (their largest item) and this much:
# a get's other items stop once their bytes reach 512 KB, and the rest is Thrift's framing.
REPLY_MARGIN = 1 << 20
RECEIVE_STEP = 1 << 20  # a reply's bytes are received (and held) as they come, this much at a time


class _Client(TClient):
    """thriftpy2's client, with each reply's frame received here, whole, before it is decoded:
    within the call's `deadline` (thriftpy2's socket timeout counted each read alone, so a server
    sending a byte now and then held a call for ever), and no longer than `max_reply` (thriftpy2's
    framed transport allocated whatever length a frame claimed: MemoryError at 2 GB)."""

    def __init__(self, sock: TSocket, max_reply: int) -> None:
        transport = TCyFramedTransportFactory().get_transport(sock)
        super().__init__(kestrel_thrift.Kestrel, TCyBinaryProtocolFactory().get_protocol(transport))
        self.sock, self.max_reply, self.deadline = sock, max_reply, 0.0

    def _recv(self, _api: str) -> Any:
        frame = receive_frame(self.sock.sock, self.deadline, self.max_reply)
        self._iprot = TCyBinaryProtocol(TCyBufferedTransport(io.BytesIO(frame)))
        try:
            return super()._recv(_api)
        except TTransportException as e:  # not the connection's end: the frame's
            raise TProtocolException(message=f"the reply ends before its frame of {len(frame)} bytes "
                                             f"says it does") from e


def receive_frame(sock: socket.socket, deadline: float, limit: int) -> bytes:
    """A framed reply's bytes, received by `deadline` (time.monotonic()); a frame claiming more
    than `limit` bytes, or none, is no Kestrel reply."""
    size = int.from_bytes(_receive(sock, 4, deadline), "big", signed=True)
    if not 0 < size <= limit:
        raise TProtocolException(message=f"a reply frame of {size} bytes (a reply holds 1 to {limit})")
    return _receive(sock, size, deadline)


def _receive(sock: socket.socket, size: int, deadline: float) -> bytes:
    chunks: list[bytes] = []
    while size:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("timed out: the reply did not come whole within the call's time-out")
        sock.settimeout(left)
        chunk = sock.recv(min(size, RECEIVE_STEP))
        if not chunk:
            raise EOFError("the server closed the connection")
        chunks.append(chunk)
        size -= len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class _Connection:
    """One framed binary Thrift connection, and the ids of the open reads its gets opened that
    this client has not settled yet (the server caps a connection's open reads on each queue),
    until `reads_due`: by then the server's auto-abort has returned every one of them."""

    def __init__(self, host: str, port: int, connect_timeout_ms: int, max_reply: int) -> None:
        self.open_reads: set[int] = set()
        self.reads_due = 0.0  # time.monotonic()
        self.socket = TSocket(host, port, socket_timeout=connect_timeout_ms,
                              connect_timeout=connect_timeout_ms)
        self.socket.open()
        self.client = _Client(self.socket, max_reply)

    def invoke(self, method: str, args: tuple[Any, ...], deadline: float) -> Any:
        """One call and its answer, which must come whole by `deadline`. A put of PackedItems is
        written whole, framed around the items' bytes as they are, and its answer read as any."""
        self.client.deadline = deadline
        if method == "put" and isinstance(args[1], PackedItems):
            queue, items, expiration_ms = args
            send_parts(self.socket.sock, items.put_call(queue, expiration_ms))
            return self.client._recv("put")
        return getattr(self.client, method)(*args)

    def close(self) -> None:
        self.socket.close()


class Opening:
    """A connection being opened ahead of calls, beside them (`Server.open_ahead`): once open it goes
    to its server's pool; `error` is the ServerUnavailable if it could not be (the server is then
    marked down, as after any failed connect). Each pass waiting on it (`watch`) is woken by its end
    on an event of the pass's own, shared by the pass's openings, so that the pass wakes for
    whichever of them ends first."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.home = home()  # who may wait on it
        self.done = False
        self.error: ServerUnavailable | None = None
        self._watchers: list[Event] = []
        self._lock = threading.Lock()

    def watch(self, ended: Event) -> None:
        """Set `ended` when the opening ends (at once if it has)."""
        with self._lock:
            if not self.done:
                self._watchers.append(ended)
                return
        ended.set()

    def end(self, error: ServerUnavailable | None) -> None:
        """The opening's last word: pooled (None), or why not."""
        with self._lock:
            self.error, self.done = error, True
            watchers, self._watchers = self._watchers, []
        for ended in watchers:
            ended.set()


class Server:
    """Kestrel's Thrift calls on one server.

    A call on a pooled connection that turns out to be dead is repeated once on a new connection
    (the server may have restarted since, closing every pooled one: they are dropped with it); any
    other connection failure raises ServerUnavailable
    and marks the server down for a while (`retry_after` seconds, longer after a try that waited out
    a timeout and after failures in a row: `_mark_down`), which a Cluster uses to try it last, or,
    after a timeout waited out, not at all (`still_hung`).
    An error the server answers with raises Refused, except a closed queue (the server is shutting
    down), which raises ServerClosing, a ServerUnavailable, and marks the server down too. A refusal
    because of the server's status marks that method refused for `retry_after` seconds
    (`avoids(method)`), so that a Cluster tries the other servers first.

    Use it as a context manager, or call `close()`; after either, every call raises ClientClosed.

    A get that opens reads (`auto_abort_ms`) takes a connection holding none of this client's
    unsettled ones, or a new one: the server caps the open reads of a connection on each queue
    (`max_open_reads`), and threads sharing the pool would otherwise pile theirs on one connection
    until a get of a queue full of items found none. A `confirm`, `abort` or `settle` of ids, from
    any connection, frees theirs, as does the end of their `auto_abort_ms` (the server has returned them).
    """

    def __init__(self, host: str, port: int, *, timeout_ms: int = 10_000, connect_timeout_ms: int = 2_000,
                 retry_after: float = 1.0, max_idle: int = 8, max_frame_size: int = MAX_FRAME_SIZE) -> None:
        self.host, self.port = host, port
        self.timeout_ms, self.connect_timeout_ms = timeout_ms, connect_timeout_ms
        self.max_reply = max_frame_size + REPLY_MARGIN
        self.retry_after, self.max_idle = retry_after, max_idle
        self.down_until = 0.0
        self._failures = 0  # failures in a row, since the server last answered
        self._failure: ServerUnavailable | None = None  # the last of them, and what it cost
        self._failure_cost = 0.0
        self._refused_until: dict[str, float] = {}  # method → when a status refusal is stale
        self._closed = False
        self._idle: list[_Connection] = []
        # an unsettled open read's id → its connection, while the connection lives
        self._opened_on: weakref.WeakValueDictionary[int, _Connection] = weakref.WeakValueDictionary()
        self._retired = False
        self._opening: Opening | None = None  # the connection last opened ahead (`open_ahead`)
        self._lock = threading.Lock()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def seems_down(self) -> bool:
        """Failed lately, and still avoided for it (see `_mark_down`)."""
        return time.monotonic() < self.down_until

    def still_hung(self) -> ServerUnavailable | None:
        """While the server is avoided after a failure that cost its caller a timeout (its cost, not
        `retry_after`, set the avoidance), why: an error saying so, for a Cluster that does not ask
        it at all meanwhile, since asking would likely cost as much again. None otherwise: a server
        that failed at once (a refused connection) costs nothing to ask, and may be back."""
        with self._lock:
            failure, cost = self._failure, self._failure_cost
        left = self.down_until - time.monotonic()
        if failure is None or left <= 0 or AVOID_PER_COST * cost <= self.retry_after:
            return None
        return ServerUnavailable(self.address, f"not asked, avoided {left:.1f} s more after a try that cost "
                                               f"{cost:.1f} s ({failure.reason})")

    def avoids(self, method: str) -> bool:
        """Seems down, or refused `method` because of its status less than `retry_after` ago."""
        now = time.monotonic()
        return now < self.down_until or now < self._refused_until.get(method, 0.0)

    @property
    def closed(self) -> bool:
        """Whether `close()` was called: then every call but `settle` raises ClientClosed."""
        return self._closed

    def __repr__(self) -> str:
        return f"Server({self.address})"

    def __enter__(self) -> Server:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    # -----------------------------------------------------------------------------------------
    # The Thrift calls

    def put(self, queue: str, items: Iterable[BytesLike], expiration_ms: int = 0) -> int:
        """Add items; returns how many were accepted (fewer when the queue is full).

        Items are bytes, bytearray or memoryview; anything else raises TypeError before anything is
        sent (see `Cluster.put_many`).
        """
        what = f"put on {queue!r}"
        check_queue(queue, what)
        check_count(expiration_ms, "expiration_ms", what)
        return self.put_checked(queue, check_items(items, what), expiration_ms)

    def put_checked(self, queue: str, items: list[bytes] | PackedItems, expiration_ms: int) -> int:
        """`put` of arguments already checked (a Cluster checks a batch once, whatever the servers
        it tries), or of items laid out already (PackedItems)."""
        return int(self.call("put", queue, items, expiration_ms))

    def get(self, queue: str, max_items: int = 1, timeout_ms: int = 0, auto_abort_ms: int = 0) -> list[Any]:
        """Up to `max_items` Items (`data`, `id`), waiting up to `timeout_ms` for the first.

        With `auto_abort_ms` > 0 each item is an open read: `confirm` or `abort` its id on this
        server (from any connection), or it returns to the head of its queue after that long.
        """
        return self._get("get", queue, max_items, timeout_ms, auto_abort_ms)

    def get_timed(self, queue: str, max_items: int = 1, timeout_ms: int = 0,
                  auto_abort_ms: int = 0) -> list[Any]:
        """`get`, with each item's `add_time_msec` and `expiry_msec` (None: never) as TimedItems; a
        queue the server does not hold is not created (no items). A call Kestrel's own servers lack."""
        return self._get("get_timed", queue, max_items, timeout_ms, auto_abort_ms)

    def _get(self, method: str, queue: str, max_items: int, timeout_ms: int,
              auto_abort_ms: int) -> list[Any]:
        what = f"{method} from {queue!r}"
        check_queue(queue, what)
        check_count(max_items, "max_items", what, least=1)
        check_count(timeout_ms, "timeout_ms", what)
        check_count(auto_abort_ms, "auto_abort_ms", what)
        items = list(self.call(method, queue, max_items, timeout_ms, auto_abort_ms, wait_ms=timeout_ms))
        if len(items) > max_items:  # a hostile or broken peer: its items are no queue's
            raise self._mark_down(0.0, ServerUnavailable(
                self.address, f"{method}: the answer is not a Kestrel Thrift reply ({len(items)} items, "
                              f"where {max_items} were asked for)", maybe_done=True))
        return items

    def peek_items(self, queue: str, first: int = 0, max_items: int = 1) -> Any:
        """Up to `max_items` items from position `first` on, left where they are: an ItemsAt
        (`opened_at`, `head`, `items`, `after`, `shown`: TimedItems), fewer once their bytes reach
        512 KB (go on from `after`). Nothing is opened or counted,
        so a look is no delivery; only items the server holds in memory are shown (`after` stops
        where the rest is on disk); a queue the server does not hold is not created. A call
        Kestrel's own servers lack."""
        what = f"peek_items of {queue!r}"
        check_queue(queue, what)
        check_count(max_items, "max_items", what)
        check_count(first, "first", what)
        return self.call("peek_items", queue, first, max_items)

    def queue_names(self) -> list[str]:
        """The queues the server holds (aliases not); creates nothing. A call Kestrel's servers lack."""
        return list(self.call("queue_names"))

    def confirm(self, queue: str, ids: set[int]) -> int:
        """Remove open reads for good; returns how many were still open."""
        what = f"confirm on {queue!r}"
        return int(self.call("confirm", check_queue(queue, what), check_ids(ids, what)))

    def abort(self, queue: str, ids: set[int]) -> int:
        """Return open reads to the head of their queue; returns how many were still open."""
        what = f"abort on {queue!r}"
        return int(self.call("abort", check_queue(queue, what), check_ids(ids, what)))

    def peek(self, queue: str) -> Any:
        """The queue's QueueInfo: head item, items, bytes, journal bytes, age, waiters, open reads."""
        return self.call("peek", check_queue(queue, f"peek of {queue!r}"))

    def status(self) -> int:
        """The server's status, as kestrel_thrift.Status (UP, READ_ONLY, QUIESCENT, NOT_CONFIGURED)."""
        return int(self.call("current_status"))

    def set_status(self, status: int) -> None:
        """Set the server's status: one of kestrel_thrift.Status's values."""
        if isinstance(status, bool) or not isinstance(status, int):
            raise TypeError(f"set_status: the status must be a kestrel_thrift.Status value, got "
                            f"{type(status).__name__}")
        names = kestrel_thrift.Status._VALUES_TO_NAMES
        if status not in names:
            listed = ", ".join(f"{name} ({value})" for value, name in sorted(names.items()))
            raise ValueError(f"set_status: {status} is no status; the statuses are {listed}")
        self.call("set_status", status)

    # -----------------------------------------------------------------------------------------
    # Connections

    def settle(self, queue: str, confirm: set[int], abort: set[int]) -> None:
        """Abort, then confirm, open reads taken before: the one call still allowed after `close()`,
        so that work in flight when a client closes ends cleanly instead of waiting out the
        auto-abort and being delivered again. Raises like the other calls."""
        failed: list[KestrelClientError] = []
        for method, ids in (("abort", abort), ("confirm", confirm)):
            if ids:
                try:
                    self.call(method, queue, set(ids), after_close=True)
                except KestrelClientError as e:  # still try the other half
                    failed.append(e)
        if failed:
            raise failed[0]

    def call(self, method: str, *args: Any, wait_ms: int = 0, after_close: bool = False) -> Any:
        """Call a Kestrel Thrift method; `wait_ms` is how long the server may legitimately take.

        After `close()` it raises ClientClosed, unless `after_close` (see `settle`); the connection
        such a call opens is closed when it ends.
        """
        if self._closed and not after_close:
            raise ClientClosed(f"cannot call {method} on kestrel {self.address}")
        opens_reads = method in ("get", "get_timed") and args[3] > 0
        for attempt in (1, 2):
            conn, reused = self._take(fresh=attempt == 2, without_reads=opens_reads)
            allowed_ms = self.timeout_ms + max(wait_ms, 0)
            conn.socket.set_timeout(allowed_ms)
            started = time.monotonic()
            try:
                result = conn.invoke(method, args, started + allowed_ms / 1000)
            except (TApplicationException, *NOT_A_REPLY) as e:
                if not isinstance(e, TApplicationException) or e.type == TApplicationException.MISSING_RESULT:
                    # Bytes that are no Kestrel reply (another service on the port, a proxy): the
                    # connection's state is unknown, and the next server may serve the call.
                    conn.close()
                    raise self._mark_down(self._call_cost(started, wait_ms), ServerUnavailable(
                        self.address, f"{method}: the answer is not a Kestrel Thrift reply ({e})",
                        maybe_done=True)) from e
                error = refusal(self.address, e.message or str(e))
                if isinstance(error, ServerClosing):
                    conn.close()
                    self._mark_down(self._call_cost(started, wait_ms), error)
                else:
                    self._answered()
                    if isinstance(error, Refused) and error.by_status:
                        self._refused_until[method] = time.monotonic() + self.retry_after
                    self._give_back(conn)
                raise error from None
            except CONNECTION_ERRORS as e:
                conn.close()
                if reused and attempt == 1 and not isinstance(e, socket.timeout):
                    # An idle connection the server closed (a restart closes the others too): say
                    # it again on a new one.
                    self._drop_idle()
                    continue
                raise self._mark_down(self._call_cost(started, wait_ms), ServerUnavailable(
                    self.address, f"{method} failed: {e!r}", maybe_done=True)) from e
            except BaseException:
                conn.close()  # interrupted mid-call (a gevent timeout, a signal): its state is unknown
                raise
            finally:
                if method in ("confirm", "abort"):  # settled, or left to the server's auto-abort
                    self._forget_reads(args[1])
            self._answered()
            if opens_reads and result:
                self._note_reads(conn, result, time.monotonic() + args[3] / 1000)  # the server's is sooner
            self._give_back(conn)
            return result
        raise AssertionError("unreachable")

    def _note_reads(self, conn: _Connection, items: list[Any], due: float) -> None:
        with self._lock:
            conn.reads_due = max(conn.reads_due, due)
            for item in items:
                conn.open_reads.add(item.id)
                self._opened_on[item.id] = conn

    def _forget_reads(self, ids: Iterable[int]) -> None:
        with self._lock:
            for read_id in ids:
                conn = self._opened_on.pop(read_id, None)
                if conn is not None:
                    conn.open_reads.discard(read_id)

    def has_idle(self, without_reads: bool = False) -> bool:
        """Whether a call would find a pooled connection (one holding no open reads, `without_reads`)."""
        with self._lock:
            return any(not (without_reads and self._holds_reads(conn)) for conn in self._idle)

    def connecting(self) -> bool:
        """Whether a connection opened ahead is under way that this caller would join (`open_ahead`)."""
        with self._lock:
            return self._under_way() is not None

    def open_ahead(self, ended: Event) -> tuple[Opening, bool]:
        """A connection being opened for the pool beside the caller (`cooperation.run_beside`), which
        sets `ended` when it ends, and whether it was begun now: one under way already, begun by
        another pass, is joined, since a second connect to a hung host would cost its timeout again
        and mark the server down once more. So a Cluster need not wait for this server's connect
        before it begins the next one's. It ends with the connect (within its connect timeout, once
        the host's name is resolved)."""
        with self._lock:
            opening = self._under_way()
            begun = opening is None
            if opening is None:
                opening = self._opening = Opening()
        opening.watch(ended)
        if begun:
            run_beside(partial(self._open, opening), f"kestrel-connect-{self.address}")
        return opening, begun

    def _under_way(self) -> Opening | None:
        """The connection being opened ahead that this caller may wait on: not one begun on another
        thread's hub, which only that hub runs (`cooperation.home`)."""
        opening = self._opening
        return opening if opening is not None and not opening.done and opening.home == home() else None

    def _open(self, opening: Opening) -> None:
        error = None
        try:
            conn, _ = self._take(fresh=True)
            self._give_back(conn)
        except ServerUnavailable as e:
            error = e
        finally:
            opening.end(error)

    def _holds_reads(self, conn: _Connection) -> bool:
        """Whether `conn` holds open reads neither settled nor returned by their auto-abort (then
        forgotten: left to it, they kept the connection from every later reliable get, each of
        which opened a connection of its own). Called with `_lock` held."""
        if conn.open_reads and time.monotonic() >= conn.reads_due:
            for read_id in conn.open_reads:
                self._opened_on.pop(read_id, None)
            conn.open_reads.clear()
        return bool(conn.open_reads)

    def _take(self, fresh: bool = False, without_reads: bool = False) -> tuple[_Connection, bool]:
        """An idle connection (one holding no unsettled open reads, for a get that opens some), or,
        `fresh` or with none idle, a new one."""
        with self._lock:
            if not fresh:
                for n in range(len(self._idle) - 1, -1, -1):
                    if not (without_reads and self._holds_reads(self._idle[n])):
                        return self._idle.pop(n), True
        started = time.monotonic()
        try:
            conn = _Connection(self.host, self.port, self.connect_timeout_ms, self.max_reply)
        except CONNECTION_ERRORS as e:
            raise self._mark_down(time.monotonic() - started,
                                  ServerUnavailable(self.address, f"cannot connect: {e!r}")) from e
        return conn, False

    @staticmethod
    def _call_cost(started: float, wait_ms: int) -> float:
        """What a failed call cost its caller beyond the wait it asked for (a timeout waited out)."""
        return max(time.monotonic() - started - max(wait_ms, 0) / 1000.0, 0.0)

    def _mark_down(self, cost: float, failure: ServerUnavailable) -> ServerUnavailable:
        """Avoid the server after `failure`, which cost its caller `cost` seconds: for `retry_after`, or
        AVOID_PER_COST times the cost if longer, doubled for each failure in a row before it, up to
        MAX_AVOID_S; returns `failure`. The avoidance must outlast what a try costs: a second of it
        after a connect timeout of two had run out by the time a producer came back, and two puts in
        three stalled. A failure whose cost set the avoidance (a timeout waited out) makes the server
        `still_hung` for all of it."""
        with self._lock:
            self._failures += 1
            doublings = min(self._failures - 1, 16)
            self._failure, self._failure_cost = failure, cost
        avoid = max(self.retry_after, AVOID_PER_COST * cost) * 2 ** doublings
        self.down_until = time.monotonic() + min(avoid, max(MAX_AVOID_S, self.retry_after))
        return failure

    def _answered(self) -> None:
        """The server answered: its failures in a row end, and so does its avoidance."""
        if self._failures:
            with self._lock:
                self._failures = 0
                self.down_until = 0.0

    def _give_back(self, conn: _Connection) -> None:
        with self._lock:
            if not self._closed and not self._retired and len(self._idle) < self.max_idle:
                self._idle.append(conn)
                return
        conn.close()

    def _drop_idle(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def retire(self) -> None:
        """Close the idle connections and pool no more (a server that left its Cluster's sets);
        calls still work, each on a connection of its own, closed when it ends."""
        self._retired = True
        self._drop_idle()

    def close(self) -> None:
        """Close the idle connections (calls in flight close theirs when they finish); final."""
        self._closed = True
        self._drop_idle()
