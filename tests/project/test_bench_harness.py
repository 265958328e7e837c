"""The benchmark harness keeps working: loadgen.c builds here and reports exactly the items it moved."""

from __future__ import annotations

import re
import socket
from pathlib import Path
from typing import Any

import pytest
from pymemcache.client.base import Client

from bench import loadgen
from tests.conftest import free_port
from tests.support.system import tool
from tests.support.wire import memcache_stats


@pytest.fixture(scope="module")
def binary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tool("gcc")
    return loadgen.build(tmp_path_factory.mktemp("loadgen"))


def queue_stats(port: int, name: str) -> dict[str, int]:
    client = Client(("127.0.0.1", port))
    try:
        stats = client.stats()
    finally:
        client.close()
    prefix = f"queue_{name}_".encode()
    return {key[len(prefix):].decode(): int(value) for key, value in stats.items() if key.startswith(prefix)}


# (protocol, batch, Thrift auto-abort ms, memcache open reads)
VARIANTS = [("thrift", 1, 0, False), ("thrift", 7, 0, False), ("thrift", 5, 10_000, False),
            ("memcache", 1, 0, False), ("memcache", 3, 0, False), ("memcache", 1, 0, True)]


def test_loadgen_reports_the_items_it_moved(binary: Path, server_factory: Any) -> None:
    server = server_factory()
    for n, (protocol, batch, auto_abort_ms, open_reads) in enumerate(VARIANTS):
        port = server.thrift_port if protocol == "thrift" else server.memcache_port
        result = loadgen.run(binary, protocol, port, clients=2, batch=batch, items=21,
                             auto_abort_ms=auto_abort_ms, open_reads=open_reads, prefix=f"lg{n}_")
        rounds = -(-21 // batch)
        assert (result.put, result.items, result.wrong) == (2 * rounds * batch, 2 * rounds * batch, 0)
        assert result.items_per_s > 0 and result.seconds > 0
        assert result.latency_us["round"]["requests"] == 2 * rounds
        assert 0 < result.p("round", "p50") <= result.p("round", "p99") <= result.p("round", "max")
        assert ("ack" in result.latency_us) == (auto_abort_ms > 0 or open_reads)
        for client in (f"lg{n}_0", f"lg{n}_1"):  # the server saw the same: a warm-up round, then the rest
            stats = queue_stats(server.memcache_port, client)
            assert stats["total_items"] == (rounds + 1) * batch, (protocol, batch, stats)
            assert (stats["items"], stats["open_transactions"]) == (0, 0)


@pytest.mark.parametrize("protocol", ["memcache", "thrift"])
def test_loadgen_spreads_its_load_over_shared_queues_and_fills_them(binary: Path, server: Any,
                                                                   protocol: str) -> None:
    """-Q: 3 clients go round 10 queues (each its share, one a round); -F: each queue keeps its fill;
    -W: a later run makes no warm-up round."""
    port = server.memcache_port if protocol == "memcache" else server.thrift_port
    prefix = f"spread_{protocol}"
    result = loadgen.run(binary, protocol, port, clients=3, items=8, queues=10, fill=2, prefix=prefix)
    assert (result.put, result.items, result.wrong) == (24, 24, 0)
    stats = {q: queue_stats(server.memcache_port, f"{prefix}{q}") for q in range(10)}
    # Client 0 owns queues 0, 3, 6, 9 (8 rounds: two each), client 2 owns 2, 5, 8 (3, 3, 2).
    assert [stats[q]["total_items"] - 1 - 2 for q in (0, 3, 6, 9)] == [2, 2, 2, 2]
    assert [stats[q]["total_items"] - 1 - 2 for q in (2, 5, 8)] == [3, 3, 2]
    assert all(s["items"] == 2 for s in stats.values())  # the fill stays; each round takes what it puts
    again = loadgen.run(binary, protocol, port, clients=3, items=3, queues=10, warm_up=False, prefix=prefix)
    assert again.items == 9
    assert sum(queue_stats(server.memcache_port, f"{prefix}{q}")["total_items"] for q in range(10)) == \
        sum(s["total_items"] for s in stats.values()) + 9


@pytest.mark.parametrize("protocol", ["memcache", "thrift"])
def test_loadgen_drives_many_connections_from_a_few_processes(binary: Path, server: Any, protocol: str) -> None:
    """-p: 50 connections from 2 processes, each connection request/response on its own queue, every
    reply checked, the server seeing each connection's warm-up round and its rounds."""
    port = server.memcache_port if protocol == "memcache" else server.thrift_port
    prefix = f"many_{protocol}"
    before = int(memcache_stats(server.memcache_port)["total_connections"])
    result = loadgen.run(binary, protocol, port, clients=50, processes=2, batch=2, items=6, prefix=prefix)
    assert (result.put, result.items, result.wrong) == (300, 300, 0)
    assert result.latency_us["round"]["requests"] == 150
    assert int(memcache_stats(server.memcache_port)["total_connections"]) - before == 51  # and the stats'
    for client in range(50):
        stats = queue_stats(server.memcache_port, f"{prefix}{client}")
        assert (stats["total_items"], stats["items"]) == (8, 0), (client, stats)
    with pytest.raises(loadgen.LoadgenError, match=r"process \d: thrift put failed: queue name 'bad\.\d' contains"):
        loadgen.run(binary, "thrift", server.thrift_port, clients=4, processes=2, items=1, prefix="bad.")


@pytest.mark.parametrize("batch", [1, 7])
def test_the_minimal_gevent_server_moves_every_item_the_load_generator_puts(binary: Path, tmp_path: Path,
                                                                           batch: int) -> None:
    """The stack's floor, a peer of the benchmarks, answers loadgen's memcache rounds as a queue
    does (each get the item its client put), one request at a time and pipelined."""
    from bench import peers

    with peers.minimal_gevent(tmp_path) as floor:
        result = loadgen.run(binary, "memcache", floor["memcache"], clients=3, batch=batch, items=21)
    rounds = -(-21 // batch)
    assert (result.put, result.items, result.wrong) == (3 * rounds * batch, 3 * rounds * batch, 0)


def test_the_minimal_gevent_server_answers_requests_split_anywhere() -> None:
    """A request cut at any byte is answered once the rest arrives, and not before."""
    from bench.minimal_gevent_server import answer, queues

    requests = b"set split 0 0 5\r\nhello\r\nget split\r\nget split\r\nflush_all\r\n"
    expected = [b"STORED\r\n", b"VALUE split 0 5\r\nhello\r\nEND\r\n", b"END\r\n", b"ERROR\r\n"]
    for cut in range(len(requests) + 1):
        queues.clear()
        replies: list[bytes] = []
        left = answer(requests[:cut], replies)
        left = answer(left + requests[cut:], replies)
        assert (replies, left) == (expected, b""), cut


def test_loadgen_names_what_went_wrong(binary: Path, server: Any) -> None:
    with pytest.raises(loadgen.LoadgenError, match="connect to 127.0.0.1"):
        loadgen.run(binary, "thrift", free_port(), clients=1, items=1)
    with pytest.raises(loadgen.LoadgenError, match="thrift put failed: queue name 'bad.0' contains '.'"):
        loadgen.run(binary, "thrift", server.thrift_port, clients=1, items=1, prefix="bad.")
    with pytest.raises(loadgen.LoadgenError, match="memcache set: CLIENT_ERROR"):
        loadgen.run(binary, "memcache", server.memcache_port, clients=1, items=1, prefix="bad.")


def test_server_cpu_time_counts_every_thread_of_the_process() -> None:
    import os
    import threading
    import time

    from bench.common import process_cpu_seconds

    def spin() -> None:
        end = time.process_time() + 0.2
        while time.process_time() < end:
            pass

    before = process_cpu_seconds(os.getpid())
    worker = threading.Thread(target=spin)  # CPU burnt by another thread counts too
    worker.start()
    worker.join()
    assert process_cpu_seconds(os.getpid()) - before >= 0.15


def test_the_machine_header_names_the_boots_speed_and_leaves_no_child() -> None:
    import re

    from bench.common import machine
    from tests.support.threads import thread_files

    def children() -> set[str]:
        return {child for listed in thread_files("self", "children").values() for child in listed.split()}

    before = children()
    header = machine()
    figures = re.search(r"an interpreted step (\d+) ns, a round trip between two processes (\d+) µs$", header)
    assert figures is not None, header
    assert int(figures[1]) > 0 and int(figures[2]) >= 0
    assert not children() - before  # the echoing child was waited for (another test's may have ended)


def test_thread_cpu_time_counts_the_named_threads_alone() -> None:
    import ctypes
    import os
    import threading
    import time

    from bench.common import threads_cpu_seconds

    spun, measured = threading.Event(), threading.Event()

    def spin() -> None:
        ctypes.CDLL(None).prctl(15, b"bench-spinner")  # PR_SET_NAME: the name /proc shows
        end = time.thread_time() + 0.2
        while time.thread_time() < end:
            pass
        spun.set()
        measured.wait()  # a thread's time is read while it lives

    pid = os.getpid()
    before, others_before = threads_cpu_seconds(pid, ("bench-spin",)), threads_cpu_seconds(pid, ("C2 Compiler",))
    worker = threading.Thread(target=spin)
    worker.start()
    spun.wait()
    spent = threads_cpu_seconds(pid, ("bench-spin",)) - before
    measured.set()
    worker.join()
    assert spent >= 0.1
    assert threads_cpu_seconds(pid, ("C2 Compiler",)) == others_before


def test_binding_a_servers_threads_passes_over_one_that_ended(monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread listed in /proc that has ended by its binding (a server's fsync or pool thread) is
    passed over; the others are bound. The ended thread's id is one past `pid_max`, which no task
    holds: a real ended thread's id may be taken at once by another task on a busy machine."""
    import os

    from bench import common

    with open("/proc/sys/kernel/pid_max") as f:
        ended = int(f.read()) + 1
    pid, cpus = os.getpid(), os.sched_getaffinity(0)
    listdir = os.listdir
    monkeypatch.setattr(common.os, "listdir",
                        lambda path: [str(ended), *listdir(path)] if path.endswith("/task") else listdir(path))
    bound: list[int] = []
    setaffinity = os.sched_setaffinity

    def recorded(thread: int, to: set[int]) -> None:
        setaffinity(thread, to)
        bound.append(thread)

    monkeypatch.setattr(common.os, "sched_setaffinity", recorded)
    common.bind_threads(pid, cpus)
    assert pid in bound and ended not in bound


@pytest.mark.parametrize("figure", ["hang-up", "tiny-frame", "thread-wake", "end-waits"])
def test_responsiveness_figures_are_measured(figure: str, tmp_path: Path) -> None:
    """Each kind of figure of bench/bench_responsiveness.py (over a server, in this process) still runs;
    how it compares with its budget is the benchmark's business, not a test's."""
    from bench.bench_responsiveness import FIGURES

    seconds, budget = FIGURES[figure](tmp_path)
    assert seconds >= 0 and budget > 0


def test_the_serve_loop_benchmark_answers_every_request() -> None:
    from bench.bench_answer import measure_loop

    measured = measure_loop(50)  # raises unless each connection sent a reply to every request
    assert list(measured) == ["thrift", "memcache"] and all(us > 0 for us in measured.values())
    reliable = measure_loop(50, reliable=True)  # raises too unless each read was confirmed
    assert list(reliable) == ["thrift", "memcache"] and all(us > 0 for us in reliable.values())
    spread = measure_loop(50, queues=7)  # round 7 queues, each holding an item first
    assert list(spread) == ["thrift", "memcache"] and all(us > 0 for us in spread.values())


def test_servers_taking_turns_under_labels_in_words_each_serve_their_runs(binary: Path, server: Any) -> None:
    """Labels such as "pure, `commit_log: on`" name the rows only: the clients' queue names come
    from each server's place in the turns, which a queue name may hold."""
    from bench import peers
    from bench.bench_servers import Bench

    assert server.proc is not None
    running = peers.Running(server.proc.pid, {"thrift": server.thrift_port}, Path("."))
    bench = Bench(binary, seconds=0.2, repeat=1)
    measured = bench.alternate("thrift", {"pure, `commit_log: on`": running, "compiled, `commit_log: off`": running},
                               "thrift", "turns", clients=2)
    assert all(m is not None and m.load.items > 0 and m.load.wrong == 0 for m in measured.values()), measured


SYNCING = """
import os, sys, threading
fd = os.open(sys.argv[1], os.O_CREAT | os.O_WRONLY)
sys.stdin.readline()
def sync() -> None:
    for _ in range(7):
        os.fdatasync(fd)
thread = threading.Thread(target=sync)  # a thread started after the count began counts too
thread.start()
thread.join()
for _ in range(3):
    os.fsync(fd)
print("done", flush=True)
sys.stdin.readline()
"""


def test_fsyncs_are_counted_in_every_thread_of_a_server(tmp_path: Path) -> None:
    import subprocess
    import sys

    from bench.common import syscall_counts

    tool("perf", "linux-perf")
    proc = subprocess.Popen([sys.executable, "-c", SYNCING, str(tmp_path / "file")], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    try:
        with syscall_counts(proc.pid, ("fsync", "fdatasync")) as counts:
            proc.stdin.write("go\n")
            proc.stdin.flush()
            assert proc.stdout.readline() == "done\n"
    finally:
        proc.stdin.close()
        proc.wait(10)
    if "all" not in counts:
        pytest.skip("perf stat cannot count the kernel's system call tracepoints here")
    assert (counts["fdatasync"], counts["fsync"]) == (7, 3)


# The quick run of every aim takes about a minute (at a load of 15 on two cores), and longer still on a
# busier machine; cut by the suite's timeout of a test (300 s), it would say nothing of where it was.
AIMS_TIMEOUT_S = 900


@pytest.mark.slow
@pytest.mark.timeout(AIMS_TIMEOUT_S + 60)
def test_the_aims_table_has_every_row_with_its_peers() -> None:
    """`bench_aims --quick` runs every aim's measurement and prints one table: each row of the aims
    with its figures and its peers'. Its ratios are the benchmark's business, not a test's.

    Nothing here depends on the machine's speed but the time the run takes: the run has its own
    deadline, within the test's, and a failure shows what the run printed last."""
    import os
    import signal
    import subprocess
    import sys

    from bench.bench_aims import COLUMNS

    for command, package in (("gcc", "gcc"), ("beanstalkd", "beanstalkd"), ("redis-server", "redis-server"),
                             ("memcached", "memcached")):
        tool(command, package)
    # A session of its own, so that a run past its deadline is stopped with the servers it started.
    run = subprocess.Popen([sys.executable, "-m", "bench.bench_aims", "--quick", "--builds", "pure"],
                           cwd=Path(__file__).resolve().parents[2], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = run.communicate(timeout=AIMS_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGKILL)
        stdout, stderr = run.communicate()
        pytest.fail(f"bench_aims --quick ran past {AIMS_TIMEOUT_S} s; it printed last:\n"
                    f"{stdout[-3000:]}\n{stderr[-3000:]}")
    assert run.returncode == 0, f"bench_aims --quick failed:\n{stdout[-3000:]}\n{stderr[-3000:]}"
    assert "### The aims\n" in stdout, f"bench_aims --quick printed no table:\n{stdout[-3000:]}"
    table = stdout.split("### The aims\n", 1)[1].strip().splitlines()
    header, rule, *rows = (line for line in table if line.startswith("|"))
    assert header == f"| {' | '.join(COLUMNS)} |" and rule.count("---") == len(COLUMNS), (header, rule)
    cells = [[cell.strip() for cell in line.strip("|").split(" | ")] for line in rows]
    assert all(len(row) == len(COLUMNS) for row in cells), rows
    by_workload = {row[0]: row for row in cells}
    expected = {
        "Thrift single items, 4 clients (pure)": ("beanstalkd -F", "Redis"),
        "memcache single items, 4 clients (pure)": ("beanstalkd -F", "Redis"),
        "Thrift batches of 100 (pure)": ("Redis RPUSH of 100 values",),
        "`always`, 16 producers, `commit_log: on` (the default) (pure)": ("Redis appendfsync always", "beanstalkd -f0"),
        "`always`, 16 producers, `commit_log: off` (pure)": ("Redis appendfsync always", "beanstalkd -f0"),
        "200 filled queues against 4, memcache (pure)": ("Redis",),
        "200 filled queues against 4, Thrift (pure)": ("Redis",),
        "an idle server holding 200 queues (pure)": ("Redis",),
        "memcache single items beside the stack's floor (pure)": ("a minimal gevent server",),
        "20 connections against 4, memcache (pure)": ("memcached", "Redis", "a minimal gevent server"),
        "accepting and closing a connection (pure)": ("Redis", "a minimal gevent server"),
        **{f"{size} items, {protocol} (pure)": ("Redis",) for size in ("1 KB", "64 KB")
           for protocol in ("Thrift", "memcache")},
    }
    assert sorted(by_workload) == sorted(expected)
    for workload, names in expected.items():
        _, ours, peers, *_ = by_workload[workload]
        found = peers.split("; ")
        assert len(found) == len(names) and all(map(str.startswith, found, names)), (workload, peers)
        # A run that failed printed why ("  ! ...") to its error output.
        assert "failed" not in ours and "failed" not in peers, (workload, ours, peers, stderr[-3000:])
    assert all(row[5] in ("met", "not met", "-") for row in cells), rows
    copies = [row for row in cells if " KB items" in row[0]]
    assert all(row[3].startswith("copies: ") for row in copies), copies


def test_the_aims_over_several_runs_count_where_each_was_met(capsys: pytest.CaptureFixture[str]) -> None:
    """`bench_aims --runs N` ends with each aim's row over the runs: in how many it was met (of those
    that judged it: a failed run or a row with no aim of its own judges nothing), each run's ratios."""
    from bench.bench_aims import Row, print_over_runs

    def runs_of(always: bool | None, ratio: str) -> list[Row]:
        return [Row("`always`", "1 (2)", ("Redis 1 (2)",), ratio, "≥1.0× Redis", always),
                Row("log off", "1 (2)", ("Redis 1 (2)",), "0.40× Redis", "(the aim is the default's)", None)]

    print_over_runs([runs_of(True, "1.01× Redis"), runs_of(False, "0.90× Redis"), runs_of(None, "-")])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == "### The aims over 3 runs"
    assert lines[-2:] == ["| `always` | ≥1.0× Redis | 1 of 2 | 1.01× Redis / 0.90× Redis / - |",
                          "| log off | (the aim is the default's) | - | 0.40× Redis / 0.40× Redis / 0.40× Redis |"]


@pytest.mark.parametrize("protocol", ["binary", "compact"])
def test_the_hostile_neighbours_frames_are_as_large_as_the_limits_let_through(server_factory: Any,
                                                                              protocol: str) -> None:
    """bench_fairness measures a light client beside the largest frames a server reads: each must
    be answered, not refused by a limit (a refusal is cheap and would measure nothing)."""
    from bench import hostile
    from tests.support.thrift_wire import encode_call, framed, read_framed_reply

    srv = server_factory({"thrift_protocol": protocol})
    with socket.create_connection(("127.0.0.1", srv.thrift_port), timeout=60) as s:
        s.sendall(framed(encode_call(protocol, "get_version")))
        version = read_framed_reply(s, protocol, "get_version")
        assert isinstance(version, str)
        for kind, message in hostile.thrift_frames(protocol).items():
            s.sendall(framed(message))
            assert read_framed_reply(s, protocol, "get_version") == version, kind


def test_the_journal_files_figure_appends_to_each_file_and_leaves_none(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """bench_scale's `files`: a system time for 4 files and for `--queues`, each file written; the
    folder it wrote in is gone after."""
    import argparse

    from bench.bench_scale import RECORD, appends, journal_files

    args = argparse.Namespace(queues=7, repeat=1, dir=tmp_path)
    figures = journal_files(tmp_path, args)
    assert sorted(figures) == [4, 7] and all(seconds >= 0 for seconds in figures.values())
    assert list(tmp_path.iterdir()) == []
    assert "| 7 |" in capsys.readouterr().out
    appends(tmp_path, args)  # in a folder kept: each file holds whole records, the same count
    sizes = {path.stat().st_size for path in (tmp_path / "7").iterdir()}
    assert len(sizes) == 1 and sizes.pop() % RECORD == 0 and len(list((tmp_path / "7").iterdir())) == 7


def test_the_governors_tick_figures_time_a_plan_and_a_page_out_with_their_pauses(
        capsys: pytest.CaptureFixture[str]) -> None:
    """`bench_memory --tick`, over more queues than a pause's worth (in a process of its own, which
    takes its hard limit of descriptors): a plan and a page-out each timed, the longest stretch
    between pauses within the page-out's time, and the descriptors held after it: each queue's
    journal (written to), none for the cursors of the queues paged out."""
    from bench.bench_memory import compare_ticks

    compare_ticks(600, None, repeat=1)
    figures = re.search(r"plan ([\d.]+) ms .*longest stretch ([\d.]+) ms; page-out ([\d.]+) ms, longest "
                        r"stretch ([\d.]+) ms; (\d+) descriptors held", capsys.readouterr().out)
    assert figures is not None
    plan_cpu, plan_stretch, paging, paging_stretch = (float(figure) for figure in figures.groups()[:4])
    assert plan_cpu > 0 and plan_stretch > 0
    assert 0 < paging_stretch < paging
    assert int(figures[5]) == 600
