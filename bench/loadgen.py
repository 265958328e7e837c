"""Building and driving loadgen.c, the C load generator every server benchmark uses.

The source ships in bench/ and is compiled with the machine's C compiler into the caller's work
directory, so a clone needs nothing but `cc`. One run prints one JSON line, parsed into a LoadResult.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).resolve().with_name("loadgen.c")


class LoadgenError(Exception):
    """Raised when the load generator cannot be built, or a run reports an error or a lost item."""


def compiler() -> str:
    """The C compiler's path, installing gcc with apt-get when running as root on Debian."""
    found = shutil.which("cc") or shutil.which("gcc")
    if found is None and os.geteuid() == 0 and shutil.which("apt-get"):
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", "gcc", "libc6-dev"], env=env, capture_output=True)
        found = shutil.which("cc") or shutil.which("gcc")
    if found is None:
        raise LoadgenError("no C compiler to build bench/loadgen.c (Debian: apt-get install gcc)")
    return found


def build(work: Path) -> Path:
    """Compile loadgen.c into `work` and return the binary's path."""
    binary = Path(work) / "loadgen"
    done = subprocess.run([compiler(), "-O2", "-o", str(binary), str(SOURCE), "-lm"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise LoadgenError(f"building {SOURCE.name} failed:\n{done.stderr}")
    return binary


@dataclass(frozen=True)
class LoadResult:
    """What one run reports: items put and taken back, the rate, and latency per request kind in µs."""

    protocol: str
    clients: int
    batch: int
    size: int
    put: int
    items: int
    wrong: int
    seconds: float
    items_per_s: float
    latency_us: dict[str, dict[str, float]]

    def p(self, request: str, percentile: str) -> float:
        """A latency percentile ("p50", "p99", ...) of one request kind ("put", "get", "ack", "round")."""
        return self.latency_us[request][percentile]


def run(binary: Path, protocol: str, port: int, *, clients: int = 4, processes: int = 0, batch: int = 1,
        size: int = 128,
        seconds: float = 0.0, items: int = 0, auto_abort_ms: int = 0, open_reads: bool = False,
        pipelined: bool = False,
        prefix: str = "loadgen", timeout: float = 120.0, queues: int = 0, fill: int = 0,
        warm_up: bool = True) -> LoadResult:
    """Run the generator for `seconds`, or for `items` per client; raise LoadgenError if anything failed.

    protocol is one of thrift, memcache, redis, beanstalk. `auto_abort_ms` makes Thrift gets open
    reads that are then confirmed; `open_reads` makes memcache gets reliable reads (`get q/open`,
    then `get q/close`, one item a round); `pipelined` makes Redis send a batch as single-item commands;
    `processes` spreads the clients' connections over that many processes, each driving its share
    on one event loop (0: a process each); `queues` makes the clients share that many queues (0: one
    each); `fill` leaves that many items in each queue first (thrift, memcache, redis); without
    `warm_up` no round precedes the timed ones (the queues are an earlier run's).
    """
    args = [str(binary), protocol, str(port), "-c", str(clients), "-b", str(batch), "-s", str(size),
            "-q", prefix, "-j"]
    if processes:
        args += ["-p", str(processes)]
    if seconds:
        args += ["-t", str(seconds)]
    if items:
        args += ["-n", str(items)]
    if auto_abort_ms:
        args += ["-a", str(auto_abort_ms)]
    if open_reads:
        args.append("-o")
    if pipelined:
        args.append("-P")
    if queues:
        args += ["-Q", str(queues)]
    if fill:
        args += ["-F", str(fill)]
    if not warm_up:
        args.append("-W")
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if not done.stdout.strip():
        raise LoadgenError(f"loadgen {protocol} on port {port} printed nothing: {done.stderr.strip()}")
    fields = json.loads(done.stdout)
    failed = fields.pop("failed_clients")
    result = LoadResult(**fields)
    if done.returncode != 0:
        raise LoadgenError(f"loadgen {protocol} on port {port}: {failed} clients failed, "
                           f"{result.items} of {result.put} items back, {result.wrong} wrong: "
                           f"{done.stderr.strip()}")
    return result
