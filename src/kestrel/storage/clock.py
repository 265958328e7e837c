"""One injectable source of time, so expiry and timeout tests need no sleeping."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Final


def _performance_counter() -> Callable[[], float]:
    """`time.perf_counter`, or where it reads CLOCK_MONOTONIC and the build has its C twin, the
    twin: the same readings at about two thirds of the instructions (src/kestrel/storage/_clock.c)."""
    try:
        from kestrel.storage._clock import perf_counter as c_perf_counter
    except ImportError:
        return time.perf_counter
    if time.get_clock_info("perf_counter").implementation != "clock_gettime(CLOCK_MONOTONIC)":
        return time.perf_counter
    return c_perf_counter


# The clocks read on every request, bound once: the compiled build reads a `Final` name from a C
# static, where `time.perf_counter` costs two dictionary lookups a call (src/kestrel/build.py).
perf_counter: Final = _performance_counter()
_time_ns: Final = time.time_ns
_monotonic: Final = time.monotonic


class Clock:
    """Wall-clock milliseconds since the epoch (what the journal stores), and a monotonic reading
    in seconds for deadlines (waits, grace periods, auto-aborts)."""

    def now_ms(self) -> int:
        return _time_ns() // 1_000_000

    def monotonic(self) -> float:
        return _monotonic()


class FakeClock(Clock):
    """A clock that moves only when told to (both readings move together)."""

    def __init__(self, start_ms: int = 1_700_000_000_000) -> None:
        self.ms = start_ms

    def now_ms(self) -> int:
        return self.ms

    def monotonic(self) -> float:
        return self.ms / 1000.0

    def advance(self, ms: int) -> None:
        self.ms += ms


SYSTEM_CLOCK = Clock()
