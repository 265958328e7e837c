"""Large appends written, and large records read back, off the event loop, with the journal's other
changes waiting their turn.

A change is applied in memory and appended to its journal before anything yields, so the journal's
order is the order of the changes. An append of megabytes (a 16 MB item) would hold the loop for
the kernel's copy into the page cache and its throttling of dirty pages, tens of milliseconds
on a busy disk, stalling every other client. So an append of `LARGE_APPEND` bytes or more goes to
the runtime's thread pool, and the loop serves other queues meanwhile; this queue's changes (and,
in Kestrel 3, those of every reader of its writer journal) wait at the gate until it is written,
so none sees memory its journal does not hold yet, and their records follow it in order. The
write is the same system call either way: what fails leaves the journal as it was and fails the
change, and its acknowledgement still comes after the write (and its fsync under `always`).

A read-behind cursor of either format reads a record of `LARGE_APPEND` bytes or more back the same
way, in one read on the thread pool (`BufferedFile.read_at`, src/kestrel/storage/journal_file.py),
and so does it any read the page cache cannot answer (a refill of its buffer from a disk that may
take seconds): the change that reads is in progress, so the journal's other changes wait at the
gate until it is read, and nothing that would move the cursor (a change, paging out, a close) runs
meanwhile. Such a read leaves the loop only while its change is the one change of the journal in
progress (`WriteGate.read`): another one, already in (a change waiting for its fsync), would go on
meanwhile and find this one half made, its items taken and their records not yet written (a
rotation taking that state for a pack, a Kestrel 3 change clearing what this one noted for an
undo); then it is read on the loop, as before. A page-out (Kestrel 2: the reads that place its
cursor, `PersistentQueue.shed`) counts as such a change while it runs.
A page-out made inside another queue's put (`PersistentQueue.shed` without `wait`, the memory
governor's `make_room`), a change that must not pause, reads through `CachedReads`: what the page
cache holds, on the loop; where it does not hold what the page-out would read, nothing is read and
nothing freed (`NotCached`), and the governor's tick pages the queue out, reading off the loop.
A Kestrel 3 reader's checkpoint rewritten whole (its manifest entry, the file, their fsyncs) goes
the same way, every reader of the writer journal waiting meanwhile
(src/kestrel/storage/kestrel3/journal.py, `ReaderFile.replace`).

A change that hands items to another queue (an expired item to `expire_to_queue`, a poison item to
its `error_queue`) may pause half made as well, that queue's put waiting for its fsync or its gate
(`hand_over`): the journal's other changes wait here meanwhile, as for an append off the loop. In
Kestrel 2 another change went on then and wrote the first one's records before that queue had the
items (lost, should its put fail), or failed and rebuilt memory from the journal under it (the
items handed over twice). The task handing over passes its own gate: that queue's put may hand
items back to this journal (an `expire_to_queue` naming each other, a Kestrel 3 fanout reader).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, TypeVar

from greenlet import getcurrent

from kestrel.storage.runtime import Event, Runtime

T = TypeVar("T")

# The size from which an append is written, or a record read, off the loop. Below it a write costs
# the loop less than handing it to a thread and back (0.2 ms of CPU for a megabyte into the page
# cache: bench/README.md).
LARGE_APPEND: Final = 1 << 20


class WriteGate:
    """The changes of one journal (every reader's, for a Kestrel 3 writer journal) wait here while
    a large append of theirs is written, or a record read, off the loop (`off_loop`, `read`), and
    while disk work a Kestrel 2 rotation left for before the next change runs (`hold`), and while one
    of them hands items to another queue (`hand_over`)."""

    __slots__ = ("runtime", "busy", "changes", "holder", "_holders")

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        # Set while the gate is held (`hold`): an append or a read off the loop, a rotation's naming,
        # a hand-over.
        self.busy: Event | None = None
        # The journal's changes in progress, counted from their turn at the gate to their end
        # (`PersistentQueue.__enter__`, `__exit__`), one waiting for its fsync included, and a
        # page-out placing its cursor (`PersistentQueue.shed`).
        self.changes = 0
        self.holder: object = None  # the task (greenlet, or thread's) handing items over, if one is
        self._holders = 0

    def wait_turn(self) -> None:
        """Return once nothing holds the gate (no append or read of this journal running off the
        loop, no work a rotation left under way) or the gate is this task's own hand-over."""
        while (busy := self.busy) is not None and self.holder is not getcurrent():
            busy.wait()

    def hold(self) -> None:
        """Close the gate now, whatever holds it already: the journal's changes wait at it until
        every hold is released (`release`)."""
        if self.busy is None:
            self.busy = self.runtime.event()
        self._holders += 1

    def release(self) -> None:
        """One hold ends; the gate opens with the last, waking the changes that wait."""
        self._holders -= 1
        if not self._holders:
            done, self.busy = self.busy, None
            if done is not None:
                done.set()

    def off_loop(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` (a system call appending to the journal or reading a record of it) on the
        runtime's thread pool, the journal's other changes waiting meanwhile; what it returns or
        raises. The gate opens only once the call has ended, even for a caller killed meanwhile,
        which takes the call's outcome first, so that the journal counts or cuts back what reached
        it (`Runtime.run_blocking`); to the hand-over it is part of, if it is."""
        self.wait_turn()
        self.hold()
        try:
            return self.runtime.run_blocking(fn, *args)
        finally:
            self.release()

    def read(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)`, a read of the journal that may wait for the disk, made inside a change (or
        a page-out): off the loop (`off_loop`) when that change is the journal's one change in
        progress, else on the caller's thread (another change would go on meanwhile and find this
        one half made)."""
        if self.changes > 1:
            return fn(*args)
        return self.off_loop(fn, *args)

    def hand_over(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)`, a change's call that hands items to another queue and may pause (that
        queue's creation, its gate, its fsync), the journal's other changes waiting meanwhile;
        what it returns or raises. This task's own changes of the journal pass (`wait_turn`)."""
        me = getcurrent()
        if self.holder is me:
            return fn(*args)
        self.wait_turn()
        self.hold()
        self.holder = me
        try:
            return fn(*args)
        finally:
            self.holder = None
            self.release()


class NotCached(Exception):
    """Raised by a read through `CachedReads`: the page cache does not hold what it would read."""


class CachedReads(WriteGate):
    """The gate of reads made where nothing may pause (a page-out inside another queue's put):
    what the page cache holds is read on the loop, as through any gate
    (`BufferedFile._read_gated`), and what it does not is never read: the disk, which may stall
    for seconds, would hold every client."""

    __slots__ = ()

    def read(self, fn: Callable[..., T], *args: object) -> T:
        raise NotCached()
