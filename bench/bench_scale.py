"""Cost that follows the work: what many queues and many connections cost this server, beside Redis
(and, for connections, memcached and a minimal gevent server) in the same run, as server CPU time
from /proc.

- queues: memcache set + get and Thrift put + get of 128-byte items (Redis: RPUSH / LPOP), 4
  connections, on 4 queues and on QUEUES queues each holding FILL items, the load spread over all of
  them (each round on the client's next queue): CPU µs per item, and the ratio of the two.
- idle: the server still holding those QUEUES queues, no client: % of one core over IDLE seconds.
- stats: `GET /stats.json` and `GET /metrics` of the server holding those queues: how long each
  took (the least of three), and the longest round of a light client (memcache `version`, one at a
  time) meanwhile.
- library: the same put + get through the storage alone (`QueueCollection`, in one process, no
  socket), on 4 queues and on QUEUES queues, the memory governor's tick and the expiry sweep called
  every ITEMS_PER_TICK items (about the server's rate over 250 ms): CPU µs per item of the put +
  get, of the tick and of the sweep, the best of three.
- connections: the same load on 4 queues from 4 connections and from CONNECTIONS connections,
  both from 4 client processes (each driving its share of the connections on one event loop, so
  that the clients' own scheduling is the same in both): CPU µs per item, and the ratio.
- connect + close: CYCLES connections opened and closed in turn, no request: CPU µs per connection.
- files: the kernel's part of a journal file a queue, with no server: appends of a put's record
  (150 bytes) to QUEUES files in turn against 4 files, in `--dir` (the file system to measure;
  default the work folder): the system time of a `write`, the least of `--repeat` runs.

Our server runs in each of BUILDS (bench/peers.py) in every row.

Every server starts afresh for each row (our server on its defaults: `max_memory_total` auto, the
expiry sweep every second), and is left SETTLE seconds after its queues are made for the background
tasks' first look at them. The two loads a ratio compares take their turns run by run (for queues,
on two servers of the row side by side: one holding 4 queues, one holding QUEUES), so that the ratio
compares runs of the same minutes. `--source DIR` runs our server from another source tree (the code
before a change, say), with this checkout's load generator; `--compiled DIR` runs the compiled
build installed in DIR (another checkout's build/compiled) in place of this checkout's.

    .venv/bin/python -m bench.bench_scale [--queues 10000] [--fill 2] [--connections 1000]
                                          [--seconds 3] [--repeat 3] [--idle 10] [--cycles 2000]
                                          [--settle 1]
                                          [--only queues|library|connections|connect|files]
                                          [--dir DIR]
                                          [--builds pure compiled]
                                          [--source DIR] [--compiled DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

from bench import loadgen, peers
from bench.common import load_average, machine, process_cpu_seconds

Server = Callable[[], AbstractContextManager[peers.Running]]


def servers(work: Path, builds: list[str]) -> Iterator[tuple[str, Server, str, str]]:
    """(label, start, port name, load generator protocol) of each server a row compares."""
    for build in builds:
        yield f"kestrel-py {build}", ours(work, build), "memcache", "memcache"
    yield "Redis", lambda: peers.redis(work), "redis", "redis"


def queue_rows(work: Path, builds: list[str]) -> Iterator[tuple[str, Server, str, str]]:
    """The rows of the queues table: ours on both protocols (the admin port open, for the stats)."""
    for build in builds:
        yield f"kestrel-py {build} memcache", ours(work, build, admin=True), "memcache", "memcache"
        yield f"kestrel-py {build} Thrift", ours(work, build, admin=True), "thrift", "thrift"
    yield "Redis", lambda: peers.redis(work), "redis", "redis"


@dataclass(frozen=True)
class Cost:
    """The run of least server CPU per item (a put and a get), and its items/s."""

    cpu_us_per_item: float
    items_per_s: float


@dataclass(frozen=True)
class Load:
    """One side of a comparison: a server, its port and protocol, and the generator's options."""

    server: peers.Running
    port: str
    protocol: str
    options: dict[str, int]


def costs_in_turn(binary: Path, args: argparse.Namespace, *loads: Load, fill: int = 0) -> list[Cost]:
    """Each load's server CPU µs per item, the least of `args.repeat` runs of `args.seconds` (other
    work on a shared machine only ever adds to it), the loads taking turns run by run so that each
    ratio compares runs of the same minutes; after a short run of each that creates its queues (and
    fills them), so that their creation is not counted."""
    for load in loads:
        loadgen.run(binary, load.protocol, load.server[load.port], seconds=0.1, timeout=600, fill=fill,
                    **load.options)
    time.sleep(args.settle)  # the background tasks' first look at the new queues
    best = [Cost(float("inf"), 0.0) for _ in loads]
    for _ in range(args.repeat):
        for n, load in enumerate(loads):
            before = process_cpu_seconds(load.server.pid)
            result = loadgen.run(binary, load.protocol, load.server[load.port], seconds=args.seconds,
                                 timeout=600, warm_up=False, **load.options)
            cpu = (process_cpu_seconds(load.server.pid) - before) * 1e6 / max(result.items, 1)
            if cpu < best[n].cpu_us_per_item:
                best[n] = Cost(cpu, result.items_per_s)
    return best


def growth(few: Cost, many: Cost) -> float:
    """CPU per item under the heavier load over the lighter's (NaN where a run was too short for
    /proc's clock ticks to see the server)."""
    return many.cpu_us_per_item / few.cpu_us_per_item if few.cpu_us_per_item else float("nan")


# Each server's figures on 4 queues and on many, and % of a core idle holding the many.
QueueFigures = dict[str, tuple[Cost, Cost, float]]


def queues_and_idle(binary: Path, work: Path, args: argparse.Namespace) -> QueueFigures:
    print(f"\n### {args.queues:,} queues against 4: memcache set + get, Thrift put + get (Redis RPUSH / "
          f"LPOP), 128 B, 4 connections, {args.fill} items left in each queue\n")
    print("| server | CPU µs/item, 4 queues | CPU µs/item, "
          f"{args.queues:,} queues | ratio | idle with {args.queues:,} queues, % of a core |")
    print("| --- | --- | --- | --- | --- |")
    polls = []
    figures: QueueFigures = {}
    for label, start, port, protocol in queue_rows(work, args.builds):
        with start() as few_server, start() as server:  # a server holding 4 queues, one holding many
            few, many = costs_in_turn(binary, args, Load(few_server, port, protocol, {"queues": 4}),
                                      Load(server, port, protocol, {"queues": args.queues}), fill=args.fill)
            time.sleep(2 * args.settle)  # the first look of the background tasks at what the load changed
            before = process_cpu_seconds(server.pid)
            time.sleep(args.idle)
            idle = (process_cpu_seconds(server.pid) - before) / args.idle * 100
            if "admin" in server.ports:
                polls.append((label, *stats_poll(server, "/stats.json"), *stats_poll(server, "/metrics")))
        figures[label] = (few, many, idle)
        ratio = growth(few, many)
        print(f"| {label} | {few.cpu_us_per_item:.1f} | {many.cpu_us_per_item:.1f} | {ratio:.2f} "
              f"| {idle:.2f} |", flush=True)
    print(f"\n`GET /stats.json` and `GET /metrics` with {args.queues:,} queues, and a light client's "
          "rounds meanwhile:\n")
    print("| server | /stats.json, ms to answer | longest light round, ms | /metrics, ms to answer | "
          "longest light round, ms |")
    print("| --- | --- | --- | --- | --- |")
    for label, took, longest, metrics_took, metrics_longest in polls:
        print(f"| {label} | {took * 1000:.0f} | {longest * 1000:.1f} | {metrics_took * 1000:.0f} | "
              f"{metrics_longest * 1000:.1f} |", flush=True)
    return figures


def stats_poll(server: peers.Running, path: str) -> tuple[float, float]:
    """Seconds a `GET path` of the admin port took (the least of three), and the longest round of a
    light memcache client (`version`, one request at a time) while they ran."""
    longest = 0.0
    polling = threading.Event()
    polling.set()

    def light_client() -> None:
        nonlocal longest
        with socket.create_connection(("127.0.0.1", server["memcache"])) as sock:
            while polling.is_set():
                started = time.perf_counter()
                sock.sendall(b"version\r\n")
                while not sock.recv(4096).endswith(b"\r\n"):
                    pass
                longest = max(longest, time.perf_counter() - started)

    client = threading.Thread(target=light_client)
    client.start()
    took = float("inf")
    url = f"http://127.0.0.1:{server['admin']}{path}"
    try:
        for _ in range(3):
            started = time.perf_counter()
            with urllib.request.urlopen(url, timeout=60) as reply:
                reply.read()
            took = min(took, time.perf_counter() - started)
    finally:
        polling.clear()
        client.join()
    return took, longest


ITEMS_PER_TICK = 3500


def library(args: argparse.Namespace) -> None:
    print(f"\n### The storage alone, in process: put + get on 4 and on {args.queues:,} queues "
          f"holding {args.fill} items, the tick and the sweep every {ITEMS_PER_TICK:,} items\n")
    print("| queues | CPU µs/item: put + get | the governor's tick | the expiry sweep |")
    print("| --- | --- | --- | --- |")
    env = dict(os.environ, PYTHONPATH=f"{peers.SOURCE}{os.pathsep}{peers.ROOT}")
    for queues in (4, args.queues):
        done = subprocess.run([sys.executable, "-m", "bench.bench_scale", "--library-child", str(queues),
                               "--fill", str(args.fill)], env=env, capture_output=True, text=True, check=True)
        figures = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"| {queues:,} | {figures['items']:.2f} | {figures['tick']:.2f} | {figures['sweep']:.2f} |",
              flush=True)


def library_child(queues: int, fill: int) -> None:
    """The `library` figures of `queues` queues, as one JSON line (run in a process of its own, on
    the source tree under test)."""
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    from kestrel.storage import QueueCollection

    item = b"x" * 128
    best = {"items": float("inf"), "tick": float("inf"), "sweep": float("inf")}
    with tempfile.TemporaryDirectory(prefix="kestrel-scale-") as path:
        coll = QueueCollection(path, max_memory_total=1 << 30)
        coll.load()
        governor = coll.governor
        assert governor is not None
        names = [f"q{i}" for i in range(queues)]
        for name in names:
            coll.put(name, [item] * fill)
        governor.tick()
        coll.sweep()
        rounds = 20 * ITEMS_PER_TICK
        for _ in range(3):
            spent = {"items": 0.0, "tick": 0.0, "sweep": 0.0}
            for i in range(rounds):
                started = time.process_time()
                name = names[i % queues]
                coll.put(name, [item])
                coll.remove(name)
                spent["items"] += time.process_time() - started
                if i % ITEMS_PER_TICK == ITEMS_PER_TICK - 1:
                    started = time.process_time()
                    governor.tick()
                    spent["tick"] += time.process_time() - started
                    started = time.process_time()
                    coll.sweep()
                    spent["sweep"] += time.process_time() - started
            best = {key: min(best[key], spent[key] * 1e6 / rounds) for key in best}
        coll.close()
    print(json.dumps(best))


def connections(binary: Path, work: Path, args: argparse.Namespace) -> dict[str, tuple[Cost, Cost]]:
    """Each server's figures from 4 connections and from `args.connections`."""
    print(f"\n### {args.connections:,} connections against 4: the same load on 4 queues\n")
    print(f"| server | CPU µs/item, 4 connections | CPU µs/item, {args.connections:,} connections | ratio |")
    print("| --- | --- | --- | --- |")
    rows = [*servers(work, args.builds), ("memcached", lambda: peers.memcached(work), "memcache", "memcache"),
            ("a minimal gevent server", lambda: peers.minimal_gevent(work), "memcache", "memcache")]
    figures = {}
    for label, start, port, protocol in rows:
        with start() as server:
            loads = (Load(server, port, protocol, {"clients": clients, "processes": 4, "queues": 4})
                     for clients in (4, args.connections))
            few, many = costs_in_turn(binary, args, *loads)
        figures[label] = (few, many)
        print(f"| {label} | {few.cpu_us_per_item:.1f} | {many.cpu_us_per_item:.1f} | "
              f"{growth(few, many):.2f} |", flush=True)
    return figures


def connect_and_close(work: Path, args: argparse.Namespace) -> dict[str, float]:
    """Each server's CPU µs to accept and close a connection."""
    print(f"\n### Accepting and closing a connection: {args.cycles:,} in turn, no request\n")
    print("| server | CPU µs per connection |")
    print("| --- | --- |")
    rows = [(f"kestrel-py {build} ({name} port)", ours(work, build), port)
            for build in args.builds for name, port in (("memcache", "memcache"), ("Thrift", "thrift"))]
    rows.append(("Redis", lambda: peers.redis(work), "redis"))
    rows.append(("a minimal gevent server", lambda: peers.minimal_gevent(work), "memcache"))
    costs = {}
    for label, start, port in rows:
        with start() as server:
            address = ("127.0.0.1", server[port])
            for _ in range(100):  # warm
                socket.create_connection(address).close()
            time.sleep(0.5)
            before = process_cpu_seconds(server.pid)
            for _ in range(args.cycles):
                socket.create_connection(address).close()
            time.sleep(0.5)  # the last closes handled
            cost = (process_cpu_seconds(server.pid) - before - idle_cpu(server, 0.5)) / args.cycles * 1e6
        costs[label] = cost
        print(f"| {label} | {cost:.0f} |", flush=True)
    return costs


RECORD = 150  # a put's record of a 128-byte item: its opcode, length, times and data


def journal_files(work: Path, args: argparse.Namespace) -> dict[int, float]:
    """System µs per append to each of `args.queues` files in turn and to each of 4 (`files`)."""
    root = Path(tempfile.mkdtemp(prefix="journal-files-", dir=args.dir or work))
    try:
        return appends(root, args)
    finally:
        shutil.rmtree(root)


def appends(root: Path, args: argparse.Namespace) -> dict[int, float]:
    print(f"\n### Appends of {RECORD} bytes to {args.queues:,} files in turn against 4, in "
          f"{args.dir or 'the work folder'} (`{file_system(root)}`), no server\n")
    print("| files | system µs a write | user µs a write (the Python loop) |\n| --- | --- | --- |")
    figures: dict[int, float] = {}
    record = b"x" * RECORD
    for files in (4, args.queues):
        folder = root / str(files)
        folder.mkdir()
        fds = [os.open(folder / str(i), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644) for i in range(files)]
        try:
            writes = max(200_000 // files, 20) * files  # each file written past its first page of records
            best = (float("inf"), float("inf"))
            for _ in range(args.repeat):
                before = os.times()
                for i in range(writes):
                    os.write(fds[i % files], record)
                after = os.times()
                best = min(best, ((after.system - before.system) * 1e6 / writes,
                                  (after.user - before.user) * 1e6 / writes))
        finally:
            for fd in fds:
                os.close(fd)
        figures[files] = best[0]
        print(f"| {files:,} | {best[0]:.2f} | {best[1]:.2f} |")
    ratio = figures[args.queues] / figures[4]
    print(f"\n{args.queues:,} files cost {ratio:.2f}× the system time a write of 4.")
    return figures


def file_system(path: Path) -> str:
    """The type and mount options of the file system holding `path` (/proc/mounts)."""
    best = ("", "")
    with open("/proc/mounts", encoding="utf-8") as mounts:
        for line in mounts:
            _, point, kind, options = line.split()[:4]
            if str(path.resolve()).startswith(point.rstrip("/") + "/") and len(point) > len(best[0]):
                best = (point, f"{kind} {options}")
    return best[1]


def ours(work: Path, build: str, admin: bool = False) -> Server:
    """Starts our server in `build` (with the admin port open with `admin`)."""
    return lambda: peers.kestrel(work, admin=admin, build=build)


def idle_cpu(server: peers.Running, seconds: float) -> float:
    """What the server spends doing nothing for `seconds` (taken off the connection figures)."""
    before = process_cpu_seconds(server.pid)
    time.sleep(seconds)
    return process_cpu_seconds(server.pid) - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queues", type=int, default=10_000)
    parser.add_argument("--fill", type=int, default=2, help="items left in each queue")
    parser.add_argument("--connections", type=int, default=1_000)
    parser.add_argument("--seconds", type=float, default=3.0, help="each load run")
    parser.add_argument("--repeat", type=int, default=3, help="load runs per figure, the least CPU kept")
    parser.add_argument("--idle", type=float, default=10.0, help="seconds the idle server is watched")
    parser.add_argument("--cycles", type=int, default=2_000, help="connections opened and closed")
    parser.add_argument("--only", choices=["queues", "library", "connections", "connect", "files"])
    parser.add_argument("--dir", type=Path, help="where `files` appends (the file system to measure)")
    parser.add_argument("--settle", type=float, default=1.0,
                        help="seconds left to the background tasks after the queues are made")
    parser.add_argument("--builds", nargs="+", choices=sorted(peers.BUILDS), default=["pure"],
                        help="our server's builds, each measured in every row (default: pure)")
    parser.add_argument("--library-child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--source", type=Path, help="run our server from this source tree")
    parser.add_argument("--compiled", type=Path, help="run our compiled build from this directory")
    args = parser.parse_args()
    if args.library_child:
        library_child(args.library_child, args.fill)
        return
    if args.source is not None:
        peers.SOURCE = args.source.resolve()
    if args.compiled is not None:
        peers.COMPILED = args.compiled.resolve()
    print(f"# cost that follows the work, {time.strftime('%Y-%m-%d %H:%M %Z')}, {machine()}")
    print(f"# our server from {peers.SOURCE} (compiled: {peers.COMPILED}); load average before: "
          f"{load_average()}")
    with tempfile.TemporaryDirectory(prefix="kestrel-scale-") as directory:
        work = Path(directory)
        try:
            binary = loadgen.build(work)
            if args.only in (None, "queues"):
                queues_and_idle(binary, work, args)
            if args.only in (None, "library"):
                library(args)
            if args.only in (None, "connections"):
                connections(binary, work, args)
            if args.only in (None, "connect"):
                connect_and_close(work, args)
            if args.only in (None, "files"):
                journal_files(work, args)
        except peers.MissingPeer as e:
            sys.exit(str(e))
    print(f"\n# load average after: {load_average()}")


if __name__ == "__main__":
    main()
