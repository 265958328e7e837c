"""A Kestrel cluster as clients see it: independent servers, work spread over them.

Puts go to the write set, reads to the read set (the same list when the servers are given by hand).
Each call picks servers in turn (round-robin, or random), skipping none but trying the ones that
recently failed last; a connection error or a refusal moves the call to the next server. Delivery
is at least once: a put whose reply was lost is sent again elsewhere, and an open read whose
confirm was lost returns to its queue, so consumers should be idempotent.
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from kestrel.client.discovery import Address, ServerSource, StaticServers, ZooKeeperServerSets, as_address
from kestrel.client.errors import KestrelClientError, NoServers, Refused, ServerUnavailable
from kestrel.client.server import Server

log = logging.getLogger("kestrel.client")

STRATEGIES = ("round_robin", "random")


class Cluster:
    """Puts, gets and reliable reads over every server of a Kestrel cluster.

    Thread-safe and cooperative under gevent: share one Cluster between threads or greenlets.

    Parameters: `servers`: addresses (`"host:2229"` or (host, port)) or a ServerSource such as
    ZooKeeperServerSets; `strategy`: `round_robin` (default) or `random`; `timeout_ms`: the network
    timeout of one call (on top of any wait asked for); `auto_abort_ms`: how long a reliable read may
    stay open before the server puts it back; `poll_ms`: the longest one server is waited on while
    others may have items.
    """

    def __init__(self, servers: Iterable[str | Address] | ServerSource, *, strategy: str = "round_robin",
                 timeout_ms: int = 10_000, auto_abort_ms: int = 60_000, poll_ms: int = 500) -> None:
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}, got {strategy!r}")
        self.source = servers if isinstance(servers, ServerSource) else StaticServers(servers)
        self.strategy = strategy
        self.timeout_ms, self.auto_abort_ms, self.poll_ms = timeout_ms, auto_abort_ms, poll_ms
        self._servers: dict[Address, Server] = {}
        self._lock = threading.Lock()
        self._turn = itertools.count()

    @classmethod
    def from_zookeeper(cls, hosts: str, path_prefix: str = "/kestrel", *, endpoint: str = "thrift",
                       session_timeout: float = 10.0, **options: Any) -> Cluster:
        """A cluster found in the ZooKeeper server sets the servers join (`zookeeper` setting)."""
        sets = ZooKeeperServerSets(hosts, path_prefix, endpoint=endpoint, session_timeout=session_timeout)
        return cls(sets, **options)

    # -----------------------------------------------------------------------------------------
    # Servers

    def server(self, address: str | Address) -> Server:
        """The Server for an address (one per address, shared by every call)."""
        key = as_address(address)
        with self._lock:
            found = self._servers.get(key)
            if found is None:
                found = self._servers[key] = Server(key[0], key[1], timeout_ms=self.timeout_ms)
            return found

    def writers(self) -> list[Server]:
        return [self.server(a) for a in self.source.writers()]

    def readers(self) -> list[Server]:
        return [self.server(a) for a in self.source.readers()]

    def _in_turn(self, servers: Sequence[Server]) -> list[Server]:
        """Every server once, starting from the next in turn (or shuffled); failing ones last."""
        if self.strategy == "random":
            order = random.sample(list(servers), len(servers))
        else:
            start = next(self._turn) % len(servers) if servers else 0
            order = [*servers[start:], *servers[:start]]
        return sorted(order, key=lambda s: s.seems_down)  # stable: keeps the turn among equals

    # -----------------------------------------------------------------------------------------
    # Writing

    def put(self, queue: str, item: bytes, expiration_ms: int = 0) -> bool:
        """Put one item; False when every server's queue is full. Raises NoServers (see put_many)."""
        return self.put_many(queue, [item], expiration_ms) == 1

    def put_many(self, queue: str, items: Sequence[bytes], expiration_ms: int = 0) -> int:
        """Put a batch on the next server; what it refuses (full queue, errors) goes to the next.

        Returns how many items were stored: fewer than given when every server refused the rest
        (full queues, or some unreachable). Raises NoServers, carrying each server's error, when
        nothing was stored and not every server merely had a full queue.
        """
        writers = self.writers()
        if not writers and items:
            raise NoServers(f"put on {queue!r}")
        remaining = list(items)
        stored = 0
        errors: list[KestrelClientError] = []
        for server in self._in_turn(writers):
            if not remaining:
                break
            try:
                accepted = server.put(queue, remaining, expiration_ms)
            except (ServerUnavailable, Refused) as e:
                errors.append(e)
                log.debug("put moved on from %s: %s", server.address, e)
                continue
            stored += accepted
            remaining = remaining[accepted:]
        if remaining and not stored and errors:
            raise NoServers(f"put {len(items)} items on {queue!r}", errors)
        return stored

    # -----------------------------------------------------------------------------------------
    # Reading

    def get(self, queue: str, timeout: float = 0.0) -> bytes | None:
        """One item, removed for good, waiting up to `timeout` seconds; None if none came."""
        items = self.get_many(queue, 1, timeout)
        return items[0] if items else None

    def get_many(self, queue: str, max_items: int, timeout: float = 0.0) -> list[bytes]:
        """Up to `max_items` from the first server that has any, waiting up to `timeout` seconds."""
        found = self._fetch(queue, max_items, timeout, auto_abort_ms=0)
        return [item.data for item in found[1]] if found else []

    @contextmanager
    def reliable_read(self, queue: str, max_items: int = 1, timeout: float = 0.0) -> Iterator[list[bytes]]:
        """Open reads of up to `max_items`: confirmed when the block ends, aborted if it raises.

            with cluster.reliable_read("jobs", max_items=10, timeout=1.0) as items:
                for item in items:
                    work(item)

        `items` is empty when nothing came within `timeout`. Items not confirmed within
        `auto_abort_ms` (say, the process died) return to their queue on the server.
        """
        found = self._fetch(queue, max_items, timeout, auto_abort_ms=self.auto_abort_ms)
        if not found:
            yield []
            return
        server, items = found
        with self._open_reads(server, queue, items) as data:
            yield data

    def reliable_items(self, queue: str, timeout: float = 0.0, batch: int = 1) -> Iterator[bytes]:
        """Items as open reads, until none comes within `timeout` seconds.

        An item is confirmed when the loop asks for the next one (with `batch` > 1, when it asks
        for the one after the batch). Leaving the loop, by `break` or an exception, aborts the
        item in hand: it returns to the head of its queue.
        """
        while True:
            with self.reliable_read(queue, batch, timeout) as items:
                if not items:
                    return
                yield from items

    def consume(self, queue: str, handle: Callable[[bytes], Any], *, batch: int = 100,
                stop: threading.Event | None = None, until_empty: bool = False) -> int:
        """Feed every item of every server in the read set to `handle`, as reliable reads.

        Each round takes a batch of open reads from each server in turn, confirming a batch once
        `handle` returned for all of it; if `handle` raises, the batch is aborted and the error
        propagates. Runs until `stop` is set or, with `until_empty`, until a round over every
        server finds nothing. Returns how many items were handled.
        """
        def feed(server: Server, items: list[Any]) -> int:
            with self._open_reads(server, queue, items) as data:
                for item in data:
                    handle(item)
            return len(items)

        handled = 0
        while stop is None or not stop.is_set():
            got = 0
            for server in self._in_turn(self.readers()):
                items = self._get_from(server, queue, batch, 0, self.auto_abort_ms)
                if items:
                    got += feed(server, items)
            handled += got
            if got:
                continue
            if until_empty:
                return handled
            # Nothing anywhere: wait on each server in turn for a while, then look at them all again.
            found = self._fetch(queue, batch, self.poll_ms / 1000.0, self.auto_abort_ms, first_look=False)
            if found:
                handled += feed(*found)
        return handled

    def _fetch(self, queue: str, max_items: int, timeout: float, auto_abort_ms: int,
               first_look: bool = True) -> tuple[Server, list[Any]] | None:
        """Items from the first reader that has some; while none has, wait on each in turn."""
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            readers = self._in_turn(self.readers())
            left = deadline - time.monotonic()
            if first_look or not readers:
                wait_ms = 0
            else:
                wait_ms = int(max(0.0, min(left, self.poll_ms / 1000.0 / len(readers))) * 1000)
            for server in readers:
                items = self._get_from(server, queue, max_items, wait_ms, auto_abort_ms)
                if items:
                    return server, items
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if not readers:
                time.sleep(min(left, self.poll_ms / 1000.0))
            first_look = False

    def _get_from(self, server: Server, queue: str, max_items: int, wait_ms: int,
                  auto_abort_ms: int) -> list[Any]:
        try:
            return server.get(queue, max_items, wait_ms, auto_abort_ms)
        except (ServerUnavailable, Refused) as e:
            log.debug("get skipped %s: %s", server.address, e)
            return []

    @contextmanager
    def _open_reads(self, server: Server, queue: str, items: list[Any]) -> Iterator[list[bytes]]:
        ids = {item.id for item in items}
        try:
            yield [item.data for item in items]
        except BaseException:
            try:
                server.abort(queue, ids)
            except KestrelClientError as e:
                log.warning("could not abort open reads on %s (%s); the server's auto-abort returns them",
                            server.address, e)
            raise
        try:
            server.confirm(queue, ids)
        except KestrelClientError as e:
            log.warning("could not confirm open reads on %s (%s): they will be delivered again",
                        server.address, e)

    def close(self) -> None:
        """Close every connection and stop watching ZooKeeper."""
        self.source.close()
        with self._lock:
            servers, self._servers = list(self._servers.values()), {}
        for server in servers:
            server.close()
