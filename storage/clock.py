"""One injectable source of time, so expiry and timeout tests need no sleeping."""

from __future__ import annotations

import time


class Clock:
    """Wall-clock milliseconds since the epoch (what the journal stores)."""

    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000


class FakeClock(Clock):
    """A clock that moves only when told to."""

    def __init__(self, start_ms: int = 1_700_000_000_000) -> None:
        self.ms = start_ms

    def now_ms(self) -> int:
        return self.ms

    def advance(self, ms: int) -> None:
        self.ms += ms


SYSTEM_CLOCK = Clock()
