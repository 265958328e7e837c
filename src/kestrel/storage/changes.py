"""Which queues changed since each of the collection's background tasks last looked.

The memory governor (src/kestrel/storage/memory.py) visits the queues that changed rather than
every queue, so that what it costs follows the work and an idle server is idle (the expiry sweep
needs less: the queues due, src/kestrel/storage/expiry.py). A queue tells of its first change after
each look through its `noted` flag (`PersistentQueue.note_changes_to`): one attribute test a change.

A deleted queue is `forget`-ten at once rather than left for the next look: nothing here may hold
it past its delete (docs/queue-lifetime.md).
"""

from __future__ import annotations

from collections.abc import Callable

from kestrel.storage.queue import PersistentQueue


class ChangedQueues:
    """The queues noted since each reader's last `take` (see `reader`)."""

    def __init__(self) -> None:
        # Noted since the last take of any reader: a dict for its order of insertion and its
        # removal of one queue in one step (`forget`), its values unused.
        self._fresh: dict[PersistentQueue, None] = {}
        self._pending: list[set[PersistentQueue]] = []  # per reader: noted since its own take

    def note(self, queue: PersistentQueue) -> None:
        """`queue` changed (what a queue calls, once between two takes)."""
        self._fresh[queue] = None

    def forget(self, queue: PersistentQueue) -> None:
        """`queue` was deleted: no reader is told of it, and it is never noted again (its flag
        stays set)."""
        queue.noted = True
        self._fresh.pop(queue, None)
        for pending in self._pending:
            pending.discard(queue)

    def reader(self) -> Callable[[], set[PersistentQueue]]:
        """A new reader: a function returning the queues noted since its last call (a set that
        is then its own: the reader starts a new one rather than copying it)."""
        index = len(self._pending)
        self._pending.append(set())
        pending = self._pending

        def take() -> set[PersistentQueue]:
            self._spread()
            taken = pending[index]
            pending[index] = set()
            return taken

        return take

    def _spread(self) -> None:
        """Hand what was noted to every reader and clear the queues' flags. Each queue leaves the
        dict before its flag is cleared, so a change made meanwhile (plain threads) either comes
        before the readers look at it or notes the queue again, never lost."""
        fresh = self._fresh
        if not fresh:
            return
        noted = list(fresh)
        for queue in noted:
            fresh.pop(queue, None)
            queue.noted = False
        for pending in self._pending:
            pending.update(noted)
