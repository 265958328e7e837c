"""TCP keepalive on every listener: the kernel's timer list shows which connections are probed."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

from tests.conftest import wait_until

KEEPALIVE_TIMER = 2  # /proc/net/tcp's `tr` column: 2 = the keepalive timer is running
# A request each listener answers, so that the server has surely set up the connection.
REQUESTS = {"memcache": b"version\r\n", "text": b"version\n", "admin": b"GET /ping HTTP/1.0\r\n\r\n"}


def _server_side_timers(port: int, client_port: int) -> list[int]:
    """The `tr` of the server's end of each connection from `client_port` to `port`."""
    timers = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, timer = fields[1], fields[2], int(fields[5].split(":")[0], 16)
        if int(local.split(":")[1], 16) == port and int(remote.split(":")[1], 16) == client_port:
            timers.append(timer)
    return timers


def test_every_listener_probes_idle_clients(server_factory: Any) -> None:
    srv = server_factory({"tcp_keepalive": "5s"})
    for name in ("thrift", "memcache", "text", "admin"):
        port = getattr(srv, f"{name}_port")
        with socket.create_connection(("127.0.0.1", port)) as client:
            mine = client.getsockname()[1]
            wait_until(lambda p=port, c=mine: _server_side_timers(p, c) == [KEEPALIVE_TIMER],
                       f"{name}: the keepalive timer on the server's end")


def test_keepalive_can_be_turned_off(server_factory: Any) -> None:
    srv = server_factory({"tcp_keepalive": None})
    for name, request in REQUESTS.items():
        port = getattr(srv, f"{name}_port")
        with socket.create_connection(("127.0.0.1", port)) as client:
            client.sendall(request)
            assert client.recv(100)  # answered: the connection is set up as it will stay
            assert KEEPALIVE_TIMER not in _server_side_timers(port, client.getsockname()[1])
