"""What idle clients cost each server: RSS with many connections open, each after one request.

Our server over Thrift and over memcache, beside Redis in the same run: every server starts afresh,
its RSS is read from /proc before the clients connect, once all of them have been answered and
wait, and after they have all closed, once it has stopped falling (our server gives memory back a
second after a wave of closes: src/kestrel/service/memory_return.py).

    .venv/bin/python -m bench.bench_idle_connections [--connections 10000]
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


def measure(pid: int, port: int, protocol: str, connections: int) -> tuple[int, int, int]:
    """RSS in KB: before, with every client connected and answered, and after they closed."""
    request, reply_end = REQUESTS[protocol]
    before = rss_kb(pid)
    clients: list[socket.socket] = []
    try:
        for _ in range(connections):
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
            clients.append(s)
            s.sendall(request)
            reply = s.recv(4096)
            if not reply or not reply.endswith(reply_end):
                raise RuntimeError(f"{protocol}: unexpected reply {reply!r}")
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
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = args.connections + 100
    if hard < need:
        raise SystemExit(f"needs {need} file descriptors; the hard limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the servers started here inherit it

    print(f"{args.connections:,} idle connections, each after one request; {machine()}; "
          f"load average {load_average()}")
    print(f"{'server':<20} {'RSS before':>11} {'RSS held':>10} {'per client':>11} {'RSS after close':>16} "
          f"{'kept':>8}")
    with tempfile.TemporaryDirectory() as work:
        for name, start, port_name, protocol in servers(Path(work)):
            with start() as running:
                before, held, after = measure(running.pid, running[port_name], protocol, args.connections)
            per = (held - before) / args.connections
            print(f"{name:<20} {before / 1024:>8.1f} MB {held / 1024:>7.1f} MB {per:>8.1f} KB "
                  f"{after / 1024:>13.1f} MB {(after - before) / 1024:>5.1f} MB")


if __name__ == "__main__":
    main()
