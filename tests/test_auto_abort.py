"""The auto-abort wait list: deadlines fire in order, each open read once, closed reads never."""

from __future__ import annotations

import time

import gevent

from service.auto_abort import SLACK, AutoAborts


def _list(open_ids: dict[int, object]) -> tuple[AutoAborts, list[list[int]]]:
    fired: list[list[int]] = []

    def expire(ids: list[int]) -> None:
        fired.append(ids)
        for read_id in ids:
            del open_ids[read_id]

    return AutoAborts(open_ids, expire), fired


def test_deadlines_fire_in_deadline_order_each_once() -> None:
    open_ids: dict[int, object] = {i: None for i in range(1, 6)}
    aborts, fired = _list(open_ids)
    for read_id, seconds in [(1, 0.06), (2, 0.02), (3, 0.04), (4, 0.02), (5, 0.08)]:
        aborts.add(read_id, seconds)
    started = time.monotonic()
    while open_ids and time.monotonic() - started < 5:
        gevent.sleep(0.01)
    flat = [read_id for ids in fired for read_id in ids]
    assert flat == [2, 4, 3, 1, 5]
    assert not open_ids and len(aborts) == 0
    gevent.sleep(0.03)
    assert [read_id for ids in fired for read_id in ids] == flat  # nothing fires twice
    aborts.close()


def test_an_earlier_deadline_wakes_the_timer_already_waiting_for_a_later_one() -> None:
    open_ids: dict[int, object] = {1: None, 2: None}
    aborts, fired = _list(open_ids)
    aborts.add(1, 10.0)
    gevent.sleep(0.01)  # the timer now sleeps towards read 1's deadline
    aborts.add(2, 0.02)
    gevent.sleep(0.08)
    assert fired == [[2]] and list(open_ids) == [1]
    aborts.close()


def test_reads_closed_before_their_deadline_never_fire() -> None:
    open_ids: dict[int, object] = {1: None, 2: None, 3: None}
    aborts, fired = _list(open_ids)
    for read_id in open_ids:
        aborts.add(read_id, 0.02)
    del open_ids[2]  # confirmed in time
    gevent.sleep(0.08)
    assert fired == [[1, 3]]
    aborts.close()


def test_a_batch_due_together_is_expired_in_one_call() -> None:
    open_ids: dict[int, object] = {i: None for i in range(100)}
    aborts, fired = _list(open_ids)
    for read_id in range(100):
        aborts.add(read_id, 0.01)
    gevent.sleep(0.06)
    assert fired == [list(range(100))]
    aborts.close()


def test_entries_of_closed_reads_are_compacted_away() -> None:
    open_ids: dict[int, object] = {}
    aborts, fired = _list(open_ids)
    for read_id in range(3 * SLACK):
        open_ids[read_id] = None
        aborts.add(read_id, 60.0)
        del open_ids[read_id]  # confirmed at once, as a busy consumer does
    assert len(aborts) <= SLACK + 1
    open_ids[-1] = None
    aborts.add(-1, 0.01)
    gevent.sleep(0.05)
    assert fired == [[-1]]
    aborts.close()


def test_close_stops_the_timer_and_leaves_reads_open() -> None:
    open_ids: dict[int, object] = {1: None}
    aborts, fired = _list(open_ids)
    aborts.add(1, 0.02)
    aborts.close()
    gevent.sleep(0.05)
    assert fired == [] and 1 in open_ids
