"""Group commit across journals: one fsync round at a time for every journal with unsynced records.

A writer that must wait for the disk (`sync_journal: always`, rotation, shutdown) asks for its
journal to be in the next round and waits for that round. A round starts once the event-loop turn
that asked for it has run (so every change made in that turn joins it), or at once for a caller
whose turn has run already (the commit log's, `join_now`), and fdatasyncs its
journals concurrently: the file system joins concurrent fsyncs into one commit of its own journal,
where fsyncs issued one after another each wait for a commit. They are issued on threads kept for
it, one per journal in the round: C threads from `src/kestrel/storage/fsync/_fsync_many.c` when it was built
(the interpreter lock is not taken by them at all), else Python threads. With `KESTREL_FSYNC=aio` they
go through Linux native AIO instead (`src/kestrel/storage/fsync/aio_fsync.py`: one system call, no thread, far
less CPU; but the kernel's shared workers run those fsyncs, and on a machine whose CPUs are
oversubscribed they wait for a turn far longer than our own threads do). With `KESTREL_FSYNC=syncfs` a
round of two or more journals on one file system is one syncfs instead (`src/kestrel/storage/fsync/syncfs.py`:
one commit of the file system for the whole round, on the same threads), where the kernel reports its
errors.
On the C threads a round needs no greenlet: it is handed out by a callback on the loop and ends in
the callback of the eventfd's watcher, which tells its waiters and hands out the next round (other
ways, and a round the C threads cannot take at once, run in a greenlet that waits for them); and on
Linux it runs on one CPU, the loop's or the one that takes the disk's completions (`run_rounds_on`),
the loop bound there until it collects the round (`_fsync_many.c`).
Requests that arrive while a round runs go into the next one. A journal whose fsync fails fails
exactly the waiters whose records that round covered; the other journals of the round are unaffected.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any, Protocol

import gevent
import gevent.event
import gevent.lock
import structlog
from gevent import monkey

from kestrel.storage.fsync import FsyncMany
from kestrel.storage.fsync.aio_fsync import AioFsync, AioUnsupported
from kestrel.storage.fsync.eventfd import read_when_ready
from kestrel.storage.fsync.syncfs import FilesystemSync, libc_syncfs

log = structlog.get_logger("kestrel.journal")

# Real OS threads and locks, also where gevent has patched the thread module into greenlets.
_start_new_thread, _allocate_lock = monkey.get_original("_thread", ["start_new_thread", "allocate_lock"])

# Threads issuing a round's fsyncs: one per journal in the round keeps them concurrent; beyond this
# many journals, the rest of a round waits for a free thread.
MAX_THREADS = 64
# How rounds are issued (`KESTREL_FSYNC` for the server; see the module's doc): "" for fdatasyncs on
# threads, `aio` for native AIO, `syncfs` for one syncfs a round of several journals.
FSYNC_WAYS = ("", "aio", "syncfs")


class Syncable(Protocol):
    """What a round needs of a journal: its descriptor and name, how far it is written and synced.
    A round takes its descriptor with `hold` and gives it back with `release` once the fsync has
    ended, so that a `close` meanwhile leaves it open until then (`JournalWriter.hold`)."""

    path: str
    fd: int
    size: int
    synced: int

    def hold(self) -> int: ...

    def release(self) -> None: ...


class _Worker:
    """One OS thread that fsyncs a descriptor each time it is handed one (no event loop of its own:
    it takes the interpreter lock only to start and to report)."""

    def __init__(self, idle: list[_Worker]) -> None:
        self._idle = idle
        self._go = _allocate_lock()
        self._go.acquire()  # released by `hand`
        self._job: tuple[Callable[[int], None], int, int, Callable[[int, OSError | None], None]] | None = None
        _start_new_thread(self._serve, ())

    def hand(self, fsync: Callable[[int], None], fd: int, index: int,
             report: Callable[[int, OSError | None], None]) -> None:
        self._job = (fsync, fd, index, report)
        self._go.release()

    def _serve(self) -> None:
        while True:
            self._go.acquire()
            assert self._job is not None
            fsync, fd, index, report = self._job
            error: OSError | None = None
            try:
                fsync(fd)
            except OSError as e:
                error = e
            except BaseException as other:  # never leave a round without its report
                error = OSError(errno.EIO, f"fsync raised {other!r}")
            self._idle.append(self)  # free again before the round can learn it is over
            report(index, error)


class ThreadFsync:
    """A round's fsyncs on OS threads of its own, one per descriptor (up to `max_threads` at once);
    the last to finish wakes the event loop once for the whole round."""

    def __init__(self, fsync: Callable[[int], None] = os.fdatasync, max_threads: int = MAX_THREADS) -> None:
        self._fsync = fsync
        self._max_threads = max_threads
        self._idle: list[_Worker] = []
        self._wake: Any = None  # the loop's async watcher, made by the first round
        os.register_at_fork(after_in_child=self._forget_threads)

    def _forget_threads(self) -> None:
        """A forked child has none of the parent's threads, nor its event loop."""
        self._idle = []
        self._wake = None

    def fsync_all(self, fds: list[int]) -> list[OSError | None]:
        results: list[OSError | None] = [None] * len(fds)
        for start in range(0, len(fds), self._max_threads):
            self._round(fds[start:start + self._max_threads], results, start)
        return results

    def _round(self, fds: list[int], results: list[OSError | None], offset: int) -> None:
        if self._wake is None:
            self._wake = gevent.get_hub().loop.async_()
        wake = self._wake
        finished = gevent.event.Event()
        reported: list[int] = []

        def report(index: int, error: OSError | None) -> None:  # on a worker thread
            results[offset + index] = error
            reported.append(index)
            if len(reported) == len(fds):
                wake.send()

        wake.start(finished.set)  # before any fsync can finish: a send to a stopped watcher is lost
        try:
            for index, fd in enumerate(fds):
                worker = self._idle.pop() if self._idle else _Worker(self._idle)
                worker.hand(self._fsync, fd, index, report)
            while len(reported) < len(fds):
                finished.wait()
                finished.clear()
        finally:
            wake.stop()


class NativeThreadFsync:
    """A round's fsyncs on C threads (`src/kestrel/storage/fsync/_fsync_many.c`): `start` hands them out and
    returns, the last to finish adds 1 to an eventfd the loop watches, and `finish` collects the results; no
    Python thread takes part, so the interpreter lock never changes hands for a round. A greenlet
    waits for the round (`fsync_all`), or nothing does and the watcher's callback passes the
    results on (`begin`).

    The helper's threads and its round belong to the process, so there is one of these per process
    (`native_threads()`), and its rounds take turns: the greenlets' (`_round`) through a semaphore,
    whose holder waits for a round of `begin`'s in flight to end; `begin`, which never waits, hands
    out no round while the semaphore is held, and takes it no more (its non-blocking acquire was a
    fifth of the loop's instructions to start a round). The eventfd is made at once (at
    import, for the server), not by the first round, which may come when the process is out of
    descriptors; without one, rounds go to Python threads."""

    def __init__(self, start: Callable[[list[int], int, bool], None],
                 finish: Callable[[], list[int]], prefer: Callable[[int], None]) -> None:
        self._start = start
        self._finish = finish
        self.prefer = prefer  # the CPU rounds run on where the loop may (-1: the loop's own)
        self._fallback = ThreadFsync()
        self._turn = gevent.lock.Semaphore()  # `_round`'s, one greenlet's round at a time
        self._begun_ended: gevent.event.Event | None = None  # what the holder waits on for `begin`'s round
        self._eventfd = self._make_eventfd()
        self._watcher: Any = None  # made by the first round, in the loop of the process that runs it
        # `begin`'s watcher: started by its first round and never stopped (a start and a stop each
        # round cost an `epoll_ctl` and the loop's bookkeeping); it keeps the loop running (`ref`)
        # only while a round it waits for runs.
        self._ending: Any = None
        self._abandoned = False  # a round whose waiter was killed: finished before the next starts
        self._forks = 0  # how many times this process was forked from the one that made this
        self._then: tuple[Callable[[list[OSError | None]], None], int] | None = None  # `begin`'s round
        os.register_at_fork(after_in_child=self._new_eventfd)

    @staticmethod
    def _make_eventfd() -> int:
        try:
            return os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        except OSError as e:
            log.warning("no eventfd for the C fsync threads; rounds go to Python threads", error=str(e))
            return -1

    def _new_eventfd(self) -> None:
        """A forked child must not share its parent's eventfd (each would read the other's rounds),
        nor wait for a turn that a greenlet of its parent held; a parent's round that was waiting
        when the process forked, for the threads or for its turn, fails in the child instead of
        reading the child's rounds or running beside them."""
        for watcher in (self._watcher, self._ending):
            if watcher is not None:
                watcher.stop()
        if self._eventfd >= 0:
            os.close(self._eventfd)
        self._eventfd, self._watcher, self._ending, self._abandoned = self._make_eventfd(), None, None, False
        self._turn = gevent.lock.Semaphore()
        waiting, self._begun_ended = self._begun_ended, None
        if waiting is not None:  # the turn's holder, waiting for `begin`'s round: it fails in the child
            waiting.set()
        self._forks += 1
        if self._then is not None:  # a parent's round: it fails in the child, on the child's loop
            then, size = self._then
            self._then = None
            failed: list[OSError | None] = [_forked()] * size
            gevent.get_hub().loop.run_callback(then, failed)

    @property
    def ready(self) -> bool:
        """Whether rounds go to the C threads (there is an eventfd to hear from them)."""
        return self._eventfd >= 0

    @property
    def busy(self) -> bool:
        """Whether a round holds the threads: `begin`'s in flight, a greenlet's holding the turn, or
        one whose waiter was killed, not yet collected. `begin` hands out none meanwhile."""
        return self._then is not None or self._abandoned or self._turn.locked()

    def fsync_all(self, fds: list[int]) -> list[OSError | None]:
        return self._round(fds, syncfs=False)

    def syncfs_all(self, fds: list[int]) -> list[OSError | None]:
        """The syncfs of each descriptor's file system (callers check the kernel: `libc_syncfs`)."""
        return self._round(fds, syncfs=True)

    def begin(self, fds: list[int], then: Callable[[list[OSError | None]], None]) -> bool:
        """Hand an fdatasync of each of `fds` to the C threads and return at once: `then` is called
        with the results on the event loop, by the eventfd's watcher, once all have run. No greenlet
        waits for the round, so none is switched to and from for it. False, with nothing handed
        out, when the threads serve another round or cannot tell the loop (no eventfd): the caller
        then runs it with `fsync_all`."""
        if not fds or self._eventfd < 0 or self.busy:
            return False
        if self._ending is None:
            self._ending = gevent.get_hub().loop.io(self._eventfd, 1)
            self._ending.start(self._ended)
        self._start(fds, self._eventfd, False)
        self._then = (then, len(fds))
        self._ending.ref = True
        return True

    def _ended(self) -> None:
        """On the loop: the eventfd is readable. If `begin`'s round has ended, collect its results
        and hand them on (a wake-up that finds the counter at zero, or that is a round of
        `_round`'s, whose greenlet reads it, waits on)."""
        if self._then is None:
            return
        try:
            os.eventfd_read(self._eventfd)
        except BlockingIOError:
            return
        then, _ = self._then
        self._then = None
        self._ending.ref = False
        try:
            codes = self._finish()
        finally:
            waiting = self._begun_ended
            if waiting is not None:  # a greenlet holding the turn waits for the threads
                self._begun_ended = None
                waiting.set()
        then(_errors(codes))

    def _round(self, fds: list[int], syncfs: bool) -> list[OSError | None]:
        if not fds:
            return []
        if self._eventfd < 0:
            if syncfs:  # its caller then fdatasyncs each journal, on the fallback's threads
                return [OSError(errno.EMFILE, "no eventfd for the C threads' syncfs rounds")] * len(fds)
            return self._fallback.fsync_all(fds)
        if self._watcher is None:
            self._watcher = gevent.get_hub().loop.io(self._eventfd, 1)
        forks = self._forks  # before the turn: a greenlet that waited for it across a fork is the parent's
        with self._turn:  # held, it keeps `begin` from handing out another round
            while self._then is not None:  # `begin`'s round is on the threads: it ends on the loop
                waiting = self._begun_ended
                if waiting is None:
                    waiting = self._begun_ended = gevent.event.Event()
                waiting.wait()
            if self._forks != forks:  # a greenlet of the parent's: the threads are the child's
                raise _forked()
            if self._abandoned:
                self._wait_and_finish()
            self._start(fds, self._eventfd, syncfs)
            self._abandoned = True  # until its results are collected
            codes = self._wait_and_finish()
        return _errors(codes)

    def _wait_and_finish(self) -> list[int]:
        forks, watcher = self._forks, self._watcher

        def not_forked() -> None:
            if self._forks != forks:
                raise _forked()

        read_when_ready(self._eventfd, partial(gevent.get_hub().wait, watcher), not_forked)
        codes = self._finish()
        self._abandoned = False
        return codes


def _errors(codes: list[int]) -> list[OSError | None]:
    """The C threads' result codes (0: the fsync succeeded) as each descriptor's error."""
    return [OSError(code, os.strerror(code)) if code else None for code in codes]


def _forked() -> OSError:
    """What a round begun in the parent gives its waiters in a forked child."""
    return OSError(errno.EIO, "an fsync round begun before this process was forked")


_native: NativeThreadFsync | None = None


def native_threads() -> NativeThreadFsync | None:
    """The process's one handle on the C helper, or None where it was not built (no C compiler at
    install time)."""
    global _native
    if _native is None:
        try:
            from kestrel.storage.fsync._fsync_many import finish, prefer, start
        except ImportError:
            return None
        _native = NativeThreadFsync(start, finish, prefer)
    return _native


def _threads() -> FsyncMany:
    """C threads when the helper was built, else Python threads."""
    return native_threads() or ThreadFsync()


def filesystem_sync(each: FsyncMany) -> FilesystemSync | None:
    """Rounds of several journals on one file system as one syncfs, on the C threads where they
    serve, else on Python threads; None where the kernel does not report syncfs's errors (Linux
    before 5.8) or the C library lacks it."""
    syncfs = libc_syncfs()
    if syncfs is None:
        return None
    native = native_threads()
    if native is not None and native.ready:
        return FilesystemSync(each, native.syncfs_all)
    return FilesystemSync(each, ThreadFsync(syncfs).fsync_all)


class Round:
    """The journals one round fsyncs, how far each was written when the round began, and the
    errors of those that failed; `ended` once it has run, and then each of `then` is called, on
    the loop and in the order given (`after`)."""

    __slots__ = ("journals", "begun", "failed", "ended", "_ending", "then")

    def __init__(self) -> None:
        self.journals: dict[Syncable, int] = {}  # journal -> position its fsync covers
        self.begun = False  # its positions taken (`_claim`): a journal joining now waits for the next
        self.failed: dict[Syncable, OSError] = {}
        self.ended = False
        # what a greenlet waiting for the round (`wait`) waits on, made by the first: the log's
        # rounds have none, and an event a round cost them its making and its setting
        self._ending: gevent.event.Event | None = None
        self.then: list[Callable[[], None]] = []

    def wait(self) -> None:
        """Return once the round has run (the calling greenlet waits)."""
        if self.ended:
            return
        ending = self._ending
        if ending is None:
            ending = self._ending = gevent.event.Event()
        ending.wait()

    def after(self, fn: Callable[[], None]) -> None:
        """Call `fn` once the round has run, where it ends (a callback of the loop or the greenlet
        running rounds), before the next round begins: a caller with no greenlet waiting (the
        commit log's rounds) costs no event, and no callback of the hub a round."""
        self.then.append(fn)

    def ran(self) -> None:
        """The round has run: wake its waiters and call what waits for it (an error is logged: a
        round is never left without its end). The calls are dropped once made: one that holds the
        round (the log's do) would otherwise keep it, and all it holds, until a full collection."""
        self.ended = True
        ending = self._ending
        if ending is not None:
            ending.set()
        then, self.then = self.then, []
        for fn in then:
            try:
                fn()
            except Exception:
                log.exception("a call made when a group commit round had run failed")


def loop_timer(seconds: float) -> Any:
    """A timer of the running hub's loop, due `seconds` from now (`start` it with its callback).

    From now, as gevent's own `Timeout` times itself: the loop times a timer from its clock, read
    once an iteration, and one set late in a busy iteration, or after work done without the loop
    (a queue's replay at start), fired that much early in real time. The commit log's gathering
    timer, set after the iteration's requests, cut its rounds short so (measured in bench/README.md,
    "Timers timed from now")."""
    loop = gevent.get_hub().loop
    loop.update_now()
    return loop.timer(seconds)


class GroupCommit:
    """Rounds of concurrent fsyncs for every journal of the process (`shared()`)."""

    def __init__(self, fsync_many: FsyncMany | None = None, way: str = "",
                 timer: Callable[[float], Any] = loop_timer) -> None:
        """Rounds through `fsync_many`, or else the way named (one of FSYNC_WAYS); `later`'s timers
        from `timer`."""
        self._timer = timer
        # fdatasync: the journals only grow, and the size they grow to is flushed with the data.
        self._threads = _threads()
        if fsync_many is None and way not in FSYNC_WAYS:
            log.warning("unknown KESTREL_FSYNC value; fsyncs go to threads", value=way,
                        known=[known for known in FSYNC_WAYS if known])
        if fsync_many is None and way == "syncfs":
            fsync_many = filesystem_sync(self._threads)
            if fsync_many is None:
                log.warning("KESTREL_FSYNC=syncfs, but this kernel does not report write-back errors "
                            "through syncfs (Linux before 5.8): fsyncs go to threads")
        # None: native AIO, set up by the first round
        self._fsync_many = fsync_many or (None if way == "aio" else self._threads)
        self._next: Round | None = None  # gathering journals; starts when its turn has run
        self._running: Round | None = None
        self.runner: gevent.Greenlet | None = None  # the greenlet running rounds, the latest one

    def run_rounds_on(self, cpu: int) -> bool:
        """Run the rounds on `cpu` (the one that takes the disk's completions: `completion_cpu.py`)
        wherever the loop may run there, rather than on the CPU the loop is on; whether this group
        commit's rounds go to the C threads, where that applies (not native AIO's, nor Python
        threads')."""
        native = self._threads
        if not isinstance(native, NativeThreadFsync) or not native.ready or not (
                self._fsync_many is native or isinstance(self._fsync_many, FilesystemSync)):
            return False
        native.prefer(cpu)
        return True

    def sync(self, journal: Syncable, position: int) -> None:
        """Return once `journal` is on disk up to `position` (its `synced` is moved on by the round).

        Raises OSError when the fsync of a round covering `position` failed.
        """
        while journal.synced < position:
            running = self._running
            if running is not None and running.journals.get(journal, -1) >= position:
                round_ = running  # the round in flight covers it: wait for that one
            else:
                round_ = self.join(journal)
            round_.wait()
            error = round_.failed.get(journal)
            if error is not None:
                raise OSError(error.errno, f"fsync of {journal.path} failed: {error.strerror}")

    def later(self, seconds: float, fn: Callable[[], None]) -> Any:
        """Call `fn` on the loop once `seconds` have passed, from the loop's own callback: no greenlet
        is made for it, so `fn` must never yield. What a caller gathering a round waits with (the
        commit log's `_join`); `stop()` the timer returned to cancel it."""
        timer = self._timer(seconds)
        timer.start(fn)
        return timer

    def join(self, journal: Syncable) -> Round:
        """The next round, with `journal` in it (also for a caller that waits for it in its own
        way: `Round.after`): it starts once this turn has run, or once the round in flight has finished, and
        covers what `journal` holds then. Never yields."""
        round_ = self._gathering()
        if round_ is None:
            round_ = self._next = Round()
            gevent.get_hub().loop.run_callback(self._start)
        round_.journals[journal] = -1  # its position is taken when the round starts
        return round_

    def _gathering(self) -> Round | None:
        """The round a journal joins: the next, or the one claimed to run whose runner has not yet
        taken the journals' positions (a round handed to a runner greenlet waits for its turn of the
        loop), which would cover this turn's changes too; None where neither is, and none runs."""
        running = self._running
        if running is not None and not running.begun:
            return running
        round_ = self._next
        if round_ is None and running is not None:
            round_ = self._next = Round()  # begun once the one in flight has finished
        return round_

    def join_now(self, journals: Iterable[Syncable]) -> Round:
        """The next round, with each of `journals` in it, begun at once where none is in flight
        (else once the one in flight has finished): for a caller whose turn has run already, the
        commit log's, whose changes are all in, so that no callback of the loop is queued to begin
        it (a journal that joins later in this turn of the loop waits for the round after)."""
        round_ = self._gathering()
        if round_ is None:
            round_ = self._next = Round()
        for journal in journals:
            round_.journals[journal] = -1
        if self._running is None:
            self._start()
        return round_

    def _start(self) -> None:
        if self._running is None and self._next is not None:
            self._running = self._next  # claimed now, so that no second runner starts
            self._next = None
            if not self._begin_on_loop(self._running):
                self.runner = gevent.spawn(self._run_rounds)

    def _begin_on_loop(self, round_: Round) -> bool:
        """Hand the claimed round to the C threads, to end in a callback on the loop
        (`_ran_on_loop`) with no greenlet waiting for it; False where this way of fsyncing cannot
        (then a runner greenlet runs it)."""
        native = self._fsync_many
        if not isinstance(native, NativeThreadFsync):
            return False
        journals, fds = self._claim(round_)
        if not journals:
            return False
        if native.begin(fds, partial(self._ran_on_loop, round_, journals)):
            return True
        _release(journals)  # nothing handed out: the runner claims them again
        round_.begun = False
        return False

    def _ran_on_loop(self, round_: Round, journals: list[Syncable], errors: list[OSError | None]) -> None:
        """On the loop: a round begun there has run. Its waiters are told, and the round gathered
        meanwhile begins."""
        try:
            self._record(round_, journals, errors)
        finally:
            round_.ran()  # what it calls may join the next round: it begins here, with no callback
            self._running = self._next
            self._next = None
            if self._running is not None and not self._begin_on_loop(self._running):
                self.runner = gevent.spawn(self._run_rounds)

    def _run_rounds(self) -> None:
        """Run the claimed round, then each round gathered meanwhile, until none is waiting."""
        round_ = self._running
        try:
            while round_ is not None:
                try:
                    self._run(round_)
                except Exception as e:  # no waiter may wait on for a round that will never end
                    log.exception("group commit round failed")
                    for journal in round_.journals:
                        round_.failed.setdefault(journal, OSError(errno.EIO, f"group commit failed: {e!r}"))
                finally:
                    round_.ran()  # killed midway: its waiters find themselves unsynced and ask again
                round_ = self._running = self._next
                self._next = None
        except BaseException:  # this runner was killed: the rounds still waiting get a runner of their own
            self._running = None
            if self._next is not None:
                gevent.get_hub().loop.run_callback(self._start)
            raise

    def _run(self, round_: Round) -> None:
        journals, fds = self._claim(round_)
        try:
            errors = self._fsync_all(fds)
        except Exception:  # no fsync runs on: the descriptors are let go (a killed runner's may run on)
            _release(journals)
            raise
        self._record(round_, journals, errors)

    @staticmethod
    def _claim(round_: Round) -> tuple[list[Syncable], list[int]]:
        """The round begins: what each journal holds now is what it covers; the open journals and
        their descriptors, each held until the round has run (`_record`). A journal closed with
        every byte synced (its close fsynced it) needs nothing more; one closed unsynced fails."""
        round_.begun = True
        journals: list[Syncable] = []
        fds: list[int] = []
        for journal in round_.journals:
            size = round_.journals[journal] = journal.size
            fd = journal.hold()
            if fd >= 0:
                journals.append(journal)
                fds.append(fd)
            elif journal.synced < size:
                round_.failed[journal] = OSError(errno.EBADF, "the journal was closed before its fsync")
        return journals, fds

    @staticmethod
    def _record(round_: Round, journals: list[Syncable], errors: list[OSError | None]) -> None:
        """The round's fsyncs have ended: the descriptors are let go, and each journal is synced
        as far as its round covered, or failed."""
        _release(journals)
        if len(errors) != len(journals):
            raise ValueError(f"{len(errors)} results for a round of {len(journals)} journals")
        for index, journal in enumerate(journals):  # (a `zip` with `strict` is a generic call a round)
            error = errors[index]
            if error is not None:
                round_.failed[journal] = error
            else:
                journal.synced = max(journal.synced, round_.journals[journal])

    def _fsync_all(self, fds: list[int]) -> list[OSError | None]:
        if self._fsync_many is None:
            try:
                self._fsync_many = AioFsync.create() or self._threads
            except OSError as e:  # e.g. out of descriptors for its eventfd: threads this time
                log.warning("native AIO not ready; this round's fsyncs go to threads", error=str(e))
                return self._threads.fsync_all(fds)
        try:
            return self._fsync_many.fsync_all(fds)
        except AioUnsupported as refused:
            log.info("fsyncs of a group commit go to threads", reason=str(refused))
            self._fsync_many = self._threads
            return self._threads.fsync_all(fds)


def _release(journals: list[Syncable]) -> None:
    """The fsyncs that held these journals' descriptors have ended (`Syncable.hold`)."""
    for journal in journals:
        journal.release()


_shared: GroupCommit | None = None


def shared() -> GroupCommit:
    """The process's group commit, in the way `KESTREL_FSYNC` names, made on first use: after the
    server has set up its log, so that a warning about the variable is a line of that log."""
    global _shared
    if _shared is None:
        _shared = GroupCommit(way=os.environ.get("KESTREL_FSYNC", ""))
    return _shared
