"""The pipeline's parts that need no Spark: servers, options, the write-ahead log, the client, replay."""

from __future__ import annotations

import hashlib
import os
import signal
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pyspark", reason="pyspark is installed by `make test` (the spark extra)")

from kestrel.client import Refused, ServerUnavailable  # noqa: E402
from kestrel.pipeline import wal  # noqa: E402
from kestrel.pipeline.options import Option, parse_options, whole  # noqa: E402
from kestrel.pipeline.servers import ServersUnreachable, parse_servers, take_open_reads  # noqa: E402
from tests.conftest import ServerProcess, free_port, wait_until  # noqa: E402
from tests.support.client_retries import Retries, recorded_retries  # noqa: E402, F401  (the `retries` fixture)
from tests.support.wire import memcache_stats  # noqa: E402


@pytest.mark.parametrize("text, message", [
    ("a:1,", "empty entry at position 2"),
    ("a:1,,b:2", "empty entry at position 2"),
    ("a:x", "bad entry 'a:x'"),
    ("a:70000", "bad entry 'a:70000'"),
    (":5", "bad entry ':5'"),
    ("a:1, a:1", "lists a:1 twice"),
    ("  ", "option 'servers' is required"),
])
def test_bad_server_lists_are_refused(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_servers(text)


def test_server_list_defaults_the_port() -> None:
    assert parse_servers("h1, h2:1234") == ["h1:2229", "h2:1234"]


SPEC = [Option("maxItemsPerTrigger", whole(1), None), Option("queue", lambda n, v: v)]


def test_options_take_camel_case_snake_case_and_any_case() -> None:
    assert parse_options({"maxitemspertrigger": "5"}, SPEC, "x")["maxItemsPerTrigger"] == 5
    assert parse_options({"max_items_per_trigger": "5"}, SPEC, "x")["maxItemsPerTrigger"] == 5
    assert parse_options({}, SPEC, "x")["maxItemsPerTrigger"] is None


@pytest.mark.parametrize("given, message", [
    ({"maxOffsetsPerTrigger": "5"}, "unknown option 'maxOffsetsPerTrigger' \\(did you mean "
                                    "'maxItemsPerTrigger'\\?\\); valid options are: maxItemsPerTrigger, queue"),
    ({"maxitemspertriger": "5"}, "unknown option 'maxitemspertriger' \\(did you mean 'maxItemsPerTrigger'"),
    ({"colour": "5"}, "unknown option 'colour'; valid options are: "),
    ({"maxItemsPerTrigger": "0"}, "'maxItemsPerTrigger' must be at least 1, got 0"),
    ({"maxItemsPerTrigger": "many"}, "must be a whole number, got 'many'"),
    ({"maxItemsPerTrigger": "1", "max_items_per_trigger": "2"}, "given twice"),
    ({}, "option 'queue' is required"),
])
def test_bad_options_are_refused(given: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_options(given, SPEC, "x", required=("queue",))


@pytest.mark.parametrize("queue, message", [("a,", "empty entry at position 2"), ("a, a", "lists 'a' twice"),
                                            ("a,../etc", "path separator")])
def test_sources_refuse_what_is_not_a_list_of_queue_names(queue: str, message: str) -> None:
    from kestrel.pipeline.kestrel_source import KestrelBatchReader, KestrelDataSource
    from kestrel.pipeline.writer import KestrelWriter

    with pytest.raises(ValueError, match=message):
        KestrelBatchReader({"servers": "127.0.0.1:1", "queue": queue})
    stream = KestrelDataSource({"servers": "127.0.0.1:1", "queue": queue, "checkpointLocation": "/cp"}) \
        .streamReader(KestrelDataSource({}).schema())
    with pytest.raises(ValueError, match=message):  # raised at the stream's first call from Spark
        stream.initialOffset()
    schema = KestrelDataSource({}).schema()
    with pytest.raises(ValueError, match="'a,b' is not one queue's name \\(a comma\\)"):
        KestrelWriter({"servers": "127.0.0.1:1", "queue": "a,b"}, schema)  # a put goes to one queue
    from kestrel.pipeline.journal_source import KestrelJournalDataSource

    with pytest.raises(ValueError, match=message):  # a journal read's filter too: not 0 rows
        KestrelJournalDataSource({"path": "/q", "queue": queue}).reader(KestrelJournalDataSource({}).schema())


def test_min_partitions_splits_a_micro_batch_further(tmp_path: Path) -> None:
    from kestrel.pipeline.stream_source import KestrelStreamReader

    (tmp_path / "metadata").write_text("{}")
    reader = KestrelStreamReader({"servers": "h:1,h:2", "queue": "a,b", "checkpointLocation": str(tmp_path),
                                  "minPartitions": "6"})
    try:
        parts = reader.partitions({"batch": -1}, {"batch": 0, "take": {"h:1": {"a": 100, "b": 3}, "h:2": {"a": 20}}})
    finally:
        reader.stop()
    assert len(parts) >= 6
    quotas: dict[tuple[str, str], int] = {}
    for p in parts:
        quotas[(p.server, p.queue)] = quotas.get((p.server, p.queue), 0) + p.quota
    assert quotas == {("h:1", "a"): 100, ("h:1", "b"): 3, ("h:2", "a"): 20}


def test_a_micro_batch_is_split_into_partitions_large_enough_to_amortize_a_task(tmp_path: Path) -> None:
    """Each partition costs a Spark task, a fetch and a log file fsynced: by default a server's share
    is split every 50,000 items, not every 10,000 (bench/README.md has the figures)."""
    from kestrel.pipeline.stream_source import KestrelStreamReader

    (tmp_path / "metadata").write_text("{}")
    reader = KestrelStreamReader({"servers": "h:1", "queue": "a", "checkpointLocation": str(tmp_path)})
    try:
        parts = reader.partitions({"batch": -1}, {"batch": 0, "take": {"h:1": {"a": 120_000}}})
    finally:
        reader.stop()
    assert [p.quota for p in parts] == [50_000, 50_000, 20_000]


def test_a_replayed_batch_is_split_as_it_was_planned_whatever_the_options_now(server: ServerProcess,
                                                                             tmp_path: Path) -> None:
    """A replay reads the log files its batch was fetched into: split by today's itemsPerPartition it
    named other files, read none of those logged, and the restart had confirmed them all (items lost)."""
    from pyspark.sql.streaming.datasource import ReadMaxRows

    from kestrel.client import Server
    from kestrel.pipeline.stream_source import NO_CAP, KestrelStreamReader, StreamPartition

    Server("127.0.0.1", server.thrift_port).put("events", [b"%d" % i for i in range(40)])
    (tmp_path / "metadata").write_text("{}")
    options = {"servers": f"127.0.0.1:{server.thrift_port}", "queue": "events",
               "checkpointLocation": str(tmp_path)}

    def split(end: dict[str, Any], **more: str) -> list[tuple[str, int]]:
        reader = KestrelStreamReader(dict(options, **more))
        try:
            parts = reader.partitions({"batch": -1}, end)
        finally:
            reader.stop()
        return [(p.path, p.quota) for p in parts if isinstance(p, StreamPartition)]

    planner = KestrelStreamReader(dict(options, itemsPerPartition="10"))
    try:
        end = planner.latestOffset({"batch": -1}, ReadMaxRows(NO_CAP))
    finally:
        planner.stop()
    planned = split(end, itemsPerPartition="10")
    assert [quota for _, quota in planned] == [10, 10, 10, 10]
    assert split(end) == planned  # restarted with the default itemsPerPartition
    assert split(end, minPartitions="8", itemsPerPartition="3") == planned


def test_option_names_no_operation_takes_fail_before_an_operation_is_chosen() -> None:
    from kestrel.pipeline.kestrel_source import KestrelDataSource

    assert KestrelDataSource({"maxitemspertrigger": "5", "batch_size": "3"}).schema() is not None
    with pytest.raises(ValueError, match="kestrel: unknown option 'maxoffsetspertrigger' \\(did you mean "
                                         "'maxItemsPerTrigger'\\?\\)"):
        KestrelDataSource({"maxoffsetspertrigger": "5"}).schema()


def test_unreachable_servers_are_logged_once_per_interval_and_fail_the_stream_in_time() -> None:
    from structlog.testing import capture_logs

    from kestrel.pipeline.servers import LOG_EVERY_S, Reachability

    now = [0.0]
    reach = Reachability(["a:1", "b:1"], 120.0, "kestrel stream of queue 'q'", clock=lambda: now[0])
    error = ServerUnavailable("a:1", "refused")
    with capture_logs() as logs:
        for _ in range(int(LOG_EVERY_S + 2) * 75):  # a failed peek every planning, 75 plannings a second
            if reach.due("a:1"):
                reach.failed("a:1", "peek", error)
            reach.check()  # b:1 answers
            now[0] += 1 / 75
        assert [e["event"] for e in logs] == ["server unreachable; going on without it, asking again every second",
                                              "server still unreachable"]
        assert LOG_EVERY_S - 2 <= logs[1]["attempts"] <= LOG_EVERY_S + 1  # asked once a second
        reach.failed("b:1", "peek", error)
        now[0] += 119
        reach.check()
        now[0] += 1
        with pytest.raises(ServersUnreachable, match="no server answered for 120 s \\(unreachableTimeoutMs is "
                                                     "120000\\): a:1, b:1 \\(a:1: kestrel a:1: refused; b:1: "):
            reach.check()
        reach.answered("b:1")
        reach.check()
        assert logs[-1]["event"] == "server reachable again"
    never = Reachability(["a:1"], 0, "x", clock=lambda: now[0])
    never.failed("a:1", "peek", error)
    now[0] += 10**6
    never.check()


def test_a_trigger_cap_is_shared_in_proportion_and_never_exceeded() -> None:
    from kestrel.pipeline.stream_source import share

    assert share({"a": 0, "b": 0}, 10) == {}
    assert share({"a": 30, "b": 10}, None) == {"a": 30, "b": 10}
    take = share({"a": 30, "b": 10, "c": 1}, 20)
    assert sum(take.values()) == 20 and take["a"] >= take["b"]
    assert all(take[k] <= n for k, n in {"a": 30, "b": 10, "c": 1}.items() if k in take)
    assert share({"a": 3, "b": 0}, 20) == {"a": 3}


def test_log_files_round_trip_and_the_first_writer_wins(tmp_path: Path) -> None:
    from kestrel.pipeline import wal

    path = str(tmp_path / "7" / "h_1-0")
    header = wal.WalHeader("h:1", 12.5, 3)
    logged = wal.Logged([b"a", b"", b"c" * 70_000], [1_700_000_000_001, 2, 3], [0, 1_800_000_000_000, 0])
    assert wal.write_partition(path, header, [4, 5, 6], logged)
    assert not wal.write_partition(path, wal.WalHeader("h:1", 13.0, 1), [9], wal.Logged([b"z"]))
    assert wal.read_ids(path) == (header, [4, 5, 6]) and header.timed
    assert wal.read_items(path) == logged
    assert wal.batches(str(tmp_path)) == [7] and wal.batch_files(str(tmp_path), 7) == [path]
    assert list((tmp_path / "7").iterdir()) == [Path(path)]  # nothing left aside
    # A file of an earlier version: no times, and none read.
    old = str(tmp_path / "8" / "h_1-0")
    os.makedirs(os.path.dirname(old))
    with open(old, "wb") as f:
        f.write(wal.MAGIC + b'{"server": "h:1", "fetched_at": 1.0, "count": 1, "queue": "q"}\n')
        f.write(struct.pack("<q", 9) + struct.pack("<I", 1) + b"z")
    assert wal.read_items(old) == wal.Logged([b"z"])
    assert wal.read_ids(old) == (wal.WalHeader("h:1", 1.0, 1, "q"), [9])


def test_spark_commit_log_names_the_source_batch(tmp_path: Path) -> None:
    from kestrel.pipeline.wal import SparkCommitLog, checkpoint_dir

    (tmp_path / "offsets").mkdir()
    (tmp_path / "commits").mkdir()
    log = SparkCommitLog(str(tmp_path), "q-1")
    assert log.committed() == -1
    (tmp_path / "offsets" / "4").write_text('v1\n{"batchWatermarkMs":0}\n{"source":"other","batch":9}\n'
                                            '{"source":"q-1","batch":2,"take":{"h:1":5}}\n')
    assert log.committed() == -1  # planned, not committed
    (tmp_path / "commits" / "4").write_text("v1\n{}\n")
    assert log.committed() == 2
    assert checkpoint_dir(f"file://{tmp_path}") == str(tmp_path)
    with pytest.raises(ValueError, match="only local or mounted paths"):
        checkpoint_dir("s3a://bucket/cp")


def test_a_fetch_takes_more_than_max_open_reads_over_one_connection(server_factory: Any) -> None:
    """`get_timed`'s reads are not capped per connection: a fetch is one call, not a connection
    for each `max_open_reads` items."""
    from kestrel.client import Server

    srv = server_factory({"max_open_reads": 7})
    address = f"127.0.0.1:{srv.thrift_port}"
    server = Server("127.0.0.1", srv.thrift_port)
    before = int(time.time() * 1000)
    server.put("q", [b"%d" % i for i in range(30)])
    after = int(time.time() * 1000)
    connections = int(memcache_stats(srv.memcache_port)["total_connections"])
    taken = take_open_reads(address, "q", 25, 60_000, 10_000)
    assert int(memcache_stats(srv.memcache_port)["total_connections"]) - connections == 1 + 1  # + the stats'
    assert taken.items == [b"%d" % i for i in range(25)] and len(set(taken.ids)) == 25
    assert all(before <= t <= after for t in taken.added) and taken.expiry == [0] * 25
    assert taken.failure is None
    assert server.peek("q").open_transactions == 25
    assert server.confirm("q", set(taken.ids)) == 25  # closed over another connection
    lost = take_open_reads(f"127.0.0.1:{free_port()}", "q", 5, 60_000, 10_000)  # a lost server: nothing, and why
    assert (lost.ids, lost.items) == ([], []) and "cannot connect" in str(lost.failure)


def test_the_writer_leaves_retrying_to_the_client(server: ServerProcess, retries: Retries) -> None:
    """One layer retries: the writer's `retries` are the client's passes over the servers, its pauses
    the client's (recorded here, not timed), with nothing stacked on top."""
    import pyarrow as pa
    from pyspark.sql.types import BinaryType, StructField, StructType

    from kestrel.client import NoServers
    from kestrel.pipeline.writer import KestrelWriter

    schema = StructType([StructField("data", BinaryType())])
    batch = pa.RecordBatch.from_arrays([pa.array([b"x", b"y"], pa.binary())], names=["data"])
    options = {"queue": "q", "retries": "3", "retryBackoffMs": "100"}
    gone = KestrelWriter({**options, "servers": f"127.0.0.1:{free_port()}"}, schema)
    with pytest.raises(NoServers, match="cannot connect"):
        gone.write(iter([batch]))
    pauses = retries.pauses
    assert retries.puts == 4 and len(pauses) == 3, pauses  # the first pass, then three more after a pause each
    assert 0.05 <= pauses[0] <= 0.1 and 0.1 <= pauses[1] <= 0.2 and 0.2 <= pauses[2] <= 0.4
    retries.clear()
    live = KestrelWriter({**options, "servers": f"127.0.0.1:{server.thrift_port}"}, schema)
    assert live.write(iter([batch])).written == 2 and (retries.puts, pauses) == (1, [])


def test_the_writers_puts_keep_to_batch_size_and_bytes_a_larger_item_alone(server: ServerProcess,
                                                                            retries: Retries) -> None:
    import pyarrow as pa
    from pyspark.sql.types import BinaryType, StructField, StructType

    from kestrel.client import Server
    from kestrel.pipeline.writer import KestrelWriter

    schema = StructType([StructField("data", BinaryType())])
    rows = [b"%04d" % i + b"." * 996 for i in range(30)]  # 1,000 bytes each
    rows[17] = b"big" + b"!" * 50_000  # over batchBytes on its own
    batches = [pa.RecordBatch.from_arrays([pa.array(rows[i:i + 12], pa.binary())], names=["data"])
               for i in range(0, 30, 12)]  # Arrow batches of 12 rows, as Spark might send them
    writer = KestrelWriter({"servers": f"127.0.0.1:{server.thrift_port}", "queue": "sized", "batchSize": "8",
                            "batchBytes": "5000"}, schema)
    assert writer.write(iter(batches)).written == 30
    assert max(retries.sizes) <= 5 and 1 in retries.sizes  # 5 rows of 1,000 bytes; the big one alone
    with Server("127.0.0.1", server.thrift_port) as client:
        got = [item.data for item in client.get("sized", 100)]
    assert got == rows  # every row once, in order


def test_a_put_is_laid_out_as_thrift_lays_out_a_list_of_binary() -> None:
    """Each item's 4-byte big-endian length, then its bytes: from slices at any offset, pieces of
    more than one batch, empty items, and puts of sizes met before (their order of taking is kept)."""
    import pyarrow as pa

    from kestrel.pipeline.writer import packed

    rows = [b"row %d " % i + b"." * (i % 13) for i in range(3000)]
    column = pa.array(rows, pa.binary())
    other = pa.array([b"", b"z", b""], pa.binary())
    for pieces in ([column], [column.slice(7, 500), column.slice(2000, 500)], [other], [column.slice(1, 1000)],
                   [column.slice(5, 1000)], [other, column.slice(0, 2)]):
        items = [row for piece in pieces for row in piece.to_pylist()]
        laid_out = packed(pieces, sum(map(len, items)))
        assert laid_out.count == len(items)
        assert bytes(laid_out.body) == b"".join(struct.pack(">i", len(row)) + row for row in items)


WRITES = 3  # the writes measured in turn


@pytest.mark.parametrize("kind", ["binary", "string", "large_binary", "large_string"])
def test_the_writer_puts_from_arrows_buffers_without_an_object_per_row(server: ServerProcess, kind: str) -> None:
    """A put is laid out from the Arrow column's buffers: the Python heap holds no object per row
    while 100,000 rows go (a list of them would take megabytes), and every row arrives, in order."""
    import tracemalloc

    import pyarrow as pa
    from pyspark.sql.types import BinaryType, StringType, StructField, StructType

    from kestrel.client import Server
    from kestrel.pipeline.writer import KestrelWriter

    rows = [b"row %06d " % i + b"." * (i % 97) for i in range(100_000)]
    values: list[Any] = rows if kind.endswith("binary") else [row.decode() for row in rows]
    batches = [pa.RecordBatch.from_arrays([pa.array(values[i:i + 10_000], getattr(pa, kind)())], names=["data"])
               for i in range(0, len(rows), 10_000)]
    schema = StructType([StructField("data", BinaryType() if kind.endswith("binary") else StringType())])
    writer = KestrelWriter({"servers": f"127.0.0.1:{server.thrift_port}", "queue": f"arrow-{kind}"}, schema)
    writer.write(iter(batches[:1]))  # what a first write imports and sets up is not per row
    peaks = []
    for _ in range(WRITES):  # tracemalloc counts every thread: the least peak is the write's own
        tracemalloc.start()
        try:
            report = writer.write(iter(batches))
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()
        assert report.written == len(rows)
    assert min(peaks) < 512 << 10, f"{min(peaks):,} bytes of Python objects at the peak"
    got: list[bytes] = []
    with Server("127.0.0.1", server.thrift_port) as client:
        while taken := client.get(f"arrow-{kind}", 10_000):
            got += [item.data for item in taken]
    assert got == rows[:10_000] + rows * WRITES


# One step of a write in a process of its own, as pyspark's daemon runs it (`python -m pyspark.daemon`)
# or not: planning (the writer made), a task (two tasks, each on its own), or committing; each followed
# by the full collection the daemon runs after a request. Prints the objects each collection walked
# and how many were frozen.
_STEP_IN_A_WORKER = """
import gc, importlib.util, sys
step, address, daemon = sys.argv[1], sys.argv[2], sys.argv[3] == "daemon"
import pyarrow as pa
from pyspark import TaskContext
from pyspark.sql.types import BinaryType, StructField, StructType
from kestrel.pipeline.writer import KestrelWriter, PutReport

schema = StructType([StructField("data", BinaryType())])
options = {"servers": address, "queue": "steps"}
batch = pa.RecordBatch.from_arrays([pa.array([b"row %d" % i for i in range(1000)], pa.binary())], names=["data"])
writer = KestrelWriter(options, schema)  # made, as a task finds it, before the process is the daemon's
if daemon:
    sys.modules["__main__"].__spec__ = importlib.util.find_spec("pyspark.daemon")
walked = []
for request in ((0, 1) if step == "task" else (0,)):
    if step == "plan":
        KestrelWriter(options, schema)
    elif step == "task":
        TaskContext._getOrCreate()._partitionId = request
        assert writer.write(iter([batch])).written == 1000
    else:
        writer.commit([PutReport(1000, 0, 0), PutReport(1000, 0, 0)])
    gc.collect()
    walked.append(len(gc.get_objects()))
print(gc.get_freeze_count(), *walked)
"""


@pytest.mark.parametrize("step", ["plan", "task", "commit"])
def test_collections_after_each_step_of_a_write_leave_out_the_modules_it_loaded(server: ServerProcess,
                                                                              step: str) -> None:
    """pyspark's daemon collects garbage after every request a worker serves, walking every object the
    process holds (some 55,000 with the writer's modules loaded, 25 ms of CPU a task): in a process
    the daemon runs, planning, each task and committing freeze what the process holds once, so the
    collections after them walk only what is new; elsewhere (a driver, a process that only calls
    the writer) the collector is left alone."""
    import subprocess
    import sys

    def run(daemon: str) -> list[int]:
        shown = subprocess.run([sys.executable, "-c", _STEP_IN_A_WORKER, step,
                                f"127.0.0.1:{server.thrift_port}", daemon],
                               capture_output=True, text=True, timeout=120)
        assert shown.returncode == 0, shown.stderr[-2000:]
        return [int(number) for number in shown.stdout.splitlines()[-1].split()]  # after the log's lines

    frozen, *walked = run("daemon")
    assert frozen > 30_000 and max(walked) < 2_000, (frozen, walked)  # the modules, frozen once
    frozen, *walked = run("elsewhere")
    assert frozen == 0 and min(walked) > 30_000, (frozen, walked)


class _Spared(Exception):
    pass


@pytest.mark.parametrize("reader", ["batch read", "stream", "journal read"])
def test_each_read_task_spares_its_worker_the_collections_of_what_it_loaded(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, reader: str) -> None:
    """A read task, like a write's, leaves what its Python worker holds out of the collections
    pyspark's daemon runs after each task (`kestrel.pipeline.worker.spare_collections`), before it
    reads anything."""
    from kestrel.pipeline import journal_source, kestrel_source, stream_source

    def spare() -> None:
        raise _Spared

    module: Any
    if reader == "batch read":
        module, source, partition = (kestrel_source, kestrel_source.KestrelBatchReader,
                                     kestrel_source.LookPartition(0, "127.0.0.1:1", "q", 0, 0, 1))
    elif reader == "stream":
        module, source, partition = (stream_source, stream_source.KestrelStreamReader,
                                     stream_source.StreamPartition(str(tmp_path / "log"), "127.0.0.1:1", "q",
                                                                   1, 1000, 1000, "t", None))
    else:
        module, source, partition = (journal_source, journal_source.JournalReader,
                                     journal_source.JournalPartition("q", str(tmp_path / "q")))
    monkeypatch.setattr(module, "spare_collections", spare)
    with pytest.raises(_Spared):
        next(iter(object.__new__(source).read(partition)))


def test_a_put_in_flight_that_fails_fails_the_write(server_factory: Any) -> None:
    """The writer keeps one put in flight while it reads on: a put refused meanwhile still fails the
    task (here the last one, in flight when the rows ran out), with what was written counted."""
    import pyarrow as pa
    from pyspark.sql.types import BinaryType, StructField, StructType

    from kestrel.client import Server
    from kestrel.pipeline.writer import KestrelWriter, QueueFullError

    srv = server_factory({"queues": {"small": {"max_items": 10}}})
    schema = StructType([StructField("data", BinaryType())])
    batches = [pa.RecordBatch.from_arrays([pa.array([b"%d" % i for i in range(first, first + 4)], pa.binary())],
                                          names=["data"]) for first in range(0, 12, 4)]
    options = {"servers": f"127.0.0.1:{srv.thrift_port}", "queue": "small", "batchSize": "4"}
    with pytest.raises(QueueFullError, match="refused 2 of 4"):
        KestrelWriter(options, schema).write(iter(batches))
    counted = KestrelWriter({**options, "onFull": "count"}, schema).write(iter(batches))
    assert (counted.written, counted.refused) == (0, 12)
    with Server("127.0.0.1", srv.thrift_port) as client:
        assert [item.data for item in client.get("small", 20)] == [b"%d" % i for i in range(10)]


def test_replay_reopens_open_reads_first_in_order() -> None:
    from kestrel.storage.kestrel2.codec import AddX, ConfirmRemove, RemoveTentative, Unremove
    from kestrel.storage.kestrel2.replay import QueueReplay

    replay = QueueReplay()
    records: list[Any] = [AddX(1, 0, b"a"), AddX(1, 0, b"b"), AddX(1, 0, b"c"), RemoveTentative(),
                          RemoveTentative(), RemoveTentative(), ConfirmRemove(2), Unremove(3)]
    for record in records:
        replay.apply(record)
    assert [i.data for i in replay.items] == [b"c"]
    assert {xid: i.data for xid, i in replay.opens.items()} == {1: b"a"}


def test_large_journal_files_split_at_record_boundaries_into_every_record_once(tmp_path: Path) -> None:
    from kestrel.pipeline.journal_source import record_batches, split_points
    from kestrel.storage.kestrel2.codec import encode_addx

    records = [encode_addx(1, 0, b"r%d" % i * (i % 7 + 1)) for i in range(1000)]
    path = tmp_path / "q"
    path.write_bytes(b"".join(records) + records[0][:5])  # ends in a torn record
    ranges = split_points(str(path), 1000)
    assert len(ranges) > 5 and ranges[0][0] == 0 and ranges[-1][1] is None
    boundaries = set()
    at = 0
    for r in records:
        boundaries.add(at)
        at += len(r)
    assert all(start in boundaries for start, _ in ranges)
    rows = [row for start, end in ranges for batch in record_batches("q", str(path), False, start, end)
            for row in batch.to_pylist()]
    assert [r["data"] for r in rows[:-1]] == [b"r%d" % i * (i % 7 + 1) for i in range(1000)]
    assert rows[-1]["status"] == "torn" and [r["status"] for r in rows].count("torn") == 1
    assert split_points(str(path), 10**9) == [(0, None)]


def test_a_closed_queue_reply_is_a_server_going_away(server: ServerProcess) -> None:
    from thriftpy2.rpc import make_server
    from thriftpy2.thrift import TApplicationException
    from thriftpy2.transport import TFramedTransportFactory

    from kestrel.client import Cluster, NoServers, ServerClosing
    from kestrel.contract import kestrel_thrift

    class Closing:
        """What a Kestrel server answers while it shuts down: its queues are closed."""

        def put(self, queue: str, items: list[bytes], expiration_msec: int) -> int:
            raise TApplicationException(TApplicationException.UNKNOWN, f"queue {queue!r} is closed")

        def peek(self, queue: str) -> Any:
            raise TApplicationException(TApplicationException.UNKNOWN, f"queue {queue!r} is not there")

    port = free_port()
    closing = make_server(kestrel_thrift.Kestrel, Closing(), "127.0.0.1", port,
                          trans_factory=TFramedTransportFactory())
    threading.Thread(target=closing.serve, daemon=True).start()
    from kestrel.client import Server

    lone = Server("127.0.0.1", port)

    def closing_said() -> bool:
        try:
            lone.put("q", [b"x"])
        except ServerClosing as e:
            assert "shutting down (queue 'q' is closed)" in str(e) and lone.seems_down
            return True
        except ServerUnavailable:  # not listening yet
            return False
        raise AssertionError("the put was taken")

    wait_until(closing_said, "the closing server to answer")
    with pytest.raises(Refused, match="is not there"):  # any other error reply stays a refusal
        lone.peek("q")
    with pytest.raises(NoServers, match="is closed"):  # retried as a server that is down, then given up
        Cluster([f"127.0.0.1:{port}"], retries=1, backoff_ms=1).put("q", b"x")
    cluster = Cluster([f"127.0.0.1:{port}", f"127.0.0.1:{server.thrift_port}"])
    assert all(cluster.put("q", b"%d" % i) for i in range(4))  # every put lands on the live server
    assert Server("127.0.0.1", server.thrift_port).peek("q").items == 4
    closing.close()


@pytest.mark.parametrize("decoder", ["compiled if built", "python"])
def test_record_rows_match_the_storage_reader_for_every_kind_of_record(
        tmp_path: Path, decoder: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from kestrel.pipeline.journal_source import ROWS_PER_BATCH, record_batches
    from kestrel.storage.kestrel2 import codec
    from kestrel.storage.kestrel2.reader import read_journal

    if decoder == "python":
        monkeypatch.setattr(codec, "decode_common_columns", codec.decode_common_columns_python)

    kinds: list[Any] = [
        codec.Add(1_800_000_000, b"old add"), codec.AddX(1_700_000_000_123, 0, b"x"),
        codec.AddX(1_700_000_000_456, 1_700_000_999_000, b""), codec.Remove(), codec.RemoveTentative(),
        codec.SaveXid(7), codec.Unremove(7), codec.ConfirmRemove(7), codec.AddXid(9, 1_700_000_000_789, 0, b"xid"),
        codec.RemoveTentativeXid(9), codec.ConfirmRemove(9)]
    # enough common records between the others for several batches and runs of the reader's fast path
    records = kinds + [codec.AddX(1_700_000_001_000 + i, 0, b"r%d" % i) for i in range(ROWS_PER_BATCH + 5)] + kinds
    path = tmp_path / "q"
    path.write_bytes(b"".join(codec.encode(r) for r in records))
    rows = [row for batch in record_batches("q", str(path), False) for row in batch.to_pylist()]
    expected = list(read_journal(str(path)))
    assert len(rows) == len(expected) == len(records)
    for row, (offset, record) in zip(rows, expected, strict=True):
        assert row["offset"] == offset and row["opcode"] == codec.OPCODE_NAMES[type(record)]
        assert row["xid"] == getattr(record, "xid", None)
        assert row["data"] == getattr(record, "data", None)
        added = getattr(record, "add_time", 0)
        assert (row["timestamp"].timestamp() * 1000 if row["timestamp"] else 0) == pytest.approx(added)
        expiry = getattr(record, "expiry", 0) or getattr(record, "expiry_s", 0) * 1000
        assert (row["expiry"].timestamp() * 1000 if row["expiry"] else 0) == pytest.approx(expiry)
        assert row["status"] == "ok" and row["queue"] == "q" and row["file"] == str(path)


def _committed(checkpoint: Path, source_key: str, batch: int) -> None:
    """What Spark writes once its sink committed `batch` (the source's offset names the batch)."""
    (checkpoint / "offsets").mkdir(exist_ok=True)
    (checkpoint / "commits").mkdir(exist_ok=True)
    (checkpoint / "offsets" / str(batch)).write_text(
        f'v1\n{{"batchWatermarkMs":0}}\n{{"source":"{source_key}","batch":{batch}}}\n')
    (checkpoint / "commits" / str(batch)).write_text("v1\n{}\n")


def test_the_items_only_the_log_may_hold_are_those_of_uncommitted_batches_confirmed_early(tmp_path: Path
                                                                                           ) -> None:
    from kestrel.pipeline import wal

    checkpoint = tmp_path / "cp"
    root = checkpoint / "kestrel" / "jobs-1"

    def logged(batch: int, name: str, count: int) -> str:
        path = str(root / str(batch) / name)
        assert wal.write_partition(path, wal.WalHeader("h:1", 1.0, count), list(range(count)),
                                   wal.Logged([b"x"] * count))
        return path

    wal.mark_confirmed(logged(0, "h_1-0", 5))  # committed: the queue no longer holds them, by design
    _committed(checkpoint, "jobs-1", 0)
    wal.mark_confirmed(logged(1, "h_1-0", 3))  # confirmed early
    wal.mark_confirming(logged(1, "h_1-1", 4), 2.0)  # a confirm sent, its answer never noted
    logged(1, "h_1-2", 7)  # open reads: back to the queue after autoAbortMs
    undone = logged(1, "h_1-3", 2)
    wal.mark_confirming(undone, 2.0)
    wal.unmark_confirming(undone)  # a confirm the server did not take
    assert wal.held_early(str(checkpoint)) == 3 + 4
    assert wal.batch_files(str(root), 1) == [str(root / "1" / f"h_1-{part}") for part in range(4)]


def test_a_confirm_the_server_cannot_take_stays_pending_until_it_can(server: ServerProcess,
                                                                    tmp_path: Path) -> None:
    import signal

    from kestrel.client import Server
    from kestrel.pipeline import wal
    from kestrel.pipeline.stream_source import KestrelStreamReader

    address = f"127.0.0.1:{server.thrift_port}"
    direct = Server("127.0.0.1", server.thrift_port)
    direct.put("events", [b"%d" % i for i in range(30)])
    checkpoint = tmp_path / "cp"
    checkpoint.mkdir()
    (checkpoint / "metadata").write_text('{"id":"q"}\n')
    # A stalled server answers nothing within timeoutMs: a call that waited for it takes at least that
    # long, one that did not returns well within it (a second, longer than a busy machine's stalls).
    timeout = 1.0
    reader = KestrelStreamReader({"servers": address, "queue": "events", "checkpointLocation": str(checkpoint),
                                  "timeoutMs": str(int(timeout * 1000))})

    def log_batch(batch: int, quota: int) -> str:
        opened_at = direct.peek_items("events", 0, 0).opened_at
        taken = take_open_reads(address, "events", quota, 60_000, 10_000)
        path = os.path.join(reader.root, str(batch), "part-0")
        header = wal.WalHeader(address, time.time(), len(taken.ids), "events", opened_at=opened_at)
        assert wal.write_partition(path, header, taken.ids, wal.Logged(taken.items))
        _committed(checkpoint, reader.source_key, batch)
        return path

    def planned_until_gone(path: str) -> Callable[[], bool]:
        def check() -> bool:  # what a planning does: ask the servers (a down one in the background), confirm
            reader._waiting()
            reader._confirm_up_to(reader.spark_log.committed())
            return not os.path.exists(path)
        return check

    # Stalled, not restarted: the confirm's answer is lost; it waits in the log, marked as sent, and is
    # tried again once the server answers. The stalled server closed the reads once resumed: the retry
    # finds none open, and knows that its first confirm closed them (sent in time, the queue not reopened).
    first = log_batch(0, 10)
    assert server.proc is not None
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        reader._confirm_up_to(reader.spark_log.committed())
        assert os.path.exists(first) and not wal.is_confirmed(first)  # kept, not dropped
        assert wal.confirming_since(first) is not None  # its items may be in the log alone (held_early)
        started = time.monotonic()
        reader._waiting()  # the server is down: asked in the background, not waited for
        reader._confirm_up_to(reader.spark_log.committed())
        assert time.monotonic() - started < timeout and os.path.exists(first)
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    wait_until(planned_until_gone(first), "the pending confirm to be retried")
    assert direct.peek("events").items == 20 and direct.peek("events").open_transactions == 0
    assert wal.returned(reader.root) == 0  # exact: nothing is delivered again

    # Restarted meanwhile: the old ids close nothing; their items are back, counted as duplicates.
    second = log_batch(1, 4)
    server.stop()
    reader._confirm_up_to(reader.spark_log.committed())
    assert os.path.exists(second) and wal.confirming_since(second) is None  # never reached the server
    server.start()
    wait_until(planned_until_gone(second), "the pending confirm to be retried")
    assert wal.returned(reader.root) == 4
    assert direct.peek("events").items == 20  # the 4 came back beside the 16 never taken

    # Stalled, its confirm's answer lost, then killed and restarted: the reads came back, and count.
    third = log_batch(2, 6)
    os.kill(server.proc.pid, signal.SIGSTOP)
    reader._confirm_up_to(reader.spark_log.committed())
    assert wal.confirming_since(third) is not None
    server.kill()
    server.start()
    wait_until(planned_until_gone(third), "the pending confirm to be retried")
    assert wal.returned(reader.root) == 4 + 6
    assert direct.peek("events").items == 20
    reader.stop()


def test_reads_of_a_deleted_queue_are_not_counted_as_delivered_again(server: ServerProcess,
                                                                     tmp_path: Path) -> None:
    """A confirm finds no read open in a deleted queue: the items went with it. They were counted in
    `returned` as delivered again, under a warning that a restart or autoAbortMs had returned them."""
    from structlog.testing import capture_logs

    from kestrel.client import Server
    from kestrel.pipeline import wal
    from kestrel.pipeline.stream_source import KestrelStreamReader

    address = f"127.0.0.1:{server.thrift_port}"
    direct = Server("127.0.0.1", server.thrift_port)
    (tmp_path / "metadata").write_text("{}")
    reader = KestrelStreamReader({"servers": address, "queue": "events", "checkpointLocation": str(tmp_path)})

    def log_batch(batch: int) -> None:
        direct.put("events", [b"%d" % i for i in range(5)])
        opened_at = direct.peek_items("events", 0, 0).opened_at
        taken = take_open_reads(address, "events", 5, 60_000, 10_000)
        path = os.path.join(reader.root, str(batch), "part-0")
        header = wal.WalHeader(address, time.time(), len(taken.ids), "events", opened_at=opened_at)
        assert wal.write_partition(path, header, taken.ids, wal.Logged(taken.items))
        _committed(tmp_path, reader.source_key, batch)
        direct.call("delete_queue", "events")

    try:
        log_batch(0)  # deleted, not made again: certainly gone
        with capture_logs() as logs:
            reader._confirm_up_to(reader.spark_log.committed())
        assert wal.returned(reader.root) == 0
        assert [e["items"] for e in logs if e["event"].startswith("reads of a queue deleted")] == [5]
        log_batch(1)  # deleted, then made anew by a put: a restart would look the same to a confirm
        time.sleep(0.01)  # a new queue opens at a later millisecond
        direct.put("events", [b"new"])
        with capture_logs() as logs:
            reader._confirm_up_to(reader.spark_log.committed())
        (warned,) = [e for e in logs if e["event"].startswith("reads no longer open")]
        assert "by a server restart" in warned["event"] and "by a delete and a put" in warned["event"]
        assert wal.returned(reader.root) == 5  # possibly delivered again: counted, and said so
    finally:
        reader.stop()


def test_a_subscription_matches_names_patterns_and_a_readers_children() -> None:
    from kestrel.pipeline.subscription import Subscription

    held = ["jobs", "jobs+audit", "prod-1", "prod-2", "prod-2+app", "test-1"]
    plain = Subscription(("prod-*", "jobs"))
    assert plain.queues(held) == ["prod-1", "prod-2", "jobs"]  # a child is its queue's reader, not a queue
    assert Subscription(("prod-2+*",)).queues(held) == ["prod-2+app"]  # unless the pattern names children
    assert plain.children(held) == []
    app = Subscription(("prod-*", "jobs"), "app")
    assert app.queues(held) == ["prod-2+app"]  # the children the servers hold
    assert app.children(held) == ["jobs+app", "prod-1+app"]  # and those a stream creates
    assert app.children([]) == ["jobs+app"]  # a named queue's child is created before its queue exists
    assert Subscription(("jobs", "nope", "x*")).unmatched([["jobs"], ["prod-1"]]) == ["nope", "x*"]
    assert Subscription(("b", "a")).key() == Subscription(("a", "b")).key() != app.key()


def test_a_streams_identity_is_what_it_reads_not_how_the_options_spell_it(tmp_path: Path) -> None:
    from kestrel.pipeline.stream_source import KestrelStreamReader

    def identity(servers: str, queue: str, **more: str) -> str:
        reader = KestrelStreamReader({"servers": servers, "queue": queue, "checkpointLocation": str(tmp_path),
                                      **more})
        reader.stop()
        return reader.source_key

    first = identity("h1:2229,h2:2229", "a,b")
    assert identity("h2:2229, h1", "b, a") == first  # reordered, respelled: the same stream
    assert identity("h1:2229", "a,b") != first and identity("h1:2229,h2:2229", "a") != first
    assert identity("h1:2229,h2:2229", "a,b", reader="app") != first
    # A checkpoint of a version that named a stream by its options' text keeps that name.
    earlier = "a-" + hashlib.sha1(b"a@h2:2229,h1:2229").hexdigest()[:12]
    (tmp_path / "kestrel" / earlier).mkdir(parents=True)
    assert identity("h2:2229,h1:2229", "a") == earlier
    assert identity("h1:2229,h2:2229", "a") != earlier


def test_a_task_that_does_not_see_the_drivers_checkpoint_takes_nothing(server: ServerProcess,
                                                                      tmp_path: Path) -> None:
    from kestrel.client import Server
    from kestrel.pipeline.stream_source import CheckpointNotShared, StreamPartition, read_partition

    direct = Server("127.0.0.1", server.thrift_port)
    direct.put("private", [b"x"] * 5)
    elsewhere = tmp_path / "executor-view" / "kestrel" / "private-1"  # the driver wrote its mark elsewhere
    partition = StreamPartition(str(elsewhere / "0" / "part-0"), f"127.0.0.1:{server.thrift_port}", "private",
                                5, 60_000, 10_000, "the-drivers-token", None)
    with pytest.raises(CheckpointNotShared, match=f"does not see the checkpoint the driver wrote at "
                                                  f"{tmp_path / 'executor-view'} .*must be storage the driver and "
                                                  f"every executor share.*Nothing was taken"):
        list(read_partition(partition))
    assert direct.peek("private").items == 5 and direct.peek("private").open_transactions == 0


def test_a_restart_past_the_window_warns_naming_it(tmp_path: Path) -> None:
    from structlog.testing import capture_logs

    from kestrel.pipeline import wal
    from kestrel.pipeline.stream_source import KestrelStreamReader

    (tmp_path / "metadata").write_text("{}")
    reader = KestrelStreamReader({"servers": f"127.0.0.1:{free_port()}", "queue": "q",
                                  "checkpointLocation": str(tmp_path), "autoAbortMs": "1600"})
    fetched = time.time() - 5  # a batch fetched 5 s ago, its reads never confirmed: the driver stopped
    assert wal.write_partition(os.path.join(reader.root, "3", "h_1-0"), wal.WalHeader("h:1", fetched, 2, "q"),
                               [7, 8], wal.Logged([b"a", b"b"]))
    with capture_logs() as logs:
        reader._start()
    reader.stop()
    late = [e for e in logs if e["event"].startswith("kestrel stream restarted")]
    assert len(late) == 1 and late[0]["batch"] == 3 and late[0]["items"] == 2
    assert "duplicates nothing if it comes within 1 s (0.4375 of autoAbortMs) of the stop" in late[0]["event"]


def test_reads_in_flight_are_confirmed_early_through_a_step_of_the_drivers_wall_clock_back(
        server: ServerProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The keeper judged a read's age by the driver's wall clock alone: stepped back an hour after the
    fetch, it confirmed nothing early, and the server (its auto-abort on its monotonic clock) put the
    items back after autoAbortMs, to be delivered again."""
    import types

    from kestrel.client import Server
    from kestrel.pipeline import stream_source

    address = f"127.0.0.1:{server.thrift_port}"
    direct = Server("127.0.0.1", server.thrift_port)
    direct.put("events", [b"%d" % i for i in range(10)])
    (tmp_path / "metadata").write_text("{}")
    auto_abort_s = 4.0
    reader = stream_source.KestrelStreamReader({"servers": address, "queue": "events",
                                                "checkpointLocation": str(tmp_path),
                                                "autoAbortMs": str(int(auto_abort_s * 1000))})
    end = {"source": reader.source_key, "batch": 0, "take": {address: {"events": 10}}, "split": 10}
    try:
        (partition,) = reader.partitions({"source": reader.source_key, "batch": -1}, end)
        fetched = time.monotonic()
        assert sum(rows.num_rows for rows in reader.read(partition)) == 10  # fetched and logged
        assert isinstance(partition, stream_source.StreamPartition)
        stepped = types.SimpleNamespace(time=lambda: time.time() - 3600, monotonic=time.monotonic)
        monkeypatch.setattr(stream_source, "time", stepped)  # the driver's wall clock, an hour back
        wait_until(lambda: wal.is_confirmed(partition.path), "the early confirm", timeout=2 * auto_abort_s)
        assert time.monotonic() - fetched >= auto_abort_s / 2  # not before the rule's age, nor after the server
        wait_until(lambda: not reader._in_flight, "the confirmed file to be forgotten")
        assert direct.peek("events").items == 0 and direct.peek("events").open_transactions == 0
        assert wal.returned(reader.root) == 0
    finally:
        reader.stop()


class FakeSession:
    """A SparkSession as `register` and `drain` see it: what they register, and a query that ends as
    told."""

    def __init__(self, known: set[str], failure: Exception | None = None) -> None:
        self.known = known
        self.registered: list[str] = []
        self.failure = failure
        self.locations: list[str] = []
        self.dataSource = self
        self.readStream = self.writeStream = self
        manager = type("Manager", (), {"dataSourceExists": lambda _self, name: name in self.known})()
        state = type("State", (), {"dataSourceManager": lambda _self: manager})()
        self._jsparkSession = type("J", (), {"sessionState": lambda _self: state})()

    def register(self, source: Any) -> None:
        self.registered.append(source.name())

    def option(self, key: str, value: str) -> FakeSession:
        if key == "checkpointLocation":
            self.locations.append(value)
        return self

    def __getattr__(self, name: str) -> Any:  # format, load, foreachBatch, trigger, start
        if name == "awaitTermination":
            def wait() -> None:
                if self.failure is not None:
                    raise self.failure
            return wait
        return lambda *args, **kwargs: self


def test_register_leaves_alone_the_formats_spark_found_itself() -> None:
    from kestrel.pipeline import register

    found = FakeSession({"kestrel", "kestrel-journal"})  # installed: Spark's lookup found both
    register(found)
    assert found.registered == []  # re-registering each would replace it, warning each time
    missing = FakeSession({"kestrel"})
    register(missing)
    assert missing.registered == ["kestrel-journal"]


def test_drain_removes_its_temporary_checkpoint_unless_it_holds_items(monkeypatch: pytest.MonkeyPatch) -> None:
    from kestrel.pipeline import drain, wal

    done = FakeSession(set())
    drain(done, "127.0.0.1:1", "q", lambda batch, batch_id: None)
    (location,) = set(done.locations)
    assert Path(location).name.startswith("kestrel-drain-") and not Path(location).exists()

    failed = FakeSession(set(), RuntimeError("the sink failed"))
    with pytest.raises(RuntimeError):
        drain(failed, "127.0.0.1:1", "q", lambda batch, batch_id: None)
    assert not Path(failed.locations[0]).exists()  # its items went back to their queues

    held = FakeSession(set(), RuntimeError("the sink failed late"))
    monkeypatch.setattr(wal, "held_early", lambda location: 3)
    with pytest.raises(RuntimeError) as err:
        drain(held, "127.0.0.1:1", "q", lambda batch, batch_id: None)
    kept = Path(held.locations[0])
    try:
        assert kept.is_dir() and repr(str(kept)) in "".join(err.value.__notes__)  # named, and there
    finally:
        kept.rmdir()


def test_drain_refuses_a_write_that_is_not_a_function_before_spark_runs_it() -> None:
    from kestrel.pipeline.drain import drain

    with pytest.raises(TypeError, match="write must be a function of \\(batch_df, batch_id\\), got None"):
        drain(object(), "127.0.0.1:1", "q", None)  # type: ignore[arg-type]  # (no Spark session needed)


def test_a_record_cut_short_before_the_next_file_is_damage_and_at_the_end_of_the_last_torn(
        tmp_path: Path) -> None:
    """The one torn-tail rule, as the server's start-up keeps it: torn only in a queue's last file."""
    from kestrel.pipeline.journal_source import record_batches
    from kestrel.storage.kestrel2 import codec

    path = tmp_path / "q.1700000000000"
    path.write_bytes(b"".join(codec.encode(codec.AddX(1_700_000_000_000, 0, b"item %d" % n)) for n in range(3))[:-4])
    for last, status in [(True, "torn"), (False, "corrupt: ")]:
        rows = [row for batch in record_batches("q", str(path), False, last=last) for row in batch.to_pylist()]
        assert [row["status"] for row in rows[:2]] == ["ok", "ok"]
        assert rows[2]["status"].startswith(status) and rows[2]["offset"] == 2 * rows[1]["offset"]


def test_kestrel3_queues_are_refused_at_planning_naming_them(tmp_path: Path) -> None:
    """A Kestrel 3 queue's writer files were read as Kestrel 2 journals: rows of damage ("unknown
    opcode 39" at offset 0) or, in the items view, no items and an executor's log line."""
    from kestrel.pipeline.journal_source import JournalReader
    from tests.support.queues import open_collection

    coll = open_collection(tmp_path, queues={"new": {"journal_format": "kestrel3"}})
    coll.put("old", [b"x"])
    coll.put("new", [b"x"])
    coll.close()
    for view in ("records", "items"):
        with pytest.raises(ValueError, match=f"reads Kestrel 2 journals, and these queues are Kestrel 3's "
                                             f"\\(journal_format: kestrel3\\): {tmp_path / 'new'}\\. Read a copy "
                                             f"of the queue path converted with `kestrel journal convert --to "
                                             f"kestrel2`, or leave them out with the option queue"):
            JournalReader([str(tmp_path)], view, False, None, 1 << 20).partitions()
        (kept,) = JournalReader([str(tmp_path)], view, False, {"old"}, 1 << 20).partitions()
        assert kept.queue == "old"  # type: ignore[attr-defined]


@pytest.mark.parametrize("zone", ["Pacific/Kiritimati", "Etc/GMT+12", "America/Los_Angeles", "UTC"])
def test_the_ends_of_the_times_shown_convert_in_any_time_zone(zone: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Spark's collect converts a time in the driver's local zone: the ends of the years 1 to 9999
    themselves fail there as year 0 or 10000, and so does a day inside them (Python's conversion
    looks a day further)."""
    from pyspark.sql.types import TimestampType

    from kestrel.pipeline.rows import timestamps

    monkeypatch.setenv("TZ", zone)
    time.tzset()
    try:
        shown = timestamps([-2**63, 2**63 - 1, 0, 1_700_000_000_000]).cast("int64").to_pylist()
        assert [None if t is None else TimestampType().fromInternal(t).year for t in shown] == [1, 9999, None, 2023]
    finally:
        monkeypatch.undo()
        time.tzset()


def test_the_items_view_of_a_torn_journal_says_so(tmp_path: Path) -> None:
    """The items view showed a torn journal's items with no word, in FAILFAST too, where the records
    view shows a row `torn` or fails the job."""
    from structlog.testing import capture_logs

    from kestrel.pipeline.journal_source import item_batches
    from kestrel.storage.errors import CorruptJournalError
    from kestrel.storage.kestrel2 import codec

    whole = b"".join(codec.encode(codec.AddX(1_700_000_000_000, 0, b"item %d" % n)) for n in range(2))
    # The first item opened, then its confirm cut short: the read is open, as the next start loads it.
    (tmp_path / "q").write_bytes(whole + codec.encode(codec.RemoveTentative()) + codec.encode(codec.ConfirmRemove(1))[:3])
    with pytest.raises(CorruptJournalError, match=f"at offset {len(whole) + 1} .*torn \\(mode FAILFAST\\)"):
        list(item_batches("q", str(tmp_path), True))
    with capture_logs() as logs:
        rows = [row for batch in item_batches("q", str(tmp_path), False) for row in batch.to_pylist()]
    assert [(row["data"], row["open"]) for row in rows] == [(b"item 0", True), (b"item 1", False)]
    (torn,) = [e for e in logs if e["event"].startswith("torn journal")]
    assert torn["file"] == str(tmp_path / "q") and torn["offset"] == len(whole) + 1


def test_the_items_view_reads_a_queue_again_when_a_server_rotated_it_under_the_reading(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kestrel.pipeline.journal_source import item_batches
    from kestrel.storage import settled_read
    from kestrel.storage.kestrel2 import codec
    from kestrel.storage.kestrel2 import replay as kestrel2_replay

    monkeypatch.setattr(settled_read, "SETTLE_PAUSE_S", 0)
    (tmp_path / "q").write_bytes(b"".join(codec.encode(codec.AddX(1_700_000_000_000, 0, d)) for d in (b"a", b"b")))
    listed = kestrel2_replay.replay_files
    readings: list[list[str]] = []

    def listed_then_rotated(queue_path: str, queue: str) -> list[str]:
        paths = listed(queue_path, queue)
        readings.append(paths)
        if len(readings) == 1:  # as a server rotating between the listing and the reading
            os.rename(tmp_path / "q", tmp_path / "q.1700000000001")
            (tmp_path / "q").write_bytes(codec.encode(codec.Remove()))
        return paths

    monkeypatch.setattr(kestrel2_replay, "replay_files", listed_then_rotated)
    rows = [row for batch in item_batches("q", str(tmp_path), True) for row in batch.to_pylist()]
    assert [row["data"] for row in rows] == [b"b"] and len(readings) == 2


def test_reads_are_judged_by_the_auto_abort_they_were_opened_with(tmp_path: Path) -> None:
    """A query restarted with a lower autoAbortMs judged reads opened with 600,000 ms by its 5,000,
    and warned that their items were delivered again although they were still open."""
    path = str(tmp_path / "0" / "s-0")
    os.makedirs(os.path.dirname(path))
    header = wal.WalHeader("h:1", 1000.0, 1, "jobs", auto_abort_ms=600_000)
    assert wal.write_partition(path, header, [7], wal.Logged([b"x"], [0], [0]))
    logged, _ = wal.read_ids(path)
    assert logged.returned_at(5_000) == 1600.0
    earlier = wal.WalHeader("h:1", 1000.0, 1, "jobs")  # a file of a version that did not record it
    assert earlier.returned_at(5_000) == 1005.0


def test_a_sigterm_ends_the_stream_source_s_runner_unless_its_stop_has_begun(monkeypatch: pytest.MonkeyPatch) -> None:
    """Spark ends a stopped query's source process with SIGTERM as it closes the runner's input: the
    signal unwinds the runner through the source's stop(), which confirms what the sink committed;
    one that lands while that stop() runs (begun by the end of the input) lets it finish, where its
    SystemExit cut the confirms short and the committed batch came back after autoAbortMs. Spark
    sends a second SIGTERM as it stops the source's workers: one landing between the first and the
    stop()'s beginning lets it begin (it raised again, and the stop() never ran)."""
    from kestrel.pipeline import worker

    monkeypatch.setattr(worker, "_main_module", lambda: "pyspark.sql.streaming.python_streaming_source_runner")
    monkeypatch.setattr(worker, "_stopping", False)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        worker.stop_source_when_terminated()
        with pytest.raises(SystemExit) as ended:
            signal.raise_signal(signal.SIGTERM)
        assert ended.value.code == 128 + signal.SIGTERM
        signal.raise_signal(signal.SIGTERM)  # Spark's second, before the runner reaches stop()
        worker.source_stopping()
        signal.raise_signal(signal.SIGTERM)  # the stop goes on
    finally:
        signal.signal(signal.SIGTERM, previous)
    monkeypatch.setattr(worker, "_stopping", False)  # and a stop() begun by the end of the runner's input
    try:
        worker.stop_source_when_terminated()
        worker.source_stopping()
        signal.raise_signal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, previous)
