"""Creating a queue beside many others: the time of one creation with the queue path empty, and with
`--queues` queues already there (loaded at start-up), against creating an empty file in that
directory (the least a new queue's journal costs). Then re-creating a queue just deleted (each of
the queues created is deleted, then named again, each re-creation timed alone): it should cost what
a new name costs.

    .venv/bin/python -m bench.bench_queue_create [--queues 10000] [--format kestrel2|kestrel3]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from bench.common import machine
from kestrel.service.logs import configure_logging
from kestrel.storage import QueueCollection, QueueConfigs

CREATED = 100  # queues created and timed at each size


DIRECTORY_READS = [0]  # directory listings made by the re-creations of the last run


@contextlib.contextmanager
def _counting_directory_reads() -> Iterator[None]:
    real = os.scandir

    def counted(path: Any = ".") -> Any:
        DIRECTORY_READS[0] += 1
        return real(path)

    os.scandir = counted
    try:
        yield
    finally:
        os.scandir = real


def _create_ms(path: str, existing: int, fmt: str) -> tuple[float, float, float]:
    """(ms per queue created, ms per empty file created, ms per deleted queue created again) with
    `existing` queues in `path`."""
    os.makedirs(path)
    for n in range(existing):
        with open(os.path.join(path, f"old{n}"), "wb"):
            pass  # an empty Kestrel 2 journal: a queue on disk
    configs = QueueConfigs({}, {f"new{n}": {"journal_format": fmt} for n in range(CREATED)})
    coll = QueueCollection(path, configs)
    coll.load()
    started = time.perf_counter()
    for n in range(CREATED):
        coll.queue(f"new{n}")
    queue_ms = (time.perf_counter() - started) * 1000 / CREATED
    again = 0.0
    for n in range(CREATED):
        coll.delete(f"new{n}")
        started = time.perf_counter()
        with _counting_directory_reads():
            coll.queue(f"new{n}")
        again += time.perf_counter() - started
    again_ms = again * 1000 / CREATED
    coll.close()
    started = time.perf_counter()
    for n in range(CREATED):
        os.close(os.open(os.path.join(path, f"file{n}"), os.O_WRONLY | os.O_CREAT, 0o644))
    file_ms = (time.perf_counter() - started) * 1000 / CREATED
    return queue_ms, file_ms, again_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--queues", type=int, default=10_000, help="queues already in the queue path")
    parser.add_argument("--format", default="kestrel2", choices=["kestrel2", "kestrel3"])
    args = parser.parse_args()
    configure_logging("warning")
    print(machine())
    print(f"creating {CREATED} {args.format} queues, ms each (best of 3)")
    print(f"{'queues already there':>22} {'queue ms':>10} {'empty file ms':>14} {'ratio':>7} "
          f"{'re-created ms':>14} {'vs new':>7} {'listings each':>14}")
    for existing in (0, args.queues - CREATED):
        runs = []
        DIRECTORY_READS[0] = 0
        for _ in range(3):
            root = tempfile.mkdtemp(prefix="bench-create-")
            try:
                runs.append(_create_ms(os.path.join(root, "queues"), existing, args.format))
            finally:
                shutil.rmtree(root)
        queue_ms = min(r[0] for r in runs)
        file_ms = min(r[1] for r in runs)
        again_ms = min(r[2] for r in runs)
        print(f"{existing:>22,} {queue_ms:>10.3f} {file_ms:>14.3f} {queue_ms / file_ms:>7.1f} "
              f"{again_ms:>14.3f} {again_ms / queue_ms:>7.1f} {DIRECTORY_READS[0] / (3 * CREATED):>14.1f}")


if __name__ == "__main__":
    main()
