"""Log lines from sections that must not yield to other greenlets, written by a task of their own.

Writing a log line may pause its caller, by whatever logger the process set up: one that writes
under a gevent lock (structlog's own, under monkey patching) makes a greenlet that wants it wait, and
another run, while a thread (a pack) holds it. The server's writes under an OS lock
(src/kestrel/service/logs.py), which never switches, but the engine does not count on the logger it
is given. A change must not pause before its records are appended, nor a Kestrel 3 put between
taking its ids and writing them (two puts took the same ids so), so what such a section has to say
is handed to `log_later`, which logs it once the section is over.
`tests/support/switches.py` holds these sections to it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from kestrel.storage.runtime import Runtime


def log_later(runtime: Runtime, write: Callable[..., Any], event: str, **fields: Any) -> None:
    """Call `write(event, **fields)` (a logger's method: `log.info`, `log.error`, ...) in a task of
    its own, which the runtime starts without pausing the caller. An error goes as `exc_info=error`."""
    runtime.spawn(partial(write, event, **fields))
