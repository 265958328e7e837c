"""Gevent's lock for a queue's changes: nothing to take, since a greenlet is never preempted inside a
change. Compiled with the request path (src/kestrel/build.py): every add and remove enters and
leaves it, which cost two calls of interpreted Python a change while it lived in `runtime.py`."""

from __future__ import annotations

from types import TracebackType


class NoLock:
    """A lock that never waits: `with` it, `acquire` and `release` do nothing."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        return None

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        return True

    def release(self) -> None:
        return None


NO_LOCK = NoLock()
