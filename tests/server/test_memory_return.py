"""When the server gives memory back: after a wave of closes, not under a steady stream of clients."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kestrel.service.memory_return import MemoryReturn, give_back


class Timers:
    def __init__(self) -> None:
        self.due: list[Callable[[], None]] = []

    def later(self, _seconds: float, fn: Callable[[], None]) -> None:
        self.due.append(fn)

    def fire(self) -> None:
        due, self.due = self.due, []
        for fn in due:
            fn()


def watcher(timers: Timers) -> MemoryReturn:
    return MemoryReturn(min_drop=100, settle_s=1.0, later=timers.later, release=lambda: {})


def test_a_wave_of_closes_gives_memory_back_once_it_settles() -> None:
    timers = Timers()
    m = watcher(timers)
    for _ in range(300):
        m.opened()
    for _ in range(140):
        m.closed()
    assert timers.due == []  # 160 of 300 still open: more than half
    for _ in range(160):
        m.closed()
    assert len(timers.due) == 1  # scheduled once, however many closed
    timers.fire()
    assert m.releases == 1 and m.peak == 0
    for _ in range(50):
        m.opened()
        m.closed()
    assert timers.due == []


def test_clients_coming_and_going_never_trigger_it() -> None:
    timers = Timers()
    m = watcher(timers)
    for _ in range(500):
        m.opened()
    for _ in range(10_000):  # one leaves, one arrives: as many open as ever
        m.closed()
        m.opened()
    assert timers.due == [] and m.releases == 0


def test_giving_back_reports_what_it_did() -> None:
    done: dict[str, Any] = give_back()
    assert set(done) == {"rss_mb_before", "rss_mb_after", "ms"} and done["rss_mb_after"] > 0
