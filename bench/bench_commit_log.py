"""What the commit log's path costs the event loop, without sockets or protocols.

Under the server's runtime (gevent, the group commit), 16 greenlets each put an item on a queue of
its own and take it back, one item at a time, as the 16 producers of `bench_servers --only
durability` do: `sync_journal: always` with `commit_log: on`, against `never` (the same changes
with no wait at all). Reported per item (a put and a get): the server process's CPU (every thread:
the fsync threads' system time is in it) and the event loop thread's alone, which is what bounds
the rate a server reaches on one core. The fsyncs are real; the queue path is a temporary
directory under --dir (the disk the server's queues would be on).

    .venv/bin/python -m bench.bench_commit_log [--items 2000] [--runs 3] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import logging
import resource
import shutil
import tempfile
import time

import gevent
import structlog

from bench.common import load_average, machine
from kestrel.storage import QueueCollection, QueueConfigs

PRODUCERS = 16
DATA = b"x" * 128


def run(directory: str, sync: str, commit_log: bool, items: int) -> tuple[float, float, float]:
    """Items per second, process CPU µs per item, event loop thread CPU µs per item."""
    path = tempfile.mkdtemp(prefix="bench-commit-log-", dir=directory)
    try:
        coll = QueueCollection(path, QueueConfigs({"sync_journal": sync}), commit_log=commit_log)
        coll.load()
        names = [f"q{n}" for n in range(PRODUCERS)]
        for name in names:  # created (a journal and its directory entry) before the clock starts
            coll.put(name, [DATA])
            coll.remove(name)

        def producer(name: str) -> None:
            for _ in range(items):
                coll.put(name, [DATA])
                coll.remove(name)

        process = resource.getrusage(resource.RUSAGE_SELF)
        loop = resource.getrusage(resource.RUSAGE_THREAD)
        started = time.perf_counter()
        gevent.joinall([gevent.spawn(producer, name) for name in names], raise_error=True)
        wall = time.perf_counter() - started
        process_after = resource.getrusage(resource.RUSAGE_SELF)
        loop_after = resource.getrusage(resource.RUSAGE_THREAD)
        coll.close()
    finally:
        shutil.rmtree(path, ignore_errors=True)
    total = PRODUCERS * items

    def cpu(before: resource.struct_rusage, after: resource.struct_rusage) -> float:
        return (after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime) / total * 1e6

    return total / wall, cpu(process, process_after), cpu(loop, loop_after)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=2000, help="items each producer puts and gets")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    print(f"# commit log path, {time.strftime('%Y-%m-%d %H:%M %Z')}, {machine()}, load {load_average()}")
    print(f"# {PRODUCERS} producers each on its own queue, put + get of 128 B, {args.items} items each\n")
    print("| setting | items/s | CPU µs/item (process) | CPU µs/item (event loop thread) |")
    print("| --- | --- | --- | --- |")
    for _ in range(args.runs):
        for sync, commit_log in (("always", True), ("never", False)):
            rate, process, loop = run(args.dir, sync, commit_log, args.items)
            setting = f"`{sync}`" + (", `commit_log: on`" if commit_log else "")
            print(f"| {setting} | {rate:,.0f} | {process:.1f} | {loop:.1f} |", flush=True)


if __name__ == "__main__":
    main()
