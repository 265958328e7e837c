"""The Spark data sources in local mode against real servers (one SparkSession for the module)."""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pyspark = pytest.importorskip("pyspark", reason="pyspark is installed by `make test` (the spark extra)")

from thriftpy2.rpc import make_client  # noqa: E402
from thriftpy2.transport import TFramedTransportFactory  # noqa: E402

from contract import kestrel_thrift as kestrel  # noqa: E402
from tests.conftest import ServerProcess  # noqa: E402


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.skip("Spark needs Java (17) on the machine")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYSPARK_DRIVER_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    from pipeline import register

    session = (SparkSession.builder.master("local[2]").appName("kestrel-tests")
               .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "2")
               .config("spark.driver.memory", "1g").getOrCreate())
    session.sparkContext.setLogLevel("ERROR")
    register(session)
    yield session
    session.stop()


def client(srv: ServerProcess) -> Any:
    return make_client(kestrel.Kestrel, "127.0.0.1", srv.thrift_port, trans_factory=TFramedTransportFactory())


def test_journal_rows_equal_what_was_put_in_order(spark: Any, server: ServerProcess, tmp_path: Path) -> None:
    c = client(server)
    c.put("audit", [b"a", b"b", b"c"], 0)
    opened = c.get("audit", 1, 0, 60_000)
    c.confirm("audit", {opened[0].id})
    c.close()
    rows = (spark.read.format("kestrel-journal").load(str(server.queue_path))
            .where("queue = 'audit'").orderBy("offset").collect())
    assert [r.opcode for r in rows] == ["ADDX", "ADDX", "ADDX", "REMOVE_TENTATIVE_XID", "CONFIRM_REMOVE"]
    assert [r.data for r in rows[:3]] == [b"a", b"b", b"c"]
    assert rows[3].xid == rows[4].xid == 1 and all(r.status == "ok" for r in rows)


def test_torn_tail_is_a_row_status(spark: Any, tmp_path: Path) -> None:
    from storage.codec import encode_addx

    content = encode_addx(1, 0, b"whole") + encode_addx(1, 0, b"torn")[:9]
    (tmp_path / "q").write_bytes(content)
    rows = spark.read.format("kestrel-journal").load(str(tmp_path)).orderBy("offset").collect()
    assert [(r.opcode, r.status) for r in rows] == [("ADDX", "ok"), (None, "torn")]
    assert (tmp_path / "q").read_bytes() == content  # the operator's file is untouched


def test_items_mode_equals_what_the_server_serves_after_restart(spark: Any, server: ServerProcess) -> None:
    c = client(server)
    c.put("work", [b"one", b"two", b"three"], 0)
    c.get("work", 1, 0, 0)  # "one" gone for good
    c.get("work", 1, 0, 600_000)  # "two" open at the time of the copy
    c.close()
    items = (spark.read.format("kestrel-journal").option("mode", "items").load(str(server.queue_path))
             .where("queue = 'work'").orderBy("position").collect())
    assert [(r.data, r.open) for r in items] == [(b"two", True), (b"three", False)]
    server.restart()
    c = client(server)
    served = [i.data for i in c.get("work", 10, 0, 0)]
    c.close()
    assert served == [r.data for r in items]


def test_write_then_drain_round_trips_every_row_once(spark: Any, server_factory: Any) -> None:
    a, b = server_factory(name="a"), server_factory(name="b")
    servers = f"127.0.0.1:{a.thrift_port},127.0.0.1:{b.thrift_port}"
    df = spark.range(0, 5000, numPartitions=4).selectExpr("cast(id as string) as data")
    df.write.format("kestrel").option("servers", servers).option("queue", "rt").option("batch_size", 100) \
        .mode("append").save()
    ca, cb = client(a), client(b)
    assert ca.peek("rt").items > 0 and cb.peek("rt").items > 0  # spread over both servers
    drained = (spark.read.format("kestrel").option("servers", servers).option("queue", "rt")
               .option("max_items", 10_000).load().collect())
    assert sorted(int(r.data) for r in drained) == list(range(5000))
    assert ca.peek("rt").items == 0 and cb.peek("rt").items == 0
    assert ca.peek("rt").open_transactions == 0
    ca.close()
    cb.close()


def test_full_queue_fails_the_job_or_is_counted(spark: Any, server_factory: Any) -> None:
    srv = server_factory({"queues": {"small": {"max_items": 10}}})
    servers = f"127.0.0.1:{srv.thrift_port}"
    df = spark.range(0, 50, numPartitions=1).selectExpr("cast(id as string) as data")
    with pytest.raises(Exception, match="is full"):
        df.write.format("kestrel").option("servers", servers).option("queue", "small").mode("append").save()
    df.write.format("kestrel").option("servers", servers).option("queue", "small") \
        .option("on_full", "count").mode("append").save()
    c = client(srv)
    assert c.peek("small").items == 10
    c.close()


def test_stream_redelivers_the_items_of_a_failed_batch(spark: Any, server_factory: Any, tmp_path: Path) -> None:
    # A per-connection cap far below the batch size: batches must still fill and never stall.
    server = server_factory({"max_open_reads": 3})
    c = client(server)
    c.put("events", [b"e%d" % i for i in range(20)], 0)
    servers = f"127.0.0.1:{server.thrift_port}"

    def stream(auto_abort_ms: int) -> Any:
        return (spark.readStream.format("kestrel").option("servers", servers).option("queue", "events")
                .option("max_batch_items", 8).option("auto_abort_ms", auto_abort_ms).load())

    def fail(batch: Any, batch_id: int) -> None:
        raise RuntimeError("sink down")

    query = stream(1500).writeStream.foreachBatch(fail).option("checkpointLocation", str(tmp_path / "cp1")).start()
    from pyspark.errors import StreamingQueryException

    with pytest.raises(StreamingQueryException, match="sink down"):
        query.awaitTermination(60)
    query.stop()
    deadline = time.monotonic() + 15
    while (info := c.peek("events")).open_transactions and time.monotonic() < deadline:
        time.sleep(0.2)
    assert info.items == 20 and info.open_transactions == 0  # the failed batch came back

    seen: list[bytes] = []
    query = (stream(4000).writeStream.option("checkpointLocation", str(tmp_path / "cp2"))
             .foreachBatch(lambda batch, _: seen.extend(r.data for r in batch.collect())).start())
    query.processAllAvailable()
    query.stop()
    assert set(seen) == {b"e%d" % i for i in range(20)}  # every item, at least once
    # Spark commits a batch to its source when it plans the next one, so the last batch was never
    # committed: its open reads come back (auto-abort) to be delivered again (at-least-once).
    deadline = time.monotonic() + 15
    while (info := c.peek("events")).open_transactions and time.monotonic() < deadline:
        time.sleep(0.2)
    assert info.open_transactions == 0 and info.items <= 8
    left = [i.data for i in c.get("events", 100, 0, 0)]
    assert set(left) <= set(seen)
    c.close()
