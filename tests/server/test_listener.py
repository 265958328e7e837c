"""The shared accept loop: out of file descriptors it waits calmly and serves again once some return;
a connection it closes on a protocol error delivers its last reply, whatever the client sent after."""

from __future__ import annotations

import json
import socket
import time
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import gevent
import gevent.event
import gevent.socket
import pytest

from kestrel.service import listener
from kestrel.service.listener import Listener
from kestrel.service.memcache.handler import MemcacheConnection
from kestrel.service.session.server_state import ServerState
from kestrel.service.socket_io import ClientSocket, accepted
from kestrel.service.text.handler import TextConnection
from kestrel.service.thrift.handler import ThriftConnection
from kestrel.service.thrift.messages import METHODS
from tests.conftest import STALL_S, ServerProcess, wait_until
from tests.support.thrift_wire import decode_reply, encode_call, framed
from tests.support.wire import readable_now


def _refusals(srv: ServerProcess) -> list[dict[str, Any]]:
    events = [json.loads(line) for line in srv.log().splitlines() if line.startswith("{")]
    return [e for e in events if e["event"].startswith("out of file descriptors")]


def test_out_of_descriptors_backs_off_logs_once_and_recovers(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path, {"thrift_port": 0, "text_port": 0, "admin_port": 0})
    srv.open_files_limit = 40
    srv.start()
    served: list[socket.socket] = []
    waiting: socket.socket | None = None
    try:
        for _ in range(40):
            sock = socket.create_connection(("127.0.0.1", srv.memcache_port), timeout=STALL_S)
            sock.sendall(b"version\r\n")
            # Answered, or connected in the backlog while the server, out of descriptors, cannot accept it
            # (it says so in its log); whichever happens first.
            wait_until(lambda s=sock: readable_now(s) or bool(_refusals(srv)), "a reply or a refusal")
            if not readable_now(sock):
                waiting = sock
                break
            assert sock.recv(100).startswith(b"VERSION ")
            served.append(sock)
        assert waiting is not None and len(served) >= 20, len(served)
        # Descriptors stay exhausted for a while: the accept loop keeps retrying, logging once.
        time.sleep(1.0)  # real time: the retries are the server's, on its own clock
        events = [json.loads(line) for line in srv.log().splitlines() if line.startswith("{")]
        warnings = [e for e in events if e["event"].startswith("out of file descriptors")]
        assert len(warnings) == 1, srv.log()  # one warning per interval, not one per attempt
        assert warnings[0]["refused"] >= 1 and warnings[0]["error"] == "EMFILE"
        assert "Traceback" not in srv.log()

        for sock in served[:5]:
            sock.close()
        started = time.monotonic()
        assert waiting.recv(100).startswith(b"VERSION ")  # its request, sent while it sat in the backlog
        # Soon (the backoff is capped at half a second; how soon is bench/bench_responsiveness.py's).
        assert time.monotonic() - started < STALL_S
        fresh = socket.create_connection(("127.0.0.1", srv.memcache_port), timeout=STALL_S)
        served.append(fresh)
        fresh.sendall(b"version\r\n")
        assert fresh.recv(100).startswith(b"VERSION ")
        events = [json.loads(line) for line in srv.log().splitlines() if line.startswith("{")]
        recovered = [e for e in events if e["event"] == "accepting clients again"]
        assert len(recovered) == 1 and recovered[0]["refused"] >= 3, srv.log()  # several tries, one warning
        assert len([e for e in events if e["event"].startswith("out of file descriptors")]) == 1
    finally:
        for sock in served:
            sock.close()
        if waiting is not None:
            waiting.close()
        srv.stop()


MAX_LINE = 100
PIPELINED = bytes(range(256)) * 1024  # 256 KiB sent behind the request that ends the connection


def _thrift_put_then_a_bad_frame() -> bytes:
    return framed(encode_call("binary", "put", queue_name="lingering", items=[b"x"], expiration_msec=0)) + b"\xff" * 4


@pytest.mark.parametrize("protocol, request_, reply", [
    ("memcache", b"get " + b"q" * 2 * MAX_LINE + b"\r\n", b"CLIENT_ERROR line too long\r\n"),
    ("text", b"get " + b"q" * 2 * MAX_LINE + b"\n", b"-line too long\n"),
    ("thrift", _thrift_put_then_a_bad_frame(), None),  # the put's reply, then a close on the bad frame
])
def test_a_connection_closed_on_a_protocol_error_delivers_its_last_reply_and_ends_without_a_reset(
        server_factory: Any, protocol: str, request_: bytes, reply: bytes | None) -> None:
    """The server closes the connection with the client's later requests unread: closed at once,
    the kernel would answer them with a reset, which drops the reply (the one saying why) wherever
    it was not yet delivered. It shuts its sending side and reads on until the client closes."""
    srv = server_factory({"max_line_length": MAX_LINE})
    port = {"memcache": srv.memcache_port, "text": srv.text_port, "thrift": srv.thrift_port}[protocol]
    with socket.create_connection(("127.0.0.1", port), timeout=STALL_S) as sock:
        try:
            sock.sendall(request_ + PIPELINED)
        except (BrokenPipeError, ConnectionResetError):
            pass  # reset part way: what was read before is checked below
        received, reset = b"", False
        try:
            while chunk := sock.recv(65536):
                received += chunk
        except ConnectionResetError:
            reset = True
    if reply is None:
        assert len(received) > 4 and decode_reply(received[4:], "binary", "put") == 1, received
    else:
        assert received == reply
    assert not reset, f"reset after {received!r}"


@pytest.fixture
def closes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The connections the listener closed lingering (the others it closed at once)."""
    seen: list[str] = []
    lingering = listener.close_lingering

    def recorded(sock: Any) -> None:
        seen.append("lingering")
        lingering(sock)

    monkeypatch.setattr(listener, "close_lingering", recorded)
    return seen


def _serve_one(handle: Any, keepalive_ms: int | None = None) -> Any:
    """A listener on a free port serving one connection with `handle`; returns it once it closed."""
    done = gevent.event.Event()

    def handled(sock: Any, address: tuple[str, int]) -> Any:
        try:
            return handle(sock, address)
        finally:
            gevent.get_hub().loop.run_callback(done.set)

    listening = Listener("test", ("127.0.0.1", 0), handled, 4, keepalive_ms)
    listening.start()
    try:
        client = gevent.socket.create_connection(listening.address)
        client.close()
        assert done.wait(STALL_S)
        listening.join(STALL_S)
    finally:
        listening.stop_accepting()
    return listening


def test_a_connection_whose_client_ended_the_stream_closes_without_lingering(closes: list[str]) -> None:
    _serve_one(lambda sock, address: True)
    assert closes == []


@pytest.mark.parametrize("outcome", [None, False, "raises"])
def test_any_other_connection_closes_lingering(closes: list[str], outcome: Any) -> None:
    def handle(sock: Any, address: tuple[str, int]) -> Any:
        if outcome == "raises":
            raise OSError("gone")
        return outcome

    _serve_one(handle)
    assert closes == ["lingering"]


def test_an_accepted_connection_takes_the_keepalive_of_its_listener() -> None:
    """Set once on the listening socket, not four system calls a connection."""
    seen: list[tuple[int, int, int, int]] = []

    def handle(sock: Any, address: tuple[str, int]) -> bool:
        seen.append((sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
                     sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
                     sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
                     sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT)))
        return False

    _serve_one(handle, keepalive_ms=9_000)
    assert seen == [(1, 9, 3, 3)]


def test_an_accepted_connection_sends_without_waiting_to_fill_a_segment() -> None:
    """TCP_NODELAY, from the listening socket: under Nagle's algorithm a reply written just after
    another waited for the client's delayed ACK (40 ms; bench_responsiveness memory-pressed)."""
    seen: list[int] = []

    def handle(sock: Any, address: tuple[str, int]) -> bool:
        seen.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        return False

    _serve_one(handle)
    assert seen == [1]


CONNECTIONS = {"memcache": (MemcacheConnection, b"version\r\n", b"get " + b"q" * 2 * MAX_LINE + b"\r\n"),
               "text": (TextConnection, b"version\n", b"get " + b"q" * 2 * MAX_LINE + b"\n"),
               "thrift": (ThriftConnection, framed(encode_call("binary", "get_version")), b"\xff" * 8)}


@pytest.mark.parametrize("protocol", CONNECTIONS)
def test_a_connection_says_whether_its_client_ended_the_stream(server_state: ServerState, protocol: str) -> None:
    """True when the client closed with all it sent read (the listener then closes at once); False
    when the server ends it on a protocol error, the client's later input perhaps unread."""
    server_state.config.max_line_length = MAX_LINE
    connection, request_, bad = CONNECTIONS[protocol]
    for sent, client_closes in ((request_, True), (bad, False)):
        a, client = gevent.socket.socketpair()
        sock = accepted(a)
        serving = gevent.spawn(connection(server_state, sock, "peer:1").run)
        client.sendall(sent)
        if client_closes:
            assert client.recv(65536)  # answered
            client.shutdown(socket.SHUT_WR)
        assert serving.get(timeout=STALL_S) is client_closes
        sock.close()
        client.close()


def test_thrift_connections_share_one_table_of_calls(server_state: ServerState) -> None:
    """Looked up once in the process, not per connection (a cost every connect paid); each
    connection's calls still reach its own session."""
    first, second = (gevent.socket.socketpair() for _ in range(2))
    one = ThriftConnection(server_state, accepted(first[0]), "peer:1")
    other = ThriftConnection(server_state, accepted(second[0]), "peer:2")
    assert one.calls is other.calls
    one._call(METHODS["put"], 1, ("q", [b"x"], 0))
    assert one.session.stats.total_connections == 2 and server_state.collection.peek("q") is not None
    for sock in (*first, *second):
        sock.close()


def _until_the_client_closes(sock: socket.socket) -> bool:
    """Greet the client, then serve it until it closes (a connection holding its place in the pool)."""
    sock.sendall(b"hi")
    io = ClientSocket(sock, 1024)
    try:
        while io.receive(bytearray(), None):
            pass
    finally:
        io.close()
    return True


def _greeted(sock: gevent.socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        return bool(sock.recv(2) == b"hi")
    except TimeoutError:
        return False


def test_a_client_beyond_max_connections_waits_in_the_backlog_until_one_closes() -> None:
    listening = Listener("test", ("127.0.0.1", 0), lambda sock, address: _until_the_client_closes(sock), 2)
    listening.start()
    clients = [gevent.socket.create_connection(listening.address) for _ in range(3)]
    try:
        assert _greeted(clients[0], STALL_S) and _greeted(clients[1], STALL_S)
        assert not _greeted(clients[2], 0.3)  # connected, in the backlog: not accepted
        clients[0].close()
        assert _greeted(clients[2], STALL_S)
    finally:
        for client in clients:
            client.close()
        listening.stop_accepting()
        listening.kill()


def test_a_listener_binds_where_configured_ipv6_too() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 in this Python")
    peers: list[tuple[str, int]] = []
    served = gevent.event.Event()

    def handle(sock: Any, address: tuple[str, int]) -> bool:
        peers.append(address[:2])
        served.set()
        return True

    listening = Listener("test", ("::1", 0), handle, 4)
    listening.start()
    try:
        with gevent.socket.create_connection(listening.address) as client:
            assert served.wait(STALL_S)
            assert peers == [client.getsockname()[:2]] and peers[0][0] == "::1"
    finally:
        listening.stop_accepting()


def test_connections_are_accepted_from_the_os_socket_with_no_gevent_socket_made(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """gevent's accept made a socket object of its own for each connection (four system calls),
    only for it to be handed over; the connection gets the OS socket, non-blocking."""
    def refused(self: Any) -> Any:
        raise AssertionError("gevent's accept")

    monkeypatch.setattr(gevent.socket.socket, "accept", refused)
    handed: list[Any] = []

    def handle(sock: Any, address: tuple[str, int]) -> bool:
        handed.append(sock)
        return True

    listening = Listener("test", ("127.0.0.1", 0), handle, 4)
    listening.start()
    try:
        with gevent.socket.create_connection(listening.address) as client:
            client.settimeout(STALL_S)
            assert client.recv(1) == b""  # served, then closed
            assert type(handed[0]) is not gevent.socket.socket and handed[0].gettimeout() == 0.0
    finally:
        listening.stop_accepting()


def test_a_flood_of_connects_lets_the_connections_already_accepted_run() -> None:
    """Thousands connecting at once: the accept loop steps aside every ACCEPT_BURST accepts, so the
    first connection is served before the last is accepted."""
    flood = 3 * listener.ACCEPT_BURST
    open_at_first_serve: list[int] = []
    served = gevent.event.Event()
    listening = Listener("test", ("127.0.0.1", 0), lambda sock, address: True, 2 * flood)

    def first_served(sock: Any, address: tuple[str, int]) -> bool:
        if not open_at_first_serve:
            open_at_first_serve.append(len(listening.connections))
            served.set()
        return True

    listening.handle = first_served
    clients = [gevent.socket.create_connection(listening.address) for _ in range(flood)]  # all in the backlog
    listening.start()
    try:
        assert served.wait(STALL_S)
        assert open_at_first_serve[0] <= listener.ACCEPT_BURST
    finally:
        for client in clients:
            client.close()
        listening.stop_accepting()


def test_a_kept_greenlet_serves_the_next_connection_in_a_context_of_its_own() -> None:
    """A greenlet whose connection ended serves the next one (no greenlet made, no frame stack mapped),
    which sees none of the context variables the last one set; stopping ends the kept ones."""
    variable: ContextVar[str] = ContextVar("variable", default="fresh")
    seen: list[tuple[Any, str]] = []

    def handle(sock: Any, address: tuple[str, int]) -> bool:
        seen.append((gevent.getcurrent(), variable.get()))
        variable.set(f"set by connection {len(seen)}")
        return True

    listening = Listener("test", ("127.0.0.1", 0), handle, 4)
    listening.start()
    try:
        for _ in range(3):
            with gevent.socket.create_connection(listening.address) as client:
                client.settimeout(STALL_S)
                assert client.recv(1) == b""  # served and closed
            assert listening.join(STALL_S)
    finally:
        listening.stop_accepting()
    workers = {worker for worker, _ in seen}
    assert len(workers) == 1 and [value for _, value in seen] == ["fresh"] * 3
    gevent.sleep(0.01)
    assert all(worker.dead for worker in workers)
