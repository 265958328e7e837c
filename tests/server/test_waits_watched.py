"""A memcache or text get watches its client only once it does wait: a get with a time-out whose
item is ready is answered as a get without one, with no greenlet started to watch the socket."""

from __future__ import annotations

import socket
from typing import Any

import pytest


@pytest.mark.pure_build
@pytest.mark.parametrize("protocol", ["memcache", "text"])
def test_a_get_watches_its_client_only_while_it_waits(server_state: Any, protocol: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from kestrel.service import buffered_connection
    from kestrel.service.memcache.handler import MemcacheConnection
    from kestrel.service.text.handler import TextConnection

    watched: list[int] = []
    real = buffered_connection.wait_watching

    def counted(*args: Any) -> Any:
        watched.append(1)
        return real(*args)

    monkeypatch.setattr(buffered_connection, "wait_watching", counted)
    ours, theirs = socket.socketpair()
    ours.setblocking(False)  # as the listener hands a connection its socket
    kind = MemcacheConnection if protocol == "memcache" else TextConnection
    connection = kind(server_state, ours, "test")
    if protocol == "memcache":
        ready, empty = b"set q 0 0 1\r\nx\r\nget q/t=60000\r\n", b"get q/t=10\r\n"
        found, none = b"VALUE q/t=60000 0 1\r\nx\r\nEND\r\n", b"END\r\n"
    else:
        ready, empty = b"put q:\nx\n\nget q 60000\n", b"get q 10\n"
        found, none = b":x\n", b"*\n"
    try:
        assert connection.process(bytearray(ready)) == len(ready)
        connection.send()
        assert found in theirs.recv(4096)
        assert watched == []  # its item was there: no watch
        assert connection.process(bytearray(empty)) == len(empty)
        connection.send()
        assert theirs.recv(4096).endswith(none)
        assert watched == [1]  # it waited 10 ms, watched
    finally:
        ours.close()
        theirs.close()
