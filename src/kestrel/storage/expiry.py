"""Expiry in the background: the sweep looks only at the queues where something is due.

Kestrel's rule (the guide's "Item expiration"): an expired item is discarded when it reaches the
head (a put, a get or a peek expires the head first: src/kestrel/storage/queue.py), and a sweep
every `expiration_timer_frequency` removes expired items from the head of each queue, at most
`max_expire_sweep` a round, and deletes a queue that is empty and older than `max_queue_age`.

Scanning every queue each round made an idle server with 10,000 queues busy, and looking at each
queue that changed made every item on 10,000 queues pay for a look. So the schedule keeps, as Redis
keeps its volatile keys, a heap of queues keyed by the next time a look could find something (the
head's expiry, the end of `max_queue_age`), and nothing else. A queue that can expire nothing (no
`max_age`, no `max_queue_age`, no item ever given an expiry: `PersistentQueue.may_expire`) is never
in it and never looked at. One that can tells the schedule after each change (`watch`), which
brings its entry forward when the change revealed an earlier head; a later head is found when the
earlier entry comes due. A round costs what is due, not the number of queues or of items.

An entry left behind in the heap (a sooner one replaced it, or its queue was deleted) lets go of its
queue at once: the heap never keeps a deleted queue alive until the entry's time comes
(docs/queue-lifetime.md).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from itertools import count
from operator import attrgetter

from kestrel.storage.errors import JournalWriteError
from kestrel.storage.queue import PersistentQueue
from kestrel.storage.runtime import Lock

_NAME = attrgetter("name")


class _Look:
    """A look at `queue` due at `at`: the heap's entry, and its queue's live one until it is due,
    replaced or forgotten, when `queue` becomes None (the heap may keep the entry a while; it holds
    no queue then)."""

    __slots__ = ("at", "queue")

    def __init__(self, at: int, queue: PersistentQueue) -> None:
        self.at = at
        self.queue: PersistentQueue | None = queue


class ExpirySchedule:
    """When to look at each queue that can expire something. `lock` guards the heap against
    changes made in other threads (a no-op under gevent); it is never held while a queue is looked
    at, so that a change (holding its queue's lock) can always `watch`."""

    def __init__(self, lock: Lock) -> None:
        self._lock = lock
        self._heap: list[tuple[int, int, _Look]] = []  # (when, order, look); stale ones too
        self._when: dict[PersistentQueue, _Look] = {}  # each queue's one live entry
        self._order = count()

    def watch(self, q: PersistentQueue) -> None:
        """`q`, which can expire something, changed (or was loaded, or given new settings): make
        sure it is looked at by the time its head expires (at the next sweep when the head is due or
        on disk, or when the queue is past `max_queue_age`, to see whether it is empty now)."""
        head = q.head_expiry()
        at = 1 if head < 0 else head  # 0: the head never expires
        age = q.config.max_queue_age
        if age:
            ends = q.create_time + age + 1
            at = min(at, ends) if at else ends
        if at:
            self._schedule(q, at)

    def forget(self, q: PersistentQueue) -> None:
        """`q` is closed or deleted: no look at it is due any more."""
        with self._lock:
            look = self._when.pop(q, None)
            if look is not None:
                look.queue = None

    def sweep(self, now: int, expire_queue: Callable[[PersistentQueue], None]) -> int:
        """Look at the queues due by `now`, in name order: discard the expired items at their
        heads, and hand each queue past `max_queue_age` (empty, no open read) to `expire_queue`.
        Returns the items expired."""
        expired = 0
        for q in self._due(now):
            head = q.head_expiry()
            age = q.config.max_queue_age
            if head and head <= now:  # -1: the head is on disk, and the look reads it
                try:
                    expired += q.discard_expired(q.config.max_expire_sweep)
                except JournalWriteError:
                    pass  # the queue logged it and is read-only: looked at again next sweep
                head = q.head_expiry()
            if age and q.length == 0 and q.open_transactions == 0 and now - q.create_time > age:
                self.forget(q)
                expire_queue(q)
                continue
            at = self._next_look(q, head, now)
            if at:
                self._schedule(q, at)
        return expired

    def _due(self, now: int) -> list[PersistentQueue]:
        """The queues whose time has come, by name, their entries taken from the schedule."""
        due = []
        with self._lock:
            heap, when = self._heap, self._when
            while heap and heap[0][0] <= now:
                q = heapq.heappop(heap)[2].queue
                if q is not None:  # the queue's live entry
                    del when[q]
                    if not q.closed:
                        due.append(q)
        return sorted(due, key=_NAME)

    @staticmethod
    def _next_look(q: PersistentQueue, head: int, now: int) -> int:
        """When a look at `q` (whose head expires at `head`) could next find something, if nothing
        changes it first (0: never): now (the next sweep) while its head is expired or on disk,
        else its head's expiry or the end of its `max_queue_age`, whichever comes first. A queue
        past its age but not empty is looked at again when it changes."""
        at = now if head < 0 or 0 < head <= now else head
        age = q.config.max_queue_age
        if age and now <= q.create_time + age:
            ends = q.create_time + age + 1
            at = min(at, ends) if at else ends
        return at

    def _schedule(self, q: PersistentQueue, at: int) -> None:
        """A look at `q` by `at`: an earlier entry already there stands (a change in another thread
        may have made it while a sweep looked at `q`)."""
        with self._lock:
            when = self._when
            live = when.get(q)
            if live is not None:
                if live.at <= at:
                    return
                live.queue = None  # stale from now on
            look = when[q] = _Look(at, q)
            heap = self._heap
            heapq.heappush(heap, (at, next(self._order), look))
            if len(heap) > 2 * len(when) + 64:  # stale entries: keep the heap within twice the live ones
                self._heap = [(look.at, next(self._order), look) for look in when.values()]
                heapq.heapify(self._heap)
