"""Side-by-side server benchmarks: this server against beanstalkd, Redis and memcached, in one run.

The load comes from bench/loadgen.c, built here with the machine's C compiler: CLIENTS processes, one
connection each, each on its own queue, request/response, 128-byte items; an item is one put plus
one get. Every server runs on loopback on this machine, started and stopped by this script; the
peers come from Debian (installed when run as root). Each row prints our rate, the peer's, the ratio,
the p50 / p99 latency of one round (put + get of a batch, plus the confirm or delete if any), and the
server's CPU time per item (user + system, all its threads, from /proc): what an item costs the
server whatever else the machine is doing, where items/s also depends on how much of a core it got.

- single: one item per request, 4 clients. Our `sync_journal: never` against beanstalkd -F and
  Redis appendfsync no (a journal write per request, no fsync); our memcache port against memcached.
- batch: 100 items per round, 4 clients: one Thrift put and get against Redis's multi-value RPUSH
  and LPOP with a count, against 100 pipelined single-item Redis commands, and against 100
  pipelined beanstalkd commands (it has no batch command); memcache pipelined against memcached.
- durability: 16 clients, one item per put, an fsync before every acknowledgement: our
  `sync_journal: always`, with `commit_log` off and on (the default; run by run in turn), against
  beanstalkd -f0 and Redis appendfsync always.
- latency: one client, one item per request, with and without fsync (and the commit log).

    .venv/bin/python -m bench.bench_servers [--seconds S] [--repeat N] [--quick]
                                            [--only single|batch|durability|latency]
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench import loadgen, peers
from bench.common import load_average, machine, process_cpu_seconds


@dataclass(frozen=True)
class Measured:
    """The best run of a measurement, and the server's CPU time per item during that run."""

    load: loadgen.LoadResult
    cpu_us_per_item: float

    @property
    def items_per_s(self) -> float:
        return self.load.items_per_s


@dataclass
class Bench:
    """What every measurement needs: the generator's binary, how long a run lasts, how many to take.

    A measurement keeps the best of `repeat` runs: on a shared machine other work only ever slows a
    run down, so the fastest is the closest to what the server can do.
    """

    binary: Path
    seconds: float
    repeat: int

    def measure(self, protocol: str, server: peers.Running, port: str, prefix: str,
                **options: Any) -> Measured | None:
        best = None
        for attempt in range(self.repeat):
            cpu_before = process_cpu_seconds(server.pid)
            try:
                result = loadgen.run(self.binary, protocol, server[port], seconds=self.seconds,
                                     prefix=f"{prefix}{attempt}_", **options)
            except loadgen.LoadgenError as e:
                print(f"  ! {e}", file=sys.stderr)
                continue
            cpu = process_cpu_seconds(server.pid) - cpu_before
            if best is None or result.items_per_s > best.items_per_s:
                best = Measured(result, cpu * 1e6 / max(result.items, 1))
        return best


def cell(measured: Measured | None) -> str:
    if measured is None:
        return "failed | | "
    result = measured.load
    return (f"{result.items_per_s:,.0f} | {result.p('round', 'p50'):,.0f} / "
            f"{result.p('round', 'p99'):,.0f} | {measured.cpu_us_per_item:,.1f}")


def header(title: str) -> None:
    print(f"\n### {title}\n")
    print("| workload | kestrel-py items/s | p50 / p99 µs | CPU µs/item | peer | peer items/s | p50 / p99 µs "
          "| CPU µs/item | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")


def row(workload: str, ours: Measured | None, peer: str, theirs: Measured | None) -> None:
    ratio = f"{ours.items_per_s / theirs.items_per_s:.2f}" if ours and theirs else "-"
    print(f"| {workload} | {cell(ours)} | {peer} | {cell(theirs)} | {ratio} |", flush=True)


Section = Callable[[Bench, Path], None]


def single(bench: Bench, work: Path) -> None:
    header("Single items: 4 clients, 128 B, one item per request")
    with peers.kestrel(work) as k, peers.beanstalkd(work) as bean, peers.redis(work) as red, \
            peers.memcached(work) as mc:
        thrift = bench.measure("thrift", k, "thrift", "single")
        beans = bench.measure("beanstalk", bean, "beanstalk", "single")
        row("Thrift put + get", thrift, "beanstalkd -F put/reserve/delete", beans)
        row("Thrift put + get", thrift, "Redis RPUSH/LPOP", bench.measure("redis", red, "redis", "single"))
        confirmed = bench.measure("thrift", k, "thrift", "confirm", auto_abort_ms=10_000)
        row("Thrift put + get/auto-abort + confirm", confirmed, "beanstalkd -F put/reserve/delete", beans)
        memcache = bench.measure("memcache", k, "memcache", "single")
        row("memcache set + get", memcache, "memcached set/get",
            bench.measure("memcache", mc, "memcache", "m"))
        row("memcache set + get", memcache, "beanstalkd -F put/reserve/delete", beans)


def batch(bench: Bench, work: Path) -> None:
    header("Batches of 100: 4 clients, 128 B, one round = put 100 + get 100")
    with peers.kestrel(work) as k, peers.beanstalkd(work) as bean, peers.redis(work) as red, \
            peers.memcached(work) as mc:
        thrift = bench.measure("thrift", k, "thrift", "batch", batch=100)
        row("Thrift put(100) + get(100)", thrift, "Redis RPUSH ×100 values / LPOP 100",
            bench.measure("redis", red, "redis", "batch", batch=100))
        row("Thrift put(100) + get(100)", thrift, "Redis 100 RPUSH + 100 LPOP pipelined",
            bench.measure("redis", red, "redis", "pipe", batch=100, pipelined=True))
        beans = bench.measure("beanstalk", bean, "beanstalk", "batch", batch=100)
        row("Thrift put(100) + get(100)", thrift, "beanstalkd -F 100 put/reserve/delete pipelined", beans)
        confirmed = bench.measure("thrift", k, "thrift", "confirm", batch=100, auto_abort_ms=10_000)
        row("Thrift put + get/auto-abort + confirm (100)", confirmed,
            "beanstalkd -F 100 put/reserve/delete pipelined", beans)
        row("memcache 100 set + 100 get pipelined",
            bench.measure("memcache", k, "memcache", "batch", batch=100), "memcached, the same",
            bench.measure("memcache", mc, "memcache", "m", batch=100))


def durability(bench: Bench, work: Path) -> None:
    header("Durability: 16 clients each on its own queue, one item per put, fsync before every reply")
    with peers.kestrel(work, "always") as off, peers.kestrel(work, "always", "on") as on, \
            peers.beanstalkd(work, "always") as bean, peers.redis(work, "always") as red:
        # The two settings alternate run by run, so that both see the disk and the machine alike.
        once = replace(bench, repeat=1)
        measured: dict[str, Measured | None] = {"off": None, "on": None}
        for attempt in range(bench.repeat):
            for setting, server in (("off", off), ("on", on)):
                run = once.measure("thrift", server, "thrift", f"durable{setting}{attempt}", clients=16)
                best = measured[setting]
                if run is not None and (best is None or run.items_per_s > best.items_per_s):
                    measured[setting] = run
        beans = bench.measure("beanstalk", bean, "beanstalk", "durable", clients=16)
        redis = bench.measure("redis", red, "redis", "durable", clients=16)
        for setting in ("off", "on"):
            workload = f"Thrift put + get, `sync_journal: always`, `commit_log: {setting}`"
            row(workload, measured[setting], "beanstalkd -f0", beans)
            row(workload, measured[setting], "Redis appendfsync always", redis)


def latency(bench: Bench, work: Path) -> None:
    header("Latency: one client, one item per request")
    for sync, commit_log in (("never", "off"), ("always", "off"), ("always", "on")):
        with peers.kestrel(work, sync, commit_log) as k, peers.beanstalkd(work, sync) as bean:
            flag = "-F" if sync == "never" else "-f0"
            logged = ", `commit_log: on`" if commit_log == "on" else ""
            row(f"Thrift put + get, `sync_journal: {sync}`{logged}",
                bench.measure("thrift", k, "thrift", "latency", clients=1), f"beanstalkd {flag}",
                bench.measure("beanstalk", bean, "beanstalk", "latency", clients=1))


SECTIONS: dict[str, Section] = {"single": single, "batch": batch, "durability": durability,
                                "latency": latency}


@contextlib.contextmanager
def work_directory() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="kestrel-bench-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=1.0, help="length of each run (default 1)")
    parser.add_argument("--repeat", type=int, default=2,
                        help="runs per measurement, the fastest kept (default 2)")
    parser.add_argument("--quick", action="store_true", help="one run of 0.5 s: a smoke test of the harness")
    parser.add_argument("--only", choices=sorted(SECTIONS))
    args = parser.parse_args()
    seconds, repeat = (0.5, 1) if args.quick else (args.seconds, args.repeat)
    print(f"# server benchmarks, {time.strftime('%Y-%m-%d %H:%M %Z')}, {machine()}")
    print(f"# load: bench/loadgen.c, one process per connection; each figure the best of {repeat} "
          f"run(s) of {seconds:g} s; load average before: {load_average()}")
    with work_directory() as work:
        bench = Bench(loadgen.build(work), seconds, repeat)
        try:
            for name, section in SECTIONS.items():
                if args.only in (None, name):
                    section(bench, work)
        except peers.MissingPeer as e:
            sys.exit(str(e))
    print(f"\n# load average after: {load_average()}")


if __name__ == "__main__":
    main()
