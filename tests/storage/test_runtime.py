"""The swappable runtime: a collection used from plain threads with no gevent hub, and manual time
that makes waits, expiry sweeps and periodic fsyncs a matter of moving a clock, not of sleeping."""

from __future__ import annotations

import errno
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

import gevent
import gevent.event
import pytest
from gevent._hub_local import get_hub_if_exists

from kestrel.storage import QueueCollection, QueueConfigs
from kestrel.storage.errors import QueueClosed
from kestrel.storage.fsync.group_commit import loop_timer
from kestrel.storage.no_lock import NoLock
from kestrel.storage.runtime import (
    GeventRuntime,
    ManualRuntime,
    OneAtATime,
    ThreadsRuntime,
    all_side_by_side,
    paced,
    side_by_side,
)
from kestrel.storage.wait_list import WaitList
from tests.conftest import STALL_S, wait_until
from tests.support.queues import one
from tests.support.slow_disk import until_begun

# ---------------------------------------------------------------------------------------------
# Plain threads


def test_threads_put_and_get_with_waits_and_timeouts_without_a_gevent_hub(tmp_path: Path) -> None:
    coll = QueueCollection(str(tmp_path), QueueConfigs({"sync_journal": "5ms"}), runtime=ThreadsRuntime())
    coll.load()
    producers, consumers, each = 4, 4, 300
    got: list[bytes] = []
    got_lock = threading.Lock()
    hubs: list[object] = []
    errors: list[BaseException] = []
    producing = threading.Semaphore(0)  # released once by each producer when done

    def produce(n: int) -> None:
        for i in range(each):
            coll.put("jobs", [b"%d-%d" % (n, i)])
            if i % 50 == 0:  # let the consumers catch up, so that they wait for the next
                wait_until(lambda: coll.queue("jobs").length == 0, "the consumers to catch up")
        producing.release()

    def consume() -> None:
        try:
            while True:
                finished = done_producing.is_set()  # before the remove: then an empty one is the end
                item = one(coll.remove("jobs", transaction=True, timeout=0.05))  # a wait that may time out
                if item is None:
                    if finished:
                        break
                    continue
                assert coll.confirm("jobs", [item.xid])
                with got_lock:
                    got.append(item.data)
            hubs.append(get_hub_if_exists())
        except BaseException as e:  # surfaced below: a thread's failure must fail the test
            errors.append(e)

    done_producing = threading.Event()

    def wait_for_producers() -> None:
        for _ in range(producers):
            producing.acquire()
        done_producing.set()

    threads = [threading.Thread(target=consume) for _ in range(consumers)]
    threads += [threading.Thread(target=produce, args=(n,)) for n in range(producers)]
    threads.append(threading.Thread(target=wait_for_producers))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors
    assert sorted(got) == sorted(b"%d-%d" % (n, i) for n in range(producers) for i in range(each))
    assert hubs == [None] * consumers
    q = coll.queue("jobs")
    assert (q.length, q.open_transactions, q.waiters) == (0, 0, 0)
    started = time.monotonic()
    assert one(coll.remove("empty", timeout=0.05)) is None  # a wait that times out
    assert time.monotonic() - started >= 0.05
    coll.close()
    again = QueueCollection(str(tmp_path), runtime=ThreadsRuntime())
    again.load()
    assert again.queue("jobs").length == 0  # everything confirmed is gone for good
    again.close()


def test_a_thread_waiting_for_an_item_is_woken_by_another_threads_add(tmp_path: Path) -> None:
    coll = QueueCollection(str(tmp_path), runtime=ThreadsRuntime())
    result: list[bytes | None] = []
    waiter = threading.Thread(target=lambda: result.append(getattr(one(coll.remove("q", timeout=10.0)), "data", None)))
    waiter.start()
    wait_until(lambda: coll.queue("q").waiters == 1, "the thread to wait")
    started = time.monotonic()
    coll.put("q", [b"hello"])
    waiter.join(timeout=30)
    # Woken by the add, not by its own time-out (how soon is bench/bench_responsiveness.py's figure).
    assert result == [b"hello"] and time.monotonic() - started < STALL_S
    coll.close()


class _CountingThreadsRuntime(ThreadsRuntime):
    """Plain threads whose locks count how often a change enters and leaves them."""

    def __init__(self) -> None:
        super().__init__()
        self.entered = self.left = 0

    def lock(self) -> Any:
        runtime, lock = self, threading.RLock()

        class Counted:
            def __enter__(self) -> None:
                runtime.entered += 1
                lock.acquire()

            def __exit__(self, *exc: object) -> None:
                runtime.left += 1
                lock.release()

            def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
                return lock.acquire(blocking, timeout)

            def release(self) -> None:
                lock.release()

        return Counted()


def test_every_change_enters_and_leaves_a_threads_runtime_s_lock(tmp_path: Path) -> None:
    """A queue skips only gevent's lock, which does nothing; a real one is taken by each change,
    also one that fails."""
    runtime = _CountingThreadsRuntime()
    coll = QueueCollection(str(tmp_path), QueueConfigs({}), runtime=runtime)
    coll.load()
    coll.put("q", [b"a"])  # creating the queue may take its lock for more than the change
    entered = runtime.entered
    coll.put("q", [b"b"])
    assert one(coll.remove("q")) is not None
    assert runtime.entered - entered >= 2 and runtime.entered == runtime.left
    queue = coll.queue("q")
    coll.close()
    before = runtime.entered
    with pytest.raises(QueueClosed):
        queue.put([b"c"], 0, 0)
    assert runtime.entered == runtime.left == before + 1


@pytest.mark.pure_build  # NoLock's methods are replaced, which compiled callers would not see
def test_a_change_under_gevent_makes_no_call_of_its_lock_that_does_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    coll = QueueCollection(str(tmp_path), QueueConfigs({}))
    coll.load()
    coll.put("q", [b"a"])  # the queue made (the collection's lock taken for it)
    calls: list[str] = []
    monkeypatch.setattr(NoLock, "__enter__", lambda self: calls.append("enter"))
    monkeypatch.setattr(NoLock, "__exit__", lambda self, *exc: calls.append("exit"))
    coll.put("q", [b"b"])
    assert one(coll.remove("q")) is not None and calls == []
    coll.close()


# ---------------------------------------------------------------------------------------------
# Manual time


def test_a_wait_times_out_when_the_clock_passes_its_deadline(tmp_path: Path) -> None:
    runtime = ManualRuntime()
    coll = QueueCollection(str(tmp_path), runtime=runtime)
    waiter = gevent.spawn(partial(coll.remove, "q", 1, False, 5.0))
    gevent.sleep(0)
    assert coll.queue("q").waiters == 1
    runtime.advance(4_999)
    gevent.sleep(0)
    assert not waiter.ready()
    runtime.advance(1)
    assert waiter.get(timeout=1) == []
    assert coll.queue("q").waiters == 0 and runtime.timers == 0
    coll.close()


def test_the_expiry_sweeper_runs_on_the_manual_timer(tmp_path: Path) -> None:
    runtime = ManualRuntime()
    coll = QueueCollection(str(tmp_path), runtime=runtime)
    coll.put("q", [b"short"], runtime.clock.now_ms() + 1_500)
    coll.put("q", [b"long"], runtime.clock.now_ms() + 60_000)
    coll.start_sweeper(1_000)
    runtime.advance(1_000)
    assert coll.queue("q").stats()["expired_items"] == 0
    runtime.advance(1_000)
    assert coll.queue("q").stats()["expired_items"] == 1 and coll.queue("q").length == 1
    coll.close()
    runtime.advance(10_000)  # the sweeper is stopped: nothing fires after close
    assert runtime.timers == 0


def test_periodic_fsync_comes_due_on_the_manual_timer(tmp_path: Path) -> None:
    runtime = ManualRuntime()
    coll = QueueCollection(str(tmp_path), QueueConfigs({"sync_journal": "100ms"}), runtime=runtime)
    coll.put("q", [b"one"])
    coll.put("q", [b"two"])
    writer = coll.queue("q")._journal.writer
    assert writer is not None
    # This journal's own figures: fsyncs of other tests' journals may run meanwhile in this process.
    assert writer.synced < writer.size and runtime.timers == 1  # one fsync covers both writes
    runtime.advance(99)
    assert writer.synced < writer.size
    runtime.advance(1)
    assert writer.synced == writer.size and runtime.timers == 0
    coll.close()


def _waiting(count: int, runtime: ManualRuntime | None = None) -> tuple[WaitList, list[Any], list[gevent.Greenlet]]:
    """A wait list, its items, and `count` readers waiting on it for one of them each."""
    waits = WaitList(runtime or ManualRuntime())
    items: list[Any] = []
    waiters = [gevent.spawn(partial(waits.wait, lambda: items.pop(0) if items else None, 10.0))
               for _ in range(count)]
    gevent.sleep(0)
    return waits, items, waiters


def test_wait_list_serves_waiters_first_come_first_and_ends_them(tmp_path: Path) -> None:
    waits, items, waiters = _waiting(3)
    assert len(waits) == 3
    items.append("a")
    assert waits.wake() == 1
    gevent.sleep(0)
    assert waiters[0].ready() and waiters[0].value == "a"
    waits.end()
    assert [w.get(timeout=1) for w in waiters[1:]] == [None, None]
    assert waits.wait(lambda: None, 10.0) is None and len(waits) == 0  # ended: no more waiting


def test_a_woken_waiter_that_finds_nothing_keeps_its_place() -> None:
    waits, items, waiters = _waiting(3)
    assert waits.wake() == 1  # the first, for an item another took
    gevent.sleep(0)
    items.append("a")
    assert waits.wake() == 1
    gevent.sleep(0)
    assert [w.ready() for w in waiters] == [True, False, False] and waiters[0].value == "a"
    waits.end()


class _CountingRuntime(ManualRuntime):
    """Counts the looks at its events' flags."""

    looks = 0

    def event(self) -> Any:
        event = super().event()
        is_set = event.is_set

        def look() -> bool:
            _CountingRuntime.looks += 1
            return is_set()

        event.is_set = look
        return event


def test_waking_many_readers_at_once_looks_at_each_once() -> None:
    """A put of N items to a queue with N waiting readers, and an abort returning N, wake N: each
    wake-up scanned from the longest-waiting reader past those woken before it (10,000 items to
    10,000 readers held the loop for a second)."""
    readers = 500
    waits, items, waiters = _waiting(readers, _CountingRuntime())
    _CountingRuntime.looks = 0
    items.extend(range(readers))
    assert waits.wake(readers) == readers and waits.wake() == 0
    gevent.joinall(waiters, timeout=5)
    assert sorted(w.value for w in waiters) == list(range(readers)) and len(waits) == 0
    assert _CountingRuntime.looks <= 2 * readers  # a scan per wake-up: readers² / 2


def test_readers_that_leave_unwoken_are_let_go_of() -> None:
    runtime = ManualRuntime()
    waits = WaitList(runtime)
    for _ in range(3):
        waiters = [gevent.spawn(partial(waits.wait, lambda: None, 1.0)) for _ in range(200)]
        gevent.sleep(0)
        runtime.advance(2000)
        gevent.joinall(waiters, timeout=5)
    assert len(waits) == 0 and len(waits._asleep) <= 64  # 600 left, none woken


def test_a_wake_up_that_comes_while_a_woken_waiter_looks_goes_to_the_next_waiter() -> None:
    runtime = ManualRuntime()
    waits = WaitList(runtime)
    items: list[str] = []

    def slow_look() -> str | None:
        """A look that lets others run (a queue's write gate), during which a second item comes."""
        if items and len(items) == 1:
            items.append("b")
            waits.wake()
            gevent.sleep(0)
        return items[0] if items else None

    first = gevent.spawn(partial(waits.wait, slow_look, 10.0))
    second = gevent.spawn(partial(waits.wait, lambda: items[-1] if len(items) == 2 else None, 10.0))
    gevent.sleep(0)
    items.append("a")
    waits.wake()
    gevent.joinall([first, second], timeout=1)
    assert first.value == "a" and second.value == "b"  # the second wake-up was not lost with the first


def test_a_woken_waiter_whose_look_is_cut_short_passes_its_wake_up_to_the_next_waiter() -> None:
    """A look may let others run (a queue's write gate) and end there, its client gone: the item it
    was woken for is still there, and the next waiter must not sleep beside it."""
    runtime = ManualRuntime()
    waits = WaitList(runtime)
    items: list[str] = []
    at_gate, gate = gevent.event.Event(), gevent.event.Event()

    def look_at_gate() -> str | None:
        if items:
            at_gate.set()
            gate.wait()
        return items[0] if items else None

    first = gevent.spawn(partial(waits.wait, look_at_gate, 10.0))
    second = gevent.spawn(partial(waits.wait, lambda: items[0] if items else None, 10.0))
    gevent.sleep(0)
    items.append("a")
    waits.wake()
    at_gate.wait(timeout=1)
    first.kill()  # as a hang-up is thrown into its wait
    gevent.joinall([second], timeout=1)
    assert second.value == "a" and len(waits) == 0


def test_threads_drain_a_backlog_through_read_behind_rotation_and_packing(tmp_path: Path) -> None:
    configs = QueueConfigs({}, {"q": {"max_memory_size": 4096, "default_journal_size": 2048}})
    coll = QueueCollection(str(tmp_path), configs, runtime=ThreadsRuntime())
    items = [b"item-%05d-" % n + b"x" * 50 for n in range(3000)]
    got: list[list[bytes]] = [[], []]

    def produce(part: list[bytes]) -> None:
        for data in part:
            coll.put("q", [data])

    behind: list[bool] = []

    def consume(mine: list[bytes]) -> None:
        while True:
            finished = not any(p.is_alive() for p in producers)  # before the remove: then empty is the end
            item = one(coll.remove("q", transaction=True, timeout=0.05))
            if item is None:
                if finished:
                    return
                continue
            behind.append(coll.queue("q").in_read_behind)
            mine.append(item.data)
            assert coll.confirm("q", [item.xid])

    producers = [threading.Thread(target=produce, args=(items[:1500],)),
                 threading.Thread(target=produce, args=(items[1500:],))]
    threads = [*producers, threading.Thread(target=consume, args=(got[0],)),
               threading.Thread(target=consume, args=(got[1],))]
    coll.put("q", [b"head-%d" % n for n in range(100)])  # the consumers start behind a backlog
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(d for d in got[0] + got[1] if d.startswith(b"item")) == items
    assert any(behind)  # the consumers drained a backlog in read-behind
    for mine in got:  # each consumer saw each producer's items in the order they were put
        for producer in (0, 1):
            seen = [d for d in mine if d.startswith(b"item") and (int(d[5:10]) < 1500) == (producer == 0)]
            assert seen == sorted(seen)
    q = coll.queue("q")
    q.wait_for_packing()
    assert q.length == 0 and not q.in_read_behind
    coll.close()
    again = QueueCollection(str(tmp_path), configs, runtime=ThreadsRuntime())
    again.load()
    assert again.queue("q").length == 0 and again.queue("q").open_transactions == 0
    again.close()


def test_a_timer_for_the_rest_of_a_wait_fires_at_the_waits_deadline() -> None:
    runtime = ManualRuntime()
    deadline = runtime.clock.monotonic() + 1.0
    runtime.advance(100)
    fired: list[int] = []
    runtime.call_later(deadline - runtime.clock.monotonic(), lambda: fired.append(runtime.clock.ms))
    runtime.advance(899)
    assert fired == []
    runtime.advance(1)
    assert fired == [runtime.clock.ms]


@pytest.mark.parametrize("timer", ["call_later", "loop_timer"])
def test_a_timer_set_after_work_without_the_loop_fires_no_earlier_than_asked(timer: str) -> None:
    """The loop's clock, read at its last iteration, is behind by the work done since; a call timed
    from it ran 0.3 s early here. The engine's timers (the runtime's, and the loop's own that the
    commit log gathers a round with) are timed from now."""
    gevent.sleep(0.01)  # an iteration of the loop: its clock read
    time.sleep(0.3)  # work without the loop (a replay, a busy iteration)
    fired = gevent.event.Event()
    started = time.monotonic()
    if timer == "call_later":
        GeventRuntime().call_later(0.2, fired.set)
    else:
        loop_timer(0.2).start(fired.set)
    assert fired.wait(STALL_S)
    assert time.monotonic() - started >= 0.2


@pytest.mark.parametrize("fails", [False, True])
def test_a_caller_killed_during_a_blocking_call_takes_its_outcome_then_the_kill(fails: bool) -> None:
    """The thread of `run_blocking` cannot be stopped, so its caller must not go on beside it (a
    journal's next append beside a large one still being written): a kill waits for the call. The
    caller then gets what the call returned or raised, which its state must follow, and the kill at
    its next wait."""
    runtime = GeventRuntime()
    started, release = threading.Event(), threading.Event()
    ended: list[str] = []
    seen: list[object] = []

    def call() -> str:
        started.set()
        release.wait(STALL_S)
        ended.append("call")
        if fails:
            raise OSError(errno.ENOSPC, "the call's own error")
        return "done"

    def caller_body() -> None:
        try:
            seen.append(runtime.run_blocking(call))
        except OSError as e:
            seen.append(e.errno)
        gevent.sleep(STALL_S)  # its next wait: the kill comes here
        seen.append("not killed")

    caller = gevent.spawn(caller_body)
    until_begun(started)
    caller.kill(block=False)
    gevent.sleep(0.2)
    assert not caller.dead, "the killed caller went on while its call still ran"
    release.set()
    caller.join(STALL_S)
    assert caller.dead and ended == ["call"]
    assert seen == [errno.ENOSPC if fails else "done"]
    assert isinstance(caller.value, gevent.GreenletExit)


def test_a_caller_killed_during_a_blocking_call_is_killed_before_its_next_one() -> None:
    """A caller making one blocking call after another (a queue's creation: an fsync each) takes
    the first call's outcome, then the kill as its next call would begin: that call is never made,
    where the kill, thrown into its wait, was held back again and the caller ran on through them all."""
    runtime = GeventRuntime()
    started, release = threading.Event(), threading.Event()
    calls: list[str] = []

    def first() -> None:
        started.set()
        release.wait(STALL_S)
        calls.append("first")

    def caller_body() -> None:
        runtime.run_blocking(first)
        runtime.run_blocking(calls.append, "second")
        calls.append("went on")

    caller = gevent.spawn(caller_body)
    until_begun(started)
    caller.kill(block=False)
    gevent.sleep(0.1)
    release.set()
    caller.join(STALL_S)
    assert caller.dead and isinstance(caller.value, gevent.GreenletExit)
    assert calls == ["first"]


@pytest.mark.parametrize("block_goes_on", [False, True])
def test_a_time_out_held_back_by_a_blocking_call_is_raised_inside_its_block_or_not_at_all(
        block_goes_on: bool) -> None:
    """A `gevent.Timeout` that fires while its block's call runs on the pool is held back, as a kill
    is, so that the caller takes the call's outcome. It is raised at the block's next wait, or, once
    its block has ended, never: thrown at the next wait past it, it escaped there as an error of
    whatever waited (the admin port's silent request time-out, out of the next request's read)."""
    runtime = GeventRuntime()
    started, release = threading.Event(), threading.Event()
    seen: list[object] = []

    def call() -> str:
        started.set()
        release.wait(STALL_S)
        return "done"

    def caller_body() -> None:
        with gevent.Timeout(0.01, False):  # silent: its block swallows it
            seen.append(runtime.run_blocking(call))
            if block_goes_on:
                gevent.sleep(STALL_S)  # its next wait: the time-out comes here
                seen.append("not timed out")
        seen.append("past the block")
        gevent.sleep(0.05)  # a wait past the block
        seen.append("went on")

    caller = gevent.spawn(caller_body)
    until_begun(started)
    gevent.sleep(0.1)  # the time-out fires meanwhile
    release.set()
    caller.join(STALL_S)
    assert caller.dead and caller.successful(), caller.exception
    assert seen == ["done", "past the block", "went on"]


def test_a_kill_held_back_with_a_time_out_is_raised_past_the_time_outs_block() -> None:
    """A kill outranks a time-out held back with it: the time-out's block ending drops the time-out,
    never the kill."""
    runtime = GeventRuntime()
    started, release = threading.Event(), threading.Event()
    seen: list[str] = []

    def call() -> None:
        started.set()
        release.wait(STALL_S)

    def caller_body() -> None:
        with gevent.Timeout(0.01, False):
            runtime.run_blocking(call)
        seen.append("past the block")
        gevent.sleep(STALL_S)
        seen.append("not killed")

    caller = gevent.spawn(caller_body)
    until_begun(started)
    gevent.sleep(0.1)  # the time-out fires
    caller.kill(block=False)
    gevent.sleep(0.05)
    release.set()
    caller.join(STALL_S)
    assert caller.dead and isinstance(caller.value, gevent.GreenletExit)
    assert seen == ["past the block"]


@pytest.mark.parametrize("runtime", [GeventRuntime(), ThreadsRuntime()], ids=["gevent", "threads"])
def test_side_by_side_returns_what_each_call_raised_a_kill_or_an_exit_too(runtime: Any) -> None:
    """Every call runs; what each raised comes back in the calls' order, whatever its kind: a
    BaseException (a kill, a crash of a test's) ended its task unseen, and the caller went on as if
    the call had returned (a delete cut off part way answered as done)."""
    ran: list[int] = []

    class Stop(BaseException):
        pass

    def call(index: int, error: BaseException | None) -> None:
        ran.append(index)
        if error is not None:
            raise error

    stop, failure = Stop(), OSError(errno.EIO, "disk")
    failed = side_by_side(runtime, [partial(call, 0, stop), partial(call, 1, None), partial(call, 2, failure)])
    assert sorted(ran) == [0, 1, 2] and failed == [stop, failure]


@pytest.mark.parametrize("runtime", [GeventRuntime(), ThreadsRuntime()], ids=["gevent", "threads"])
def test_all_side_by_side_raises_the_first_calls_failure_once_every_call_has_ended(runtime: Any) -> None:
    ran: list[int] = []

    def call(index: int, error: OSError | None) -> None:
        ran.append(index)
        if error is not None:
            raise error

    first, second = OSError(errno.EIO, "first"), OSError(errno.ENOSPC, "second")
    with pytest.raises(OSError) as raised:
        all_side_by_side(runtime, [partial(call, 0, None), partial(call, 1, first), partial(call, 2, second)])
    assert raised.value is first and sorted(ran) == [0, 1, 2]
    all_side_by_side(runtime, [partial(call, 3, None)])
    assert sorted(ran) == [0, 1, 2, 3]


@pytest.mark.parametrize("lock", [False, True], ids=["gevent", "threads"])
def test_one_at_a_time_runs_each_turn_after_the_one_under_way_even_one_that_failed(lock: bool) -> None:
    """The checkpoints of the commit log and the reloads of the settings take turns so: each
    caller's block begins only once the one before has ended, raised or not."""
    runtime = ThreadsRuntime() if lock else GeventRuntime()
    turns = OneAtATime(runtime, runtime.lock()) if lock else OneAtATime(runtime)
    inside: list[int] = []
    overlapped: list[int] = []

    def take(index: int) -> None:
        with turns.turn():
            if inside:
                overlapped.append(index)
            inside.append(index)
            runtime.sleep(0.02)  # the others look meanwhile
            inside.remove(index)
            if index == 0:
                raise OSError(errno.EIO, "the first turn fails")

    failed = side_by_side(runtime, [partial(take, index) for index in range(4)])
    assert [type(e) for e in failed] == [OSError] and overlapped == []
    turns.wait()  # none under way: returns at once
    assert not turns.running


@pytest.mark.parametrize("count", [0, 3, 500, 1000, 1010])
def test_a_paced_walk_yields_every_item_in_order_and_pauses_between_chunks_only(count: int) -> None:
    """A walk pauses after each `every` items that more follow, never before the first item nor
    after the last; what it walks may be any iterable (here a generator)."""
    runtime = ManualRuntime()
    seen: list[tuple[str, int]] = []
    runtime.pause = lambda: seen.append(("pause", len(seen)))  # type: ignore[method-assign]
    for item in paced((n for n in range(count)), runtime, every=500):
        seen.append(("item", item))
    assert [n for kind, n in seen if kind == "item"] == list(range(count))
    pauses = [i for i, (kind, _) in enumerate(seen) if kind == "pause"]
    assert pauses == [500 * k + k - 1 for k in range(1, (count - 1) // 500 + 1)]  # the k-th after 500k items


def test_a_blocking_call_reached_from_the_hub_runs_there_rather_than_never_end() -> None:
    """The hub cannot wait for a thread, whose outcome it alone would deliver: a call reached from a
    request answered in its callback (which the rule meant never to wait) ran the wait's loop
    forever, every port unanswered. It runs in place, and says so."""
    runtime = GeventRuntime()
    answered = gevent.event.AsyncResult()
    gevent.get_hub().loop.run_callback(lambda: answered.set(runtime.run_blocking(sum, (1, 2))))
    assert answered.get(timeout=STALL_S) == 3
    with pytest.raises(ZeroDivisionError):
        GeventRuntime().run_blocking(divmod, 1, 0)  # elsewhere, on the pool as before
