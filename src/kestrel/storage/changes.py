"""Which queues changed since each of the collection's background tasks last looked.

The memory governor (src/kestrel/storage/memory.py) visits the queues that changed rather than
every queue, so that what it costs follows the work and an idle server is idle (the expiry sweep
needs less: the queues due, src/kestrel/storage/expiry.py). A queue tells of its first change after
each look through its `noted` flag (`PersistentQueue.note_changes_to`): one attribute test a change.
"""

from __future__ import annotations

from collections.abc import Callable

from kestrel.storage.queue import PersistentQueue


class ChangedQueues:
    """The queues noted since each reader's last `take` (see `reader`)."""

    def __init__(self) -> None:
        self._fresh: list[PersistentQueue] = []  # noted since the last take of any reader
        self._pending: list[set[PersistentQueue]] = []  # per reader: noted since its own take

    def note(self, queue: PersistentQueue) -> None:
        """`queue` changed (what a queue calls, once between two takes)."""
        self._fresh.append(queue)

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
        """Hand what was noted to every reader and clear the queues' flags. A flag is cleared before
        its queue leaves the list, so a change made meanwhile (plain threads) is noted again rather
        than lost."""
        fresh = self._fresh
        count = len(fresh)
        if not count:
            return
        noted = fresh[:count]
        for queue in noted:
            queue.noted = False
        del fresh[:count]
        for pending in self._pending:
            pending.update(noted)
