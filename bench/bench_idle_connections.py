"""What idle clients cost each server: RSS with many connections open, each after one request.

Our server over Thrift and over memcache, beside Redis in the same run: every server starts afresh,
its RSS is read from /proc before the clients connect, once all of them have been answered and
wait, and after they have all closed, once it has stopped falling (our server gives memory back a
second after a wave of closes: src/kestrel/service/memory_return.py).

With `--item BYTES`, each client sends a put of an item of that size and a get of it together, twice
(memcache and Redis only), so that nothing stays queued: what a connection of large requests keeps
(ours receives such a connection's requests in place from its first large one on, the second here,
into room its input keeps between requests: docs/protocols.md).

    .venv/bin/python -m bench.bench_idle_connections [--connections 10000] [--item 1024]
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import socket
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from bench import peers
from bench.common import load_average, machine
from tests.support.thrift_wire import encode_call, framed, rss_kb

REQUESTS = {
    "thrift": (framed(encode_call("binary", "get_version")), b""),
    "memcache": (b"version\r\n", b"\r\n"),
    "redis": (b"PING\r\n", b"+PONG\r\n"),
}


def put_and_get(protocol: str, size: int) -> tuple[bytes, bytes]:
    """A put of an item of `size` bytes and a get of it, sent together, and how their replies end."""
    item = b"i" * size
    if protocol == "memcache":
        return b"set idle 0 0 %d\r\n%s\r\nget idle\r\n" % (size, item), b"END\r\n"
    return (b"*3\r\n$5\r\nRPUSH\r\n$4\r\nidle\r\n$%d\r\n%s\r\n*2\r\n$4\r\nLPOP\r\n$4\r\nidle\r\n"
            % (size, item), item + b"\r\n")


def measure(pid: int, port: int, protocol: str, connections: int, item: int = 0) -> tuple[int, int, int]:
    """RSS in KB: before, with every client connected and answered, and after they closed."""
    request, reply_end = put_and_get(protocol, item) if item else REQUESTS[protocol]
    before = rss_kb(pid)
    clients: list[socket.socket] = []
    try:
        for _ in range(connections):
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
            clients.append(s)
            for _ in range(2 if item else 1):
                s.sendall(request)
                reply = s.recv(65536)
                while reply and not reply.endswith(reply_end):
                    more = s.recv(65536)
                    if not more:
                        break
                    reply += more
                if not reply or not reply.endswith(reply_end):
                    raise RuntimeError(f"{protocol}: unexpected reply {reply[:200]!r}")
        held = rss_kb(pid)
    finally:
        for s in clients:
            s.close()
    return before, held, settled_rss_kb(pid)


def settled_rss_kb(pid: int, quiet_s: float = 3.0, limit_s: float = 30.0) -> int:
    """RSS once it has not fallen for `quiet_s` (the server has noticed the closes and freed what
    it frees), or after `limit_s`."""
    started = last_drop = time.monotonic()
    low = rss_kb(pid)
    while time.monotonic() - last_drop < quiet_s and time.monotonic() - started < limit_s:
        time.sleep(0.2)
        now = rss_kb(pid)
        if now < low:
            low, last_drop = now, time.monotonic()
    return low


def servers(work: Path) -> Iterator[tuple[str, Callable[[], contextlib.AbstractContextManager[peers.Running]],
                                          str, str]]:
    yield "kestrel (thrift)", lambda: peers.kestrel(work), "thrift", "thrift"
    yield "kestrel (memcache)", lambda: peers.kestrel(work), "memcache", "memcache"
    yield "redis", lambda: peers.redis(work), "redis", "redis"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--connections", type=int, default=10_000)
    parser.add_argument("--item", type=int, default=0,
                        help="each request a put and a get of an item of this many bytes "
                             "(memcache and Redis)")
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = args.connections + 100
    if hard < need:
        raise SystemExit(f"needs {need} file descriptors; the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the servers started here inherit it

    request = f"a put and a get of {args.item:,} B twice" if args.item else "one request"
    print(f"{args.connections:,} idle connections, each after {request}; {machine()}; "
          f"load average {load_average()}")
    print(f"{'server':<20} {'RSS before':>11} {'RSS held':>10} {'per client':>11} {'RSS after close':>16} "
          f"{'kept':>8}")
    with tempfile.TemporaryDirectory() as work:
        for name, start, port_name, protocol in servers(Path(work)):
            if args.item and protocol == "thrift":
                continue
            with start() as running:
                before, held, after = measure(running.pid, running[port_name], protocol, args.connections,
                                              args.item)
            per = (held - before) / args.connections
            print(f"{name:<20} {before / 1024:>8.1f} MB {held / 1024:>7.1f} MB {per:>8.1f} KB "
                  f"{after / 1024:>13.1f} MB {(after - before) / 1024:>5.1f} MB")


if __name__ == "__main__":
    main()
