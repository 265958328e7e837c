"""Holding the engine to its word where a section is documented never to yield to other greenlets.

`never_switches` fails a test when the code run inside it let another greenlet run, and says where
it switched; `logs_that_pause` makes every log line wait for a turn of the loop, as the server's
does when a thread (a pack) holds its logger's lock, so that a log line inside such a section shows.
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from typing import Any

import gevent
import greenlet
import pytest
import structlog


class SwitchedGreenlets(AssertionError):
    """Raised when a block that must not yield let another greenlet run."""


@contextmanager
def never_switches(what: str = "the block") -> Iterator[None]:
    """Fail (SwitchedGreenlets) if the calling greenlet switches to another one inside the block.

    Uses greenlet's switch tracing: every switch away from the caller is seen, whatever made it (a
    wait on an event, a contended gevent lock, a sleep, a cooperative socket).
    """
    here = greenlet.getcurrent()
    seen: list[str] = []

    def trace(event: str, args: tuple[greenlet.greenlet, greenlet.greenlet]) -> None:
        origin, _target = args
        if origin is here and event in ("switch", "throw") and not seen:
            # Called as the target runs: the caller's stack is its suspended frame.
            seen.append("".join(traceback.format_stack(origin.gr_frame, limit=16)))
        if previous is not None:
            previous(event, args)

    previous = greenlet.settrace(trace)
    try:
        yield
    finally:
        greenlet.settrace(previous)
        if seen:  # also when the block raised: this error, in its place, says what came first
            raise SwitchedGreenlets(f"{what} let another greenlet run; it switched here:\n{seen[0]}")


@contextmanager
def logs_that_pause() -> Iterator[None]:
    """Every log line of the calling thread's greenlets waits for one turn of the loop before it is
    written (other greenlets run); other threads (a pack) log as before."""
    config = structlog.get_config()
    assert not config["cache_logger_on_first_use"], "loggers already cached would not pause"
    thread = threading.get_ident()

    def pause(_logger: Any, _method: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        if threading.get_ident() == thread:
            gevent.sleep(0)
        return event

    structlog.configure(processors=[pause, *config["processors"]])
    try:
        yield
    finally:
        structlog.configure(**config)


def hold_to_never_switching(monkeypatch: pytest.MonkeyPatch, sections: list[tuple[type, str]]) -> list[str]:
    """Run every call of each `(class, method)` inside `never_switches`; the list returned collects
    what each failure said (a caller that catches the error hides it from the test otherwise)."""
    failures: list[str] = []
    for owner, name in sections:
        method = getattr(owner, name)

        def checked(*args: Any, _method: Any = method, _what: str = f"{owner.__name__}.{name}",
                    **kwargs: Any) -> Any:
            try:
                with never_switches(_what):
                    return _method(*args, **kwargs)
            except SwitchedGreenlets as e:
                failures.append(str(e))
                raise

        monkeypatch.setattr(owner, name, checked)
    return failures
