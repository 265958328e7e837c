"""What the commit log's path costs the event loop, without sockets or protocols.

Under the server's runtime (gevent, the group commit), 16 greenlets each put an item on a queue of
its own and take it back, one item at a time, as the 16 producers of `bench_servers --only
durability` do, under `sync_journal: always`: with `commit_log: on`, each greenlet holding its
acknowledgements as the server's connections do (a change does not wait; the greenlet waits for
its turn to be settled before its next change, as a client waits for its reply), and waiting in
each change as a library caller does; with `commit_log: off`; and `never` (the same changes with
no wait at all). Reported per item (a put and a get): the server process's CPU (every thread: the
fsync threads' system time is in it) and the event loop thread's alone, which is what bounds the
rate a server reaches on one core, and the fsync rounds of the log per item. The fsyncs are real;
the queue path is a temporary directory under --dir (the disk the server's queues would be on).

First, what a round's fdatasync of a segment costs on that disk, each way a segment can be written:
appended (a segment of format version 1), and over zeros laid down and synced ahead (version 2,
what the log does): a turn's write of 16 records (3,200 B) then an fdatasync, `--fsyncs` times;
the median and 90th percentile of the fdatasync's wall time, and the CPU of the write and the
fdatasync together (the thread's, which is the fsync thread's share in the server).

    .venv/bin/python -m bench.bench_commit_log [--items 2000] [--runs 3] [--fsyncs 1500] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import shutil
import tempfile
import time
from functools import partial

import gevent
import gevent.event
import structlog

from bench.common import load_average, machine
from kestrel.storage import QueueCollection, QueueConfigs, acknowledgements

PRODUCERS = 16
DATA = b"x" * 128


SETTINGS = (  # (label, sync_journal, commit_log, the producers hold their acknowledgements)
    ("`always`, `commit_log: on`, replies held (the server's connections)", "always", True, True),
    ("`always`, `commit_log: on`, waiting in the change (a library caller)", "always", True, False),
    ("`always`, `commit_log: off`", "always", False, False),
    ("`never`", "never", False, False),
)


def run(directory: str, sync: str, logged: bool, hold: bool, items: int) -> tuple[float, float, float, float]:
    """Items per second, process CPU µs per item, event loop thread CPU µs per item, and rounds of
    the log per item (0 without it)."""
    path = tempfile.mkdtemp(prefix="bench-commit-log-", dir=directory)
    rounds = 0
    try:
        coll = QueueCollection(path, QueueConfigs({"sync_journal": sync}), commit_log=logged)
        coll.load()
        names = [f"q{n}" for n in range(PRODUCERS)]
        for name in names:  # created (a journal and its directory entry) before the clock starts
            coll.put(name, [DATA])
            coll.remove(name)

        def producer(name: str) -> None:
            told = gevent.event.Event()
            held = acknowledgements.Acknowledgements(told.set)
            if hold:
                acknowledgements.hold(held)
            for _ in range(items):
                for change in (lambda: coll.put(name, [DATA]), lambda: coll.remove(name)):
                    told.clear()
                    change()
                    if held.pending:  # a client waits for its reply
                        told.wait()

        before = coll.commit_log.rounds if coll.commit_log is not None else 0
        process = resource.getrusage(resource.RUSAGE_SELF)
        loop = resource.getrusage(resource.RUSAGE_THREAD)
        started = time.perf_counter()
        gevent.joinall([gevent.spawn(partial(producer, name)) for name in names], raise_error=True)
        wall = time.perf_counter() - started
        rounds = coll.commit_log.rounds - before if coll.commit_log is not None else 0
        process_after = resource.getrusage(resource.RUSAGE_SELF)
        loop_after = resource.getrusage(resource.RUSAGE_THREAD)
        coll.close()
    finally:
        shutil.rmtree(path, ignore_errors=True)
    total = PRODUCERS * items

    def cpu(before: resource.struct_rusage, after: resource.struct_rusage) -> float:
        return (after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime) / total * 1e6

    return total / wall, cpu(process, process_after), cpu(loop, loop_after), rounds / total


TURN = b"r" * 3200  # a turn's write of the log under 16 producers


def segment_fsyncs(directory: str, laid_down: bool, writes: int) -> tuple[float, float, float]:
    """The fdatasync after each turn's write of a segment: median and 90th percentile wall µs, and
    CPU µs of the write and the fdatasync together."""
    path = os.path.join(tempfile.mkdtemp(prefix="bench-segment-", dir=directory), "segment")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | (0 if laid_down else os.O_APPEND), 0o644)
    try:
        if laid_down:
            os.write(fd, bytes(len(TURN) * writes))
            os.fsync(fd)
        waits: list[float] = []
        cpu = time.thread_time()
        for n in range(writes):
            if laid_down:
                os.pwrite(fd, TURN, n * len(TURN))
            else:
                os.write(fd, TURN)
            started = time.perf_counter()
            os.fdatasync(fd)
            waits.append(time.perf_counter() - started)
        cpu = time.thread_time() - cpu
    finally:
        os.close(fd)
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    waits.sort()
    return waits[len(waits) // 2] * 1e6, waits[len(waits) * 9 // 10] * 1e6, cpu / writes * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=2000, help="items each producer puts and gets")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--fsyncs", type=int, default=1500, help="writes and fdatasyncs of each kind")
    parser.add_argument("--dir", default=tempfile.gettempdir())
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    print(f"# commit log path, {time.strftime('%Y-%m-%d %H:%M %Z')}, {machine()}, load {load_average()}")
    print("| a segment's fdatasync after a write of 3,200 B | median µs | p90 µs "
          "| CPU µs (write + fdatasync) |")
    print("| --- | --- | --- | --- |")
    for _ in range(args.runs):
        for label, laid_down in (("appended (version 1)", False), ("over zeros laid down (version 2)", True)):
            median, p90, cpu = segment_fsyncs(args.dir, laid_down, args.fsyncs)
            print(f"| {label} | {median:.0f} | {p90:.0f} | {cpu:.0f} |", flush=True)
    print()
    print(f"# {PRODUCERS} producers each on its own queue, put + get of 128 B, {args.items} items each\n")
    print("| setting | items/s | CPU µs/item (process) | CPU µs/item (event loop thread) "
          "| rounds of the log per item |")
    print("| --- | --- | --- | --- | --- |")
    for _ in range(args.runs):
        for label, sync, logged, hold in SETTINGS:
            rate, process, loop, rounds = run(args.dir, sync, logged, hold, args.items)
            print(f"| {label} | {rate:,.0f} | {process:.1f} | {loop:.1f} | {rounds:.2f} |", flush=True)


if __name__ == "__main__":
    main()
