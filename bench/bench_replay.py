"""Start-up replay speed: a queue's journal of add+remove records replayed by a fresh collection.

For 64-byte and 1 KB items: records/s and MB/s from opening the collection to the queue serving,
and from starting a Python process (imports included) to the same point.
`--profile` prints where the time goes (cProfile, the 64-byte journal). `--kestrel3 N` loads a
Kestrel 3 queue of N items of 16 B put in batches of 1,000 instead, and prints the CPU seconds of
each load (the build is the one on PYTHONPATH: run it with another build's for a before).

    .venv/bin/python -m bench.bench_replay [--quick] [--profile SIZE] [--kestrel3 N [--repeat R]]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import time

from bench.common import machine
from kestrel.storage import QueueCollection, QueueConfigs
from kestrel.storage.kestrel2.codec import REMOVE_BYTES, encode_addx


def write_journal(directory: str, size: int, megabytes: int) -> tuple[int, int]:
    """A journal of ADDX+REMOVE pairs (the queue ends empty); returns (records, bytes)."""
    path = os.path.join(directory, "replay")
    pair = encode_addx(1, 0, b"r" * size) + REMOVE_BYTES
    pairs = megabytes * 1_000_000 // len(pair)
    with open(path, "wb") as f:
        for _ in range(pairs // 1000):
            f.write(pair * 1000)
    return pairs // 1000 * 2000, os.path.getsize(path)


def replay_seconds(directory: str) -> float:
    started = time.perf_counter()
    coll = QueueCollection(directory, QueueConfigs({"max_memory_size": "64MB"}))
    coll.load()
    coll.queue("replay")
    elapsed = time.perf_counter() - started
    coll.close()
    return elapsed


KESTREL3 = QueueConfigs({"journal_format": "kestrel3", "max_memory_size": "1GB", "sync_journal": "never"})


def write_kestrel3_queue(directory: str, items: int, readers: int = 1) -> None:
    """A Kestrel 3 queue of `items` items, and `readers` - 1 fanout readers holding them all too."""
    coll = QueueCollection(directory, KESTREL3)
    coll.load()
    for child in range(1, readers):
        coll.queue(f"replay+r{child}")
    batch = [b"0123456789abcdef"] * 1000
    for _ in range(items // 1000):
        coll.put("replay", batch)
    coll.close()


def kestrel3_load_cpu_seconds(directory: str) -> tuple[float, int]:
    """The process's CPU seconds for loading the Kestrel 3 queue, and the items its readers hold."""
    started = time.process_time()
    coll = QueueCollection(directory, KESTREL3)
    coll.load()
    items = sum(coll.queue(name).length for name in coll.queue_names())
    elapsed = time.process_time() - started
    coll.close()
    return elapsed, items


def process_seconds(directory: str) -> float:
    """The same replay in a new process, from its start (interpreter and imports included)."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", f"from bench.bench_replay import replay_seconds; "
                    f"replay_seconds({directory!r})"], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small journals, for a smoke run")
    parser.add_argument("--profile", type=int, metavar="SIZE", help="cProfile the replay of SIZE-byte items")
    parser.add_argument("--kestrel3", type=int, metavar="N", help="load a Kestrel 3 queue of N items instead")
    parser.add_argument("--repeat", type=int, default=3, help="loads of the Kestrel 3 queue (default 3)")
    parser.add_argument("--readers", type=int, default=1,
                        help="readers of the Kestrel 3 queue: the queue and its fanout children (default 1)")
    args = parser.parse_args()
    print(f"# replay benchmark, {time.strftime('%Y-%m-%d')}, {machine()}")
    if args.kestrel3:
        directory = tempfile.mkdtemp(prefix="kestrel-replay-")
        try:
            write_kestrel3_queue(directory, args.kestrel3, args.readers)
            for _ in range(args.repeat):
                seconds, items = kestrel3_load_cpu_seconds(directory)
                print(f"Kestrel 3 queue of {args.kestrel3:,} items of 16 B, {args.readers} reader(s) holding "
                      f"{items:,}: loaded in {seconds:.2f} s of CPU, {seconds / items * 1e6:.2f} µs an item "
                      "held")
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        return
    for size, megabytes in ((64, 20), (1024, 200)):
        megabytes //= 10 if args.quick else 1
        directory = tempfile.mkdtemp(prefix="kestrel-replay-")
        try:
            records, nbytes = write_journal(directory, size, megabytes)
            if args.profile and size == args.profile:
                profile = cProfile.Profile()
                profile.runcall(replay_seconds, directory)
                pstats.Stats(profile).sort_stats("tottime").print_stats(12)
                continue
            best = min(replay_seconds(directory) for _ in range(3))
            whole = min(process_seconds(directory) for _ in range(3))
            print(f"{size:>5} B items: {records:,} records, {nbytes / 1e6:.0f} MB in {best:.2f} s: "
                  f"{records / best:,.0f} records/s, {nbytes / best / 1e6:.0f} MB/s; from process start "
                  f"{whole:.2f} s: {records / whole:,.0f} records/s, {nbytes / whole / 1e6:.0f} MB/s")
        finally:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
