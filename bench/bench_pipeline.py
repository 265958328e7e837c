"""Spark pipeline throughput: the writer into one and into three servers, and journal reading.

Each figure stands beside a plain single-process Python loop doing the same work in the same run:
a thriftpy2 client putting the same batches, and a loop over storage.journal.read_records.

    .venv/bin/python -m bench.bench_pipeline [--rows N]
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

from bench import peers
from bench.common import machine


@contextlib.contextmanager
def servers(count: int, work: Path) -> Iterator[list[peers.Running]]:
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(peers.kestrel(work)) for _ in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=200_000)
    args = parser.parse_args()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession
    from thriftpy2.rpc import make_client
    from thriftpy2.transport import TFramedTransportFactory

    from contract import kestrel_thrift as idl
    from pipeline import register
    from storage.journal import read_records
    spark = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false").getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    n = args.rows
    payload = "x" * 64
    print(f"# pipeline benchmark, {time.strftime('%Y-%m-%d')}, {machine()}, {n:,} rows of 64 B, "
          f"batches of 1000, Spark local[2]")
    work = Path(tempfile.mkdtemp(prefix="kestrel-bench-"))
    try:
        for count in (1, 3):
            with servers(count, work) as running:
                ports = [server["thrift"] for server in running]
                if count == 1:
                    queue_path = running[0].home / "queues"
                df = spark.range(0, n, numPartitions=4).selectExpr(f"'{payload}' as data").cache()
                df.count()
                target = ",".join(f"127.0.0.1:{p}" for p in ports)
                df.limit(1000).write.format("kestrel").option("servers", target).option("queue", "warmup") \
                    .mode("append").save()  # starts the Python workers outside the timing
                started = time.perf_counter()
                df.write.format("kestrel").option("servers", target) \
                    .option("queue", "bench").option("batch_size", 1000).mode("append").save()
                spark_rate = n / (time.perf_counter() - started)
                client = make_client(idl.Kestrel, "127.0.0.1", ports[0],
                                     trans_factory=TFramedTransportFactory())
                batch = [payload.encode()] * 1000
                started = time.perf_counter()
                for _ in range(n // 1000):
                    client.put("plain", batch, 0)
                plain_rate = n / (time.perf_counter() - started)
                client.close()
                print(f"writer into {count} server(s): spark {spark_rate:,.0f} rows/s, "
                      f"plain loop into one {plain_rate:,.0f} rows/s, ratio {spark_rate / plain_rate:.2f}")
        size = sum(f.stat().st_size for f in queue_path.iterdir() if f.is_file())
        started = time.perf_counter()
        rows = spark.read.format("kestrel-journal").load(str(queue_path)).count()
        spark_mb = size / (time.perf_counter() - started) / 1e6
        started = time.perf_counter()
        plain = sum(1 for f in queue_path.iterdir() if f.is_file() and "." not in f.name
                    for _ in read_records(str(f)))
        plain_mb = size / (time.perf_counter() - started) / 1e6
        print(f"journal read ({size / 1e6:.1f} MB, {rows:,} records): spark {spark_mb:.1f} MB/s, "
              f"plain loop {plain_mb:.1f} MB/s ({plain:,} records), ratio {spark_mb / plain_mb:.2f}")
    finally:
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
