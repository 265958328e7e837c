"""What a get of a large item read back from the journal (read-behind) holds the event loop for.

Each run is a process of its own, on this checkout's code (`--build pure|compiled`) or another
tree's (`--source DIR`: a src/ or a build/compiled put first on the path). A queue with
`max_memory_size` 1MB takes six 16 MB items, one put each: the first stays in memory, the others
only in the journal. Six gets then take them, each reading the next item back, with the journal's
pages cached or dropped first (`posix_fadvise`). A greenlet ticking every 0.5 ms beside them gives
the longest stretch the loop was held during each get; the main thread's CPU time over a get is the
loop's CPU for it (a read on the thread pool is not counted). The peer in the same process: the same
gets with the items held in memory (`max_memory_size` 1GB).

`--drain N`: what the change costs small items instead, counted by valgrind's callgrind: the main
thread's instructions an item of N and then 4 N puts of 128 B and the gets that read them back
(`max_memory_size` 16KB: read-behind), the difference divided by the 3 N items between them.
`--format` names the journal format of either measure (Kestrel 3: the writer journal's readers
read back through the same gate).

    .venv/bin/python -m bench.bench_large_read [--repeat 3] [--format kestrel2] [--build compiled]
        [--source DIR] [--drain N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.callgrind_log import _callgrind, _main_thread_instructions
from bench.common import filled_queue, machine

ROOT = Path(__file__).resolve().parent.parent
ITEMS = 6
SIZE = 16 << 20
TICK_S = 0.0005


def _drop_pages(directory: str) -> None:
    """The journal's pages out of the page cache (written back first, or they could not be dropped)."""
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def child(journal_format: str, memory: str, cold: bool) -> list[tuple[float, float]]:
    """(longest loop hold, loop CPU) in ms for each get."""
    import gevent

    from kestrel.storage import QueueCollection, QueueConfigs

    longest = [0.0]
    running = [True]

    def tick() -> None:
        while running[0]:
            started = time.perf_counter()
            gevent.sleep(TICK_S)
            longest[0] = max(longest[0], time.perf_counter() - started)

    with tempfile.TemporaryDirectory(prefix="bench-large-read-") as directory:
        coll = QueueCollection(directory, QueueConfigs({"journal_format": journal_format,
                                                        "max_memory_size": memory}))
        coll.load()
        queue = coll.queue("large")
        for n in range(ITEMS):
            queue.put([bytes([n]) * SIZE])
        if cold:
            _drop_pages(directory)
        ticker = gevent.spawn(tick)
        gevent.sleep(0.01)
        figures = []
        for n in range(ITEMS):
            longest[0] = 0.0
            cpu = time.thread_time()
            (item,) = queue.remove()
            cpu = time.thread_time() - cpu
            gevent.sleep(TICK_S * 4)  # the ticker's turn after the get
            assert item.data[:1] == bytes([n]) and len(item.data) == SIZE
            figures.append((longest[0] * 1e3, cpu * 1e3))
        running[0] = False
        ticker.join()
        coll.close()
    return figures


def drain(count: int, journal_format: str) -> None:
    """`count` puts of 128 B and the gets that read them back, through read-behind."""
    with tempfile.TemporaryDirectory(prefix="bench-large-read-") as directory:
        coll, queue = filled_queue(directory, "small", count, {"journal_format": journal_format,
                                                               "max_memory_size": "16KB"})
        for _ in range(count):
            assert queue.remove()
        coll.close()


def drain_instructions(path: str, count: int, journal_format: str) -> float:
    """Main thread instructions an item of `drain`, from runs of `count` and 4 `count` items."""
    counts = []
    with tempfile.TemporaryDirectory(prefix="bench-large-read-") as work:
        for n in (count, 4 * count):
            out = f"{work}/drain-{n}.%p"
            subprocess.run([*_callgrind(out), sys.executable, "-m", "bench.bench_large_read", "--child",
                            "drain", str(n), journal_format], cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": path}, check=True, capture_output=True)
            counts.append(_main_thread_instructions(f"{work}/drain-{n}.*-01"))
    return (counts[1] - counts[0]) / (3 * count)


def run(path: str, journal_format: str, memory: str, cold: bool) -> list[tuple[float, float]]:
    env = {**os.environ, "PYTHONPATH": path}
    out = subprocess.run([sys.executable, "-m", "bench.bench_large_read", "--child", journal_format, memory,
                          "cold" if cold else "cached"], cwd=ROOT, env=env, check=True,
                         capture_output=True, text=True).stdout
    return [tuple(pair) for pair in json.loads(out.splitlines()[-1])]  # (the server's log lines before)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--format", default="kestrel2", choices=("kestrel2", "kestrel3"))
    parser.add_argument("--build", default="compiled", choices=("pure", "compiled"))
    parser.add_argument("--source", type=Path,
                        help="another tree's src/ or build/compiled, run in turn with this one")
    parser.add_argument("--drain", type=int, metavar="N", help="count small items' instructions instead")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        journal_format, memory, cache = args.child
        if journal_format == "drain":
            drain(int(memory), cache)
        else:
            print(json.dumps(child(journal_format, memory, cache == "cold")))
        return
    here = str(ROOT / ("build/compiled" if args.build == "compiled" else "src"))
    trees = [("this", here)] + ([("source", str(args.source.resolve()))] if args.source else [])
    if args.drain:
        print(f"# {machine()}; {args.format}, {args.build} build; main thread instructions an item, "
              f"128 B put + get through read-behind ({args.drain} and {4 * args.drain} items)")
        for _ in range(args.repeat):
            for name, path in trees:
                print(f"| {name} | {drain_instructions(path, args.drain, args.format):,.0f} |", flush=True)
        return
    print(f"# {machine()}; {ITEMS} items of {SIZE >> 20} MB, {args.format}, {args.build} build; "
          f"ms per get: longest loop hold / loop CPU (the gets that read an item back)")
    print("| tree | pages | read-behind hold | read-behind loop CPU | in memory hold | in memory loop CPU |")
    print("| --- | --- | --- | --- | --- | --- |")
    for _ in range(args.repeat):
        for name, path in trees:
            for cold in (False, True):
                behind = run(path, args.format, "1MB", cold)[:-1]  # the last get reads nothing back
                held = run(path, args.format, "1GB", cold)[:-1]
                cells = [f"{min(v):.1f}–{max(v):.1f} (median {statistics.median(v):.1f})"
                         for v in ([h for h, _ in behind], [c for _, c in behind],
                                   [h for h, _ in held], [c for _, c in held])]
                pages = "dropped" if cold else "cached"
                print(f"| {name} | {pages} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
