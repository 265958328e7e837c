"""Raw-socket helpers for the line protocols: exact bytes in, exact bytes out."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable


def conn(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def exchange(sock: socket.socket, request: bytes, expect_end: bytes = b"\r\n", wait: float = 5.0) -> bytes:
    """Send, then read until the reply ends with `expect_end` (or the connection closes)."""
    sock.sendall(request)
    data = b""
    deadline = time.monotonic() + wait
    while not data.endswith(expect_end) and time.monotonic() < deadline:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def closed_by_server(sock: socket.socket, wait: float = 5.0) -> bool:
    """Whether the server closes `sock` within `wait` seconds (any unread reply is dropped)."""
    sock.settimeout(wait)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def memcache_stats(port: int) -> dict[str, str]:
    with conn(port) as s:
        text = exchange(s, b"stats\r\n", b"END\r\n").decode()
    return {parts[1]: parts[2] for line in text.splitlines() if len(parts := line.split(" ", 2)) == 3}


def eventually(check: Callable[[], bool], wait: float = 5.0) -> float:
    """Poll `check` every 10 ms until true; return the seconds it took (AssertionError on time-out)."""
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > wait:
            raise AssertionError(f"condition not met within {wait}s")
        time.sleep(0.01)
    return time.monotonic() - start
