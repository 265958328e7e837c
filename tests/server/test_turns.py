"""A connection's turn (src/kestrel/service/turns.py): it starts again at each wait for the client,
its clock at the first check after that wait, so a request/response client's checks read no clock."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kestrel.service import turns
from kestrel.service.socket_io import ClientSocket, accepted
from kestrel.service.turns import TURN, Turns


@pytest.fixture
def io() -> Iterator[ClientSocket]:
    a, b = socket.socketpair()
    client = ClientSocket(accepted(a), 4096)
    yield client
    client.sock.close()
    b.close()


def test_a_turn_is_over_a_turn_after_its_first_check_and_starts_again_at_each_wait(io: ClientSocket) -> None:
    connection = Turns(io)
    assert not connection.over()  # its clock starts here
    time.sleep(TURN * 2)
    assert connection.over()
    io.waited = True  # the connection waited for its client: a new turn
    assert not connection.over()
    assert not io.waited
    assert not connection.over()  # the new turn's clock starts here
    time.sleep(TURN * 2)
    assert connection.over()
    connection.step_aside()
    assert not connection.over()  # after stepping aside too, a new turn from its first check


@pytest.mark.pure_build
def test_a_client_that_waits_before_each_request_has_its_turn_checked_without_a_clock(
        io: ClientSocket, monkeypatch: pytest.MonkeyPatch) -> None:
    readings: list[float] = []
    clock = turns.perf_counter

    def counted() -> Any:
        readings.append(1)
        return clock()

    monkeypatch.setattr(turns, "perf_counter", counted)
    connection = Turns(io)
    for _ in range(10):  # each request follows a wait: its check after it finds the wait
        io.waited = True
        assert not connection.over()
    assert readings == []
    assert not connection.over()  # a request without a wait before it: the turn's clock starts
    assert readings == [1]
