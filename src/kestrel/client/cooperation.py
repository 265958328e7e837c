"""Whether the client cooperates with gevent: once gevent has patched the socket module, every wait
of the client is a socket's, served by the hub of the thread that made the socket. What the client
runs beside a call must then run on the caller's hub (a greenlet), not in a thread of its own, and
a client library it hands sockets to must use gevent's handlers (kazoo's, `discovery.py`)."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:
    import gevent.event

Event: TypeAlias = "threading.Event | gevent.event.Event"


def gevent_sockets() -> bool:
    """Whether gevent has patched the socket module. Asked without importing gevent, which patching
    imports (it may not be installed at all, and a process that never used it is spared its
    modules: a Spark worker's collections walk every object it holds)."""
    monkey = sys.modules.get("gevent.monkey")
    return monkey is not None and bool(monkey.is_module_patched("socket"))


def run_beside(work: Callable[[], None], name: str) -> None:
    """Run `work` beside the caller: in a daemon thread named `name`, or once gevent has patched
    sockets in a greenlet of the caller's hub (a socket made in a thread of its own failed its first
    call in the caller's, "cannot switch to a different thread", where gevent had patched sockets
    and not threads)."""
    if gevent_sockets():
        import gevent

        gevent.spawn(work)
    else:
        threading.Thread(target=work, daemon=True, name=name).start()


def new_event() -> Event:
    """An event the caller waits on while what runs beside it (`run_beside`) sets it: a thread's, or
    once gevent has patched sockets a greenlet's (which only greenlets of one hub may share)."""
    if gevent_sockets():
        import gevent.event

        return gevent.event.Event()
    return threading.Event()


def home() -> int | None:
    """Who may wait on what runs beside this caller: any thread (None), or once gevent has patched
    sockets the greenlets of the caller's thread alone (its ident, not the greenlet's that a
    patched `threading.get_ident` gives): a greenlet runs, and its event wakes, on its own hub."""
    if not gevent_sockets():
        return None
    from gevent.monkey import get_original

    return int(get_original("_thread", "get_ident")())
