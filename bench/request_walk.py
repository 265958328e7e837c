"""The walk of one request through the code: which Python functions an item passes through from the
protocol handler to the journal's write (a put) or back out to the reply (a get), and how many
Python functions the request calls in all. A tracer (`sys.setprofile`) watches one request answered
by a connection without sockets, as `bench_answer` answers them, on a warmed-up queue.

- **to the journal**: the functions, in call order from the handler's entry, that are handed the item
  (its data, a list holding it, or bytes holding it, such as an encoded record) up to the journal
  file's append (`JournalWriter.append`, what writes every journal file, whose `os.write` follows),
  and the frames on the stack there, from the handler's entry down to that append.
- **back out**: for a get, the functions that return the item (or something holding it), from the
  queue out to the handler.
- **calls**: every Python function called while the request is answered.

    .venv/bin/python -m bench.request_walk [--format kestrel2|kestrel3] [--show]
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any

from kestrel.service.config import from_mapping
from kestrel.service.logs import configure_logging
from kestrel.service.memcache.handler import MemcacheConnection
from kestrel.service.session.server_state import ServerState
from kestrel.service.thrift.handler import ThriftConnection
from tests.support.thrift_wire import encode_call

MARK = b"walk-item-" + bytes(range(65, 91)) * 4  # an item no other value in the server holds
JOURNAL_APPEND = "JournalWriter.append"  # writes every journal file: where a walk reaches the journal


def _holds(value: Any, depth: int = 0) -> bool:
    """Whether `value` is the item, holds its bytes, or holds something that does (two levels deep)."""
    if isinstance(value, bytes | bytearray):
        return MARK in value
    if isinstance(value, memoryview):
        return value.nbytes < 1 << 20 and MARK in value.tobytes()
    if depth > 1:
        return False
    if isinstance(value, list | tuple) and len(value) <= 4096:
        return any(_holds(v, depth + 1) for v in value)
    data = getattr(value, "data", None)  # an item
    if isinstance(data, bytes):
        return MARK in data
    items = getattr(value, "items", None)  # a get's TakenItems
    if isinstance(items, list) and len(items) <= 4096:
        return any(_holds(v, depth + 1) for v in items)
    return False


def _name(code: CodeType) -> str:
    module = os.path.splitext(os.path.basename(code.co_filename))[0]
    return f"{module}.{code.co_qualname}"


class Walk:
    """What one traced request did."""

    def __init__(self, entry: CodeType) -> None:
        self.entry = entry
        self.calls = 0
        self.handed: list[str] = []  # functions handed the item, first call each, in order
        self.returned: list[str] = []  # functions returning it, in order
        self.write_stack: list[str] | None = None  # from the entry down to the journal file's append
        self._written = False
        self._inside = False

    def _stack(self, frame: FrameType | None) -> list[str]:
        names: list[str] = []
        while frame is not None:
            names.append(_name(frame.f_code))
            if frame.f_code is self.entry:
                break
            frame = frame.f_back
        return names[::-1]

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        code = frame.f_code
        if event == "call":
            if code is self.entry:
                self._inside = True
            if not self._inside:
                return
            self.calls += 1
            if not self._written:
                args = code.co_varnames[:code.co_argcount + code.co_kwonlyargcount]
                name = _name(code)
                if name not in self.handed and any(_holds(frame.f_locals.get(a)) for a in args):
                    self.handed.append(name)
                if code.co_qualname == JOURNAL_APPEND:
                    self.write_stack = self._stack(frame)
                    self._written = True
        elif event == "return" and self._inside:
            if _holds(arg):
                self.returned.append(_name(code))
            if code is self.entry:
                self._inside = False


def trace(entry: Callable[..., Any], call: Callable[[], Any]) -> Walk:
    code = getattr(entry, "__func__", entry).__code__
    walk = Walk(code)
    sys.setprofile(walk.profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return walk


Request = Callable[[], Any]


def _thrift(server: ServerState) -> tuple[ThriftConnection, Callable[[str, dict[str, Any]], Request]]:
    conn = ThriftConnection(server, socket.socket(), "walk")

    def request(method: str, args: dict[str, Any]) -> Request:
        frame = encode_call("binary", method, **args)
        return lambda: conn.answer_frame(frame)

    return conn, request


def _memcache(server: ServerState) -> tuple[MemcacheConnection, Callable[[bytes], Request]]:
    conn = MemcacheConnection(server, socket.socket(), "walk")

    def request(data: bytes) -> Request:
        def answer() -> None:
            conn.process(bytearray(data))
            conn.out.clear()
        return answer

    return conn, request


def _report(title: str, walk: Walk, show: bool) -> None:
    stack = walk.write_stack or []
    returned = len(walk.returned) or "-"
    print(f"| {title} | {len(walk.handed)} | {len(stack) or '-'} | {returned} | {walk.calls} |")
    if show:
        if walk.handed:
            print("|  | handed the item: " + " → ".join(walk.handed) + " | | | |")
        if stack:
            print("|  | stack at the write: " + " → ".join(stack) + " | | | |")
        if walk.returned:
            print("|  | returned by: " + " → ".join(walk.returned) + " | | | |")


def run(journal_format: str, show: bool) -> None:
    home = tempfile.mkdtemp(prefix="kestrel-walk-")
    try:
        config = {"queue_path": home, "default_queue": {"journal_format": journal_format}}
        server = ServerState(from_mapping(config, home))
        server.collection.load()
        thrift, call = _thrift(server)
        memcache, send = _memcache(server)
        put = call("put", {"queue_name": "q", "items": [MARK], "expiration_msec": 0})
        one = {"queue_name": "q", "max_items": 1, "timeout_msec": 0}
        get = call("get", {**one, "auto_abort_msec": 0})
        reliable = call("get", {**one, "auto_abort_msec": 60000})
        mc_set = send(b"set q 0 0 %d\r\n%s\r\n" % (len(MARK), MARK))
        mc_get = send(b"get q\r\n")
        mc_sets = send(b"set q 0 0 %d\r\n%s\r\n" % (len(MARK), MARK) * 100)
        mc_gets = send(b"get q\r\n" * 100)
        for step in (put, get, put, reliable, mc_set, mc_get, mc_sets, mc_gets):  # warm up
            step()
        rows: list[tuple[str, Callable[..., Any], Request]] = [
            ("Thrift put, 1 item", thrift.answer_frame, put),
            ("Thrift get, 1 item", thrift.answer_frame, get),
            ("Thrift put, 1 item (again)", thrift.answer_frame, put),
            ("Thrift reliable get (auto-abort), 1 item", thrift.answer_frame, reliable),
            ("memcache set", memcache.process, mc_set),
            ("memcache get", memcache.process, mc_get),
            ("memcache 100 pipelined sets", memcache.process, mc_sets),
            ("memcache 100 pipelined gets", memcache.process, mc_gets),
        ]
        print(f"# journal_format {journal_format}: one request each, after a warm-up")
        print("| request | functions handed the item, to the journal | frames on the stack, handler to "
              "journal | functions returning the item | Python calls in all |")
        print("| --- | --- | --- | --- | --- |")
        for title, entry, step in rows:
            _report(title, trace(entry, step), show)
        server.close()
    finally:
        shutil.rmtree(home, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--format", choices=["kestrel2", "kestrel3"], default="kestrel2")
    parser.add_argument("--show", action="store_true", help="name the functions of each walk")
    args = parser.parse_args()
    configure_logging("warning")
    run(args.format, args.show)


if __name__ == "__main__":
    main()
