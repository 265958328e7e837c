"""Random and truncated input: the parsers answer an error or close that one connection, nothing else."""

from __future__ import annotations

import socket

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kestrel.service.memcache.commands import Command, ProtocolError, parse_get_key, parse_line
from tests.conftest import ServerProcess

WORDS = st.sampled_from([b"get", b"gets", b"set", b"delete", b"flush", b"flush_all", b"monitor", b"confirm",
                         b"status", b"stats", b"version", b"q", b"q/open", b"q/t=5/close", b"0", b"-1", b"5",
                         b"noreply", b"/", b"//", b"t=", b"\xff", b"put", b"peek", b"q:"])
LINES = st.one_of(st.binary(max_size=200), st.lists(WORDS, max_size=6).map(b" ".join))


@given(LINES)
def test_memcache_parser_answers_or_refuses(line: bytes) -> None:
    try:
        command = parse_line(line)
    except ProtocolError as e:
        assert e.reply == "ERROR" or e.reply.startswith("CLIENT_ERROR ")
    else:
        assert isinstance(command, Command) and command.name


@given(st.text(max_size=60))
def test_get_options_parse_or_refuse(key: str) -> None:
    try:
        options = parse_get_key(key)
    except ProtocolError as e:
        assert e.reply.startswith("CLIENT_ERROR ")
    else:
        assert options.queue and not (options.peek and (options.open or options.close or options.abort))


def _drain(sock: socket.socket) -> None:
    sock.settimeout(0.3)
    try:
        while sock.recv(65536):
            pass
    except (TimeoutError, ConnectionError, OSError):
        pass


@pytest.mark.parametrize("protocol", ["memcache", "text"])
def test_servers_survive_random_and_truncated_input(server: ServerProcess, protocol: str) -> None:
    port = server.memcache_port if protocol == "memcache" else server.text_port
    junk = st.lists(st.one_of(LINES.map(lambda b: b + b"\r\n"), st.binary(max_size=300)), max_size=8).map(b"".join)

    @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
    @given(junk, st.booleans())
    def fuzz(payload: bytes, truncate: bool) -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as bad:
            bad.sendall(payload[: len(payload) // 2] if truncate else payload)
            bad.shutdown(socket.SHUT_WR)
            _drain(bad)
        with socket.create_connection(("127.0.0.1", server.memcache_port), timeout=5) as good:
            good.sendall(b"version\r\n")
            assert good.recv(100).startswith(b"VERSION ")

    fuzz()
    with socket.create_connection(("127.0.0.1", server.memcache_port), timeout=30) as good:
        good.sendall(b"version\r\n")  # after every bad connection was closed
        assert good.recv(100).startswith(b"VERSION ")
    assert server.proc is not None and server.proc.poll() is None
