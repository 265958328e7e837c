"""Raw-socket helpers for the line protocols: exact bytes in, exact bytes out."""

from __future__ import annotations

import select
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import ServerProcess
from tests.support.lines import DEADLINE_S as DEADLINE_S  # re-exported: the tests import both from here
from tests.support.lines import exchange as exchange

_opened: list[socket.socket] = []


@pytest.fixture(scope="module", name="server")
def shared_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """`server` for a module that imports this: one server for all its tests, each keeping to its
    own queue names; on the defaults, with the settings of the module's `SHARED_SERVER_CONFIG` if it
    has one (queues of their own for tests that would otherwise start a server for them)."""
    srv = ServerProcess(tmp_path_factory.mktemp("shared"), getattr(request.module, "SHARED_SERVER_CONFIG", None)).start()
    yield srv
    srv.stop()


def conn(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S)
    _opened.append(sock)
    return sock


@pytest.fixture(autouse=True)
def close_sockets(server_factory: Any) -> Iterator[None]:
    """Close every socket a test opened before its servers stop (idle clients slow a stop down)."""
    yield
    while _opened:
        _opened.pop().close()


def readable_now(sock: socket.socket) -> bool:
    """Whether the socket has something to read now, without waiting. Asked with poll: select
    refuses a descriptor past 1023, which a test process that has run many tests may hand out."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    return bool(poller.poll(0))


def closed_by_server(sock: socket.socket, wait: float = DEADLINE_S) -> bool:
    """Whether the server closes `sock` within `wait` seconds (any unread reply is dropped)."""
    sock.settimeout(wait)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def memcache_stats(port: int) -> dict[str, str]:
    with conn(port) as s:
        text = exchange(s, b"stats\r\n", b"END\r\n").decode()
    return {parts[1]: parts[2] for line in text.splitlines() if len(parts := line.split(" ", 2)) == 3}
