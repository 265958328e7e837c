"""A connection's receives: between requests they wait for input before calling `recv`, so a client
that has not yet sent its next request costs no `recv` that finds nothing."""

from __future__ import annotations

import time
from typing import Any

import gevent
import gevent.socket
import pytest

from service.socket_io import Receiver


class CountingSocket:
    """The gevent socket, with its `recv_into` calls and what each found counted."""

    def __init__(self, sock: Any) -> None:
        self.sock = sock
        self.found: list[int | str] = []

    def fileno(self) -> int:
        return int(self.sock.fileno())

    def settimeout(self, timeout: float | None) -> None:
        self.sock.settimeout(timeout)

    def recv_into(self, buffer: Any) -> int:
        try:
            n = int(self.sock._sock.recv_into(buffer))  # the OS socket: what one system call finds
        except BlockingIOError:
            self.found.append("nothing")
            n = int(self.sock.recv_into(buffer))  # gevent's: waits, then reads
        self.found.append(n)
        return n


@pytest.fixture
def pair() -> Any:
    a, b = gevent.socket.socketpair()
    yield a, b
    a.close()
    b.close()


def test_between_requests_the_receive_waits_for_input_then_reads_once(pair: Any) -> None:
    server, client = pair
    sock = CountingSocket(server)
    receiver = Receiver(sock, 1024)  # type: ignore[arg-type]
    buf = bytearray()
    later = gevent.spawn_later(0.05, client.sendall, b"next request")
    assert receiver.receive(buf, None, between_requests=True) == 12
    assert buf == b"next request" and sock.found == [12]
    later.join()
    # Mid-request, the receive reads at once (the rest of a request is likely on its way).
    gevent.spawn_later(0.05, client.sendall, b"rest")
    assert receiver.receive(buf, 1.0) == 4
    assert sock.found == [12, "nothing", 4]
    receiver.close()


def test_after_a_receive_that_filled_the_buffer_the_next_reads_at_once(pair: Any,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    server, client = pair
    sock = CountingSocket(server)
    receiver = Receiver(sock, 8)  # type: ignore[arg-type]
    waits: list[float | None] = []
    real_wait = gevent.socket.wait

    def wait(watcher: Any, timeout: float | None = None) -> None:
        waits.append(timeout)
        real_wait(watcher, timeout)

    monkeypatch.setattr(gevent.socket, "wait", wait)
    client.sendall(b"0123456789")
    buf = bytearray()
    assert receiver.receive(buf, None, between_requests=True) == 8
    assert receiver.receive(buf, None, between_requests=True) == 2
    assert buf == b"0123456789" and sock.found == [8, 2]
    assert waits == [None]  # only before the first: it filled the buffer, so more was waiting
    receiver.close()


def test_a_wait_for_input_ends_at_its_timeout(pair: Any) -> None:
    server, _ = pair
    receiver = Receiver(server, 64)
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        receiver.receive(bytearray(), 0.05, between_requests=True)
    assert 0.04 < time.monotonic() - started < 1.0
    receiver.close()


def test_a_closed_client_is_a_receive_of_nothing(pair: Any) -> None:
    server, client = pair
    receiver = Receiver(server, 64)
    gevent.spawn_later(0.02, client.close)
    assert receiver.receive(bytearray(), None, between_requests=True) == 0
    receiver.close()
