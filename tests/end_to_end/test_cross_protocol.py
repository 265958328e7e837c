"""A web page cannot drive the line protocols: HTTP sent to the memcache or text port is refused at
its first line and the connection closed, so a POST's body never runs as commands.

The page is a real one, in a real headless Chromium, served from another port of this machine: it
POSTs (`mode: "no-cors"`, which needs no preflight) bodies that would empty and delete queues. A
raw client shows the same for each line that gives HTTP away, and that nothing sent after it runs.
"""

from __future__ import annotations

import http.server
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import ServerProcess, wait_until
from tests.end_to_end.test_dashboard import put
from tests.support.browser import Browser, one_browser  # noqa: F401  (one browser)
from tests.support.lines import exchange

REFUSED = "HTTP request on the {port} port (an HTTP client or a web page?): closing the connection"
ATTACK = {"memcache": "flush_all\\r\\ndelete jobs\\r\\n", "text": "flush jobs\\ndelete jobs\\n"}


def items(srv: ServerProcess, queue: str) -> int:
    with socket.create_connection(("127.0.0.1", srv.memcache_port), timeout=30) as s:
        stats = exchange(s, b"stats\r\n", b"END\r\n").decode()
    for line in stats.splitlines():
        if line.startswith(f"STAT queue_{queue}_items "):
            return int(line.split()[2])
    raise AssertionError(f"no queue {queue!r} in the stats")


def read_to_close(sock: socket.socket) -> bytes:
    """Every byte until the server closes the connection."""
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


@pytest.fixture
def attacking_page(server: ServerProcess) -> Iterator[str]:
    """The address of a page, on a port of its own, that POSTs commands to both line ports."""
    script = "".join(
        f'fetch("http://127.0.0.1:{getattr(server, f"{port}_port")}/", '
        f'{{method: "POST", mode: "no-cors", body: "{body}"}}).catch(() => 0);'
        for port, body in ATTACK.items())
    page = f"<html><body><script>{script}</script>sent</body></html>".encode()

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://localhost:{httpd.server_address[1]}/"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_web_page_posting_commands_runs_none(server: ServerProcess, attacking_page: str,
                                               browser: Browser) -> None:
    put(server.memcache_port, "jobs", 5)
    browser.open(attacking_page)
    # The server logs each refusal: so the browser's requests did arrive, and were refused.
    wait_until(lambda: all(REFUSED.format(port=port) in server.log() for port in ATTACK),
               "both ports refused the page's request")
    assert items(server, "jobs") == 5


@pytest.mark.parametrize("port", ["memcache", "text"])
@pytest.mark.parametrize("first", [b"POST / HTTP/1.1", b"OPTIONS /jobs HTTP/1.0", b"GET /jobs HTTP/1.1",
                                   b"PUT /jobs HTTP/1.1", b"Host: 127.0.0.1:2222", b"host:localhost"])
def test_the_first_line_that_speaks_http_closes_the_connection(server: ServerProcess, port: str,
                                                               first: bytes) -> None:
    put(server.memcache_port, "jobs", 2)
    eol = b"\r\n" if port == "memcache" else b"\n"
    commands = ATTACK[port].replace("\\r\\n", "\r\n").replace("\\n", "\n").encode()
    with socket.create_connection(("127.0.0.1", getattr(server, f"{port}_port")), timeout=30) as s:
        s.sendall(first + eol + b"Content-Type: text/plain" + eol + eol + commands)
        received = read_to_close(s)
    refusal = REFUSED.format(port=port).encode()
    assert received == (b"CLIENT_ERROR " if port == "memcache" else b"-") + refusal + eol
    assert items(server, "jobs") == 2
