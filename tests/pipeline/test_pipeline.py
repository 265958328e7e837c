"""The Spark data sources in local mode against real servers (one SparkSession for the whole run)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pyspark = pytest.importorskip("pyspark", reason="pyspark is installed by `make test` (the spark extra)")
# A deadline for a hung job, not a budget: on a loaded machine a Spark job takes minutes, and a time-out
# that interrupts a call into the JVM leaves the session unusable for every later test of its process.
pytestmark = pytest.mark.timeout(900)


from tests.conftest import ROOT, STALL_S, ServerProcess, free_port, wait_until  # noqa: E402
from tests.support.clients import every_item, thrift_client  # noqa: E402
from tests.support.system import need_java  # noqa: E402
from tests.support.wire import memcache_stats  # noqa: E402

# Settings for short jobs: a JVM that starts fast (C1 only), Python workers over Unix sockets,
# no web UI (no port to share between test processes), everything Spark writes under the test's
# own temporary folder, and a stream that looks for new data every 50 ms.
SPARK_SETTINGS = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "2",
    "spark.sql.adaptive.enabled": "false",
    "spark.driver.memory": "1g",
    "spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
    "spark.python.unix.domain.socket.enabled": "true",
    "spark.sql.streaming.pollingDelay": "50ms",
}


@pytest.fixture(scope="session")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One SparkSession for every test of this process; safe beside other test processes."""
    need_java()
    os.environ["KESTREL_SPARK_PYTHON"] = sys.executable
    # Every Python that Spark starts imports pyspark precompiled: the executors' workers
    # (PYSPARK_PYTHON) and the driver side's, which look up, create and plan data sources and run
    # streaming sources (PYSPARK_DRIVER_PYTHON; this process is the driver, so nothing else reads it).
    os.environ["PYSPARK_PYTHON"] = str(ROOT / "tests" / "support" / "spark_python.sh")
    os.environ["PYSPARK_DRIVER_PYTHON"] = os.environ["PYSPARK_PYTHON"]
    from pyspark.sql import SparkSession

    own = tmp_path_factory.mktemp("spark")
    builder = (SparkSession.builder.master("local[2]").appName("kestrel-tests")
               .config("spark.local.dir", str(own / "local"))
               .config("spark.sql.warehouse.dir", str(own / "warehouse")))
    for key, value in SPARK_SETTINGS.items():
        builder = builder.config(key, value)
    # The JVM, and every Python worker it starts, runs from a folder of its own, not the repository's
    # root: Spark's data source lookup finds the pyspark_* modules through the install alone.
    here = os.getcwd()
    os.chdir(own)
    try:
        session = builder.getOrCreate()
    finally:
        os.chdir(here)
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture(autouse=True)
def spark_active(spark: Any) -> None:
    """The shared session active on the JVM thread that serves this test's calls, as it is in a
    driver that has just created it. Spark 4.3 looks a Python sink up, a batch write's `save()` as a
    stream's `start()`, through that thread's active session (DataSource.lookupDataSource), not the
    DataFrame's own; after some earlier tests of the process (a write that rode out a server's
    restart, streams) the thread had none, and the next write failed with DATA_SOURCE_NOT_FOUND."""
    spark._jvm.SparkSession.setActiveSession(spark._jsparkSession)


def client(srv: ServerProcess) -> Any:
    # thriftpy2's default of 3 s ran out once on a machine loaded by two test runs and their Spark
    # JVMs, just after the server had restarted.
    return thrift_client(srv.thrift_port, timeout_ms=30_000)


def address(*servers: ServerProcess) -> str:
    return ",".join(f"127.0.0.1:{s.thrift_port}" for s in servers)


def waiting(srv: ServerProcess, queue: str) -> tuple[int, int]:
    """(items, open reads) of a queue."""
    c = client(srv)
    try:
        info = c.peek(queue)
        return info.items, info.open_transactions
    finally:
        c.close()


def put(srv: ServerProcess, queue: str, items: list[bytes]) -> None:
    c = client(srv)
    for first in range(0, len(items), 5000):
        c.put(queue, items[first:first + 5000], 0)
    c.close()


def take_all(srv: ServerProcess, queue: str) -> list[bytes]:
    c = client(srv)
    try:
        return every_item(c, queue)
    finally:
        c.close()


def connections_made(srv: ServerProcess) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.admin_port}/stats.json", timeout=5) as r:
        return int(json.load(r)["server"]["total_connections"])


# ---------------------------------------------------------------------------------------------
# Batch reads look without taking; draining is an explicit write


def test_formats_are_found_without_register(spark: Any, server: ServerProcess) -> None:
    # The fixture never calls register(): Spark finds pyspark_kestrel and pyspark_kestrel_journal in
    # the editable install's one directory on sys.path, though its JVM runs outside the repository.
    put(server, "found", [b"x"])
    assert spark.read.format("kestrel").option("servers", address(server)).option("queue", "found") \
        .load().count() == 1
    from kestrel.pipeline import register

    # Registering by hand as well does no harm; in a session of its own, since a registered source
    # gets Python workers of its own, which every later test of this session would start again.
    register(spark.newSession())
    assert waiting(server, "found") == (1, 0)


def test_actions_that_discard_rows_leave_every_item(spark: Any, server_factory: Any) -> None:
    a, b = server_factory(name="a"), server_factory(name="b")
    put(a, "keep", [b"a%d" % i for i in range(800)])
    put(b, "keep", [b"b%d" % i for i in range(800)])
    df = spark.read.format("kestrel").option("servers", address(a, b)).option("queue", "keep").load()
    assert df.count() == 1600
    assert df.count() == 1600
    df.show(3)
    assert len(df.take(5)) == 5
    assert len(df.limit(10).collect()) == 10
    assert df.first() is not None
    assert not df.isEmpty()
    assert df.rdd.getNumPartitions() >= 2  # at least one partition per server
    assert sorted(r.data for r in df.where("server like '%'").collect()) == \
        sorted([b"a%d" % i for i in range(800)] + [b"b%d" % i for i in range(800)])
    assert waiting(a, "keep") == (800, 0) and waiting(b, "keep") == (800, 0)
    assert take_all(a, "keep") == [b"a%d" % i for i in range(800)]  # and in their order

    # A server that is down fails the read, naming it, instead of counting as an empty queue; what the
    # other server showed goes back (at once, or after autoAbortMs if Spark killed its task midway).
    gone = f"127.0.0.1:{free_port()}"
    partial = spark.read.format("kestrel").option("servers", f"{address(b)},{gone}").option("queue", "keep") \
        .load()
    with pytest.raises(Exception, match=f"server {gone} could not list its queues"):
        partial.count()
    assert waiting(b, "keep") == (800, 0)


def queue_stats(srv: ServerProcess, queue: str) -> dict[str, Any]:
    """A queue's figures but those time moves (how long its head has waited)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{srv.admin_port}/stats.json", timeout=5) as r:
        return {k: v for k, v in json.load(r)["queues"][queue].items() if not k.endswith("_wait_ms")}


POISON_QUEUES = {"queues": {
    "k2": {"max_errors": 2},  # poison dropped
    "k3": {"max_errors": 2, "error_queue": "k3_failed", "journal_format": "kestrel3"},
}}


def test_batch_reads_never_destroy_items_of_queues_with_poison_settings(spark: Any, server_factory: Any) -> None:
    srv = server_factory(POISON_QUEUES)
    for queue in ("k2", "k3"):
        put(srv, queue, [b"%s-%d" % (queue.encode(), i) for i in range(50)])
    before = {queue: queue_stats(srv, queue) for queue in ("k2", "k3")}
    df = spark.read.format("kestrel").option("servers", address(srv)).option("queue", "k2,k3").load()
    for _ in range(3):  # each item looked at more often than max_errors
        df.show(2)
        assert df.count() == 100
    assert sorted(r.data for r in df.collect()) == sorted(b"%s-%d" % (q, i) for q in (b"k2", b"k3")
                                                          for i in range(50))
    after = {queue: queue_stats(srv, queue) for queue in ("k2", "k3")}
    for queue in ("k2", "k3"):  # no counter moved: a look is no delivery
        assert after[queue] == before[queue], (queue, before[queue], after[queue])
    assert queue_names(srv) == ["k2", "k3"]  # nothing poisoned into the error queue
    assert take_all(srv, "k2") == [b"k2-%d" % i for i in range(50)]  # and in their order
    assert take_all(srv, "k3") == [b"k3-%d" % i for i in range(50)]


def test_batch_read_takes_the_whole_queue_or_refuses_naming_max_items(spark: Any, server: ServerProcess) -> None:
    put(server, "deep", [b"%d" % i for i in range(25_000)])
    df = spark.read.format("kestrel").option("servers", address(server)).option("queue", "deep").load()
    assert df.count() == 25_000
    assert df.rdd.getNumPartitions() == 3  # itemsPerPartition, 10,000
    assert df.select("data").distinct().count() == 25_000
    capped = spark.read.format("kestrel").option("servers", address(server)).option("queue", "deep") \
        .option("maxItems", 10_000).load()
    with pytest.raises(Exception, match="the queues hold 25,000 items, more than maxItems \\(10,000\\): raise "
                                        "maxItems, or leave it out"):
        capped.count()
    assert waiting(server, "deep") == (25_000, 0)


def test_batch_read_of_large_items_reads_every_item(spark: Any, server: ServerProcess) -> None:
    """A look's items stop at a get's bytes (512 KB), fewer than it asked: each task goes on from
    where its last look ended and never takes a short look for the end of its positions."""
    items = [b"%02d" % i + bytes([65 + i]) * (200 * 1024) for i in range(12)]  # 2.4 MB: five looks
    put(server, "large", items)
    rows = spark.read.format("kestrel").option("servers", address(server)).option("queue", "large").load()
    assert [bytes(r.data) for r in rows.collect()] == items
    assert waiting(server, "large") == (12, 0)


def test_batch_read_by_pattern_reads_the_queues_it_matches(spark: Any, server_factory: Any) -> None:
    a, b = server_factory(name="a"), server_factory(name="b")
    put(a, "prod-1", [b"a1"])
    put(b, "prod-2", [b"b2"])
    put(b, "test-1", [b"t"])
    c = client(b)
    c.peek("prod-2+audit")  # a fanout child: a reader of prod-2, not a queue the pattern matches
    c.close()
    read = spark.read.format("kestrel").option("servers", address(a, b))
    rows = read.option("queue", "prod-*").load().collect()
    assert sorted((r.queue, r.data) for r in rows) == [("prod-1", b"a1"), ("prod-2", b"b2")]
    with pytest.raises(Exception, match="no server holds queue 'stage-\\*'"):
        read.option("queue", "prod-*,stage-*").load().collect()


def queue_names(srv: ServerProcess) -> list[str]:
    c = client(srv)
    try:
        return list(c.queue_names())
    finally:
        c.close()


def test_batch_read_of_queues_no_server_holds_creates_nothing(spark: Any, server_factory: Any) -> None:
    a, b = server_factory(name="a"), server_factory(name="b")
    put(a, "only-a", [b"1", b"2"])
    before = (queue_names(a), queue_names(b))
    assert before == (["only-a"], [])
    read = spark.read.format("kestrel").option("servers", address(a, b))
    for queue, named in (("nowhere", "'nowhere'"), ("x,y", "'x', 'y'"), ("only-a,absent", "'absent'")):
        with pytest.raises(Exception, match=f"no server holds queue {named} .*nothing was created"):
            read.option("queue", queue).load().collect()
    # A queue one server holds is read there alone; the other server gains no queue.
    rows = read.option("queue", "only-a").load().collect()
    assert sorted(r.data for r in rows) == [b"1", b"2"]
    assert (queue_names(a), queue_names(b)) == before
    assert not (b.queue_path / "only-a").exists() and not (a.queue_path / "nowhere").exists()
    # Through a reader, the queue missing is its child (the queue itself is held: it was named instead)
    with pytest.raises(Exception, match=r"no server holds queue 'only-a\+billing' \(reader 'billing' of "
                                        r"'only-a': a stream creates it, a batch read does not\)"):
        spark.read.format("kestrel").option("servers", address(a, b)).option("queue", "only-a") \
            .option("reader", "billing").load().collect()


def test_rows_carry_each_items_add_time_and_expiry(spark: Any, server: ServerProcess, tmp_path: Path) -> None:
    c = client(server)
    before = time.time()
    c.put("stamped", [b"forever"], 0)
    c.put("stamped", [b"brief"], 3_600_000)
    after = time.time()
    c.close()
    rows = (spark.read.format("kestrel").option("servers", address(server)).option("queue", "stamped").load()
            .select("data", "timestamp", "expiry").collect())
    assert [r.data for r in rows] == [b"forever", b"brief"]
    assert all(before - 0.001 <= r.timestamp.timestamp() <= after + 0.001 for r in rows)
    assert rows[0].expiry is None
    assert before + 3599.999 <= rows[1].expiry.timestamp() <= after + 3600.001
    # The stream's rows carry them too (its log keeps them, for a batch replayed).
    out = str(tmp_path / "out")
    checkpoint = str(tmp_path / "cp")
    query = (spark.readStream.format("kestrel").option("servers", address(server)).option("queue", "stamped")
             .option("checkpointLocation", checkpoint).load()
             .writeStream.format("parquet").option("path", out).option("checkpointLocation", checkpoint)
             .trigger(availableNow=True).start())
    query.awaitTermination(600)
    streamed = sorted(spark.read.parquet(out).select("data", "timestamp", "expiry").collect())
    assert streamed == sorted(rows)
    assert waiting(server, "stamped") == (0, 0)


def test_drain_writes_then_confirms_every_item_once(spark: Any, server_factory: Any, tmp_path: Path) -> None:
    from kestrel.pipeline import drain

    a, b = server_factory(name="a"), server_factory(name="b")
    put(a, "jobs", [b"a%d" % i for i in range(600)])
    put(b, "jobs", [b"b%d" % i for i in range(400)])
    out = str(tmp_path / "out")

    def write(batch: Any, batch_id: int) -> None:
        batch.write.mode("overwrite").parquet(f"{out}/{batch_id}")  # idempotent per batch

    drain(spark, address(a, b), "jobs", write, checkpoint=str(tmp_path / "cp"), maxItemsPerTrigger=400)
    rows = [r.data for r in spark.read.parquet(f"{out}/*").collect()]
    assert sorted(rows) == sorted([b"a%d" % i for i in range(600)] + [b"b%d" % i for i in range(400)])
    assert waiting(a, "jobs") == (0, 0) and waiting(b, "jobs") == (0, 0)


def test_failed_multi_server_drain_leaves_every_item(spark: Any, server_factory: Any, tmp_path: Path) -> None:
    from kestrel.pipeline import drain

    a, b = server_factory(name="a"), server_factory(name="b")
    put(a, "jobs", [b"%d" % i for i in range(1000)])
    b.stop()  # one server down
    written: list[int] = []
    with pytest.raises(Exception, match="nothing was taken"):
        drain(spark, address(a, b), "jobs", lambda df, _: written.append(df.count()),
              checkpoint=str(tmp_path / "cp"))
    assert written == []
    assert waiting(a, "jobs") == (1000, 0)


def test_drain_whose_server_goes_down_midway_fails_rather_than_finish(spark: Any, server: ServerProcess,
                                                                     tmp_path: Path) -> None:
    """Left out of the planning as a stream leaves a down server, the server made the drain end as if
    its queue were empty, 80 of its 100 items never taken."""
    from kestrel.pipeline import drain

    items = [b"%d" % i for i in range(100)]
    put(server, "jobs", items)
    seen: list[bytes] = []

    def write(df: Any, batch_id: int) -> None:
        seen.extend(r.data for r in df.collect())
        if batch_id == 0:
            server.stop()

    cp = str(tmp_path / "cp")
    with pytest.raises(Exception, match=f"server {address(server)} did not answer .* while it held 80 items "
                                        f"this query was to take"):
        drain(spark, address(server), "jobs", write, checkpoint=cp, maxItemsPerTrigger=20, timeoutMs=1000)
    assert len(seen) == 20
    server.start()
    drain(spark, address(server), "jobs", write, checkpoint=cp, maxItemsPerTrigger=20)  # goes on
    assert set(seen) == set(items)
    assert waiting(server, "jobs") == (0, 0)


def test_drain_whose_server_dies_during_a_fetch_fails_rather_than_finish(spark: Any, server_factory: Any,
                                                                          tmp_path: Path) -> None:
    """Counted as taken when its batch was planned, the share a killed server never handed out made
    the drain end as if that queue were empty, its 50 items left behind."""
    from kestrel.pipeline import drain

    a, b = server_factory(name="a"), server_factory(name="b")
    items = [b"a%d" % i for i in range(50)] + [b"b%d" % i for i in range(50)]
    put(a, "jobs", items[:50])
    put(b, "jobs", items[50:])
    seen: list[bytes] = []

    def write(df: Any, batch_id: int) -> None:
        if batch_id == 0:
            b.kill()  # planned already: the fetch runs as the batch is collected
        seen.extend(r.data for r in df.collect())

    cp = str(tmp_path / "cp")
    with pytest.raises(Exception, match=f"server {address(b)} did not answer .* while it held 50 items "
                                        f"this query was to take"):
        drain(spark, address(a, b), "jobs", write, checkpoint=cp, timeoutMs=2000)
    assert sorted(seen) == sorted(items[:50])
    b.start()
    drain(spark, address(a, b), "jobs", write, checkpoint=cp)  # goes on
    assert sorted(seen) == sorted(items)
    assert waiting(a, "jobs") == (0, 0) and waiting(b, "jobs") == (0, 0)


def test_drain_whose_sink_fails_confirms_nothing_of_that_batch(spark: Any, server: ServerProcess,
                                                               tmp_path: Path) -> None:
    from kestrel.pipeline import drain, wal

    items = [b"%d" % i for i in range(300)]
    put(server, "jobs", items)

    def broken(df: Any, batch_id: int) -> None:
        df.count()
        raise RuntimeError("sink down")

    cp = tmp_path / "cp"
    with pytest.raises(Exception, match="sink down") as raised:
        drain(spark, address(server), "jobs", broken, checkpoint=str(cp), autoAbortMs=2000)
    # Nothing of the failed batch was confirmed for good: its reads come back to the queue after
    # autoAbortMs, but those of a batch that ran longer than half of it (the first Python worker of a
    # loaded machine takes seconds to start) were confirmed early, their items held in the batch's log
    # alone, as the error says. Either way each item is in one of the two, the log never emptied.
    held = early(cp)
    assert wal.held_early(str(cp)) == len(held)
    assert not held or f"run drain again with checkpoint={str(cp)!r}" in "".join(getattr(raised.value, "__notes__", []))
    with contextlib.suppress(AssertionError):
        wait_until(lambda: waiting(server, "jobs") == (300 - len(held), 0), "the failed batch's reads to come back",
                   timeout=60)
    assert waiting(server, "jobs") == (300 - len(held), 0)
    seen: list[bytes] = []
    drain(spark, address(server), "jobs", lambda df, _: seen.extend(r.data for r in df.collect()),
          checkpoint=str(cp), autoAbortMs=2000)  # resumes: the logged batch, then the rest
    assert sorted(set(seen)) == sorted(items)
    assert waiting(server, "jobs")[0] == 0


def early(checkpoint: Path) -> list[bytes]:
    """The items of a checkpoint's logged batches whose reads were confirmed early (or may have been:
    the confirm sent, the answer not yet noted when the query stopped)."""
    from kestrel.pipeline import wal

    logged = {path.with_suffix("") for path in checkpoint.glob("kestrel/*/*/*")
              if path.suffix in (".confirmed", ".confirming")}
    return [item for path in sorted(logged) for item in wal.read_items(str(path)).items]


def test_drain_whose_slow_sink_fails_names_the_checkpoint_holding_its_batch(spark: Any, server: ServerProcess
                                                                            ) -> None:
    from kestrel.pipeline import drain

    items = [b"%d" % i for i in range(300)]
    put(server, "jobs", items)

    def slow_then_broken(df: Any, batch_id: int) -> None:
        df.count()  # the batch is fetched: 300 open reads, logged
        wait_until(lambda: waiting(server, "jobs") == (0, 0), "the batch's reads to be confirmed early", timeout=60)
        raise RuntimeError("sink down")

    # No checkpoint: a temporary one, which the error names, since it alone holds the batch's items.
    with pytest.raises(Exception, match="sink down") as raised:
        drain(spark, address(server), "jobs", slow_then_broken, autoAbortMs=2000)
    (note,) = raised.value.__notes__
    found = re.search(r"^kestrel drain: 300 items of the failed batch are held in the checkpoint's log alone .*"
                      r"run drain again with checkpoint='([^']+)' to deliver them$", note)
    assert found, note
    assert sorted(early(Path(found[1]))) == sorted(items)
    assert waiting(server, "jobs") == (0, 0)  # none came back: a drain without the checkpoint finds nothing
    # Run again reading another queue too, it is another stream, whose log lacks the batch Spark
    # replays: it fetched anew, found nothing, and the 300 items were lost with no word.
    with pytest.raises(Exception, match=r"kestrel stream: Spark replays batch 0 of this checkpoint as it was "
                                        r"planned, by a stream that read other servers or queues \(it took "
                                        rf"from {address(server)}: jobs; .*Nothing was taken"):
        drain(spark, address(server), "jobs,other", lambda df, _: None, checkpoint=found[1], autoAbortMs=2000)
    assert sorted(early(Path(found[1]))) == sorted(items)
    seen: list[bytes] = []
    drain(spark, address(server), "jobs", lambda df, _: seen.extend(r.data for r in df.collect()),
          checkpoint=found[1], autoAbortMs=2000)
    assert sorted(seen) == sorted(items)  # each once, from the log
    assert waiting(server, "jobs") == (0, 0)
    shutil.rmtree(found[1])


# ---------------------------------------------------------------------------------------------
# The writer


def test_write_spreads_rows_over_servers(spark: Any, server_factory: Any) -> None:
    a, b = server_factory(name="a"), server_factory(name="b")
    df = spark.range(0, 2000, numPartitions=4).selectExpr("cast(id as string) as data")
    df.write.format("kestrel").option("servers", address(a, b)).option("queue", "rt") \
        .option("batchSize", 100).mode("append").save()
    got = take_all(a, "rt") + take_all(b, "rt")
    assert sorted(int(x) for x in got) == list(range(2000))


@pytest.mark.parametrize("expr, kind", [("id", "bigint"), ("id > 3", "boolean"),
                                        ("named_struct('a', id)", "struct<a:bigint>")])
def test_writer_refuses_other_types_at_planning(spark: Any, server: ServerProcess, expr: str, kind: str) -> None:
    df = spark.range(0, 10).selectExpr(f"{expr} as data")
    with pytest.raises(Exception, match=f"column 'data' is {kind}"):
        df.write.format("kestrel").option("servers", address(server)).option("queue", "typed") \
            .mode("append").save()
    assert waiting(server, "typed") == (0, 0)


def test_writer_nulls_fail_or_are_counted(spark: Any, server: ServerProcess) -> None:
    df = spark.range(0, 10, numPartitions=1).selectExpr("if(id % 2 = 0, null, cast(id as string)) as data")
    writer = df.write.format("kestrel").option("servers", address(server)).option("queue", "nulls") \
        .mode("append")
    with pytest.raises(Exception, match="has a null value"):
        writer.save()
    assert waiting(server, "nulls") == (0, 0)
    writer.option("onNull", "count").save()
    assert sorted(take_all(server, "nulls")) == [b"1", b"3", b"5", b"7", b"9"]


@pytest.mark.parametrize("options, message", [
    ({"servers": "127.0.0.1:1,"}, "empty entry at position 2"),
    ({"servers": "127.0.0.1:1", "batch_sise": "10"}, "unknown option 'batch_sise' \\(did you mean 'batchSize'"),
    ({"servers": "127.0.0.1:1", "batchSize": "0"}, "'batchSize' must be at least 1"),
])
def test_writer_refuses_bad_options_before_any_row(spark: Any, options: dict[str, str], message: str) -> None:
    df = spark.range(0, 10).selectExpr("cast(id as string) as data")
    writer = df.write.format("kestrel").option("queue", "q").mode("append")
    for key, value in options.items():
        writer = writer.option(key, value)
    with pytest.raises(Exception, match=message):
        writer.save()


def test_writer_snake_case_aliases_and_save_modes(spark: Any, server: ServerProcess) -> None:
    df = spark.range(0, 10, numPartitions=1).selectExpr("cast(id as string) as value")
    df.write.format("kestrel").option("servers", address(server)).option("queue", "alias") \
        .option("batch_size", 3).option("retry_backoff_ms", 50).mode("append").save()
    assert waiting(server, "alias") == (10, 0)
    with pytest.raises(Exception, match="use mode\\('append'\\)"):
        df.write.format("kestrel").option("servers", address(server)).option("queue", "alias") \
            .mode("overwrite").save()
    with pytest.raises(Exception, match="Append"):  # Spark's own refusal of its default, errorifexists
        df.write.format("kestrel").option("servers", address(server)).option("queue", "alias").save()
    assert waiting(server, "alias") == (10, 0)


def test_full_queue_fails_the_job_or_is_counted(spark: Any, server_factory: Any) -> None:
    srv = server_factory({"queues": {"small": {"max_items": 10}}})
    df = spark.range(0, 50, numPartitions=1).selectExpr("cast(id as string) as data")
    with pytest.raises(Exception, match="refused 40 of 50 items on every server: full, or an item over"):
        df.write.format("kestrel").option("servers", address(srv)).option("queue", "small").mode("append").save()
    df.write.format("kestrel").option("servers", address(srv)).option("queue", "small") \
        .option("onFull", "count").mode("append").save()
    assert waiting(srv, "small")[0] == 10


def test_an_item_over_max_item_size_is_refused_alone(spark: Any, server_factory: Any) -> None:
    """A put the server answered with 0 made the writer refuse the rest of its batch too: 6 of 11."""
    srv = server_factory({"queues": {"fail": {"max_item_size": "100B"}, "count": {"max_item_size": "100B"}}})
    rows = [(b"small %d" % i,) for i in range(5)] + [(b"x" * 1000,)] + [(b"small %d" % i,) for i in range(5, 10)]
    df = spark.createDataFrame(rows, "data binary").coalesce(1)
    with pytest.raises(Exception, match="refused 1 of 11 items on every server"):
        df.write.format("kestrel").option("servers", address(srv)).option("queue", "fail").mode("append").save()
    assert waiting(srv, "fail")[0] == 10
    df.write.format("kestrel").option("servers", address(srv)).option("queue", "count") \
        .option("onFull", "count").mode("append").save()
    assert sorted(take_all(srv, "count")) == sorted(r[0] for r in rows if len(r[0]) <= 100)


def test_a_full_queue_refuses_a_batch_in_one_put_not_one_a_row(spark: Any, server_factory: Any) -> None:
    """Refused alone, each item of a batch to a full queue cost a put on every server: the items as
    large as one refused are refused with it, and only smaller ones offered again."""
    srv = server_factory({"queues": {"full": {"max_items": 5}}})
    rows = [(b"%05d" % i,) for i in range(2_000)]
    spark.createDataFrame(rows, "data binary").coalesce(1).write.format("kestrel") \
        .option("servers", address(srv)).option("queue", "full").option("onFull", "count").mode("append").save()
    assert waiting(srv, "full")[0] == 5
    assert int(memcache_stats(srv.memcache_port)["cmd_set"]) < 50  # each put counts its items taken and one refused


def test_writer_rides_out_a_server_restart(spark: Any, server: ServerProcess) -> None:
    df = spark.range(0, 30_000, numPartitions=2).selectExpr("cast(id as string) as data")
    bounce = threading.Timer(1.0, server.restart)
    bounce.start()
    df.write.format("kestrel").option("servers", address(server)).option("queue", "bounce") \
        .option("batchSize", 500).option("retryBackoffMs", 200).option("retries", 10).mode("append").save()
    # Ten passes, 200 ms doubling up to 10 s (each cut by up to half at random): half a minute at
    # least for the restart, which a loaded machine stretched past what the default five allow (3-6 s).
    bounce.join()
    got = take_all(server, "bounce")
    assert set(got) == {b"%d" % i for i in range(30_000)}
    assert len(got) - 30_000 <= 2 * 500  # at most a batch per task put twice (a reply lost)


# ---------------------------------------------------------------------------------------------
# Streams


class Sink:
    """An idempotent sink: a batch written again replaces its earlier copy."""

    def __init__(self) -> None:
        self.batches: dict[int, list[bytes]] = {}

    def __call__(self, df: Any, batch_id: int) -> None:
        self.batches[batch_id] = [r.data for r in df.collect()]

    def rows(self) -> list[bytes]:
        return [row for batch in self.batches.values() for row in batch]


def stream(spark: Any, servers: str, checkpoint: Path, **options: Any) -> Any:
    reader = (spark.readStream.format("kestrel").option("servers", servers).option("queue", "events")
              .option("checkpointLocation", str(checkpoint)))
    for key, value in options.items():
        reader = reader.option(key, str(value))
    return reader.load()


def drained(query: Any, *servers: ServerProcess, timeout: float) -> None:
    """Run the query until the queue holds nothing on any of the servers, taken or open (every item
    confirmed), then until the sink has what was confirmed. Reads a killed task left open return
    after autoAbortMs."""
    query.processAllAvailable()
    with contextlib.suppress(AssertionError):  # the caller's assertions say what is missing
        wait_until(lambda: all(waiting(srv, "events") == (0, 0) for srv in servers), "every item confirmed",
                   timeout=timeout)
    query.processAllAvailable()


def test_idle_stream_delivers_each_item_once_over_the_same_connections(spark: Any, server: ServerProcess,
                                                                      tmp_path: Path) -> None:
    put(server, "events", [b"e%d" % i for i in range(1000)])
    sink = Sink()
    query = stream(spark, address(server), tmp_path / "cp", autoAbortMs=5000).writeStream \
        .foreachBatch(sink).option("checkpointLocation", str(tmp_path / "cp")).start()
    try:
        query.processAllAvailable()
        # The committed batch is confirmed at the next planning.
        wait_until(lambda: waiting(server, "events") == (0, 0), "the committed batch to be confirmed", timeout=60)
        before = connections_made(server)
        time.sleep(20)  # real time: the stream sits idle for four times the auto-abort time
        query.processAllAvailable()
        assert connections_made(server) == before  # idle: no new connections
        assert sorted(sink.rows()) == sorted(b"e%d" % i for i in range(1000))  # each once
        assert waiting(server, "events") == (0, 0)  # confirmed, not left to time out
    finally:
        query.stop()


def test_stream_creates_no_queue_on_a_server_that_does_not_hold_it(spark: Any, server_factory: Any,
                                                                  tmp_path: Path) -> None:
    a, b = server_factory(name="a"), server_factory(name="b")
    put(a, "events", [b"a%d" % i for i in range(100)])
    sink = Sink()
    query = stream(spark, address(a, b), tmp_path / "cp").writeStream \
        .foreachBatch(sink).option("checkpointLocation", str(tmp_path / "cp")).start()
    try:
        query.processAllAvailable()
        query.processAllAvailable()  # planned again: the empty server is asked again
        assert sorted(sink.rows()) == sorted(b"a%d" % i for i in range(100))
        assert queue_names(b) == [] and not (b.queue_path / "events").exists()
        # Once a put creates the queue there, the stream reads it.
        put(b, "events", [b"b1", b"b2"])
        wait_until(lambda: (query.processAllAvailable(), b"b2" in sink.rows())[1], "the new queue's items")
        assert sorted(sink.rows()) == sorted([b"a%d" % i for i in range(100)] + [b"b1", b"b2"])
    finally:
        query.stop()


def test_available_now_drains_50000_items_within_the_limit_and_stops(spark: Any, server_factory: Any,
                                                                    tmp_path: Path) -> None:
    a, b = server_factory(name="a"), server_factory(name="b")
    put(a, "events", [b"a%d" % i for i in range(30_000)])
    put(b, "events", [b"b%d" % i for i in range(20_000)])
    sink = Sink()
    partitions: list[int] = []

    def write(df: Any, batch_id: int) -> None:
        partitions.append(df.rdd.getNumPartitions())
        sink(df, batch_id)

    query = stream(spark, address(a, b), tmp_path / "cp", maxItemsPerTrigger=20_000).writeStream \
        .foreachBatch(write).option("checkpointLocation", str(tmp_path / "cp")) \
        .trigger(availableNow=True).start()
    assert query.awaitTermination(120)  # stopped by itself
    assert len(sink.rows()) == 50_000 and len(set(sink.rows())) == 50_000
    assert all(len(rows) <= 20_000 for rows in sink.batches.values()) and len(sink.batches) >= 3
    assert min(partitions) >= 2  # at least one partition per server
    assert waiting(a, "events") == (0, 0) and waiting(b, "events") == (0, 0)


def test_stopped_stream_resumes_with_every_item_once(spark: Any, server: ServerProcess, tmp_path: Path) -> None:
    items = {b"e%d" % i for i in range(1200)}
    put(server, "events", sorted(items))
    sink = Sink()
    cp = tmp_path / "cp"

    def start() -> Any:
        return stream(spark, address(server), cp, maxItemsPerTrigger=300, autoAbortMs=10_000).writeStream \
            .foreachBatch(sink).option("checkpointLocation", str(cp)).start()

    query = start()
    wait_until(lambda: len(sink.batches) >= 2, "two batches", timeout=120)
    query.stop()
    query = start()  # confirms the ids the first query logged, over its own connections
    try:
        drained(query, server, timeout=120)
    finally:
        query.stop()
    rows = sink.rows()
    print(f"duplicates: {len(rows) - len(items)} of {len(items)}")
    assert sorted(rows) == sorted(items)  # every item exactly once
    assert waiting(server, "events") == (0, 0)


@pytest.mark.parametrize("stop", ["at once", "a moment later"])
def test_a_stopped_query_leaves_no_committed_batch_open(spark: Any, server: ServerProcess, tmp_path: Path,
                                                        stop: str) -> None:
    """Spark tells a source of a commit only when it plans the next batch (30 s later here), and
    ended the source's process at a query.stop() without its stop(): a committed batch stayed open
    on the server and came back after autoAbortMs, to be delivered again."""
    put(server, "events", [b"e%d" % i for i in range(20)])
    sink = Sink()
    cp = tmp_path / "cp"
    query = stream(spark, address(server), cp).writeStream.foreachBatch(sink) \
        .option("checkpointLocation", str(cp)).trigger(processingTime="30 seconds").start()
    try:
        wait_until(lambda: (cp / "commits" / "0").exists(), "batch 0 to be committed", timeout=120)
        if stop == "a moment later":  # confirmed as soon as committed, well before the next trigger
            wait_until(lambda: waiting(server, "events") == (0, 0), "batch 0 to be confirmed", timeout=20)
    finally:
        query.stop()
    # (the source's process confirms as it ends, which query.stop() does not wait for; on a busy
    # machine that end took more than 5 s. Left open, the batch would come back after autoAbortMs:
    # 10 minutes.)
    wait_until(lambda: waiting(server, "events") == (0, 0), "batch 0 to be confirmed", timeout=60)
    assert sorted(sink.rows()) == sorted(b"e%d" % i for i in range(20))


class BatchFiles:
    """An idempotent sink that outlives its driver: a file per batch, replaced whole when the batch
    is written again."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def __call__(self, df: Any, batch_id: int) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        aside = self.folder / f"{batch_id}.tmp"
        aside.write_text("".join(r.data.hex() + "\n" for r in df.collect()))
        os.replace(aside, self.folder / str(batch_id))

    def rows(self) -> list[bytes]:
        return [bytes.fromhex(line) for batch in self.folder.iterdir() if batch.name.isdigit()
                for line in batch.read_text().splitlines()]


DRIVER = """
import json, sys, threading
from pathlib import Path
from pyspark.sql import SparkSession
from tests.pipeline.test_pipeline import BatchFiles
servers, checkpoint, out, settings = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
builder = SparkSession.builder.master("local[2]")
for key, value in settings.items():
    builder = builder.config(key, value)
spark = builder.getOrCreate()
sink = BatchFiles(Path(out))
def write(df, batch_id):
    sink(df, batch_id)
    if batch_id == 1:  # written, never committed: the test kills this driver here
        threading.Event().wait()
reader = (spark.readStream.format("kestrel").option("servers", servers).option("queue", "events")
          .option("checkpointLocation", checkpoint).option("maxItemsPerTrigger", 400))
for key, value in json.loads(sys.argv[5]).items():
    reader = reader.option(key, value)
reader.load().writeStream.foreachBatch(write).option("checkpointLocation", checkpoint).start().awaitTermination()
"""


def killed_driver(servers: str, tmp_path: Path, **options: Any) -> None:
    """Run DRIVER on `servers` in a process of its own until it has written batch 1, then kill it,
    its JVM and its workers: batch 1 is fetched and logged, its reads open, never committed."""
    import signal
    import subprocess

    settings = dict(SPARK_SETTINGS, **{"spark.local.dir": str(tmp_path / "driver")})
    driver = subprocess.Popen([sys.executable, "-c", DRIVER, servers, str(tmp_path / "cp"),
                               str(tmp_path / "out"), json.dumps(settings), json.dumps(options)],
                              cwd=str(ROOT), start_new_session=True, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: (tmp_path / "out" / "1").exists(), "the driver to write batch 1", timeout=180)
    finally:
        os.killpg(driver.pid, signal.SIGKILL)
        driver.wait()


def test_killed_driver_resumes_with_every_item_once_its_servers_listed_the_other_way_round(
        spark: Any, server_factory: Any, tmp_path: Path) -> None:
    a, b = server_factory(name="a"), server_factory(name="b")
    items = {b"a%d" % i for i in range(600)} | {b"b%d" % i for i in range(600)}
    put(a, "events", sorted(i for i in items if i.startswith(b"a")))
    put(b, "events", sorted(i for i in items if i.startswith(b"b")))
    cp, out = tmp_path / "cp", tmp_path / "out"
    killed_driver(address(a, b), tmp_path, autoAbortMs=20_000)
    sink = BatchFiles(out)
    # The same stream, its servers spelt the other way round: it goes on from the killed driver's log.
    query = stream(spark, f"127.0.0.1:{b.thrift_port}, 127.0.0.1:{a.thrift_port}", cp, maxItemsPerTrigger=400,
                   autoAbortMs=20_000).writeStream.foreachBatch(sink).option("checkpointLocation", str(cp)).start()
    try:
        drained(query, a, b, timeout=120)
    finally:
        query.stop()
    rows = sink.rows()
    print(f"duplicates: {len(rows) - len(items)} of {len(items)}")
    assert sorted(rows) == sorted(items)  # every item exactly once
    assert waiting(a, "events") == (0, 0) and waiting(b, "events") == (0, 0)
    assert len([d for d in (cp / "kestrel").iterdir() if d.is_dir()]) == 1  # one stream, no log orphaned


@pytest.mark.slow
def test_a_driver_restarted_a_minute_and_more_later_duplicates_nothing_by_default(
        spark: Any, server: ServerProcess, tmp_path: Path) -> None:
    items = {b"e%d" % i for i in range(1200)}
    put(server, "events", sorted(items))
    cp, out = tmp_path / "cp", tmp_path / "out"
    killed_driver(address(server), tmp_path)  # the stream's defaults
    time.sleep(65)  # real time: an ordinary restart of a driver on a cluster takes a minute and more
    sink = BatchFiles(out)
    query = stream(spark, address(server), cp, maxItemsPerTrigger=400).writeStream.foreachBatch(sink) \
        .option("checkpointLocation", str(cp)).start()
    try:
        drained(query, server, timeout=120)
    finally:
        query.stop()
    rows = sink.rows()
    assert sorted(rows) == sorted(items)  # every item exactly once: batch 1's reads were still open
    assert returned(cp) == 0


def test_server_killed_and_restarted_mid_stream_loses_nothing(spark: Any, server: ServerProcess,
                                                              tmp_path: Path) -> None:
    items = {b"e%d" % i for i in range(1500)}
    put(server, "events", sorted(items))
    cp = tmp_path / "cp"
    slow = Sink()

    def write(df: Any, batch_id: int) -> None:
        slow(df, batch_id)
        if batch_id == 1:
            server.kill()
            server.start()

    query = stream(spark, address(server), cp, maxItemsPerTrigger=300, autoAbortMs=10_000).writeStream \
        .foreachBatch(write).option("checkpointLocation", str(cp)).start()
    try:
        drained(query, server, timeout=120)
    finally:
        query.stop()
    rows = slow.rows()
    assert set(rows) == items
    print(f"duplicates: {len(rows) - len(items)} of {len(items)}")
    assert len(rows) - len(items) <= 2 * 300  # documented: the batches whose reads the restart returned
    assert waiting(server, "events") == (0, 0)


def test_a_batch_slower_than_auto_abort_delivers_each_item_once(spark: Any, server: ServerProcess,
                                                                 tmp_path: Path) -> None:
    items = {b"e%d" % i for i in range(600)}
    put(server, "events", sorted(items))
    cp = tmp_path / "cp"
    sink = Sink()
    open_at_end: list[tuple[int, int]] = []

    def slow(df: Any, batch_id: int) -> None:
        if batch_id > 3:  # two batches hold every item: fail the query rather than loop on returned reads
            raise RuntimeError(f"batch {batch_id}: items keep coming back")
        sink(df, batch_id)  # the rows are fetched, as open reads, and logged
        if batch_id == 0:
            time.sleep(2.5)  # real time: the batch lasts longer than autoAbortMs after the fetch
        open_at_end.append(waiting(server, "events"))

    query = stream(spark, address(server), cp, maxItemsPerTrigger=300, autoAbortMs=2000).writeStream \
        .foreachBatch(slow).option("checkpointLocation", str(cp)).start()
    try:
        drained(query, server, timeout=120)
    finally:
        query.stop()
    rows = sink.rows()
    assert sorted(rows) == sorted(items)  # each once: no read timed out and came back
    assert open_at_end[0] == (300, 0)  # the first batch's reads were confirmed while it ran, not aborted
    assert returned(cp) == 0


def returned(checkpoint: Path) -> int:
    """The stream source's count of possible duplicates (items whose reads had gone back when confirmed)."""
    from kestrel.pipeline import wal

    return sum(wal.returned(str(root)) for root in (checkpoint / "kestrel").iterdir())


def test_server_stopped_during_commit_keeps_the_confirm_until_it_is_back(spark: Any, server: ServerProcess,
                                                                         tmp_path: Path) -> None:
    items = {b"e%d" % i for i in range(900)}
    put(server, "events", sorted(items))
    cp = tmp_path / "cp"
    sink = Sink()

    def write(df: Any, batch_id: int) -> None:
        sink(df, batch_id)
        if batch_id == 1:
            server.stop()  # before Spark commits the batch: its confirm finds the server gone

    query = stream(spark, address(server), cp, maxItemsPerTrigger=300, autoAbortMs=20_000).writeStream \
        .foreachBatch(write).option("checkpointLocation", str(cp)).start()
    try:
        def committed() -> bool:
            assert query.exception() is None, query.exception()
            return (cp / "commits" / "1").exists()

        wait_until(committed, "batch 1 to be committed", timeout=120)
        time.sleep(0.1)  # real time: a planning or two with the server gone
        assert [p.parent.name for p in cp.glob("kestrel/*/1/*")], "the pending confirm was dropped"
        server.start()
        drained(query, server, timeout=120)
    finally:
        query.stop()
    rows = sink.rows()
    assert set(rows) == items
    duplicates = len(rows) - len(items)
    print(f"duplicates: {duplicates} of {len(items)}, counted: {returned(cp)}")
    # The stop returned batch 1's open reads; their old ids closed nothing when the confirm was retried.
    assert duplicates == returned(cp) == 300
    assert not list(cp.glob("kestrel/*/1"))  # the retried confirm was answered and the batch forgotten
    assert waiting(server, "events") == (0, 0)


def test_progress_reports_each_queues_depth_and_the_last_batch(spark: Any, server_factory: Any,
                                                               tmp_path: Path) -> None:
    a, b = server_factory(name="a"), server_factory(name="b")
    put(a, "events", [b"a%d" % i for i in range(500)])
    put(b, "events", [b"b%d" % i for i in range(300)])
    cp = tmp_path / "cp"
    sink = Sink()
    query = stream(spark, address(a, b), cp, maxItemsPerTrigger=200).writeStream.queryName("kestrel-events") \
        .foreachBatch(sink).option("checkpointLocation", str(cp)).start()
    try:
        query.processAllAvailable()
        wait_until(lambda: waiting(a, "events") == (0, 0) and waiting(b, "events") == (0, 0), "every item confirmed")
        query.processAllAvailable()
        reports = [json.loads(p.sources[0].latestOffset) for p in query.recentProgress
                   if p.sources and p.sources[0].latestOffset not in (None, "null")]
    finally:
        query.stop()
    assert query.name == "kestrel-events"  # what the Spark UI lists the query by
    assert reports[0]["waiting"] == {address(a): {"events": 500}, address(b): {"events": 300}}  # the lag
    lags = [sum(n for queues in r["waiting"].values() for n in queues.values()) for r in reports]
    assert lags == sorted(lags, reverse=True) and lags[-1] <= 200  # shrinking by at most a batch each time
    assert all(r["down"] == [] for r in reports)
    batches = [r["lastBatch"] for r in reports if "lastBatch" in r]
    assert batches and all(r["items"] <= 200 and r["fetchMs"] >= 0 for r in batches)
    assert sum({r["batch"]: r["items"] for r in batches}.values()) <= 800 and len(sink.rows()) == 800


def test_two_readers_each_see_every_item_as_consumer_groups_do(spark: Any, server: ServerProcess,
                                                               tmp_path: Path) -> None:
    sinks = {"billing": Sink(), "audit": Sink()}
    queries = [stream(spark, address(server), tmp_path / name, reader=name).writeStream.foreachBatch(sink)
               .option("checkpointLocation", str(tmp_path / name)).start() for name, sink in sinks.items()]
    try:
        for query in queries:
            query.processAllAvailable()  # each creates its reader: events+billing, events+audit
        assert queue_names(server) == ["events+audit", "events+billing"]  # the parent comes with its put
        items = [b"e%d" % i for i in range(300)]
        put(server, "events", items)
        for name, query in zip(sinks, queries, strict=True):
            wait_until(lambda: (query.processAllAvailable(), waiting(server, f"events+{name}"))[1] == (0, 0),  # noqa: B023
                       f"reader {name} to take every item")
            query.processAllAvailable()
    finally:
        for query in queries:
            query.stop()
    assert sorted(sinks["billing"].rows()) == sorted(items) == sorted(sinks["audit"].rows())
    assert waiting(server, "events") == (300, 0)  # the queue itself keeps its own copy, for its own readers


def test_a_pattern_stream_takes_up_queues_that_appear_between_batches(spark: Any, server: ServerProcess,
                                                                      tmp_path: Path) -> None:
    put(server, "orders-eu", [b"eu%d" % i for i in range(100)])
    put(server, "other", [b"x"])
    sink = Sink()
    query = stream(spark, address(server), tmp_path / "cp", queue="orders-*").writeStream.foreachBatch(sink) \
        .option("checkpointLocation", str(tmp_path / "cp")).start()
    try:
        query.processAllAvailable()
        put(server, "orders-us", [b"us%d" % i for i in range(50)])  # a new queue the pattern matches
        wait_until(lambda: (query.processAllAvailable(), len(sink.rows()))[1] == 150, "the new queue's items")
    finally:
        query.stop()
    assert sorted(sink.rows()) == sorted([b"eu%d" % i for i in range(100)] + [b"us%d" % i for i in range(50)])
    assert waiting(server, "other") == (1, 0)
    assert waiting(server, "orders-eu") == (0, 0) and waiting(server, "orders-us") == (0, 0)


def test_a_frozen_server_stalls_no_batch_after_the_first_and_an_all_frozen_cluster_fails_in_time(
        spark: Any, server_factory: Any, tmp_path: Path) -> None:
    import signal

    a, b = server_factory(name="a"), server_factory(name="b")
    put(b, "events", [b"never"])
    assert a.proc is not None and b.proc is not None
    os.kill(b.proc.pid, signal.SIGSTOP)  # frozen: connections are accepted, nothing is answered
    sink = Sink()
    cp = tmp_path / "cp"
    query = stream(spark, address(a, b), cp, timeoutMs=1000, unreachableTimeoutMs=4000).writeStream \
        .foreachBatch(sink).option("checkpointLocation", str(cp)).start()
    try:
        for round_ in range(3):
            put(a, "events", [b"%d-%d" % (round_, i) for i in range(100)])
            wait_until(lambda: (query.processAllAvailable(), len(sink.rows()))[1] == 100 * (round_ + 1),  # noqa: B023
                       f"round {round_} delivered")
        stalls = [p.durationMs.get("latestOffset", 0) for p in query.recentProgress[1:]]
        assert max(stalls) < STALL_S * 1000, stalls  # asked again in the background, not waited for
        assert sorted(sink.rows()) == sorted(b"%d-%d" % (r, i) for r in range(3) for i in range(100))
        os.kill(a.proc.pid, signal.SIGSTOP)  # now every server is frozen
        frozen = time.monotonic()
        with pytest.raises(Exception, match="no server answered for \\d+ s \\(unreachableTimeoutMs is 4000\\)"):
            query.awaitTermination(120)
        assert time.monotonic() - frozen < 4 + 1 + 3 * STALL_S  # the time-out, one call's, and a margin
    finally:
        for srv in (a, b):
            os.kill(srv.proc.pid, signal.SIGCONT)
        query.stop()


@pytest.mark.parametrize("options, message", [
    ({"maxItems": "10"}, "kestrel stream: unknown option 'maxitems'; valid options are: "),  # the batch read's
    ({}, "option 'checkpointLocation' is required: give the source the same path as the query's own "
         "checkpoint location"),
    ({"checkpointLocation": "elsewhere"}, "holds no Spark checkpoint, so it is not this query's: give the "
                                          "source the same path"),
])
def test_stream_refuses_bad_options(spark: Any, tmp_path: Path, options: dict[str, str], message: str) -> None:
    reader = spark.readStream.format("kestrel").option("servers", "127.0.0.1:1").option("queue", "q")
    if options and "checkpointLocation" not in options:
        reader = reader.option("checkpointLocation", str(tmp_path / "cp"))
    if options.get("checkpointLocation") == "elsewhere":
        options = {"checkpointLocation": str(tmp_path / "elsewhere")}
    for key, value in options.items():
        reader = reader.option(key, value)
    query = reader.load().writeStream.format("noop").option("checkpointLocation", str(tmp_path / "cp")).start()
    with pytest.raises(Exception, match=message) as raised:
        query.awaitTermination(60)
    assert "UnboundLocalError" not in str(raised.value)  # ours is the error the user sees, alone
    query.stop()


def test_stream_option_typos_fail_at_load_naming_the_option_meant(spark: Any, server: ServerProcess) -> None:
    reader = spark.readStream.format("kestrel").option("servers", address(server)).option("queue", "q")
    with pytest.raises(Exception, match="unknown option 'maxitemspertriger' \\(did you mean "
                                        "'maxItemsPerTrigger'\\?\\); valid options are: "):
        reader.option("maxItemsPerTriger", 10).load()  # before start(): Spark asks for the schema here
    # Two queues, as Kafka's subscribe lists topics: never a queue called 'a,b'.
    put(server, "a", [b"a1", b"a2"])
    put(server, "b", [b"b1"])
    both = spark.read.format("kestrel").option("servers", address(server)).option("queue", "a, b").load()
    assert sorted((r.queue, r.data) for r in both.collect()) == [("a", b"a1"), ("a", b"a2"), ("b", b"b1")]
    assert not (server.queue_path / "a,b").exists() and not (server.queue_path / "a, b").exists()
    assert waiting(server, "a") == (2, 0) and waiting(server, "b") == (1, 0)


def test_trigger_once_is_refused_and_available_now_takes_each_item_once(spark: Any, server: ServerProcess,
                                                                        tmp_path: Path) -> None:
    put(server, "events", [b"e%d" % i for i in range(2000)])
    rows: list[bytes] = []  # every row the sink was handed, over every run

    def run(checkpoint: Path, **trigger: bool) -> Any:
        return stream(spark, address(server), checkpoint).writeStream \
            .foreachBatch(lambda df, _: rows.extend(r.data for r in df.collect())) \
            .option("checkpointLocation", str(checkpoint)).trigger(**trigger).start()

    for _ in range(3):
        query = run(tmp_path / "once", once=True)
        with pytest.raises(Exception, match="Trigger.Once is not supported; use .trigger\\(availableNow=True\\)"):
            query.awaitTermination(60)
        assert rows == [] and waiting(server, "events") == (2000, 0)  # nothing taken
    for _ in range(3):
        query = run(tmp_path / "now", availableNow=True)
        assert query.awaitTermination(60) and query.exception() is None
        assert sorted(rows) == sorted(b"e%d" % i for i in range(2000))  # each once, over the three runs
        assert waiting(server, "events") == (0, 0)  # confirmed, not left open


def test_stream_of_two_queues_into_a_queue(spark: Any, server: ServerProcess, tmp_path: Path) -> None:
    put(server, "events", [b"e%d" % i for i in range(500)])
    put(server, "others", [b"o%d" % i for i in range(100)])
    cp = str(tmp_path / "cp")
    query = spark.readStream.format("kestrel").option("servers", address(server)) \
        .option("queue", "events,others").option("checkpointLocation", cp).option("maxItemsPerTrigger", 200) \
        .option("minPartitions", 4).load().writeStream \
        .format("kestrel").option("servers", address(server)).option("queue", "moved") \
        .option("batchSize", 64).option("checkpointLocation", cp).trigger(availableNow=True).start()
    assert query.awaitTermination(60) and query.exception() is None
    assert sorted(take_all(server, "moved")) == sorted([b"e%d" % i for i in range(500)] +
                                                       [b"o%d" % i for i in range(100)])
    assert waiting(server, "events") == (0, 0) and waiting(server, "others") == (0, 0)


def test_stream_with_no_server_reachable_fails_naming_them(spark: Any, tmp_path: Path) -> None:
    gone = f"127.0.0.1:{free_port()}"
    cp = str(tmp_path / "cp")
    started = time.monotonic()
    query = spark.readStream.format("kestrel").option("servers", gone).option("queue", "q") \
        .option("checkpointLocation", cp).option("unreachableTimeoutMs", 2000).load() \
        .writeStream.format("noop").option("checkpointLocation", cp).start()
    with pytest.raises(Exception, match=f"no server answered for \\d+ s \\(unreachableTimeoutMs is 2000\\): {gone}"):
        query.awaitTermination(60)
    assert time.monotonic() - started >= 2
    query.stop()


# ---------------------------------------------------------------------------------------------
# Journals


def test_journal_rows_equal_what_was_put_in_order(spark: Any, server: ServerProcess) -> None:
    c = client(server)
    c.put("audit", [b"a", b"b", b"c"], 0)
    c.put("other", [b"x"], 0)
    opened = c.get("audit", 1, 0, 60_000)
    c.confirm("audit", {opened[0].id})
    c.close()
    started = time.time()
    rows = (spark.read.format("kestrel-journal").option("queue", "audit").load(str(server.queue_path))
            .orderBy("offset").collect())
    assert [r.opcode for r in rows] == ["ADDX", "ADDX", "ADDX", "REMOVE_TENTATIVE_XID", "CONFIRM_REMOVE"]
    assert [r.data for r in rows[:3]] == [b"a", b"b", b"c"]
    assert rows[3].xid == rows[4].xid == 1 and all(r.status == "ok" and r.queue == "audit" for r in rows)
    assert rows[0].expiry is None  # never expires
    assert abs(rows[0].timestamp.timestamp() - started) < 120
    split = (spark.read.format("kestrel-journal").option("queue", "audit").option("maxPartitionBytes", 40)
             .load(str(server.queue_path)))
    assert split.rdd.getNumPartitions() > 1
    assert split.orderBy("offset").collect() == rows


def test_queue_filters_are_pushed_down(spark: Any, server: ServerProcess) -> None:
    c = client(server)
    c.put("audit", [b"a"], 0)
    c.put("other", [b"x"], 0)
    c.close()
    spark.conf.set("spark.sql.python.filterPushdown.enabled", "true")
    try:
        df = (spark.read.format("kestrel-journal").option("filterPushdown", "true")
              .load(str(server.queue_path)).where("queue = 'audit'"))
        assert [r.data for r in df.collect()] == [b"a"]
        assert df.rdd.getNumPartitions() == 1  # the other queue's file is never opened
    finally:
        spark.conf.set("spark.sql.python.filterPushdown.enabled", "false")


def test_damage_is_a_row_or_fails_the_job(spark: Any, tmp_path: Path) -> None:
    from kestrel.storage.kestrel2.codec import encode_addx

    content = encode_addx(1, 0, b"whole") + encode_addx(1, 0, b"torn")[:9]
    (tmp_path / "q").write_bytes(content)
    rows = spark.read.format("kestrel-journal").load(str(tmp_path)).orderBy("offset").collect()
    assert [(r.opcode, r.status) for r in rows] == [("ADDX", "ok"), (None, "torn")]
    assert (tmp_path / "q").read_bytes() == content  # the operator's file is untouched
    (tmp_path / "q").write_bytes(encode_addx(1, 0, b"whole") + b"\x7f" + encode_addx(1, 0, b"after"))
    rows = spark.read.format("kestrel-journal").load(str(tmp_path)).orderBy("offset").collect()
    assert rows[0].data == b"whole" and rows[-1].status.startswith("corrupt")
    offset = len(encode_addx(1, 0, b"whole"))
    for view in ("records", "items"):
        with pytest.raises(Exception, match=f"offset {offset}|{offset}"):
            spark.read.format("kestrel-journal").option("view", view).option("mode", "FAILFAST") \
                .load(str(tmp_path)).collect()
    with pytest.raises(Exception, match="unknown option 'modus'; valid options are: "):
        spark.read.format("kestrel-journal").option("modus", "x").load(str(tmp_path)).collect()


def test_times_beyond_what_a_collect_shows_are_shown_at_its_ends(spark: Any, tmp_path: Path) -> None:
    """A damaged add time or expiry was multiplied into another time or none (2**62 ms read as no
    time), or failed the collect with "year out of range"."""
    from kestrel.storage.kestrel2.codec import encode_addx

    times = [(1_700_000_000_000, 0), (2**62, -2**62), (-2**62, 2**63 - 1), (300_000_000_000_000, 0)]
    (tmp_path / "q").write_bytes(b"".join(encode_addx(added, expiry, b"%d" % n)
                                          for n, (added, expiry) in enumerate(times)))
    for view in ("records", "items"):
        rows = spark.read.format("kestrel-journal").option("view", view).load(str(tmp_path)).collect()
        shown = sorted((r.data, r.timestamp.year, r.expiry and r.expiry.year) for r in rows)
        assert shown == [(b"0", 2023, None), (b"1", 9999, 1), (b"2", 1, 9999), (b"3", 9999, None)], view


def test_journals_of_several_queue_paths_load_together(spark: Any, tmp_path: Path) -> None:
    from kestrel.storage.kestrel2.codec import encode_addx

    for name in ("one", "two"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "q").write_bytes(encode_addx(1, 0, name.encode()))
    paths = [str(tmp_path / "one"), str(tmp_path / "two")]
    rows = spark.read.format("kestrel-journal").load(paths).collect()
    assert sorted((r.data, r.file) for r in rows) == [(b"one", str(tmp_path / "one" / "q")),
                                                      (b"two", str(tmp_path / "two" / "q"))]
    items = spark.read.format("kestrel-journal").option("view", "items").load(paths + paths[:1]).collect()
    assert sorted(r.data for r in items) == [b"one", b"two"]  # a path given twice is read once


def test_items_view_equals_what_the_server_serves_after_restart(spark: Any, server: ServerProcess) -> None:
    c = client(server)
    c.put("work", [b"one", b"two", b"three"], 0)
    c.get("work", 1, 0, 0)  # "one" gone for good
    c.get("work", 1, 0, 600_000)  # "two" open while the journal is read
    c.close()
    before = {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in server.queue_path.iterdir()}
    items = (spark.read.format("kestrel-journal").option("view", "items").load(str(server.queue_path))
             .where("queue = 'work'").orderBy("position").collect())
    assert [(r.data, r.open) for r in items] == [(b"two", True), (b"three", False)]
    assert items[0].timestamp is not None and items[0].expiry is None
    after = {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in server.queue_path.iterdir()}
    assert after == before  # read in place, nothing written
    server.restart()
    c = client(server)
    served = [i.data for i in c.get("work", 10, 0, 0)]
    c.close()
    assert served == [r.data for r in items]
