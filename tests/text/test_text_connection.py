"""A text connection on a socket pair, in this process: how it reads lines split across receives,
and what a large put block answers when a step after its first is refused."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest

from kestrel.service.buffered_connection import CloseConnection
from kestrel.service.text.handler import PUT_STEP, TextConnection
from kestrel.storage.errors import RefusedByStatus


@pytest.fixture
def connection(server_state: Any) -> Iterator[tuple[TextConnection, socket.socket]]:
    ours, theirs = socket.socketpair()
    ours.setblocking(False)  # as the listener hands a connection its socket
    try:
        yield TextConnection(server_state, ours, "test"), theirs
    finally:
        ours.close()
        theirs.close()


def _answer(connection: TextConnection, theirs: socket.socket, *receives: bytes) -> bytes:
    """What the connection answers `receives`, each processed as it arrives."""
    buf = bytearray()
    for data in receives:
        buf += data
        del buf[:connection.process(buf)]
    connection.send()
    theirs.settimeout(5)
    return theirs.recv(65536)


def test_a_line_of_max_line_length_is_read_whichever_receive_its_line_end_comes_in(
        connection: tuple[TextConnection, socket.socket]) -> None:
    text, theirs = connection
    longest = b"a" * text.max_line
    assert _answer(text, theirs, b"put q:\n" + longest + b"\r\n\n") == b"+1\n"
    assert _answer(text, theirs, b"put q:\n" + longest + b"\r", b"\n\n") == b"+1\n"
    assert _answer(text, theirs, b"put q:\n" + longest, b"\r", b"\n\n") == b"+1\n"
    with pytest.raises(CloseConnection):  # one byte more, its line end still to come: refused
        text.process(bytearray(b"a" * (text.max_line + 1) + b"\r"))


@pytest.mark.pure_build
def test_a_put_block_refused_after_its_first_steps_answers_the_count_stored(
        connection: tuple[TextConnection, socket.socket], monkeypatch: pytest.MonkeyPatch) -> None:
    """A client told `+<n>` sends the rest again; told an error, it would send all of it again and
    store its first steps twice."""
    text, theirs = connection
    put = text.session.put
    steps: list[int] = []

    def readonly_after_two_steps(queue: str, items: list[bytes], expiry_ms: int = 0) -> int:
        steps.append(len(items))
        if len(steps) > 2:
            raise RefusedByStatus("put refused: server is ReadOnly")
        return put(queue, items, expiry_ms)

    monkeypatch.setattr(text.session, "put", readonly_after_two_steps)
    block = b"put q:\n" + b"item\n" * (3 * PUT_STEP) + b"\n"
    assert _answer(text, theirs, block) == b"+%d\n" % (2 * PUT_STEP)
    assert text.server.collection.queue("q").length == 2 * PUT_STEP
    # Refused at its first step, nothing was stored: the refusal is the answer.
    assert _answer(text, theirs, b"put q:\nitem\n\n") == b"-put refused: server is ReadOnly\n"


def test_a_large_put_block_is_stored_whole_and_in_order(connection: tuple[TextConnection, socket.socket]) -> None:
    text, theirs = connection
    items = [b"%06d" % n for n in range(3 * PUT_STEP + 7)]
    assert _answer(text, theirs, b"put q:\n" + b"\n".join(items) + b"\n\n") == b"+%d\n" % len(items)
    taken = text.server.collection.remove("q", len(items))
    assert [item.data for item in taken] == items
