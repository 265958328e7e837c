"""Bytes on disk for a queue with fanout readers: journal_format kestrel3 against kestrel2.

A parent queue with `--readers` fanout children (default 4) gets the same items in both formats;
prints the bytes of every file of the parent and its children after the puts, after half of every
reader has been drained (confirmed reads), and after all of it. Kestrel 2 keeps one journal per
child (plus the parent's); Kestrel 3 one writer journal and a small checkpoint per reader. Disk
figures do not depend on the machine's speed; the time to put is printed too.

    .venv/bin/python -m bench.bench_fanout_disk [--readers 4] [--items 20000] [--size 512]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

from bench.common import load_average, machine
from kestrel.storage import QueueCollection, QueueConfigs
from kestrel.storage.clock import FakeClock

KB = 1024


def disk_bytes(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory)
               if n == "q" or n.startswith(("q.", "q+")))


def run(fmt: str, readers: int, items: int, size: int) -> dict[str, float]:
    directory = tempfile.mkdtemp(prefix=f"bench-fanout-{fmt}-")
    settings = {"journal_format": fmt, "default_journal_size": "1MB", "max_memory_size": "4MB"}
    coll = QueueCollection(directory, QueueConfigs({}, {"q": settings}), clock=FakeClock())
    coll.load()
    names = ["q"] + [f"q+r{i}" for i in range(readers)]
    for name in names:
        coll.queue(name)
    data = b"x" * size
    started = time.perf_counter()
    for _ in range(0, items, 100):
        coll.put("q", [data] * 100)
    put_seconds = time.perf_counter() - started
    figures = {"put_s": put_seconds, "after_put": disk_bytes(directory)}
    for stage, share in (("half_drained", 0.5), ("drained", 1.0)):
        for name in names:
            q = coll.queue(name)
            while q.length > items * (1 - share):
                got = coll.remove(name, min(100, int(q.length - items * (1 - share))), True)
                coll.confirm(name, [i.xid for i in got])
            q.wait_for_packing()
        figures[stage] = disk_bytes(directory)
    coll.close()
    shutil.rmtree(directory, ignore_errors=True)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readers", type=int, default=4)
    parser.add_argument("--items", type=int, default=20_000)
    parser.add_argument("--size", type=int, default=512)
    args = parser.parse_args()
    print(f"{machine()}; load {load_average()}")
    print(f"a parent and {args.readers} fanout readers, {args.items} items of {args.size} B "
          f"({args.items * args.size // KB} KB of data)")
    results = {fmt: run(fmt, args.readers, args.items, args.size) for fmt in ("kestrel2", "kestrel3")}
    print(f"{'':>14} {'kestrel2 KB':>12} {'kestrel3 KB':>12} {'k2 / k3':>8}")
    for stage in ("after_put", "half_drained", "drained"):
        k2, k3 = results["kestrel2"][stage], results["kestrel3"][stage]
        ratio = f"{k2 / k3:.2f}" if k3 else "-"
        print(f"{stage:>14} {k2 / KB:>12.1f} {k3 / KB:>12.1f} {ratio:>8}")
    print(f"{'put seconds':>14} {results['kestrel2']['put_s']:>12.2f} {results['kestrel3']['put_s']:>12.2f}")


if __name__ == "__main__":
    main()
