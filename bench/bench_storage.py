"""Storage engine throughput through the library (no server), and replay speed at start-up.

Measures, for 64-byte and 4 KB items: add+remove pairs per second through one journaled queue for
each sync policy (never, 10ms, always), single items and batches of 100; and the replay speed of a
journal in MB/s. The peer, in the same run: a plain Python loop writing the same record bytes to a
file, once with buffered f.write and once with one os.write per record (what `never` promises).

    .venv/bin/python -m bench.bench_storage [--quick]
"""

from __future__ import annotations

import argparse
import os
import shutil
import struct
import tempfile
import time

from bench.common import machine
from kestrel.storage import QueueCollection, QueueConfigs
from kestrel.storage.kestrel2.codec import encode_addx

SIZES = (64, 4096)


def engine_pairs(directory: str, size: int, sync: str, n: int, batch: int) -> float:
    coll = QueueCollection(directory, QueueConfigs({"sync_journal": sync}))
    coll.load()
    q = coll.queue(f"bench_{size}_{sync.replace('ms', '')}_{batch}")
    data = b"x" * size
    items = [data] * batch
    started = time.perf_counter()
    if batch == 1:
        for _ in range(n):
            q.put(items)
            q.remove()
    else:
        for _ in range(n // batch):
            q.put(items)
            for _ in range(batch):
                q.remove()
    elapsed = time.perf_counter() - started
    coll.close()
    return n / elapsed


def plain_pairs(path: str, size: int, n: int, per_record_syscall: bool) -> float:
    data = b"x" * size
    header = struct.Struct("<biqq")
    started = time.perf_counter()
    if per_record_syscall:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        for _ in range(n):
            os.write(fd, header.pack(2, 16 + size, 1, 0) + data)
            os.write(fd, b"\x01")
        os.close(fd)
    else:
        with open(path, "wb") as f:
            for _ in range(n):
                f.write(header.pack(2, 16 + size, 1, 0) + data)
                f.write(b"\x01")
    return n / (time.perf_counter() - started)


def replay_mb_s(directory: str, megabytes: int) -> tuple[float, int]:
    path = os.path.join(directory, "replay")
    record = encode_addx(1, 0, b"r" * 1000) + b"\x01"
    with open(path, "wb") as f:
        for _ in range(megabytes * 1024 * 1024 // len(record)):
            f.write(record)
    size = os.path.getsize(path)
    started = time.perf_counter()
    coll = QueueCollection(directory, QueueConfigs({"max_memory_size": "64MB"}))
    coll.queue("replay")
    elapsed = time.perf_counter() - started
    coll.close()
    return size / elapsed / 1e6, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small counts, for a smoke run")
    args = parser.parse_args()
    scale = 10 if args.quick else 1
    print(f"# storage benchmark, {time.strftime('%Y-%m-%d')}, {machine()}")
    print(f"{'item':>6} {'sync':>6} {'batch':>5} {'pairs/s':>10}   peer")
    directory = tempfile.mkdtemp(prefix="kestrel-bench-")
    try:
        for size in SIZES:
            n = (200_000 if size == 64 else 50_000) // scale
            buffered = plain_pairs(os.path.join(directory, "plain"), size, n, False)
            syscall = plain_pairs(os.path.join(directory, "plain2"), size, n, True)
            for sync, count in (("never", n), ("10ms", n), ("always", 2_000 // scale)):
                for batch in (1, 100):
                    rate = engine_pairs(directory, size, sync, max(count, batch), batch)
                    peer = ""
                    if sync == "never":
                        peer = (f"plain f.write {buffered:,.0f}/s ({buffered / rate:.1f}x faster), "
                                f"os.write per record {syscall:,.0f}/s ({syscall / rate:.1f}x)")
                    print(f"{size:>6} {sync:>6} {batch:>5} {rate:>10,.0f}   {peer}")
        mb_s, size = replay_mb_s(directory, 20 if args.quick else 200)
        print(f"replay: {size / 1e6:.0f} MB of 1 KB add+remove records at {mb_s:.0f} MB/s")
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
