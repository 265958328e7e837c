"""A Kestrel cluster as clients see it: independent servers, work spread over them.

Puts go to the write set, reads to the read set (the same list when the servers are given by hand).
Each call tries the servers in turn (round-robin, or random), those that recently failed or refused
by status last, so a dead server's share spreads evenly over the others, and those whose failure
cost a timeout not at all while they are avoided (a call finding only such fails at once); a
connection error or a refusal moves the call to the next server. The connects a pass needs are begun
side by side while the one at hand is slow, and the pass calls whichever server connects first
(`Cluster._ahead`), so hung hosts' connect timeouts are not waited out in a row, nor at all by a
call that a live server can take. When no server could take a call, it is tried again, `retries`
times, after a growing pause; then it raises NoServers, reads as well as puts, so that "the cluster
is down" never looks like "the queue is empty". Delivery is at least once: a put whose reply was
lost is sent again elsewhere, and an open read whose confirm was lost returns to its queue, so
consumers should be idempotent.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from types import TracebackType
from typing import Any

from kestrel.client.checks import BytesLike, check_count, check_item, check_items, check_queue, check_seconds
from kestrel.client.cooperation import new_event
from kestrel.client.discovery import Address, ServerSource, StaticServers, ZooKeeperServerSets, as_address
from kestrel.client.errors import ClientClosed, KestrelClientError, NoServers, Refused, ServerUnavailable
from kestrel.client.packed import PackedItems
from kestrel.client.server import MAX_FRAME_SIZE, Opening, Server

log = logging.getLogger("kestrel.client")

STRATEGIES = ("round_robin", "random")

OTHER_PROTOCOLS = ("memcache", "text")  # the servers' endpoints, beside "thrift", in their member data


class _Round:
    """What one pass over the servers heard: whether any answered, each failure, and why the servers
    not asked were not (`skipped`: still hung, see `Cluster._in_turn`)."""

    def __init__(self) -> None:
        self.answered = False
        self.errors: list[KestrelClientError] = []
        self.skipped: list[ServerUnavailable] = []
        self.fit = 0  # how many of the servers to ask, the first ones, were neither hung nor avoided

    @property
    def failures(self) -> list[KestrelClientError]:
        """Every server's failure, the skipped ones' included: what NoServers carries."""
        return [*self.errors, *self.skipped]

    @property
    def worth_retrying(self) -> bool:
        """Some server could not be reached, or was not asked while still hung, or none was there to
        ask: it may be back soon. A round in which every server answered with a refusal is not
        repeated. A round that asked none because all were still hung is, after its pause, as any
        unreachable round: a caller that calls again at once on NoServers (a consumer's loop) then
        waits the retries' pauses each time rather than spinning, and a server whose avoidance ends
        within them is asked."""
        return not self.errors or any(isinstance(e, ServerUnavailable) for e in self.failures)


class Cluster:
    """Puts, gets and reliable reads over every server of a Kestrel cluster.

    Thread-safe and cooperative under gevent: share one Cluster between threads or greenlets. Use it
    as a context manager, or call `close()`; closing is final (every call after it raises
    ClientClosed).

    Parameters: `servers`: addresses (`"host:2229"` or (host, port)) or a ServerSource such as
    ZooKeeperServerSets; `strategy`: `round_robin` (default) or `random`; `timeout_ms`: the network
    time-out of one call, its reply received whole (on top of any wait asked for); `connect_timeout_ms`:
    how long connecting to one server may take; `auto_abort_ms`: how long a reliable read may stay open
    before the server puts it back; `poll_ms`: the longest one server is waited on while others may have
    items; `retries`: how many more passes over the servers a call makes when none could take it (none
    reachable, or the set empty; not when every server answered with a refusal); `backoff_ms`: the pause
    before the first of them, doubling for each next one up to `max_backoff_ms` (each pause shortened at
    random by up to half, so that clients do not retry in step); `max_frame_size`: the servers' own
    (`max_frame_size`, 16MB by default), over which they refuse a call unread, and with 1 MB more the
    most a reply may hold (a larger one is no Kestrel reply: ServerUnavailable).
    """

    def __init__(self, servers: Iterable[str | Address] | ServerSource, *, strategy: str = "round_robin",
                 timeout_ms: int = 10_000, connect_timeout_ms: int = 2_000, auto_abort_ms: int = 60_000,
                 poll_ms: int = 500, retries: int = 2, backoff_ms: int = 100,
                 max_backoff_ms: int = 2_000, max_frame_size: int = MAX_FRAME_SIZE) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
        for name, value, least in (
                ("timeout_ms", timeout_ms, 1), ("connect_timeout_ms", connect_timeout_ms, 1),
                ("auto_abort_ms", auto_abort_ms, 1), ("poll_ms", poll_ms, 1),
                ("retries", retries, 0), ("backoff_ms", backoff_ms, 0),
                ("max_backoff_ms", max_backoff_ms, backoff_ms), ("max_frame_size", max_frame_size, 1)):
            check_count(value, name, "Cluster", least=least)
        self.source = servers if isinstance(servers, ServerSource) else StaticServers(servers)
        self.strategy = strategy
        self.timeout_ms, self.connect_timeout_ms = timeout_ms, connect_timeout_ms
        self.auto_abort_ms, self.poll_ms = auto_abort_ms, poll_ms
        self.retries, self.backoff_ms, self.max_backoff_ms = retries, backoff_ms, max_backoff_ms
        self.max_frame_size = max_frame_size
        self._servers: dict[Address, Server] = {}
        self._sets_seen: tuple[list[Address], list[Address]] = ([], [])  # the source's lists last looked at
        self._lock = threading.Lock()
        # A turn of each call's own: puts go round the writers whatever gets do, and gets round the readers.
        self._turns = {"put": itertools.count(), "get": itertools.count()}
        self._closed = False

    @classmethod
    def from_zookeeper(cls, hosts: str, path_prefix: str = "/kestrel", *, endpoint: str = "thrift",
                       session_timeout: float = 10.0, connect_timeout: float = 10.0,
                       **options: Any) -> Cluster:
        """A cluster found in the ZooKeeper server sets the servers join (`zookeeper` setting).

        `hosts` is kazoo's connection string (`"zk1:2181,zk2:2181"`, optionally with a chroot);
        `session_timeout` (seconds) is the ZooKeeper session's, `connect_timeout` (seconds) how long
        to wait for the first connection before raising ServerSetsUnavailable; `endpoint` is the
        member endpoint to use. Any other keyword is a Cluster option (`retries`, `timeout_ms`, ...).
        A bad option raises before ZooKeeper is contacted, and a failure after it closes the session.
        """
        if endpoint in OTHER_PROTOCOLS:  # each server advertises its ports by these names
            raise ValueError(f"Cluster.from_zookeeper: endpoint {endpoint!r} is a {endpoint} port; the "
                             f"client speaks Thrift (the servers advertise it as 'thrift')")
        if endpoint is None:
            raise ValueError("Cluster.from_zookeeper: endpoint None, each member's default, is the servers' "
                             "memcache port; the client speaks Thrift (the servers advertise it as 'thrift')")
        cluster = cls(_NotYetFound(), **options)  # the options are checked before ZooKeeper is asked
        cluster.source = ZooKeeperServerSets(hosts, path_prefix, endpoint=endpoint,
                                             session_timeout=session_timeout, connect_timeout=connect_timeout)
        return cluster

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        """Whether `close()` was called: then every call raises ClientClosed."""
        return self._closed

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise ClientClosed(f"cannot {what}")

    # -----------------------------------------------------------------------------------------
    # Servers

    def server(self, address: str | Address) -> Server:
        """The Server for an address (one per address, shared by every call)."""
        key = as_address(address)
        with self._lock:
            self._check_open(f"use kestrel {key[0]}:{key[1]}")
            found = self._servers.get(key)
            if found is None:
                found = self._servers[key] = Server(key[0], key[1], timeout_ms=self.timeout_ms,
                                                    connect_timeout_ms=self.connect_timeout_ms,
                                                    max_frame_size=self.max_frame_size)
            return found

    def writers(self) -> list[Server]:
        """The servers taking puts now (the source may change them at any time)."""
        self._retire_departed()
        return [self.server(a) for a in self.source.writers()]

    def readers(self) -> list[Server]:
        """The servers to read from now."""
        self._retire_departed()
        return [self.server(a) for a in self.source.readers()]

    def _retire_departed(self) -> None:
        """Let go of the servers in neither set any more, once the source's lists change (they are
        new lists then): a server that left (a rolling restart, a scale-down) kept its pooled
        connections open, half-closed, for the Cluster's life. A call in flight on one finishes;
        one that comes back is a new Server."""
        writers, readers = self.source.writers(), self.source.readers()
        seen = self._sets_seen
        if writers is seen[0] and readers is seen[1]:
            return
        current = {*writers, *readers}
        with self._lock:
            self._sets_seen = (writers, readers)
            gone = [self._servers.pop(a) for a in [a for a in self._servers if a not in current]]
        for server in gone:
            server.retire()

    def _in_turn(self, servers: Sequence[Server], method: str, round_: _Round) -> list[Server]:
        """The servers a pass of `round_` asks, each once: those fit for `method` from the next in
        `method`'s turn (or shuffled), then the ones that recently failed at once or refused it by
        status. Turning among the fit ones alone is what spreads a dead server's share evenly over
        the others, instead of onto the one after it.

        A server still hung (avoided after a failure that cost a timeout: `Server.still_hung`) is not
        asked at all, even when no other is left, and the round says why (`skipped`): asking would
        likely cost its caller the timeout again, and with every server so avoided each call waited
        on all of them, where the call now fails at once (NoServers). Its avoidance ends by itself,
        and the next call asks it again: that call is the probe."""
        fit: list[Server] = []
        unfit: list[Server] = []
        for server in servers:  # judged once each: another thread may mark one down meanwhile
            hung = server.still_hung()
            if hung is not None:
                round_.skipped.append(hung)
            else:
                (unfit if server.avoids(method) else fit).append(server)
        round_.fit = len(fit)
        if self.strategy == "random":
            random.shuffle(fit)
            random.shuffle(unfit)
            return fit + unfit
        turn = next(self._turns[method])
        return [*_rotated(fit, turn), *_rotated(unfit, turn)]

    def _ahead(self, servers: list[Server], round_: _Round, without_reads: bool = False,
               wait_after_answer: bool = True) -> Iterator[tuple[int, Server]]:
        """`servers` (a pass of `round_`, from `_in_turn`), with their index, each once a call to it
        would meet no connect: a fit one (the first `round_.fit`) once a pooled connection awaits it
        (holding no open reads, `without_reads`), opened beside the call if none did
        (`Server.open_ahead`, which joins a connect under way). The last fit one, with none under
        way, comes as it is (nothing is left to begin beside its connect, which its call makes), and
        so do the others (they failed at once lately: their connect costs nothing). A server whose
        connection could not be opened is not yielded: its error goes to the round.

        They come in turn while the server at hand connects promptly. Once its connect has taken a
        `stagger` (its connect timeout shared among the fit servers) it is slow: the next fit
        server's connect is begun each stagger (those with a pooled connection or a connect under way
        passed over at no cost), and whichever begun server is ready first comes, the first in turn
        among those ready, before the pass comes back to the one at hand. So a pass begins every
        connect within one connect timeout, and a live server behind any number of hung ones is
        called within about one, where the pass waited on each hung one at hand in turn (1.7
        timeouts behind six). With `wait_after_answer` false (a get's round: one answer says the
        queue is empty), once a server answered the pass leaves what it would wait on, a slow
        connect or an avoided server (past the fit ones): their items wait for a later round. What
        is still being opened when the caller is done is pooled, or marks its server down, in its
        own time; the passes meeting it meanwhile join it rather than connect again, so a hung host
        costs one connect timeout, once."""
        fit = round_.fit
        ended = new_event()  # set by each opening of the pass as it ends
        openings: dict[int, Opening] = {}
        waiting = list(range(len(servers)))  # neither yielded nor failed yet, in turn order
        begun = 0  # the fit servers before this one have a connection pooled or being opened
        at_hand, slow_at, next_begin = -1, 0.0, 0.0

        def ready(k: int) -> bool:
            opening = openings.get(k)
            if opening is None:  # passed over: a pooled connection awaited it
                return servers[k].has_idle(without_reads)
            return opening.done and opening.error is None

        while waiting:
            n = waiting[0]
            if n not in openings:
                if n >= fit and round_.answered and not wait_after_answer:
                    return
                last = len(waiting) == 1 or waiting[1] >= fit
                if n >= fit or servers[n].has_idle(without_reads) or (last and not servers[n].connecting()):
                    waiting.pop(0)
                    yield n, servers[n]
                    continue
                openings[n], _ = servers[n].open_ahead(ended)
                begun = max(begun, n + 1)
            stagger = servers[n].connect_timeout_ms / 1000.0 / fit
            if n != at_hand:
                at_hand = n
                slow_at = next_begin = openings[n].started + stagger
            ended.clear()  # before looking: an opening that ends after the look sets it again
            for k in list(waiting):
                opening = openings.get(k)
                if opening is not None and opening.done and opening.error is not None:
                    round_.errors.append(opening.error)
                    del openings[k]
                    waiting.remove(k)
            if n not in waiting:
                continue
            now = time.monotonic()
            taken = next((k for k in (waiting if now >= slow_at else [n]) if k < begun and ready(k)), None)
            if taken is not None:
                waiting.remove(taken)
                openings.pop(taken, None)
                yield taken, servers[taken]
            elif now >= slow_at and round_.answered and not wait_after_answer:
                waiting.remove(n)  # left to connect in its own time
                del openings[n]
            elif now >= next_begin:
                next_begin = now + stagger
                while begun < fit:  # the next connect; those that cost none are passed over
                    begun += 1
                    if not servers[begun - 1].has_idle(without_reads):
                        openings[begun - 1], new = servers[begun - 1].open_ahead(ended)
                        if new:
                            break
            else:
                ended.wait(next_begin - now)

    def _pause(self, failed_rounds: int) -> None:
        """Wait before pass `failed_rounds` + 1: backoff_ms, doubling, capped, with jitter."""
        ceiling = min(self.backoff_ms * 2 ** failed_rounds, self.max_backoff_ms) / 1000.0
        time.sleep(random.uniform(ceiling / 2, ceiling))

    def _gave_up(self, round_: _Round, failed_rounds: int) -> bool:
        """Whether a pass in which no server could take the call is the last one."""
        return failed_rounds >= self.retries or not round_.worth_retrying

    # -----------------------------------------------------------------------------------------
    # Writing

    def put(self, queue: str, item: BytesLike, expiration_ms: int = 0) -> bool:
        """Put one item; False when every server's queue refused it: full, or the item over its
        `max_item_size` (a put answers how many items it took, not why). Raises NoServers (see put_many).

        The item is bytes, bytearray or memoryview; anything else (a str included) raises TypeError.
        """
        what = f"put on {queue!r}"
        check_queue(queue, what)
        return self.put_many(queue, [check_item(item, what)], expiration_ms) == 1

    def put_many(self, queue: str, items: Iterable[BytesLike] | PackedItems, expiration_ms: int = 0) -> int:
        """Put a batch on the next server; what it refuses (full queue, errors) goes to the next.

        Items are bytes, bytearray or memoryview. Anything else, and a batch that is itself a str or
        bytes, raises TypeError naming the item's position, before anything is sent: a queue keeps
        what it is given, and a wrong item found by its consumer is found too late. PackedItems (items
        laid out already, as a producer holding them in one buffer makes them) go as they are.

        Returns how many items were stored: fewer than given when the servers refused the rest
        (full queues, or unreachable after the retries). When no server could be reached, every
        server is tried again `retries` times after a pause; raises NoServers, carrying each
        server's error, when nothing was stored and not every server merely had a full queue.
        """
        what = f"put on {queue!r}"
        check_queue(queue, what)
        remaining = items if isinstance(items, PackedItems) else check_items(items, what)
        check_count(expiration_ms, "expiration_ms", what)
        self._check_open(what)
        if not remaining:
            return 0
        framed = _put_frame_size(queue, remaining)
        if framed > self.max_frame_size:  # every server would close the connection unread
            raise ValueError(f"{what}: {len(remaining)} items make a call of {framed} bytes, over "
                             f"max_frame_size ({self.max_frame_size}): put fewer at a time")
        stored = 0
        failed_rounds = 0
        while True:
            self._check_open(what)
            round_ = _Round()
            for _, server in self._ahead(self._in_turn(self.writers(), "put", round_), round_):
                try:
                    accepted = server.put_checked(queue, remaining, expiration_ms)
                except (ServerUnavailable, Refused) as e:
                    round_.errors.append(e)
                    log.debug("put moved on from %s: %s", server.address, e)
                    continue
                round_.answered = True
                stored += accepted
                remaining = remaining[accepted:]
                if not remaining:
                    return stored
            if round_.answered and not round_.errors:
                return stored  # every server answered: their queues are full
            if self._gave_up(round_, failed_rounds):
                if not stored:
                    raise NoServers(f"put {len(remaining)} items on {queue!r}", round_.failures)
                return stored
            self._pause(failed_rounds)
            failed_rounds += 1

    # -----------------------------------------------------------------------------------------
    # Reading

    def get(self, queue: str, timeout: float = 0.0) -> bytes | None:
        """One item, removed for good, waiting up to `timeout` seconds; None if none came.

        Raises NoServers when no server of the read set could be asked (after the retries): an
        unreachable cluster is not an empty queue.
        """
        items = self.get_many(queue, 1, timeout)
        return items[0] if items else None

    def get_many(self, queue: str, max_items: int, timeout: float = 0.0) -> list[bytes]:
        """Up to `max_items` from the first server that has any, waiting up to `timeout` seconds.

        Raises NoServers when no server could be asked (see `get`).
        """
        found = self._fetch(queue, max_items, timeout, auto_abort_ms=0)
        return [item.data for item in found[1]] if found else []

    @contextmanager
    def reliable_read(self, queue: str, max_items: int = 1, timeout: float = 0.0) -> Iterator[list[bytes]]:
        """Open reads of up to `max_items`: confirmed when the block ends, aborted if it raises.

            with cluster.reliable_read("jobs", max_items=10, timeout=1.0) as items:
                for item in items:
                    work(item)

        `items` is empty when nothing came within `timeout`; NoServers is raised when no server could
        be asked. Items not confirmed within `auto_abort_ms` (say, the process died) return to their
        queue on the server. The batch is settled as a whole; `consume` and `reliable_items` confirm
        item by item what was finished.
        """
        found = self._fetch(queue, max_items, timeout, auto_abort_ms=self.auto_abort_ms)
        if not found:
            yield []
            return
        server, items = found
        done = 0
        try:
            yield [item.data for item in items]
            done = len(items)
        finally:
            self._settle(server, queue, items, done)

    def reliable_items(self, queue: str, timeout: float = 0.0, batch: int = 1) -> Iterator[bytes]:
        """Items as open reads, until none comes within `timeout` seconds.

        An item is finished when the loop asks for the next one; the finished items of a batch are
        confirmed together once the loop asks for the one after the batch. Leaving the loop, by
        `break` or an exception, confirms the finished items and aborts the one in hand and the rest
        of its batch: they return to the head of their queue. Raises NoServers when no server could
        be asked.
        """
        while True:
            found = self._fetch(queue, batch, timeout, self.auto_abort_ms)
            if not found:
                return
            server, items = found
            done = 0
            try:
                for item in items:
                    yield item.data
                    done += 1
            finally:
                self._settle(server, queue, items, done)

    def consume(self, queue: str, handle: Callable[[bytes], object], *, batch: int = 100,
                stop: threading.Event | None = None, until_empty: bool = False) -> int:
        """Feed every item of every server in the read set to `handle`, one item at a time, as
        reliable reads.

        Each round takes a batch of open reads from each server in turn. Acknowledgement is per
        item: when `handle` raises, the items it finished are confirmed, and the one it failed on and
        those after it are aborted (back to the head of their queue, in order), then the error
        propagates; nothing is lost, and nothing finished is delivered again. Otherwise the batch is
        confirmed once `handle` returned for all of it. Setting `stop` ends the loop after the item
        in hand (the rest of its batch is aborted). Runs until `stop` is set or, with `until_empty`,
        until a round over every server finds nothing. Returns how many items were handled.

        Raises NoServers when, after the retries, no server of the read set could be asked, and
        ClientClosed once the cluster is closed (after settling the batch in hand, as for `stop`).
        """
        what = f"consume {queue!r}"
        check_queue(queue, what)
        check_count(batch, "batch", what, least=1)

        handled = 0
        failed_rounds = 0
        while stop is None or not stop.is_set():
            self._check_open(what)
            round_ = _Round()
            got = 0
            readers = self._in_turn(self.readers(), "get", round_)
            for _, server in self._ahead(readers, round_, without_reads=True):
                items = self._get_from(server, queue, batch, 0, self.auto_abort_ms, round_)
                if items:
                    got += self._feed(server, queue, items, handle, stop)
                    if stop is not None and stop.is_set():
                        break
            handled += got
            if not round_.answered:
                if self._gave_up(round_, failed_rounds):
                    raise NoServers(f"get from {queue!r}", round_.failures)
                self._pause(failed_rounds)
                failed_rounds += 1
                continue
            failed_rounds = 0
            if got:
                continue
            if until_empty:
                return handled
            # Nothing anywhere: wait on each server in turn for a while, then look at them all again.
            found = self._fetch(queue, batch, self.poll_ms / 1000.0, self.auto_abort_ms, first_look=False)
            if found:
                server, items = found
                handled += self._feed(server, queue, items, handle, stop)
        return handled

    def _feed(self, server: Server, queue: str, items: list[Any], handle: Callable[[bytes], object],
              stop: threading.Event | None) -> int:
        """Hand items to `handle` one by one; confirm those it finished, abort the rest."""
        done = 0
        try:
            for item in items:
                if self._closed or (stop is not None and stop.is_set()):
                    break
                handle(item.data)
                done += 1
        finally:
            self._settle(server, queue, items, done)
        return done

    def _fetch(self, queue: str, max_items: int, timeout: float, auto_abort_ms: int,
               first_look: bool = True) -> tuple[Server, list[Any]] | None:
        """Items from the first reader that has some; while none has, wait on each in turn.

        None when none came within `timeout`; NoServers when no reader could be asked in a pass and
        the retries are spent.

        A plain get (no `auto_abort_ms`) whose answer was lost may have taken items the server will
        not give again (`maybe_done`): that server is not asked again in this call, where each try
        could take more, and NoServers then says what may have been taken.
        """
        what = f"get from {queue!r}"
        check_queue(queue, what)
        check_count(max_items, "max_items", what, least=1)
        deadline = time.monotonic() + check_seconds(timeout, "timeout", what)
        failed_rounds = 0
        spent: dict[str, ServerUnavailable] = {}  # by address: a plain get's lost answers
        while True:
            self._check_open(what)
            round_ = _Round()
            readers = self._in_turn([s for s in self.readers() if s.address not in spent], "get", round_)
            if spent and not readers:
                raise NoServers(f"{what} (a get without a reliable read may have taken items from "
                                f"{', '.join(spent)}, lost with its answer)",
                                [*spent.values(), *round_.skipped])
            for n, server in self._ahead(readers, round_, without_reads=auto_abort_ms > 0,
                                         wait_after_answer=False):
                # Each server's wait is its share of what is left of `timeout` among the servers
                # still to ask this round (at most `poll_ms` a round in all), so that the round ends
                # by the deadline however many servers there are.
                wait_s = 0.0 if first_look else min((deadline - time.monotonic()) / (len(readers) - n),
                                                    self.poll_ms / 1000.0 / len(readers))
                failures = len(round_.errors)
                items = self._get_from(server, queue, max_items, int(max(wait_s, 0.0) * 1000),
                                       auto_abort_ms, round_)
                if items:
                    return server, items
                lost = round_.errors[-1] if len(round_.errors) > failures else None
                if not auto_abort_ms and isinstance(lost, ServerUnavailable) and lost.maybe_done:
                    spent[server.address] = lost
            if not round_.answered:
                if self._gave_up(round_, failed_rounds):
                    raise NoServers(what, round_.failures)
                self._pause(failed_rounds)
                failed_rounds += 1
                continue
            failed_rounds = 0
            if deadline - time.monotonic() <= 0:
                return None
            first_look = False

    def _get_from(self, server: Server, queue: str, max_items: int, wait_ms: int,
                  auto_abort_ms: int, round_: _Round) -> list[Any]:
        try:
            items = server.get(queue, max_items, wait_ms, auto_abort_ms)
        except (ServerUnavailable, Refused) as e:
            round_.errors.append(e)
            log.debug("get skipped %s: %s", server.address, e)
            return []
        round_.answered = True
        return items

    def _settle(self, server: Server, queue: str, items: list[Any], done: int) -> None:
        """Confirm the first `done` open reads and abort the others (back to the queue's head), even
        if the cluster was closed meanwhile.

        A failure is logged, not raised: the server's auto-abort returns what was not settled.
        """
        try:
            server.settle(queue, {item.id for item in items[:done]}, {item.id for item in items[done:]})
        except KestrelClientError as e:
            log.warning("could not settle %d open reads of %r on %s (%s): the server's auto-abort returns "
                        "them, and any of the %d finished will be delivered again", len(items), queue,
                        server.address, e, done)

    def close(self) -> None:
        """Close every connection and stop watching ZooKeeper. Final: every call after it raises
        ClientClosed; calls in flight finish on their connection."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            servers, self._servers = list(self._servers.values()), {}
        self.source.close()
        for server in servers:
            server.close()


class _NotYetFound:
    """The servers of a Cluster whose source is being set up: none yet."""

    def writers(self) -> list[Address]:
        return []

    def readers(self) -> list[Address]:
        return []

    def close(self) -> None:
        pass


def _put_frame_size(queue: str, items: list[bytes] | PackedItems) -> int:
    """The bytes of a framed binary `put` call of `items`: each item's 4-byte length and bytes, the
    queue's name and the message's and fields' headers (64 bytes covers them)."""
    body = len(items.body) if isinstance(items, PackedItems) else sum(len(item) + 4 for item in items)
    return body + len(queue.encode()) + 64


def _rotated(servers: list[Server], turn: int) -> list[Server]:
    if not servers:
        return []
    start = turn % len(servers)
    return [*servers[start:], *servers[:start]]
