"""Helpers for the cluster tests: several real servers started together, and waiting on a condition."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from tests.conftest import PACKAGE_ROOT, ROOT, ServerProcess


@contextmanager
def running_servers(workdir: Path, configs: list[dict[str, Any]]) -> Iterator[list[ServerProcess]]:
    """One server per config, started in parallel, each in its own directory; stopped at the end."""
    servers = []
    for i, config in enumerate(configs):
        (workdir / f"s{i}").mkdir(parents=True, exist_ok=True)
        servers.append(ServerProcess(workdir / f"s{i}", config))
    try:
        with ThreadPoolExecutor(len(servers)) as pool:
            started = list(pool.map(ServerProcess.start, servers))
        servers[:] = started
        yield servers
    finally:
        for srv in servers:
            if srv.proc is not None and srv.proc.poll() is None:
                srv.stop()


# Producers, a get waiting on servers three seconds at a time, and a consumer in greenlets of one
# monkey-patched process, beside a ticker that only runs while nobody blocks the loop. A client that
# blocked the loop would hold the ticker up for a whole wait on a server: seconds, which tells it apart
# from anything a loaded machine does to a 10 ms ticker.
# Argument: host:port,... or zookeeper=hosts/prefix.
GEVENT_SCRIPT = """
from gevent import monkey
monkey.patch_all()
import sys, time
import gevent
from kestrel.client import Cluster

if sys.argv[1].startswith("zookeeper="):
    hosts, prefix = sys.argv[1].removeprefix("zookeeper=").split("/", 1)
    cluster = Cluster.from_zookeeper(hosts, "/" + prefix, poll_ms=9000)
else:
    cluster = Cluster(sys.argv[1].split(","), poll_ms=9000)
ticks = []

def ticker():
    while True:
        ticks.append(time.monotonic())
        gevent.sleep(0.01)

def producer(n):
    for i in range(100):
        cluster.put_many("g", [b"%d-%d" % (n, i)])

gevent.spawn(ticker)
started = time.monotonic()
waiting = gevent.spawn(cluster.get, "later", 30.0)   # waits on one server three seconds at a time
producers = [gevent.spawn(producer, n) for n in range(10)]
gevent.joinall(producers, raise_error=True)
gevent.spawn_later(0.5, cluster.put, "later", b"now")
assert waiting.get() == b"now"
waited = time.monotonic() - started
seen = []
cluster.consume("g", seen.append, batch=30, until_empty=True)
assert len(seen) == 1000 and len(set(seen)) == 1000, len(seen)
print("max_gap", round(max(b - a for a, b in zip(ticks, ticks[1:])), 3), "waited", round(waited, 2))
"""


# The longest the ticker may be held up: far below a wait on one server (3 s), far above what a
# loaded machine does to it.
MAX_TICKER_GAP_S = 2.0


def run_gevent_script(servers: str) -> tuple[float, float]:
    """Run GEVENT_SCRIPT against `servers`: the longest the ticker was kept waiting, and how long
    the get waited while the others worked."""
    out = subprocess.run([sys.executable, "-c", GEVENT_SCRIPT, servers], cwd=str(ROOT), capture_output=True,
                         text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(PACKAGE_ROOT)))
    assert out.returncode == 0, out.stderr[-3000:]
    words = out.stdout.split()
    return float(words[1]), float(words[3])


@contextmanager
def hung_servers(count: int, silence: str) -> Iterator[list[str]]:
    """Addresses of `count` listeners that never accept (their backlog full: a connect times out, as to
    a partitioned host) or never answer (the kernel accepts, nobody reads: a call times out, as on a
    frozen server)."""
    with ExitStack() as held:
        addresses = []
        for _ in range(count):
            hung = held.enter_context(socket.socket())
            hung.bind(("127.0.0.1", 0))
            hung.listen(0 if silence == "never accepts" else 64)
            port = hung.getsockname()[1]
            addresses.append(f"127.0.0.1:{port}")
            if silence == "never accepts":
                for _ in range(3):  # fill its backlog: the connects after these are never answered
                    queued = held.enter_context(socket.socket())
                    queued.setblocking(False)
                    queued.connect_ex(("127.0.0.1", port))
        yield addresses
