"""A journal's large reads and writes run off the event loop, with its other changes waiting their
turn at the journal's gate.

A change is applied in memory and appended to its journal before anything yields, so the journal's
order is the order of the changes. An append of megabytes (a 16 MB item) would hold the loop for
the kernel's copy into the page cache and its throttling of dirty pages, tens of milliseconds on a
busy disk, stalling every other client; so would a read-behind cursor reading such an item back.
So a read or write of `LARGE_IO` bytes or more goes to the runtime's thread pool, and the loop
serves other queues meanwhile; this queue's changes (and, in Kestrel 3, those of every reader of
its writer journal) wait at the gate until it is done, so none sees memory its journal does not
hold yet, and their records follow in order. The system call is the same either way: a write that
fails leaves the journal as it was and fails the change, and an acknowledgement still comes after
its write (and its fsync under `always`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, TypeVar

from kestrel.storage.runtime import Event, Runtime

T = TypeVar("T")

# The size from which a read or write runs off the loop. Below it the system call costs the loop
# less than handing it to a thread and back (a megabyte into the page cache: 0.2 ms of CPU).
LARGE_IO: Final = 1 << 20


class JournalGate:
    """The changes of one journal (every reader's, for a Kestrel 3 writer journal) wait here while
    a large read or write of theirs runs off the loop (`run`)."""

    __slots__ = ("runtime", "busy")

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.busy: Event | None = None  # set while a system call of this journal runs off the loop

    def wait_turn(self) -> None:
        """Return once no read or write of this journal runs off the loop."""
        while (busy := self.busy) is not None:
            busy.wait()

    def run(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` (a system call reading or writing the journal's files) on the runtime's
        thread pool, the journal's other changes waiting meanwhile; what it returns or raises.
        Called within a change, which passed the gate: none other runs off the loop now."""
        done = self.busy = self.runtime.event()
        try:
            return self.runtime.run_blocking(fn, *args)
        finally:
            self.busy = None
            done.set()
