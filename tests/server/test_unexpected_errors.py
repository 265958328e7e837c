"""An error no rule expects (a bug) inside a command: each protocol answers it with its own internal
error naming the exception, and the connection goes on, in both builds (tests/server/test_builds.py).

Each connection is made in this process over a socket it never uses; the failing command is put in
the place the connection looks it up (Thrift's and memcache's tables of handlers, the text
protocol's answer), since a bug has no request that reaches it on purpose; a Thrift put, called on
the handler directly, meets arguments of the wrong type instead.
"""

from __future__ import annotations

from typing import Any

from thriftpy2.thrift import TApplicationException

from kestrel.service.memcache.commands import parse_line
from kestrel.service.memcache.handler import MemcacheConnection
from kestrel.service.session.server_state import ServerState
from kestrel.service.text.handler import TextConnection
from kestrel.service.thrift.handler import ThriftConnection
from kestrel.service.thrift.messages import METHODS
from tests.support.thrift_wire import decode_reply, unframed


class _Unused:
    """A client's socket the connection keeps but these tests never reach."""

    def fileno(self) -> int:
        return -1


def _bug(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("a bug")


def test_thrift_answers_an_internal_error_and_goes_on(server_state: ServerState) -> None:
    conn = ThriftConnection(server_state, _Unused(), "test")  # type: ignore[arg-type]
    peek = METHODS["peek"]
    conn._call(peek, 6, ("q",))  # the handler function is bound at its first call, then kept
    handler = conn.bound[peek.number]
    conn.bound[peek.number] = _bug
    reply = decode_reply(unframed(conn._call(peek, 7, ("q",))), "binary", "peek")
    assert isinstance(reply, TApplicationException)
    assert reply.type == TApplicationException.INTERNAL_ERROR
    assert reply.message == "internal error in peek: RuntimeError('a bug')"
    conn.bound[peek.number] = handler
    assert decode_reply(unframed(conn._call(peek, 8, ("q",))), "binary", "peek").items == 0


def test_a_put_called_directly_answers_an_internal_error_and_goes_on(server_state: ServerState) -> None:
    """A put (as a get) is called on the handler directly, not through the bound table: what it
    raises is answered the same way (items that are not a list: a TypeError, in either build)."""
    conn = ThriftConnection(server_state, _Unused(), "test")  # type: ignore[arg-type]
    put = METHODS["put"]
    reply = decode_reply(unframed(conn._call(put, 7, ("q", 5, 0))), "binary", "put")
    assert isinstance(reply, TApplicationException)
    assert reply.type == TApplicationException.INTERNAL_ERROR
    assert reply.message.startswith("internal error in put: TypeError(")
    assert decode_reply(unframed(conn._call(put, 8, ("q", [b"x"], 0))), "binary", "put") == 1


def test_memcache_answers_a_server_error_and_goes_on(server_state: ServerState) -> None:
    conn = MemcacheConnection(server_state, _Unused(), "test")  # type: ignore[arg-type]
    conn.process(bytearray(b"version\r\n"))  # the command's handler is looked up once, then kept
    conn.commands["version"] = (_bug, conn.commands["version"][1])
    conn.execute(parse_line(b"version"))
    conn.process(bytearray(b"set q 0 0 1\r\nx\r\n"))
    assert conn.out[1:] == [b"SERVER_ERROR internal error: RuntimeError('a bug')\r\n", b"STORED\r\n"]


def test_text_answers_an_internal_error_and_goes_on(server_state: ServerState) -> None:
    conn = TextConnection(server_state, _Unused(), "test")  # type: ignore[arg-type]
    conn.answer(_bug)
    conn.answer(lambda: b"+next\n")
    assert conn.out == [b"-internal error: RuntimeError('a bug')\n", b"+next\n"]
