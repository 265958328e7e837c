"""`request_timeout` on the line protocols: each request's rest must come within it of its first
byte, so a client that pipelines (each send ending one request and beginning the next) is served
for as long as it keeps on, while one request that trickles in, however many receives it spans
(a text put block, a memcache item skipped unread), is still closed at its deadline."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.support.wire import (
    close_sockets,  # noqa: F401  (autouse: closes the sockets before the servers stop)
    closed_by_server,
    conn,
)

# What each send ends and begins: a request split across two sends, again and again.
PIPELINED = {
    "text": (b"put q:\nx\n\nput q", b":\nx\n\nput q", b"+1\n"),
    "memcache": (b"set q 0 0 1\r\nx\r\nset q 0", b" 0 1\r\nx\r\nset q 0", b"STORED\r\n"),
}
# One request whose parts come a send at a time.
TRICKLED = {
    "text": (b"put slow:\n", b"item\n"),
    "memcache": (b"set slow 0 0 2000\r\n", b"x" * 10),  # over max_frame_size: skipped unread
}


@pytest.mark.parametrize("protocol", ["text", "memcache"])
def test_a_client_pipelining_whole_requests_is_served_past_request_timeout(server_factory: Any,
                                                                          protocol: str) -> None:
    srv = server_factory({"request_timeout": "1s"})
    first, each, answer = PIPELINED[protocol]
    s = conn(srv.text_port if protocol == "text" else srv.memcache_port)
    s.sendall(first)
    sends = 1
    started = time.monotonic()
    while time.monotonic() - started < 2.0:  # twice the timeout, every request whole in 0.1 s
        time.sleep(0.1)
        s.sendall(each)
        sends += 1
    s.settimeout(5)
    replies = b""
    while replies.count(answer) < sends and (chunk := s.recv(65536)):
        replies += chunk
    assert replies == answer * sends
    assert closed_by_server(s)  # the last one never ends: closed at its deadline


@pytest.mark.parametrize("protocol", ["text", "memcache"])
def test_one_request_trickling_in_is_closed_at_request_timeout(server_factory: Any, protocol: str) -> None:
    srv = server_factory({"request_timeout": "500ms", "max_frame_size": "1KB"})
    start, part = TRICKLED[protocol]
    s = conn(srv.text_port if protocol == "text" else srv.memcache_port)
    s.sendall(start)
    began = time.monotonic()
    closed = False
    while not closed and time.monotonic() - began < 5:
        time.sleep(0.1)
        try:
            s.sendall(part)
        except OSError:
            closed = True
        else:
            closed = closed_by_server(s, wait=0.01)
    assert closed
