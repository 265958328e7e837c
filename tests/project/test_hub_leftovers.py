"""The suite's check that a test leaves no work of the engine on the gevent hub
(tests/support/hub_leftovers.py, applied to every test by tests/conftest.py)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import gevent
import gevent.event
import pytest

from kestrel.storage.fsync.group_commit import native_threads
from kestrel.storage.runtime import DEFAULT_RUNTIME
from tests.support.hub_leftovers import clock_at_now, let_background_work_finish, no_hub_leftovers
from tests.support.queues import open_collection

ALWAYS = {"sync_journal": "always"}


def test_a_commit_log_left_open_is_named_and_its_tick_cancelled(tmp_path: Path) -> None:
    with pytest.raises(AssertionError, match=f"CommitLog CommitLog._tick on {tmp_path}"):
        with no_hub_leftovers():
            coll = open_collection(tmp_path, ALWAYS, commit_log=True)
    assert coll.commit_log is not None and coll.commit_log._timer is not None
    assert not coll.commit_log._timer._timer.active, "the tick left is still armed"  # type: ignore[attr-defined]
    coll.close()


def test_a_sweeper_left_running_names_its_collection(tmp_path: Path) -> None:
    coll = open_collection(tmp_path)
    # The pure build names the collection's path too; a closure mypyc compiled keeps it out of reach.
    with pytest.raises(AssertionError, match="QueueCollection.*tick|tick.*QueueCollection"):
        with no_hub_leftovers():
            coll.start_sweeper(60_000)
    coll.close()


def test_a_collection_closed_leaves_nothing(tmp_path: Path) -> None:
    with no_hub_leftovers():
        coll = open_collection(tmp_path, ALWAYS, commit_log=True)
        coll.start_sweeper(60_000)
        coll.put("q", [b"x"])
        coll.close()


def test_a_round_whose_waiter_was_killed_is_collected_so_the_next_begins_on_the_loop(tmp_path: Path) -> None:
    """Left, it sends every later round to a runner greenlet until some greenlet's round collects it."""
    native = native_threads()
    if native is None:
        pytest.skip("the C helper was not built (no C compiler at install time)")
    let_background_work_finish()
    fd = os.open(tmp_path / "journal", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        # What a greenlet's round leaves when its waiter is killed before it reads the eventfd (a
        # kill that wins that race is not made on demand: the fsync may end first).
        if native._watcher is None:  # made by the process's first greenlet round
            native._watcher = gevent.get_hub().loop.io(native._eventfd, 1)
        native._start([fd], native._eventfd, False)
        native._abandoned = True
        assert not native.begin([fd], lambda errors: None)
        let_background_work_finish()
        ended = gevent.event.Event()
        assert not native._abandoned and native.begin([fd], lambda errors: ended.set())
        assert ended.wait(timeout=10)
    finally:
        os.close(fd)


def test_work_a_test_spawned_and_the_loop_did_not_run_yet_is_run_before_the_next_test() -> None:
    """A rotated journal's seal spawned by a test's last put would otherwise write its manifest in
    the next test, through the fakes that test patched in (a full disk it simulates)."""
    ran: list[str] = []
    with no_hub_leftovers():
        DEFAULT_RUNTIME.spawn(lambda: ran.append("sealed"))
    assert ran == []
    let_background_work_finish()
    assert ran == ["sealed"]


def test_work_a_test_spawned_that_does_not_end_is_killed_and_named() -> None:
    never = gevent.event.Event()

    def waits_for_ever() -> None:
        never.wait()

    with no_hub_leftovers():
        task = DEFAULT_RUNTIME.spawn(waits_for_ever)
    with pytest.raises(AssertionError, match="did not end within 0 s: .*waits_for_ever"):
        let_background_work_finish(0.05)
    assert task.greenlet.dead  # type: ignore[attr-defined]


def test_a_test_starts_on_the_loops_clock_at_now() -> None:
    """A clock left behind by work done without the loop times the next timers from the past; the
    clock brought to now times them from now (without it, the call 0.2 s later ran at once)."""
    gevent.sleep(0.01)  # an iteration of the loop: its clock read
    time.sleep(0.3)  # work without the loop, as between two tests
    clock_at_now()
    started = time.monotonic()
    gevent.spawn_later(0.2, lambda: None).join()  # (`gevent.sleep` brings the clock to now itself)
    assert time.monotonic() - started >= 0.2
