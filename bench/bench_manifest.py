"""What the per-queue manifest costs: rotation, start-up and checkpoint rewrites, both formats.

Through the library, in one process: 100,000 1 KB items added (4 MB journals: Kestrel 2 rotates
in read-behind and packs past 64 MB, Kestrel 3 starts about 25 writer files), then every
background write settled (`wait_for_packing`); the collection closed
and opened again (start-up: every file compared with the manifest, then replayed); for Kestrel 3,
flushes of a reader (each rewrites its checkpoint). Wall and CPU time (all threads) per item or
per operation. Run it on two trees in alternation to compare them (bench/README.md).

    .venv/bin/python -m bench.bench_manifest [--quick]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

from bench.common import load_average, machine
from kestrel.storage import QueueCollection, QueueConfigs

ITEM = b"m" * 1024
JOURNAL = 4 << 20


def collection(directory: str, fmt: str) -> QueueCollection:
    settings = {"journal_format": fmt, "max_memory_size": JOURNAL, "max_journal_size": 16 * JOURNAL,
                "default_journal_size": JOURNAL}
    coll = QueueCollection(directory, QueueConfigs({}, {"q": settings}))
    coll.load()
    coll.queue("q")
    return coll


def timed(fn: object) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    fn()  # type: ignore[operator]
    return time.perf_counter() - wall, time.process_time() - cpu


def run(fmt: str, items: int, flushes: int) -> None:
    directory = tempfile.mkdtemp(prefix=f"kestrel-manifest-{fmt}-")
    try:
        coll = collection(directory, fmt)

        def fill() -> None:
            for start in range(0, items, 100):
                coll.put("q", [ITEM] * min(100, items - start), 0)
            coll.queue("q").wait_for_packing()

        wall, cpu = timed(fill)
        files = len(os.listdir(directory))
        print(f"{fmt}: {items:,} adds of 1 KB ({files} files): {wall:.2f} s wall, "
              f"{cpu / items * 1e6:.1f} µs CPU per item, rotations and manifest included")
        coll.close()
        best = min(timed(lambda: collection(directory, fmt).close())[0] for _ in range(3))
        print(f"{fmt}: start-up of {items * len(ITEM) / 1e6:.0f} MB in {files} files: {best:.3f} s "
              "(best of 3)")
        if fmt == "kestrel3":
            coll = collection(directory, fmt)

            def flush() -> None:
                for _ in range(flushes):
                    coll.put("q", [ITEM])
                    coll.flush("q")

            wall, cpu = timed(flush)
            print(f"{fmt}: {flushes} add + flush (a checkpoint rewrite each): "
                  f"{wall / flushes * 1e3:.2f} ms wall, {cpu / flushes * 1e6:.0f} µs CPU each")
            coll.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="small counts, for a smoke run")
    args = parser.parse_args()
    print(f"# manifest benchmark, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {machine()}, "
          f"load {load_average()}")
    items = 10_000 if args.quick else 100_000
    for fmt in ("kestrel2", "kestrel3"):
        run(fmt, items, 20 if args.quick else 200)


if __name__ == "__main__":
    main()
