"""One injectable source of time, so expiry and timeout tests need no sleeping."""

from __future__ import annotations

import time


class Clock:
    """Wall-clock milliseconds since the epoch (what the journal stores), and a monotonic reading
    in seconds for deadlines (waits, grace periods, auto-aborts)."""

    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000

    def monotonic(self) -> float:
        return time.monotonic()


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
