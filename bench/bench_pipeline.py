"""Spark pipeline throughput, each figure beside a plain Python loop doing the same work in the same run.

- writer into 1 and 3 servers: `df.write.format("kestrel")` against one thriftpy2 client putting the
  same batches into one server;
- streaming: a `Trigger.AvailableNow` stream into a counting sink against one client taking the same
  items as open reads and confirming them;
- journal: `spark.read.format("kestrel-journal")` counting records against a loop over
  kestrel.storage.kestrel2.reader.read_journal on the same files (and one over the reader's fast path),
  and against what Spark alone costs for a Python source's Arrow batches.

    .venv/bin/python -m bench.bench_pipeline [--rows N] [--journal-mb M] [--only journal ...]
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
from bench.common import load_average, machine


@contextlib.contextmanager
def servers(count: int, work: str) -> Iterator[list[int]]:
    """`count` servers of this checkout, started as the other benchmarks start them; their Thrift ports."""
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(peers.kestrel(Path(work)))["thrift"] for _ in range(count)]


def thrift_client(port: int) -> Any:
    from thriftpy2.rpc import make_client
    from thriftpy2.transport import TFramedTransportFactory

    from kestrel.contract import kestrel_thrift

    return make_client(kestrel_thrift.Kestrel, "127.0.0.1", port, trans_factory=TFramedTransportFactory())


def timed(work: Any) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def bench_writer(spark: Any, n: int, payload: str, work: str) -> None:
    df = spark.range(0, n, numPartitions=4).selectExpr(f"'{payload}' as data").cache()
    df.count()
    batch = [payload.encode()] * 1000
    for count in (1, 3):
        with servers(count, work) as ports:
            target = ",".join(f"127.0.0.1:{p}" for p in ports)
            df.limit(1000).write.format("kestrel").option("servers", target).option("queue", "warmup") \
                .mode("append").save()  # starts the Python workers outside the timing
            spark_s = timed(lambda: df.write.format("kestrel").option("servers", target)  # noqa: B023
                            .option("queue", "bench").option("batchSize", 1000).mode("append").save())
            client = thrift_client(ports[0])
            plain_s = timed(lambda: [client.put("plain", batch, 0) for _ in range(n // 1000)])  # noqa: B023
            client.close()
            print(f"writer into {count} server(s): spark {n / spark_s:,.0f} rows/s, plain loop into one "
                  f"{n / plain_s:,.0f} rows/s, ratio {plain_s / spark_s:.2f}")


def bench_stream(spark: Any, n: int, payload: str, work: str) -> None:
    batch = [payload.encode()] * 1000
    with servers(1, work) as (port,):
        client = thrift_client(port)
        for _ in range(n // 1000):
            client.put("stream", batch, 0)
            client.put("plain", batch, 0)
        checkpoint = tempfile.mkdtemp(prefix="kestrel-bench-cp-", dir=work)
        seen = [0]

        def count(df: Any, _: int) -> None:
            seen[0] += df.count()

        def run_stream() -> None:
            (spark.readStream.format("kestrel").option("servers", f"127.0.0.1:{port}")
             .option("queue", "stream").option("checkpointLocation", checkpoint)
             .option("maxItemsPerTrigger", 50_000).load()
             .writeStream.foreachBatch(count).option("checkpointLocation", checkpoint)
             .trigger(availableNow=True).start().awaitTermination())

        spark_s = timed(run_stream)

        def plain() -> None:
            while got := client.get("plain", 1000, 0, 60_000):
                client.confirm("plain", {item.id for item in got})

        plain_s = timed(plain)
        client.close()
        print(f"streaming ({seen[0]:,} rows, AvailableNow, 50,000 per trigger): "
              f"spark {n / spark_s:,.0f} rows/s, plain get+confirm loop {n / plain_s:,.0f} rows/s, "
              f"ratio {plain_s / spark_s:.2f}")


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--journal-mb", type=int, default=200)
    parser.add_argument("--runs", type=int, default=3, help="journal read: best of this many runs")
    parser.add_argument("--unix-sockets", choices=("true", "false"), default="true",
                        help="spark.python.unix.domain.socket.enabled (Python workers over Unix sockets)")
    parser.add_argument("--only", choices=("writer", "stream", "journal"), action="append",
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
    print(f"# pipeline benchmark, {time.strftime('%Y-%m-%d')}, {machine()}, {args.rows:,} rows of 64 B, "
          f"batches of 1000, Spark {spark.version} local[2], Python workers over "
          f"{'Unix' if args.unix_sockets == 'true' else 'TCP'} sockets")
    work = tempfile.mkdtemp(prefix="kestrel-bench-")
    try:
        parts = args.only or ["writer", "stream", "journal"]
        if "writer" in parts:
            bench_writer(spark, args.rows, payload, work)
        if "stream" in parts:
            bench_stream(spark, args.rows, payload, work)
        if "journal" in parts:
            bench_journal(spark, args.journal_mb, work, args.runs)
    finally:
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
