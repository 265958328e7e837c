"""Whether the client cooperates with gevent: once gevent has patched the socket module, every wait
of the client is a socket's, served by the hub of the thread that made the socket. What the client
runs beside a call must then run on the caller's hub (a greenlet), not in a thread of its own, and
a client library it hands sockets to must use gevent's handlers (kazoo's, `discovery.py`)."""

from __future__ import annotations


def gevent_sockets() -> bool:
    """Whether gevent has patched the socket module (gevent may not be installed at all)."""
    try:
        from gevent import monkey
    except ImportError:
        return False
    return bool(monkey.is_module_patched("socket"))
