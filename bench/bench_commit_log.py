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
        gevent.joinall([gevent.spawn(producer, name) for name in names], raise_error=True)
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
    print("| setting | items/s | CPU µs/item (process) | CPU µs/item (event loop thread) "
          "| rounds of the log per item |")
    print("| --- | --- | --- | --- | --- |")
    for _ in range(args.runs):
        for label, sync, logged, hold in SETTINGS:
            rate, process, loop, rounds = run(args.dir, sync, logged, hold, args.items)
            print(f"| {label} | {rate:,.0f} | {process:.1f} | {loop:.1f} | {rounds:.2f} |", flush=True)


if __name__ == "__main__":
    main()
