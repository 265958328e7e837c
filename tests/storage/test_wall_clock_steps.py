"""The wall clock stepped under a running server (NTP, a VM resumed, a wrong clock set right): an
expiry is a time of the wall clock, as Kestrel's, so items expire when the wall clock reaches it;
waits, timers and every duration run on the monotonic clock, which no step moves; the names of
files made of the time stay in order. `FakeClock.step` steps the wall clock alone."""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path

import gevent

from kestrel.storage import QueueCollection
from kestrel.storage.kestrel2 import codec
from kestrel.storage.kestrel2.journal import QueueJournal
from kestrel.storage.kestrel2.replay import QueueReplay
from kestrel.storage.queue_path import list_journal_files
from kestrel.storage.runtime import ManualRuntime

HOUR = 3_600_000


def test_a_step_moves_the_wall_clock_and_not_the_monotonic_one() -> None:
    runtime = ManualRuntime()
    clock = runtime.clock
    wall, monotonic = clock.now_ms(), clock.monotonic()
    fired: list[int] = []
    runtime.call_later(1.0, lambda: fired.append(clock.now_ms()))
    clock.step(-HOUR)
    assert (clock.now_ms(), clock.monotonic()) == (wall - HOUR, monotonic)
    runtime.advance(1_000)  # the timer is due by the monotonic clock
    assert fired == [wall - HOUR + 1_000]
    clock.step(2 * HOUR)
    assert (clock.now_ms(), clock.monotonic()) == (wall + HOUR + 1_000, monotonic + 1.0)


def test_a_wait_ends_when_its_time_has_passed_whatever_steps_the_wall_clock_takes(tmp_path: Path) -> None:
    runtime = ManualRuntime()
    coll = QueueCollection(str(tmp_path), runtime=runtime)
    waiter = gevent.spawn(partial(coll.remove, "q", 1, False, 5.0))
    gevent.sleep(0)
    runtime.clock.step(-HOUR)
    runtime.advance(4_999)
    runtime.clock.step(2 * HOUR)
    gevent.sleep(0)
    assert not waiter.ready()
    runtime.advance(1)
    assert waiter.get(timeout=1) == []
    assert runtime.timers == 0
    coll.close()


def test_items_expire_when_the_wall_clock_reaches_their_expiry_and_the_sweeper_runs_on(tmp_path: Path) -> None:
    runtime = ManualRuntime()
    coll = QueueCollection(str(tmp_path), runtime=runtime)
    coll.put("before", [b"a"], runtime.clock.now_ms() + 1_500)
    coll.start_sweeper(1_000)
    runtime.clock.step(-HOUR)
    coll.put("after", [b"b"], runtime.clock.now_ms() + 1_500)  # 1.5 s from the wall clock's time now
    runtime.advance(2_000)
    assert coll.queue("after").length == 0  # its time came
    assert coll.queue("before").length == 1  # an hour of the wall clock still to go
    runtime.clock.step(HOUR)
    runtime.advance(1_000)
    assert coll.queue("before").length == 0 and runtime.timers == 1  # the sweeper alone, still running
    coll.close()


def test_a_kestrel2_journal_rotated_after_a_step_back_and_a_restart_is_named_after_the_last(tmp_path: Path) -> None:
    runtime = ManualRuntime()

    def opened() -> QueueJournal:
        j = QueueJournal(str(tmp_path), "q", None, 1 << 20, runtime, runtime.lock())
        j.replay(list_journal_files(str(tmp_path), "q"), True, QueueReplay())
        j.open_live()
        return j

    def add(j: QueueJournal, data: bytes) -> None:
        j.write(codec.encode_addx(runtime.clock.now_ms(), 0, data))
        j.flush()
        j.sync()

    j = opened()
    add(j, b"a")
    first = j.rotate()
    runtime.clock.step(-HOUR)
    add(j, b"b")
    second = j.rotate()
    j.close()
    runtime.clock.step(-HOUR)  # further back while it was down
    j = opened()
    add(j, b"c")
    third = j.rotate()
    add(j, b"d")
    j.close()
    assert [first + 1, first + 2] == [second, third]
    assert sorted(os.listdir(tmp_path)) == sorted([".kestrel", "q", f"q.{first}", f"q.{second}", f"q.{third}"])
    replay = QueueReplay()
    j = QueueJournal(str(tmp_path), "q", None, 1 << 20, runtime, runtime.lock())
    j.replay(list_journal_files(str(tmp_path), "q"), True, replay)
    assert [item.data for item in replay.restart_order()] == [b"a", b"b", b"c", b"d"]
    j.close()
