"""Instructions an item of the event loop thread under `sync_journal: always` with the commit log,
counted by valgrind's callgrind: a count that a busy machine does not move, where items/s and CPU
time do.

- `path`: the log's path without sockets, `bench_commit_log`'s 16 greenlets holding their
  acknowledgements as the server's connections do; the process runs twice, with `--items` and
  with 6 × `--items` each, and the difference of the main thread's instructions is divided by the
  difference of items (so start-up and the first rounds cancel out).
- `server`: the server itself (`always`, `commit_log: on`, Thrift) under 16 clients of
  bench/loadgen.c, put + get of 128 B (`--size`), one item at a time; callgrind counts only from the end of
  a warm-up to the end of `--seconds` of load (`callgrind_control -i on`, then a dump).
- `never`: the same server and load under `sync_journal: never`, the floor that the log's path
  adds to.

`--protocol memcache` drives the two server measurements over memcache (set + get) instead.

Each build named runs in turn (`--against DIR`: another version's build/compiled, or a src/ tree,
beside this checkout's compiled build), `--runs` times. Needs valgrind.

    .venv/bin/python -m bench.callgrind_log [--against DIR] [--runs 2] [--only path server never]
                                            [--size BYTES] [--protocol thrift|memcache]
"""

from __future__ import annotations

import argparse
import glob
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import loadgen, peers
from bench.common import free_port, load_average, machine

ROOT = Path(__file__).resolve().parent.parent
CLIENTS = 16
PATH_RUN = ("import logging, sys, tempfile, structlog; "
            "structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING)); "
            "from bench.bench_commit_log import run; "
            "print(run(tempfile.gettempdir(), 'always', True, True, int(sys.argv[1]))[3])")


def _main_thread_instructions(pattern: str) -> int:
    """The instructions of the process's first thread, from its callgrind file."""
    (path,) = glob.glob(pattern)
    with open(path) as f:
        for line in f:
            if line.startswith(("summary:", "totals:")):
                return int(line.split()[1])
    raise ValueError(f"{path} holds no total")


def _callgrind(out: str, *extra: str) -> list[str]:
    return ["valgrind", "--tool=callgrind", "--separate-threads=yes", f"--callgrind-out-file={out}", *extra]


def path_instructions(build: Path, work: Path, items: int) -> tuple[float, float]:
    """Loop thread instructions per item of the log's path without sockets, and rounds per item."""
    counts = []
    rounds = 0.0
    for n in (items, 6 * items):
        out = str(work / f"path-{n}.%p")
        env = dict(os.environ, PYTHONPATH=f"{build}{os.pathsep}{ROOT}")
        done = subprocess.run([*_callgrind(out), sys.executable, "-c", PATH_RUN, str(n)], env=env,
                              capture_output=True, text=True, check=True)
        rounds = float(done.stdout.split()[-1])
        counts.append(_main_thread_instructions(str(work / f"path-{n}.*-01")))
    return (counts[1] - counts[0]) / (5 * items * CLIENTS), rounds


def server_instructions(build: Path, work: Path, binary: Path, sync: str, seconds: float,
                        size: int = 128, protocol: str = "thrift") -> float:
    """Loop thread instructions per item of the server under the clients' load over `protocol`."""
    home = Path(tempfile.mkdtemp(prefix=f"server-{sync}-", dir=work))
    port = free_port()
    ports = {"thrift": 0, "memcache": 0, protocol: port}
    config = home / "kestrel.yaml"
    config.write_text(f"queue_path: {home / 'queues'}\nlisten_address: 127.0.0.1\n"
                      f"thrift_port: {ports['thrift']}\nmemcache_port: {ports['memcache']}\n"
                      f"text_port: 0\nadmin_port: 0\ncommit_log: on\n"
                      f"default_queue:\n  sync_journal: {sync}\n")
    out = str(home / "server.%p")
    command = [*_callgrind(out, "--instr-atstart=no"), sys.executable, "-m", "kestrel", "serve",
               "--config", str(config), "--log-level", "warning"]
    with open(home / "server.log", "wb") as log:
        proc = subprocess.Popen(command, env=dict(os.environ, PYTHONPATH=str(build)), stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300  # the interpreter starts slowly under valgrind
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the server did not start: see {home / 'server.log'}") from None
                time.sleep(1)
        loadgen.run(binary, protocol, port, clients=CLIENTS, seconds=5, size=size, prefix="durable",
                    timeout=600)
        subprocess.run(["callgrind_control", "-i", "on", str(proc.pid)], check=True, capture_output=True)
        result = loadgen.run(binary, protocol, port, clients=CLIENTS, seconds=seconds, size=size,
                             prefix="durable", timeout=600, warm_up=False)
        subprocess.run(["callgrind_control", "-d", str(proc.pid)], check=True, capture_output=True)
    finally:
        proc.terminate()
        proc.wait(120)
    return _main_thread_instructions(str(home / f"server.{proc.pid}.1-01")) / result.items


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", type=Path,
                        help="another version's build/compiled or src/, as `before`")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--items", type=int, default=40,
                        help="items each greenlet moves in `path`'s shorter run")
    parser.add_argument("--seconds", type=float, default=15, help="of load counted on the server")
    parser.add_argument("--size", type=int, default=128,
                        help="bytes of each item the clients put (default 128)")
    parser.add_argument("--only", nargs="+", choices=("path", "server", "never"),
                        default=["path", "server", "never"])
    parser.add_argument("--protocol", choices=("thrift", "memcache"), default="thrift",
                        help="the clients' protocol in `server` and `never` (default thrift)")
    args = parser.parse_args()
    builds = {"compiled": peers.build_path("compiled")}
    if args.against is not None:
        builds["before"] = args.against.resolve()
    print(f"# instructions of the event loop thread an item of {args.size} B (callgrind, {args.protocol}), "
          f"{time.strftime('%Y-%m-%d %H:%M %Z')}, {machine()}, load {load_average()}\n")
    print("| run | build | the log's path without sockets (rounds/item) | the server, `always` with the log "
          "| the server, `never` |")
    print("| --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory(prefix="callgrind-log-") as scratch:
        work = Path(scratch)
        binary = loadgen.build(work)
        for run in range(1, args.runs + 1):
            for name, build in builds.items():
                cells = []
                if "path" in args.only:
                    per_item, rounds = path_instructions(build, Path(tempfile.mkdtemp(dir=work)), args.items)
                    cells.append(f"{per_item:,.0f} ({rounds:.3f})")
                else:
                    cells.append("")
                for sync in ("always", "never"):
                    if ("server" if sync == "always" else "never") not in args.only:
                        cells.append("")
                        continue
                    count = server_instructions(build, work, binary, sync, args.seconds, args.size,
                                                args.protocol)
                    cells.append(f"{count:,.0f}")
                print(f"| {run} | {name} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
