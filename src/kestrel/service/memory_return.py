"""Giving memory back to the system once many connections have closed.

A connection's objects are small, and Python's allocator takes memory from the system a 1 MiB arena
at a time, returning an arena only once nothing in it is alive. After 10,000 clients closed, the
arenas their objects had filled were almost all kept by a few objects that outlive them: names in
the interpreter's type-attribute cache (gevent looks a watcher's `stop` up by a new string each
time, and the cache keeps each string it saw), and tuples and contexts on the interpreter's free
lists; glibc meanwhile kept the larger blocks (saved greenlet stacks) as free heap. RSS stayed at
twice the idle server's.

So once the connections open fall to half the most there were since the last time (and at least
`MIN_DROP` fewer), and once no connection has closed for `SETTLE_S` (the wave is over, however long
a busy machine takes to close it), the server empties
the type cache and the free lists (a full garbage collection empties the lists) and asks glibc to
hand its free pages back (`malloc_trim`). It costs a few milliseconds of the loop, once per wave
of disconnections; a steady stream of clients coming and going never triggers it. When objects
were frozen while clients were connected (src/kestrel/service/gc_pauses.py), the collection thaws
them first, to free any cycle that died frozen (a connection makes none; this is cover for what
else might): then it walks the whole heap, 0.1–0.5 s with 10,000 queues, once per such wave.
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import gevent
import structlog

from kestrel.service.gc_pauses import GC_PAUSES

log = structlog.get_logger("kestrel.memory")

MIN_DROP = 1000  # connections closed since the peak before anything is given back (about 10 MB)
SETTLE_S = 1.0  # without a close, for the wave to count as over


def _malloc_trim(pad: int) -> None:
    """glibc's malloc_trim, where the C library has it (not musl, not macOS)."""
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim(pad)


def rss_bytes() -> int:
    """The process's resident set size (0 where /proc cannot tell)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def give_back() -> dict[str, Any]:
    """Empty the caches that keep small objects alive, then return free heap pages; what it did."""
    started = time.perf_counter()
    before = rss_bytes()
    clear = getattr(sys, "_clear_internal_caches", None) or sys._clear_type_cache
    clear()
    thawed = GC_PAUSES.thaw_after_closes()
    gc.collect()  # a full collection empties the free lists (tuples, dicts, lists, contexts)
    _malloc_trim(0)
    return {"rss_mb_before": round(before / 2**20, 1), "rss_mb_after": round(rss_bytes() / 2**20, 1),
            "ms": round((time.perf_counter() - started) * 1000, 1), "thawed": thawed}


class MemoryReturn:
    """Counts the connections open across listeners and gives memory back after a wave of closes."""

    def __init__(self, min_drop: int = MIN_DROP, settle_s: float = SETTLE_S,
                 later: Callable[[float, Callable[[], None]], Any] = gevent.spawn_later,
                 release: Callable[[], dict[str, Any]] = give_back,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.min_drop = min_drop
        self.settle_s = settle_s
        self._later = later
        self._release = release
        self._clock = clock
        self._last_close = 0.0
        self.open = 0
        self.peak = 0  # the most open at once since the last release
        self.releases = 0
        self._scheduled = False

    def opened(self) -> None:
        self.open += 1
        if self.open > self.peak:
            self.peak = self.open

    def closed(self) -> None:
        self.open -= 1
        self._last_close = self._clock()
        if not self._scheduled and self.peak - self.open >= self.min_drop and self.open * 2 <= self.peak:
            self._scheduled = True
            self._later(self.settle_s, self._run)

    def _run(self) -> None:
        quiet = self._clock() - self._last_close
        if quiet < self.settle_s:  # still closing: what is released now would fill again
            self._later(self.settle_s - quiet, self._run)
            return
        self._scheduled = False
        closed = self.peak - self.open
        done = self._release()
        self.releases += 1
        self.peak = self.open
        log.info("memory given back after connections closed", closed=closed, still_open=self.open, **done)


# One per process, as the memory it watches: every listener reports to it.
MEMORY_RETURN = MemoryReturn()
