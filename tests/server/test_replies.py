"""A connection's replies held for the disk (src/kestrel/service/replies.py): each goes out once the
changes it acknowledges are durable, in order, from the event loop; none goes out after a change
the disk could not keep."""

from __future__ import annotations

import errno
import os
import socket
import time
from functools import partial
from typing import Any

import gevent
import gevent.socket
import pytest

from kestrel.service.replies import Replies
from kestrel.service.session.stats import ServerStats
from kestrel.service.socket_io import ClientSocket, accepted
from kestrel.storage import acknowledgements
from kestrel.storage.commit_log import Turn  # what a holder's `last` is (a trait, `Settled`)
from tests.conftest import STALL_S


@pytest.fixture
def pair() -> Any:
    """(the connection's replies, the client's socket)."""
    a, b = gevent.socket.socketpair()
    server = accepted(a)
    replies = Replies(ClientSocket(server, 4096, send_timeout=STALL_S), ServerStats(started=0))
    yield replies, b
    server.close()
    b.close()


def settle(replies: Replies, turn: Turn) -> None:
    turn.settled = True
    replies.acks.settled()


def received(client: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = client.recv(size - len(data))
        if not chunk:
            break
        data += chunk
    return data


def nothing_waiting(client: socket.socket) -> bool:
    client.setblocking(False)
    try:
        client.recv(1)
    except BlockingIOError:
        return True
    finally:
        client.setblocking(True)
    return False


def test_a_reply_with_nothing_pending_goes_out_at_once(pair: Any) -> None:
    replies, client = pair
    replies.send(b"STORED\r\n")
    assert received(client, 8) == b"STORED\r\n"
    assert replies.stats.bytes_written == 8


def test_replies_wait_for_their_turn_and_go_out_together_in_order(pair: Any) -> None:
    replies, client = pair
    first, second = Turn(1), Turn(2)
    replies.acks.last = first
    replies.send(b"one\r\n")
    replies.send(b"peek\r\n")  # no change of its own: it waits behind the reply before it
    replies.acks.last = second
    replies.send(b"two\r\n")
    assert nothing_waiting(client) and replies.stats.bytes_written == 0
    settle(replies, first)
    assert received(client, 11) == b"one\r\npeek\r\n"
    assert nothing_waiting(client)
    settle(replies, second)
    assert received(client, 5) == b"two\r\n"
    replies.send(b"three\r\n")  # every turn settled: at once again
    assert received(client, 7) == b"three\r\n"


def test_pipelined_replies_over_three_turns_go_out_turn_by_turn_in_order(pair: Any) -> None:
    """Replies held behind the first: each turn settled sends those it releases, the rest wait on."""
    replies, client = pair
    turns = [Turn(1), Turn(2), Turn(3)]
    for n, turn in enumerate(turns):
        replies.acks.last = turn
        replies.send(b"%da\r\n" % n)
        replies.send(b"%db\r\n" % n)
    assert nothing_waiting(client)
    for n, turn in enumerate(turns):
        settle(replies, turn)
        assert received(client, 8) == b"%da\r\n%db\r\n" % (n, n)
        assert nothing_waiting(client)
    assert replies.stats.bytes_written == 24


def test_a_change_the_disk_could_not_keep_cuts_the_connection_off_without_its_reply(pair: Any) -> None:
    replies, client = pair
    turn = Turn(1)
    replies.acks.last = turn
    replies.send(b"STORED\r\n")
    replies.acks.failed = OSError(errno.EIO, "Input/output error")
    settle(replies, turn)
    client.settimeout(STALL_S)
    assert client.recv(100) == b""  # the end of the stream, and no acknowledgement
    replies.send(b"later\r\n")
    assert replies.cut_off and replies.stats.bytes_written == 0


def test_a_released_reply_larger_than_the_socket_takes_is_finished_in_order(pair: Any) -> None:
    replies, client = pair
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    replies.io.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    big = bytes(range(256)) * 2048  # 512 KiB: far more than the socket holds, less than HELD_BYTES
    turn = Turn(1)
    replies.acks.last = turn
    replies.send(big)
    settle(replies, turn)  # part goes at once, a greenlet sends the rest
    assert replies.full
    got = gevent.spawn(partial(received, client, len(big) + 5))
    replies.send(b"after")  # behind it, though nothing holds it: once the rest has had room
    assert got.get(timeout=STALL_S) == big + b"after"


def test_a_send_behind_a_reply_that_waits_for_room_waits_too(pair: Any) -> None:
    """A connection whose client does not read its replies is read no more: its next reply's send
    waits until the reply before it has had room (`wait_sent`), as its own send would."""
    replies, client = pair
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    replies.io.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    big = bytes(range(256)) * 4096
    replies.send_at_once(big)  # as a request answered in the hub sends its reply
    assert replies.full
    sending = gevent.spawn(partial(replies.send, b"after"))
    gevent.sleep(0.05)
    assert not sending.dead  # waits while nothing is read
    got = gevent.spawn(partial(received, client, len(big) + 5))
    assert got.get(timeout=STALL_S) == big + b"after"
    sending.join(STALL_S)
    assert sending.dead and not replies.full


def test_a_reply_released_to_a_client_that_is_gone_cuts_the_connection_off(pair: Any) -> None:
    replies, client = pair
    turn = Turn(1)
    replies.acks.last = turn
    replies.send(b"STORED\r\n")
    # The client hung up while its reply waited for the disk: its descriptor closed now (gevent's
    # `close` defers it to a turn of the loop when libev still knows the number from an earlier test).
    os.close(client.detach())
    settle(replies, turn)
    assert replies.cut_off
    replies.send(b"END\r\n")  # nothing more is sent, nor raised
    replies.finish()


def test_finish_waits_until_the_held_replies_are_out(pair: Any) -> None:
    replies, client = pair
    turn = Turn(1)
    replies.acks.last = turn
    replies.send(b"STORED\r\n")
    finishing = gevent.spawn(replies.finish)
    gevent.sleep(0.01)
    assert not finishing.dead
    settle(replies, turn)
    finishing.join(STALL_S)
    assert finishing.dead and received(client, 8) == b"STORED\r\n"


def test_hold_is_per_greenlet(pair: Any) -> None:
    replies, _ = pair

    def connection() -> object:
        replies.hold()
        gevent.sleep(0)
        return acknowledgements.holder()

    assert gevent.spawn(connection).get() is replies.acks
    assert gevent.spawn(acknowledgements.holder).get() is None  # another greenlet holds nothing


@pytest.mark.parametrize("protocol", ["memcache", "thrift"])
def test_a_connection_that_ended_leaves_its_greenlet_holding_nothing(server_state: Any, protocol: str) -> None:
    """A connection served in a greenlet that lives on (an embedding, a benchmark) gives the holder
    back when it ends: later changes made there wait for the disk again, as a library caller's do."""
    from kestrel.service.memcache.handler import MemcacheConnection
    from kestrel.service.thrift.handler import ThriftConnection
    from tests.support.thrift_wire import encode_call, framed

    server = server_state
    ours, theirs = gevent.socket.socketpair()
    if protocol == "memcache":
        connection: Any = MemcacheConnection(server, ours, "test")
        theirs.sendall(b"set q 0 0 1\r\nx\r\n")
    else:
        connection = ThriftConnection(server, ours, "test")
        theirs.sendall(framed(encode_call("binary", "put", queue_name="q", items=[b"x"], expiration_msec=0)))
    theirs.shutdown(socket.SHUT_WR)

    def serve() -> object:
        connection.run()
        return acknowledgements.holder()

    try:
        assert gevent.spawn(serve).get(timeout=STALL_S) is None
        assert theirs.recv(4096)  # the reply went out once its change was durable
    finally:
        theirs.close()


def test_a_held_reply_handing_out_reads_to_a_client_gone_meanwhile_is_withheld_with_those_after_it(pair: Any) -> None:
    """Released together, the replies before it go out (a half-closed client reads them); it and
    every reply after it are not sent, and each one's read ids are handed back to be put back."""
    replies, client = pair
    asked: list[list[int]] = []
    gone = [False]

    def withhold(read_ids: list[int]) -> bool:
        asked.append(read_ids)
        return gone[0]

    replies.hold(withhold)
    try:
        turn = Turn(1)
        replies.acks.last = turn
        replies.send(b"put\r\n")
        replies.hands_out([7, 8])
        replies.send(b"get\r\n")
        replies.hands_out([9])
        replies.send(b"later\r\n")
        gone[0] = True  # the client ended its stream while the round ran
        settle(replies, turn)
        assert received(client, 5) == b"put\r\n" and nothing_waiting(client)
        assert asked == [[7, 8], [9]] and replies.cut_off
        replies.send(b"more\r\n")
        assert nothing_waiting(client)
    finally:
        replies.finish()
        replies.release()


def test_a_held_reply_handing_out_reads_to_a_client_still_there_goes_out(pair: Any) -> None:
    replies, client = pair
    asked: list[list[int]] = []
    replies.hold(lambda read_ids: bool(asked.append(read_ids)))
    try:
        turn = Turn(1)
        replies.acks.last = turn
        replies.hands_out([7])
        replies.send(b"get\r\n")
        replies.send(b"put\r\n")
        settle(replies, turn)
        assert received(client, 10) == b"get\r\nput\r\n" and asked == [[7]] and not replies.cut_off
        replies.hands_out([8])
        replies.send(b"now\r\n")  # nothing held: out at once, its client asked nothing
        assert received(client, 5) == b"now\r\n" and asked == [[7]]
    finally:
        replies.release()


def test_a_connection_whose_reply_waits_for_the_disk_is_not_idle_until_it_has_gone_out() -> None:
    """`client_timeout` counts the silence of a client that owes the next request: one waiting for a
    reply held for a slow fsync is waiting for the server, and its idle time starts once the reply has
    gone out (a 2 s fsync closed connections with a 1 s client_timeout under every write)."""
    a, client = gevent.socket.socketpair()
    io = ClientSocket(accepted(a), 4096, idle_timeout=0.2)
    replies = Replies(io, ServerStats(started=0))
    turn = Turn(1)
    replies.acks.last = turn
    replies.send(b"STORED\r\n")  # held for the turn's fsync
    gevent.spawn_later(0.5, partial(settle, replies, turn))  # the fsync takes longer than the idle time-out
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        io.receive(bytearray(), between_requests=True)
    assert received(client, 8) == b"STORED\r\n"
    assert 0.5 + 0.2 <= time.monotonic() - started < STALL_S  # idle from the reply on, not from the request
    a.close()
    client.close()
