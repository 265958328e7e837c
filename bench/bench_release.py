"""What a Kestrel 3 get that passes the end of a writer file costs the event loop.

Once every reader has passed a writer file, the file is deleted (marked in the manifest first, the
folder fsynced after). Each run is a process of its own, on this checkout's code (`--build
pure|compiled`) or another tree's (`--source DIR`: a src/ or a build/compiled put first on the
path), the two in turn. A Kestrel 3 queue with `default_journal_size` 16KB (a writer file every
100 or so items) takes `--items` puts of 128 B, then as many gets, the loop let run a turn after
each (as a server's does between requests). Counted on the main thread, which runs the loop: its
CPU over the gets, per get, beside the process's (all threads, the close that follows included);
its `fsync` and `unlink` calls (wrappers of `os.fsync` and `os.unlink`, which the engine calls by
name), beside those of the runtime's thread pool, up to that close; the longest get. After the
close the writer files left are counted (one: every file the readers passed is gone).

    .venv/bin/python -m bench.bench_release [--items 5000] [--repeat 3] [--build compiled]
        [--source DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import filled_queue, load_average, machine

ROOT = Path(__file__).resolve().parent.parent


def child(items: int) -> dict[str, float]:
    import _thread

    import gevent

    main = _thread.get_ident()
    calls = {"loop fsync": 0, "loop unlink": 0, "pool fsync": 0, "pool unlink": 0}

    def counted(name: str, fn):  # type: ignore[no-untyped-def]
        def call(*args, **kwargs):  # type: ignore[no-untyped-def]
            where = "loop" if _thread.get_ident() == main else "pool"
            calls[f"{where} {name}"] += 1
            return fn(*args, **kwargs)
        return call

    with tempfile.TemporaryDirectory(prefix="bench-release-") as directory:
        coll, queue = filled_queue(directory, "drain", items, {"journal_format": "kestrel3",
                                                              "default_journal_size": "16KB"})
        gevent.sleep(0.2)  # the rotated files sealed into the manifest
        fsync, unlink = os.fsync, os.unlink
        os.fsync, os.unlink = counted("fsync", fsync), counted("unlink", unlink)
        files = sum(1 for name in os.listdir(directory) if name.startswith("drain.") and "read" not in name)
        longest = 0.0
        cpu, process = time.thread_time(), time.process_time()
        for _ in range(items):
            started = time.perf_counter()
            assert queue.remove()
            longest = max(longest, time.perf_counter() - started)
            gevent.sleep(0)
        cpu = time.thread_time() - cpu
        coll.close()
        process = time.process_time() - process
        os.fsync, os.unlink = fsync, unlink  # (not the temporary folder's removal)
        left = sum(1 for name in os.listdir(directory) if name.startswith("drain.") and "read" not in name)
    return {"files": files, "left": left, "cpu_us": cpu / items * 1e6, "process_us": process / items * 1e6,
            "longest_ms": longest * 1e3, **calls}


def run(path: str, items: int) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-m", "bench.bench_release", "--child", str(items)], cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": path}, check=True, capture_output=True,
                         text=True).stdout
    result: dict[str, float] = json.loads(out.splitlines()[-1])  # (the engine's log lines before)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--items", type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--build", default="compiled", choices=("pure", "compiled"))
    parser.add_argument("--source", type=Path,
                        help="another tree's src/ or build/compiled, run in turn with this one")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    here = str(ROOT / ("build/compiled" if args.build == "compiled" else "src"))
    trees = [("this", here)] + ([("source", str(args.source.resolve()))] if args.source else [])
    print(f"# {machine()}; load {load_average()}; {args.build} build; {args.items} gets of 128 B "
          "items from a Kestrel 3 queue, 16KB writer files")
    print("| tree | writer files passed | left after close | loop CPU µs a get | process CPU µs a get "
          "| longest get ms "
          "| fsyncs on the loop | unlinks on the loop | fsyncs on the pool | unlinks on the pool |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for _ in range(args.repeat):
        for name, path in trees:
            r = run(path, args.items)
            print(f"| {name} | {r['files'] - 1:.0f} | {r['left']:.0f} | {r['cpu_us']:.1f} "
                  f"| {r['process_us']:.1f} | {r['longest_ms']:.2f} | {r['loop fsync']:.0f} "
                  f"| {r['loop unlink']:.0f} | {r['pool fsync']:.0f} | {r['pool unlink']:.0f} |", flush=True)
    print(f"# load {load_average()} after")


if __name__ == "__main__":
    main()
