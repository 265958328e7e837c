"""One fsync at a time for one purpose, shared: the callers that need it while it is under way wait
for it instead of starting their own, which would wait behind it on the same disk for nothing.

A journal file's writer holds one for the name of the file it created (its folder's fsync) and one
for its bytes where no group commit shares its fsyncs (src/kestrel/storage/journal_file.py).
"""

from __future__ import annotations

from collections.abc import Callable

from kestrel.storage.runtime import Event, Runtime


class SharedFsync:
    """The fsync of one purpose under way, if one is, and the callers waiting for it."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self._running: Event | None = None  # set once the fsync under way has ended

    def until(self, done: Callable[[], bool], fsync: Callable[[], None]) -> None:
        """Return once `done()`. Until then: wait for the fsync under way, if one is, and look
        again (failed, it leaves the waiter to try itself); else run `fsync`, which makes its
        blocking call on the runtime's thread pool, the callers arriving meanwhile waiting for it.
        Raises what `fsync` raised, to the caller that ran it alone."""
        while not done():
            running = self._running
            if running is not None:
                running.wait()
                continue
            running = self._running = self.runtime.event()
            try:
                fsync()
            finally:
                self._running = None
                running.set()
