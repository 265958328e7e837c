"""The shared accept loop: out of file descriptors it waits calmly and serves again once some return."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

from tests.conftest import ServerProcess


def _version(sock: socket.socket, timeout: float) -> bytes | None:
    sock.settimeout(timeout)
    try:
        sock.sendall(b"version\r\n")
        return sock.recv(100)
    except TimeoutError:
        return None


def test_out_of_descriptors_backs_off_logs_once_and_recovers(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path, {"thrift_port": 0, "text_port": 0, "admin_port": 0})
    srv.open_files_limit = 40
    srv.start()
    served: list[socket.socket] = []
    waiting: socket.socket | None = None
    try:
        for _ in range(40):
            sock = socket.create_connection(("127.0.0.1", srv.memcache_port), timeout=2)
            if _version(sock, 0.5) is None:  # connected in the backlog, but the server cannot accept it
                waiting = sock
                break
            served.append(sock)
        # The last client's unanswered half second: descriptors stayed exhausted and the accept
        # loop kept retrying meanwhile.
        assert waiting is not None and len(served) >= 20, len(served)
        events = [json.loads(line) for line in srv.log().splitlines() if line.startswith("{")]
        warnings = [e for e in events if e["event"].startswith("out of file descriptors")]
        assert len(warnings) == 1, srv.log()  # one warning per interval, not one per attempt
        assert warnings[0]["refused"] >= 1 and warnings[0]["error"] == "EMFILE"
        assert "Traceback" not in srv.log()

        for sock in served[:5]:
            sock.close()
        started = time.monotonic()
        waiting.settimeout(2.0)
        assert waiting.recv(100).startswith(b"VERSION ")  # its request, sent while it sat in the backlog
        assert time.monotonic() - started < 1.0  # backoff is capped at half a second
        fresh = socket.create_connection(("127.0.0.1", srv.memcache_port), timeout=2)
        served.append(fresh)
        assert (_version(fresh, 2.0) or b"").startswith(b"VERSION ")
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
