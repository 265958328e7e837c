"""The auto-abort wait list: deadlines fire in order, each open read once, closed reads never.
Time is a manual runtime's: the tests move its clock instead of sleeping."""

from __future__ import annotations

from collections.abc import Callable

from kestrel.service.session.auto_abort import SLACK, AutoAborts
from kestrel.storage.runtime import ManualRuntime


def _list(open_ids: dict[int, object], then: Callable[[list[int]], None] | None = None,
          ) -> tuple[AutoAborts, list[list[int]], ManualRuntime]:
    """A wait list whose expire notes the ids and closes their reads, then calls `then` with them."""
    fired: list[list[int]] = []
    runtime = ManualRuntime()

    def expire(ids: list[int]) -> None:
        fired.append(ids)
        for read_id in ids:
            del open_ids[read_id]
        if then is not None:
            then(ids)

    return AutoAborts(open_ids, expire, runtime), fired, runtime


def test_deadlines_fire_in_deadline_order_each_once() -> None:
    open_ids: dict[int, object] = {i: None for i in range(1, 6)}
    aborts, fired, runtime = _list(open_ids)
    for read_id, seconds in [(1, 0.06), (2, 0.02), (3, 0.04), (4, 0.02), (5, 0.08)]:
        aborts.add(read_id, seconds)
    runtime.advance(19)
    assert fired == []
    runtime.advance(1)
    assert fired == [[2, 4]]
    runtime.advance(60)
    assert fired == [[2, 4], [3], [1], [5]]
    assert not open_ids and len(aborts) == 0 and runtime.timers == 0
    runtime.advance(1_000)
    assert fired == [[2, 4], [3], [1], [5]]  # nothing fires twice
    aborts.close()


def test_an_earlier_deadline_wakes_the_timer_already_waiting_for_a_later_one() -> None:
    open_ids: dict[int, object] = {1: None, 2: None}
    aborts, fired, runtime = _list(open_ids)
    aborts.add(1, 10.0)
    runtime.advance(10)  # the timer now waits for read 1's deadline
    aborts.add(2, 0.02)
    runtime.advance(20)
    assert fired == [[2]] and list(open_ids) == [1]
    runtime.advance(10_000)
    assert fired == [[2], [1]]
    aborts.close()


def test_reads_closed_before_their_deadline_never_fire() -> None:
    open_ids: dict[int, object] = {1: None, 2: None, 3: None}
    aborts, fired, runtime = _list(open_ids)
    for read_id in open_ids:
        aborts.add(read_id, 0.02)
    del open_ids[2]  # confirmed in time
    runtime.advance(80)
    assert fired == [[1, 3]]
    aborts.close()


def test_a_batch_due_together_is_expired_in_one_call() -> None:
    open_ids: dict[int, object] = {i: None for i in range(100)}
    aborts, fired, runtime = _list(open_ids)
    for read_id in range(100):
        aborts.add(read_id, 0.01)
    runtime.advance(60)
    assert fired == [list(range(100))]
    aborts.close()


def test_entries_of_closed_reads_are_compacted_away() -> None:
    open_ids: dict[int, object] = {}
    aborts, fired, runtime = _list(open_ids)
    for read_id in range(3 * SLACK):
        open_ids[read_id] = None
        aborts.add(read_id, 60.0)
        del open_ids[read_id]  # confirmed at once, as a busy consumer does
    assert len(aborts) <= SLACK + 1
    open_ids[-1] = None
    aborts.add(-1, 0.01)
    runtime.advance(50)
    assert fired == [[-1]]
    aborts.close()


def test_close_stops_the_timer_and_leaves_reads_open() -> None:
    open_ids: dict[int, object] = {1: None}
    aborts, fired, runtime = _list(open_ids)
    aborts.add(1, 0.02)
    aborts.close()
    runtime.advance(50)
    assert fired == [] and 1 in open_ids


def test_the_default_runtime_fires_on_real_time() -> None:
    import gevent

    open_ids: dict[int, object] = {1: None}
    fired: list[list[int]] = []
    aborts = AutoAborts(open_ids, fired.append)
    aborts.add(1, 0.01)
    with gevent.Timeout(5):
        while not fired:
            gevent.sleep(0.005)
    assert fired == [[1]]
    aborts.close()


def test_a_run_of_reads_is_one_entry_whose_closed_reads_are_skipped() -> None:
    open_ids: dict[int, object] = {read_id: None for read_id in range(1_000, 1_100)}
    aborts, fired, runtime = _list(open_ids)
    aborts.add_run(1_000, 100, aborts.deadline_after(0.02))
    aborts.add(7, 0.01)  # an earlier deadline, added later
    open_ids[7] = None
    for read_id in range(1_000, 1_100, 2):
        del open_ids[read_id]  # half confirmed in time
    assert len(aborts) == 2
    runtime.advance(50)
    assert fired == [[7], list(range(1_001, 1_100, 2))]
    aborts.close()


def test_runs_whose_reads_are_all_closed_are_compacted_away() -> None:
    open_ids: dict[int, object] = {}
    aborts, fired, runtime = _list(open_ids)
    for run in range(3 * SLACK):
        first = run * 100
        open_ids.update(dict.fromkeys(range(first, first + 100)))
        aborts.add_run(first, 100, aborts.deadline_after(60.0))
        for read_id in range(first, first + 100):
            del open_ids[read_id]
    assert len(aborts) <= SLACK + 1
    aborts.close()


def test_a_read_opened_during_an_expire_does_not_hold_back_an_earlier_deadline() -> None:
    """An expire's journal write can wait (sync_journal), and a get served meanwhile opens a read
    with a later deadline: the entries already listed still come due at their own deadlines."""
    open_ids: dict[int, object] = {1: None, 2: None}

    def reopen(ids: list[int]) -> None:
        if ids == [1]:  # a waiting get takes the aborted item back, with a long auto-abort
            open_ids[3] = None
            aborts.add(3, 30.0)

    aborts, fired, runtime = _list(open_ids, reopen)
    aborts.add(1, 0.5)
    aborts.add(2, 1.5)
    runtime.advance(500)
    assert fired == [[1]]
    runtime.advance(1_000)
    assert fired == [[1], [2]]
    runtime.advance(30_000)
    assert fired == [[1], [2], [3]] and not open_ids and runtime.timers == 0
    aborts.close()
