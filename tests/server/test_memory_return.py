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


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def watcher(timers: Timers, clock: Clock | None = None) -> MemoryReturn:
    return MemoryReturn(min_drop=100, settle_s=1.0, later=timers.later, release=lambda: {},
                        clock=clock or Clock())


def test_a_wave_of_closes_gives_memory_back_once_it_settles() -> None:
    timers = Timers()
    clock = Clock()
    m = watcher(timers, clock)
    for _ in range(300):
        m.opened()
    for _ in range(140):
        m.closed()
    assert timers.due == []  # 160 of 300 still open: more than half
    for _ in range(160):
        m.closed()
    assert len(timers.due) == 1  # scheduled once, however many closed
    clock.now += 1.0
    timers.fire()
    assert m.releases == 1 and m.peak == 0
    for _ in range(50):
        m.opened()
        m.closed()
    assert timers.due == []


def test_a_wave_still_closing_when_its_timer_fires_waits_for_the_rest() -> None:
    """On a busy machine a wave of closes can outlast the settling time: released part way, the
    memory the rest of the wave frees would stay."""
    timers = Timers()
    clock = Clock()
    m = watcher(timers, clock)
    for _ in range(1000):
        m.opened()
    for _ in range(600):
        m.closed()
    clock.now += 0.9
    for _ in range(300):
        m.closed()  # the wave goes on, slowly
    clock.now += 0.1
    timers.fire()
    assert m.releases == 0 and len(timers.due) == 1  # 0.1 s since the last close: not yet
    for _ in range(100):
        m.closed()
    clock.now += 1.0
    timers.fire()
    assert m.releases == 1 and m.open == 0 and m.peak == 0


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
    assert set(done) == {"rss_mb_before", "rss_mb_after", "ms", "thawed"} and done["rss_mb_after"] > 0
