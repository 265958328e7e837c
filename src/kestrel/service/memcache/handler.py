"""Kestrel's memcache protocol on a gevent StreamServer.

Each connection reads into one buffer, answers every complete command in it, and sends the replies
of a burst with one `send`, so pipelined clients cost one system call per burst. A run of plain
`set`s to one queue, or of plain `get`s, found by the compiled scanner (runs.py), is answered
with one put or get; every other command is parsed alone (a set being a put of one). Lines are
bounded by `max_line_length` and items by `max_frame_size` before anything is allocated for them.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import ClassVar, Final

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
from kestrel.service.histogram_series import HistogramSeries
from kestrel.service.listener import Listener
from kestrel.service.memcache.commands import Command, ProtocolError, absolute_expiry_ms, parse_line
from kestrel.service.memcache.runs import RUN_LIMIT, scan_gets, scan_sets, values
from kestrel.service.session.server_state import ServerState
from kestrel.service.session.session import ClientGone, OpenReadConflict, SessionError
from kestrel.service.session.status import Status
from kestrel.service.socket_io import BoxedInt
from kestrel.service.stats_render import dump_config, dump_stats, memcache_stats
from kestrel.storage.clock import perf_counter
from kestrel.storage.errors import InvalidQueueName, KestrelError

log = structlog.get_logger("kestrel.memcache")

# `Final`: the compiled build reads these as constants, not from the module's dictionary.
CRLF: Final = b"\r\n"
END: Final = b"END\r\n"
STORED: Final = b"STORED\r\n"
NOT_STORED: Final = b"NOT_STORED\r\n"
TOO_LARGE: Final = b"SERVER_ERROR object too large for cache\r\n"  # (a well-formed set: silent with noreply)
# a set's byte in a run's `answered`: whether it wants a reply
REPLY: Final = b"\x01"
NOREPLY: Final = b"\x00"


BINARY_MAGIC: Final = 0x80
BINARY_HEADER: Final = 24
BINARY_REFUSAL = b"binary protocol not supported: use the memcache text protocol"
# The first byte of a command that may begin a run, where the scanner was built (`_starts_run`).
SET_START: Final = ord("s")
GET_START: Final = ord("g")
RUNS_SCANNED: Final = scan_sets is not None
# The scanner's entry points, bound once (a `Final` name is a C static in the compiled build).
_scan_sets: Final = scan_sets
_scan_gets: Final = scan_gets


def _starts_run(first: int) -> bool:
    """Whether a command whose first byte is `first` may begin a run the scanner reads. Compared
    byte by byte: `in` a tuple held in a name cost the compiled build a boxed int and a generic
    comparison of each (about 90 instructions a test, two a request)."""
    return RUNS_SCANNED and first in (SET_START, GET_START)


def binary_refusal(header: bytes) -> bytes:
    """A binary-protocol error response ("not supported", 0x83) a binary client can show."""
    return (bytes([0x81, header[1], 0, 0, 0, 0, 0, 0x83]) + len(BINARY_REFUSAL).to_bytes(4, "big")
            + header[12:16] + bytes(8) + BINARY_REFUSAL)


class MemcacheConnection(BufferedConnection):
    """One memcache client; an item being swallowed or skipped spans read bursts."""

    protocol: ClassVar[str] = "memcache"
    answers_in_hub: ClassVar[bool] = RUNS_SCANNED  # the scanner's runs, gets with options (built with it)

    def __init__(self, server: ServerState, sock: socket.socket, peer: str) -> None:
        super().__init__(server, sock, peer)
        self.max_item = server.config.max_frame_size
        # What each scan is handed, boxed once (`BoxedInt`).
        self.scan_line: BoxedInt = self.max_line
        self.scan_item: BoxedInt = self.max_item
        self.scan_run: BoxedInt = RUN_LIMIT
        self.discard = 0  # bytes of item data still to drop unread
        self.discard_reply = b""  # sent once they are dropped
        self.skip_line = False  # after a bad data chunk: drop input up to the next line end
        # The key of the last run and the queue name made of it (`queue_named`).
        self.last_key = b""
        self.last_queue = ""
        # Each command's handler and answer-time histogram, looked up at its first use only. The
        # handlers are the class's functions, not this connection's bound methods: a table of those
        # would refer back to the connection, a cycle only a full collection frees (and none frees
        # once a freeze caught it, src/kestrel/service/gc_pauses.py).
        self.commands: dict[str, tuple[Callable[[MemcacheConnection, Command], None], HistogramSeries]] = {}
        self.set_latency = metrics.request_latency("memcache", "set")
        self.get_latency = metrics.request_latency("memcache", "get")

    def queue_named(self, key: bytes) -> str:
        """The queue a run's `key` names: the str made for the last run's key when it is the same,
        as a client's runs name the same queue one after another (no decode, and the queue's lookup
        finds the str's hash already computed)."""
        if key == self.last_key:
            return self.last_queue
        queue = key.decode()
        self.last_key = key
        self.last_queue = queue
        return queue

    def mid_request(self) -> bool:
        return self.discard > 0 or self.skip_line

    def process(self, buf: bytearray) -> int:
        """Answer every complete command in `buf`; return how many bytes were used."""
        pos = 0
        end = len(buf)
        while pos < end:
            if pos:
                if not self.in_hub:
                    self.take_turns()
                elif self.turns.over() or self.replies_due():
                    return pos  # the replies sent, the rest in the connection's greenlet
            if self.discard:
                step = min(self.discard, end - pos)
                self.discard -= step
                pos += step
                if not self.discard:
                    self.out.append(self.discard_reply)
                continue
            first = buf[pos]
            if self.in_hub and not _starts_run(first):
                return pos  # any other command in the connection's greenlet
            if first == BINARY_MAGIC and not self.skip_line:
                if end - pos < BINARY_HEADER:
                    return pos
                self.out.append(binary_refusal(bytes(buf[pos:pos + BINARY_HEADER])))
                log.info("binary protocol request refused", client=self.peer)
                raise CloseConnection
            if _starts_run(first) and not self.skip_line:  # a run of plain sets or gets, read in one step
                if first == SET_START:
                    assert _scan_sets is not None
                    sets = _scan_sets(buf, pos, end, self.scan_line, self.scan_item, self.scan_run)
                    if sets is not None:
                        key, exptime, datas, answered, after = sets
                        queue = self.queue_named(key)
                        if self.in_hub and not self.session.answers_at_once(queue):
                            return pos
                        pos = after
                        self.store(queue, exptime, datas, answered)
                        continue
                else:
                    assert _scan_gets is not None
                    gets = _scan_gets(buf, pos, end, self.scan_line, self.scan_run)
                    if gets is not None:
                        key, count, after = gets
                        queue = self.queue_named(key)
                        if self.in_hub and not self.session.answers_at_once(queue, count):
                            return pos
                        served = self.fetch(key, queue, count)
                        if served == count:
                            pos = after
                            continue
                        # the items' bytes bounded the run (`Session.get_run`): its replies go out
                        # before the gets left are read again
                        pos += (after - pos) // count * served
                        if self.in_hub:
                            return pos
                        self.send()
                        self.replies.wait_sent()
                        continue
            if self.in_hub and first != GET_START:
                return pos  # not a run the scanner reads, nor a get with options
            nl = buf.find(b"\n", pos)
            if nl < 0:
                if self.unended_line_too_long(buf, pos):
                    self.out.append(b"CLIENT_ERROR line too long\r\n")
                    raise CloseConnection
                return pos
            if self.skip_line:
                self.skip_line = False
                pos = nl + 1
                continue
            ends = line_end(buf, pos, nl)
            if ends - pos > self.max_line:
                self.out.append(b"CLIENT_ERROR line too long\r\n")
                raise CloseConnection
            line = take(buf, pos, ends)
            start, pos = pos, nl + 1
            try:
                command = parse_line(line)
            except ProtocolError as e:
                # The item data of a refused set is dropped unread: it is never run as commands.
                self.out.append(e.reply.encode() + CRLF)
                if e.close:
                    raise CloseConnection(e.reply) from None
                self.discard, self.discard_reply = e.skip, b""
                self.requests_begun += 1
                continue
            if command.name != "set":
                if self.in_hub and not self._answers_at_once(command):
                    return start  # in the connection's greenlet, which parses it again (a cached line)
                self.execute(command)
                continue
            if command.size > self.max_item:
                self.discard = command.size + 2
                self.discard_reply = b"" if command.noreply else TOO_LARGE
                self.requests_begun += 1
                continue
            data_end = pos + command.size
            if data_end + 2 > end:
                return start  # wait for the rest of the item
            if buf[data_end:data_end + 2] != CRLF:
                self.out.append(b"CLIENT_ERROR bad data chunk\r\n")
                resync = buf.find(b"\n", data_end)
                if resync < 0:
                    self.skip_line = True
                    self.requests_begun += 1
                    return end
                pos = resync + 1
                continue
            answered = NOREPLY if command.noreply else REPLY
            self.store(command.key, command.expiry, [take(buf, pos, data_end)], answered)
            pos = data_end + 2
        return pos

    def store(self, queue: str, exptime: int, datas: list[bytes], answered: bytes) -> None:
        """Sets of one queue and exptime (one, or a pipelined run) as one put: STORED for the items
        accepted, then NOT_STORED, or the error, for the one refused, and the rest put again, so
        that each set is answered as it would have been alone; nothing for those sent with noreply
        (`answered` has a 0 there)."""
        started = perf_counter()
        expiry = absolute_expiry_ms(exptime, self.session.coll.clock)
        count = len(datas)
        done = 0
        try:
            while done < count:
                reply = NOT_STORED
                try:
                    stored = self.session.put(queue, datas[done:] if done else datas, expiry)
                except (ConnectionError, ClientGone):
                    raise
                except Exception as e:
                    stored, reply = 0, self._error(e)
                if stored:
                    if count == 1:  # a set alone, the common case: no call of `count`
                        if answered[0]:
                            self.out.append(STORED)
                    else:
                        self.out.append(STORED * answered.count(1, done, done + stored))
                    done += stored
                    if done == count:
                        break
                if answered[done]:
                    self.out.append(reply)
                done += 1
        except BaseException:
            count = done + 1  # the connection ends at this set: the run's later sets are never read
            raise
        finally:
            self.set_latency.observe_many(perf_counter() - started, count)

    def fetch(self, key: bytes, queue: str, count: int) -> int:
        """`count` plain gets of one queue (one, or a pipelined run) as one get: the items found
        answer the first gets, END alone the others; how many gets were answered (fewer when the
        items' bytes bounded the get: `Session.get_run`). A get that meets an error answers it and
        the rest get again; beside an open read the first answers ERROR and the connection closes."""
        started = perf_counter()
        done = 0
        try:
            while done < count:
                try:
                    datas, answered = self.session.get_run(queue, count - done)
                except (ConnectionError, ClientGone):
                    raise
                except OpenReadConflict:
                    # Kestrel's answer to a plain get beside an open read: ERROR, and the connection
                    # closes (which aborts the open read, so its item goes back to the queue).
                    self.out.append(b"ERROR\r\n")
                    raise CloseConnection from None
                except Exception as e:
                    self.out.append(self._error(e))
                    done += 1
                    continue
                reply = values(key, datas, answered - len(datas))
                self.out.append(reply)
                self.reply_bytes += len(reply)
                done += answered
                break
        except BaseException:
            done += 1  # the connection ends at this get: the run's later gets are never read
            raise
        finally:
            self.get_latency.observe_many(perf_counter() - started, done)
        return done

    def _answers_at_once(self, command: Command) -> bool:
        """Whether a get with options (`/open`, `/close`, `/abort`, `/peek`, `/t=`) completes without
        yielding (`Session.answers_at_once`): one that reads asks for one item, a close or an abort
        alone for none."""
        options = command.get
        if options is None:
            return False
        reads = options.open or options.peek or not (options.close or options.abort)
        return self.session.answers_at_once(options.queue, 1 if reads else 0,
                                            options.timeout_ms if reads else 0)

    def _error(self, e: Exception) -> bytes:
        if isinstance(e, InvalidQueueName | SessionError):
            return f"CLIENT_ERROR {e}\r\n".encode()
        if isinstance(e, KestrelError):
            return f"SERVER_ERROR {e}\r\n".encode()
        log.exception("memcache command failed", client=self.peer)
        return f"SERVER_ERROR internal error: {e!r}\r\n".encode()

    def execute(self, command: Command) -> None:
        handler, latency = self.commands.get(command.name) or self._command(command.name)
        started = perf_counter()
        try:
            handler(self, command)
        except (CloseConnection, ConnectionError, ClientGone):
            raise
        except OpenReadConflict:
            # Kestrel's answer to a plain get beside an open read: ERROR, and the connection closes
            # (which aborts the open read, so its item goes back to the queue).
            self.out.append(b"ERROR\r\n")
            raise CloseConnection from None
        except ProtocolError as e:
            self.reply(command, e.reply.encode() + CRLF)
        except Exception as unexpected:
            self.reply(command, self._error(unexpected))
        finally:
            latency.observe(perf_counter() - started)

    def _command(self, name: str) -> tuple[Callable[[MemcacheConnection, Command], None], HistogramSeries]:
        function = getattr(type(self), f"do_{name}")
        found = self.commands[name] = (function, metrics.request_latency("memcache", name))
        return found

    def reply(self, command: Command, line: bytes) -> None:
        """A reply, unless the client said `noreply` (then it reads none, not even an error)."""
        if not command.noreply:
            self.out.append(line)

    def _value(self, command: Command, data: bytes) -> None:
        cas = b" 0" if command.cas else b""
        self.out += (b"VALUE %s 0 %d%s\r\n" % (command.key.encode(), len(data), cas), data, CRLF)
        self.reply_bytes += len(data)

    def do_get(self, command: Command) -> None:
        options = command.get
        assert options is not None
        if options.timeout_ms and not self.in_hub:  # (in the hub its items are there: it never waits)
            self.send()  # earlier replies go out before this one waits
        datas = self.session.get(options.queue, timeout_ms=options.timeout_ms, open=options.open,
                                 close=options.close, abort=options.abort, peek=options.peek)
        if datas:
            self._value(command, datas[0])
        self.out.append(END)

    def do_delete(self, command: Command) -> None:
        self.session.delete(command.key)
        self.reply(command, b"DELETED\r\n")

    def do_flush(self, command: Command) -> None:
        self.session.flush(command.key)
        self.reply(command, END)

    def do_flush_all(self, command: Command) -> None:
        self.session.flush_all()
        self.reply(command, b"Flushed all queues.\r\n")

    def do_flush_expired(self, command: Command) -> None:
        self.reply(command, b"%d\r\n" % self.session.flush_expired(command.key))

    def do_flush_all_expired(self, command: Command) -> None:
        self.reply(command, b"%d\r\n" % self.session.flush_all_expired())

    def do_version(self, command: Command) -> None:
        self.out.append(f"VERSION {SERVER_VERSION}\r\n".encode())

    def do_shutdown(self, command: Command) -> None:
        log.info("shutdown requested", client=self.peer)
        self.server.request_shutdown()
        raise CloseConnection

    def do_quit(self, command: Command) -> None:
        raise CloseConnection

    def do_reload(self, command: Command) -> None:
        self.server.reload(by=f"memcache client {self.peer}")
        self.reply(command, b"Reloaded config.\r\n")

    def do_stats(self, command: Command) -> None:
        self.send_pieces(memcache_stats(self.server))

    def do_dump_stats(self, command: Command) -> None:
        self.send_pieces(dump_stats(self.server, command.keys or None))

    def do_dump_config(self, command: Command) -> None:
        self.send_pieces(dump_config(self.server))

    def do_monitor(self, command: Command) -> None:
        self.send()
        items = self.session.monitor(command.key, command.timeout_ms, command.count)
        while (data := next(items, None)) is not None:
            self._value(command, data)
            self.send()
        self.out.append(END)

    def do_confirm(self, command: Command) -> None:
        closed = self.session.confirm_reads(command.key, command.count)
        self.reply(command, END if closed else b"ERROR\r\n")

    def do_status(self, command: Command) -> None:
        if self.session.current_status() == Status.NOT_CONFIGURED:
            self.out.append(b"ERROR\r\n")  # Kestrel's answer when no status is configured
            return
        if command.status is None:
            self.out.append(self.session.current_status().label.upper().encode() + CRLF)
            return
        try:
            self.session.set_status(command.status)
        except KestrelError as e:  # an unknown status, or a change refused during a grace period
            raise ProtocolError(f"CLIENT_ERROR {e}") from None
        self.reply(command, END)


def make_memcache_server(server: ServerState, listener: tuple[str, int]) -> Listener:
    """A StreamServer speaking Kestrel's memcache dialect."""
    return make_listener(MemcacheConnection, server, listener)
