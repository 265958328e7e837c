"""What an idle connection costs the server: no receive buffer of its own, for every protocol.

Each connection once held its own receive buffer (256 KiB for Thrift, 64 KiB for memcache and
text): 10,000 idle clients took RSS past a gigabyte. Receives now land in one buffer that every
connection shares. Measured here as the server's RSS growth over many connections that have each
made one request and then wait; the figures for 10,000 beside Redis are in bench/README.md.
"""

from __future__ import annotations

import resource
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import ServerProcess, wait_until
from tests.support.thrift_wire import encode_call, framed, rss_kb

CONNECTIONS = 1000
# Far above what a connection costs now (about 12 KB on the first thousand, 4 KB after) and far
# below what it cost with a buffer of its own (68 KB memcache, 270 KB Thrift): RSS, not timing.
MAX_KB_PER_CONNECTION = 32


@pytest.fixture
def many_server(tmp_path: Path) -> Iterator[ServerProcess]:
    """A server of its own for each protocol, so that no other test's memory is there to reuse."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 3 * CONNECTIONS:
        pytest.skip(f"needs {3 * CONNECTIONS} file descriptors; the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 3 * CONNECTIONS), hard))
    srv = ServerProcess(tmp_path, {"max_connections": 4 * CONNECTIONS})
    srv.open_files_limit = 3 * CONNECTIONS
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("protocol, request_bytes, reply_end", [
    ("thrift", framed(encode_call("binary", "get_version")), None),
    ("memcache", b"version\r\n", b"\r\n"),
    ("text", b"version\n", b"\n"),
])
def test_an_idle_connection_holds_no_receive_buffer(many_server: ServerProcess, protocol: str,
                                                    request_bytes: bytes, reply_end: bytes | None) -> None:
    assert many_server.proc is not None
    port = getattr(many_server, f"{protocol}_port")
    before = rss_kb(many_server.proc.pid)
    clients: list[socket.socket] = []
    try:
        for _ in range(CONNECTIONS):
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
            clients.append(s)
            s.sendall(request_bytes)  # served: the connection's greenlet has run and now waits
            reply = s.recv(4096)
            assert reply and (reply_end is None or reply.endswith(reply_end)), reply
        grown = rss_kb(many_server.proc.pid) - before
    finally:
        for s in clients:
            s.close()
    assert grown / CONNECTIONS <= MAX_KB_PER_CONNECTION, f"{grown / CONNECTIONS:.1f} KB per idle connection"


CLOSING = 3000  # connections opened, answered, then all closed: a wave the server gives memory back after


@pytest.mark.parametrize("protocol, request_bytes, reply_end", [
    ("thrift", framed(encode_call("binary", "get_version")), None),
    ("memcache", b"version\r\n", b"\r\n"),
])
def test_memory_comes_back_after_many_connections_close(tmp_path: Path, protocol: str, request_bytes: bytes,
                                                        reply_end: bytes | None) -> None:
    """What the connections took is given back once they have closed: before, most of it stayed
    (arenas of small objects kept by a few survivors, free heap glibc kept). RSS, read after the
    server says it gave memory back, not a timing."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 2 * CLOSING:
        pytest.skip(f"needs {2 * CLOSING} file descriptors; the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2 * CLOSING), hard))
    srv = ServerProcess(tmp_path, {"max_connections": 2 * CLOSING})
    srv.open_files_limit = 2 * CLOSING
    srv.start()
    try:
        assert srv.proc is not None
        port = getattr(srv, f"{protocol}_port")
        before = rss_kb(srv.proc.pid)
        clients = []
        try:
            for _ in range(CLOSING):
                s = socket.create_connection(("127.0.0.1", port), timeout=30)
                clients.append(s)
                s.sendall(request_bytes)
                reply = s.recv(4096)
                assert reply and (reply_end is None or reply.endswith(reply_end)), reply
            held = rss_kb(srv.proc.pid) - before
        finally:
            for s in clients:
                s.close()
        wait_until(lambda: "memory given back after connections closed" in srv.log(),
                   "the server giving memory back", timeout=60)
        left = rss_kb(srv.proc.pid) - before
        assert held > 10_000, f"{held} KB for {CLOSING} connections: too little to tell"
        assert left <= held / 2, f"{left} of the {held} KB the connections took stayed after they closed"
    finally:
        srv.stop()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
