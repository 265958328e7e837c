"""Waiting on an eventfd from a greenlet: how a round of fsyncs done outside the interpreter (C
threads, native AIO) tells the event loop it has finished, without a Python thread."""

from __future__ import annotations

import os
from collections.abc import Callable


def read_when_ready(eventfd: int, wait: Callable[[], object],
                    check: Callable[[], None] | None = None) -> int:
    """The counter of a non-blocking `eventfd` once it is above zero (reading resets it).

    `wait` blocks this greenlet until the eventfd may be readable (the loop's watcher on it); a
    wake-up that finds the counter still at zero waits again. `check`, if given, runs before every
    read and raises to give up (e.g. the process forked while it waited)."""
    while True:
        if check is not None:
            check()
        try:
            return os.eventfd_read(eventfd)
        except BlockingIOError:
            wait()
