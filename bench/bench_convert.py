"""`kestrel journal convert` speed, against copying the same bytes with fsync (the peer).

A Kestrel 2 queue of 1 KB and of 64-byte items is converted to Kestrel 3 and back; each direction
is timed from the call to the files in place, and the peer copies the source journal into a new
file of the same directory and fsyncs it, so the ratio says what reading, re-encoding and the
crash-safe steps cost over moving the bytes once.

    .venv/bin/python -m bench.bench_convert [--megabytes 100]
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import tempfile
import time

from bench.common import load_average, machine
from kestrel.storage.kestrel2.codec import encode_addx
from kestrel.storage.tools import convert


def write_queue(directory: str, size: int, megabytes: int) -> int:
    """A Kestrel 2 journal `bench` of ADDX records; returns the item count."""
    record = encode_addx(1_700_000_000_000, 0, b"c" * size)
    count = megabytes * 1_000_000 // len(record)
    with open(os.path.join(directory, "bench"), "wb") as f:
        for _ in range(count // 1000):
            f.write(record * 1000)
        f.write(record * (count % 1000))
    return count


def copy_seconds(directory: str, source: str) -> float:
    started = time.perf_counter()
    target = os.path.join(directory, "copy")
    with open(source, "rb") as src, open(target, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
        dst.flush()
        os.fsync(dst.fileno())
    elapsed = time.perf_counter() - started
    os.unlink(target)
    return elapsed


def convert_seconds(directory: str, to: str) -> float:
    started = time.perf_counter()
    convert.convert(directory, to, [], io.StringIO())
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--megabytes", type=int, default=100, help="journal size of each queue")
    args = parser.parse_args()
    print(f"# {machine()}; load average {load_average()}")
    print("| items | journal MB | copy + fsync MB/s | to kestrel3 MB/s (ratio) | to kestrel2 MB/s (ratio) |")
    print("| --- | --- | --- | --- | --- |")
    for size in (1024, 64):
        directory = tempfile.mkdtemp(prefix="bench-convert-")
        try:
            count = write_queue(directory, size, args.megabytes)
            megabytes = os.path.getsize(os.path.join(directory, "bench")) / 1e6
            copy_rate = megabytes / copy_seconds(directory, os.path.join(directory, "bench"))
            to3 = megabytes / convert_seconds(directory, "kestrel3")
            to2 = megabytes / convert_seconds(directory, "kestrel2")
            print(f"| {count:,} × {size} B | {megabytes:.0f} | {copy_rate:.0f} | {to3:.0f} "
                  f"({to3 / copy_rate:.2f}) | {to2:.0f} ({to2 / copy_rate:.2f}) |")
        finally:
            shutil.rmtree(directory)


if __name__ == "__main__":
    main()
