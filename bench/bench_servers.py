"""Side-by-side server benchmarks: this server against beanstalkd, Redis and memcached, in one run.

The load comes from ../shared/bench/flood.c, a C client (one process per connection, each doing
rounds of "enqueue BATCH items of SIZE bytes, then dequeue them"), so that the client is not what is
measured. Every peer runs on this machine, on loopback, started and stopped by this script.

- thrift: our Thrift put/get against beanstalkd (binlog on) and Redis (AOF), fsync policies matched:
  our `never` ~ beanstalkd -F ~ Redis appendfsync no; our `always` ~ beanstalkd -f 0 ~ Redis
  appendfsync always (group commit shows with many producers).
- memcache: Darner's flood workload (set then get of small items through one queue per connection)
  against our memcache port and memcached (the ceiling: the same requests with no queue behind them).
- latency: p50/p99 of a single-item Thrift put from one client, one request at a time.

    .venv/bin/python -m bench.bench_servers [--quick] [--only thrift|memcache|latency]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from bench.common import free_port, machine, wait_port

ROOT = Path(__file__).resolve().parent.parent
FLOOD_SOURCE = ROOT.parent / "shared" / "bench" / "flood.c"


def ensure(command: str, package: str) -> str:
    path = shutil.which(command)
    if path is None and os.geteuid() == 0:
        subprocess.run(["apt-get", "install", "-y", "-qq", package], capture_output=True)
        path = shutil.which(command)
    if path is None:
        sys.exit(f"{command} is missing: apt-get install {package}")
    return path


@contextlib.contextmanager
def process(args: list[str], port: int) -> Iterator[None]:
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_port(port)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()


@contextlib.contextmanager
def kestrel(work: str, sync: str) -> Iterator[tuple[int, int]]:
    thrift, memcache = free_port(), free_port()
    config = Path(work) / f"kestrel-{sync}.yaml"
    queues = Path(work) / f"queues-{sync}"
    shutil.rmtree(queues, ignore_errors=True)
    config.write_text(f"queue_path: {queues}\nthrift_port: {thrift}\nmemcache_port: {memcache}\n"
                      f"text_port: 0\nadmin_port: 0\nmax_open_reads: 1000\n"
                      f"default_queue:\n  sync_journal: {sync}\n")
    command = [sys.executable, "-m", "service", "serve", "--config", str(config), "--log-level", "warning"]
    with process(command, thrift):
        wait_port(memcache)
        yield thrift, memcache


@contextlib.contextmanager
def beanstalkd(work: str, fsync: str) -> Iterator[int]:
    port = free_port()
    binlog = Path(work) / f"binlog-{port}"
    binlog.mkdir()
    flag = ["-F"] if fsync == "never" else ["-f", "0"]
    command = [ensure("beanstalkd", "beanstalkd"), "-l", "127.0.0.1", "-p", str(port),
               "-b", str(binlog), *flag]
    with process(command, port):
        yield port


@contextlib.contextmanager
def redis(work: str, fsync: str) -> Iterator[int]:
    port = free_port()
    policy = {"never": "no", "always": "always"}[fsync]
    with process([ensure("redis-server", "redis-server"), "--port", str(port), "--bind", "127.0.0.1",
                  "--appendonly", "yes", "--appendfsync", policy, "--save", "", "--dir", work,
                  "--appendfilename", f"aof-{port}.aof"], port):
        yield port


@contextlib.contextmanager
def memcached() -> Iterator[int]:
    port = free_port()
    with process([ensure("memcached", "memcached"), "-l", "127.0.0.1", "-p", str(port), "-U", "0",
                  "-c", "4096", "-u", "root"], port):
        yield port


def build_flood(work: str) -> str:
    binary = os.path.join(work, "flood")
    subprocess.run(["cc", "-O2", "-o", binary, str(FLOOD_SOURCE)], check=True)
    return binary


def flood(binary: str, proto: str, port: int, procs: int, rounds: int, batch: int, size: int) -> float:
    done = subprocess.run([binary, proto, str(port), str(procs), str(rounds), str(batch), str(size)],
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        return float("nan")
    return float(done.stdout.split()[0])


def rounds_for(procs: int, batch: int, quick: bool) -> int:
    target = 20_000 if quick else 120_000  # items per configuration
    return max(2, target // (procs * batch))


def thrift_table(work: str, binary: str, quick: bool) -> None:
    print("\n## Thrift put+get (items/s), sync never / beanstalkd -F / Redis appendfsync no")
    print(f"{'conns':>5} {'batch':>5} {'size':>5} {'kestrel':>10} {'beanstalkd':>10} {'redis':>10} "
          f"{'vs bean':>7} {'vs redis':>8}")
    shapes = [(c, b, s) for s in (64, 1024) for b in (1, 10, 100) for c in (1, 10, 100)]
    if quick:
        shapes = [(1, 1, 64), (10, 100, 64)]
    with kestrel(work, "never") as (thrift, _), beanstalkd(work, "never") as bean, \
            redis(work, "never") as red:
        for conns, batch, size in shapes:
            n = rounds_for(conns, batch, quick)
            ours = flood(binary, "thrift", thrift, conns, n, batch, size)
            b = flood(binary, "beanstalk", bean, conns, n, batch, size)
            r = flood(binary, "redis", red, conns, n, batch, size)
            print(f"{conns:>5} {batch:>5} {size:>5} {ours:>10,.0f} {b:>10,.0f} {r:>10,.0f} "
                  f"{ours / b:>7.2f} {ours / r:>8.2f}")
    print("\n## Group commit: 16 producers, batch 1, 64 B, fsync on every acknowledged write")
    with kestrel(work, "always") as (thrift, _), beanstalkd(work, "always") as bean, \
            redis(work, "always") as red:
        n = 20 if quick else 150
        ours = flood(binary, "thrift", thrift, 16, n, 1, 64)
        b = flood(binary, "beanstalk", bean, 16, n, 1, 64)
        r = flood(binary, "redis", red, 16, n, 1, 64)
        print(f"kestrel always {ours:,.0f}/s   beanstalkd -f 0 {b:,.0f}/s ({ours / b:.2f}x)   "
              f"redis appendfsync always {r:,.0f}/s ({ours / r:.2f}x)")


def memcache_table(work: str, binary: str, quick: bool) -> None:
    print("\n## Memcache flood: set then get, 1 item of 64 B per round (items/s)")
    print(f"{'conns':>5} {'kestrel':>10} {'memcached':>10} {'ratio':>6}")
    with kestrel(work, "never") as (_, memcache), memcached() as mc:
        for conns in (1, 10, 100, 1000):
            n = rounds_for(conns, 1, quick)
            ours = flood(binary, "memcache", memcache, conns, n, 1, 64)
            ceiling = flood(binary, "memcache", mc, conns, n, 1, 64)
            print(f"{conns:>5} {ours:>10,.0f} {ceiling:>10,.0f} {ours / ceiling:>6.2f}")


def latency(work: str, quick: bool) -> None:
    from thriftpy2.rpc import make_client
    from thriftpy2.transport import TFramedTransportFactory

    from contract import kestrel_thrift as idl
    print("\n## Single-item Thrift put latency, one client, sequential")
    for sync in ("never", "always"):
        with kestrel(work, sync) as (thrift, _):
            c = make_client(idl.Kestrel, "127.0.0.1", thrift, trans_factory=TFramedTransportFactory())
            samples = []
            for _ in range(300 if quick else 3000):
                t = time.perf_counter()
                c.put("latency", [b"x" * 64], 0)
                samples.append(time.perf_counter() - t)
            c.close()
            samples.sort()
            p50, p99 = samples[len(samples) // 2], samples[int(len(samples) * 0.99)]
            print(f"sync {sync:>6}: p50 {p50 * 1e6:,.0f} us   p99 {p99 * 1e6:,.0f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", choices=["thrift", "memcache", "latency"])
    args = parser.parse_args()
    print(f"# server benchmarks, {time.strftime('%Y-%m-%d')}, {machine()}; "
          f"clients: flood.c, one process per connection")
    work = tempfile.mkdtemp(prefix="kestrel-bench-")
    try:
        binary = build_flood(work)
        if args.only in (None, "thrift"):
            thrift_table(work, binary, args.quick)
        if args.only in (None, "memcache"):
            memcache_table(work, binary, args.quick)
        if args.only in (None, "latency"):
            latency(work, args.quick)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
