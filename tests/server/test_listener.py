"""The shared accept loop: out of file descriptors it waits calmly and serves again once some return."""

from __future__ import annotations

import json
import select
import socket
import time
from pathlib import Path
from typing import Any

from tests.conftest import STALL_S, ServerProcess, wait_until


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
