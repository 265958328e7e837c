"""Group commit: one fsync round for every journal waiting, issued concurrently, failures kept to
their own journal; native AIO and threads give the same answers."""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import resource
import time
import weakref
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import gevent
import gevent.event
import pytest

from kestrel.storage.fsync import aio_fsync
from kestrel.storage.fsync.aio_fsync import AioFsync
from kestrel.storage.fsync.eventfd import read_when_ready
from kestrel.storage.fsync.group_commit import (
    FsyncMany,
    GroupCommit,
    NativeThreadFsync,
    ThreadFsync,
    filesystem_sync,
    native_threads,
)
from kestrel.storage.fsync.syncfs import FilesystemSync, libc_syncfs, reports_errors
from kestrel.storage.journal_file import JournalWriter
from kestrel.storage.runtime import GeventRuntime, ThreadsRuntime
from tests.conftest import open_files_within
from tests.support.hub_leftovers import background_work_left, let_background_work_finish
from tests.support.threads import thread_files

T = TypeVar("T")


def naming_nothing() -> int:
    """A descriptor number that names nothing, far above the lowest free one (a number just closed
    is the next any thread of the process opens, and an fdatasync of it would then succeed): the
    highest free one under the process's limit, looked up, as the files a long run's worker holds
    open reach any fixed number."""
    for number in range(open_files_within(resource.getrlimit(resource.RLIMIT_NOFILE)[0]) - 1, 2, -1):
        try:
            os.fstat(number)
        except OSError:
            return number
    raise AssertionError("every descriptor number is in use")


class Journal:
    """A file being appended to, as a round sees it."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.size = 0
        self.synced = 0

    def append(self, data: bytes) -> int:
        os.write(self.fd, data)
        self.size += len(data)
        return self.size

    def hold(self) -> int:
        return self.fd

    def release(self) -> None:
        """(closed by the test, which knows when no round holds it)"""


class Syncable:
    """Something a round holds (a journal, a turn): only its lifetime matters."""


class Counting:
    """Records every round of fsyncs handed to the real way of issuing them."""

    def __init__(self, inner: FsyncMany) -> None:
        self.inner = inner
        self.rounds: list[list[int]] = []

    def fsync_all(self, fds: list[int]) -> list[OSError | None]:
        self.rounds.append(list(fds))
        return self.inner.fsync_all(fds)


def aio() -> AioFsync:
    made = AioFsync.create()
    if made is None:
        pytest.skip("this kernel or machine has no native AIO (the threads are tested alone)")
    return made


def c_threads() -> NativeThreadFsync:
    """The process's one handle on the C threads, once no round of an earlier test's (a queue it
    left behind may still sync, a killed waiter's round) holds them: a round the test begins before
    it next yields (`GroupCommit.join_now`) then begins on the loop. One begun by a callback of the
    loop (`join`) may find a leftover's round there first, and go to a runner greenlet."""
    found = native_threads()
    if found is None:
        pytest.skip("the C helper was not built (no C compiler at install time)")
    let_background_work_finish(10)
    assert not background_work_left() and not found.busy, "a round of an earlier test still holds the C threads"
    return found


@pytest.fixture(params=["aio", "threads", "c-threads"])
def fsync_many(request: pytest.FixtureRequest) -> Iterator[FsyncMany]:
    if request.param == "threads":
        yield ThreadFsync()
        return
    if request.param == "c-threads":
        yield c_threads()
        return
    made = aio()
    yield made
    made.close()


def test_journals_waiting_in_one_turn_share_one_round(tmp_path: Path, fsync_many: FsyncMany) -> None:
    counting = Counting(fsync_many)
    commit = GroupCommit(counting)
    journals = [Journal(tmp_path / f"q{i}") for i in range(8)]
    waiters = [gevent.spawn(partial(commit.sync, j, j.append(b"record"))) for j in journals]
    gevent.joinall(waiters, raise_error=True)
    assert len(counting.rounds) == 1 and sorted(counting.rounds[0]) == sorted(j.fd for j in journals)
    assert all(j.synced == j.size == 6 for j in journals)


def test_appends_during_a_round_wait_for_the_next(tmp_path: Path, fsync_many: FsyncMany) -> None:
    way = HeldRound(fsync_many, held=1)
    counting = Counting(way)
    commit = GroupCommit(counting)
    journal = Journal(tmp_path / "q")
    first = gevent.spawn(partial(commit.sync, journal, journal.append(b"one")))
    assert way.in_flight.wait(timeout=10)  # the round's fsync is under way
    second = gevent.spawn(partial(commit.sync, journal, journal.append(b"two")))
    gevent.sleep(0)
    way.go.set()
    gevent.joinall([first, second], raise_error=True)
    assert journal.synced == 6
    assert len(counting.rounds) == 2  # the second append was not covered by the first fsync


def test_appends_before_a_round_runner_takes_its_journals_join_that_round(
        tmp_path: Path, fsync_many: FsyncMany) -> None:
    """A round handed to a runner greenlet takes the journals' positions when the runner runs, a
    turn of the loop later: a change made meanwhile is covered by it, and waits for no round more
    (it went to the next, whose fsync found nothing new)."""
    counting = Counting(fsync_many)  # (no way of the C threads' own: the rounds go to a runner)
    commit = GroupCommit(counting)
    journal = Journal(tmp_path / "q")
    first = commit.join(journal)
    journal.append(b"one")
    gevent.sleep(0)  # the loop's callbacks: the round is claimed, its runner spawned, not yet run
    assert commit._running is first and not first.begun
    assert commit.join(journal) is first
    journal.append(b"two")
    first.wait()
    assert journal.synced == 6 and len(counting.rounds) == 1
    commit.sync(journal, 6)
    assert len(counting.rounds) == 1
    os.close(journal.fd)


def test_an_already_synced_position_waits_for_nothing(tmp_path: Path, fsync_many: FsyncMany) -> None:
    counting = Counting(fsync_many)
    commit = GroupCommit(counting)
    journal = Journal(tmp_path / "q")
    commit.sync(journal, journal.append(b"one"))
    commit.sync(journal, 3)
    assert len(counting.rounds) == 1


def test_what_waits_for_a_round_with_no_greenlet_is_called_after_its_fsync_before_the_next_round(
        tmp_path: Path, fsync_many: FsyncMany) -> None:
    """The commit log's way of waiting: no link on the round's event, a call where the round ends;
    a round it joins from there begins at once, and a call that fails leaves the others called."""
    counting = Counting(fsync_many)
    commit = GroupCommit(counting)
    journal = Journal(tmp_path / "q")
    seen: list[tuple[str, int, int]] = []
    ended = gevent.event.Event()

    def first() -> None:
        seen.append(("first", journal.synced, len(counting.rounds)))
        raise RuntimeError("a call that fails")

    def second() -> None:
        seen.append(("second", journal.synced, len(counting.rounds)))
        journal.append(b"two")
        commit.join(journal).after(ended.set)  # joined from the call: the next round

    journal.append(b"one")
    round_ = commit.join(journal)
    round_.after(first)
    round_.after(second)
    assert ended.wait(timeout=10)
    assert seen == [("first", 3, 1), ("second", 3, 1)]  # after the fsync covering "one", in order
    assert journal.synced == 6 and len(counting.rounds) == 2 and round_.ended


def test_a_round_on_the_c_threads_calls_what_waits_for_it_from_the_loop(tmp_path: Path) -> None:
    """Begun and ended on the loop (no greenlet runs rounds): the calls come after the fsync, and a
    round joined from one begins there too."""
    way = c_threads()
    commit = GroupCommit(way)
    journal = Journal(tmp_path / "q")
    seen: list[int] = []
    free: list[bool] = []
    ended = gevent.event.Event()

    def then() -> None:
        seen.append(journal.synced)
        journal.append(b"two")
        commit.join(journal).after(ended.set)
        # (an earlier test's greenlet may have taken the threads while this round ran: its next
        # round then goes to a runner greenlet, as it must)
        free.append(not way.busy)

    journal.append(b"one")
    commit.join_now([journal]).after(then)
    assert ended.wait(timeout=10)
    assert seen == [3] and journal.synced == 6 and (commit.runner is None) == free[0]


def test_a_call_that_holds_its_round_is_dropped_once_made_so_the_round_is_freed_by_reference_counting(
        tmp_path: Path) -> None:
    """The commit log's calls hold their round (and its turns, and the journals the round fsynced,
    a deleted queue's among them): kept after the round ran, each round would be a cycle that only a
    full collection frees, which the server keeps its loaded queues out of
    (src/kestrel/service/gc_pauses.py)."""
    commit = GroupCommit(c_threads())
    journal = Journal(tmp_path / "q")
    ended = gevent.event.Event()
    journal.append(b"one")
    round_ = commit.join(journal)
    held = Syncable()  # what the round holds, as the log's rounds hold their turns and journals
    round_.after(partial(lambda *_: ended.set(), round_, held))  # holds its round, as the log's do
    gone = weakref.ref(held)
    del round_, held
    gc.disable()  # only reference counting frees it
    try:
        assert ended.wait(timeout=10)
        gevent.sleep(0)  # the loop's callback that ended the round has returned
        assert gone() is None
    finally:
        gc.enable()


def test_a_failed_fsync_fails_only_the_waiters_of_its_journal(tmp_path: Path, fsync_many: FsyncMany) -> None:
    commit = GroupCommit(fsync_many)
    good = Journal(tmp_path / "good")
    bad = Journal(tmp_path / "bad")
    bad_position = bad.append(b"record")
    pipe = os.pipe()
    os.dup2(pipe[0], bad.fd)  # its fsync fails with EINVAL (a closed fd could be reused meanwhile)
    waiters = [gevent.spawn(partial(commit.sync, good, good.append(b"record"))),
               gevent.spawn(partial(commit.sync, bad, bad_position)), gevent.spawn(partial(commit.sync, bad, bad_position))]
    gevent.joinall(waiters)
    assert waiters[0].successful() and good.synced == 6
    for failed in waiters[1:]:
        assert isinstance(failed.exception, OSError) and failed.exception.errno == errno.EINVAL
        assert "fsync of " + bad.path in str(failed.exception)
    assert bad.synced == 0
    for fd in pipe:
        os.close(fd)


def test_journals_joined_now_begin_their_round_at_once_and_a_failed_fsync_fails_only_its_own(
        tmp_path: Path, fsync_many: FsyncMany) -> None:
    """`join_now` (the commit log's, once its turn has run) begins the round before the loop runs
    again; a journal joining later in the same turn waits for the round after."""
    commit = GroupCommit(fsync_many)
    good, closed, late = (Journal(tmp_path / name) for name in ("good", "closed", "late"))
    good_end, late_end = good.append(b"x"), late.append(b"z")
    closed.append(b"y")
    closed.fd = naming_nothing()  # its fdatasync fails with EBADF
    round_ = commit.join_now({good, closed})
    assert commit._running is round_  # claimed, with no callback of the loop queued for it
    # Begun on the C threads (their positions taken), a later journal waits for the next round;
    # handed to a runner greenlet, it joins this one, whose positions are taken when the runner runs.
    assert (commit.join(late) is round_) is not round_.begun
    ended = gevent.event.Event()
    round_.after(ended.set)
    assert ended.wait(timeout=10)
    assert good.synced == good_end and closed.synced == 0 and round_.failed[closed].errno == errno.EBADF
    assert good not in round_.failed
    commit.sync(late, late_end)
    assert late.synced == late_end
    os.close(good.fd)
    os.close(late.fd)


def test_aio_python_threads_and_c_threads_answer_alike(tmp_path: Path) -> None:
    native = aio()
    pipe = os.pipe()  # fsync of a pipe fails with EINVAL
    try:
        files = [Journal(tmp_path / f"q{i}") for i in range(3)]
        for j in files:
            j.append(b"x")
        fds = [files[0].fd, pipe[0], files[1].fd, files[2].fd]
        answers = [[None if e is None else e.errno for e in way.fsync_all(fds)]
                   for way in (native, ThreadFsync(), c_threads())]
        assert answers[0] == answers[1] == answers[2] == [None, errno.EINVAL, None, None]
    finally:
        native.close()
        for fd in pipe:
            os.close(fd)


def test_a_round_larger_than_the_aio_slots_is_issued_in_parts(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aio_fsync, "SLOTS", 4)
    native = aio()
    try:
        files = [Journal(tmp_path / f"q{i}") for i in range(10)]
        assert native.fsync_all([j.fd for j in files]) == [None] * 10
    finally:
        native.close()


def test_sync_always_journal_is_on_disk_before_append_returns(tmp_path: Path) -> None:
    writer = JournalWriter(str(tmp_path / "q"), 0)
    writer.open()
    writer.append(b"record")
    writer.commit()
    assert writer.synced == writer.size == 6
    writer.close()


class Broken:
    def fsync_all(self, fds: list[int]) -> list[OSError | None]:
        raise RuntimeError("a bug in the round")


def test_a_round_that_breaks_fails_its_waiters_instead_of_leaving_them_waiting(tmp_path: Path) -> None:
    commit = GroupCommit(Broken())
    journal = Journal(tmp_path / "q")
    with pytest.raises(OSError, match="group commit failed: RuntimeError"):
        commit.sync(journal, journal.append(b"record"))
    assert journal.synced == 0


def test_without_descriptors_for_aio_a_round_uses_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def out_of_descriptors() -> AioFsync:
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    monkeypatch.setattr(AioFsync, "create", out_of_descriptors)
    commit = GroupCommit(way="aio")
    journal = Journal(tmp_path / "q")
    commit.sync(journal, journal.append(b"record"))
    assert journal.synced == 6


@pytest.mark.parametrize("way", ["threads", "c-threads"])
def test_a_forked_child_syncs_with_threads_of_its_own(tmp_path: Path, way: str) -> None:
    commit = GroupCommit(ThreadFsync() if way == "threads" else c_threads())
    parent = Journal(tmp_path / "parent")
    commit.sync(parent, parent.append(b"before the fork"))  # the parent's thread now waits for work
    pid = os.fork()
    if pid == 0:  # the child: no work for the parent's absent thread (reinit as gevent's fork does)
        gevent.reinit()
        child = Journal(tmp_path / "child")
        waiter = gevent.spawn(partial(commit.sync, child, child.append(b"x")))
        waiter.join(timeout=10)
        os._exit(0 if waiter.successful() and child.synced == 1 else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def fsync_threads() -> list[int]:
    """The C helper's threads of this process (by the name it gives them)."""
    return [thread for thread, name in thread_files("self", "comm").items() if name.strip() == "kestrel-fsync"]


ONE_CPU = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: a round runs there anyway")


@contextlib.contextmanager
def round_in_flight(tmp_path: Path) -> Iterator[set[int]]:
    """A round of one journal handed to the C threads by this thread (the loop, to the helper) and
    collected when the block ends; the CPUs this thread could run on before it."""
    c_threads()
    from kestrel.storage.fsync._fsync_many import finish, start

    allowed = os.sched_getaffinity(0)
    journal = Journal(tmp_path / "q")
    journal.append(b"x")
    done = os.eventfd(0, os.EFD_CLOEXEC)
    start([journal.fd], done)
    try:
        yield allowed
    finally:
        os.eventfd_read(done)  # the round is over
        codes = finish()
        os.close(done)
    assert codes == [0]


@ONE_CPU
def test_a_round_on_the_c_threads_runs_on_the_loops_cpu_and_the_loop_gets_its_cpus_back(tmp_path: Path) -> None:
    """A hand-over between CPUs costs a wake-up across them each way: the round, the threads and
    the caller (the loop), run on the CPU the caller ran on, and the caller is free again after."""
    with round_in_flight(tmp_path) as allowed:
        bound = os.sched_getaffinity(0)
        threads = {thread: os.sched_getaffinity(thread) for thread in fsync_threads()}
    assert len(bound) == 1 and bound <= allowed
    assert threads and all(cpus == bound for cpus in threads.values()), (bound, threads)
    assert os.sched_getaffinity(0) == allowed


@ONE_CPU
def test_a_child_forked_during_a_round_runs_where_the_loop_could_before_it(tmp_path: Path) -> None:
    with round_in_flight(tmp_path) as allowed:
        pid = os.fork()
        if pid == 0:
            os._exit(0 if os.sched_getaffinity(0) == allowed else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child stayed bound to the round's CPU"
    assert os.sched_getaffinity(0) == allowed


@ONE_CPU
def test_a_round_runs_on_the_cpu_preferred_where_the_loop_may_run_there(tmp_path: Path) -> None:
    """The CPU that takes the disk's completions (`completion_cpu`), named to the helper: the round
    and the loop go there, wherever the loop ran; a CPU the loop may not run on is passed over."""
    native = c_threads()
    allowed = os.sched_getaffinity(0)
    try:
        for cpu in sorted(allowed):
            native.prefer(cpu)
            (tmp_path / str(cpu)).mkdir()
            with round_in_flight(tmp_path / str(cpu)):
                bound = os.sched_getaffinity(0)
                threads = {thread: os.sched_getaffinity(thread) for thread in fsync_threads()}
            assert bound == {cpu} and all(cpus == {cpu} for cpus in threads.values()), (cpu, threads)
            assert os.sched_getaffinity(0) == allowed
        os.sched_setaffinity(0, {min(allowed)})  # the loop may no longer run on the CPU preferred
        native.prefer(max(allowed))
        (tmp_path / "barred").mkdir()
        with round_in_flight(tmp_path / "barred"):
            assert os.sched_getaffinity(0) == {min(allowed)}
    finally:
        native.prefer(-1)
        os.sched_setaffinity(0, allowed)
    with pytest.raises(ValueError, match="not a CPU"):
        native.prefer(-2)


def test_rounds_go_to_the_cpu_preferred_only_where_they_run_on_the_c_threads() -> None:
    native = c_threads()
    try:
        assert GroupCommit().run_rounds_on(0)
        assert not GroupCommit(way="aio").run_rounds_on(0)
        assert not GroupCommit(ThreadFsync()).run_rounds_on(0)
    finally:
        native.prefer(-1)


class GeventWithItsOwnRounds(GeventRuntime):
    """The server's runtime, its journals in rounds of a group commit of their own: the process's
    shared one also takes the journals other tests left syncing in the background (a rotated
    file sealed late), which would join these rounds."""

    def __init__(self, commit: GroupCommit) -> None:
        super().__init__()
        self.commit = commit

    def group_commit(self) -> GroupCommit | None:
        return self.commit


def test_queues_with_sync_always_share_rounds_across_journals(tmp_path: Path) -> None:
    """The server's path: puts to eight queues in one turn are acknowledged after one round."""
    from kestrel.storage import QueueCollection, QueueConfigs

    counting = Counting(ThreadFsync())
    runtime = GeventWithItsOwnRounds(GroupCommit(counting))
    coll = QueueCollection(str(tmp_path), QueueConfigs({"sync_journal": "always"}), runtime=runtime)
    coll.load()
    for i in range(8):
        coll.put(f"q{i}", [b"first"])  # each queue's journal is open and synced before the turn
    counting.rounds.clear()
    puts = [gevent.spawn(partial(coll.put, f"q{i}", [b"second"])) for i in range(8)]
    gevent.joinall(puts, raise_error=True)
    assert all(put.value for put in puts)
    assert len(counting.rounds) == 1 and len(counting.rounds[0]) == 8
    coll.close()


class RuntimeWithItsOwnRounds(ThreadsRuntime):
    """Any runtime may name the group commit its journals share."""

    def __init__(self, commit: GroupCommit) -> None:
        super().__init__()
        self.commit = commit

    def group_commit(self) -> GroupCommit | None:
        return self.commit


def test_a_journal_syncs_through_the_group_commit_its_runtime_names(tmp_path: Path) -> None:
    counting = Counting(ThreadFsync())
    writer = JournalWriter(str(tmp_path / "q"), 0, RuntimeWithItsOwnRounds(GroupCommit(counting)))
    writer.append(b"x")
    writer.commit()
    assert writer.synced == 1 and counting.rounds == [[writer.fd]]
    writer.close()


def test_a_runtime_without_a_group_commit_syncs_each_journal_alone(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from kestrel.storage.fsync.group_commit import shared

    counting = Counting(ThreadFsync())
    monkeypatch.setattr(shared(), "_fsync_many", counting)
    writer = JournalWriter(str(tmp_path / "q"), 0, ThreadsRuntime())
    writer.append(b"x")
    writer.commit()
    assert writer.synced == 1 and counting.rounds == []
    writer.close()


class HeldRound:
    """Rounds through `inner`, but for the round numbered `held` (1: the first), whose fsyncs are
    issued only once `go` is set, as a thread's may be late under load: in flight until then."""

    def __init__(self, inner: FsyncMany, held: int) -> None:
        self.inner = inner
        self.held = held
        self.rounds = 0
        self.in_flight = gevent.event.Event()
        self.go = gevent.event.Event()

    def fsync_all(self, fds: list[int]) -> list[OSError | None]:
        self.rounds += 1
        if self.rounds == self.held:
            self.in_flight.set()
            self.go.wait()
        return self.inner.fsync_all(fds)


def still_names(fd: int, path: str) -> bool:
    """Whether descriptor `fd` is open on the file at `path`."""
    try:
        held = os.fstat(fd)
    except OSError:
        return False
    on_disk = os.stat(path)
    return (held.st_dev, held.st_ino) == (on_disk.st_dev, on_disk.st_ino)


def test_a_journal_closed_while_a_round_fsyncs_it_keeps_its_descriptor_until_then(tmp_path: Path) -> None:
    """A journal closed unsynced (a file about to be deleted) while a round's fsync of it is in
    flight on a thread: closed under it, that fsync failed with EBADF and its waiters with it (the
    queue read-only), or fsynced another file that took the number."""
    way = HeldRound(ThreadFsync(), held=1)
    commit = GroupCommit(way)
    writer = JournalWriter(str(tmp_path / "q"), 0, GeventWithItsOwnRounds(commit))
    writer.append(b"a")
    waiter = gevent.spawn(partial(commit.sync, writer, writer.size))
    assert way.in_flight.wait(timeout=10)
    fd = writer.fd
    writer.close(sync=False)
    assert writer.fd == -1 and still_names(fd, writer.path)
    way.go.set()
    waiter.join(timeout=10)
    assert waiter.successful() and writer.synced == 1
    assert not still_names(fd, writer.path)  # closed once the round had run


def test_a_journal_closed_fully_synced_while_its_round_waits_to_begin_is_not_failed_by_it(
        tmp_path: Path) -> None:
    """A commit log segment retired by a checkpoint (its records are in their journals) is closed
    while the log's round for it waits behind the round in flight: nothing of it is left to fsync."""
    way = HeldRound(ThreadFsync(), held=1)
    commit = GroupCommit(way)
    other = Journal(tmp_path / "other")
    other.append(b"x")
    commit.join_now([other])
    assert way.in_flight.wait(timeout=10)
    writer = JournalWriter(str(tmp_path / "segment"), 0, GeventWithItsOwnRounds(commit))
    writer.append(b"record")
    waiting = commit.join_now([writer])  # behind the round in flight
    writer.synced = writer.size
    writer.close()
    way.go.set()
    waiting.wait()
    assert writer not in waiting.failed
    commit.sync(writer, writer.size)  # returns at once
    os.close(other.fd)


class ThreadsOnCue:
    """The C helper's `start` and `finish`, its threads' fdatasyncs made when the test says (`run`),
    the round in flight until then; its end told through the eventfd, as the threads tell it."""

    def __init__(self) -> None:
        self.fds: list[int] = []
        self.eventfd = -1
        self.codes: list[int] = []

    def start(self, fds: list[int], eventfd: int, syncfs: bool) -> None:
        self.fds, self.eventfd = list(fds), eventfd

    def run(self) -> None:
        self.codes = []
        for fd in self.fds:
            try:
                os.fdatasync(fd)
                self.codes.append(0)
            except OSError as e:
                self.codes.append(e.errno or errno.EIO)
        os.eventfd_write(self.eventfd, 1)

    def finish(self) -> list[int]:
        return self.codes


def test_a_journal_closed_while_a_round_begun_on_the_loop_fsyncs_it_is_closed_once_the_round_has_run(
        tmp_path: Path) -> None:
    """The C helper's threads are handed the descriptor when the round begins; a close meanwhile
    (a file closed unsynced, to be deleted) leaves it open to them until the round has run."""
    threads = ThreadsOnCue()
    way = NativeThreadFsync(threads.start, threads.finish, lambda cpu: None)
    try:
        commit = GroupCommit(way)
        writer = JournalWriter(str(tmp_path / "q"), 0, GeventWithItsOwnRounds(commit))
        writer.append(b"record")
        round_ = commit.join_now([writer])
        assert threads.fds == [writer.fd]  # on the threads
        fd = writer.fd
        writer.close(sync=False)
        assert writer.fd == -1 and still_names(fd, writer.path)
        threads.run()
        round_.wait()
        assert writer not in round_.failed and writer.synced == 6
        assert not still_names(fd, writer.path)
    finally:
        if way._ending is not None:
            way._ending.stop()
        os.close(way._eventfd)


class ClosingDuringBlockingCalls(ThreadsRuntime):
    """Plain threads, where the journal is closed (by another thread, say) as its fsync begins."""

    def __init__(self) -> None:
        super().__init__()
        self.writer: JournalWriter | None = None

    def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        if self.writer is not None:
            self.writer.close(sync=False)
        return fn(*args)


def test_a_journal_synced_alone_keeps_its_descriptor_open_for_its_fsync(tmp_path: Path) -> None:
    runtime = ClosingDuringBlockingCalls()
    writer = JournalWriter(str(tmp_path / "q"), 0, runtime)
    writer.append(b"record")
    fd = writer.fd
    runtime.writer = writer
    writer.sync_to(writer.size)
    assert writer.synced == 6 and writer.fd == -1 and not still_names(fd, writer.path)


# ---------------------------------------------------------------------------------------------
# Rounds as one syncfs of the file system (src/kestrel/storage/fsync/syncfs.py)


class SyncfsCalls:
    """Rounds of syncfs that record the descriptors they were given and answer `code` (0 or an errno)."""

    def __init__(self, code: int = 0) -> None:
        self.code = code
        self.fds: list[int] = []

    def __call__(self, fds: list[int]) -> list[OSError | None]:
        self.fds += fds
        return [OSError(self.code, os.strerror(self.code)) if self.code else None for _ in fds]


class FailingFor:
    """One fdatasync a journal, failing with EIO for the descriptors in `bad`."""

    def __init__(self, bad: set[int]) -> None:
        self.bad = bad
        self.rounds: list[list[int]] = []

    def fsync_all(self, fds: list[int]) -> list[OSError | None]:
        self.rounds.append(list(fds))
        return [OSError(errno.EIO, "Input/output error") if fd in self.bad else None for fd in fds]


def test_a_round_of_journals_on_one_file_system_is_one_syncfs(tmp_path: Path) -> None:
    each, syncfs = FailingFor(set()), SyncfsCalls()
    commit = GroupCommit(FilesystemSync(each, syncfs))
    journals = [Journal(tmp_path / f"q{i}") for i in range(8)]
    waiters = [gevent.spawn(partial(commit.sync, j, j.append(b"record"))) for j in journals]
    gevent.joinall(waiters, raise_error=True)
    assert len(syncfs.fds) == 1 and each.rounds == []
    assert all(j.synced == 6 for j in journals)


def test_a_round_of_one_journal_keeps_its_fdatasync(tmp_path: Path) -> None:
    each, syncfs = FailingFor(set()), SyncfsCalls()
    commit = GroupCommit(FilesystemSync(each, syncfs))
    journal = Journal(tmp_path / "q")
    commit.sync(journal, journal.append(b"record"))
    assert syncfs.fds == [] and each.rounds == [[journal.fd]]


def test_journals_on_other_file_systems_are_fsynced_each(tmp_path: Path) -> None:
    journals = [Journal(tmp_path / f"q{i}") for i in range(3)]
    each, syncfs = FailingFor(set()), SyncfsCalls()
    elsewhere = journals[2].fd
    commit = GroupCommit(FilesystemSync(each, syncfs, device=lambda fd: 2 if fd == elsewhere else 1))
    gevent.joinall([gevent.spawn(partial(commit.sync, j, j.append(b"record"))) for j in journals], raise_error=True)
    assert syncfs.fds == [] and sorted(each.rounds[0]) == sorted(j.fd for j in journals)


def test_a_failed_syncfs_fails_only_the_journals_whose_own_fsync_fails(tmp_path: Path) -> None:
    journals = [Journal(tmp_path / f"q{i}") for i in range(4)]
    each, syncfs = FailingFor({journals[1].fd}), SyncfsCalls(errno.EIO)
    commit = GroupCommit(FilesystemSync(each, syncfs))
    waiters = [gevent.spawn(partial(commit.sync, j, j.append(b"record"))) for j in journals]
    gevent.joinall(waiters)
    assert len(syncfs.fds) == 1 and len(each.rounds) == 1  # the syncfs, then each journal's own
    assert [w.successful() for w in waiters] == [True, False, True, True]
    assert isinstance(waiters[1].exception, OSError) and waiters[1].exception.errno == errno.EIO
    assert [j.synced for j in journals] == [6, 0, 6, 6]


def test_syncfs_is_trusted_only_where_the_kernel_reports_its_errors() -> None:
    assert not reports_errors("5.4.0-150-generic")
    assert not reports_errors("4.19.0")
    assert reports_errors("5.8.0")
    assert reports_errors("6.18.44-fc-v669")
    assert not reports_errors("unknown")


def syncfs_ways() -> dict[str, Callable[[list[int]], list[OSError | None]]]:
    """How a syncfs round can be issued here: on the C helper's threads and on Python threads."""
    syncfs = libc_syncfs()
    if syncfs is None:
        pytest.skip("this kernel does not report writeback errors through syncfs (Linux before 5.8)")
    ways = {"python threads": ThreadFsync(syncfs).fsync_all}
    native = native_threads()
    if native is not None:
        ways["c threads"] = native.syncfs_all
    return ways


def test_a_real_syncfs_round_syncs_real_journals(tmp_path: Path) -> None:
    made = filesystem_sync(ThreadFsync())
    assert made is not None or libc_syncfs() is None
    if made is None:
        pytest.skip("this kernel does not report writeback errors through syncfs (Linux before 5.8)")
    journals = [Journal(tmp_path / f"q{i}") for i in range(4)]
    commit = GroupCommit(made)
    gevent.joinall([gevent.spawn(partial(commit.sync, j, j.append(b"record"))) for j in journals], raise_error=True)
    assert [j.synced for j in journals] == [6] * 4
    native = native_threads()
    if native is not None:  # the server's rounds: on the C helper's threads, as its fdatasyncs
        assert made._syncfs == native.syncfs_all


def test_syncfs_on_c_threads_and_python_threads_answer_alike(tmp_path: Path) -> None:
    ways = syncfs_ways()  # first: the C threads' eventfd, if made now, takes the lowest free number
    journal = Journal(tmp_path / "q")
    journal.append(b"record")
    closed = naming_nothing()
    answers = {}
    for name, syncfs_all in ways.items():
        results = syncfs_all([journal.fd, closed, journal.fd])
        answers[name] = [None if r is None else r.errno for r in results]
    assert answers["python threads"] == [None, errno.EBADF, None]
    assert len(set(map(tuple, answers.values()))) == 1, answers


def test_the_server_rounds_use_syncfs_only_when_told() -> None:
    if libc_syncfs() is None:
        pytest.skip("this kernel does not report writeback errors through syncfs (Linux before 5.8)")
    assert not isinstance(GroupCommit()._fsync_many, FilesystemSync)
    assert isinstance(GroupCommit(way="syncfs")._fsync_many, FilesystemSync)


def test_a_c_thread_round_whose_waiter_was_killed_does_not_block_the_next(tmp_path: Path) -> None:
    way = c_threads()
    journals = [Journal(tmp_path / f"q{i}") for i in range(3)]
    for j in journals:
        j.append(b"record")
    waiter = gevent.spawn(partial(way.fsync_all, [j.fd for j in journals]))
    gevent.sleep(0)  # the round is handed to the threads; its waiter waits for the eventfd
    waiter.kill()
    assert way.fsync_all([journals[0].fd]) == [None]  # the abandoned round is collected first


class HangsOnce:
    """A way of fsyncing whose first round never ends by itself."""

    def __init__(self) -> None:
        self.rounds = 0

    def fsync_all(self, fds: list[int]) -> list[OSError | None]:
        self.rounds += 1
        if self.rounds == 1:
            gevent.event.Event().wait()
        return [None] * len(fds)


def test_a_killed_round_runner_leaves_no_waiter_waiting_for_good(tmp_path: Path) -> None:
    way = HangsOnce()
    commit = GroupCommit(way)
    journal = Journal(tmp_path / "q")
    waiter = gevent.spawn(partial(commit.sync, journal, journal.append(b"one")))
    deadline = time.monotonic() + 30  # polled with gevent's sleep: the round runs in this loop's turns
    while not way.rounds and time.monotonic() < deadline:
        gevent.sleep(0.001)
    assert way.rounds == 1 and commit.runner is not None
    commit.runner.kill()
    waiter.join(timeout=5)
    assert waiter.successful() and journal.synced == 3 and way.rounds == 2  # synced by a round of its own


def test_c_threads_without_an_eventfd_use_python_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def out_of_descriptors(initval: int, flags: int = 0) -> int:
        raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))

    monkeypatch.setattr(os, "eventfd", out_of_descriptors)
    shared = c_threads()
    way = NativeThreadFsync(shared._start, shared._finish, shared.prefer)  # a handle made with no descriptor left
    journal = Journal(tmp_path / "q")
    journal.append(b"record")
    assert way.fsync_all([journal.fd, -5])[0] is None
    assert way.fsync_all([-5])[0] is not None  # a bad descriptor is still named, by the threads
    # A syncfs round cannot go to the C threads: it fails, and the journals are fdatasynced each.
    (refused,) = way.syncfs_all([journal.fd])
    assert refused is not None and refused.errno == errno.EMFILE
    journals = [journal, Journal(tmp_path / "r")]
    commit = GroupCommit(FilesystemSync(way, way.syncfs_all))
    gevent.joinall([gevent.spawn(partial(commit.sync, j, j.append(b"more"))) for j in journals], raise_error=True)
    assert [j.synced for j in journals] == [10, 4]


def test_an_unknown_fsync_way_is_named_in_the_log(capsys: pytest.CaptureFixture[str]) -> None:
    commit = GroupCommit(way="syncfss")
    assert not isinstance(commit._fsync_many, FilesystemSync)
    logged = capsys.readouterr()
    assert "unknown KESTREL_FSYNC value" in logged.out + logged.err and "syncfss" in logged.out + logged.err


def test_c_thread_rounds_of_two_group_commits_at_once_each_get_their_own_results(tmp_path: Path) -> None:
    way = c_threads()
    good = Journal(tmp_path / "good")
    closed = Journal(tmp_path / "closed")
    closed.fd = naming_nothing()  # its fdatasync fails with EBADF
    good.append(b"x")
    first = gevent.spawn(partial(way.fsync_all, [good.fd, closed.fd]))
    second = gevent.spawn(partial(way.fsync_all, [good.fd]))
    gevent.joinall([first, second], raise_error=True)
    assert first.value[0] is None and first.value[1] is not None and first.value[1].errno == errno.EBADF
    assert second.value == [None]


def test_a_round_waiting_when_the_process_forks_does_not_take_the_childs_results(tmp_path: Path) -> None:
    way = c_threads()
    parent = Journal(tmp_path / "parent")
    parent.append(b"x")
    for _ in range(100):  # a round that ended during the loop's turn below is not in flight: again
        leftover = gevent.spawn(partial(way.fsync_all, [parent.fd]))  # still waiting for its eventfd at the fork
        gevent.sleep(0)
        if not leftover.ready():
            break
    assert not leftover.ready(), "no round was still in flight at the fork in 100 tries"
    pid = os.fork()
    if pid == 0:
        gevent.reinit()
        child = Journal(tmp_path / "child")
        child.append(b"y")
        mine = gevent.spawn(partial(way.fsync_all, [child.fd]))
        mine.join(timeout=10)
        leftover.join(timeout=1)
        # Each way to fail exits with its own code, which the parent names.
        os._exit(2 if not mine.ready() else 3 if not mine.successful() else 4 if mine.value != [None]
                 else 5 if leftover.successful() else 0)
    leftover.join(timeout=10)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    assert code == 0, {1: "the child raised", 2: "the child's round never ended", 3: "the child's round failed",
                       4: "the child's round returned another's results",
                       5: "the parent's round ended in the child"}.get(code, code)
    assert leftover.successful() and leftover.value == [None]  # the parent's round is the parent's


def test_an_eventfd_is_read_once_above_zero_and_a_wake_up_that_finds_it_at_zero_waits_again() -> None:
    fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
    try:
        os.eventfd_write(fd, 3)
        assert read_when_ready(fd, lambda: pytest.fail("waited with the counter above zero")) == 3

        waits = []

        def wait() -> None:  # the first wake-up is spurious; the round ends during the second wait
            waits.append(1)
            if len(waits) == 2:
                os.eventfd_write(fd, 5)

        assert read_when_ready(fd, wait) == 5
        assert len(waits) == 2

        def forked() -> None:
            raise OSError(errno.EIO, "forked")

        os.eventfd_write(fd, 1)
        with pytest.raises(OSError, match="forked"):  # the check comes before the read
            read_when_ready(fd, wait, forked)
        assert os.eventfd_read(fd) == 1
    finally:
        os.close(fd)


def test_a_round_on_the_c_threads_runs_with_no_greenlet_and_fails_only_its_own_journal(tmp_path: Path) -> None:
    way = c_threads()
    commit = GroupCommit(way)
    good, closed = Journal(tmp_path / "good"), Journal(tmp_path / "closed")
    good_end, closed_end = good.append(b"x"), closed.append(b"y")
    closed.fd = naming_nothing()  # its fdatasync fails with EBADF
    commit.join_now([good, closed])  # the round the waiters find in flight
    waiters = [gevent.spawn(partial(commit.sync, good, good_end)), gevent.spawn(partial(commit.sync, closed, closed_end))]
    gevent.joinall(waiters)
    assert commit.runner is None  # handed out on the loop, ended by the eventfd's watcher
    assert waiters[0].successful() and good.synced == good_end
    error = waiters[1].exception
    assert isinstance(error, OSError) and error.errno == errno.EBADF and closed.synced == 0


def test_a_waiting_round_and_a_round_with_no_waiter_on_the_c_threads_take_turns(tmp_path: Path) -> None:
    way = c_threads()
    commit = GroupCommit(way)
    journals = [Journal(tmp_path / f"q{i}") for i in range(3)]
    ends = [j.append(b"record") for j in journals]
    commit.join_now([journals[0]])
    assert way._then is not None  # the commit's round is on the threads, its end awaited by the watcher
    assert way.busy and not way.begin([journals[1].fd], lambda errors: None)  # one round at a time
    logged = gevent.spawn(partial(commit.sync, journals[0], ends[0]))
    assert way.fsync_all([journals[1].fd, journals[2].fd]) == [None, None]  # after it, with its own results
    logged.join(timeout=10)
    assert logged.successful() and journals[0].synced == ends[0] and commit.runner is None and not way.busy


def test_a_greenlet_waiting_for_the_c_threads_is_not_passed_over_by_rounds_begun_on_the_loop(
        tmp_path: Path) -> None:
    """A round with no waiter that ends hands out the next at once, on the loop, as a busy commit
    log's do; a greenlet's round waiting for the threads goes before it all the same."""
    way = c_threads()
    commit = GroupCommit(way)
    logged, other = Journal(tmp_path / "logged"), Journal(tmp_path / "other")
    ended = []

    def next_round() -> None:
        ended.append(logged.synced)
        if len(ended) < 50:
            logged.append(b"x")
            commit.join_now([logged]).after(next_round)

    logged.append(b"x")
    commit.join_now([logged]).after(next_round)
    assert way._then is not None  # begun on the loop, its end awaited by the watcher
    other.append(b"y")
    assert way.fsync_all([other.fd]) == [None]
    assert len(ended) == 1  # the round in flight ended; the log's next waited for this one
    with gevent.Timeout(30, AssertionError("the log's rounds did not all run")):
        while len(ended) < 50:
            gevent.sleep(0.01)
    assert ended == list(range(1, 51))
    for journal in (logged, other):
        os.close(journal.fd)


def test_a_round_with_no_waiter_when_the_process_forks_fails_in_the_child(tmp_path: Path) -> None:
    way = c_threads()
    commit = GroupCommit(way)
    parent = Journal(tmp_path / "parent")
    for _ in range(100):  # until a round is still on the threads when the process forks
        end = parent.append(b"x")
        leftover = gevent.spawn(partial(commit.sync, parent, end))
        while commit._running is None:  # until the round is on the threads, its end awaited by the watcher
            gevent.sleep(0)
        if way._then is not None:  # its results not yet collected: nothing yields from here to the fork
            break
        leftover.join(timeout=10)  # it ended before the fork, on a busy machine: a success the child may see
    else:
        pytest.fail("no round was still on the threads after 100 tries")
    pid = os.fork()
    if pid == 0:
        gevent.reinit()
        leftover.join(timeout=10)
        child = Journal(tmp_path / "child")
        mine = gevent.spawn(partial(way.fsync_all, [child.append(b"y") and child.fd]))
        mine.join(timeout=10)
        os._exit(2 if not leftover.ready() else 3 if leftover.successful() else
                 4 if not mine.ready() or mine.value != [None] else 0)
    leftover.join(timeout=10)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    assert code == 0, {2: "the parent's round left its waiter waiting in the child",
                       3: "the parent's round ended well in the child",
                       4: "the child's own round failed"}.get(code, code)
    assert leftover.successful() and parent.synced == end


def test_a_greenlet_queued_for_the_c_threads_when_the_process_forks_fails_in_the_child(tmp_path: Path) -> None:
    """At the fork, one greenlet holds the threads' turn (waiting for a round begun on the loop) and
    another waits for the turn. In the child both are the parent's: neither may run a round on the
    child's threads, which the child's own rounds take turns for."""
    way = c_threads()
    commit = GroupCommit(way)
    logged, first, second = (Journal(tmp_path / name) for name in ("logged", "first", "second"))
    for _ in range(100):  # until the round begun on the loop is still on the threads at the fork
        for journal in (logged, first, second):
            journal.append(b"x")
        commit.join_now([logged]).after(lambda: None)  # a round begun on the loop, no greenlet waiting
        holder = gevent.spawn(partial(way.fsync_all, [first.fd]))
        queued = gevent.spawn(partial(way.fsync_all, [second.fd]))
        gevent.sleep(0)  # the holder takes the turn and waits; the other waits for the turn
        if way._then is not None and way._turn.locked() and not queued.ready():
            break
        gevent.joinall([holder, queued], timeout=10)
    else:
        pytest.fail("no round was still on the threads with both greenlets waiting, in 100 tries")
    pid = os.fork()
    if pid == 0:
        gevent.reinit()
        gevent.joinall([holder, queued], timeout=10)
        child = Journal(tmp_path / "child")
        mine = gevent.spawn(partial(way.fsync_all, [child.append(b"w") and child.fd]))
        mine.join(timeout=10)
        forked = [isinstance(g.exception, OSError) and "forked" in str(g.exception) for g in (holder, queued)]
        os._exit(2 if not (holder.ready() and queued.ready()) else 3 if not forked[0] else
                 4 if not forked[1] else 5 if not mine.ready() or mine.value != [None] else 0)
    gevent.joinall([holder, queued], timeout=10)
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    assert code == 0, {2: "a parent's greenlet was left waiting in the child",
                       3: "the turn's holder did not fail as a parent's round in the child",
                       4: "the greenlet queued for the turn did not fail as a parent's round in the child",
                       5: "the child's own round failed"}.get(code, code)
    assert holder.value == [None] and queued.value == [None]  # the parent's rounds are the parent's
    for journal in (logged, first, second):
        os.close(journal.fd)


def test_rounds_begun_on_the_loop_keep_one_watcher_started_that_holds_the_loop_only_while_one_runs(
        tmp_path: Path) -> None:
    native = c_threads()
    group = GroupCommit(native)
    journal = Journal(tmp_path / "j")
    watchers = []
    for _ in range(3):  # each round alone: nothing else keeps the loop running while it waits
        group.sync(journal, journal.append(b"x"))
        watchers.append(native._ending)
        assert watchers[-1] is not None and watchers[-1].active  # not stopped: no epoll_ctl a round
        assert not watchers[-1].ref  # an idle server's loop is not held by it
    assert journal.synced == 3 and len({id(w) for w in watchers}) == 1  # one watcher, started once
    os.close(journal.fd)
