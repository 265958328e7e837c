"""What limits `sync_journal: always` under 16 producers: our server's fsync cycle beside Redis's
`appendfsync always`, from the kernel's system call tracepoints (`perf record`, which hardly slows
a server, unlike `strace`).

Each server runs in turn under bench/loadgen.c's 16 durable clients (Thrift put + get of 128 B for
ours, with the commit log; RPUSH + LPOP for Redis). From the trace, over the middle of the run:

- fsyncs a second, their duration, and the gap from one's end to the next one's start; the
  share of the time some fsync runs (the disk's busy fraction);
- the event loop thread's share of the time blocked in `epoll_wait` (Redis's loop is blocked in
  its `fdatasync` instead: it fsyncs on the loop);
- each cycle's phases on the loop thread, medians: from an fsync's end to the first reply, the
  burst of replies, from there to the log's write (or Redis's fsync), and from that write to the
  fsync's start on our fsync thread;
- replies a cycle; and, from a run just before without the trace (which adds to the traced
  server's CPU), items/s and CPU per item: the server (its event loop thread apart), the clients
  (their rusage), and the machine's idle share while it ran (`/proc/stat`): near 0, the 2 cores are
  the limit and items/s follows the CPU an item costs everyone.

    .venv/bin/python -m bench.fsync_cycle [--seconds 3] [--runs 2] [--build compiled|pure]
"""

from __future__ import annotations

import argparse
import bisect
import resource
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench import loadgen, peers
from bench.common import load_average, machine, process_cpu_seconds, thread_cpu_seconds

CLIENTS = 16
EVENTS = ("fdatasync", "fsync", "epoll_wait", "sendto", "write", "pwrite64", "recvfrom", "read")


@dataclass(frozen=True)
class Call:
    """One system call's entry or exit, as `perf script` prints it."""

    at: float
    tid: int
    name: str  # e.g. "sys_enter_fdatasync"


def _idle_ticks() -> tuple[int, int]:
    """The machine's idle and total CPU ticks so far."""
    with open("/proc/stat") as f:
        ticks = [int(value) for value in f.readline().split()[1:]]
    return ticks[3] + ticks[4], sum(ticks)


def _trace(path: Path) -> list[Call]:
    script = subprocess.run(["perf", "script", "-i", str(path), "-F", "tid,time,event"],
                            capture_output=True, text=True, check=True).stdout
    calls = []
    for line in script.splitlines():
        parts = line.split()
        if len(parts) >= 3:
            name = parts[2].rstrip(":").split(":")[-1]
            calls.append(Call(float(parts[1].rstrip(":")), int(parts[0]), name))
    calls.sort(key=lambda call: call.at)
    return calls


def _median(values: Sequence[float]) -> float:
    return sorted(values)[len(values) // 2] if values else 0.0


def _percentile(values: Sequence[float], share: float) -> float:
    return sorted(values)[min(int(len(values) * share), len(values) - 1)] if values else 0.0


def measure(name: str, running: peers.Running, protocol: str, binary: Path, work: Path,
            seconds: float) -> None:
    """Run the clients against `running` under the tracepoints and print its row."""
    ours = protocol == "thrift"
    loadgen.run(binary, protocol, running[protocol], clients=CLIENTS, seconds=1, prefix="warm")
    # CPU from a run without the trace (which adds to the traced server's), then the traced run
    idle0, total0 = _idle_ticks()
    cpu0, threads0 = process_cpu_seconds(running.pid), thread_cpu_seconds(running.pid)
    clients0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    plain = loadgen.run(binary, protocol, running[protocol], clients=CLIENTS, seconds=seconds,
                        prefix="plain")
    clients1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu1, threads1 = process_cpu_seconds(running.pid), thread_cpu_seconds(running.pid)
    idle1, total1 = _idle_ticks()
    items = plain.items_per_s * plain.seconds
    loop_cpu = threads1.get(running.pid, 0.0) - threads0.get(running.pid, 0.0)
    clients_cpu = (clients1.ru_utime + clients1.ru_stime) - (clients0.ru_utime + clients0.ru_stime)

    data = work / f"{name}-{running.pid}.data"
    events = ",".join(f"syscalls:sys_{edge}_{call}" for call in EVENTS for edge in ("enter", "exit"))
    recorder = subprocess.Popen(
        ["perf", "record", "-q", "-e", events, "-p", str(running.pid), "-o", str(data)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.7)  # perf attaches in the background
    result = loadgen.run(binary, protocol, running[protocol], clients=CLIENTS, seconds=seconds,
                         prefix="durable")
    recorder.send_signal(signal.SIGINT)
    recorder.wait(30)

    calls = _trace(data)
    if not calls:
        print(f"| {name} | no trace (perf could not record the tracepoints) |")
        return
    start, end = calls[0].at + 1.0, calls[-1].at - 0.3  # the middle of the run
    fsyncs: list[tuple[float, float]] = []
    entered: dict[int, float] = {}
    for call in calls:
        if call.name in ("sys_enter_fdatasync", "sys_enter_fsync"):
            entered[call.tid] = call.at
        elif call.name in ("sys_exit_fdatasync", "sys_exit_fsync") and call.tid in entered:
            began = entered.pop(call.tid)
            if start <= began <= end:
                fsyncs.append((began, call.at))
    fsyncs.sort()
    if len(fsyncs) < 2:
        print(f"| {name} | fewer than two fsyncs traced |")
        return
    span = fsyncs[-1][1] - fsyncs[0][0]
    busy, reached = 0.0, fsyncs[0][0]  # the time some fsync runs (a checkpoint's run side by side)
    for began, ended in fsyncs:
        busy += max(ended - max(began, reached), 0.0)
        reached = max(reached, ended)
    durations = [(b - a) * 1e6 for a, b in fsyncs]
    gaps = [(fsyncs[i + 1][0] - fsyncs[i][1]) * 1e6 for i in range(len(fsyncs) - 1)]
    loop = [call for call in calls if call.tid == running.pid and start <= call.at <= end]
    blocked, since = 0.0, None
    for call in loop:
        if call.name == "sys_enter_epoll_wait":
            since = call.at
        elif call.name == "sys_exit_epoll_wait" and since is not None:
            blocked += call.at - since
            since = None
    reply = "sys_enter_sendto" if ours else "sys_enter_write"
    logged = ("sys_enter_pwrite64",) if ours else ("sys_enter_fdatasync", "sys_enter_fsync")
    times = [call.at for call in loop]
    to_first, burst, serving, hand_off, replies = [], [], [], [], []
    for (_, ended), (began, _) in zip(fsyncs, fsyncs[1:], strict=False):
        cycle = loop[bisect.bisect(times, ended):bisect.bisect(times, began)]
        sends = [call.at for call in cycle if call.name == reply]
        writes = [call.at for call in cycle if call.name in logged]
        if not sends:
            continue
        replies.append(len(sends) - (0 if ours else len(writes)))  # Redis writes its AOF with `write` too
        last = sends[0]
        for at in sends:  # the burst: replies less than 30 µs apart
            if at - last > 30e-6:
                break
            last = at
        to_first.append((sends[0] - ended) * 1e6)
        burst.append((last - sends[0]) * 1e6)
        if ours and writes:
            serving.append((writes[-1] - last) * 1e6)
            hand_off.append((began - writes[-1]) * 1e6)
        elif not ours:
            serving.append((began - last) * 1e6)
    print(f"| {name} | {plain.items_per_s:,.0f} ({result.items_per_s:,.0f}) "
          f"| {(cpu1 - cpu0) / items * 1e6:.1f} "
          f"({loop_cpu / items * 1e6:.1f}) | {clients_cpu / items * 1e6:.1f} "
          f"| {100 * (idle1 - idle0) / max(total1 - total0, 1):.0f}% "
          f"| {len(fsyncs) / span:,.0f} ({len(fsyncs) / span / result.items_per_s:.3f}) "
          f"| {_median(durations):.0f} / {_percentile(durations, 0.9):.0f} "
          f"| {_median(gaps):.0f} / {_percentile(gaps, 0.9):.0f} "
          f"| {100 * busy / span:.0f}% | {100 * blocked / (end - start):.0f}% "
          f"| {_median(to_first):.0f}, {_median(burst):.0f}, {_median(serving):.0f}, "
          f"{_median(hand_off):.0f} | {_median(replies):.0f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=3)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--build", choices=("compiled", "pure"), default="compiled")
    args = parser.parse_args()
    peers.ensure_command("perf", "linux-perf")
    print(f"# the fsync cycle under {CLIENTS} durable clients, {time.strftime('%Y-%m-%d %H:%M %Z')}, "
          f"{machine()}, load {load_average()}\n")
    print("| run | items/s (traced) | server CPU µs/item (loop thread) | clients CPU µs/item | machine idle "
          "| fsyncs/s (per item) | fsync µs p50 / p90 | gap µs p50 / p90 | fsync busy | loop in epoll_wait "
          "| cycle µs: to the first reply, reply burst, serving, write to fsync | replies a cycle |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory(prefix="fsync-cycle-") as scratch:
        work = Path(scratch)
        binary = loadgen.build(work)
        for run in range(1, args.runs + 1):
            with peers.kestrel(work, "always", "on", build=args.build) as ours:
                measure(f"{run}: ours ({args.build})", ours, "thrift", binary, work, args.seconds)
            with peers.redis(work, "always") as redis:
                measure(f"{run}: Redis", redis, "redis", binary, work, args.seconds)


if __name__ == "__main__":
    main()
