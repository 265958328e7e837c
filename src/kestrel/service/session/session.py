"""The session layer every protocol shares: status checks, open reads, limits, stats.

Protocol handlers parse a request, call a Session method and encode the reply. The rules live
here once: what the server status allows, how reads are opened and closed (the open reads
themselves are kept in `open_reads.py`: Thrift's by id, with auto-abort deadlines; memcache and
text one per queue and connection, aborted when the connection drops).

Deadlines are read from the server's runtime clock, the one the queues' waits use, so a manual
runtime drives the session's waits and auto-aborts as it drives the storage's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any, Final

import structlog

from kestrel.service.logs import bind_client
from kestrel.service.session.open_reads import OpenReads, by_serial, return_all
from kestrel.service.session.server_state import ServerState
from kestrel.service.session.status import Status, UnknownStatus
from kestrel.storage import QItem
from kestrel.storage.config import NATIVE_LIMIT
from kestrel.storage.errors import KestrelError
from kestrel.storage.filenames import check_queue_name
from kestrel.storage.item import LookedItems, item_data
from kestrel.storage.queue import PersistentQueue
from kestrel.storage.taken_items import TakenItems

log = structlog.get_logger("kestrel.session")

# Items a get takes before the connection may let others run: a 100,000-item get held the loop
# for 20 ms in one piece (bench/bench_fairness.py, 2026-11-27); a slice costs well under a turn.
# A look (`peek_items`), which is one step, shows at most a slice: 100,000 empty items held the
# others 137–209 ms (docs/protocols.md).
# (`Final`, as GET_BYTES: a constant in the compiled build, not a lookup in the module's dictionary)
GET_SLICE: Final = 8192
# Item bytes a get takes at most, past the first item that reaches them (a Thrift get of
# `max_items`, a memcache run of gets), and a look shows (`peek_items`): what one reply holds stays
# bounded however large its items (up to `max_item_size` each, read back from disk in read-behind),
# whatever the count asked.
GET_BYTES: Final = 512 * 1024


def _go_on() -> None:
    """A session's `pause` where nobody else waits for the loop."""


class SessionError(KestrelError):
    """Raised when a client misuses the protocol (a second open read, too many open reads...)."""


class OpenReadConflict(SessionError):
    """Raised for a plain get on a queue where the connection holds an open read."""


class ClientGone(Exception):
    """Raised inside a blocking read whose client has hung up (by the session before a wait, or
    thrown into the waiting task by the connection that saw the hang-up)."""


# A connection's watch of its client during a wait: called with the session and the wait, it runs
# the wait and raises ClientGone in it when the client hangs up meanwhile.
Watch = Callable[["Session", Callable[[], "QItem | None"]], "QItem | None"]


class Session:
    """One client connection's view of the server."""

    def __init__(self, server: ServerState, peer: str, pause: Callable[[], None] | None = None,
                 protocol: str = "", watch: Watch | None = None,
                 hung_up: Callable[[], bool] | None = None,
                 hands_out: Callable[[list[int]], None] | None = None) -> None:
        self.server = server
        self.peer = peer
        self.protocol = protocol
        # Called between the slices of a large get: the connection lets the others run there if its
        # turn is over (src/kestrel/service/turns.py). Nothing by default (tests, and single-item protocols).
        self.pause = pause or _go_on
        # Runs a wait for an item while the connection watches its client (a hang-up ends it), only
        # once a get does wait. None: the wait is not watched (tests, library callers).
        self.watch = watch
        # Asked before a get gives its items read ids, which outlive the connection: whether its
        # client has already ended its stream (one that timed out on a stalled server), so that no
        # read is opened whose id nobody can learn. None: never asked (tests, library callers, and
        # the protocols whose reads close with their connection).
        self.hung_up = hung_up
        # Told the read ids a get gives its reads, for the reply that hands them out: held for the
        # disk, that reply asks `unsent` before it goes (src/kestrel/service/replies.py).
        self.hands_out = hands_out
        # Read ids whose reply never went out, its client gone: put back as the connection closes.
        self.unsent_reads: list[int] = []
        bind_client(peer)  # the connection's greenlet: its queue creations name the client
        self.coll = server.collection
        self.status = server.status
        self.stats = server.stats
        self._monotonic = server.runtime.clock.monotonic  # looked up once, read on every wait
        self.reads = OpenReads(server.config.max_open_reads)
        # Read by every get: the server's config is a Python object, each attribute of it a lookup by
        # name (250 instructions a get in the compiled build); a reload never changes it.
        self.max_batch_items = server.config.max_batch_items
        self.stats.curr_connections += 1
        self.stats.total_connections += 1
        self.stats.connections[protocol] = self.stats.connections.get(protocol, 0) + 1
        self.closed = False
        self.gone = False  # the client hung up during a blocking read
        self.waiting = False  # in the one wait a hang-up may cancel

    def close(self) -> None:
        """The connection is gone: its memcache-style open reads go back to their queues (Thrift
        reads outlive it, until confirmed by id or aborted by their timer). It counts as connected
        until they are back, so a client that sees the count drop finds them in their queues."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.unsent_reads:
                self.server.reads_by_id.put_back(self.unsent_reads)
            self._return_reads(self.reads.queues())
        finally:
            self.stats.curr_connections -= 1
            self.stats.connections[self.protocol] -= 1

    # -----------------------------------------------------------------------------------------
    # Writes

    def expiry_after(self, ms: int) -> int:
        """The absolute expiry of an item that lives `ms` more milliseconds (0: never expires).

        A negative `ms` means already expired, as Kestrel treats it: the item is accepted and
        never handed out.
        """
        if ms == 0:
            return 0
        return max(self.coll.clock.now_ms() + ms, 1)

    def answers_at_once(self, queue: str, count: int = 0, timeout_ms: int = 0) -> bool:
        """Whether a put to `queue`, a confirm or an abort of this connection's open reads on it (a
        Thrift call's, by id, are `closes_at_once`'s), or a get (or peek) of
        up to `count` items from it, with or without auto-abort or an open read, completes without
        yielding: what a connection may answer in the hub's callback,
        where anything that waits would fail (docs/architecture.md, *Requests answered in the
        hub*). Such a get takes its items in one remove (one slice, no time-out or every item
        there), from memory (none read back from disk); arming its auto-abort starts a timer of
        the loop, which never waits."""
        return (count <= GET_SLICE and (timeout_ms <= 0 or self.coll.holds(queue, count))
                and self.coll.never_waits(queue, count > 0))

    def closes_at_once(self, ids: Iterable[int]) -> bool:
        """Whether a confirm or an abort of the open reads among `ids` completes without yielding
        (`answers_at_once`): each is closed in the queue it was read from, whatever queue a Thrift
        call names, so those are the queues asked (the one named, answering at once, let a read of a
        queue that waits be closed in the hub's callback: an internal error, its change made)."""
        coll = self.coll
        return all(coll.never_waits(queue) for queue in self.server.reads_by_id.queues_of(ids))

    def put(self, queue: str, items: list[bytes], expiry_ms: int = 0) -> int:
        """Add items (absolute expiry in ms, 0 = never); how many were accepted: those before the
        first the queue refused (full, or over `max_item_size`). A pipelined run of single-item
        puts is one call too: its protocol answers those accepted and the one refused, then puts
        the rest again, so that each is answered as it would have been alone.

        Counted as Kestrel counts its put, item by item (`cmd_set`): those accepted and the one
        refused, or the one that met an error; none refused by the status. Raises RefusedByStatus,
        MemoryBudgetExceeded (the memory governor's flow control), and the collection's errors.
        """
        self.status.check_write("put")
        try:
            governor = self.coll.governor
            if governor is not None and governor.flow_control:
                governor.admit_put()  # held briefly, then MemoryBudgetExceeded
            accepted = self.coll.put(queue, items, expiry_ms)
        except Exception:
            self.stats.cmd_set += min(len(items), 1)
            raise
        self.stats.cmd_set += accepted + 1 if accepted < len(items) else accepted
        return accepted

    def flush(self, queue: str) -> None:
        """Empty a queue; one that does not exist is not created."""
        self.status.check_write("flush")
        check_queue_name(queue)
        self.coll.check_refused(queue)
        if self.coll.get(queue) is None:
            return
        self.coll.flush(queue)
        log.info("queue flushed", queue=queue, client=self.peer)

    def flush_expired(self, queue: str) -> int:
        """Drop the expired items of one queue (not created if missing); how many."""
        self.status.check_write("flush_expired")
        check_queue_name(queue)
        self.coll.check_refused(queue)
        q = self.coll.get(queue)
        return q.discard_expired() if q is not None else 0

    def flush_all_expired(self) -> int:
        self.status.check_write("flush_all_expired")
        return sum(self.flush_expired(name) for name in self.coll.queue_names())

    def flush_all(self) -> None:
        self.status.check_write("flush_all")
        self.coll.flush_all()
        log.info("all queues flushed", client=self.peer)

    def delete(self, queue: str) -> None:
        self.status.check_write("delete")
        self.coll.delete(queue)  # the collection logs it

    # -----------------------------------------------------------------------------------------
    # Thrift-style reads: server-wide ids, auto-abort timers, a cap per connection and queue

    def get_items(self, queue: str, max_items: int, timeout_ms: int = 0, auto_abort_ms: int = 0,
                  create: bool = True, capped: bool = True) -> TakenItems:
        """One Thrift get: up to `max_items` (at most `max_batch_items`) with the ids of their open
        reads (0 without auto-abort), waiting up to `timeout_ms` (at most `max_wait`) for each
        while the queue is empty. With auto-abort and `capped` the connection may hold
        `max_open_reads` open reads on each queue, as Kestrel counts them (its `get`); uncapped, one
        call opens up to `max_batch_items` whatever the connection holds (`get_timed`: reads with
        ids outlive their connection, so a count per connection bounds nothing a new connection
        would not undo). Without `create` a queue the server does not hold is not created (no
        items, at once).

        The queue is taken a slice of `GET_SLICE` at a time (`_take_slices`) when the get may let
        others run or wait before it replies; a get that cannot (one slice, without auto-abort,
        with no time-out or with every item it asks for in the queue) takes them in one remove.
        """
        if not create:
            check_queue_name(queue)
            self.coll.check_refused(queue)
            if self.coll.get(queue) is None:
                self.status.check_read("get")
                return TakenItems([], 0)
        self.status.check_read("get")
        max_items = min(max_items, self.max_batch_items)
        transaction = auto_abort_ms > 0
        if transaction and capped:
            max_items = min(max_items, self.reads.room(queue))
        self.stats.cmd_get += 1
        if 0 < max_items <= GET_SLICE and not transaction and (timeout_ms <= 0
                                                              or self.coll.holds(queue, max_items)):
            # The usual get: one slice, no read, and no wait (none asked, or every item is there).
            taken = TakenItems(self.coll.remove(queue, max_items, max_bytes=GET_BYTES), 0)
        else:
            taken = self._take_slices(queue, max_items, timeout_ms, auto_abort_ms)
        # Counted as Kestrel counts its Thrift get, a loop of removes: each item a hit, and a miss
        # where it came back short on an empty queue (not where it stopped at its bytes).
        got = len(taken.items)
        self.stats.get_hits += got
        if got < max_items and not self.coll.holds(queue, 1):
            self.stats.get_misses += 1
        return taken

    def _take_slices(self, queue: str, max_items: int, timeout_ms: int, auto_abort_ms: int) -> TakenItems:
        """A get's items a slice at a time, letting the others run between slices (`pause`) and
        waiting up to `timeout_ms` for more while the queue is empty (the wait a hang-up ends).

        Every item is taken as an open read, the get's own until it replies: then, without
        auto-abort, confirmed (removed for good), or with it, given its read id. A get that ends
        without a reply (its client hung up during the wait, or before auto-abort reads got their
        ids, a fault in a later slice or in the closing step, its task killed) puts them all back at
        the head, in order (`_put_back`), and its error is the answer: a slice taken is never lost
        with the connection.
        """
        deadline = self._monotonic() + self._wait_seconds(timeout_ms) if timeout_ms > 0 else 0.0
        held = auto_abort_ms <= 0
        items: list[QItem] = []
        room = GET_BYTES
        serial = 0  # the queue's, once it gave an item: every slice comes from that one
        try:
            while len(items) < max_items:
                want = min(max_items - len(items), GET_SLICE)
                more, serial = self._open_reads(queue, want, held, room, serial)
                while not more and deadline:  # empty: wait for an item, in the wait a hang-up ends
                    remaining = deadline - self._monotonic()
                    if remaining <= 0 or self._wait_for_item(queue, remaining, "get") is None:
                        break
                    more, serial = self._open_reads(queue, want, held, room, serial)
                items += more
                if not more or (len(more) < want and not deadline):
                    break
                room -= sum(map(len, item_data(more)))
                if room <= 0:
                    break
                if len(items) < max_items:
                    self.pause()
            if held:
                if items:
                    self.coll.confirm(queue, [item.xid for item in items], serial)
                return TakenItems(items, 0)
            hung_up = self.hung_up
            if items and hung_up is not None and hung_up():
                raise ClientGone  # its items go back (below): nobody could learn their read ids
            xids = [item.xid for item in items]
            ids = self.server.reads_by_id.open_many(self.reads, queue, serial, xids, auto_abort_ms)
            if ids and self.hands_out is not None:
                self.hands_out(ids)
            return TakenItems(items, ids)
        except BaseException:
            if items:
                self._put_back(queue, serial, items)
            raise

    def unsent(self, read_ids: list[int]) -> bool:
        """Asked as a reply handing out `read_ids`, held until the disk had its get's records, is
        due to go out (or is dropped unsent): whether it must not, its client having ended its
        stream since the get looked (`hung_up`: one that timed out while an fsync round ran, and
        closed). Its reads then go back to the head as the connection closes (`close`), as a get's
        items go back when its own look finds the end: in the order read, no error counted."""
        hung_up = self.hung_up
        if hung_up is None or not hung_up():
            return False
        self.unsent_reads += read_ids
        return True

    def _open_reads(self, queue: str, count: int, held: bool, max_bytes: int, serial: int = 0
                    ) -> tuple[list[QItem], int]:
        """Up to `count` head items of `queue` taken as open reads (`PersistentQueue.remove`), and the
        serial of the queue they came from: none where the name is an alias or, given a `serial`,
        where the queue of that name is another one now (the one of `serial` was deleted)."""
        q = self.coll.reading(queue)
        if q is None or (serial and q.serial != serial):
            return [], serial
        return q.remove(count, True, 0.0, held, max_bytes), q.serial

    def _put_back(self, queue: str, serial: int, items: list[QItem]) -> None:
        """Items a get took and never handed out go back to the head, the first taken first, with
        no error counted. Where that cannot be written (a journal that fails), they stay open reads
        until the journal can be written again, and then go back (`PersistentQueue.unremove`)."""
        try:
            self.coll.unremove(queue, [item.xid for item in reversed(items)], False, serial, owed=True)
        except Exception:
            log.error("a get ended without a reply and could not put back what it took; it goes back "
                      "once the journal can be written", queue=queue, items=len(items), exc_info=True)

    def peek_items(self, queue: str, first: int, max_items: int) -> LookedItems:
        """Up to `max_items` (at most `max_batch_items` and `GET_SLICE`) items from position `first`
        on, left where they are (`PersistentQueue.look`): a look, not a delivery, so it counts
        nothing. Its items stop once their bytes reach `GET_BYTES`, as a get's do, so a reply stays
        bounded whatever its items' size and count; the next look goes on from `after`. A queue the
        server does not hold is not created (no items, every figure 0)."""
        check_queue_name(queue)
        self.coll.check_refused(queue)
        self.status.check_read("peek")
        q = self._looked_at(queue)
        if q is None:
            return LookedItems(0, 0, 0, 0, [])
        return q.look(first, min(max_items, self.max_batch_items, GET_SLICE), GET_BYTES)

    def _looked_at(self, queue: str) -> PersistentQueue | None:
        """The queue a look at `queue` shows, created by none: none for an alias, whose name hides a
        queue under it (its items cannot be read while the alias exists, as a get finds nothing)."""
        return None if self.coll.is_alias(queue) else self.coll.get(queue)

    def queue_names(self) -> list[str]:
        """The queues the server holds (fanout readers included, aliases not); creates nothing."""
        return self.coll.queue_names()

    def confirm_ids(self, ids: set[int]) -> int:
        """Confirm open reads by id (from any connection, each in its own queue: the queue a Thrift
        call names is not asked); Quiescent still allows this."""
        return self.server.reads_by_id.close(ids, confirm=True)

    def abort_ids(self, ids: set[int]) -> int:
        self.status.check_read("abort")
        return self.server.reads_by_id.close(ids, confirm=False)

    # -----------------------------------------------------------------------------------------
    # Memcache-style reads: open reads kept per queue on this connection, oldest first

    def client_gone(self) -> None:
        """The connection saw its client hang up: no wait for an item starts from now on.

        A wait already under way is the connection's to cancel, by raising ClientGone in the task
        that waits while `waiting` is true: it knows that task, the session does not. Only the wait
        itself is cancellable (never a remove or a journal write in progress), so the dead
        connection takes no item; its open reads are aborted when the connection closes.
        """
        self.gone = True

    def _wait_for_item(self, queue: str, seconds: float, operation: str) -> QItem | None:
        """Wait until `queue` has a head item (the one wait a hang-up may cancel), watched by the
        connection's `watch` where it has one, for `operation`: a `peek` looks, anything else takes.
        The head item seen, a peek's answer; None at the deadline.

        Waiters are served first come first: an item wakes the longest waiting, and a taker keeps
        that turn until it takes (`PersistentQueue.wait_peek`). One that will not take after all,
        its client gone meanwhile or its operation refused by a status changed during the wait,
        hands the turn to the next waiter as it raises.
        """
        if self.gone:
            raise ClientGone
        taking = operation != "peek"
        self.waiting = True
        try:
            if self.watch is not None:
                head = self.watch(self, lambda: self._await_head(queue, seconds, taking))
            else:
                head = self._await_head(queue, seconds, taking)
        finally:
            self.waiting = False
        if head is not None:
            try:
                if self.gone:
                    raise ClientGone
                self.status.check_read(operation)
            except BaseException:
                if taking:
                    self.coll.pass_turn(queue)
                raise
        return head

    def _await_head(self, queue: str, seconds: float, taking: bool) -> QItem | None:
        head = self.coll.peek(queue, seconds, taking)
        self.waiting = False  # over: a hang-up seen from now on is `_wait_for_item`'s to raise
        return head

    def _take(self, queue: str, count: int, seconds: float, operation: str, open: bool = False,
              peek: bool = False) -> tuple[list[QItem], int]:
        """Head items (removed, opened, or the head only looked at), waiting up to `seconds` for one,
        and for open reads the serial of the queue they came from; `operation` names the request
        to a status that refuses it. A peek that waited answers the head its wait saw (a second look
        could find it taken and wait again, behind the waiters that came after it)."""
        deadline = self._monotonic() + seconds if seconds > 0 else 0.0  # no clock read for a plain get
        serial = 0
        while True:
            if peek:
                head = self.coll.peek(queue)
                items = [head] if head is not None else []
            elif open:
                items, serial = self._open_reads(queue, count, False, NATIVE_LIMIT)
            else:
                items = self.coll.remove(queue, count)
            if items or seconds <= 0:
                return items, serial
            remaining = deadline - self._monotonic()
            seen = self._wait_for_item(queue, remaining, operation) if remaining > 0 else None
            if seen is None:
                return [], serial
            if peek:
                return [seen], serial

    def _wait_seconds(self, timeout_ms: int) -> float:
        """A client's wait, capped by `max_wait`."""
        return min(max(timeout_ms, 0), self.server.config.max_wait) / 1000.0

    def get(self, queue: str, count: int = 1, *, timeout_ms: int = 0, open: bool = False, close: bool = False,
            abort: bool = False, peek: bool = False) -> list[bytes]:
        """One get (memcache, text), or `count` gets answered alike: `get_run`'s data."""
        return self.get_run(queue, count, timeout_ms=timeout_ms, open=open, close=close, abort=abort,
                            peek=peek)[0]

    def get_run(self, queue: str, count: int = 1, *, timeout_ms: int = 0, open: bool = False,
                close: bool = False, abort: bool = False, peek: bool = False) -> tuple[list[bytes], int]:
        """`count` gets of one item each (memcache, text): the data of those that found one, the
        first ones, and how many gets were answered: all, unless the items' bytes reached
        `GET_BYTES` first (`PersistentQueue.remove`), which answers as many gets as items taken and
        leaves the others for the connection to read again. A pipelined run of plain gets is one
        call; one get alone takes the memcache options `/t=`, `/open`, `/close`, `/abort`, `/peek`.
        Each get answered counts (`cmd_get` or `cmd_peek`, a hit or a miss), and one that meets an
        error counts alone.

        Raises OpenReadConflict for a plain get while this connection holds an open read on `queue`.
        """
        if close or abort:
            if close:
                self.confirm_reads(queue, 1)
            if abort:
                self.status.check_read("abort")
                self.abort_pending(queue)
            if not (open or peek):
                return [], count
        operation = "peek" if peek else "get"
        self.status.check_read(operation)
        if not peek and self.reads.holds(queue) and self._holds_live_read(queue):
            if not open:
                raise OpenReadConflict(f"plain get on {queue!r} beside this connection's open read on it")
            raise SessionError("already have an open read on this queue: close or abort it first")
        stats = self.stats
        serial = 0
        try:
            if peek or timeout_ms > 0:
                items, serial = self._take(queue, count, self._wait_seconds(timeout_ms), operation, open=open,
                                           peek=peek)
            elif open:
                items, serial = self._open_reads(queue, count, False, GET_BYTES)
            else:
                items = self.coll.remove(queue, count, max_bytes=GET_BYTES)
        except BaseException:
            if peek:
                stats.cmd_peek += 1
            else:
                stats.cmd_get += 1
            raise
        datas = item_data(items)
        if len(items) < count and sum(map(len, datas)) >= GET_BYTES:
            count = len(items)  # the rest are left unanswered, to be read again
        if peek:
            stats.cmd_peek += count
        else:
            stats.cmd_get += count
        if open:
            for item in items:
                self.reads.open(queue, serial, item.xid)
        stats.get_hits += len(items)
        stats.get_misses += count - len(items)
        return datas, count

    def monitor(self, queue: str, timeout_ms: int, max_items: int | None = None) -> Iterator[bytes]:
        """Items arriving within `timeout_ms`, each an open read to be closed with `confirm_reads`.

        As in Kestrel, it stops once this connection holds `max_open_reads` open reads on `queue`
        (the default for `max_items`); each item is a hit or a miss, not a `cmd_get`.
        """
        self.status.check_read("monitor")
        max_items = self.reads.max_open_reads if max_items is None else max_items
        deadline = self._monotonic() + self._wait_seconds(timeout_ms)
        count = 0
        while count < max_items and self.reads.room(queue) > 0:
            remaining = deadline - self._monotonic()
            if remaining <= 0:
                return
            taken, serial = self._take(queue, 1, remaining, "monitor", open=True)
            if not taken:
                self.stats.get_misses += 1
                return
            item = taken[0]
            self.stats.get_hits += 1
            self.reads.open(queue, serial, item.xid)
            count += 1
            yield item.data

    def confirm_reads(self, queue: str, count: int | None = None) -> int:
        """Confirm this connection's oldest `count` open reads on `queue` (None: all); how many were
        open (those of a queue deleted since are closed with nothing to confirm)."""
        closed = 0
        taken = self.reads.take_oldest(queue, count)
        confirmed: set[int] = set()
        try:
            for serial, xids in by_serial(taken).items():
                closed += self.coll.confirm(queue, xids, serial)
                confirmed.add(serial)
        except Exception:  # refused (the journal): open still, and held again, to be closed later
            self.reads.give_back([read for read in taken if read.serial not in confirmed])
            raise
        return closed

    def _holds_live_read(self, queue: str) -> bool:
        """Whether this connection's open reads on `queue` include one of the queue as it is now:
        those of a queue deleted since went with its items, and are forgotten here (they refused the
        next `/open`, and a plain get closed the connection)."""
        now = self.coll.opened_on(queue, None)
        self.reads.forget_others(queue, None if now is None else now.serial)
        return self.reads.holds(queue)

    def abort_pending(self, queue: str) -> None:
        """Put this connection's oldest open read on `queue` back at the head: one, as `/close`
        confirms one (Kestrel's `abortRead`; a `monitor` leaves several open)."""
        self._return_reads([queue], 1)

    def _return_reads(self, queues: list[str], count: int | None = None) -> None:
        """This connection's oldest `count` open reads on each of `queues` (None: all) go back to
        their heads, oldest first, each queue's (and each serial's) in a change of its own
        (`return_all`)."""
        returns: list[tuple[str, int, list[int]]] = []
        for queue in queues:
            done = self.reads.take_oldest(queue, count)
            done.reverse()
            returns += [(queue, serial, xids) for serial, xids in by_serial(done).items()]
        return_all(self.coll, returns)

    # -----------------------------------------------------------------------------------------
    # Inspection and status

    def peek(self, queue: str) -> QItem | None:
        """The head item, left in place: a `cmd_peek`, and a hit or a miss as every get is."""
        self.status.check_read("peek")
        self.stats.cmd_peek += 1
        head = self.coll.peek(queue)
        if head is None:
            self.stats.get_misses += 1
        else:
            self.stats.get_hits += 1
        return head

    def queue_info(self, queue: str) -> dict[str, Any]:
        """The head item and the figures Thrift's QueueInfo carries."""
        head = self.peek(queue)
        q = self._looked_at(queue)
        stats = q.stats() if q is not None else {}
        return {
            "head_item": head.data if head is not None else None,
            "items": stats.get("items", 0),
            "bytes": stats.get("bytes", 0),
            "journal_bytes": stats.get("logsize", 0),
            "age": stats.get("age", 0),
            "waiters": stats.get("waiters", 0),
            "open_transactions": stats.get("open_transactions", 0),
        }

    def current_status(self) -> Status:
        return self.status.current

    def set_status(self, status: Status | str | int) -> None:
        """A status by name (memcache) or number (Thrift)."""
        try:
            value = Status.parse(status)
        except UnknownStatus as e:
            raise SessionError(str(e)) from None
        self.status.set(value)
        log.info("status set by client", status=value.label, client=self.peer)
