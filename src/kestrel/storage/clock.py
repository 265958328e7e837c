"""One injectable source of time, so expiry and timeout tests need no sleeping."""

from __future__ import annotations

import time
from typing import Final

# The clocks read on every request, bound once: the compiled build reads a `Final` name from a C
# static, where `time.perf_counter` costs two dictionary lookups a call (src/kestrel/build.py).
perf_counter: Final = time.perf_counter
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
