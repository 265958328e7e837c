"""Readers waiting for an item: served first come first, each until its own deadline.

Deadlines are read from the runtime's clock and waits end through the runtime's events, so a
manual runtime makes a timed-out wait a matter of moving the clock, not of sleeping.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import TypeVar

from kestrel.storage.runtime import Event, Runtime

T = TypeVar("T")


class WaitList:
    """Waiting readers in arrival order. `wake` lets the longest-waiting ones try again (a woken
    reader that finds nothing keeps its place); `end` sends every waiter home empty-handed and stops
    later waits from waiting.

    The readers to wake are a heap by arrival, a woken one leaving it until it waits again: a put
    of many items wakes as many readers at a cost of the readers it wakes, where a scan from the
    longest-waiting one passed every reader woken before (10,000 items to 10,000 readers held the
    loop for a second). A reader that leaves unwoken (its time-out) stays in the heap until a
    wake-up reaches it or the heap is rebuilt, once most of it has left."""

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime
        self._waiting: dict[Event, int] = {}  # every waiter's event, and its arrival
        self._asleep: list[tuple[int, Event]] = []  # the waiters to wake, by arrival (a heap)
        self._arrivals = itertools.count()
        self._lock = runtime.lock()
        self.ended = False

    def __len__(self) -> int:
        return len(self._waiting)

    def wait(self, fetch: Callable[[], T | None], timeout: float, looking: bool = False) -> T | None:
        """`fetch()`'s first result that is not None, trying again at each wake-up until `timeout`
        seconds have passed (or the list is ended); None if there was none. A wake-up this waiter
        did not use is passed on to the next, even when its fetch after the wake-up never ended (an
        error, or the waiter cancelled while the fetch let others run); so is one it used if it is
        `looking` (its fetch takes nothing, as a peek: the next waiter may take what it saw)."""
        item = fetch()
        if item is not None or timeout <= 0 or self.ended:
            return item
        clock = self._runtime.clock
        deadline = clock.monotonic() + timeout
        event = self._runtime.event()
        arrival = next(self._arrivals)
        with self._lock:
            self._waiting[event] = arrival
            heapq.heappush(self._asleep, (arrival, event))
        owed = False  # holding a wake-up the next waiter is owed if this one leaves now
        try:
            while not self.ended:
                # Fetched again once registered: a wake-up between the first fetch and the
                # registration (another thread's add) is not lost.
                item = fetch()
                if item is not None:
                    owed = owed and looking  # a taker keeps its turn
                    break
                owed = False  # what woke this waiter was taken by another
                remaining = deadline - clock.monotonic()
                if remaining <= 0 or not event.wait(remaining):
                    break
                event.clear()
                owed = True  # until its fetch ends: one cut short used nothing
                with self._lock:
                    if not self.ended:  # to be woken again, in its place
                        heapq.heappush(self._asleep, (arrival, event))
            return item
        finally:
            with self._lock:
                del self._waiting[event]
                if len(self._asleep) > 2 * len(self._waiting) + 64:
                    self._asleep = [(a, e) for a, e in self._asleep if e in self._waiting]
                    heapq.heapify(self._asleep)
            # Passed on: a wake-up not used (one that came while this waiter, already woken, looked,
            # or one whose fetch never ended), and a used one when it only looks.
            if not self.ended and (event.is_set() or owed):
                self.wake()

    def wake(self, count: int = 1) -> int:
        """Wake up to `count` of the longest-waiting readers not already woken; how many there were."""
        woken = 0
        with self._lock:
            asleep, waiting = self._asleep, self._waiting
            while woken < count and asleep:
                event = heapq.heappop(asleep)[1]
                if event in waiting:  # else it has left
                    event.set()
                    woken += 1
        return woken

    def end(self) -> None:
        """Wake every waiter empty-handed; from now on `wait` does not wait."""
        with self._lock:
            self.ended = True
            self._asleep = []
            for event in self._waiting:
                event.set()
