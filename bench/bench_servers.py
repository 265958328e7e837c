"""Side-by-side server benchmarks: this server against beanstalkd, Redis, memcached and a minimal
gevent server, in one run.

The load comes from bench/loadgen.c, built here with the machine's C compiler: CLIENTS processes, one
connection each, each on its own queue, request/response, 128-byte items; an item is one put plus
one get. Every server runs on loopback on this machine, started and stopped by this script; the
peers come from Debian (installed when run as root). Each row prints our rate, the peer's, the ratio,
the p50 / p99 latency of one round (put + get of a batch, plus the confirm or delete if any), and the
server's CPU time per item (user + system, all its threads, from /proc): what an item costs the
server whatever else the machine is doing, where items/s also depends on how much of a core it got.
Our server runs in each build named by `--builds` (bench/peers.py: `compiled`, made by `make
compiled`, and `pure`), the builds taking turns run by run; each row names the build. The peers an
aim is stated against take their turns among ours too (Redis, beanstalkd and memcached beside each
protocol, measured again for the next), so that a ratio compares runs of the same minutes.

- single: one item per request, 4 clients. Our `sync_journal: never` against beanstalkd -F and
  Redis appendfsync no (a journal write per request, no fsync); our memcache port against memcached,
  Redis and a minimal gevent server (bench/minimal_gevent_server.py: the stack's floor, no
  journal). Reliable reads against beanstalkd's reserve + delete: Thrift get with auto-abort then
  confirm, memcache `get q/open` then `get q/close`, as Kestrel's clients make them.
- batch: 100 items per round, 4 clients: one Thrift put and get against Redis's multi-value RPUSH
  and LPOP with a count, against 100 pipelined single-item Redis commands, and against 100
  pipelined beanstalkd commands (it has no batch command); memcache pipelined against memcached.
- durability: 16 clients, one item per put, an fsync before every acknowledgement: our
  `sync_journal: always`, with `commit_log` off and on (the default; run by run in turn), against
  beanstalkd -f0 and Redis appendfsync always; with each server's fsyncs per item (fsync and
  fdatasync, all its threads, counted by `perf stat` on the kernel's tracepoints).
- latency: one client, one item per request, with and without fsync (and the commit log).
- sizes: 128 B, 1 KB and 64 KB items, one per request, 4 clients: Thrift and memcache against
  Redis RPUSH/LPOP (what moving an item's bytes costs, which 128-byte items hide).

    .venv/bin/python -m bench.bench_servers [--seconds S] [--repeat N] [--quick]
                                            [--only single|batch|durability|latency|sizes]
                                            [--builds compiled pure] [--against DIR]
                                            [--client-timeout DURATION]
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import loadgen, peers
from bench.common import load_average, machine, process_cpu_seconds, syscall_counts

FSYNCS = ("fsync", "fdatasync")  # the system calls that count as a server's fsyncs


@dataclass(frozen=True)
class Measured:
    """The best run of a measurement, the server's CPU time per item during that run and, when
    counted, its fsyncs per item."""

    load: loadgen.LoadResult
    cpu_us_per_item: float
    fsyncs_per_item: float | None = None

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
    builds: tuple[str, ...] = ("compiled", "pure")
    against: Path | None = None  # another version's build, run beside ours as `before`
    settings: dict[str, str] | None = None  # our servers' other top-level settings (`--client-timeout`)

    def measure(self, protocol: str, server: peers.Running, port: str, prefix: str, fsyncs: bool = False,
                **options: Any) -> Measured | None:
        best = None
        for attempt in range(self.repeat):
            run = self._run(protocol, server, port, f"{prefix}{attempt}_", fsyncs, **options)
            if run is not None and (best is None or run.items_per_s > best.items_per_s):
                best = run
        return best

    def alternate(self, protocol: str, servers: dict[str, peers.Running], port: str, prefix: str,
                  fsyncs: bool = False, others: dict[str, tuple[str, peers.Running, str]] | None = None,
                  **options: Any) -> dict[str, Measured | None]:
        """`measure` on each server, the servers taking turns run by run, so that all of them see
        the machine alike (our builds, or our settings); `others` (label: protocol, server, port)
        take their turns too, peers spoken to in their own protocols."""
        turns = {label: (protocol, server, port) for label, server in servers.items()} | (others or {})
        best: dict[str, Measured | None] = dict.fromkeys(turns)
        for attempt in range(self.repeat):
            for n, (label, (spoken, server, at)) in enumerate(turns.items()):  # queue names by place
                run = self._run(spoken, server, at, f"{prefix}{n}x{attempt}_", fsyncs, **options)
                kept = best[label]
                if run is not None and (kept is None or run.items_per_s > kept.items_per_s):
                    best[label] = run
        return best

    def _run(self, protocol: str, server: peers.Running, port: str, prefix: str, fsyncs: bool,
             **options: Any) -> Measured | None:
        counting = syscall_counts(server.pid, FSYNCS) if fsyncs else contextlib.nullcontext({})
        with counting as counts:
            cpu_before = process_cpu_seconds(server.pid)
            try:
                result = loadgen.run(self.binary, protocol, server[port], seconds=self.seconds, prefix=prefix,
                                     **options)
            except loadgen.LoadgenError as e:
                print(f"  ! {e}", file=sys.stderr)
                return None
            finally:
                cpu = process_cpu_seconds(server.pid) - cpu_before
        items = max(result.items, 1)
        synced = counts.get("fsync", 0) + counts.get("fdatasync", 0) if "all" in counts else None
        return Measured(result, cpu * 1e6 / items, None if synced is None else synced / items)

    @contextlib.contextmanager
    def ours(self, work: Path, sync: str = "never",
             commit_log: str = "on") -> Iterator[dict[str, peers.Running]]:
        """Our server in each build (and the version `against`, as `before`), started side by side."""
        with contextlib.ExitStack() as stack:
            servers = {build: stack.enter_context(peers.kestrel(work, sync, commit_log, build=build,
                                                                settings=self.settings))
                       for build in self.builds}
            if self.against is not None:
                servers["before"] = stack.enter_context(peers.kestrel(work, sync, commit_log,
                                                                      source=self.against,
                                                                      settings=self.settings))
            yield servers


def cell(measured: Measured | None) -> str:
    if measured is None:
        return "failed | | "
    result = measured.load
    cpu = measured.cpu_us_per_item
    cpu_text = f"{cpu:,.2f}" if cpu < 10 else f"{cpu:,.1f}"  # batches cost well under a µs an item
    synced = "" if measured.fsyncs_per_item is None else f" ({measured.fsyncs_per_item:.3f} fsyncs)"
    return (f"{result.items_per_s:,.0f} | {result.p('round', 'p50'):,.0f} / "
            f"{result.p('round', 'p99'):,.0f} | {cpu_text}{synced}")


def header(title: str) -> None:
    print(f"\n### {title}\n")
    print("| workload | kestrel-py items/s | p50 / p99 µs | CPU µs/item | peer | peer items/s | p50 / p99 µs "
          "| CPU µs/item | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")


def row(workload: str, ours: Measured | None, peer: str, theirs: Measured | None) -> None:
    ratio = f"{ours.items_per_s / theirs.items_per_s:.2f}" if ours and theirs else "-"
    print(f"| {workload} | {cell(ours)} | {peer} | {cell(theirs)} | {ratio} |", flush=True)


# What a section measured, for a caller to read beside its table (bench/bench_aims.py): our
# figures under "<what> <build>", the peers' under their names.
Figures = dict[str, Measured | None]
Section = Callable[[Bench, Path], Figures]


def rows(workload: str, ours: dict[str, Measured | None], peer: str, theirs: Measured | None) -> None:
    for build, measured in ours.items():
        row(f"{workload} ({build})", measured, peer, theirs)


def named(what: str, ours: dict[str, Measured | None]) -> Figures:
    """Our figures of each build (or setting), under "<what> <build>"."""
    return {f"{what} {build}": measured for build, measured in ours.items()}


def single(bench: Bench, work: Path) -> Figures:
    header("Single items: 4 clients, 128 B, one item per request")
    with bench.ours(work) as k, peers.beanstalkd(work) as bean, peers.redis(work) as red, \
            peers.memcached(work) as mc, peers.minimal_gevent(work) as floor:
        # Each protocol's peers take their turns among ours: a shared machine's speed drifts by the
        # minute, and a ratio compares runs of the same minutes.
        beside_both = {"beanstalkd": ("beanstalk", bean, "beanstalk"), "redis": ("redis", red, "redis")}
        thrift = bench.alternate("thrift", k, "thrift", "single", others=beside_both)
        beans, redis = thrift.pop("beanstalkd"), thrift.pop("redis")
        rows("Thrift put + get", thrift, "beanstalkd -F put/reserve/delete", beans)
        rows("Thrift put + get", thrift, "Redis RPUSH/LPOP", redis)
        confirmed = bench.alternate("thrift", k, "thrift", "confirm", auto_abort_ms=10_000)
        rows("Thrift put + get/auto-abort + confirm", confirmed, "beanstalkd -F put/reserve/delete", beans)
        memcache = bench.alternate("memcache", k, "memcache", "single",
                                   others={**beside_both, "memcached": ("memcache", mc, "memcache"),
                                           "minimal gevent": ("memcache", floor, "memcache")})
        beans_m, redis_m = memcache.pop("beanstalkd"), memcache.pop("redis")
        memcached, minimal = memcache.pop("memcached"), memcache.pop("minimal gevent")
        rows("memcache set + get", memcache, "memcached set/get", memcached)
        rows("memcache set + get", memcache, "beanstalkd -F put/reserve/delete", beans_m)
        rows("memcache set + get", memcache, "Redis RPUSH/LPOP", redis_m)
        rows("memcache set + get", memcache, "a minimal gevent server (no journal)", minimal)
        opened = bench.alternate("memcache", k, "memcache", "open", open_reads=True)
        rows("memcache set + get/open + get/close", opened, "beanstalkd -F put/reserve/delete", beans_m)
    return {**named("thrift", thrift), **named("confirm", confirmed), **named("memcache", memcache),
            **named("memcache open", opened), "beanstalkd thrift": beans, "redis thrift": redis,
            "beanstalkd memcache": beans_m, "redis memcache": redis_m, "memcached": memcached,
            "minimal gevent": minimal}


def batch(bench: Bench, work: Path) -> Figures:
    header("Batches of 100: 4 clients, 128 B, one round = put 100 + get 100")
    with bench.ours(work) as k, peers.beanstalkd(work) as bean, peers.redis(work) as red, \
            peers.memcached(work) as mc:
        thrift = bench.alternate("thrift", k, "thrift", "batch", batch=100,
                                 others={"redis": ("redis", red, "redis")})  # (as in `single`)
        redis = thrift.pop("redis")
        rows("Thrift put(100) + get(100)", thrift, "Redis RPUSH ×100 values / LPOP 100", redis)
        pipelined = bench.measure("redis", red, "redis", "pipe", batch=100, pipelined=True)
        rows("Thrift put(100) + get(100)", thrift, "Redis 100 RPUSH + 100 LPOP pipelined", pipelined)
        beans = bench.measure("beanstalk", bean, "beanstalk", "batch", batch=100)
        rows("Thrift put(100) + get(100)", thrift, "beanstalkd -F 100 put/reserve/delete pipelined", beans)
        confirmed = bench.alternate("thrift", k, "thrift", "confirm", batch=100, auto_abort_ms=10_000)
        rows("Thrift put + get/auto-abort + confirm (100)", confirmed,
             "beanstalkd -F 100 put/reserve/delete pipelined", beans)
        memcache = bench.alternate("memcache", k, "memcache", "batch", batch=100,
                                   others={"memcached": ("memcache", mc, "memcache")})
        memcached = memcache.pop("memcached")
        rows("memcache 100 set + 100 get pipelined", memcache, "memcached, the same", memcached)
    return {**named("thrift", thrift), **named("confirm", confirmed), **named("memcache", memcache),
            "redis": redis, "redis pipelined": pipelined, "beanstalkd": beans, "memcached": memcached}


def durability(bench: Bench, work: Path) -> Figures:
    header("Durability: 16 clients each on its own queue, one item per put, fsync before every reply "
           "(CPU µs/item with fsyncs per item)")
    with bench.ours(work, "always", "off") as off, bench.ours(work, "always") as on, \
            peers.beanstalkd(work, "always") as bean, peers.redis(work, "always") as red:
        # Settings and builds take turns run by run, so that all of them see the disk and the machine alike.
        servers = {**{f"{build}, `commit_log: off`": server for build, server in off.items()},
                   **{f"{build}, `commit_log: on`": server for build, server in on.items()}}
        # The peers take their turns among ours: the disk is shared, and its speed drifts by the minute.
        measured = bench.alternate("thrift", servers, "thrift", "durable", fsyncs=True, clients=16,
                                   others={"beanstalkd": ("beanstalk", bean, "beanstalk"),
                                           "redis": ("redis", red, "redis")})
        beans, redis = measured.pop("beanstalkd"), measured.pop("redis")
        rows("Thrift put + get, `sync_journal: always`", measured, "beanstalkd -f0", beans)
        rows("Thrift put + get, `sync_journal: always`", measured, "Redis appendfsync always", redis)
    return {**named("always", measured), "beanstalkd": beans, "redis": redis}


def latency(bench: Bench, work: Path) -> Figures:
    header("Latency: one client, one item per request")
    figures: Figures = {}
    for sync, commit_log in (("never", "off"), ("always", "off"), ("always", "on")):
        with bench.ours(work, sync, commit_log) as k, peers.beanstalkd(work, sync) as bean:
            flag = "-F" if sync == "never" else "-f0"
            logged = ", `commit_log: on`" if commit_log == "on" else ""
            ours = bench.alternate("thrift", k, "thrift", "latency", clients=1,  # (as in `single`)
                                   others={"beanstalkd": ("beanstalk", bean, "beanstalk")})
            beans = ours.pop("beanstalkd")
            rows(f"Thrift put + get, `sync_journal: {sync}`{logged}", ours, f"beanstalkd {flag}", beans)
            figures |= {**named(f"{sync} {commit_log}", ours), f"beanstalkd {flag}": beans}
    return figures


def sizes(bench: Bench, work: Path) -> Figures:
    header("Item sizes: 4 clients, one item per request")
    figures: Figures = {}
    with bench.ours(work) as k, peers.redis(work) as red:
        for size in (128, 1024, 65536):
            label = f"{size} B" if size < 1024 else f"{size // 1024} KB"
            for protocol in ("thrift", "memcache"):  # Redis in turn with each (as in `single`)
                ours = bench.alternate(protocol, k, protocol, f"size{size}", size=size,
                                       others={"redis": ("redis", red, "redis")})
                redis = ours.pop("redis")
                rows(f"{protocol} put + get, {label}", ours, "Redis RPUSH/LPOP", redis)
                figures |= {**named(f"{protocol} {size}", ours), f"redis {protocol} {size}": redis}
    return figures


SECTIONS: dict[str, Section] = {"single": single, "batch": batch, "durability": durability,
                                "latency": latency, "sizes": sizes}


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
    parser.add_argument("--builds", nargs="+", choices=sorted(peers.BUILDS), default=["compiled", "pure"],
                        help="our server's builds, measured in turn (default: compiled pure)")
    parser.add_argument("--against", type=Path, metavar="DIR",
                        help="also run the server from DIR (another version's build/compiled, or its "
                             "src/), as `before`, in turn with ours")
    parser.add_argument("--client-timeout", metavar="DURATION",
                        help="our servers' client_timeout, such as 60s (default: none)")
    args = parser.parse_args()
    seconds, repeat = (0.5, 1) if args.quick else (args.seconds, args.repeat)
    print(f"# server benchmarks, {time.strftime('%Y-%m-%d %H:%M %Z')}, {machine()}")
    print(f"# load: bench/loadgen.c, one process per connection; each figure the best of {repeat} "
          f"run(s) of {seconds:g} s; load average before: {load_average()}")
    with work_directory() as work:
        settings = None if args.client_timeout is None else {"client_timeout": args.client_timeout}
        bench = Bench(loadgen.build(work), seconds, repeat, tuple(args.builds), args.against, settings)
        try:
            for name, section in SECTIONS.items():
                if args.only in (None, name):
                    section(bench, work)
        except peers.MissingPeer as e:
            sys.exit(str(e))
    print(f"\n# load average after: {load_average()}")


if __name__ == "__main__":
    main()
