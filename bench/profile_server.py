"""Where the server's time goes under load: perf's on-CPU samples, py-spy's Python frames, /proc.

For each workload this starts our server (`sync_journal: never`; `always` for thrift-durable) and
drives it with bench/loadgen.c (4 clients; 16 for thrift-16, thrift-durable and thrift-durable-log, the last
with the commit log on; 128 B items). Over the first
window it reads the server's user and system CPU time from /proc and, when `perf` is installed,
records on-CPU call chains: kernel time is grouped by the system call that entered the kernel (send,
recv, the journal's write, ...), user time by the library it ran in (the Python interpreter,
thriftpy2's Cython codec, libc, gevent, the compiled request path), then by function. Over the second
window it samples Python stacks with `py-spy record` (blocking mode, so stacks are exact; it slows the
server somewhat; it sees no frame of a compiled module). py-spy samples wall time: a sample inside a
C call lands on the Python frame that made it, and time spent runnable but off the CPU (on a busy
machine, right after a send wakes a client) counts too, so its socket share is higher than perf's;
its split of the rest is the Python view.
Last, `strace -c` counts the system calls of 1,000 rounds from one client, and `perf stat` those
per item under the workload's own clients, while /proc gives the CPU per item of the event loop
thread and of the others (the fsync threads of the group commit) apart.

    .venv/bin/pip install py-spy
    .venv/bin/python -m bench.profile_server [--workload NAME] [--seconds 4] [--build compiled|pure]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import loadgen, peers
from bench.common import machine, stat_fields, syscall_counts, thread_cpu_seconds

WORKLOADS = {  # name: (port, loadgen options)
    "thrift": ("thrift", {"protocol": "thrift", "batch": 1}),
    "memcache": ("memcache", {"protocol": "memcache", "batch": 1}),
    "thrift-batch": ("thrift", {"protocol": "thrift", "batch": 100}),
    "thrift-batch-confirm": ("thrift", {"protocol": "thrift", "batch": 100, "auto_abort_ms": 10_000}),
    "thrift-16": ("thrift", {"protocol": "thrift", "batch": 1, "clients": 16}),  # thrift-durable's peer
    "thrift-durable": ("thrift", {"protocol": "thrift", "batch": 1, "clients": 16, "sync": "always"}),
    "thrift-durable-log": ("thrift", {"protocol": "thrift", "batch": 1, "clients": 16, "sync": "always",
                                      "commit_log": "on"}),
}

SYSCALL_ITEMS = 20_000  # each client's items while the system calls are counted

# Innermost frame's file → what the time is spent on; the first match wins.
# Threads off the event loop: a threadpool thread waiting for work, and the group commit's fsync
# threads (waiting, or in an fsync that the loop does not wait for): not the server's serving time.
IDLE_WORKER = re.compile(r"gevent/_threading\.py|^_serve \(.*storage/fsync/group_commit\.py")
EVENT_LOOP = "event loop: epoll wait and libev dispatch"
SOCKET = "socket send/recv (system calls)"
CATEGORIES = [
    (EVENT_LOOP, re.compile(r"gevent/hub\.py")),
    (SOCKET, re.compile(r"gevent/_socket|/socket\.py|^socket\.py|service/socket_io\.py")),
    ("journal write (os.write) and bookkeeping", re.compile(r"storage/(files|kestrel2/journal)\.py")),
    ("journal record codec", re.compile(r"storage/kestrel[23]/codec\.py")),
    ("Thrift codec and dispatch (thriftpy2)", re.compile(r"thriftpy2/")),
    ("session layer", re.compile(r"service/session/")),
    ("protocol handler (framing, parsing, replies)",
     re.compile(r"service/(thrift|memcache|buffered_connection|text)")),
    ("queue engine (queue, collection, items)", re.compile(r"storage/")),
    ("other server code (stats, status, config)", re.compile(r"service/")),
    ("gevent greenlets and waiting", re.compile(r"gevent/")),
    ("dataclass constructors (generated __init__)", re.compile(r"^<string>$")),
]
PERF_FRAME = re.compile(r"^\s*[0-9a-f]+ (?P<symbol>.*) \((?P<library>[^()]*)\)$")
SYSCALLS = {"send": "send (socket)", "sendto": "send (socket)", "sendmsg": "send (socket)",
            "recv": "recv (socket)", "recvfrom": "recv (socket)", "write": "write (journal file)",
            "epoll_wait": "epoll_wait (waiting for clients)", "fsync": "fsync", "fdatasync": "fsync"}
USER_LIBRARIES = [("kestrel__mypyc", "the compiled request path (mypyc)"),
                  ("libpython", "Python interpreter"), ("bin/python", "Python interpreter"),
                  ("thriftpy2", "thriftpy2 Cython codec"), ("greenlet", "greenlet switches"),
                  ("gevent", "gevent C (libev loop, Cython hub)"), ("libc.so", "libc (memcpy, malloc)"),
                  ("[unknown]", "unknown (no symbols)")]
FRAME = re.compile(r"^(?P<function>.*) \((?P<file>[^():]+)(:\d+)?\)$")


def py_spy() -> str:
    found = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if found is None:
        sys.exit("py-spy is missing: .venv/bin/pip install py-spy")
    return found


def cpu_seconds(pid: int) -> tuple[float, float]:
    """The process's (user, system) CPU seconds so far."""
    fields = stat_fields(Path(f"/proc/{pid}/stat").read_text())[1]
    ticks = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / ticks, int(fields[12]) / ticks


def cpu_by_thread(pid: int, before: dict[int, float], items: int) -> str:
    """CPU µs per item of the event loop thread and of the others together since `before`."""
    after = thread_cpu_seconds(pid)
    spent = {tid: seconds - before.get(tid, 0.0) for tid, seconds in after.items()}
    others = [seconds for tid, seconds in spent.items() if tid != pid and seconds > 0]
    return (f"server CPU per item by thread under load ({items:,} items, /proc): event loop "
            f"{spent.get(pid, 0.0) / items * 1e6:.1f} µs, other threads {sum(others) / items * 1e6:.1f} µs "
            f"({len(others)} of them)")


def read_stacks(raw: Path) -> list[tuple[list[str], int]]:
    """py-spy's raw output: one `outer;...;inner count` line per distinct stack."""
    stacks = []
    for line in raw.read_text().splitlines():
        frames, _, count = line.rpartition(" ")
        if frames:
            stacks.append((frames.split(";"), int(count)))
    return stacks


def category(frame: str) -> str:
    match = FRAME.match(frame)
    where = match["file"] if match else frame
    return next((name for name, pattern in CATEGORIES if pattern.search(where)), f"other ({where})")


def function(frame: str) -> str:
    match = FRAME.match(frame)
    return f"{match['function']} ({match['file']})" if match else frame


def report(stacks: list[tuple[list[str], int]], top: int) -> None:
    idle = sum(count for frames, count in stacks if IDLE_WORKER.search(frames[-1]))
    stacks = [(frames, count) for frames, count in stacks if not IDLE_WORKER.search(frames[-1])]
    total = sum(count for _, count in stacks) or 1
    by_category: collections.Counter[str] = collections.Counter()
    by_function: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    for frames, count in stacks:
        by_category[category(frames[-1])] += count
        by_function[function(frames[-1])] += count
        for name in {category(f) for f in frames}:
            inclusive[name] += count
    waiting = sum(by_category[name] for name in (SOCKET, EVENT_LOOP))
    rest = max(total - waiting, 1)
    print(f"  py-spy: {total} samples ({idle} more of threads off the event loop left out); by innermost "
          f"frame (self), anywhere on the stack (incl.), and self as a share of the samples outside socket "
          f"calls and the event loop (rest)")
    for name, count in by_category.most_common():
        share = "" if name in (SOCKET, EVENT_LOOP) else f"{100 * count / rest:5.1f}%  rest"
        print(f"    {100 * count / total:5.1f}%  self   {100 * inclusive[name] / total:5.1f}%  incl.  "
              f"{share:>11}  {name}")
    print(f"  top {top} functions (self):")
    for name, count in by_function.most_common(top):
        print(f"    {100 * count / total:5.1f}%  {name}")


def perf_stacks(pid: int, seconds: float, out: Path) -> list[list[tuple[str, str]]] | str:
    """On-CPU call chains (innermost first, as (symbol, library)) from `perf record`, or why none."""
    perf = shutil.which("perf")
    if perf is None:
        return "perf is not installed (Debian: apt-get install linux-perf); kernel time only from /proc"
    done = subprocess.run([perf, "record", "-e", "cpu-clock", "-F", "999", "-g", "-p", str(pid),
                           "-o", str(out), "--", "sleep", str(seconds)], capture_output=True, text=True)
    if done.returncode != 0:
        return f"perf record failed: {done.stderr.strip()[-300:]}"
    script = subprocess.run([perf, "script", "-i", str(out), "-F", "ip,sym,dso"], capture_output=True,
                            text=True)
    samples: list[list[tuple[str, str]]] = [[]]
    for line in script.stdout.splitlines():
        match = PERF_FRAME.match(line)
        if match:
            samples[-1].append((match["symbol"], match["library"]))
        elif not line.strip() and samples[-1]:
            samples.append([])
    return [s for s in samples if s]


def on_cpu_category(chain: list[tuple[str, str]]) -> str:
    """Kernel time by the system call that entered it; user time by the library it ran in."""
    symbol, library = chain[0]
    if library == "[kernel.kallsyms]":
        caller = next(((sym, lib) for sym, lib in chain if lib != "[kernel.kallsyms]"), None)
        if caller is None or caller[1] == "[unknown]":
            return "kernel: interrupts and scheduling outside a system call"
        call = re.sub(r"^(__GI_)?_*(libc_)?", "", caller[0])
        return f"kernel: {SYSCALLS.get(call, call)}"
    name = Path(library).name
    for pattern, label in USER_LIBRARIES:
        if pattern in library:
            return f"user: {label}"
    return f"user: {name}"


def report_on_cpu(chains: list[list[tuple[str, str]]], top: int) -> None:
    total = len(chains) or 1
    counts = collections.Counter(on_cpu_category(chain) for chain in chains)
    kernel = sum(n for name, n in counts.items() if name.startswith("kernel"))
    print(f"  perf, on-CPU samples: {len(chains)}; kernel {100 * kernel / total:.0f}%, "
          f"user {100 * (total - kernel) / total:.0f}%")
    for name, count in counts.most_common():
        if count / total >= 0.005:
            print(f"    {100 * count / total:5.1f}%  {name}")
    sends = [chain for chain in chains if on_cpu_category(chain) == "kernel: send (socket)"]
    for label, symbol in (("delivering to the client's socket (loopback receive path)", "tcp_v4_rcv"),
                          ("switching tasks (scheduler)", "__schedule")):
        inside = sum(any(sym == symbol for sym, _ in chain) for chain in sends)
        print(f"           of send, {100 * inside / total:4.1f}% of all samples is {label}")
    user = collections.Counter(f"{chain[0][0]} ({Path(chain[0][1]).name})" for chain in chains
                               if chain[0][1] != "[kernel.kallsyms]")
    print(f"  top {top} user-space functions (self, perf):")
    for name, count in user.most_common(top):
        print(f"    {100 * count / total:5.1f}%  {name}")


def syscalls_per_request(pid: int, binary: Path, port: int, options: dict[str, Any], work: Path) -> str:
    """System calls per request, counted by `strace -c` over 1,000 rounds of one client."""
    strace = shutil.which("strace")
    if strace is None:
        return "strace is not installed (Debian: apt-get install strace): no system call counts"
    counts = work / "strace.txt"
    tracer = subprocess.Popen([strace, "-c", "-f", "-p", str(pid), "-o", str(counts)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)  # strace attaches in the background
    rounds = 1000
    batch = int(options["batch"])
    loadgen.run(binary, str(options["protocol"]), port, clients=1, batch=batch, items=rounds * batch,
                auto_abort_ms=int(options.get("auto_abort_ms", 0)), prefix="strace")
    tracer.send_signal(signal.SIGINT)
    tracer.wait(10)
    requests = (rounds + 1) * (3 if options.get("auto_abort_ms") else 2)  # with the warm-up round
    calls = {}
    for line in counts.read_text().splitlines():
        fields = line.split()
        if len(fields) >= 5 and fields[0][0].isdigit() and fields[-1] != "total":
            calls[fields[-1]] = int(fields[3])
    listed = ", ".join(f"{name} {n / requests:.2f}" for name, n in sorted(calls.items(), key=lambda c: -c[1])
                       if n / requests >= 0.01)
    return f"system calls per request (strace -c, {requests} requests): {listed}"


TRACED_SYSCALLS = ("recvfrom", "sendto", "write", "pwrite64", "read", "epoll_wait", "getpid", "epoll_ctl",
                   "futex", "fdatasync")


def syscalls_per_item(pid: int, binary: Path, port: int, options: dict[str, Any]) -> str:
    """System calls per item under the workload's own clients (4 by default, 20,000 items each),
    counted by the kernel's tracepoints (`perf stat`), which hardly slow the server: under strace
    more requests are ready at each turn of the loop, so fewer turns are counted."""
    if shutil.which("perf") is None:
        return "perf is not installed: no system call counts under load"
    clients, batch = int(options.get("clients", 4)), int(options["batch"])
    items = SYSCALL_ITEMS // batch * batch
    with syscall_counts(pid, TRACED_SYSCALLS) as counts:
        loadgen.run(binary, str(options["protocol"]), port, clients=clients, batch=batch, items=items,
                    auto_abort_ms=int(options.get("auto_abort_ms", 0)), prefix="syscalls")
    if "all" not in counts:
        return "perf stat counted nothing (tracepoints unavailable?)"
    total = clients * items
    listed = ", ".join(f"{name} {n / total:.2f}" for name, n in counts.items() if name != "all" and n)
    return (f"system calls per item under load (perf stat, {clients} clients, {total:,} items): "
            f"{counts['all'] / total:.2f}: {listed}")


def profile(name: str, binary: Path, work: Path, seconds: float, rate: int, top: int, build: str) -> None:
    port_name, options = WORKLOADS[name]
    clients, sync = options.get("clients", 4), str(options.get("sync", "never"))
    commit_log = str(options.get("commit_log", "off"))
    with peers.kestrel(work, sync, commit_log, build=build) as server:
        load = subprocess.Popen(
            [str(binary), str(options["protocol"]), str(server[port_name]), "-c", str(clients), "-b",
             str(options["batch"]), "-a", str(options.get("auto_abort_ms", 0)), "-s", "128",
             "-t", str(2 * seconds + 2), "-q", name],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(0.5)
        cpu_before, wall_before = cpu_seconds(server.pid), time.monotonic()
        chains = perf_stacks(server.pid, seconds, work / f"{name}.perf")
        cpu_after, wall = cpu_seconds(server.pid), time.monotonic() - wall_before
        raw = work / f"{name}.raw"
        spy = subprocess.run([py_spy(), "record", "-p", str(server.pid), "-d", str(max(1, round(seconds))),
                              "-r", str(rate), "--format", "raw", "-o", str(raw)],
                             capture_output=True, text=True)
        out, err = load.communicate()
        syscalls = syscalls_per_request(server.pid, binary, server[port_name], options, work)
        threads_before = thread_cpu_seconds(server.pid)
        under_load = syscalls_per_item(server.pid, binary, server[port_name], options)
        batch = int(options["batch"])
        by_thread = cpu_by_thread(server.pid, threads_before, SYSCALL_ITEMS // batch * batch * int(clients))
    confirm = ", get with auto-abort + confirm" if options.get("auto_abort_ms") else ""
    print(f"\n## {name}: {clients} clients, batch {options['batch']}{confirm}, 128 B, "
          f"`sync_journal: {sync}`, `commit_log: {commit_log}`, the {build} build")
    load_line = out.strip().splitlines()[0] if out.strip() else err.strip()
    print(f"  load (the second half under py-spy): {load_line}")
    user, system = (after - before for after, before in zip(cpu_after, cpu_before, strict=True))
    kernel_share = 100 * system / max(user + system, 1e-9)
    print(f"  server CPU over {wall:.1f} s: user {100 * user / wall:.0f}%, system {100 * system / wall:.0f}% "
          f"of one core; the kernel's share of its CPU time is {kernel_share:.0f}%")
    if isinstance(chains, str):
        print(f"  {chains}")
    else:
        report_on_cpu(chains, top)
    print(f"  {syscalls}")
    print(f"  {under_load}")
    print(f"  {by_thread}")
    if spy.returncode != 0 or not raw.exists():
        print(f"  py-spy failed: {spy.stderr.strip()}")
        return
    report(read_stacks(raw), top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=sorted(WORKLOADS))
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--build", choices=sorted(peers.BUILDS), default="compiled",
                        help="our server's build (bench/peers.py; default compiled)")
    args = parser.parse_args()
    print(f"# server profile, {time.strftime('%Y-%m-%d %H:%M %Z')}, {machine()}")
    work = Path(tempfile.mkdtemp(prefix="kestrel-profile-"))
    try:
        binary = loadgen.build(work)
        for name in WORKLOADS:
            if args.workload in (None, name):
                profile(name, binary, work, args.seconds, args.rate, args.top, args.build)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
