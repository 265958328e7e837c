"""The Python cost of one Thrift put + get round, without sockets: `ThriftConnection.answer_frame` on
ready binary frames, against a real queue collection with its journal (`sync_journal: never`).
With `--protocol memcache`, a round is `batch` pipelined `set q 0 0 128` then `batch` `get q`, each
burst one buffer through `MemcacheConnection.process` (its replies dropped, not sent).

CPU time (not wall time: on a shared machine other work stretches wall time, not our CPU time), the
best of five runs. What it leaves out is the kernel's part (recv, send, the journal's write is in),
so it isolates what Python changes can win; run it in two checkouts to compare code.

    .venv/bin/python -m bench.bench_answer [--batch 1 100] [--rounds 20000] [--get get_timed]
                                           [--timeout-ms MS [--short]]
                                           [--protocol thrift|memcache] [--profile]
    .venv/bin/python -m bench.bench_answer --loop [--rounds 20000] [--protocol thrift|memcache] [--reliable]
                                           [--queues N]
    .venv/bin/python -m bench.bench_answer ... --builds compiled pure [--runs 5]

`--get get_timed` reads with the call that also hands out each item's add time and expiry.
`--timeout-ms` gives the Thrift get a time-out (its items are there: it need not wait); with
`--short` it asks for one item more than the round put, so it takes them all and waits out its
time-out for the rest (the wait unwatched: there is no socket; CPU time leaves the wait out).
`--loop` measures a connection's whole serve loop instead, Thrift and memcache, single items: framing,
each request's wait for input on the hub, the answer, the reply; over a socket stand-in that always
holds the next request, so that no `recv` or `send` runs (the hub's `epoll_wait` does): each
request is one turn of the hub, answered in its callback where it can be (docs/architecture.md,
*Requests answered in the hub*); `--protocol` measures one of the two; with `--queues N` each
round goes to the next of N queues (made, each holding an item, before anything is measured), as
`bench_scale --only queues` spreads its load. With `--reliable` each read
is a reliable reader's: a Thrift get with auto-abort then a confirm of its id (three requests a
round), a memcache `get q/close/open` (closing the read of the round before).
`--builds` compares builds of the server (bench/peers.py; the compiled one is made by `make
compiled`): a process of each in turn, `--runs` times, the median of each printed beside the first's.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

from bench import peers
from bench.common import load_average, machine
from kestrel.build import build_name
from kestrel.service import metrics, socket_io
from kestrel.service.config import from_mapping
from kestrel.service.logs import configure_logging
from kestrel.service.memcache.handler import MemcacheConnection
from kestrel.service.session.server_state import ServerState
from kestrel.service.thrift.handler import ThriftConnection
from tests.support.thrift_wire import encode_call, framed


class _NoSocket:
    """`answer` never touches the socket; the connection only keeps it and its descriptor (none)."""

    def fileno(self) -> int:
        return -1


def measure(batch: int, items: int, profile: bool, get_call: str = "get", protocol: str = "thrift",
            timeout_ms: int = 0, short: bool = False) -> float:
    """CPU µs per round of `batch` items (the best of five)."""
    home = tempfile.mkdtemp(prefix="kestrel-answer-")
    try:
        server = ServerState(from_mapping({"queue_path": home}, home))
        server.collection.load()
        metrics.install_storage_timing()
        if protocol == "thrift":
            rounds = _thrift_rounds(server, batch, get_call, timeout_ms, short)
        else:
            rounds = _memcache_rounds(server, batch)
        n = max(items // batch // 5, 1)
        rounds(n)  # warm up
        best = min(_cpu(rounds, n) for _ in range(5))
        if profile:
            profiler = cProfile.Profile()
            profiler.runcall(rounds, n)
            pstats.Stats(profiler).sort_stats("tottime").print_stats(20)
        server.close()
        return best / n * 1e6
    finally:
        shutil.rmtree(home, ignore_errors=True)


class _ReadySocket:
    """A client's socket as a connection sees it, always holding the next request: its receive
    hands out the requests in turn (then 0, the client closed) and its send takes each reply whole,
    in place of the connection's system calls (`socket_io._receive_appending` and `_send_some`,
    replaced while the loop runs). Its descriptor is one end of a socket pair with a byte left
    unread, so each wait for input is a real turn of the hub that finds it readable at once. A
    request may be made from the reply before it (`last_id`: a Thrift get's last read id)."""

    def __init__(self, readable: socket.socket) -> None:
        self.requests: Iterator[bytes | None] = iter(())
        self.readable = readable
        self.replies = 0
        self.last_id = bytes(8)

    def fileno(self) -> int:
        return self.readable.fileno()

    def receive(self, fd: int, buf: bytearray, chunk: int) -> int:
        request = next(self.requests, b"")
        if request is None:
            return -1  # the next request is made from a reply not sent yet
        buf += request
        return len(request)

    def send(self, fd: int, data: bytes | memoryview) -> int:
        self.replies += 1
        self.last_id = bytes(data[-10:-2])  # a one-item get's reply ends with the item's id, two stops
        return len(data)


# A read id that no real one equals, in the confirm whose bytes each round's id replaces.
_ID_MARK = 0x0102030405060708


def _thrift_requests_by_queue(names: list[str], reliable: bool) -> list[tuple[bytes, bytes, bytes, int]]:
    """Each queue's round of requests, framed: a put and a get of one item (`reliable`: the get with
    auto-abort), and a confirm with where its id goes."""
    rounds = []
    for name in names:
        put = framed(encode_call("binary", "put", queue_name=name, items=[bytes(128)], expiration_msec=0))
        get = framed(encode_call("binary", "get", queue_name=name, max_items=1, timeout_msec=0,
                                 auto_abort_msec=60_000 if reliable else 0))
        confirm = framed(encode_call("binary", "confirm", queue_name=name, ids={_ID_MARK}))
        rounds.append((put, get, confirm, confirm.index(_ID_MARK.to_bytes(8, "big"))))
    return rounds


def _thrift_requests(client: _ReadySocket, n: int, reliable: bool,
                     rounds: list[tuple[bytes, bytes, bytes, int]]) -> Iterator[bytes | None]:
    """`n` rounds of `_thrift_requests_by_queue`, each to the next queue; `reliable`: the get, then a
    confirm of the id its reply gave (None, nothing yet, until that reply is sent: a get with
    auto-abort looks for the end of its client's stream before it replies)."""
    for i in range(n):
        put, get, confirm, at = rounds[i % len(rounds)]
        yield put
        yield get
        if reliable:
            while client.replies < 3 * i + 2:
                yield None
            yield confirm[:at] + client.last_id + confirm[at + 8:]


def _memcache_requests_by_queue(names: list[str], reliable: bool) -> list[tuple[bytes, bytes]]:
    """Each queue's set and get (`reliable`: `get q/close/open`, closing the read before)."""
    return [(b"set %s 0 0 128\r\n%s\r\n" % (name.encode(), bytes(128)),
             b"get %s%s\r\n" % (name.encode(), b"/close/open" if reliable else b"")) for name in names]


def _memcache_requests(client: _ReadySocket, n: int, reliable: bool,
                       rounds: list[tuple[bytes, bytes]]) -> Iterator[bytes]:
    """`n` rounds of `_memcache_requests_by_queue`, each to the next queue."""
    for i in range(n):
        put, get = rounds[i % len(rounds)]
        yield put
        yield get


def measure_loop(rounds: int, protocols: tuple[str, ...] = ("thrift", "memcache"),
                 reliable: bool = False, client_timeout_ms: int | None = None,
                 queues: int = 1) -> dict[str, float]:
    """CPU µs per put + get round of the Thrift and memcache connections' serve loops (best of five);
    `reliable`: each read opened and confirmed as a reliable reader does; `client_timeout_ms`: the
    server's idle time-out between requests; `queues`: the rounds go round that many queues, each
    made (and holding an item) before anything is measured."""
    measured = {}
    home = tempfile.mkdtemp(prefix="kestrel-answer-")
    readable, writer = socket.socketpair()
    writer.send(b"x")
    try:
        idle = None if client_timeout_ms is None else f"{client_timeout_ms}ms"
        server = ServerState(from_mapping({"queue_path": home, "client_timeout": idle}, home))
        server.collection.load()
        metrics.install_storage_timing()
        names = ["q"] if queues == 1 else [f"q{i}" for i in range(queues)]
        if queues > 1:
            for name in names:
                server.collection.put(name, [bytes(128)])
        per_round = 3 if reliable else 2
        for name, connection, made, requests, replies in (
                ("thrift", ThriftConnection, _thrift_requests_by_queue, _thrift_requests, per_round),
                ("memcache", MemcacheConnection, _memcache_requests_by_queue, _memcache_requests, 2)):
            if name not in protocols:
                continue
            # Made here, outside the time measured: Thrift's for 10,000 queues took 2.8 µs a round
            # of 20,000, memcache's 1.1, which the figures of many queues once counted.
            by_queue = made(names, reliable)

            def serve(n: int, connection: Any = connection, requests: Any = requests,
                      by_queue: Any = by_queue, replies: int = replies) -> None:
                client = _ReadySocket(readable)
                client.requests = requests(client, n, reliable, by_queue)
                calls = socket_io._receive_appending, socket_io._send_some
                socket_io._receive_appending, socket_io._send_some = client.receive, client.send
                try:
                    connection(server, client, "bench").run()
                finally:
                    socket_io._receive_appending, socket_io._send_some = calls
                if client.replies != replies * n:
                    raise RuntimeError(f"{client.replies} replies to {replies * n} requests")
                if reliable and server.collection.queue(names[-1]).open_transactions > 1:
                    raise RuntimeError("the reads were not confirmed")  # (memcache leaves its last open)

            serve(rounds // 5)  # warm up
            measured[name] = min(_cpu(serve, rounds) for _ in range(5)) / rounds * 1e6
        server.close()
        return measured
    finally:
        readable.close()
        writer.close()
        shutil.rmtree(home, ignore_errors=True)


def _thrift_rounds(server: ServerState, batch: int, get_call: str, timeout_ms: int = 0,
                   short: bool = False) -> Callable[[int], None]:
    no_socket: Any = _NoSocket()
    conn = ThriftConnection(server, no_socket, "bench")
    conn.session.watch = None  # no socket to watch during a wait
    put = encode_call("binary", "put", queue_name="q", items=[bytes(128)] * batch, expiration_msec=0)
    get = encode_call("binary", get_call, queue_name="q", max_items=batch + short, timeout_msec=timeout_ms,
                      auto_abort_msec=0)

    def rounds(n: int) -> None:
        for _ in range(n):
            conn.answer_frame(put)
            conn.answer_frame(get)

    return rounds


class _Discard(_NoSocket):
    """A client's socket that takes every reply whole and never has input."""

    def send(self, data: bytes) -> int:
        return len(data)


def _memcache_rounds(server: ServerState, batch: int) -> Callable[[int], None]:
    discard: Any = _Discard()
    conn = MemcacheConnection(server, discard, "bench")
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


def measure_all(args: argparse.Namespace) -> dict[str, float]:
    """What the command line asks for, in this process: CPU µs per round by row."""
    configure_logging("warning")
    if args.loop:
        return measure_loop(args.rounds, (args.protocol,) if args.protocol else ("thrift", "memcache"),
                            args.reliable, args.client_timeout_ms, args.queues)
    return {str(batch): measure(batch, args.rounds, args.profile, args.get, args.protocol, args.timeout_ms,
                                args.short)
            for batch in args.batch}


def alternate(args: argparse.Namespace, argv: list[str]) -> dict[tuple[str, str], list[float]]:
    """`measure_all` in a process of each build in turn, `args.runs` times: the figures by row and build."""
    figures: dict[tuple[str, str], list[float]] = {}
    command = [sys.executable, "-m", "bench.bench_answer", *argv, "--json"]
    paths = {build: peers.build_path(build) for build in args.builds}
    for _ in range(args.runs):
        for build, path in paths.items():
            done = subprocess.run(command, env=dict(os.environ, PYTHONPATH=str(path)), cwd=peers.ROOT,
                                  capture_output=True, text=True, check=True)
            for key, value in json.loads(done.stdout.splitlines()[-1]).items():
                figures.setdefault((key, build), []).append(value)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 100])
    parser.add_argument("--rounds", type=int, default=20000, help="items per measurement (default 20000)")
    parser.add_argument("--get", choices=["get", "get_timed"], default="get",
                        help="the read call (default get)")
    parser.add_argument("--timeout-ms", type=int, default=0, help="the Thrift get's time-out (default 0)")
    parser.add_argument("--short", action="store_true",
                        help="the get asks for one item more than there are, and waits out its time-out")
    parser.add_argument("--protocol", choices=["thrift", "memcache"],
                        help="the requests answered (default thrift; with --loop, both)")
    parser.add_argument("--reliable", action="store_true",
                        help="with --loop: reliable reads (Thrift get with auto-abort then confirm; "
                             "memcache get q/close/open)")
    parser.add_argument("--client-timeout-ms", type=int,
                        help="with --loop: the server's client_timeout (default: none)")
    parser.add_argument("--queues", type=int, default=1,
                        help="with --loop: the rounds go round this many queues (default 1)")
    parser.add_argument("--profile", action="store_true", help="also print cProfile's top functions")
    parser.add_argument("--loop", action="store_true",
                        help="measure the connections' serve loops (Thrift and memcache, single items)")
    parser.add_argument("--builds", nargs="+", choices=sorted(peers.BUILDS),
                        help="measure each build in a process of its own, in turn (default: this process's)")
    parser.add_argument("--runs", type=int, default=5, help="with --builds: processes per build (default 5)")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # a child of --builds
    args = parser.parse_args()
    if args.json:
        print(json.dumps(measure_all(args)))
        return
    get = f"{args.get} (time-out {args.timeout_ms} ms{', one item short' if args.short else ''})"
    loop = (f"the serve loop of one connection, single items{', reliable reads' if args.reliable else ''}"
            f"{f', round {args.queues:,} queues' if args.queues > 1 else ''}")
    what = (loop if args.loop
            else f"put + {get} through ThriftConnection.answer_frame" if args.protocol != "memcache"
            else "pipelined sets + gets through MemcacheConnection.process")
    row = "protocol" if args.loop else "items per request"
    print(f"# {what}, CPU µs per put + get round, {time.strftime('%Y-%m-%d %H:%M %Z')}, {machine()}, "
          f"load average {load_average()}")
    if not args.builds:
        print(f"# the {build_name()} build")
        print(f"| {row} | CPU µs per round | items/s of one core |")
        print("| --- | --- | --- |")
        for key, us in measure_all(args).items():
            items = 1 if args.loop else int(key)
            print(f"| {key} | {us:,.1f} | {items * 1e6 / us:,.0f} |", flush=True)
        return
    argv = [arg for arg in sys.argv[1:] if arg not in ("--builds", *args.builds)]
    figures = alternate(args, argv)
    print(f"# {args.runs} processes per build, taking turns; each figure the best of five in its process")
    print(f"| {row} | build | median CPU µs per round | each process | ratio to {args.builds[0]} |")
    print("| --- | --- | --- | --- | --- |")
    for key in dict.fromkeys(key for key, _ in figures):
        first = statistics.median(figures[key, args.builds[0]])
        for build in args.builds:
            values = figures[key, build]
            median = statistics.median(values)
            print(f"| {key} | {build} | {median:,.1f} | {', '.join(f'{v:.1f}' for v in values)} | "
                  f"{median / first:.2f} |")
    print(f"# load average after: {load_average()}")


if __name__ == "__main__":
    main()
