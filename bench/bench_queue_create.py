"""Creating a queue beside many others: the time of one creation with the queue path empty, and with
`--queues` queues already there (loaded at start-up), against creating an empty file in that
directory (the least a new queue's journal costs).

    .venv/bin/python -m bench.bench_queue_create [--queues 10000] [--format kestrel2|kestrel3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

from bench.common import machine
from kestrel.service.logs import configure_logging
from kestrel.storage import QueueCollection, QueueConfigs

CREATED = 100  # queues created and timed at each size


def _create_ms(path: str, existing: int, fmt: str) -> tuple[float, float]:
    """(ms per queue created, ms per empty file created) with `existing` queues in `path`."""
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
    coll.close()
    started = time.perf_counter()
    for n in range(CREATED):
        os.close(os.open(os.path.join(path, f"file{n}"), os.O_WRONLY | os.O_CREAT, 0o644))
    file_ms = (time.perf_counter() - started) * 1000 / CREATED
    return queue_ms, file_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--queues", type=int, default=10_000, help="queues already in the queue path")
    parser.add_argument("--format", default="kestrel2", choices=["kestrel2", "kestrel3"])
    args = parser.parse_args()
    configure_logging("warning")
    print(machine())
    print(f"creating {CREATED} {args.format} queues, ms each (best of 3)")
    print(f"{'queues already there':>22} {'queue ms':>10} {'empty file ms':>14} {'ratio':>7}")
    for existing in (0, args.queues - CREATED):
        runs = []
        for _ in range(3):
            root = tempfile.mkdtemp(prefix="bench-create-")
            try:
                runs.append(_create_ms(os.path.join(root, "queues"), existing, args.format))
            finally:
                shutil.rmtree(root)
        queue_ms = min(r[0] for r in runs)
        file_ms = min(r[1] for r in runs)
        print(f"{existing:>22,} {queue_ms:>10.3f} {file_ms:>14.3f} {queue_ms / file_ms:>7.1f}")


if __name__ == "__main__":
    main()
