"""One request and its reply over a raw socket for the line protocols (memcache, text): the step
the end-to-end tests, the fuzzer's good clients and the responsiveness benchmark all take."""

from __future__ import annotations

import socket
import time

# Socket deadlines are for replies that must come: far beyond what a loaded machine takes.
DEADLINE_S = 30.0


def exchange(sock: socket.socket, request: bytes, expect_end: bytes = b"\r\n", wait: float = DEADLINE_S) -> bytes:
    """Send, then read until the reply ends with `expect_end`; if the server closes the connection
    or `wait` runs out first, what came so far (a caller's comparison then shows it)."""
    sock.sendall(request)
    data = bytearray()  # (appended to in place: `bytes +=` copied a reply of megabytes each chunk)
    deadline = time.monotonic() + wait
    while not data.endswith(expect_end) and time.monotonic() < deadline:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return bytes(data)
