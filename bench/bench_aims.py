"""Every speed and scale aim of the server in one command, each beside its peers measured in the same run.

The measurements are those of the scripts that own them, called here: bench/bench_servers.py's
single items, batches, durability and item sizes; bench/bench_scale.py's 10,000 filled queues
against 4, the idle server holding them, 1,000 connections against 4, and a connection's accept and
close; the copies of an item's bytes counted by bench/item_copies.py in a process on our server's
build. Each prints its own tables as it goes; then one table gives each aim's row: our items/s and
server CPU µs per item, each peer's from the same run, the ratio the aim is stated in, the aim, and
whether it is met.

- single items: Thrift and memcache, 4 clients, beside beanstalkd -F and Redis (appendfsync no);
- Thrift batches of 100 beside Redis's multi-value RPUSH and LPOP with a count;
- `always`, 16 producers, the commit log on (the default) and off, beside Redis appendfsync
  always and beanstalkd -f0 (the aim is the default's);
- 10,000 filled queues against 4 (memcache and Thrift), beside Redis's ratio;
- an idle server holding 10,000 queues, % of a core, beside Redis;
- memcache single items beside a minimal gevent server (bench/minimal_gevent_server.py): the
  floor of Python and gevent, no journal; no aim of its own;
- 1,000 connections against 4, beside memcached's, Redis's and the minimal gevent server's ratios;
- accepting and closing a connection, CPU µs, beside Redis and the minimal gevent server; no aim
  of its own (the aim is that it be cheap);
- 1 KB and 64 KB items over Thrift and memcache: the copies of an item's bytes between the socket
  and the journal, beside Redis at that size.

`--quick` is a smoke run of the harness (seconds of load, 200 queues, 20 connections): its ratios
mean nothing. The default suits a quiet machine and takes about 6 minutes a build. On two shared
cores one run's ratios move by more than the servers differ: `--runs N` measures everything N times,
a table each, then one more with each aim's row over the N runs (in how many it was met, each run's
ratios), where a verdict is read.

    .venv/bin/python -m bench.bench_aims [--quick] [--seconds 3] [--repeat 2] [--builds compiled pure]
                                         [--queues 10000] [--connections 1000] [--idle 10]
                                         [--cycles 2000] [--runs 1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

from bench import bench_scale, bench_servers, loadgen, peers
from bench.bench_scale import Cost
from bench.bench_servers import Figures, Measured
from bench.common import load_average, machine

COLUMNS = ("aim's row", "ours: items/s (CPU µs/item)", "peers in the same run", "ratio", "aim", "met")


@dataclass(frozen=True)
class Row:
    """One line of the aims table; `peers` is never empty: every row has its peer beside it."""

    workload: str
    ours: str
    peers: tuple[str, ...]
    ratio: str
    aim: str
    met: bool | None  # None: the row states no aim of its own, or a run failed

    def line(self) -> str:
        met = {True: "met", False: "not met", None: "-"}[self.met]
        cells = (self.workload, self.ours, "; ".join(self.peers), self.ratio, self.aim, met)
        return f"| {' | '.join(cells)} |"


def figure(measured: Measured | Cost | None) -> str:
    """items/s (server CPU µs per item)."""
    if measured is None:
        return "failed"
    cpu = measured.cpu_us_per_item
    cpu_text = f"{cpu:.2f}" if cpu < 10 else f"{cpu:.1f}"  # batches cost well under a µs an item
    return f"{measured.items_per_s:,.0f} ({cpu_text})"


def divided(ours: float, theirs: float) -> float | None:
    """None where the peer's figure is nought: a run too short for /proc's clock ticks (10 ms)."""
    return ours / theirs if theirs else None


def ratio(ours: Measured | None, theirs: Measured | None) -> float | None:
    """Our items/s over the peer's."""
    return divided(ours.items_per_s, theirs.items_per_s) if ours and theirs else None


def cpu_ratio(ours: Measured | Cost | None, theirs: Measured | Cost | None) -> float | None:
    """Our server CPU per item over the peer's (or over our own on the lighter load)."""
    return divided(ours.cpu_us_per_item, theirs.cpu_us_per_item) if ours and theirs else None


def times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}×"


def at_least(value: float | None, aim: float) -> bool | None:
    return None if value is None else value >= aim


def at_most(value: float | None, aim: float) -> bool | None:
    return None if value is None else value <= aim


def all_met(*checks: bool | None) -> bool | None:
    return None if None in checks else all(checks)


def single_rows(figures: Figures, build: str) -> Iterator[Row]:
    for protocol, label in (("thrift", "Thrift"), ("memcache", "memcache")):
        ours = figures[f"{protocol} {build}"]
        bean, redis = figures[f"beanstalkd {protocol}"], figures[f"redis {protocol}"]  # in turn with ours
        by_bean, by_redis, cpu = ratio(ours, bean), ratio(ours, redis), cpu_ratio(ours, redis)
        yield Row(f"{label} single items, 4 clients ({build})", figure(ours),
                  (f"beanstalkd -F {figure(bean)}", f"Redis {figure(redis)}"),
                  f"{times(by_bean)} beanstalkd, {times(by_redis)} Redis; CPU {times(cpu)} Redis's",
                  "≥1.5× beanstalkd, ≥0.8× Redis; CPU ≤1.3× Redis's",
                  all_met(at_least(by_bean, 1.5), at_least(by_redis, 0.8), at_most(cpu, 1.3)))
    ours, floor = figures[f"memcache {build}"], figures["minimal gevent"]
    yield Row(f"memcache single items beside the stack's floor ({build})", figure(ours),
              (f"a minimal gevent server, no journal {figure(floor)}",),
              f"{times(ratio(ours, floor))} its items/s; CPU {times(cpu_ratio(ours, floor))} its",
              "(none: what Python and gevent cost alone)", None)


def batch_rows(figures: Figures, build: str) -> Iterator[Row]:
    ours, redis = figures[f"thrift {build}"], figures["redis"]
    yield Row(f"Thrift batches of 100 ({build})", figure(ours),
              (f"Redis RPUSH of 100 values / LPOP 100 {figure(redis)}",),
              f"{times(ratio(ours, redis))} Redis; CPU {times(cpu_ratio(ours, redis))} Redis's",
              "≥1.0× Redis", at_least(ratio(ours, redis), 1.0))


def always_rows(figures: Figures, build: str) -> Iterator[Row]:
    bean, redis = figures["beanstalkd"], figures["redis"]
    for log, aim in (("on", True), ("off", False)):
        ours = figures[f"always {build}, `commit_log: {log}`"]
        by_redis = ratio(ours, redis)
        default = " (the default)" if aim else ""
        yield Row(f"`always`, 16 producers, `commit_log: {log}`{default} ({build})", figure(ours),
                  (f"Redis appendfsync always {figure(redis)}", f"beanstalkd -f0 {figure(bean)}"),
                  f"{times(by_redis)} Redis, {times(ratio(ours, bean))} beanstalkd; "
                  f"CPU {times(cpu_ratio(ours, redis))} Redis's",
                  "≥1.0× Redis" if aim else "(the aim is the default's)",
                  at_least(by_redis, 1.0) if aim else None)


def few_and_many(few: Cost, many: Cost) -> str:
    return f"{figure(few)} → {figure(many)}: {times(cpu_ratio(many, few))}"


def queue_rows(figures: bench_scale.QueueFigures, build: str, queues: int) -> Iterator[Row]:
    redis_few, redis_many, redis_idle = figures["Redis"]
    for protocol in ("memcache", "Thrift"):
        few, many, _ = figures[f"kestrel-py {build} {protocol}"]
        growth = cpu_ratio(many, few)
        yield Row(f"{queues:,} filled queues against 4, {protocol} ({build})", few_and_many(few, many),
                  (f"Redis {few_and_many(redis_few, redis_many)}",), f"CPU {times(growth)} of 4 queues'",
                  "CPU ≤1.3× of 4 queues'", at_most(growth, 1.3))
    idle = max(figures[f"kestrel-py {build} {protocol}"][2] for protocol in ("memcache", "Thrift"))
    yield Row(f"an idle server holding {queues:,} queues ({build})", f"{idle:.2f}% of a core",
              (f"Redis {redis_idle:.2f}%",), f"{idle:.2f}% of a core (the more of the two rows above)",
              "<2% of a core", idle < 2)


def connection_rows(figures: dict[str, tuple[Cost, Cost]], build: str,
                    connections: int) -> Iterator[Row]:
    few, many = figures[f"kestrel-py {build}"]
    growth = cpu_ratio(many, few)
    yield Row(f"{connections:,} connections against 4, memcache ({build})", few_and_many(few, many),
              tuple(f"{peer} {few_and_many(*figures[peer])}"
                    for peer in ("memcached", "Redis", "a minimal gevent server")),
              f"CPU {times(growth)} of 4 connections'", "CPU ≤1.3× of 4 connections'", at_most(growth, 1.3))


def connect_rows(costs: dict[str, float], build: str) -> Iterator[Row]:
    ours = max(costs[f"kestrel-py {build} ({port} port)"] for port in ("memcache", "Thrift"))
    yield Row(f"accepting and closing a connection ({build})", f"{ours:.0f} µs of CPU",
              tuple(f"{peer} {costs[peer]:.0f} µs" for peer in ("Redis", "a minimal gevent server")),
              f"{times(divided(ours, costs['Redis']))} Redis's (the more of our two ports)",
              "(none: cheap; 210 µs when the aims were set)", None)


def copy_rows(figures: Figures, copies: dict[tuple[str, int], tuple[int, int]] | str,
              build: str) -> Iterator[Row]:
    for size in (1024, 65536):
        for protocol, label in (("thrift", "Thrift"), ("memcache", "memcache")):
            ours, redis = figures[f"{protocol} {size} {build}"], figures[f"redis {protocol} {size}"]
            if isinstance(copies, str):
                counted, met = f"not counted: {copies}", None
            else:
                into, out = copies[(protocol, size)]
                counted, met = f"copies: {into} socket → journal, {out} queue → socket", into <= 1
                if protocol == "thrift":  # the items/s are framed binary's; the copies of both protocols
                    c_into, c_out = copies[("thrift compact", size)]
                    counted += f" (framed compact: {c_into}, {c_out})"
                    met = met and c_into <= 1
            yield Row(f"{size // 1024} KB items, {label} ({build})", figure(ours),
                      (f"Redis {figure(redis)}",), f"{counted}; {times(ratio(ours, redis))} Redis",
                      "≤1 copy socket → journal", met)


def count_copies(build: str) -> dict[tuple[str, int], tuple[int, int]] | str:
    """The copies of bench/item_copies.py, counted in a process on our server's `build`: (protocol,
    size) → copies from the socket to the journal and from the queue to the socket; or why not."""
    env = dict(os.environ, PYTHONPATH=f"{peers.build_path(build)}{os.pathsep}{peers.ROOT}")
    done = subprocess.run([sys.executable, "-m", "bench.item_copies"], env=env, cwd=peers.ROOT,
                          capture_output=True, text=True)
    if done.returncode != 0:
        return f"bench.item_copies failed: {done.stderr.strip().splitlines()[-1:]}"
    found = json.loads(done.stdout.strip().splitlines()[-1])
    if isinstance(found, dict):
        return str(found["error"])
    return {(entry["protocol"], entry["size"]): (entry["socket_to_journal"], entry["queue_to_socket"])
            for entry in found}


def aims(args: argparse.Namespace) -> list[Row]:
    """Every measurement, its tables printed as it goes; the aims' rows."""
    scale = argparse.Namespace(queues=args.queues, fill=2, seconds=args.seconds, repeat=args.repeat,
                               idle=args.idle, settle=args.settle, connections=args.connections,
                               cycles=args.cycles, builds=args.builds)
    with bench_servers.work_directory() as work:
        bench = bench_servers.Bench(loadgen.build(work), args.seconds, args.repeat, tuple(args.builds))
        single = bench_servers.single(bench, work)
        batch = bench_servers.batch(bench, work)
        always = bench_servers.durability(bench, work)
        sizes = bench_servers.sizes(bench, work)
        queues = bench_scale.queues_and_idle(bench.binary, work, scale)
        connections = bench_scale.connections(bench.binary, work, scale)
        connects = bench_scale.connect_and_close(work, scale)
    rows: list[Row] = []
    for build in args.builds:
        copies = count_copies(build)
        rows += [*single_rows(single, build), *batch_rows(batch, build), *always_rows(always, build),
                 *queue_rows(queues, build, args.queues),
                 *connection_rows(connections, build, args.connections), *connect_rows(connects, build),
                 *copy_rows(sizes, copies, build)]
    return rows


def print_table(rows: list[Row]) -> None:
    print("\n### The aims\n")
    print(f"| {' | '.join(COLUMNS)} |")
    print(f"|{' --- |' * len(COLUMNS)}")
    for row in rows:
        print(row.line(), flush=True)


def print_over_runs(runs: list[list[Row]]) -> None:
    """Each aim's row over the runs (each run gives the same rows in the same order): in how many of
    the runs that judged it it was met, and each run's ratios."""
    print(f"\n### The aims over {len(runs)} runs\n")
    print("| aim's row | aim | met in | each run's ratios |")
    print("| --- | --- | --- | --- |")
    for index, first in enumerate(runs[0]):
        rows = [run[index] for run in runs]
        judged = [row.met for row in rows if row.met is not None]
        met = f"{sum(judged)} of {len(judged)}" if judged else "-"
        ratios = " / ".join(row.ratio for row in rows)
        print(f"| {first.workload} | {first.aim} | {met} | {ratios} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3.0, help="length of each load run (default 3)")
    parser.add_argument("--repeat", type=int, default=2,
                        help="runs per figure, the fastest (or least CPU) kept (default 2)")
    parser.add_argument("--queues", type=int, default=10_000, help="the many queues (default 10000)")
    parser.add_argument("--connections", type=int, default=1_000,
                        help="the many connections (default 1000)")
    parser.add_argument("--idle", type=float, default=10.0,
                        help="seconds the idle server is watched (default 10)")
    parser.add_argument("--cycles", type=int, default=2_000,
                        help="connections opened and closed, each server (default 2000)")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run of the harness: seconds, not figures")
    parser.add_argument("--builds", nargs="+", choices=sorted(peers.BUILDS), default=["compiled"],
                        help="our server's builds, measured in turn (default: compiled)")
    parser.add_argument("--runs", type=int, default=1,
                        help="times everything is measured, then each aim over the runs (default 1)")
    args = parser.parse_args()
    args.settle = 1.0
    if args.quick:
        args.seconds, args.repeat, args.idle, args.settle = 0.5, 1, 0.5, 0.1
        args.queues, args.connections, args.cycles = 200, 20, 100
    print(f"# every aim beside its peers, {time.strftime('%Y-%m-%d %H:%M %Z')}, {machine()}")
    print(f"# load: bench/loadgen.c, one process per connection; each figure the best of {args.repeat} "
          f"run(s) of {args.seconds:g} s; load average before: {load_average()}")
    runs: list[list[Row]] = []
    for run in range(args.runs):
        if args.runs > 1:
            print(f"\n## Run {run + 1} of {args.runs}, load average before: {load_average()}")
        try:
            runs.append(aims(args))
        except peers.MissingPeer as e:
            sys.exit(str(e))
        print_table(runs[-1])
    if args.runs > 1:
        print_over_runs(runs)
    print(f"\n# load average after: {load_average()}")


if __name__ == "__main__":
    main()
