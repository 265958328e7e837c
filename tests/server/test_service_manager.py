"""Under systemd's `Type=notify` the server says when it is ready and when it stops, over the socket
named by `NOTIFY_SOCKET` (systemd's protocol, received here as systemd would); without one, or with
one no one listens on, it serves all the same: the real command, as a subprocess."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from kestrel.storage.kestrel2 import codec
from tests.conftest import ServerProcess


def manager_socket(tmp_path: Path, abstract: bool) -> tuple[socket.socket, str]:
    """A datagram socket as systemd's, and the NOTIFY_SOCKET value naming it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.settimeout(60)
    if abstract:
        name = f"kestrel-test-{os.getpid()}-{tmp_path.name}"
        sock.bind("\0" + name)
        return sock, "@" + name
    sock.bind(str(tmp_path / "notify"))
    return sock, str(tmp_path / "notify")


@pytest.mark.parametrize("abstract", [False, True])
def test_the_server_tells_its_service_manager_it_is_ready_once_serving_and_when_it_stops(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, abstract: bool) -> None:
    manager, name = manager_socket(tmp_path, abstract)
    monkeypatch.setenv("NOTIFY_SOCKET", name)
    srv = ServerProcess(tmp_path)
    srv.queue_path.mkdir()
    (srv.queue_path / "jobs").write_bytes(codec.encode_addx(1_700_000_000_000, 0, b"held"))
    try:
        srv.start()
        assert manager.recv(4096) == b"STATUS=loading the queues"
        assert manager.recv(4096) == b"READY=1\nSTATUS=serving; queues: 1"
        with socket.create_connection(("127.0.0.1", srv.memcache_port), timeout=10) as client:
            client.sendall(b"get jobs\r\n")  # ready means serving: the port answers, the queue loaded
            assert client.recv(100) == b"VALUE jobs 0 4\r\nheld\r\nEND\r\n"
        assert srv.stop() == 0
        assert manager.recv(4096) == b"STOPPING=1\nSTATUS=stopping"
    finally:
        srv.stop()
        manager.close()
    assert manager_said_last(srv) is None


def manager_said_last(srv: ServerProcess) -> str | None:
    """A warning the server logged about its service manager, if any."""
    return next((line for line in srv.log().splitlines() if "cannot tell the service manager" in line), None)


def test_a_manager_socket_no_one_listens_on_is_a_warning_not_a_failed_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody"))
    srv = ServerProcess(tmp_path).start()
    try:
        with socket.create_connection(("127.0.0.1", srv.memcache_port), timeout=10) as client:
            client.sendall(b"version\r\n")
            assert client.recv(100).startswith(b"VERSION ")
    finally:
        assert srv.stop() == 0
    said = manager_said_last(srv)
    assert said is not None and "No such file or directory" in said
