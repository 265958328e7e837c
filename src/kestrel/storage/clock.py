"""One injectable source of time, so expiry and timeout tests need no sleeping."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Final, Literal, TypeVar

T = TypeVar("T")


def wall_ms_python() -> int:
    """The wall clock in milliseconds since the epoch (the reference of `_clock.now_ms`)."""
    return time.time_ns() // 1_000_000


def _c_twin(python: Callable[[], T], name: str, clock: Literal["perf_counter", "time"],
            reads: str) -> Callable[[], T]:
    """`python`, or where the build has its C twin `name` (src/kestrel/storage/_clock.c) and Python
    reads `clock` as the twin does (`reads`), the twin: the same readings at a third to two thirds
    of the instructions."""
    try:
        from kestrel.storage import _clock
    except ImportError:
        return python
    if time.get_clock_info(clock).implementation != reads:
        return python
    twin: Callable[[], T] = getattr(_clock, name)
    return twin


# The clocks read on every request, bound once: the compiled build reads a `Final` name from a C
# static, where `time.perf_counter` costs two dictionary lookups a call (src/kestrel/build.py).
perf_counter: Final = _c_twin(time.perf_counter, "perf_counter", "perf_counter",
                              "clock_gettime(CLOCK_MONOTONIC)")
_now_ms: Final = _c_twin(wall_ms_python, "now_ms", "time", "clock_gettime(CLOCK_REALTIME)")
_monotonic: Final = time.monotonic


class Clock:
    """Wall-clock milliseconds since the epoch (what the journal stores, and expiry compares with),
    and a monotonic reading in seconds for deadlines and durations (waits, grace periods,
    auto-aborts, uptime, rates): the wall clock can be stepped either way (NTP, a VM resumed, a
    wrong clock set right), so a duration taken as the difference of two wall readings could come
    out negative or an hour long."""

    def now_ms(self) -> int:
        return _now_ms()

    def monotonic(self) -> float:
        return _monotonic()


def age_ms(now_ms: int, stamp_ms: int) -> int:
    """How long before `now_ms` the wall-clock stamp `stamp_ms` (an item's add time) was taken: 0,
    not less, when the clock has been stepped back past it since (as Kestrel's ages, `max 0`)."""
    return max(now_ms - stamp_ms, 0)


class FakeClock(Clock):
    """A clock that moves only when told to: `advance` moves both readings together, `step` the
    wall clock alone, as NTP steps it while the monotonic clock runs on."""

    def __init__(self, start_ms: int = 1_700_000_000_000) -> None:
        self.ms = start_ms  # the monotonic reading, in ms (a manual runtime's timers are due by it)
        self.stepped_ms = 0  # the wall clock's steps so far: it reads `ms + stepped_ms`

    def now_ms(self) -> int:
        return self.ms + self.stepped_ms

    def monotonic(self) -> float:
        return self.ms / 1000.0

    def advance(self, ms: int) -> None:
        self.ms += ms

    def step(self, ms: int) -> None:
        """Step the wall clock `ms` (back, when negative); no time passes."""
        self.stepped_ms += ms


SYSTEM_CLOCK = Clock()
