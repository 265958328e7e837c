"""What the benchmark scripts share: free ports, waiting for a listener, the machine's description,
a process's CPU time and system calls."""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

from tests.support.threads import thread_files


def free_port() -> int:
    """A port nothing listens on, from this process's own block below the ephemeral range, as the
    tests pick theirs (tests/conftest.py): a port from the ephemeral range (`bind` to port 0) can be
    taken by any client's connection before the server binds it, which a loaded machine running
    suites and load generators beside does."""
    from tests.conftest import free_port as tests_free_port

    return tests_free_port()


def wait_port(port: int, timeout: float = 60, alive: Callable[[], str | None] = lambda: None) -> None:
    """Wait until something listens on `port`; RuntimeError after `timeout`, or as soon as `alive`
    says why the server meant to listen there is gone (a loaded machine may take many seconds to
    start one, so the timeout is generous)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return
        gone = alive()
        if gone is not None:
            raise RuntimeError(f"nothing listens on {port}: {gone}")
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port} after {timeout:g} s")


def machine() -> str:
    """Cores, CPU model, kernel and Python, and how fast this boot runs (`speed`), for the header of
    every table."""
    cpu = "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "?")
    return (f"{os.cpu_count()} cores, {cpu}, Linux {platform.release()}, Python {platform.python_version()}, "
            f"{speed()}")


class _Step:
    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0

    def bump(self, table: dict[int, int], key: int) -> None:
        self.count += table.get(key, 1)


def speed(steps: int = 200_000, round_trips: int = 2_000) -> str:
    """How fast this boot of the machine runs what a server's item costs, where the same model name
    has run Python at a third of another boot's speed (bench/README.md, Method): an interpreted
    step (a method call, an attribute, a dict look-up: ns, the best of three loops), and a byte's
    round trip over a socket pair to a child process and back (µs, the median), which wakes the
    other process each way as a reply wakes its client."""
    step, table = _Step(), {1: 1}
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        for _ in range(steps):
            step.bump(table, 1)
        best = min(best, time.perf_counter() - started)
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the child echoes each byte until its end of the pair closes
        try:
            ours.close()
            while theirs.recv(1):
                theirs.send(b"x")
        finally:
            os._exit(0)
    theirs.close()
    took = []
    try:
        for _ in range(round_trips):
            started = time.perf_counter()
            ours.send(b"x")
            ours.recv(1)
            took.append(time.perf_counter() - started)
    finally:
        ours.close()
        os.waitpid(pid, 0)
    took.sort()
    return (f"an interpreted step {best / steps * 1e9:.0f} ns, a round trip between two processes "
            f"{took[len(took) // 2] * 1e6:.0f} µs")


def load_average() -> str:
    """The 1, 5 and 15-minute load averages: how busy the shared machine was around a run."""
    one, five, fifteen = os.getloadavg()
    return f"{one:.1f} {five:.1f} {fifteen:.1f} on {os.cpu_count()} cores"


def stat_fields(stat: str) -> tuple[str, list[str]]:
    """A `/proc/.../stat` text's command name and the fields after it (the name, in parentheses,
    may hold spaces and parentheses): [0] the state, [1] the parent, [11] and [12] the user and
    system CPU ticks, [13] and [14] those of the children waited for."""
    name, rest = stat.split("(", 1)[1].rsplit(")", 1)
    return name, rest.split()


def stat_cpu_seconds(fields: list[str]) -> float:
    """User plus system CPU seconds of `stat_fields`' fields."""
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid: int) -> float:
    """User plus system CPU time of process `pid` and all its threads so far (from /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        return stat_cpu_seconds(stat_fields(f.read())[1])


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    """Each thread's CPU seconds so far (user + system), by thread id (the event loop's is `pid`)."""
    stats = thread_files(pid, "stat")
    return {thread: stat_cpu_seconds(stat_fields(stat)[1]) for thread, stat in stats.items()}


def bind_threads(pid: int, cpus: set[int]) -> None:
    """Every thread of process `pid` to `cpus`; a thread that ends between the listing and its
    binding is passed over."""
    for thread in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(thread), cpus)
        except ProcessLookupError:  # ended meanwhile
            continue


def threads_cpu_seconds(pid: int, names: tuple[str, ...]) -> float:
    """CPU time so far of the threads of process `pid` whose names start with one of `names` (from
    /proc: a thread's name is cut to 15 characters)."""
    named = (stat_fields(stat) for stat in thread_files(pid, "stat").values())
    return sum(stat_cpu_seconds(fields) for name, fields in named if name.startswith(names))


def tree_cpu_seconds(pid: int) -> tuple[float, float]:
    """CPU time of process `pid` alone (all its threads), and of `pid` with every process under it,
    those still running and those ended and waited for: user plus system, from /proc. Differences of
    the second over a span count descendants that came and went within it too."""
    tick = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    times: dict[int, tuple[int, int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = stat_fields(f.read())[1]
        except OSError:  # ended meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
        times[int(entry)] = (int(fields[11]) + int(fields[12]), int(fields[13]) + int(fields[14]))
    own = times.get(pid, (0, 0))[0]
    total, todo = 0, [pid]
    while todo:
        at = todo.pop()
        total += sum(times.get(at, (0, 0)))
        todo += children.get(at, [])
    return own / tick, total / tick


@contextlib.contextmanager
def syscall_counts(pid: int, calls: tuple[str, ...]) -> Iterator[dict[str, int]]:
    """Count the system calls `calls` of process `pid` and all its threads (new ones too) while the
    block runs, by the kernel's tracepoints (`perf stat`), which hardly slow the process: the dict
    yielded is filled when the block ends, "all" holding every system call. It stays empty when
    `perf` is not installed or the tracepoints are unavailable."""
    counts: dict[str, int] = {}
    perf = shutil.which("perf")
    if perf is None:
        yield counts
        return
    events = ",".join(["raw_syscalls:sys_enter", *(f"syscalls:sys_enter_{call}" for call in calls)])
    with tempfile.NamedTemporaryFile("r", suffix=".csv") as out:
        counter = subprocess.Popen([perf, "stat", "-x", ",", "-e", events, "-p", str(pid), "-o", out.name],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.5)  # perf attaches in the background
        try:
            yield counts
        finally:
            counter.send_signal(signal.SIGINT)
            counter.wait(10)
        for line in out.read().splitlines():
            fields = line.split(",")
            if len(fields) > 2 and fields[0].strip().isdigit():
                counts[fields[2].rsplit("sys_enter", 1)[-1].lstrip("_") or "all"] = int(fields[0])


def filled_queue(directory: str, name: str, count: int, settings: dict[str, str]) -> tuple[Any, Any]:
    """A queue collection loaded from `directory` (every queue with `settings`) and its queue `name`
    given `count` items of 128 B, one put each: the storage's own state for the benchmarks that
    time reading them back. Imported late, so that a child runs the tree its PYTHONPATH names."""
    from kestrel.storage import QueueCollection, QueueConfigs

    coll = QueueCollection(directory, QueueConfigs(settings))
    coll.load()
    queue = coll.queue(name)
    data = [b"s" * 128]
    for _ in range(count):
        queue.put(data)
    return coll, queue

