"""Readers waiting for an item: served first come first, each until its own deadline.

Deadlines are read from the runtime's clock and waits end through the runtime's events, so a
manual runtime makes a timed-out wait a matter of moving the clock, not of sleeping.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TypeVar

from kestrel.storage.runtime import Event, Runtime

T = TypeVar("T")


class WaitList:
    """Waiting readers in arrival order. `wake_one` lets the longest-waiting one try again;
    `end` sends every waiter home empty-handed and stops later waits from waiting."""

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime
        self._waiters: deque[Event] = deque()
        self._lock = runtime.lock()
        self.ended = False

    def __len__(self) -> int:
        return len(self._waiters)

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
        with self._lock:
            self._waiters.append(event)
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
            return item
        finally:
            with self._lock:
                self._waiters.remove(event)
            # Passed on: a wake-up not used (one that came while this waiter, already woken, looked,
            # or one whose fetch never ended), and a used one when it only looks.
            if not self.ended and (event.is_set() or owed):
                self.wake_one()

    def wake_one(self) -> bool:
        """Wake the longest-waiting reader not already woken; False if there is none."""
        with self._lock:
            for event in self._waiters:
                if not event.is_set():
                    event.set()
                    return True
        return False

    def end(self) -> None:
        """Wake every waiter empty-handed; from now on `wait` does not wait."""
        self.ended = True
        with self._lock:
            for event in self._waiters:
                event.set()
