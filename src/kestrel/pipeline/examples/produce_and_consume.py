"""Produce rows from a DataFrame into a queue, consume them with a streaming query into Parquet, count.

Start a server first (`make run`, or `kestrel serve`), then:

    .venv/bin/python src/kestrel/pipeline/examples/produce_and_consume.py --servers 127.0.0.1:2229 --rows
    1000000
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from pyspark.sql import SparkSession

from kestrel.pipeline import register


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", default="127.0.0.1:2229")
    parser.add_argument("--queue", default="example")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--out", default=None, help="Parquet directory (default: a temporary one)")
    args = parser.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="kestrel-example-")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

    spark = SparkSession.builder.master("local[2]").appName("kestrel-example") \
        .config("spark.ui.enabled", "false") \
        .config("spark.python.unix.domain.socket.enabled", "true").getOrCreate()  # see README, Performance
    spark.sparkContext.setLogLevel("WARN")
    register(spark)

    started = time.monotonic()
    rows = spark.range(0, args.rows, numPartitions=8).selectExpr("concat('job-', cast(id as string)) as data")
    rows.write.format("kestrel").option("servers", args.servers).option("queue", args.queue) \
        .option("batchSize", 1000).mode("append").save()
    print(f"produced {args.rows:,} rows in {time.monotonic() - started:.1f}s")

    started = time.monotonic()
    checkpoint = os.path.join(out, "checkpoint")
    stream = spark.readStream.format("kestrel").option("servers", args.servers).option("queue", args.queue) \
        .option("checkpointLocation", checkpoint).option("maxItemsPerTrigger", 100_000).load()
    query = stream.selectExpr("cast(data as string) as data").writeStream.format("parquet") \
        .option("path", os.path.join(out, "data")).option("checkpointLocation", checkpoint) \
        .trigger(availableNow=True).start()
    query.awaitTermination()
    count = spark.read.parquet(os.path.join(out, "data")).distinct().count()
    print(f"consumed {count:,} distinct rows into {out} in {time.monotonic() - started:.1f}s")
    spark.stop()


if __name__ == "__main__":
    main()
