"""Auto-abort deadlines of Thrift open reads: one wait list ordered by deadline, one greenlet.

A timer greenlet per open read cost more than the read itself once reads came in batches. Here a
read's deadline is a heap entry; a read closed before its deadline leaves its entry behind, and the
entry is skipped when it comes due (or dropped when the list is compacted).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Mapping

import gevent
import gevent.event
import structlog

log = structlog.get_logger("kestrel.auto_abort")

# Compact the list once entries of closed reads outnumber open reads by this much.
SLACK = 1024


class AutoAborts:
    """Calls `expire` with the ids of open reads whose deadline has passed, oldest deadline first,
    each id once; ids no longer in `open_ids` (the server's open reads by id) by then are skipped."""

    def __init__(self, open_ids: Mapping[int, object], expire: Callable[[list[int]], None]) -> None:
        self.open_ids = open_ids
        self.expire = expire
        self.deadlines: list[tuple[float, int]] = []  # a heap of (deadline, read id)
        self.wake = gevent.event.Event()  # set when a deadline earlier than all others arrives
        self.runner: gevent.Greenlet | None = None

    def add(self, read_id: int, seconds: float) -> None:
        """Abort `read_id` after `seconds`, unless it is closed by then."""
        deadline = time.monotonic() + seconds
        deadlines = self.deadlines
        if not deadlines or deadline < deadlines[0][0]:
            self.wake.set()
        heapq.heappush(deadlines, (deadline, read_id))
        if len(deadlines) > 2 * len(self.open_ids) + SLACK:
            self.deadlines = [entry for entry in deadlines if entry[1] in self.open_ids]
            heapq.heapify(self.deadlines)
        if self.runner is None:
            self.runner = gevent.spawn(self._run)

    def __len__(self) -> int:
        """Entries in the list, closed reads' entries included until they are skipped or compacted."""
        return len(self.deadlines)

    def due(self, now: float) -> list[int]:
        """Take the entries due by `now`; the ids of those still open, in deadline order."""
        deadlines = self.deadlines
        ids = []
        while deadlines and deadlines[0][0] <= now:
            read_id = heapq.heappop(deadlines)[1]
            if read_id in self.open_ids:
                ids.append(read_id)
        return ids

    def _run(self) -> None:
        while True:
            self.wake.clear()
            if not self.deadlines:
                self.wake.wait()
                continue
            delay = self.deadlines[0][0] - time.monotonic()
            if delay > 0:
                self.wake.wait(delay)
                continue
            ids = self.due(time.monotonic())
            if ids:
                try:
                    self.expire(ids)
                except Exception:
                    log.exception("auto-abort failed", read_ids=len(ids))

    def close(self) -> None:
        """Stop the timer: reads still open stay open."""
        if self.runner is not None:
            self.runner.kill(block=False)
            self.runner = None
