"""Whether the client cooperates with gevent: once gevent has patched the socket module, every wait
of the client is a socket's, served by the hub of the thread that made the socket. What the client
runs beside a call must then run on the caller's hub (a greenlet), not in a thread of its own, and
a client library it hands sockets to must use gevent's handlers (kazoo's, `discovery.py`)."""

from __future__ import annotations

import sys


def gevent_sockets() -> bool:
    """Whether gevent has patched the socket module. Asked without importing gevent, which patching
    imports (it may not be installed at all, and a process that never used it is spared its
    modules: a Spark worker's collections walk every object it holds)."""
    monkey = sys.modules.get("gevent.monkey")
    return monkey is not None and bool(monkey.is_module_patched("socket"))
