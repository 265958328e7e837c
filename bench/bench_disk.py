"""Disk held by a queue while a read-behind backlog drains: bytes on disk / live bytes.

Queues a backlog of 100 times `max_memory_size`, then drains it, letting packing settle every
1% of the backlog; prints bytes on disk against live bytes (the records a fresh journal would
need for the items still queued) at points of the drain, the largest excess over live data, and
how many bytes the packs wrote in all. Disk figures do not depend on the machine's speed.

    .venv/bin/python -m bench.bench_disk [--quick]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile

from bench.common import machine
from kestrel.storage import QueueCollection, QueueConfigs
from kestrel.storage.clock import FakeClock
from kestrel.storage.kestrel2 import codec, packer

KB = 1024
POINTS = (0, 25, 50, 75, 90, 95, 99, 100)


def queue_disk_bytes(directory: str) -> int:
    return sum(os.path.getsize(os.path.join(directory, n)) for n in os.listdir(directory)
               if n == "q" or n.startswith("q."))


def drain(memory: int, item_size: int, journal: int, default: int) -> None:
    directory = tempfile.mkdtemp(prefix="bench-disk-")
    settings = {"max_memory_size": memory, "max_journal_size": journal, "default_journal_size": default}
    coll = QueueCollection(directory, QueueConfigs({}, {"q": settings}), clock=FakeClock(1_700_000_000_000))
    coll.load()
    q = coll.queue("q")
    count = 100 * memory // item_size
    data = b"x" * item_size
    for _ in range(0, count, 100):
        coll.put("q", [data] * 100)
    record = len(codec.encode_addx(0, 0, data))
    peak = queue_disk_bytes(directory)
    written = [0]
    real_write = packer.write_pack

    def counting(request: packer.PackRequest, dead: list[str]) -> str:
        final = real_write(request, dead)
        written[0] += os.path.getsize(final)
        return final

    packer.write_pack = counting  # type: ignore[assignment]
    print(f"\nmax_memory_size {memory // KB} KB, items of {item_size} B, backlog {count} items "
          f"({count * record // KB} KB of records), default_journal_size {default // KB} KB; "
          f"peak on disk {peak // KB} KB")
    print(f"{'drained':>8} {'disk KB':>9} {'live KB':>9} {'disk/live':>9} {'excess KB':>10}")
    worst = 0
    step = count // 100
    done = 0
    try:
        for percent in range(101):
            target = count * percent // 100
            while done < target:
                coll.remove("q")
                done += 1
            q.wait_for_packing()
            disk, live = queue_disk_bytes(directory), q.length * record
            worst = max(worst, disk - live)
            if percent in POINTS:
                ratio = f"{disk / live:9.3f}" if live else f"{'-':>9}"
                print(f"{percent:>7}% {disk / KB:9.1f} {live / KB:9.1f} {ratio} {(disk - live) / KB:10.1f}")
    finally:
        packer.write_pack = real_write  # type: ignore[assignment]
    slack = 2 * memory + default
    print(f"largest excess over live data {worst / KB:.1f} KB (2 x max_memory_size + "
          f"default_journal_size = {slack / KB:.0f} KB); packs wrote {written[0] / KB:.0f} KB in all "
          f"({step} removes between samples)")
    coll.close()
    shutil.rmtree(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="the small configuration only")
    args = parser.parse_args()
    print(machine())
    drain(8 * KB, 256, 32 * KB, 8 * KB)
    if not args.quick:
        drain(64 * KB, 1024, 256 * KB, 64 * KB)


if __name__ == "__main__":
    main()
