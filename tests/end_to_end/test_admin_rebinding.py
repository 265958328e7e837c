"""A web page cannot read the admin port by DNS rebinding: its attacker turns the page's own name to
127.0.0.1, so that its requests reach the port as its own origin. The port, listening on loopback,
answers only requests naming loopback in their `Host:`, which the browser fills with the name it
used.

The browser is a real headless Chromium told to resolve `rebind.test` to 127.0.0.1, as the
attacker's DNS would once turned.
"""

from __future__ import annotations

import socket
import tempfile
from collections.abc import Iterator

import pytest

from kestrel.service.admin import names_loopback
from tests.conftest import ServerProcess
from tests.end_to_end.test_dashboard import put
from tests.support.browser import CHROMIUM, CHROMIUM_DRIVER, Browser, start_browser
from tests.support.system import tool

REFUSED = "answers requests for localhost or a loopback address only"


@pytest.fixture(scope="module")
def rebound_browser() -> Iterator[Browser]:
    """A headless Chromium whose resolver sends `rebind.test` to 127.0.0.1."""
    binary, driver = tool(CHROMIUM), tool(CHROMIUM_DRIVER)
    with tempfile.TemporaryDirectory(prefix="kestrel-chromium-") as profile:
        opened = start_browser(binary, driver, profile, "--host-resolver-rules=MAP rebind.test 127.0.0.1")
        try:
            yield opened
        finally:
            opened.driver.quit()


def body(browser: Browser) -> str:
    return str(browser.js("return document.body ? document.body.textContent : ''"))


def test_a_page_under_a_rebound_name_reads_nothing(server: ServerProcess, rebound_browser: Browser) -> None:
    put(server.memcache_port, "secret_jobs", 1)
    rebound_browser.open(f"http://localhost:{server.admin_port}/stats.json")
    assert "secret_jobs" in body(rebound_browser)  # the browser reaches the port and reads it by its name
    for path in ("/stats.json", "/metrics", "/"):
        rebound_browser.open(f"http://rebind.test:{server.admin_port}{path}")
        text = body(rebound_browser)
        assert REFUSED in text and "'rebind.test:" in text and "secret_jobs" not in text, (path, text)
    assert "admin request for another host refused" in server.log()


def status_line(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(request)
        return s.makefile("rb").readline()


@pytest.mark.parametrize("host, answered", [
    ("localhost", True), ("LOCALHOST:2223", True), ("127.0.0.1:2223", True), ("127.3.4.5", True),
    ("[::1]:2223", True), ("dashboard.localhost:2223", True), ("localhost.", True),
    ("rebind.test", False), ("rebind.test:2223", False), ("127.0.0.1.rebind.test", False),
    ("localhost.rebind.test:2223", False), ("[::ffff:10.0.0.1]", False), ("", False),
])
def test_a_host_header_is_answered_only_when_it_names_loopback(server: ServerProcess, host: str,
                                                               answered: bool) -> None:
    line = status_line(server.admin_port, f"GET /ping HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
    assert line.startswith(b"HTTP/1.1 200 ") if answered else line.startswith(b"HTTP/1.1 421 "), line
    assert names_loopback(host) is answered


def test_a_request_without_a_host_is_answered(server: ServerProcess) -> None:
    """HTTP/1.0 needs none, and a browser always sends one: the probes of old tools keep working."""
    assert status_line(server.admin_port, b"GET /ping HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.1 200 ")
