"""Spark pipeline throughput, each figure beside a plain Python loop doing the same work in the same run.

- writer into 1 and 3 servers: `df.write.format("kestrel")` against a loop putting the same rows, in
  batches of the same size, through the project's client (`kestrel.client.Cluster.put_many`);
- batch read: `spark.read.format("kestrel")` counting a queue's items, left in place, against a loop
  through the client looking at the same items (`Server.peek_items`, 10,000 a call, as the source does);
- streaming: a `Trigger.AvailableNow` stream into a counting sink against a loop through the client
  taking the same items as open reads with their times (`Server.get_timed`) and confirming them;
- journal: `spark.read.format("kestrel-journal")` counting records against a loop over
  kestrel.storage.kestrel2.reader.read_journal on the same files (and one over the reader's fast path),
  and against what Spark alone costs for a Python source's Arrow batches.

Beside the writer and the stream, Spark's own floor in the same runs: a Python writer that only
receives the rows, and a Python streaming source that yields the same rows ready-made, in the same
batches and partitions (no server): what no source or writer of ours can go below.

The Spark and plain sides take turns, best of `--runs` each, so that both meet the same moments of
the machine's load; each run has queues of its own.

    .venv/bin/python -m bench.bench_pipeline [--rows N] [--journal-mb M] [--runs R] [--only journal ...]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench import peers
from bench.common import load_average, machine, process_cpu_seconds, threads_cpu_seconds, tree_cpu_seconds


@contextlib.contextmanager
def servers(count: int, work: str, build: str) -> Iterator[list[peers.Running]]:
    """`count` servers of this checkout in `build`, started as the other benchmarks start them."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(peers.kestrel(Path(work), build=build)) for _ in range(count)]


def timed(work: Any) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


class Cpu:
    """CPU seconds of each process a side of the writer's comparison runs in, over one timed run:
    the servers, Spark's JVM (its JIT compiler threads apart), its Python workers (every process
    under the JVM) and this process (the plain loop's client; for Spark, the driver's Python)."""

    PARTS = ("servers", "JVM", "JVM's JIT", "Python workers", "this process")

    def __init__(self, spark: Any) -> None:
        self.jvm = int(spark.sparkContext._gateway.proc.pid)
        self.runs: dict[str, list[dict[str, float]]] = {}

    def now(self, running: list[peers.Running]) -> dict[str, float]:
        jvm_own, jvm_all = tree_cpu_seconds(self.jvm)
        jit = threads_cpu_seconds(self.jvm, ("C1 CompilerThre", "C2 CompilerThre"))
        return {"servers": sum(process_cpu_seconds(r.pid) for r in running), "JVM": jvm_own - jit,
                "JVM's JIT": jit, "Python workers": jvm_all - jvm_own,
                "this process": process_cpu_seconds(os.getpid())}

    def timed(self, side: str, running: list[peers.Running], work: Any) -> float:
        before = self.now(running)
        seconds = timed(work)
        after = self.now(running)
        self.runs.setdefault(side, []).append({k: after[k] - before[k] for k in self.PARTS})
        return seconds

    def report(self, side: str, rows: int) -> str:
        """Per million rows, the range over the runs, of each process that spent any."""
        runs = self.runs.pop(side)
        cells = []
        for part in (*self.PARTS, "all"):
            spent = sorted(sum(r.values()) if part == "all" else r[part] for r in runs)
            low, high = spent[0] * 1e6 / rows, spent[-1] * 1e6 / rows
            if high >= 0.005:
                cells.append(f"{part} {low:.2f}–{high:.2f}")
        return f"  CPU s per million rows, {side}: " + ", ".join(cells)


def bench_writer(spark: Any, n: int, payload: str, work: str, build: str, runs: int, batch_size: int,
                 warm_up: int) -> None:
    from kestrel.client import Cluster, Server

    rows_expr = f"concat('{payload}', cast(id as string)) as data"
    df = spark.range(0, n, numPartitions=4).selectExpr(rows_expr).cache()
    df.count()
    rows = [b"%s%d" % (payload.encode(), i) for i in range(n)]
    spark.dataSource.register(NullSink)
    nothing = df.write.format("null-sink").mode("append")
    nothing.save()
    cpu = Cpu(spark)
    null_s = float("inf")
    for count in (1, 3):
        with servers(count, work, build) as running:
            target = ",".join(f"127.0.0.1:{r['thrift']}" for r in running)
            # Imports the writer's modules into each Python worker outside the timing (a task each).
            df.limit(1000).repartition(4).write.format("kestrel").option("servers", target) \
                .option("queue", "warmup").mode("append").save()
            if count == 1:
                # The JVM's JIT compiles for its first dozen jobs or so (0.1-0.3 CPU s a job at first):
                # untimed full-size jobs of both Spark sides first, so that it is not charged to the
                # side measured first. Their items are deleted after.
                for _ in range(warm_up):
                    df.write.format("kestrel").option("servers", target).option("queue", "warmup") \
                        .option("batchSize", batch_size).mode("append").save()
                    nothing.save()
                with Server("127.0.0.1", running[0]["thrift"]) as server:
                    server.call("delete_queue", "warmup")
            spark_s = plain_s = float("inf")
            for run in range(runs):
                writer = df.write.format("kestrel").option("servers", target).option("queue", f"spark{run}") \
                    .option("batchSize", batch_size).mode("append")
                spark_s = min(spark_s, cpu.timed("writer", running, writer.save))
                with Cluster([target.split(",")[0]]) as cluster:
                    def plain(cluster: Any = cluster, queue: str = f"plain{run}") -> None:
                        for i in range(0, n, batch_size):
                            cluster.put_many(queue, rows[i:i + batch_size])
                    plain_s = min(plain_s, cpu.timed("plain loop", running[:1], plain))
                if count == 1:
                    null_s = min(null_s, cpu.timed("Spark's floor", running, nothing.save))
            print(f"writer into {count} server(s), batches of {batch_size:,}: "
                  f"spark {n / spark_s:,.0f} rows/s, "
                  f"plain loop through the client into one {n / plain_s:,.0f} rows/s, "
                  f"ratio {plain_s / spark_s:.2f} (load average {load_average()})")
            if count == 1:
                print(f"  Spark's own floor (a Python writer that only receives the rows): "
                      f"{n / null_s:,.0f} rows/s ({null_s:.2f} s), ratio {plain_s / null_s:.2f}")
            for side in ("writer", "plain loop", "Spark's floor")[:3 if count == 1 else 2]:
                print(cpu.report(side, n))


def bench_read(spark: Any, n: int, payload: str, work: str, build: str, runs: int) -> None:
    from kestrel.client import Server

    with servers(1, work, build) as (running,), Server("127.0.0.1", running["thrift"]) as client:
        port = running["thrift"]
        for i in range(0, n, 10_000):
            client.put("look", [b"%s%d" % (payload.encode(), j) for j in range(i, min(n, i + 10_000))])
        read = spark.read.format("kestrel").option("servers", f"127.0.0.1:{port}").option("queue", "look") \
            .load()

        def plain() -> None:
            position, seen = 0, 0
            while at := client.peek_items("look", position, 10_000).shown:
                seen += len([item.data for item in at])
                position += len(at)
            assert seen == n, seen

        assert read.count() == n  # starts the Python workers outside the timing
        spark_s = plain_s = float("inf")
        for _ in range(runs):
            spark_s = min(spark_s, timed(read.count))
            plain_s = min(plain_s, timed(plain))
        print(f"batch read ({n:,} items, looked at, left in place): spark {n / spark_s:,.0f} rows/s, "
              f"plain peek_items loop through the client {n / plain_s:,.0f} rows/s, "
              f"ratio {plain_s / spark_s:.2f}")


def bench_stream(spark: Any, n: int, payload: str, work: str, build: str, runs: int, per_trigger: int,
                 per_partition: int | None) -> None:
    from kestrel.client import Server
    from kestrel.pipeline.stream_source import ITEMS_PER_PARTITION

    per_partition = per_partition or ITEMS_PER_PARTITION

    rows = [b"%s%d" % (payload.encode(), i) for i in range(n)]
    with servers(1, work, build) as (running,):
        port = running["thrift"]
        client = Server("127.0.0.1", port)
        seen = [0]

        def count(df: Any, _: int) -> None:
            seen[0] += df.count()

        def run_stream(queue: str, checkpoint: str) -> None:
            (spark.readStream.format("kestrel").option("servers", f"127.0.0.1:{port}")
             .option("queue", queue).option("checkpointLocation", checkpoint)
             .option("maxItemsPerTrigger", per_trigger).option("itemsPerPartition", per_partition).load()
             .writeStream.foreachBatch(count).option("checkpointLocation", checkpoint)
             .trigger(availableNow=True).start().awaitTermination())

        def plain(queue: str) -> None:
            while got := client.get_timed(queue, 1000, 0, 60_000):
                client.confirm(queue, {item.id for item in got})

        def run_ready(checkpoint: str) -> None:
            (spark.readStream.format("ready-stream").option("rows", n).option("perTrigger", per_trigger)
             .option("perPartition", per_partition).load()
             .writeStream.foreachBatch(count).option("checkpointLocation", checkpoint)
             .trigger(availableNow=True).start().awaitTermination())

        spark.dataSource.register(ReadyStream)
        for i in range(0, 1000, 1000):
            client.put("warmup", rows[i:i + 1000])
        run_stream("warmup", tempfile.mkdtemp(prefix="kestrel-bench-cp-", dir=work))  # workers started
        spark_s = plain_s = ready_s = float("inf")
        for run in range(runs):
            for i in range(0, n, 10_000):
                client.put(f"spark{run}", rows[i:i + 10_000])
                client.put(f"plain{run}", rows[i:i + 10_000])
            seen[0] = 0
            checkpoint = tempfile.mkdtemp(prefix="kestrel-bench-cp-", dir=work)
            spark_s = min(spark_s, timed(lambda: run_stream(f"spark{run}", checkpoint)))  # noqa: B023
            assert seen[0] == n, seen[0]
            plain_s = min(plain_s, timed(lambda: plain(f"plain{run}")))  # noqa: B023
            seen[0] = 0
            checkpoint = tempfile.mkdtemp(prefix="kestrel-bench-cp-", dir=work)
            ready_s = min(ready_s, timed(lambda: run_ready(checkpoint)))  # noqa: B023
            assert seen[0] == n, seen[0]
        client.close()
        print(f"streaming ({n:,} rows, AvailableNow, {per_trigger:,} per trigger, {per_partition:,} per "
              f"partition): "
              f"spark {n / spark_s:,.0f} rows/s, "
              f"plain get_timed + confirm loop through the client {n / plain_s:,.0f} rows/s, "
              f"ratio {plain_s / spark_s:.2f}")
        print(f"  Spark's own floor (a Python streaming source yielding the same rows ready-made, in the "
              f"same batches and partitions): {n / ready_s:,.0f} rows/s ({ready_s:.2f} s), "
              f"ratio {plain_s / ready_s:.2f}")


def read_all(path: str) -> int:
    """A plain loop over the storage reader (its general path, one record object each)."""
    from kestrel.storage.kestrel2.reader import read_journal

    return sum(1 for _ in read_journal(path))


def read_all_fast(path: str) -> int:
    """A plain loop over the storage reader's fast path for common records (what replay uses)."""
    from kestrel.storage.kestrel2.reader import JournalReader

    reader = JournalReader(path)
    count = 0
    try:
        while True:
            run = reader.common_run(64 << 20)
            if run:
                count += len(run)
            elif reader.next() is None:
                return count
            else:
                count += 1
    finally:
        reader.close()


def bench_journal(spark: Any, megabytes: int, work: str, runs: int) -> None:
    from kestrel.storage.kestrel2.codec import encode_addx

    folder = Path(work) / "journals"
    folder.mkdir()
    record = encode_addx(int(time.time() * 1000), 0, b"j" * 1024)
    per_file = (megabytes << 20) // 4 // len(record)
    for name in ("a", "b", "c", "d"):
        (folder / name).write_bytes(record * per_file)
    files = [str(f) for f in sorted(folder.iterdir())]
    size = sum(os.path.getsize(f) for f in files)
    reader = spark.read.format("kestrel-journal").load(str(folder))
    rows = reader.count()  # warms the workers
    spark.dataSource.register(ReadyBatches)
    ready = spark.read.format("ready-batches").option("rows", str(rows)).load()
    ready.count()
    # Interleaved, best of `runs` each, so that every side meets the same moments of load.
    spark_s = plain_s = fast_s = ready_s = float("inf")
    for _ in range(runs):
        spark_s = min(spark_s, timed(reader.count))
        plain_s = min(plain_s, timed(lambda: sum(read_all(f) for f in files)))
        fast_s = min(fast_s, timed(lambda: sum(read_all_fast(f) for f in files)))
        ready_s = min(ready_s, timed(ready.count))
    mb = size / 1e6
    print(f"journal read ({mb:.0f} MB in 4 files, {rows:,} records of 1 KB, best of {runs}, load average "
          f"{load_average()}):")
    print(f"  spark.read.format('kestrel-journal').count(): {mb / spark_s:,.0f} MB/s ({spark_s:.2f} s)")
    print(f"  plain loop over read_journal: {mb / plain_s:,.0f} MB/s ({plain_s:.2f} s), "
          f"ratio {plain_s / spark_s:.2f}")
    print(f"  plain loop over the reader's fast path (common_run): {mb / fast_s:,.0f} MB/s ({fast_s:.2f} s), "
          f"ratio {fast_s / spark_s:.2f}")
    print(f"  Spark's own ceiling (a Python source yielding the same volume as ready-made Arrow batches): "
          f"{mb / ready_s:,.0f} MB/s ({ready_s:.2f} s), ratio to the read_journal loop "
          f"{plain_s / ready_s:.2f}")


def _ready_batches() -> Any:
    """A source that parses nothing: what Spark alone costs for a Python source's Arrow batches."""
    from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition

    class Reader(DataSourceReader):
        def __init__(self, rows: int) -> None:
            self.rows = rows

        def partitions(self) -> list[InputPartition]:
            return [InputPartition(i) for i in range(4)]

        def read(self, partition: InputPartition) -> Iterator[Any]:
            import pyarrow as pa

            from kestrel.pipeline.journal_source import BYTES_PER_BATCH

            per_batch = BYTES_PER_BATCH // 1024  # batches the size the journal source yields
            data = pa.array([b"j" * 1024] * per_batch, pa.binary())
            batch = pa.RecordBatch.from_arrays([data], names=["data"])
            for _ in range(self.rows // 4 // per_batch):
                yield batch

    class Source(DataSource):
        @classmethod
        def name(cls) -> str:
            return "ready-batches"

        def schema(self) -> str:
            return "data binary"

        def reader(self, schema: Any) -> DataSourceReader:
            return Reader(int(self.options["rows"]))

    return Source


ReadyBatches = _ready_batches()


def _null_sink() -> Any:
    """A writer that receives the rows and does nothing: what Spark alone costs for a Python writer."""
    from pyspark.sql.datasource import DataSource, DataSourceArrowWriter, WriterCommitMessage

    class Writer(DataSourceArrowWriter):
        def write(self, iterator: Iterator[Any]) -> WriterCommitMessage:
            for _ in iterator:
                pass
            return WriterCommitMessage()

    class Sink(DataSource):
        @classmethod
        def name(cls) -> str:
            return "null-sink"

        def writer(self, schema: Any, overwrite: bool) -> Writer:
            return Writer()

    return Sink


NullSink = _null_sink()


def _ready_stream() -> Any:
    """A streaming source that holds its rows ready-made, cut into the kestrel stream's batches and
    partitions: what Spark alone costs for a Python streaming source under AvailableNow."""
    from pyspark.sql.datasource import DataSource, DataSourceStreamReader, InputPartition
    from pyspark.sql.streaming.datasource import ReadLimit, ReadMaxRows, SupportsTriggerAvailableNow

    class Part(InputPartition):
        def __init__(self, first: int, count: int) -> None:
            super().__init__(first)
            self.first, self.count = first, count

    class Reader(DataSourceStreamReader, SupportsTriggerAvailableNow):
        def __init__(self, rows: int, per_trigger: int, per_partition: int) -> None:
            self.rows, self.per_trigger, self.per_partition = rows, per_trigger, per_partition

        def initialOffset(self) -> dict[str, int]:
            return {"at": 0}

        def getDefaultReadLimit(self) -> ReadLimit:
            return ReadMaxRows(self.per_trigger)

        def prepareForTriggerAvailableNow(self) -> None:
            pass

        def latestOffset(self, start: dict[str, int], limit: ReadLimit) -> dict[str, int]:
            return {"at": min(self.rows, start["at"] + self.per_trigger)}

        def partitions(self, start: dict[str, int], end: dict[str, int]) -> list[InputPartition]:
            return [Part(first, min(self.per_partition, end["at"] - first))
                    for first in range(start["at"], end["at"], self.per_partition)]

        def read(self, partition: InputPartition) -> Iterator[Any]:
            import pyarrow as pa

            assert isinstance(partition, Part)
            payload = b"x" * 64
            for first in range(partition.first, partition.first + partition.count, 10_000):
                last = min(first + 10_000, partition.first + partition.count)
                yield pa.RecordBatch.from_arrays(
                    [pa.array([b"%s%d" % (payload, i) for i in range(first, last)], pa.binary())],
                    names=["data"])

        def commit(self, end: dict[str, int]) -> None:
            pass

    class Source(DataSource):
        @classmethod
        def name(cls) -> str:
            return "ready-stream"

        def schema(self) -> str:
            return "data binary"

        def streamReader(self, schema: Any) -> DataSourceStreamReader:
            o = self.options
            return Reader(int(o["rows"]), int(o["perTrigger"]), int(o["perPartition"]))

    return Source


ReadyStream = _ready_stream()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--journal-mb", type=int, default=200)
    parser.add_argument("--runs", type=int, default=3, help="best of this many runs")
    parser.add_argument("--build", choices=peers.BUILDS, default="compiled",
                        help="the servers' build (default: compiled, as the wheel installs it; "
                        "`make compiled` first)")
    parser.add_argument("--batch-size", type=int, default=10_000, help="writer: rows per put (batchSize)")
    parser.add_argument("--warm-up", type=int, default=3,
                        help="writer: untimed full-size jobs of the writer and of Spark's floor first, "
                        "for the JVM's JIT (0: none)")
    parser.add_argument("--per-trigger", type=int, default=500_000, help="stream: maxItemsPerTrigger")
    parser.add_argument("--per-partition", type=int, help="stream: itemsPerPartition (the source's default)")
    parser.add_argument("--unix-sockets", choices=("true", "false"), default="true",
                        help="spark.python.unix.domain.socket.enabled (Python workers over Unix sockets)")
    parser.add_argument("--only", choices=("writer", "read", "stream", "journal"), action="append",
                        help="run only these parts (repeatable); all by default")
    args = parser.parse_args()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.chdir(peers.ROOT)
    from pyspark.sql import SparkSession

    from kestrel.pipeline import register

    spark = (SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.python.unix.domain.socket.enabled", args.unix_sockets).getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    payload = "x" * 64
    print(f"# pipeline benchmark, {time.strftime('%Y-%m-%d')}, {machine()}, {args.rows:,} rows of about "
          f"70 B, Spark {spark.version} local[2], Python workers over "
          f"{'Unix' if args.unix_sockets == 'true' else 'TCP'} sockets; the servers' build: {args.build}")
    work = tempfile.mkdtemp(prefix="kestrel-bench-")
    try:
        parts = args.only or ["writer", "read", "stream", "journal"]
        if "writer" in parts:
            bench_writer(spark, args.rows, payload, work, args.build, args.runs, args.batch_size,
                         args.warm_up)
        if "read" in parts:
            bench_read(spark, args.rows, payload, work, args.build, args.runs)
        if "stream" in parts:
            bench_stream(spark, args.rows, payload, work, args.build, args.runs, args.per_trigger,
                         args.per_partition)
        if "journal" in parts:
            bench_journal(spark, args.journal_mb, work, args.runs)
    finally:
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
