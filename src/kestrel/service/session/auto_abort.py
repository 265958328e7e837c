"""Auto-abort deadlines of Thrift open reads: one wait list ordered by deadline, one timer.

A timer per open read cost more than the read itself once reads came in batches, and so did a heap
entry per read (2,270 instructions a read of a batch of 100, compiled). Here the reads of one get,
whose ids run on from the first and share a deadline, are one heap entry; a read closed before its
deadline is skipped when its entry comes due, and an entry whose reads are all closed is dropped
when the list is compacted. One runtime timer is set for the earliest deadline; time comes from the
runtime's clock, so a manual runtime drives it in tests.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping

import structlog

from kestrel.storage.runtime import DEFAULT_RUNTIME, Runtime, Timer

log = structlog.get_logger("kestrel.auto_abort")

# Compact the list once entries of closed reads outnumber open reads by this much.
SLACK = 1024


class AutoAborts:
    """Calls `expire` with the ids of open reads whose deadline has passed, oldest deadline first,
    each id once; ids no longer in `open_ids` (the server's open reads by id) by then are skipped."""

    def __init__(self, open_ids: Mapping[int, object], expire: Callable[[list[int]], None],
                 runtime: Runtime = DEFAULT_RUNTIME) -> None:
        self.open_ids = open_ids
        self.expire = expire
        self.runtime = runtime
        self.deadlines: list[tuple[float, int, int]] = []  # a heap of (deadline, first read id, count)
        self._timer: Timer | None = None
        self._timer_at = 0.0  # the deadline the timer is set for
        self.closed = False

    def add(self, read_id: int, seconds: float) -> None:
        """Abort `read_id` after `seconds`, unless it is closed by then."""
        self.add_run(read_id, 1, self.deadline_after(seconds))

    def deadline_after(self, seconds: float) -> float:
        return self.runtime.clock.monotonic() + seconds

    def add_run(self, first: int, count: int, deadline: float) -> None:
        """Abort the `count` reads whose ids run from `first` at `deadline` (the runtime clock's
        monotonic seconds), unless each is closed by then: the reads of one get come due, and go
        back to the head, together."""
        deadlines = self.deadlines
        heapq.heappush(deadlines, (deadline, first, count))
        if len(deadlines) > 2 * len(self.open_ids) + SLACK:
            self.deadlines = [entry for entry in deadlines if self._open_of(entry)]
            heapq.heapify(self.deadlines)
        self._arm()

    def _open_of(self, entry: tuple[float, int, int]) -> list[int]:
        """The ids of an entry's run still open, in order."""
        open_ids = self.open_ids
        first = entry[1]
        return [read_id for read_id in range(first, first + entry[2]) if read_id in open_ids]

    def __len__(self) -> int:
        """Entries (runs of reads) in the list, those of closed reads included until they come due or
        are compacted away."""
        return len(self.deadlines)

    def due(self, now: float) -> list[int]:
        """Take the entries due by `now`; the ids of their reads still open, in deadline order."""
        deadlines = self.deadlines
        ids: list[int] = []
        while deadlines and deadlines[0][0] <= now:
            ids += self._open_of(heapq.heappop(deadlines))
        return ids

    def _arm(self) -> None:
        """Have the timer wait for the earliest deadline, unless it already waits for none later. Also
        after an expire: reads opened while its journal write waited set the timer for their own,
        later deadline, ahead of entries still in the list."""
        if self.closed or not self.deadlines:
            return
        deadline = self.deadlines[0][0]
        timer = self._timer
        if timer is not None:
            if self._timer_at <= deadline:
                return
            timer.cancel()
        self._timer_at = deadline
        self._timer = self.runtime.call_later(max(deadline - self.runtime.clock.monotonic(), 0.0), self._fire)

    def _fire(self) -> None:
        self._timer = None
        ids = self.due(self.runtime.clock.monotonic())
        if ids:
            try:
                self.expire(ids)
            except Exception:
                log.exception("auto-abort failed", read_ids=len(ids))
        self._arm()

    def close(self) -> None:
        """Stop the timer: reads still open stay open."""
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
