"""The Python cost of one Thrift put + get round, without sockets: `ThriftConnection.answer_frame` on
ready binary frames, against a real queue collection with its journal (`sync_journal: never`).
With `--protocol memcache`, a round is `batch` pipelined `set q 0 0 128` then `batch` `get q`, each
burst one buffer through `MemcacheConnection.process` (its replies dropped, not sent).

CPU time (not wall time: on a shared machine other work stretches wall time, not our CPU time), the
best of five runs. What it leaves out is the kernel's part (recv, send, the journal's write is in),
so it isolates what Python changes can win; run it in two checkouts to compare code.

    .venv/bin/python -m bench.bench_answer [--batch 1 100] [--rounds 20000] [--get get_timed]
                                           [--protocol thrift|memcache] [--profile]
    .venv/bin/python -m bench.bench_answer --loop [--rounds 20000]

`--get get_timed` reads with the call that also hands out each item's add time and expiry.
`--loop` measures a connection's whole serve loop instead, Thrift and memcache, single items: framing,
each request's wait for input on the hub, the answer, the reply; over a socket stand-in that always
holds the next request, so that no `recv` or `send` runs (the hub's `epoll_wait` does).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from typing import Any

from bench.common import load_average, machine
from kestrel.service import metrics
from kestrel.service.config import from_mapping
from kestrel.service.logs import configure_logging
from kestrel.service.memcache.handler import MemcacheConnection
from kestrel.service.session.server_state import ServerState
from kestrel.service.thrift.handler import ThriftConnection
from tests.support.thrift_wire import encode_call, framed


class _NoSocket:
    """`answer` never touches the socket; the connection only keeps it."""


def measure(batch: int, items: int, profile: bool, get_call: str = "get", protocol: str = "thrift") -> None:
    home = tempfile.mkdtemp(prefix="kestrel-answer-")
    try:
        server = ServerState(from_mapping({"queue_path": home}, home))
        server.collection.load()
        metrics.install_storage_timing()
        if protocol == "thrift":
            rounds = _thrift_rounds(server, batch, get_call)
        else:
            rounds = _memcache_rounds(server, batch)
        n = max(items // batch // 5, 1)
        rounds(n)  # warm up
        best = min(_cpu(rounds, n) for _ in range(5))
        print(f"| {batch} | {best / n * 1e6:,.1f} | {n * batch / best:,.0f} |", flush=True)
        if profile:
            profiler = cProfile.Profile()
            profiler.runcall(rounds, n)
            pstats.Stats(profiler).sort_stats("tottime").print_stats(20)
        server.collection.close()
    finally:
        shutil.rmtree(home, ignore_errors=True)


class _ReadySocket:
    """A client's socket as a connection sees it, always holding the next request: `recv_into`
    hands out the requests in turn (then 0, the client closed) and `send` takes each reply whole.
    Its descriptor is one end of a socket pair with a byte left unread, so each wait for input is
    a real turn of the hub that finds it readable at once."""

    def __init__(self, requests: list[bytes], readable: socket.socket) -> None:
        self.requests = iter(requests)
        self.readable = readable
        self.replies = 0

    def fileno(self) -> int:
        return self.readable.fileno()

    def recv_into(self, buffer: Any, nbytes: int) -> int:
        request = next(self.requests, b"")
        buffer[:len(request)] = request
        return len(request)

    def send(self, data: bytes) -> int:
        self.replies += 1
        return len(data)


def measure_loop(rounds: int) -> None:
    """CPU per put + get round of the Thrift and memcache connections' serve loops (best of five)."""
    home = tempfile.mkdtemp(prefix="kestrel-answer-")
    readable, writer = socket.socketpair()
    writer.send(b"x")
    try:
        server = ServerState(from_mapping({"queue_path": home}, home))
        server.collection.load()
        metrics.install_storage_timing()
        thrift = [framed(encode_call("binary", "put", queue_name="q", items=[bytes(128)], expiration_msec=0)),
                  framed(encode_call("binary", "get", queue_name="q", max_items=1, timeout_msec=0,
                                     auto_abort_msec=0))]
        memcache = [b"set q 0 0 128\r\n" + bytes(128) + b"\r\n", b"get q\r\n"]
        for name, connection, requests in (("thrift", ThriftConnection, thrift),
                                           ("memcache", MemcacheConnection, memcache)):

            def serve(n: int, connection: Any = connection, requests: list[bytes] = requests) -> None:
                client = _ReadySocket(requests * n, readable)
                connection(server, client, "bench").run()
                if client.replies != 2 * n:
                    raise RuntimeError(f"{client.replies} replies to {2 * n} requests")

            serve(rounds // 5)  # warm up
            best = min(_cpu(serve, rounds) for _ in range(5))
            print(f"| {name} | {best / rounds * 1e6:,.1f} | {rounds / best:,.0f} |", flush=True)
        server.collection.close()
    finally:
        readable.close()
        writer.close()
        shutil.rmtree(home, ignore_errors=True)


def _thrift_rounds(server: ServerState, batch: int, get_call: str) -> Callable[[int], None]:
    no_socket: Any = _NoSocket()
    conn = ThriftConnection(server, no_socket, "bench")
    put = encode_call("binary", "put", queue_name="q", items=[bytes(128)] * batch, expiration_msec=0)
    get = encode_call("binary", get_call, queue_name="q", max_items=batch, timeout_msec=0, auto_abort_msec=0)

    def rounds(n: int) -> None:
        for _ in range(n):
            conn.answer_frame(put)
            conn.answer_frame(get)

    return rounds


def _memcache_rounds(server: ServerState, batch: int) -> Callable[[int], None]:
    sock, _ = socket.socketpair()
    conn = MemcacheConnection(server, sock, "bench")
    conn.send = conn.out.clear  # type: ignore[method-assign]  # the replies are dropped: nobody reads them
    sets = (b"set q 0 0 128\r\n" + bytes(128) + b"\r\n") * batch
    gets = b"get q\r\n" * batch

    def rounds(n: int) -> None:
        for _ in range(n):
            conn.process(bytearray(sets))
            conn.out.clear()
            conn.process(bytearray(gets))
            conn.out.clear()

    return rounds


def _cpu(call: Any, n: int) -> float:
    started = time.process_time()
    call(n)
    return time.process_time() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 100])
    parser.add_argument("--rounds", type=int, default=20000, help="items per measurement (default 20000)")
    parser.add_argument("--get", choices=["get", "get_timed"], default="get",
                        help="the read call (default get)")
    parser.add_argument("--protocol", choices=["thrift", "memcache"], default="thrift",
                        help="the requests answered (default thrift)")
    parser.add_argument("--profile", action="store_true", help="also print cProfile's top functions")
    parser.add_argument("--loop", action="store_true",
                        help="measure the connections' serve loops (Thrift and memcache, single items)")
    args = parser.parse_args()
    configure_logging("warning")
    if args.loop:
        print(f"# the serve loop of one connection, single items, {time.strftime('%Y-%m-%d %H:%M %Z')}, "
              f"{machine()}, load average {load_average()}")
        print("| protocol | CPU µs per put + get round | items/s of one core |")
        print("| --- | --- | --- |")
        measure_loop(args.rounds)
        return
    what = (f"put + {args.get} through ThriftConnection.answer_frame" if args.protocol == "thrift"
            else "pipelined sets + gets through MemcacheConnection.process")
    print(f"# {what}, {time.strftime('%Y-%m-%d %H:%M %Z')}, {machine()}, load average {load_average()}")
    print("| items per request | CPU µs per put + get round | items/s of one core |")
    print("| --- | --- | --- |")
    for batch in args.batch:
        measure(batch, args.rounds, args.profile, args.get, args.protocol)


if __name__ == "__main__":
    main()
