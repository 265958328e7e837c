"""Our server with every thread bound to one CPU, against the same server free to run anywhere, with
Redis free beside: items/s and server CPU µs an item under `sync_journal: always` (16 producers,
Thrift put + get, the commit log on) and under `never` (4 clients).

Under `always` a round hands its fdatasync to a C thread, and the thread wakes the event loop when
it is done (src/kestrel/storage/fsync/group_commit.py): where the two run on different CPUs, each
hand-over is a wake-up across CPUs. Bound to one CPU (as `taskset -c N` or systemd's `CPUAffinity=`
bind a whole process), both wake-ups stay on that CPU. Each run binds the running server's threads
(`sched_setaffinity` on each of `/proc/<pid>/task`) after a warm-up round that starts them, then
frees them again; the binding takes turns with the free server and with Redis, run by run, the CPU
bound to moving from one run to the next.

    .venv/bin/python -m bench.bench_cpu_binding [--runs 2] [--seconds 3]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from bench import loadgen, peers
from bench.common import bind_threads, load_average, machine, process_cpu_seconds

WORKLOADS = {"always": 16, "never": 4}  # `sync_journal` and its clients


def measure(binary: Path, server: peers.Running, protocol: str, clients: int, seconds: float,
            cpus: set[int]) -> tuple[float, float]:
    """Items/s and server CPU µs an item of one run, the server's threads bound to `cpus`."""
    loadgen.run(binary, protocol, server[protocol], clients=clients, seconds=0.5)  # the threads start
    bind_threads(server.pid, cpus)
    before = process_cpu_seconds(server.pid)
    done = loadgen.run(binary, protocol, server[protocol], clients=clients, seconds=seconds)
    used = process_cpu_seconds(server.pid) - before
    return done.items_per_s, used / (done.items_per_s * seconds) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    everywhere = os.sched_getaffinity(0)
    print(f"# our server bound to one CPU and free, {machine()}; load average before: {load_average()}")
    with tempfile.TemporaryDirectory(prefix="kestrel-bench-") as home:
        work = Path(home)
        binary = loadgen.build(work)
        for sync, clients in WORKLOADS.items():
            print(f"\n`sync_journal: {sync}`, {clients} clients: items/s (server CPU µs an item)\n")
            print("| run | ours, free | ours, one CPU | one CPU ÷ free | Redis, free | one CPU ÷ Redis |")
            print("| --- | --- | --- | --- | --- | --- |")
            with peers.kestrel(work, sync, build="compiled") as ours, peers.redis(work, sync) as redis:
                for run in range(args.runs):
                    one = {sorted(everywhere)[run % len(everywhere)]}
                    free = measure(binary, ours, "thrift", clients, args.seconds, everywhere)
                    bound = measure(binary, ours, "thrift", clients, args.seconds, one)
                    peer = measure(binary, redis, "redis", clients, args.seconds, everywhere)
                    print(f"| {run + 1} (CPU {min(one)}) | {free[0]:,.0f} ({free[1]:.1f}) | "
                          f"{bound[0]:,.0f} ({bound[1]:.1f}) | {bound[0] / free[0]:.2f} | "
                          f"{peer[0]:,.0f} ({peer[1]:.1f}) | {bound[0] / peer[0]:.2f} |", flush=True)
    print(f"\n# load average after: {load_average()}")


if __name__ == "__main__":
    main()
