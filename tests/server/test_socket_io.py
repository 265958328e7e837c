"""A connection's socket I/O: between requests a receive waits for input before calling `recv`, so a
client that has not yet sent its next request costs no `recv` that finds nothing; sends that do not
fit wait for the client to read, at most `send_timeout`; a closing connection shuts its sending
side and reads what its client still sends, within bounds, before it closes."""

from __future__ import annotations

import socket
import struct
import sys
import time
from functools import partial
from typing import Any

import gevent
import gevent.socket
import pytest
from gevent.exceptions import BlockingSwitchOutError, ConcurrentObjectUseError

from kestrel.service import socket_io
from kestrel.service.socket_io import LINGER_S, ClientSocket, SendTimeout, accepted, close_lingering
from tests.conftest import STALL_S


@pytest.fixture
def receives(monkeypatch: pytest.MonkeyPatch) -> list[int | str]:
    """What each receive through the scratch buffer found (`socket_io._receive_appending` counted)."""
    found: list[int | str] = []
    receive = socket_io._receive_appending

    def counted(fd: int, buf: bytearray, chunk: int) -> int:
        n = receive(fd, buf, chunk)
        found.append("nothing" if n < 0 else n)
        return n

    monkeypatch.setattr(socket_io, "_receive_appending", counted)
    return found


@pytest.fixture
def pair() -> Any:
    """(server side, client side): the server side as the listener hands it to a connection."""
    a, b = gevent.socket.socketpair()
    server = accepted(a)
    yield server, b
    server.close()
    b.close()


def test_the_accepted_socket_is_the_os_socket_in_non_blocking_mode(pair: Any) -> None:
    server, _ = pair
    assert type(server) is not gevent.socket.socket and server.gettimeout() == 0.0
    with pytest.raises(BlockingIOError):
        server.recv(1)


def test_between_requests_the_receive_waits_for_input_then_reads_once(pair: Any, receives: list[int | str]) -> None:
    server, client = pair
    io = ClientSocket(server, 1024)
    buf = bytearray()
    later = gevent.spawn_later(0.05, partial(client.sendall, b"next request"))
    assert io.receive(buf, None, between_requests=True) == 12
    assert buf == b"next request" and receives == [12]
    later.join()
    # Mid-request, the receive reads at once (the rest of a request is likely on its way).
    gevent.spawn_later(0.05, partial(client.sendall, b"rest"))
    assert io.receive(buf, 1.0) == 4
    assert receives == [12, "nothing", 4]
    io.close()


@pytest.mark.skipif(socket_io.receive_in_place is None, reason="built without a C compiler: no receive in place")
def test_from_a_large_receive_on_input_lands_in_place_and_a_receive_that_finds_nothing_leaves_it(
        pair: Any) -> None:
    server, client = pair
    io = ClientSocket(server, socket_io.MAX_CHUNK)
    buf = bytearray()
    client.sendall(b"s" * 100)
    assert io.receive(buf, 1.0) == 100 and not io.in_place  # a small receive: through the scratch
    client.sendall(b"L" * socket_io.IN_PLACE_FROM)
    assert io.receive(buf, 1.0) == socket_io.IN_PLACE_FROM and io.in_place
    socket_io._SCRATCH[:] = bytes(len(socket_io._SCRATCH))
    gevent.spawn_later(0.05, partial(client.sendall, b"rest"))
    io.waited = False
    assert io.receive(buf, 1.0) == 4 and io.waited  # found nothing first, then waited
    assert buf == b"s" * 100 + b"L" * socket_io.IN_PLACE_FROM + b"rest"
    assert not any(socket_io._SCRATCH[:16]), "the input went through the scratch buffer"
    # The room starts at IN_PLACE_LEAST_ROOM and doubles each time a receive fills it, up to
    # IN_PLACE_ROOM; what a receive did not fill is not kept.
    least, most = socket_io.IN_PLACE_LEAST_ROOM, socket_io.IN_PLACE_ROOM
    assert 8 * least < most < 16 * least
    sizes = []
    for _ in range(3):
        client.sendall(b"x" * (most + 10))
        sizes.append(io.receive(buf, 1.0))
        while not io.drained:
            sizes.append(io.receive(buf, 1.0))
    assert sizes == [least, 2 * least, 4 * least, most + 10 - 7 * least,  # filled thrice: doubled
                     8 * least, most + 10 - 8 * least,  # once more, to the most
                     most, 10]  # and no more
    assert len(buf) == 100 + socket_io.IN_PLACE_FROM + 4 + 3 * (most + 10)
    io.close()


@pytest.mark.skipif(socket_io.receive_in_place is None, reason="built without a C compiler: no receive in place")
def test_a_connection_of_1_kb_requests_receives_each_into_the_block_it_keeps(pair: Any) -> None:
    """Once it receives in place, a connection of 1 KB requests and small ones makes its room once:
    each request lands in the block its input keeps when answered, which neither grows nor shrinks."""
    server, client = pair
    io = ClientSocket(server, socket_io.MAX_CHUNK)
    buf = bytearray()
    client.sendall(bytes(1100))
    assert io.receive(buf, 1.0) == 1100 and io.in_place  # through the scratch buffer, the last time
    socket_io.drop_answered(buf, 1100)
    client.sendall(bytes(1100))
    assert io.receive(buf, 1.0) == 1100  # in place: room made
    held = sys.getsizeof(buf)
    assert held < 2 * socket_io.IN_PLACE_LEAST_ROOM
    for request in (b"get q", bytes(range(256)) * 4, b"g", bytes(1100)):
        socket_io.drop_answered(buf, len(buf))
        assert buf == b"" and sys.getsizeof(buf) == held
        client.sendall(request)
        assert io.receive(buf, 1.0) == len(request) and buf == request and bytes(buf) == request
        assert sys.getsizeof(buf) == held
    io.close()


def test_after_a_receive_that_filled_the_buffer_the_next_reads_at_once(pair: Any, receives: list[int | str]) -> None:
    server, client = pair
    io = ClientSocket(server, 8)
    client.sendall(b"0123456789")
    buf = bytearray()
    assert io.receive(buf, None, between_requests=True) == 8
    assert io.waited  # between requests, a receive first waits for the socket to be readable
    io.waited = False
    assert io.receive(buf, None, between_requests=True) == 2
    assert not io.waited  # not this one: the first filled the buffer, so more was waiting
    assert buf == b"0123456789" and receives == [8, 2]
    io.close()


def test_a_receive_killed_in_its_wait_leaves_the_watcher_stopped_for_the_next(pair: Any) -> None:
    server, client = pair
    io = ClientSocket(server, 64)
    waiting = gevent.spawn(partial(io.receive, bytearray(), None, True))
    gevent.sleep(0.01)
    assert io._readable is not None and io._readable.watcher.active
    waiting.kill()
    assert not io._readable.watcher.active and io._readable.watcher.callback is None
    client.sendall(b"after")
    buf = bytearray()
    assert io.receive(buf, None, between_requests=True) == 5 and buf == b"after"
    io.close()


def test_two_receives_waiting_on_one_socket_is_refused_by_name(pair: Any) -> None:
    server, client = pair
    io = ClientSocket(server, 64)
    first = gevent.spawn(partial(io.receive, bytearray(), None, True))
    gevent.sleep(0.01)
    with pytest.raises(ConcurrentObjectUseError, match="already waited for"):
        io.receive(bytearray(), None, between_requests=True)
    client.sendall(b"x")
    assert first.get(timeout=STALL_S) == 1
    io.close()


def test_a_wait_from_the_event_loop_s_own_greenlet_is_refused_and_starts_no_watcher(pair: Any) -> None:
    """The hub cannot wait for a socket (nothing would switch back to it): refused as gevent's own
    `switch` refuses it, before the watcher starts; a connection's wait afterwards is untouched."""
    server, client = pair
    io = ClientSocket(server, 64)
    refused: list[BaseException] = []

    def from_the_hub() -> None:
        try:
            io.receive(bytearray(), None, between_requests=True)
        except BlockingSwitchOutError as e:
            refused.append(e)

    gevent.get_hub().loop.run_callback(from_the_hub)
    gevent.sleep(0.01)
    watcher = io._readable.watcher  # type: ignore[union-attr]
    assert len(refused) == 1 and not watcher.active and watcher.callback is None
    client.sendall(b"x")
    assert io.receive(bytearray(), None, between_requests=True) == 1
    io.close()


def test_a_wait_for_input_ends_at_its_timeout(pair: Any) -> None:
    """Within a request at the receive's `timeout`; between requests at the idle time-out."""
    server, _ = pair
    io = ClientSocket(server, 64, idle_timeout=0.05)
    for between_requests in (True, False):
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            io.receive(bytearray(), None if between_requests else 0.05, between_requests=between_requests)
        assert 0.04 < time.monotonic() - started < STALL_S
    io.close()


def test_waits_between_requests_with_input_inside_the_idle_time_out_outlast_its_first_deadline(pair: Any) -> None:
    """One timer checks the idle time-out, armed at the first wait and left running: it finds each
    later wait within its time and arms itself for the rest (a stall of 0.3 s in the client would
    close it: real time); the wait that gets no input ends no sooner than the time-out."""
    server, client = pair
    io = ClientSocket(server, 64, idle_timeout=0.5)
    started = time.monotonic()
    for _ in range(5):
        gevent.spawn_later(0.2, partial(client.sendall, b"x"))
        assert io.receive(bytearray(), between_requests=True) == 1
    assert time.monotonic() - started > 0.5  # past the first wait's deadline
    last = time.monotonic()
    with pytest.raises(TimeoutError):
        io.receive(bytearray(), between_requests=True)
    assert 0.5 <= time.monotonic() - last < STALL_S
    io.close()


# The system calls of each request: the C helper's and their Python twins, which must answer alike.
RECEIVES = [pytest.param(socket_io.receive_appending, id="python")] + (
    [] if socket_io._c_receive is None else [pytest.param(socket_io._c_receive, id="c")])
SENDS = [pytest.param(socket_io.send_some, id="python")] + (
    [] if socket_io._c_send is None else [pytest.param(socket_io._c_send, id="c")])


@pytest.mark.parametrize("receive", RECEIVES)
def test_a_receive_appends_what_came_and_answers_nothing_yet_and_the_end_with_numbers(
        pair: Any, receive: Any) -> None:
    server, client = pair
    buf = bytearray(b"held")
    assert receive(server.fileno(), buf, 64) == -1 and buf == b"held"  # nothing yet: no exception
    client.sendall(b"0123456789")
    assert receive(server.fileno(), buf, 4) == 4 and buf == b"held0123"  # at most `chunk`
    assert receive(server.fileno(), buf, 64) == 6 and buf == b"held0123456789"
    client.close()
    assert receive(server.fileno(), buf, 64) == 0 and buf == b"held0123456789"  # the end of the stream
    with pytest.raises(ValueError, match="receive chunk 0 is not within"):
        receive(server.fileno(), buf, 0)


@pytest.mark.parametrize("send", SENDS)
def test_a_send_answers_what_the_socket_took_and_no_room_with_zero(pair: Any, send: Any) -> None:
    server, client = pair
    assert send(server.fileno(), b"reply") == 5 and client.recv(64) == b"reply"
    assert send(server.fileno(), memoryview(b"a reply")[2:]) == 5 and client.recv(64) == b"reply"
    server.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    taken = [send(server.fileno(), bytes(65536)) for _ in range(64)]
    assert taken[0] > 0 and taken[-1] == 0  # full: no room, and no exception
    client.close()
    with pytest.raises(OSError):  # the client is gone (EPIPE, or a reset of what it left unread)
        send(server.fileno(), b"reply")


DROPS = [pytest.param(socket_io._drop_answered, id="python")] + (
    [] if socket_io._c_drop_answered is None else [pytest.param(socket_io._c_drop_answered, id="c")])


@pytest.mark.parametrize("drop", DROPS)
def test_dropping_answered_input_leaves_what_del_leaves_and_a_receive_appends_after_it(drop: Any) -> None:
    for size in (0, 1, 150, 1024, 5000):
        data = bytes(i % 251 for i in range(size))
        for end in sorted({0, 1, size // 2, size - 1, size, size + 3} - {-1}):
            buf = bytearray(data)
            drop(buf, end)
            assert buf == data[end:]
            buf += b"next request"
            assert buf == data[end:] + b"next request"
    buf = bytearray(data[:150])
    drop(buf, 100)  # a partial request left, then answered with what came after it
    buf += b"rest"
    drop(buf, len(buf))
    assert buf == b""
    buf += b"next"
    assert buf == b"next" and bytes(buf) == b"next"
    buf = bytearray(b"held by a reader")
    with memoryview(buf), pytest.raises(BufferError):  # as `del` refuses: a view would see it change
        drop(buf, len(buf))
    assert buf == b"held by a reader"


@pytest.mark.skipif(socket_io._c_drop_answered is None, reason="built without a C compiler")
def test_input_emptied_keeps_a_small_request_s_block_and_lets_a_large_one_go() -> None:
    drop = socket_io.drop_answered
    buf = bytearray()
    buf += bytes(150)
    held = sys.getsizeof(buf)
    drop(buf, 150)
    assert buf == b"" and sys.getsizeof(buf) == held  # kept for the next request
    buf += bytes(150)
    assert sys.getsizeof(buf) == held  # which found its room there
    buf += bytes(100_000)
    drop(buf, len(buf))
    assert buf == b"" and sys.getsizeof(buf) < held  # a large request's block is not held on to


@pytest.mark.skipif(socket_io._c_receive is None, reason="built without a C compiler")
def test_requests_of_any_size_received_into_a_kept_block_leave_it_as_it_is(pair: Any) -> None:
    """A put's request then a get's (under half its size) then a put's again land in the block the
    first kept, which neither shrinks nor grows; a request larger than the block still grows it,
    and a view held over the buffer still refuses any change."""
    server, client = pair
    receive, drop = socket_io._c_receive, socket_io.drop_answered
    buf = bytearray()
    client.sendall(bytes(range(150)))
    assert receive(server.fileno(), buf, 4096) == 150
    drop(buf, 150)
    held = sys.getsizeof(buf)
    for request in (b"get" * 20, bytes(range(150)), b"g"):
        client.sendall(request)
        assert receive(server.fileno(), buf, 4096) == len(request)
        assert buf == request and bytes(buf) == request and sys.getsizeof(buf) == held
        drop(buf, len(buf))
    client.sendall(b"first")
    assert receive(server.fileno(), buf, 4096) == 5
    client.sendall(b" and the rest")
    assert receive(server.fileno(), buf, 4096) == 13 and buf == b"first and the rest"
    client.sendall(bytes(600))
    assert receive(server.fileno(), buf, 4096) == 600 and sys.getsizeof(buf) > held
    assert buf == b"first and the rest" + bytes(600)
    client.sendall(b"more")
    with memoryview(buf), pytest.raises(BufferError):
        receive(server.fileno(), buf, 4096)


@pytest.mark.skipif(socket_io.receive_in_place is None, reason="built without a C compiler: no receive in place")
def test_a_receive_in_place_lands_after_the_input_and_keeps_its_room_for_the_next(pair: Any) -> None:
    """Input received in place follows what the buffer held, with nothing past it; the room made
    stays the buffer's block for the next receive, and for the next request when it is small, a
    large one given back with the answered input; nothing there leaves the buffer as it was; a view
    held over it refuses, the input left in the socket."""
    server, client = pair
    receive_in_place, drop, fd = socket_io.receive_in_place, socket_io.drop_answered, server.fileno()
    assert receive_in_place is not None
    buf = bytearray(b"held")
    assert receive_in_place(fd, buf, 4096) == -1 and buf == b"held"
    client.sendall(bytes(range(200)))
    assert receive_in_place(fd, buf, 4096) == 200 and buf == b"held" + bytes(range(200))
    block = sys.getsizeof(buf)
    assert block > 4096  # the room, kept
    client.sendall(b"rest")  # room for it in that block: received there, the block as it was
    assert receive_in_place(fd, buf, 1024) == 4 and buf == b"held" + bytes(range(200)) + b"rest"
    assert sys.getsizeof(buf) == block and bytes(buf) == b"held" + bytes(range(200)) + b"rest"
    drop(buf, len(buf))
    assert buf == b"" and sys.getsizeof(buf) == block  # a small block, kept for the next request
    client.sendall(b"next")
    assert receive_in_place(fd, buf, 4096) == 4 and buf == b"next" and sys.getsizeof(buf) == block
    assert receive_in_place(fd, buf, 32 * 1024) == -1 and buf == b"next"  # room beyond the block's
    large = sys.getsizeof(buf)
    assert large > 32 * 1024
    drop(buf, len(buf))
    assert buf == b"" and sys.getsizeof(buf) < block  # a large block: given back with the answered input
    client.sendall(b"more")
    with memoryview(buf), pytest.raises(BufferError):
        receive_in_place(fd, buf, 4096)
    assert receive_in_place(fd, buf, 4096) == 4 and buf == b"more"
    with pytest.raises(OSError):
        receive_in_place(-1, buf, 64)
    with pytest.raises(ValueError):
        receive_in_place(fd, buf, 0)


@pytest.mark.parametrize(("receive", "send"), [pytest.param(r.values[0], s.values[0], id=r.id)
                                               for r, s in zip(RECEIVES, SENDS, strict=True)])
def test_a_receive_or_send_on_a_closed_descriptor_raises_oserror(receive: Any, send: Any) -> None:
    with pytest.raises(OSError):
        receive(-1, bytearray(), 64)
    with pytest.raises(OSError):
        send(-1, b"reply")


def test_a_closed_connection_reaches_no_socket_that_reused_its_descriptor(pair: Any) -> None:
    """A reply sent after the connection closed (a late one) fails; it never goes to whichever
    connection the kernel gave the descriptor's number next."""
    server, client = pair
    io = ClientSocket(server, 64)
    number = server.fileno()
    io.close()
    server.close()
    reused, other_client = socket.socketpair()
    try:
        if reused.fileno() != number:
            reused, other_client = other_client, reused
        assert reused.fileno() == number  # the kernel hands out the lowest free number
        with pytest.raises(OSError):
            io.send_all(b"late reply")
        with pytest.raises(OSError):
            io.receive(bytearray(), 0.05)
        other_client.setblocking(False)
        with pytest.raises(BlockingIOError):
            other_client.recv(64)
    finally:
        reused.close()
        other_client.close()


def test_a_closed_client_is_a_receive_of_nothing(pair: Any) -> None:
    server, client = pair
    io = ClientSocket(server, 64)
    gevent.spawn_later(0.02, client.close)
    assert io.receive(bytearray(), None, between_requests=True) == 0
    io.close()


def test_a_receive_that_finds_the_end_of_the_stream_says_the_client_ended(pair: Any) -> None:
    """What lets the listener close at once, without lingering: nothing is left unread."""
    server, client = pair
    io = ClientSocket(server, 1024)
    client.sendall(b"version\r\n")
    buf = bytearray()
    assert io.receive(buf, between_requests=True) == 9 and not io.ended
    client.close()
    assert io.receive(buf, between_requests=True) == 0 and io.ended


def test_whether_the_client_ended_is_found_without_waiting_or_receiving(pair: Any) -> None:
    """Asked before a reply whose reads outlive the connection (a Thrift get with auto-abort), in
    the request's turn or from the event loop: what the client sent stays for the connection to
    read, and its end is seen behind it."""
    server, client = pair
    io = ClientSocket(server, 1024)
    assert not io.ended_now()  # nothing there: no wait
    assert not io.waited  # a look, not a wait for the client (src/kestrel/service/turns.py)
    client.sendall(b"next")
    assert not io.ended_now()  # more to come, not the end
    client.sendall(b" last")
    client.close()
    assert io.ended_now() and not io.ended  # seen behind the input not yet read
    buf = bytearray()
    assert io.receive(buf) == 9 and buf == b"next last"  # left where it was, for the connection
    assert io.receive(buf) == 0 and io.ended_now()
    io.close()
    assert io.ended_now()  # closed: nobody to hand anything to


def test_a_client_that_reset_its_connection_has_ended(tcp_pair: Any) -> None:
    server, client = tcp_pair
    io = ClientSocket(server, 1024)
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    client.close()  # lingering 0 s: a reset rather than the end of a stream
    deadline = time.monotonic() + STALL_S
    while not io.ended_now():
        assert time.monotonic() < deadline, "the reset was never seen"
        gevent.sleep(0.01)
    io.close()


@pytest.mark.skipif(socket_io.receive_in_place is None, reason="built without a C compiler: no receive in place")
def test_a_receive_in_place_that_finds_the_end_of_the_stream_says_the_client_ended(pair: Any) -> None:
    server, client = pair
    io = ClientSocket(server, 64 * 1024)
    client.sendall(bytes(socket_io.IN_PLACE_FROM))
    buf = bytearray()
    assert io.receive(buf, between_requests=True) == socket_io.IN_PLACE_FROM
    assert io.in_place and not io.ended
    client.close()
    assert io.receive(buf, between_requests=True) == 0 and io.ended


def test_a_reply_larger_than_the_socket_takes_goes_out_whole_as_the_client_reads(pair: Any) -> None:
    server, client = pair
    server.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    io = ClientSocket(server, 64, send_timeout=5.0)
    reply = bytes(range(256)) * 4096  # 1 MiB: many times what the socket buffers hold
    received = bytearray()

    def read_slowly() -> None:
        while len(received) < len(reply):
            gevent.sleep(0.001)
            received.extend(client.recv(65536))

    reader = gevent.spawn(read_slowly)
    io.send_all(reply)
    reader.join(timeout=10)
    assert bytes(received) == reply
    io.close()


def test_a_client_that_stops_reading_holds_a_send_no_longer_than_send_timeout(pair: Any) -> None:
    server, _ = pair
    io = ClientSocket(server, 64, send_timeout=0.1)
    started = time.monotonic()
    with pytest.raises(SendTimeout):
        io.send_all(bytes(16 * 1024 * 1024))  # nobody reads: the buffers fill, then the wait times out
    assert 0.09 < time.monotonic() - started < 5.0
    io.close()


def test_while_one_greenlet_waits_for_input_another_may_take_over_after_it_is_killed(pair: Any) -> None:
    """What a memcache connection does during a blocking get: a watcher greenlet waits on the socket,
    and is killed before the connection reads again."""
    server, client = pair
    io = ClientSocket(server, 64)
    inbox = bytearray()
    watcher = gevent.spawn(partial(io.receive, inbox, None))
    gevent.sleep(0.02)
    watcher.kill()
    client.sendall(b"after")
    buf = bytearray()
    assert io.receive(buf, 1.0, between_requests=True) == 5 and buf == b"after"
    io.close()


@pytest.fixture
def tcp_pair() -> Any:
    """(server side, client side) of a TCP connection on the loopback (its resets are TCP's)."""
    with gevent.socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen(1)
        client = gevent.socket.create_connection(listening.getsockname())
        server = accepted(listening.accept()[0])
    yield server, client
    server.close()
    client.close()


def _read_to_the_end(sock: Any) -> tuple[bytes, bool]:
    """What `sock` receives until the end of the stream, and whether a reset ended it instead."""
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        return received, True
    return received, False


def test_a_lingering_close_delivers_the_last_reply_to_a_client_still_sending(tcp_pair: Any) -> None:
    server, client = tcp_pair
    server.send(b"CLIENT_ERROR line too long\r\n")
    closing = gevent.spawn(partial(close_lingering, server))
    client.sendall(bytes(256 * 1024))  # pipelined behind the request at fault: read and dropped
    assert _read_to_the_end(client) == (b"CLIENT_ERROR line too long\r\n", False)
    client.close()
    closing.join(STALL_S)
    assert closing.successful() and server.fileno() < 0


def test_a_lingering_close_of_a_client_that_ended_first_takes_no_wait(tcp_pair: Any) -> None:
    server, client = tcp_pair
    client.close()
    started = time.monotonic()
    close_lingering(server)
    assert time.monotonic() - started < LINGER_S and server.fileno() < 0


def test_a_client_that_keeps_sending_holds_a_lingering_close_no_more_than_its_bytes(tcp_pair: Any) -> None:
    server, client = tcp_pair
    sent = [0]

    def flood() -> None:
        try:
            while True:
                sent[0] += client.send(bytes(16 * 1024))
        except OSError:
            pass  # reset: the server gave up reading

    flooding = gevent.spawn(flood)
    closing = gevent.spawn(partial(close_lingering, server, 600.0, 64 * 1024))
    closing.join(STALL_S)
    assert closing.successful() and server.fileno() < 0
    flooding.join(STALL_S)
    assert flooding.dead and sent[0] >= 64 * 1024


def test_a_client_that_neither_sends_nor_closes_holds_a_lingering_close_no_longer_than_its_time(
        tcp_pair: Any) -> None:
    server, client = tcp_pair
    started = time.monotonic()
    closing = gevent.spawn(partial(close_lingering, server, 0.1))
    client.settimeout(STALL_S)
    assert client.recv(100) == b""  # the end of the stream at once: the server's side is shut
    closing.join(STALL_S)
    assert closing.successful() and server.fileno() < 0
    assert 0.09 < time.monotonic() - started < STALL_S


def test_a_lingering_close_takes_gevents_socket_too(tcp_pair: Any) -> None:
    """The admin port's connections are gevent's sockets (its WSGI server needs them)."""
    server, client = tcp_pair
    cooperative = gevent.socket.socket(fileno=server.detach())
    cooperative.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
    closing = gevent.spawn(partial(close_lingering, cooperative))
    client.sendall(bytes(64 * 1024))
    assert _read_to_the_end(client) == (b"HTTP/1.1 400 Bad Request\r\n\r\n", False)
    client.close()
    closing.join(STALL_S)
    assert closing.successful() and cooperative.fileno() < 0
