"""Kestrel's Thrift service: one greenlet per connection under the shared listener.

Requests are read with this server's own checked readers (src/kestrel/service/thrift/protocol.py), binary or
compact, framed or unframed: every length and count is checked against what the frame (or, unframed,
`max_frame_size`) can hold and against `max_batch_items` / `max_batch_bytes` before anything is read
or allocated. A framed request that is malformed gets a TApplicationException and the connection
goes on (the frame says where the next request starts); an unframed one cannot be resynchronised,
so its connection is closed after the reply.
"""

from __future__ import annotations

import inspect
import socket
from collections.abc import Callable
from functools import partial
from typing import Any, ClassVar, Final, TypeVar

import structlog

from kestrel.contract import kestrel_thrift
from kestrel.service import metrics
from kestrel.service.buffered_connection import make_listener, wait_watching
from kestrel.service.histogram_series import HistogramSeries
from kestrel.service.listener import Listener
from kestrel.service.session.server_state import ServerState
from kestrel.service.session.session import ClientGone, Session, SessionError
from kestrel.service.socket_io import BoxedInt, drop_answered
from kestrel.service.thrift.messages import (
    INTERNAL_ERROR,
    INVALID_MESSAGE_TYPE,
    METHODS,
    PROTOCOL_ERROR,
    READS_BUFFERED_FRAMES,
    UNKNOWN,
    UNKNOWN_METHOD,
    Method,
    encode_exception,
    encode_reply,
    read_args,
    read_buffered_frame,
    read_plain_frame,
)
from kestrel.service.thrift.protocol import CALL, PROTOCOLS, BinaryReader, Reader, ThriftProtocolError
from kestrel.service.thrift.transport import ClientStream, ConnectionDone
from kestrel.service.turns import Turns
from kestrel.storage import QItem
from kestrel.storage.clock import perf_counter
from kestrel.storage.errors import KestrelError
from kestrel.storage.taken_items import TakenItems

log = structlog.get_logger("kestrel.thrift")

T = TypeVar("T")


def _queue(name: str | None) -> str:
    return _given("queue_name", name)


def _given(field: str, value: T | None) -> T:
    """An argument the call cannot do without (its contract gives it no default); a client that
    left it out is told so, rather than answered as if it had sent an empty one."""
    if value is None:
        raise SessionError(f"{field} is missing")
    return value


# The methods a connection may answer in the hub's callback (`_answers_at_once`), known by identity:
# a comparison of names cost two string comparisons a request.
_GET: Final = METHODS["get"]
_PUT: Final = METHODS["put"]
_CONFIRM: Final = METHODS["confirm"]
_ABORT: Final = METHODS["abort"]

# A call's arguments as the readers give them: in the contract's order, its default for each a
# client left out (None where it has none) (messages.py).
Arguments = tuple[Any, ...]


class ThriftHandler:
    """The Kestrel service methods, each a thin shell over the session layer. Each takes the call's
    arguments positionally, in the contract's order and under its names (`method_calls` checks
    them against it): the readers hand them over as a tuple, with no dict made and looked up."""

    def __init__(self, session: Session) -> None:
        self.session = session

    def put(self, queue_name: str | None, items: list[bytes] | None, expiration_msec: int | None) -> int:
        expiry = self.session.expiry_after(expiration_msec or 0)
        return self.session.put(_queue(queue_name), _given("items", items), expiry)

    def get(self, queue_name: str | None, max_items: int | None, timeout_msec: int | None,
            auto_abort_msec: int | None) -> TakenItems:
        """The Items: each item's data and id (the encoder lays them out)."""
        return self.session.get_items(_queue(queue_name), max_items or 0, timeout_msec or 0,
                                      auto_abort_msec or 0)

    def get_timed(self, queue_name: str | None, max_items: int | None, timeout_msec: int | None,
                  auto_abort_msec: int | None) -> TakenItems:
        """The TimedItems: each item's data, id, add time and expiry; creates no queue."""
        return self.session.get_items(_queue(queue_name), max_items or 0, timeout_msec or 0,
                                      auto_abort_msec or 0, create=False, capped=False)

    def peek_items(self, queue_name: str | None, first: int | None, max_items: int | None) -> tuple[Any, ...]:
        """ItemsAt as a tuple of its fields in order, each TimedItem a tuple too (id 0)."""
        looked = self.session.peek_items(_queue(queue_name), first or 0, max_items or 0)
        shown = [(item.data, 0, item.add_time, item.expiry or None) for item in looked.shown]
        return (looked.opened_at, looked.head, looked.items, looked.after, shown)

    def queue_names(self) -> list[str]:
        return self.session.queue_names()

    def confirm(self, queue_name: str | None, ids: list[int] | None) -> int:
        _queue(queue_name)  # required by the contract; the reads are closed by id, in their own queues
        return self.session.confirm_ids(set(_given("ids", ids)))

    def abort(self, queue_name: str | None, ids: list[int] | None) -> int:
        _queue(queue_name)
        return self.session.abort_ids(set(_given("ids", ids)))

    def peek(self, queue_name: str | None) -> Any:
        return kestrel_thrift.QueueInfo(**self.session.queue_info(_queue(queue_name)))

    def flush_queue(self, queue_name: str | None) -> None:
        self.session.flush(_queue(queue_name))

    def flush_all_queues(self) -> None:
        self.session.flush_all()

    def delete_queue(self, queue_name: str | None) -> None:
        self.session.delete(_queue(queue_name))

    def current_status(self) -> int:
        return int(self.session.current_status())

    def set_status(self, status: int | None) -> None:
        self.session.set_status(_given("status", status))

    def get_version(self) -> str:
        return self.session.server.version


# Each method's handler function, contract and answer-time histogram, by the method's number, looked
# up once in the process (at the first connection, so that a server without Thrift clients shows no
# Thrift series): every connection shares them, where each once built its own table at a cost that
# showed in a connect.
Call = tuple[Callable[..., Any], Method, HistogramSeries]
_calls: list[Call] = []
# The histograms of `_calls` alone, by the method's number, for each call (`Final`: a C static in the
# compiled build, and no tuple of the three taken apart a call).
_latencies: Final[list[HistogramSeries]] = []


def parameter_names(function: Callable[..., Any]) -> tuple[str, ...]:
    """The names of a handler function's parameters after `self`, as the contract must name them."""
    return tuple(inspect.signature(function).parameters)[1:]


def method_calls() -> list[Call]:
    """The table every connection answers calls from (`_calls`), made on first use. A handler whose
    parameters are not its method's arguments in the contract's order is refused here, once."""
    if not _calls:
        calls: list[Call] = []
        for number, (name, method) in enumerate(METHODS.items()):
            function = getattr(ThriftHandler, name)
            if number != method.number or parameter_names(function) != method.names:
                raise TypeError(f"ThriftHandler.{name} takes {parameter_names(function)}, the contract "
                                f"{method.names}")
            calls.append((function, method, metrics.request_latency("thrift", name)))
        _calls.extend(calls)
        _latencies[:] = [latency for _, _, latency in calls]
    return _calls


class ThriftConnection:
    """One client: read a request, call the handler, write the reply; errors map here, once."""

    protocol: ClassVar[str] = "thrift"

    def __init__(self, server: ServerState, sock: socket.socket, peer: str) -> None:
        cfg = server.config
        self.cfg = cfg
        self.peer = peer
        self.stream = ClientStream(sock, server.stats, cfg.client_timeout, cfg.request_timeout, peer)
        self.turns = Turns(self.stream.io)
        self.session = Session(server, peer, pause=self.turns.pause, protocol=self.protocol,
                               watch=partial(_watched, self.stream, cfg.max_frame_size),
                               hung_up=self.stream.io.ended_now,
                               hands_out=self.stream.replies.hands_out)
        self.handler = ThriftHandler(self.session)
        self.calls = method_calls()
        # Each method's function bound to this connection's handler, at its first call (`_call`).
        self.bound: list[Callable[..., Any] | None] = [None] * len(self.calls)
        self.reader_cls, self.writer_cls = PROTOCOLS[cfg.thrift_protocol]
        self.framed = cfg.thrift_transport == "framed"  # each reply made as a frame, its size first
        # Between requests the plain binary puts, gets, confirms and aborts that cannot wait are
        # answered in the hub's callback (`_served_in_hub`).
        self.hub_serves = READS_BUFFERED_FRAMES and self.framed and self.reader_cls is BinaryReader
        # (boxed once: each frame hands them to the compiled reader)
        self.max_frame: BoxedInt = cfg.max_frame_size
        self.max_items: BoxedInt = cfg.max_batch_items
        self.max_bytes: BoxedInt = cfg.max_batch_bytes

    def run(self) -> bool:
        """Serve the client until it leaves; True when it ended the stream and all of it was read."""
        self.stream.replies.hold(self.session.unsent)
        try:
            try:
                if self.cfg.thrift_transport == "framed":
                    self._serve_framed()
                else:
                    self._serve_buffered()
            except ConnectionDone as e:
                log.warning("closing thrift connection", client=self.peer, reason=str(e))
            except ClientGone:  # its end of the stream ended a get's wait: nothing more to answer,
                pass  # but a half-closed client still reads the replies held before it
            self.stream.replies.finish()
        finally:
            self.stream.replies.release()
            self.stream.close()
            self.session.close()
        return self.stream.io.ended

    def _reader(self, buf: bytes | bytearray, end: int, limit: int, **kwargs: Any) -> Reader:
        return self.reader_cls(buf, end, limit, self.cfg.max_batch_items, self.cfg.max_batch_bytes,
                               pause=self.turns.pause, **kwargs)

    def _serve_framed(self) -> None:
        """Each frame in turn, read where it lies in the receive buffer (no copy of the frame): a
        plain binary call in one compiled step, any other by the protocol's reader."""
        stream, turns = self.stream, self.turns
        plain = self.reader_cls is BinaryReader
        max_frame, max_items, max_bytes = self.max_frame, self.max_items, self.max_bytes
        # (no `*` in the calls: the compiled build then calls the compiled function straight)
        replies = stream.replies
        while True:
            if replies.full:
                replies.wait_sent()  # no more requests read while a reply waits for room or the disk
            if self.hub_serves and not stream.buf:
                if not self._serve_from_hub():
                    return
                if not stream.buf:
                    continue  # woken with nothing to answer
            elif not stream.wait_request():
                return
            call = read_buffered_frame(stream.buf, max_frame, max_items, max_bytes) if plain else None
            if call is None:
                end = stream.whole_frame(max_frame)
                call = read_buffered_frame(stream.buf, max_frame, max_items, max_bytes) if plain else None
            if call is not None:
                method, seqid, args, at = call  # (once: compiled, each `call[i]` checks the whole tuple)
                drop_answered(stream.buf, at)
                reply: bytes | None = self._call(method, seqid, args)
            else:
                reply = self.answer(self._reader(stream.buf, end, end, start=4))[0]
                drop_answered(stream.buf, end)
            if reply is None:
                return
            stream.send(reply)
            reply = None  # not held while the connection waits (a get's reply holds its items)
            turns.pause()

    def _serve_from_hub(self) -> bool:
        """Wait for input, the requests that cannot wait answered in the hub meanwhile; True when
        input is left for this greenlet to answer, False when the client closed."""
        stream = self.stream
        stream.deadline = None
        try:
            stream.io.serve_from_hub(stream.buf, self._served_in_hub)
        except TimeoutError:
            raise stream.idle_over() from None
        return not stream.io.ended

    def _served_in_hub(self, received: int) -> bool:
        """In the hub, `received` bytes come: answer the whole plain calls that cannot wait, each
        reply sent without waiting; False to wake the connection's greenlet for the rest
        (`ClientSocket.serve_from_hub`), or to wait there while a reply waits for room."""
        stream = self.stream
        buf = stream.buf
        stream.stats.bytes_read += received
        while True:  # (`buf` holds what came; its truth tested once a request, about 40 instructions a test)
            call = read_buffered_frame(buf, self.max_frame, self.max_items, self.max_bytes)
            if call is None:
                break
            method, seqid, args, end = call  # (once: compiled, each `call[i]` checks the whole tuple)
            if not self._answers_at_once(method, args):
                break
            drop_answered(buf, end)
            replies = stream.replies
            replies.send_at_once(self._call(method, seqid, args))
            if not buf:
                return not replies.full
            if replies.full or self.turns.over():
                break  # the rest in the connection's greenlet, which waits for room or steps aside
        return not buf and not stream.replies.full

    def _answers_at_once(self, method: Method, args: Arguments) -> bool:
        """Whether a call completes without yielding: a put or a get (auto-abort or not) that its
        session answers at once (`Session.answers_at_once`), a confirm or an abort of reads whose
        queues all do (`Session.closes_at_once`)."""
        if method is _GET:
            return args[0] is not None and self.session.answers_at_once(args[0], args[1] or 0, args[2] or 0)
        if method is _CONFIRM or method is _ABORT:
            return args[0] is not None and args[1] is not None and self.session.closes_at_once(args[1])
        return method is _PUT and args[0] is not None and self.session.answers_at_once(args[0])

    def answer_frame(self, payload: bytes) -> bytes | None:
        """The reply to one framed request's payload (None: nothing can be answered), as
        `_serve_framed` answers it: the request's Python cost without a socket (bench/)."""
        if self.reader_cls is BinaryReader:
            plain = read_plain_frame(payload, self.cfg.max_batch_items, self.cfg.max_batch_bytes)
            if plain is not None:
                method, seqid, args = plain
                return self._call(method, seqid, args)
        return self.answer(self._reader(payload, len(payload), len(payload)))[0]

    def _serve_buffered(self) -> None:
        stream = self.stream
        while stream.wait_request():
            reader = self._reader(stream.buf, len(stream.buf), self.cfg.max_frame_size, more=stream.fill,
                                  scope="request (max_frame_size)")
            reply, intact = self.answer(reader)
            if reply is not None:
                stream.send(reply)
            if not intact:
                return
            drop_answered(stream.buf, reader.pos)
            self.turns.pause()

    def answer(self, reader: Reader) -> tuple[bytes | None, bool]:
        """The reply to the message in `reader` (None: nothing can be answered), and whether the
        message was read to its end, so that the next one can follow."""
        try:
            name, mtype, seqid = reader.read_message_begin()
        except ThriftProtocolError as e:
            log.warning("closing thrift connection after an unreadable message header", client=self.peer,
                        reason=str(e))
            return None, False
        method = METHODS.get(name)
        try:
            args, problem = read_args(reader, method)
        except ThriftProtocolError as e:
            log.warning("malformed thrift request", client=self.peer, method=name, reason=str(e))
            return self._error(name, seqid, PROTOCOL_ERROR, f"malformed {name} request: {e}"), False
        if mtype != CALL:
            return self._error(name, seqid, INVALID_MESSAGE_TYPE, f"message type {mtype} is not a call"), True
        if method is None:
            return self._error(name, seqid, UNKNOWN_METHOD, f"unknown method {name!r}"), True
        if problem is not None:
            return self._error(name, seqid, PROTOCOL_ERROR, problem), True
        return self._call(method, seqid, args), True

    def _call(self, called: Method, seqid: int, args: Arguments) -> bytes:
        """The reply to a call of `called` with `args`, timed. A put and a get, the calls of the hot
        path, are called on the handler as compiled methods (a direct call, about 280 instructions
        less than a call through their bound function taking the arguments' tuple); the others
        through the function bound at their first call."""
        number = called.number
        latency = _latencies[number]
        started = perf_counter()
        try:
            if called is _PUT:
                result: Any = self.handler.put(args[0], args[1], args[2])
            elif called is _GET:
                result = self.handler.get(args[0], args[1], args[2], args[3])
            else:
                function = self.bound[number]
                if function is None:
                    function = self.bound[number] = getattr(self.handler, called.name)
                # (bound, it takes the arguments' tuple as it is: `function(self.handler, *args)`
                # compiled makes a list of the two, extends it and copies it into a tuple each call)
                result = function(*args)
        except ClientGone:
            raise
        except KestrelError as e:
            return self._error(called.name, seqid, UNKNOWN, str(e))
        except Exception as unexpected:
            name = called.name
            log.exception("thrift call failed", method=name, client=self.peer)
            return self._error(name, seqid, INTERNAL_ERROR, f"internal error in {name}: {unexpected!r}")
        finally:
            latency.observe(perf_counter() - started)
        return encode_reply(self.writer_cls, called, seqid, result, self.framed)

    def _error(self, name: str, seqid: int, kind: int, message: str) -> bytes:
        return encode_exception(self.writer_cls(self.framed), name, seqid, kind, message)


def _watched(stream: ClientStream, most: int, session: Session, wait: Callable[[], QItem | None]
             ) -> QItem | None:
    """A get's wait for an item while the socket is watched (`wait_watching`): the requests that
    follow are received meanwhile (up to `most` bytes), and a client that hangs up ends the wait
    and takes no item, which a get without auto-abort would lose with it."""
    before = len(stream.buf)
    try:
        return wait_watching(stream.io, stream.buf, most, session, wait)
    finally:
        stream.stats.bytes_read += len(stream.buf) - before


def make_thrift_server(server: ServerState, listener: tuple[str, int]) -> Listener:
    """A listener speaking Kestrel's Thrift service with the configured transport and protocol."""
    return make_listener(ThriftConnection, server, listener)
