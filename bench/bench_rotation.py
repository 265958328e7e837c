"""Put latency while Kestrel 2 journals rotate many times a second: `sync_journal: never`, and a
periodic sync with the commit log off and on.

Each rotation makes the new live journal's name durable, its folder fsynced on the thread pool
(docs/durability.md, "Names a power cut keeps"); where the queue's changes wait for it at its gate,
the put that comes next waits for that fsync. Four Thrift clients (bench/loadgen.c), each putting and
taking back one item a round on a queue of its own, rotate their journals every `--journal` bytes (an
emptied queue rotates and packs: rotations a second are the server's packs a second, from its
`/metrics`); the table gives each mode's items/s and put latency. `--dir` places the queue paths (a
tmpfs, `/dev/shm`, against the disk); `--source DIR` runs another tree's src/ in turn with this one.

    .venv/bin/python -m bench.bench_rotation [--seconds 8] [--runs 2] [--dir DIR] [--source DIR]
"""

from __future__ import annotations

import argparse
import re
import tempfile
import urllib.request
from pathlib import Path

from bench import loadgen, peers
from bench.common import load_average, machine

PACKS = re.compile(rb"^kestrel_journal_pack_duration_seconds_count (\S+)$", re.M)


def packs(server: peers.Running) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{server['admin']}/metrics", timeout=30) as answer:
        found = PACKS.search(answer.read())
    return float(found.group(1)) if found else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--journal", default="64KB", help="default_journal_size and max_journal_size")
    parser.add_argument("--sync", default="100ms", help="the periodic sync's interval")
    parser.add_argument("--dir", default=None, help="where the queue paths go (default: the temporary one)")
    parser.add_argument("--source", type=Path, default=None, help="another tree's src/, in turn with ours")
    args = parser.parse_args()
    trees: dict[str, Path | None] = {"this tree": None} | ({"--source": args.source} if args.source else {})
    modes = [("never", "off"), (args.sync, "off"), (args.sync, "on")]
    print(f"# put latency amid Kestrel 2 rotations, {machine()}; load average before: {load_average()}")
    where = args.dir or tempfile.gettempdir()
    print(f"# {args.clients} Thrift clients, put + get of one 128-byte item, a queue each, journals of "
          f"{args.journal}, {args.seconds:g} s a run, queue paths under {where}\n")
    print("| tree | `sync_journal` | `commit_log` | run | items/s | rotations/s "
          "| put p50 µs | p99 | p99.9 | max |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory(prefix="kestrel-bench-") as tools, \
            tempfile.TemporaryDirectory(prefix="kestrel-bench-", dir=args.dir) as home:
        binary = loadgen.build(Path(tools))
        queue = {"default_journal_size": args.journal, "max_journal_size": args.journal}
        for run in range(1, args.runs + 1):
            for sync, commit_log in modes:
                for tree, source in trees.items():
                    with peers.kestrel(Path(home), sync, commit_log, admin=True, source=source,
                                       queue=queue) as server:
                        before = packs(server)
                        done = loadgen.run(binary, "thrift", server["thrift"], clients=args.clients,
                                           seconds=args.seconds)
                        rotations = (packs(server) - before) / done.seconds
                    put = done.latency_us["put"]
                    print(f"| {tree} | {sync} | {commit_log} | {run} | {done.items_per_s:,.0f} "
                          f"| {rotations:.1f} | {put['p50']:.0f} | {put['p99']:.0f} | {put['p99.9']:.0f} "
                          f"| {put['max']:,.0f} |",
                          flush=True)
    print(f"\nload average after: {load_average()}")


if __name__ == "__main__":
    main()
