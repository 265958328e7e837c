"""Expiry in the background: the sweep looks only at the queues where something is due.

Kestrel's rule (the guide's "Item expiration"): an expired item is discarded when it reaches the
head (a put, a get or a peek expires the head first: src/kestrel/storage/queue.py), and a sweep
every `expiration_timer_frequency` removes expired items from the head of each queue, at most
`max_expire_sweep` a round, and deletes a queue that is empty and older than `max_queue_age`.

Scanning every queue each round made an idle server with 10,000 queues busy. A queue's head can
only become due in two ways: its head item's expiry comes, or the queue changes (a get reveals a
new head, an abort puts one back, a put reaches an empty queue). So the schedule keeps, as Redis
keeps its volatile keys, a heap of queues keyed by the next time a look could find something (the
head's expiry, the end of `max_queue_age`), and takes every queue that changed since the last
sweep (src/kestrel/storage/changes.py). A round costs what is due and what changed, not the number
of queues.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from itertools import count
from operator import attrgetter

from kestrel.storage.errors import JournalWriteError
from kestrel.storage.queue import PersistentQueue

_NAME = attrgetter("name")


class ExpirySchedule:
    """When to look at each queue again. `changes` returns the queues changed since its last call."""

    def __init__(self, changes: Callable[[], set[PersistentQueue]]) -> None:
        self._changes = changes
        self._heap: list[tuple[int, int, PersistentQueue]] = []  # (when, order, queue); stale ones too
        self._when: dict[PersistentQueue, int] = {}  # each queue's one live entry
        self._order = count()

    def sweep(self, now: int, expire_queue: Callable[[PersistentQueue], None]) -> int:
        """Look at the queues due by `now` or changed since the last sweep, in name order: discard
        the expired items at their heads, and hand each queue past `max_queue_age` (empty, no open
        read) to `expire_queue`. Returns the items expired."""
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
                self._when.pop(q, None)
                expire_queue(q)
                continue
            self._schedule(q, self._next_look(q, head, now))
        return expired

    def _due(self, now: int) -> list[PersistentQueue]:
        """The queues to look at, by name: those whose time has come, and those changed that
        can come due at all (the others, the common case, leave the schedule here)."""
        heap, when = self._heap, self._when
        due = []
        for q in self._changes():
            if q.closed or not (q.head_expiry() or q.config.max_queue_age):
                when.pop(q, None)
            else:
                due.append(q)
        while heap and heap[0][0] <= now:
            at, _, q = heapq.heappop(heap)
            if when.get(q) == at:
                del when[q]
                if not q.closed:
                    due.append(q)
        return sorted(set(due), key=_NAME)

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
        when = self._when
        if not at:
            when.pop(q, None)
            return
        if when.get(q) == at:
            return
        when[q] = at
        heap = self._heap
        heapq.heappush(heap, (at, next(self._order), q))
        if len(heap) > 2 * len(when) + 64:  # stale entries: keep the heap within twice the live ones
            self._heap = [(at, next(self._order), q) for q, at in when.items()]
            heapq.heapify(self._heap)
