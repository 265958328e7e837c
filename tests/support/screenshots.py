"""The admin page's screenshots in docs/, taken from a real server with some queues under a load.

    .venv/bin/python -m tests.support.screenshots docs/ [seconds of load, 60 by default]

The server gets a few queues: `jobs` with a fanout child and an error queue, `emails` fed through
an alias, `events` in Kestrel 3's format with two fanout readers, and `billing`, whose journal is
damaged before the start so that it is refused. A producer and two consumers run for the given
seconds (some reads aborted until their items are poisoned) while the page of `events` is open;
then it and the overview are saved as `dashboard-queue.png` and `dashboard-overview.png`.
"""

from __future__ import annotations

import random
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

from tests.conftest import ServerProcess, wait_until
from tests.end_to_end.test_refused_queue import _addx
from tests.support.browser import chromium, start_browser
from tests.support.lines import exchange

CONFIG = {
    "queues": {
        "jobs": {"max_errors": 3, "error_queue": "failed_jobs"},
        "events": {"journal_format": "kestrel3", "default_journal_size": "1MB"},
    },
    "aliases": {"notify": {"destination_queues": ["emails"]}},
}


def damaged_queue(queue_path: Path) -> None:
    queue_path.mkdir(parents=True, exist_ok=True)
    (queue_path / "billing").write_bytes(_addx(b"invoice") + bytes([0x42]) + b"\x00" * 8 + _addx(b"lost?"))


def load(port: int, stop: threading.Event) -> None:
    """Puts to three queues at a rate that swells and ebbs, consumers a little slower, and some
    reliable reads of `jobs` aborted until their items move to its error queue; until `stop`."""
    rng = random.Random(7)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        exchange(s, b"get events+archive\r\n", b"END\r\n")  # its reader exists from the start
        exchange(s, b"get events+audit\r\n", b"END\r\n")
        tick = 0
        while not stop.is_set():
            tick += 1
            burst = int(40 + 35 * abs((tick % 60) - 30) / 30) + rng.randint(0, 10)
            for queue, count in (("jobs", burst), ("notify", burst // 3), ("events", burst * 2)):
                data = b"x" * rng.randint(40, 400)
                s.sendall((f"set {queue} 0 0 {len(data)}\r\n".encode() + data + b"\r\n") * count)
                exchange(s, b"", b"STORED\r\n" * count)
            gets = b"get jobs\r\n" * int(burst * 0.8) + b"get emails\r\n" * (burst // 4)
            gets += b"get events\r\n" * (burst * 2) + b"get events+audit\r\n" * burst
            s.sendall(gets)
            answered = b""
            while answered.count(b"END\r\n") < gets.count(b"\r\n"):
                answered += s.recv(1 << 20)
            if tick % 10 == 0:
                exchange(s, b"get jobs/open\r\n", b"END\r\n")
                exchange(s, b"get jobs/abort\r\n", b"END\r\n")
            time.sleep(0.1)


def take(out: Path, seconds: float) -> tuple[Path, Path]:
    found = chromium()
    if found is None:
        raise SystemExit("needs Debian's chromium and chromium-driver")
    with tempfile.TemporaryDirectory(prefix="kestrel-screenshots-") as work:
        srv = ServerProcess(Path(work), CONFIG)
        damaged_queue(srv.queue_path)
        srv.start()
        browser = start_browser(*found, str(Path(work) / "profile"))
        stop = threading.Event()
        producer = threading.Thread(target=load, args=(srv.memcache_port, stop))
        try:
            # The queue's page is open while the load runs: its history is kept while it asks.
            browser.open(f"http://127.0.0.1:{srv.admin_port}/#/queue/events")
            producer.start()
            time.sleep(seconds)
            overview, queue = out / "dashboard-overview.png", out / "dashboard-queue.png"
            wait_until(lambda: browser.shown("q-readers-panel"), "the page of events")
            browser.screenshot(queue)
            browser.open(f"http://127.0.0.1:{srv.admin_port}/")
            wait_until(lambda: "events" in browser.table_rows(), "the queues on the page")
            time.sleep(2)  # two polls: the rates of now
            browser.screenshot(overview)
            return overview, queue
        finally:
            stop.set()
            if producer.is_alive():
                producer.join()
            browser.driver.quit()
            srv.stop()


if __name__ == "__main__":
    for path in take(Path(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 60.0):
        print(path)
