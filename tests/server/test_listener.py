"""The shared accept loop: out of file descriptors it waits calmly and serves again once some return;
a connection it closes on a protocol error delivers its last reply, whatever the client sent after."""

from __future__ import annotations

import json
import select
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import STALL_S, ServerProcess, wait_until
from tests.support.thrift_wire import decode_reply, encode_call, framed


def _answered(sock: socket.socket) -> bool:
    """Whether a reply is there to read (without waiting)."""
    return bool(select.select([sock], [], [], 0)[0])


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
            wait_until(lambda s=sock: _answered(s) or bool(_refusals(srv)), "a reply or a refusal")
            if not _answered(sock):
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
