"""Timers a test leaves on the gevent hub: the work of a collection, commit log, journal or server
state it never closed (a checkpoint tick, a periodic sync, a sweep, the memory governor's run); and
the work a test's last calls left running off the loop or spawned on it, let finish before the
next test.

Each test process has one hub: a timer left there runs in whatever test comes next, whenever that
test yields, and a later test that counts greenlets, switches or objects, or needs the hub idle,
fails depending on which tests ran before it. `conftest.py` records the timers the engine sets on
gevent (`GeventRuntime.call_later`) while a test runs, and after
it cancels those still pending and fails the test, naming whose work they were."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import gevent
from gevent._hub_local import get_hub_if_exists

from kestrel.storage import runtime
from kestrel.storage.fsync import group_commit


class _Recorder:
    """The loop timers set, and the greenlets spawned, by the engine during the current test; one
    for the process, patched in once. It keeps the loop's watcher alone: a watcher that ran or was
    stopped drops its callback, so nothing the test made is kept alive by being recorded."""

    def __init__(self) -> None:
        self.watchers: list[Any] = []
        original = runtime.GeventRuntime.call_later

        def call_later(self_: runtime.GeventRuntime, seconds: float, fn: Callable[[], None]) -> runtime.Timer:
            timer = original(self_, seconds, fn)
            if len(self.watchers) >= PRUNE_AT:
                self.watchers = [w for w in self.watchers if w.active]
            self.watchers.append(timer._timer)  # type: ignore[attr-defined]
            return timer

        runtime.GeventRuntime.call_later = call_later  # type: ignore[method-assign, assignment]
        # Each greenlet with whose work it is, named at once: holding the work itself would keep
        # what it belongs to alive after it ran (a deleted queue whose freeing a test checks).
        self.spawned: list[tuple[gevent.Greenlet[Any, Any], str]] = []
        start = runtime.GeventRuntime.spawn

        def spawned(self_: runtime.GeventRuntime, fn: Callable[[], None]) -> runtime.Task:
            task = start(self_, fn)
            if len(self.spawned) >= PRUNE_AT:
                self.spawned = self.running()
            self.spawned.append((task.greenlet, describe(fn)))  # type: ignore[attr-defined]
            return task

        runtime.GeventRuntime.spawn = spawned  # type: ignore[method-assign, assignment]

    def pending(self) -> list[Any]:
        """The timers recorded still armed: their `_LoopTimer`s."""
        return [w.callback.__self__ for w in self.watchers if w.active]

    def running(self) -> list[tuple[gevent.Greenlet[Any, Any], str]]:
        """The greenlets recorded not done yet (those not started yet included), with whose work."""
        return [(greenlet, name) for greenlet, name in self.spawned if not greenlet.dead]


PRUNE_AT = 4096  # recorded watchers (or greenlets) past which those done are dropped (a test may set millions)
_RECORDER: _Recorder | None = None


def describe(fn: Callable[[], None]) -> str:
    """Whose work a timer's call is: the method and the queue path of the object it belongs to
    (bound methods, and closures such as the collection's sweep)."""
    owner = getattr(fn, "__self__", None)
    if owner is None:
        cells = [c.cell_contents for c in getattr(fn, "__closure__", None) or ()]
        owner = next((c for c in cells if hasattr(c, "path") or hasattr(c, "queue_path")), None)
    # A closure compiled by mypyc has neither: its class names it and its function's class
    # (`tick_start_sweeper_QueueCollection_obj`), and what it closes over is out of reach.
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    if owner is None:
        return str(name)
    path = getattr(owner, "queue_path", None) or getattr(owner, "path", None)
    return f"{type(owner).__name__} {name}" + (f" on {path}" if path else "")


def clock_at_now() -> None:
    """Bring the hub's clock to now. The loop reads the time once an iteration and times each timer
    from that reading: whatever ran since its last iteration without it (pytest between tests, a
    teardown that waited on a process) leaves it behind, and a timer set before the test first
    yields fires that much early in real time (a 0.5 s `spawn_later` ran at once after a stale
    0.5 s, and a test of idle time-outs saw its reply go out before the wait began)."""
    hub = get_hub_if_exists()
    if hub is not None:
        hub.loop.update_now()


@contextmanager
def no_hub_leftovers() -> Iterator[None]:
    """Around one test: AssertionError naming the timers it left pending (cancelled first, so that
    the next test starts on a quiet hub). The test starts on the loop's clock at now
    (`clock_at_now`)."""
    clock_at_now()
    global _RECORDER
    if _RECORDER is None:
        _RECORDER = _Recorder()
    recorder = _RECORDER
    outer, recorder.watchers = recorder.watchers, []
    recorder.spawned = []
    try:
        yield
    finally:
        left = recorder.pending()
        recorder.watchers = outer
        for timer in left:
            timer.cancel()
    if left:
        names = sorted({describe(timer._fn) for timer in left})
        raise AssertionError("the test left work on the gevent hub: close what it opened (with "
                             "contextlib.closing, or in a fixture's teardown): " + "; ".join(names))


BACKGROUND_WAIT_S = 30.0  # the longest a test's background work is waited for after it


def background_work_left() -> bool:
    """Whether the hub's threadpool has a call running or queued, or the group commit's C threads a
    round (one begun on the loop, or a greenlet's holding their turn)."""
    hub = get_hub_if_exists()
    pool = getattr(hub, "_threadpool", None) if hub is not None else None
    native = group_commit._native  # (never made here: a process that did not use them has none)
    return bool(pool is not None and len(pool)) or (
        native is not None and (native._then is not None or native._turn.locked()))


def let_background_work_finish(seconds: float = BACKGROUND_WAIT_S) -> None:
    """After a test, let the work its last calls left off the loop, or spawned on it and not run yet,
    finish (a closed Kestrel 3 queue's deletion of the files its readers passed, a pack, a
    read-behind read, an fsync round, a rotated journal's seal into the manifest, a log line): run
    into the next test, that work adds calls to those it counts (the same file names, the same
    clock), writes through the fakes it patched in, or holds the C threads its round expects free.
    About one test in ten leaves some; it is the engine's own, finishing after a close or beside a
    collection left to the process's end, so it is waited for, not failed. What is still running
    at the deadline is killed, and named."""
    deadline = time.monotonic() + seconds
    running = _RECORDER.running() if _RECORDER is not None else []
    while (background_work_left() or running) and time.monotonic() < deadline:
        gevent.sleep(0.001)
        running = [(greenlet, name) for greenlet, name in running if not greenlet.dead]
    collect_abandoned_round()
    if running:
        gevent.killall([greenlet for greenlet, _ in running], timeout=1.0)
        raise AssertionError(f"the test left work that did not end within {seconds:.0f} s: "
                             + "; ".join(sorted({name for _, name in running})))


def collect_abandoned_round() -> None:
    """A round of the C threads whose waiting greenlet was killed (a server's, at its stop) is
    collected by the next greenlet's round; until then no round is begun on the loop, each going to
    a runner greenlet instead. Collected here, so that a test expecting the loop's rounds is not
    handed another test's leftover."""
    native = group_commit._native
    if native is not None and native._abandoned and not native._turn.locked():
        with native._turn:
            if native._abandoned:
                native._wait_and_finish()
