"""The concurrency runtime the storage engine asks for what it needs, so that it can be swapped.

As kazoo's handlers do: the engine spawns work, schedules timers, waits on events, takes locks and
runs blocking calls (fsync, packing) through one `Runtime`, never through gevent or threading
directly. `GeventRuntime` (the default) serves the server; `ThreadsRuntime` serves programs that
embed the engine with plain threads and no gevent hub; `ManualRuntime` drives timers and timed
waits from a `FakeClock`, so that tests of expiry, waits, auto-abort and periodic fsync never sleep.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from functools import partial
from types import TracebackType
from typing import Any, Protocol, TypeVar

import gevent
import gevent.event
import structlog
from greenlet import getcurrent, greenlet

from kestrel.storage import disk
from kestrel.storage.clock import SYSTEM_CLOCK, Clock, FakeClock
from kestrel.storage.fsync import group_commit
from kestrel.storage.fsync.group_commit import GroupCommit
from kestrel.storage.no_lock import NO_LOCK

log = structlog.get_logger("kestrel.runtime")

T = TypeVar("T")

PACE = 500  # items a walk over every queue takes between two pauses (a few milliseconds of work)
PAUSE_S = 1e-6  # a pause on gevent: a timer due at once, run in the loop's next turn


class Event(Protocol):
    """A flag that waiters block on until it is set (threading.Event's interface)."""

    def set(self) -> None: ...

    def clear(self) -> None: ...

    def is_set(self) -> bool: ...

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the flag is set or `timeout` seconds pass; whether it is set."""
        ...


class Task(Protocol):
    """Work started by `spawn`."""

    def join(self) -> None: ...


class Timer(Protocol):
    """A call scheduled by `call_later`."""

    def cancel(self) -> None:
        """Do not make the call (if it has not started)."""
        ...


class Lock(Protocol):
    """A reentrant lock, used in `with`; `acquire(blocking=False)` takes it only if that needs no
    wait (the memory governor pages out another queue from inside a change only so: no deadlock)."""

    def __enter__(self) -> Any: ...

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> Any: ...

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool: ...

    def release(self) -> None: ...


class Runtime(Protocol):
    """What the storage engine needs from a concurrency model."""

    clock: Clock
    # Its tasks take turns on one thread: work that walks every queue pauses for the others (`paced`),
    # and a change is never interleaved by another (gevent); threads are preempted instead.
    shares_one_thread: bool

    def spawn(self, fn: Callable[[], None]) -> Task: ...

    def call_later(self, seconds: float, fn: Callable[[], None]) -> Timer: ...

    def event(self) -> Event: ...

    def lock(self) -> Lock: ...

    def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a blocking call (fsync, a pack) without stopping the other tasks. Returns or raises
        what the call did, once it has ended, even when the caller is killed meanwhile: the kill
        reaches the caller at its next wait, once it has dealt with the call's outcome (a time-out
        only if that wait is inside the time-out's block)."""
        ...

    def sleep(self, seconds: float) -> None: ...

    def pause(self) -> None:
        """Let the other tasks run, then go on (no time passes on a manual clock)."""
        ...

    def group_commit(self) -> GroupCommit | None:
        """The fsync rounds every journal shares (`src/kestrel/storage/fsync/group_commit.py`), or None: then
        the writers of one journal share that journal's next fsync."""
        ...


def side_by_side(runtime: Runtime, calls: Iterable[Callable[[], None]]) -> list[BaseException]:
    """Run each of `calls` in a task of `runtime`, and wait for them all; returns what each raised,
    in their order (nothing: an empty list), a kill or an exit too: left to end its task, it was
    lost to the caller, which went on as if the call had returned. Their waits overlap (the final
    fsyncs of a close share one round of the group commit, or take a thread each), where made in
    turn each waited for the one before. A kill of the caller ends its wait, not the calls."""
    failed: list[tuple[int, BaseException]] = []

    def make(index: int, call: Callable[[], None]) -> None:
        try:
            call()
        except BaseException as e:
            failed.append((index, e))

    tasks = [runtime.spawn(partial(make, index, call)) for index, call in enumerate(calls)]
    for task in tasks:
        task.join()
    return [e for _, e in sorted(failed, key=lambda pair: pair[0])]


def all_side_by_side(runtime: Runtime, calls: Iterable[Callable[[], None]]) -> None:
    """`side_by_side`, raising what the first of `calls` to fail raised once every one has ended."""
    failed = side_by_side(runtime, calls)
    if failed:
        raise failed[0]


def paced(items: Iterable[T], runtime: Runtime, every: int = PACE) -> Iterable[T]:
    """`items`, with a pause for the runtime's other tasks after every `every` of them where the
    tasks share one thread: a walk over 10,000 queues (the figures of the stats) would otherwise hold
    the loop for tens of milliseconds. Threads need none: `items` as they are."""
    return _paced(items, runtime, every) if runtime.shares_one_thread else items


def _paced(items: Iterable[T], runtime: Runtime, every: int) -> Iterator[T]:
    """Taken a chunk at a time, so that an item costs the walk one step of the generator (a plan of
    10,000 queues walks them three times)."""
    iterator = iter(items)
    chunk = list(itertools.islice(iterator, every))
    while chunk:
        yield from chunk
        chunk = list(itertools.islice(iterator, every))
        if chunk:
            runtime.pause()


class OneAtATime:
    """Work of which one runs at a time (a checkpoint of the commit log, a reload of the queue
    settings): a caller that finds one under way waits for it to end, then takes its own `turn`.
    Given a lock (tasks that are threads), the look and the claim are one step."""

    def __init__(self, runtime: Runtime, lock: Lock = NO_LOCK) -> None:
        self._runtime = runtime
        self._lock = lock
        self._running: Event | None = None  # set once the turn under way has ended

    @property
    def running(self) -> bool:
        return self._running is not None

    def wait(self) -> None:
        """Return once no turn is under way."""
        while (running := self._running) is not None:
            running.wait()

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """Wait for the turn under way, if any, and run the `with` block as the next."""
        while True:
            with self._lock:
                running = self._running
                if running is None:
                    done = self._running = self._runtime.event()
                    break
            running.wait()
        try:
            yield
        finally:
            self._running = None
            done.set()


# ---------------------------------------------------------------------------------------------
# gevent


class _Greenlet:
    def __init__(self, greenlet: gevent.Greenlet[Any, Any]) -> None:
        self.greenlet = greenlet

    def join(self) -> None:
        self.greenlet.join()

    def cancel(self) -> None:
        self.greenlet.kill(block=False)


class _LoopTimer:
    """A call that a timer of the loop starts in a greenlet of its own once it is due. No greenlet
    exists before: one that is cancelled (a round of the commit log that gathered its changes before
    its timer, an auto-abort of a read confirmed in time) costs only the timer, where killing a
    greenlet that never ran cost an exception. Timed from now (`group_commit.loop_timer`)."""

    __slots__ = ("_timer", "_fn", "_greenlet")

    def __init__(self, seconds: float, fn: Callable[[], None]) -> None:
        self._fn = fn
        self._greenlet: gevent.Greenlet[Any, Any] | None = None
        self._timer = group_commit.loop_timer(seconds)
        self._timer.start(self._due)

    def _due(self) -> None:
        self._greenlet = gevent.spawn(self._fn)

    def cancel(self) -> None:
        self._timer.stop()
        if self._greenlet is not None:
            self._greenlet.kill(block=False)  # due, not yet run: it does not start


class GeventRuntime:
    """Greenlets on gevent's hub; blocking calls on the hub's threadpool. Locks are no-ops: a
    greenlet is never preempted, and the engine does not yield inside a change."""

    shares_one_thread = True

    def __init__(self, clock: Clock = SYSTEM_CLOCK) -> None:
        self.clock = clock

    def spawn(self, fn: Callable[[], None]) -> Task:
        return _Greenlet(gevent.spawn(fn))

    def call_later(self, seconds: float, fn: Callable[[], None]) -> Timer:
        return _LoopTimer(seconds, fn)

    def event(self) -> Event:
        event: Event = gevent.event.Event()
        return event

    def lock(self) -> Lock:
        return NO_LOCK

    def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        me = getcurrent()
        held = _held(me)
        if held is not None:  # the call before held a kill back: this call is the next wait it is for
            raise held
        hub = gevent.get_hub()
        if me is hub:
            # Reached from a request answered in the hub's callback, which its rule meant never to
            # wait (`PersistentQueue.never_waits`): the hub cannot wait for a thread, whose outcome
            # it alone would deliver, so the call runs here and holds the loop for its length.
            self.spawn(partial(log.warning, "a blocking call ran on the event loop: a request answered "
                               "in the hub needed the disk", call=getattr(fn, "__qualname__", repr(fn))))
            return fn(*args)
        # The pool reports a call's exception itself, as a bare traceback on stderr, before the
        # caller gets it: hand it back as a value, so that only the caller's structured log says it.
        call = hub.threadpool.spawn(partial(_outcome, fn, args))
        # Meanwhile the loop's journal writes give the interpreter's lock up, so that the call's
        # Python runs beside them (src/kestrel/storage/_disk.c).
        disk.workers(1)
        # A kill (or a time-out) thrown into the caller meanwhile waits for the call to end: the
        # thread cannot be stopped, and a caller that went on would race it (a journal's next append
        # beside a large one still being written, a file closed under a write). It is then thrown
        # again at the caller's next wait, as gevent's kill reaches a greenlet that is running: the
        # caller first takes the call's outcome, which its state must follow (a journal's append
        # written whole is counted, one that failed is cut back and its change undone), where
        # raising the kill instead left the journal's size, its ids or a torn tail unaccounted. A
        # next wait that is itself a `run_blocking` raises it before its call begins: thrown into
        # that call's wait, it was held back again, and a caller making one call after another (a
        # queue's creation, an fsync each) ran them all and went on, killed at no wait. A time-out
        # (a `with gevent.Timeout(...)` block around the call) is armed again, pending until its
        # block's end closes it, and raised only while it is (`_held`): raised past its block, it
        # escaped as an error of whatever waited next.
        thrown: BaseException | None = None
        while not call.ready():
            try:
                call.wait()
            except BaseException as e:
                if thrown is None or isinstance(thrown, gevent.Timeout):  # a kill outranks a time-out
                    thrown = e
        disk.workers(-1)
        if thrown is not None:
            if isinstance(thrown, gevent.Timeout) and not thrown.pending:
                thrown.start()
            _held_kills[me] = thrown
            hub.loop.run_callback(_throw, me)
        ok, value = call.get()
        if not ok:
            raise value
        result: T = value
        return result

    def sleep(self, seconds: float) -> None:
        gevent.sleep(seconds)

    def pause(self) -> None:
        # Until the loop's next turn, which serves the sockets that are ready first: `sleep(0)`
        # would resume before the loop looks at them, and `idle()` only once none is.
        gevent.sleep(PAUSE_S)

    def group_commit(self) -> GroupCommit | None:
        return group_commit.shared()  # its rounds run on the hub


# The kill (or time-out) a `run_blocking` call held back, by caller, until the caller's next wait.
_held_kills: dict[greenlet, BaseException] = {}


def _held(waiter: greenlet) -> BaseException | None:
    """The kill or time-out a `run_blocking` call held back for `waiter`, taken: a time-out only
    while it is pending, armed again by that call (its `with` block has not ended: gevent's
    `Timeout.__exit__` closes it), and then disarmed, to be raised now; None where there is none or
    its block has ended."""
    error = _held_kills.pop(waiter, None)
    if isinstance(error, gevent.Timeout):
        if not error.pending:
            return None
        error.cancel()
    return error


def _throw(waiter: greenlet) -> None:
    """The kill held back for `waiter` thrown into it, unless its next `run_blocking` raised it
    already, it has ended meanwhile (it did not wait again) or it is a time-out whose block has
    ended (`_held`)."""
    error = _held(waiter)
    if error is not None and not waiter.dead:
        waiter.throw(error)


def _outcome(fn: Callable[..., T], args: tuple[Any, ...]) -> tuple[bool, Any]:
    """(True, what `fn(*args)` returned) or (False, the exception it raised)."""
    try:
        return True, fn(*args)
    except Exception as e:
        return False, e


# ---------------------------------------------------------------------------------------------
# Plain threads


class _Thread:
    def __init__(self, fn: Callable[[], None]) -> None:
        self.thread = threading.Thread(target=fn, daemon=True)
        self.thread.start()

    def join(self) -> None:
        self.thread.join()


class _ThreadTimer:
    def __init__(self, seconds: float, fn: Callable[[], None]) -> None:
        self.timer = threading.Timer(seconds, fn)
        self.timer.daemon = True
        self.timer.start()

    def cancel(self) -> None:
        self.timer.cancel()


class ThreadsRuntime:
    """Plain threads, for programs that embed the engine without gevent: daemon threads, timer
    threads, real reentrant locks; blocking calls run in the calling thread."""

    shares_one_thread = False

    def __init__(self, clock: Clock = SYSTEM_CLOCK) -> None:
        self.clock = clock

    def spawn(self, fn: Callable[[], None]) -> Task:
        return _Thread(fn)

    def call_later(self, seconds: float, fn: Callable[[], None]) -> Timer:
        return _ThreadTimer(seconds, fn)

    def event(self) -> Event:
        return threading.Event()

    def lock(self) -> Lock:
        return threading.RLock()

    def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        return fn(*args)

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def pause(self) -> None:
        time.sleep(0)

    def group_commit(self) -> GroupCommit | None:
        return None  # the group commit's rounds need gevent's hub


# ---------------------------------------------------------------------------------------------
# Manual time, for tests


class _ManualTimer:
    def __init__(self, due_ms: int, fn: Callable[[], None]) -> None:
        self.due_ms = due_ms
        self.fn = fn
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class _ManualEvent:
    """An event whose timed waits end when the manual clock passes their deadline."""

    def __init__(self, runtime: ManualRuntime) -> None:
        self._runtime = runtime
        self._flag = False
        self._wakers: list[Event] = []
        self._guard = threading.Lock()

    def set(self) -> None:
        with self._guard:
            self._flag = True
            wakers = list(self._wakers)
        for waker in wakers:
            waker.set()

    def clear(self) -> None:
        self._flag = False

    def is_set(self) -> bool:
        return self._flag

    def wait(self, timeout: float | None = None) -> bool:
        waker = self._runtime.base.event()
        with self._guard:
            if self._flag:
                return True
            self._wakers.append(waker)
        timer = self._runtime.call_later(timeout, waker.set) if timeout is not None else None
        try:
            waker.wait()
        finally:
            with self._guard:
                self._wakers.remove(waker)
            if timer is not None:
                timer.cancel()
        return self._flag


class ManualRuntime:
    """Tasks, locks and blocking calls from `base`; time from a FakeClock that only `advance`
    moves. Timers fire, and timed waits end, inside `advance`, in deadline order."""

    def __init__(self, base: Runtime | None = None, clock: FakeClock | None = None) -> None:
        self.base: Runtime = base if base is not None else GeventRuntime()
        self.clock: FakeClock = clock if clock is not None else FakeClock()
        self.shares_one_thread = self.base.shares_one_thread
        self._timers: list[tuple[int, int, _ManualTimer]] = []
        self._order = itertools.count()
        self._guard = threading.Lock()

    def spawn(self, fn: Callable[[], None]) -> Task:
        return self.base.spawn(fn)

    def call_later(self, seconds: float, fn: Callable[[], None]) -> Timer:
        # Rounded to the microsecond before the ceiling: a wait's rest (its deadline less now, in
        # float seconds near the epoch) is off by a fraction of a microsecond, not by a millisecond.
        timer = _ManualTimer(self.clock.ms + math.ceil(round(max(seconds, 0.0) * 1000.0, 3)), fn)
        with self._guard:
            heapq.heappush(self._timers, (timer.due_ms, next(self._order), timer))
        return timer

    def event(self) -> Event:
        return _ManualEvent(self)

    def lock(self) -> Lock:
        return self.base.lock()

    def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        return self.base.run_blocking(fn, *args)

    def sleep(self, seconds: float) -> None:
        self.event().wait(seconds)

    def pause(self) -> None:
        self.base.pause()

    def group_commit(self) -> GroupCommit | None:
        return None  # a round starts after the hub's turn, in real time: each journal syncs alone

    @property
    def timers(self) -> int:
        """Timers scheduled and not yet fired or cancelled."""
        return sum(1 for _, _, timer in self._timers if not timer.cancelled)

    def advance(self, ms: int) -> None:
        """Move the clock `ms` forward, firing every timer that comes due on the way, in order."""
        end = self.clock.ms + ms
        while True:
            with self._guard:
                if not self._timers or self._timers[0][0] > end:
                    break
                due, _, timer = heapq.heappop(self._timers)
            if timer.cancelled:
                continue
            self.clock.ms = max(self.clock.ms, due)
            timer.fn()
        self.clock.ms = end


DEFAULT_RUNTIME = GeventRuntime()
