"""The memory budget at full size: 500 queues holding 4 MB each of 1 KB items (2 GB of backlog),
with `max_memory_total: 64MB` and without a budget, side by side in one run.

For each server: RSS once its queues exist, peak RSS while the backlogs are loaded, and the
throughput of a producer/consumer pair on a 501st queue ("hot": a put of 20 items on one connection,
then a get of 20 on another, in turn) before the backlogs exist and again once they do, best of
three runs, with the server's CPU time per item. The pair
should keep at least 0.8x its throughput: its head stays in memory while the backlogs page out.
Last the server restarts on its backlogs: the time to start (the replay), its peak RSS meanwhile and
its RSS once serving, which under a budget should be what it ran in.

    .venv/bin/python -m bench.bench_memory [--queues 500] [--mb 4] [--budget 64MB] [--seconds 5]
                                           [--source DIR]

`--tick`: instead, the governor's tick that plans every queue (a budget the backlogs' wants do not
fit), in process on the storage alone: CPU per tick over `--queues` queues of three 200-byte items
under half their bytes, and the longest stretch between the tick's pauses for the other tasks; then
a tick paging most of them out (the budget cut to a quarter), its time and longest stretch; for this
tree and for `--source DIR` (another version's src/ or build/compiled) in turn.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from thriftpy2.rpc import make_client
from thriftpy2.transport import TFramedTransportFactory

from bench.common import load_average, machine, process_cpu_seconds
from kestrel.contract import kestrel_thrift as kestrel
from tests.conftest import ServerProcess

ITEM = 1024
BATCH = 200  # items per put while loading
PAIR_BATCH = 20


def rss_mb(pid: int, field: str = "VmRSS") -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} for {pid}")


def client(srv: ServerProcess) -> Any:
    return make_client(kestrel.Kestrel, "127.0.0.1", srv.thrift_port, timeout=60_000,
                       trans_factory=TFramedTransportFactory())


def pair(srv: ServerProcess, seconds: float, repeat: int = 3) -> tuple[float, float]:
    """Items a second through the hot queue (puts on one connection, gets on another), the best of
    `repeat` runs of `seconds`, and the server's CPU µs per item in that run: on a shared machine
    wall time swings with the load, CPU time much less."""
    assert srv.proc is not None
    producer, consumer = client(srv), client(srv)
    try:
        data = [b"h" * ITEM] * PAIR_BATCH
        best = (0.0, 0.0)
        for _ in range(repeat):
            done = 0
            cpu = process_cpu_seconds(srv.proc.pid)
            started = time.perf_counter()
            end = started + seconds
            while time.perf_counter() < end:
                producer.put("hot", data, 0)
                done += len(consumer.get("hot", PAIR_BATCH, 0, 0))
            rate = done / (time.perf_counter() - started)
            if rate > best[0]:
                best = (rate, (process_cpu_seconds(srv.proc.pid) - cpu) / done * 1e6)
        return best
    finally:
        producer.close()
        consumer.close()


def run(budget: str, queues: int, megabytes: int, seconds: float, source: Path | None) -> dict[str, float]:
    home = Path(tempfile.mkdtemp(prefix="kestrel-memory-"))
    srv = ServerProcess(home, {"max_memory_total": budget})
    if source is not None:
        srv.python_path = [str(source.resolve())]
    srv.start()
    assert srv.proc is not None
    try:
        c = client(srv)
        for q in range(queues):
            c.put(f"backlog{q}", [b"w"], 0)
            c.get(f"backlog{q}", 1, 0, 0)
        pair(srv, 1.0, 1)  # warm
        out = {"idle": rss_mb(srv.proc.pid)}
        out["pair_alone"], out["cpu_alone"] = pair(srv, seconds)
        per_queue = megabytes * 1024 * 1024 // ITEM
        data = [b"b" * ITEM] * BATCH
        loaded = time.perf_counter()
        for _ in range(0, per_queue, BATCH):
            for q in range(queues):
                c.put(f"backlog{q}", data, 0)
        out["load_s"] = time.perf_counter() - loaded
        time.sleep(1.0)  # a governor tick or four
        out["loaded"] = rss_mb(srv.proc.pid)
        out["pair_backlogs"], out["cpu_backlogs"] = pair(srv, seconds)
        out["peak"] = rss_mb(srv.proc.pid, "VmHWM")
        c.close()
        srv.stop()
        started = time.perf_counter()
        srv.start()
        out["restart_s"] = time.perf_counter() - started
        out["restart_peak"] = rss_mb(srv.proc.pid, "VmHWM")
        out["restarted"] = rss_mb(srv.proc.pid)
        return out
    finally:
        srv.stop()
        shutil.rmtree(home, ignore_errors=True)


def tick_figures(queues: int, ticks: int = 40) -> tuple[float, float, float, float, int]:
    """In a process whose path starts with the tree measured, on a runtime whose tasks share one
    thread as on gevent: the CPU seconds of one governor tick over `queues` queues, each planned
    (a budget their wants do not fit), and the longest stretch between two of its pauses for the
    other tasks; then, the budget cut to a quarter of what they hold, the wall seconds of the tick
    that pages most of them out and its longest stretch (the collector off while timed), and the
    descriptors the process then holds of the queues' files. The process takes its hard limit of
    descriptors: a tree whose paged-out queues hold one for their read-behind cursors beside their
    journals' needs twice `queues`."""
    import gc
    import itertools
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)

    from kestrel.storage import QueueCollection, QueueConfigs
    from kestrel.storage.runtime import ManualRuntime

    with tempfile.TemporaryDirectory(prefix="kestrel-tick-") as home:
        runtime = ManualRuntime()
        configs = QueueConfigs({"journal_format": "kestrel2", "sync_journal": "never"}, None)
        coll = QueueCollection(home, configs, runtime=runtime, max_memory_total=queues * 300)
        coll.load()
        for q in range(queues):
            coll.put(f"q{q}", [b"x" * 200] * 3)
        governor = coll.governor
        assert governor is not None
        for _ in range(5):
            governor.tick()
        pauses: list[float] = []
        runtime.pause = lambda: pauses.append(time.perf_counter())  # type: ignore[method-assign]

        def tick() -> tuple[float, float]:
            pauses.clear()
            started = time.perf_counter()
            governor._tick_all(0.25, runtime.clock.now_ms())
            marks = [started, *pauses, time.perf_counter()]
            return marks[-1] - started, max(b - a for a, b in itertools.pairwise(marks))

        gc.collect()
        gc.disable()
        try:
            started = time.process_time()
            stretch = max(tick()[1] for _ in range(ticks))
            spent = (time.process_time() - started) / ticks
            governor.budget = coll.ledger.limit = coll.ledger.total // 4
            paging, paging_stretch = tick()
        finally:
            gc.enable()
        held = sum(os.readlink(f"/proc/self/fd/{fd}").startswith(home) for fd in os.listdir("/proc/self/fd")
                   if os.path.islink(f"/proc/self/fd/{fd}"))
        coll.close()
        return spent, stretch, paging, paging_stretch, held


def compare_ticks(queues: int, source: Path | None, repeat: int = 3) -> None:
    trees = [("this tree", Path(__file__).resolve().parent.parent / "src")]
    if source is not None:
        trees.append((str(source), source.resolve()))
    print(f"# {machine()}; load {load_average()}")
    print(f"# the governor's tick over {queues} queues, in turn: a plan's CPU ms (µs a queue) and its "
          "longest stretch between pauses; a page-out of most queues, wall ms and longest stretch, and "
          "the descriptors of the queues' files held after it")
    for run_ in range(repeat):
        for label, tree in trees:
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), str(tree.parent)]))
            done = subprocess.run([sys.executable, "-m", "bench.bench_memory", "--tick-here",
                                   "--queues", str(queues)], env=env, capture_output=True, text=True,
                                  check=True, cwd=Path(__file__).resolve().parent.parent)
            *figures, held = done.stdout.split()[-5:]
            seconds, stretch, paging, paging_stretch = (float(x) for x in figures)
            per_queue = seconds / queues * 1e6
            print(f"run {run_ + 1}, {label}: plan {seconds * 1000:.2f} ms ({per_queue:.2f} µs a queue), "
                  f"longest stretch {stretch * 1000:.2f} ms; page-out {paging * 1000:.1f} ms, longest "
                  f"stretch {paging_stretch * 1000:.2f} ms; {held} descriptors held")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--queues", type=int, default=500)
    parser.add_argument("--mb", type=int, default=4, help="MB of 1 KB items in each backlog")
    parser.add_argument("--budget", default="64MB")
    parser.add_argument("--seconds", type=float, default=3.0, help="each of the pair's three runs")
    parser.add_argument("--source", type=Path, help="run the server from this source tree")
    parser.add_argument("--tick", action="store_true", help="time the governor's tick instead")
    parser.add_argument("--tick-here", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.tick_here:
        import structlog

        structlog.configure(logger_factory=structlog.ReturnLoggerFactory())  # no line a queue
        print(*tick_figures(args.queues))
        return
    if args.tick:
        compare_ticks(args.queues, args.source)
        return
    print(f"# {machine()}; load {load_average()}")
    print(f"# {args.queues} queues x {args.mb} MB of {ITEM}-byte items; hot pair: put {PAIR_BATCH} then "
          f"get {PAIR_BATCH}, best of 3 x {args.seconds:g} s (server CPU us per item in brackets)")
    rows = [(f"max_memory_total: {budget}", run(budget, args.queues, args.mb, args.seconds, args.source))
            for budget in (args.budget, "0")]
    print("| server | RSS, queues empty | RSS, backlogs loaded | peak RSS | load | hot pair alone (CPU) "
          "| hot pair beside the backlogs (CPU) | ratio | restart: start-up, peak RSS, RSS serving |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for label, r in rows:
        ratio = r["pair_backlogs"] / r["pair_alone"]
        print(f"| {label} | {r['idle']:.0f} MB | {r['loaded']:.0f} MB | {r['peak']:.0f} MB "
              f"| {r['load_s']:.0f} s | {r['pair_alone']:,.0f} items/s ({r['cpu_alone']:.1f}) "
              f"| {r['pair_backlogs']:,.0f} items/s ({r['cpu_backlogs']:.1f}) | {ratio:.2f}x "
              f"| {r['restart_s']:.1f} s, {r['restart_peak']:.0f} MB, {r['restarted']:.0f} MB |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
