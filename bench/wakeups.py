"""Where the kernel puts the clients a server wakes: our server and Redis in turn under the same 4
clients (bench/loadgen.c, one process each, put + get of 128 B; Thrift against RPUSH/LPOP).

Each reply a server sends wakes the client waiting for it. The scheduler runs the woken client on
an idle CPU when one is idle, which on a virtual machine is an inter-processor interrupt and an exit
to the host, paid inside the sender's `send`; when no CPU is idle, it may run the client on the
sender's own CPU instead, where the wake-up is cheap and the client preempts the sender. Which of
the two happens follows how busy each CPU is and how soon the reply comes, so a server that answers
more slowly, its CPU busier, wakes its clients across CPUs more often.
`perf record -e sched:sched_wakeup -e sched:sched_switch -a` over `--seconds` of each server's load
counts, per item, the wake-ups the server's threads made, the share of them sent to another CPU than
the waker's, and how often the server was switched out while still runnable (preempted); /proc
gives its CPU per item over the same window. `--split` binds every thread of the server to CPU 0
and the clients to CPU 1, so that every wake-up of either server crosses CPUs: the two then pay
alike for it. Needs `perf`.

    .venv/bin/python -m bench.wakeups [--runs 2] [--seconds 3] [--split]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path

from bench import loadgen, peers
from bench.common import bind_threads, load_average, machine, process_cpu_seconds

CLIENTS = 4
# One event of `perf script -F pid,cpu,event,trace`: the current task's process, its CPU, the event.
EVENT = re.compile(r"\s*(\d+)\s+\[(\d+)\]\s+([\w:]+):\s+(.*)")


def servers(work: Path) -> Iterator[tuple[str, str, AbstractContextManager[peers.Running]]]:
    """(name, loadgen protocol, the server to start) of each server measured."""
    yield "ours (compiled)", "thrift", peers.kestrel(work, sync="never", commit_log="off", build="compiled")
    yield "Redis", "redis", peers.redis(work)


def counted(trace: str, pid: int) -> tuple[int, int, int]:
    """(wake-ups made by process `pid`, of them to another CPU, its switches out while runnable)."""
    wakeups = elsewhere = preempted = 0
    for line in trace.splitlines():
        match = EVENT.match(line)
        if match is None or int(match[1]) != pid:
            continue
        cpu, event, fields = int(match[2]), match[3], match[4]
        if event.endswith("sched_wakeup"):
            target = re.search(r"target_cpu=(\d+)", fields)
            wakeups += 1
            elsewhere += target is not None and int(target[1]) != cpu
        elif event.endswith("sched_switch") and re.search(r"prev_state=R\b", fields):
            preempted += 1
    return wakeups, elsewhere, preempted


def measure(binary: Path, work: Path, protocol: str, server: peers.Running, seconds: float) -> str:
    """One table row's cells for `server` under the clients' load."""
    port = server.ports.get(protocol, next(iter(server.ports.values())))
    results: list[loadgen.LoadResult] = []
    load = threading.Thread(target=lambda: results.append(
        loadgen.run(binary, protocol, port, clients=CLIENTS, seconds=seconds + 3)))
    load.start()
    time.sleep(1.5)  # past the warm-up
    data = work / f"wakeups-{server.pid}.data"
    before = process_cpu_seconds(server.pid)
    started = time.monotonic()
    subprocess.run(["perf", "record", "-q", "-a", "-e", "sched:sched_wakeup", "-e", "sched:sched_switch",
                    "-o", str(data), "--", "sleep", str(seconds)], check=True, capture_output=True)
    elapsed = time.monotonic() - started
    cpu = process_cpu_seconds(server.pid) - before
    load.join()
    if not results:
        raise loadgen.LoadgenError(f"the load on {protocol} failed: see above")
    items = results[0].items_per_s * elapsed
    trace = subprocess.run(["perf", "script", "-i", str(data), "-F", "pid,cpu,event,trace"],
                           capture_output=True, text=True, check=True).stdout
    wakeups, elsewhere, preempted = counted(trace, server.pid)
    return (f"{results[0].items_per_s:,.0f} | {cpu / items * 1e6:.1f} | {wakeups / items:.2f} | "
            f"{elsewhere / max(wakeups, 1):.0%} | {preempted / items:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2, help="each server this many times, in turn")
    parser.add_argument("--seconds", type=float, default=3.0, help="of load traced a run")
    parser.add_argument("--split", action="store_true",
                        help="the server bound to CPU 0, the clients (started from here) to CPU 1")
    args = parser.parse_args()
    if shutil.which("perf") is None:
        sys.exit("perf is not installed (Debian: apt-get install linux-perf)")
    if args.split:
        os.sched_setaffinity(0, {1})  # the load generator's processes inherit it
    print(f"# wake-ups a server's replies make, {CLIENTS} clients, 128 B"
          f"{', the server on CPU 0 and they on CPU 1' if args.split else ''}, "
          f"{time.strftime('%Y-%m-%d %H:%M %Z')}, {machine()}, load average {load_average()}\n")
    print("| run | server | items/s | server CPU µs an item | wake-ups an item | to another CPU "
          "| preempted an item |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory(prefix="wakeups-") as scratch:
        work = Path(scratch)
        binary = loadgen.build(work)
        for run in range(1, args.runs + 1):
            for name, protocol, started in servers(work):
                with started as server:
                    if args.split:
                        bind_threads(server.pid, {0})
                    print(f"| {run} | {name} | {measure(binary, work, protocol, server, args.seconds)} |",
                          flush=True)


if __name__ == "__main__":
    main()
