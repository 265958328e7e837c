"""What the admin page costs the server: CPU per item under a put/get load with ten pages open,
against the same load with none, run by run in turn; and the server's CPU per second when idle.

A page open on the overview asks for `/dashboard/overview.json` once a second (its files are
fetched once, at load, and revalidated on a reload only); ten pages here are ten keep-alive HTTP
connections doing exactly that, so what is measured is the server's side, not a browser's. The load
is bench/loadgen.c's Thrift put + get, one item per request, 4 clients. Each case runs with the
loadgen's 4 queues alone, and with 10,000 queues in all (the server's `max_queues`; the others
loaded at start-up, one item each), where each snapshot reads every queue. The server's CPU time
(user + system, all threads, from /proc) is divided by the items moved; the median of the runs is
printed, with the ratio of ten pages to none. The idle column is the server's CPU over as many
seconds with no load, just before each run.

    .venv/bin/python -m bench.bench_dashboard [--seconds S] [--runs N] [--pages N] [--queues N]
"""

from __future__ import annotations

import argparse
import http.client
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from bench import loadgen, peers
from bench.common import load_average, machine, process_cpu_seconds
from kestrel.storage.kestrel2 import codec

POLL_S = 1.0  # the page's poll
CLIENTS = 4  # the load generator's, each on a queue of its own


@dataclass
class Pages:
    """Pollers each doing what an open overview page does; what they saw."""

    latencies: list[float] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    failures: int = 0


def poll(port: int, stop: threading.Event, seen: Pages) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        while not stop.is_set():
            started = time.perf_counter()
            try:
                connection.request("GET", "/dashboard/overview.json")
                reply = connection.getresponse()
                body = reply.read()
                if reply.status != 200:
                    raise OSError(f"HTTP {reply.status}")
                seen.latencies.append(time.perf_counter() - started)
                seen.sizes.append(len(body))
            except (OSError, http.client.HTTPException):
                seen.failures += 1
                connection.close()
            stop.wait(max(0.0, POLL_S - (time.perf_counter() - started)))
    finally:
        connection.close()


@contextmanager
def pages_open(port: int, count: int) -> Iterator[Pages]:
    seen = Pages()
    stop = threading.Event()
    pollers = [threading.Thread(target=poll, args=(port, stop, seen), daemon=True) for _ in range(count)]
    for i, poller in enumerate(pollers):
        poller.start()
        time.sleep(POLL_S / max(count, 1) * (i > 0))  # spread over the second, as pages opened apart are
    try:
        yield seen
    finally:
        stop.set()
        for poller in pollers:
            poller.join()


def queues_on_disk(count: int) -> Callable[[Path], None]:
    record = codec.encode_addx(1_700_000_000_000, 0, b"item")

    def fill(path: Path) -> None:
        for n in range(count):
            (path / f"waiting{n}").write_bytes(record)

    return fill


@dataclass
class Case:
    """One server (its queues) measured with `pages` pollers and without, run by run in turn."""

    cpu_us_per_item: dict[int, list[float]] = field(default_factory=dict)
    items_per_s: dict[int, list[float]] = field(default_factory=dict)
    idle_ms_per_s: dict[int, list[float]] = field(default_factory=dict)
    pages: Pages = field(default_factory=Pages)


def measure(binary: Path, running: peers.Running, page_counts: tuple[int, ...], seconds: float,
            runs: int) -> Case:
    case = Case()
    for _ in range(runs):
        for pages in page_counts:
            with pages_open(running["admin"], pages) as seen:
                time.sleep(POLL_S)  # every page has asked once: the snapshot is warm
                before = process_cpu_seconds(running.pid)
                idle_started = time.monotonic()
                time.sleep(seconds)
                idle = (process_cpu_seconds(running.pid) - before) / (time.monotonic() - idle_started)
                before = process_cpu_seconds(running.pid)
                result = loadgen.run(binary, "thrift", running["thrift"], clients=CLIENTS, seconds=seconds)
                cpu = process_cpu_seconds(running.pid) - before
            case.cpu_us_per_item.setdefault(pages, []).append(cpu * 1e6 / max(result.items, 1))
            case.items_per_s.setdefault(pages, []).append(result.items_per_s)
            case.idle_ms_per_s.setdefault(pages, []).append(idle * 1000)
            if pages:
                case.pages.latencies += seen.latencies
                case.pages.sizes += seen.sizes
                case.pages.failures += seen.failures
    return case


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=5.0, help="each run's length, and idle reading's")
    parser.add_argument("--runs", type=int, default=3, help="runs of each case, in turn; the median is kept")
    parser.add_argument("--pages", type=int, default=10)
    parser.add_argument("--queues", type=int, default=10_000, help="queues in the second case (max_queues)")
    args = parser.parse_args()

    print(f"the admin page's cost: {args.pages} pages polling /dashboard/overview.json every {POLL_S:.0f} s "
          f"against none; Thrift put + get, 1 item per request, 4 clients, {args.seconds:g} s runs, "
          f"median of {args.runs}; {machine()}; load average {load_average()}")
    print(f"{'queues':>8} {'pages':>5} {'CPU µs/item':>12} {'ratio':>6} {'items/s':>9} {'idle CPU ms/s':>14} "
          f"{'poll p50':>9} {'poll max':>9} {'JSON':>9}")
    with tempfile.TemporaryDirectory() as work:
        binary = loadgen.build(Path(work))
        for queues in (CLIENTS, args.queues):  # the loadgen's own queues among them
            prepare = queues_on_disk(queues - CLIENTS) if queues > CLIENTS else None
            with peers.kestrel(Path(work), admin=True, prepare=prepare) as running:
                case = measure(binary, running, (0, args.pages), args.seconds, args.runs)
            base = statistics.median(case.cpu_us_per_item[0])
            for pages in (0, args.pages):
                cpu = statistics.median(case.cpu_us_per_item[pages])
                polls = case.pages.latencies if pages else []
                p50 = f"{statistics.median(polls) * 1000:.1f} ms" if polls else "-"
                top = f"{max(polls) * 1000:.1f} ms" if polls else "-"
                sizes = case.pages.sizes if pages else []
                size = f"{statistics.median(sizes) / 1024:.0f} KB" if sizes else "-"
                print(f"{queues:>8,} {pages:>5} {cpu:>12.1f} {cpu / base:>6.2f} "
                      f"{statistics.median(case.items_per_s[pages]):>9,.0f} "
                      f"{statistics.median(case.idle_ms_per_s[pages]):>14.1f} {p50:>9} {top:>9} {size:>9}")
            if case.pages.failures:
                print(f"  {case.pages.failures} polls failed")


if __name__ == "__main__":
    main()
