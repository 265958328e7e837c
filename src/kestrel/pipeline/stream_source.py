"""`spark.readStream.format("kestrel")`: queues as a stream, exactly-once into idempotent sinks.

How a micro-batch lives:
1. Planning (driver, `latestOffset`): peek every server over the driver's pooled connections (only
   the queues it holds: a peek creates its queue) and decide how many items to take from each,
   within `maxItemsPerTrigger`. No items are taken yet; an idle stream only peeks, over the same
   connections.
2. Reading (executors, `read`): each partition takes its share as open reads and writes them, with
   their read ids, to the write-ahead log under the checkpoint before Spark sees a row. A replayed
   batch reads the log instead of the servers, so it yields the same rows.
3. Committing: once Spark's commit log shows the batch committed by the sink (checked at every
   planning, so an idle stream commits too) or Spark calls `commit`, its read ids are confirmed.
   A confirm the server could not take stays pending in the log and is tried again at the next
   planning or commit, never dropped.

Reads in flight are handed to the log, not renewed: Kestrel has no call that extends an open read,
so reads older than half of `autoAbortMs` are confirmed early, their items already safe in the log
(a replay of the batch reads them from there). No read of a live batch times out and comes back,
however long the sink takes.

A server's read ids are unique for the life of its queue directory, so logged ids are confirmed
over any connection to their server, by whichever query runs from the checkpoint: a query restarted
after a stop or a driver kill confirms the batches the sink committed, and confirms at once the
logged reads of the batch it replays (their rows come from the log). An id from before a server
restart closes nothing (the restarted server never hands it out again): the restart returned its
item to the queue, the item is delivered again, and the shortfall of the confirm is counted as
possible duplicates (`<checkpoint>/kestrel/<source>/returned`).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any, NoReturn, TypeVar

import structlog
from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)

from kestrel.client import Cluster, KestrelClientError
from kestrel.pipeline import wal
from kestrel.pipeline.options import Option, parse_options, queue_names, text, whole
from kestrel.pipeline.rows import queue_rows
from kestrel.pipeline.servers import Reachability, ServersUnreachable, parse_servers, take_open_reads

log = structlog.get_logger("kestrel.pipeline")

# PySpark (4.3 included) gives a Python streaming source neither its query's checkpoint location nor
# any other per-query directory (the JVM's toMicroBatchStream(checkpointLocation) drops it), so the
# location comes again as an option.
CHECKPOINT_HELP = ("give the source the same path as the query's own checkpoint location, "
                   "readStream.format('kestrel').option('checkpointLocation', path) and "
                   "writeStream.option('checkpointLocation', path): the source keeps its write-ahead log "
                   "of taken items there and reads Spark's commit log from there, and PySpark does not tell "
                   "a Python source where its query's checkpoint is")

# Spark passes every trigger the source's default read limit except Trigger.Once, which gets
# ReadAllAvailable: the default is therefore never ReadAllAvailable, so that Once can be told apart.
NO_CAP = 2**63 - 1

ONCE_REFUSED = ("kestrel stream: Trigger.Once is not supported; use .trigger(availableNow=True). Spark "
                "plans nothing after the only batch of a Once query and does not stop the source, so the "
                "source never learns that the sink committed the batch: its items would stay open reads, "
                "return to their queue after autoAbortMs and be delivered again by the next run. "
                "AvailableNow takes what the queues hold when the query starts (in batches of at most "
                "maxItemsPerTrigger), confirms every batch the sink committed, then stops")

STREAM_OPTIONS = [
    Option("servers", text, doc="host:port,host:port,..."),
    Option("queue", queue_names, doc="one queue, or several comma-separated"),
    Option("checkpointLocation", text, doc="the query's own checkpoint location, again (the log goes there)"),
    Option("maxItemsPerTrigger", whole(1), None, "a cap on the items of one micro-batch, over all servers"),
    Option("itemsPerPartition", whole(1), 10_000, "a server's share is split into partitions of this size"),
    Option("minPartitions", whole(1), None, "at least this many partitions per micro-batch, when it has as "
                                            "many items"),
    Option("autoAbortMs", whole(1000), 60_000, "open reads return to their queue if not confirmed in time"),
    Option("unreachableTimeoutMs", whole(0), 120_000, "fail the query once no server has answered for this "
                                                       "long (0: never)"),
]


class StreamPartition(InputPartition):
    """One task's share of one queue on one server in one micro-batch."""

    def __init__(self, path: str, server: str, queue: str, quota: int, auto_abort_ms: int) -> None:
        super().__init__(path)
        self.path, self.server, self.queue, self.quota = path, server, queue, quota
        self.auto_abort_ms = auto_abort_ms


def read_partition(partition: StreamPartition) -> Iterator[Any]:
    """The partition's rows: from the log if it exists, else fetched and logged first."""
    if os.path.exists(partition.path):
        logged = wal.read_items(partition.path)
    else:
        started = time.time()
        # A server failing mid-fetch leaves this batch shorter; the next batch asks it again.
        taken = take_open_reads(partition.server, partition.queue, partition.quota, partition.auto_abort_ms)
        logged = wal.Logged(taken.items, taken.added, taken.expiry)
        header = wal.WalHeader(partition.server, started, len(taken.ids), partition.queue)
        if not wal.write_partition(partition.path, header, taken.ids, logged):
            logged = wal.read_items(partition.path)  # another attempt logged first: its rows stand
    yield from queue_rows(logged.items, partition.queue, partition.server, logged.added, logged.expiry)


class KestrelStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, options: Mapping[str, str]) -> None:
        o = parse_options(options, STREAM_OPTIONS, "kestrel stream", required=("servers", "queue"))
        if o["checkpointLocation"] is None:
            raise ValueError(f"kestrel stream: option 'checkpointLocation' is required: {CHECKPOINT_HELP}")
        self.servers = parse_servers(o["servers"])
        self.queues: list[str] = o["queue"]
        self.max_per_trigger: int | None = o["maxItemsPerTrigger"]
        self.per_partition: int = o["itemsPerPartition"]
        self.min_partitions: int | None = o["minPartitions"]
        self.auto_abort_ms: int = o["autoAbortMs"]
        self.checkpoint = wal.checkpoint_dir(o["checkpointLocation"])
        listed = ",".join(self.queues)
        key = hashlib.sha1(f"{listed}@{o['servers']}".encode()).hexdigest()[:12]
        label = self.queues[0] if len(self.queues) == 1 else f"{len(self.queues)}-queues"
        self.source_key = f"{label}-{key}"
        self.root = os.path.join(self.checkpoint, "kestrel", self.source_key)
        self.spark_log = wal.SparkCommitLog(self.checkpoint, self.source_key)
        self.cluster = Cluster(self.servers)
        self.available_now: dict[tuple[str, str], int] | None = None  # left to take, per (server, queue)
        self.reach = Reachability(self.servers, o["unreachableTimeoutMs"] / 1000.0,
                                  f"kestrel stream of {listed!r}")
        self.lock = threading.Lock()
        self._stopped = threading.Event()
        self._keeper: threading.Thread | None = None  # started by the first planning, in the driver

    # -- planning -------------------------------------------------------------------------------

    def initialOffset(self) -> dict[str, Any]:
        return {"source": self.source_key, "batch": -1}

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadMaxRows(self.max_per_trigger or NO_CAP)

    def prepareForTriggerAvailableNow(self) -> None:
        """Take what is there now and no more; every server must answer before anything is taken."""
        with self.lock:
            self.available_now = self._waiting(strict=True)

    def _waiting(self, strict: bool) -> dict[tuple[str, str], int]:
        """How many items wait in each queue on each server; none where the server holds no such
        queue (nothing is created), none on a server that is down (asked again a second later)
        unless `strict`, where it fails the query before anything is taken."""
        waiting: dict[tuple[str, str], int] = {}
        for address in self.servers:
            if not strict and not self.reach.due(address):
                continue
            try:
                server = self.cluster.server(address)
                held = set(server.queue_names())  # a peek would create the queue it looks at
                for queue in self.queues:
                    waiting[(address, queue)] = int(server.peek(queue).items) if queue in held else 0
            except KestrelClientError as e:
                if strict:
                    raise ServersUnreachable(f"{e}: nothing was taken from any server") from e
                self.reach.failed(address, "peek", e)
                for queue in self.queues:
                    waiting.pop((address, queue), None)
                continue
            self.reach.answered(address)
        return waiting

    def _start(self) -> None:
        """Once per query, in the driver, before the first batch is planned or replayed: confirm
        what the log holds (committed batches for good, the batch to be replayed early, since its
        rows come from the log), then keep in-flight reads from timing out."""
        if self._keeper is not None:
            return
        if not os.path.exists(os.path.join(self.checkpoint, "metadata")):
            raise ValueError(f"kestrel stream: option 'checkpointLocation' ({self.checkpoint}) holds no "
                             f"Spark checkpoint, so it is not this query's: {CHECKPOINT_HELP}")
        self._confirm_up_to(self.spark_log.committed())
        for batch in wal.batches(self.root):
            for path in wal.batch_files(self.root, batch):
                if not wal.is_confirmed(path):
                    self._confirm(path)
        self._keeper = threading.Thread(target=self._keep_reads_alive, daemon=True, name="kestrel-keeper")
        self._keeper.start()

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        if isinstance(limit, ReadAllAvailable) and self.available_now is None:
            raise ValueError(ONCE_REFUSED)
        with self.lock:
            self._start()
            self._confirm_up_to(self.spark_log.committed())
            waiting = self._waiting(strict=False)
            self.reach.check()
            if self.available_now is not None:
                waiting = {k: min(n, self.available_now.get(k, 0)) for k, n in waiting.items()}
            cap = limit.max_rows if isinstance(limit, ReadMaxRows) else None
            take = share(waiting, cap)
            if not take:
                return start
            if self.available_now is not None:
                for k, n in take.items():
                    self.available_now[k] -= n
            by_server: dict[str, dict[str, int]] = {}
            for (address, queue), n in take.items():
                by_server.setdefault(address, {})[queue] = n
            return {"source": self.source_key, "batch": int(start.get("batch", -1)) + 1, "take": by_server}

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> list[InputPartition]:
        if end.get("batch") == start.get("batch") or "take" not in end:
            return []
        batch = int(end["batch"])
        out: list[InputPartition] = []
        with self.lock:
            self._start()
            # {server: {queue: n}}; offsets of versions that read one queue are {server: n}
            take = {(address, queue): n for address, counts in end["take"].items() for queue, n in
                    (counts if isinstance(counts, dict) else {self.queues[0]: counts}).items()}
            size = partition_size(sum(take.values()), self.per_partition, self.min_partitions)
            for (address, queue), count in sorted(take.items()):
                for part, first in enumerate(range(0, count, size)):
                    name = f"{address.replace(':', '_')}-{part}"
                    if len(self.queues) > 1:
                        name = f"{queue}~{name}"
                    path = os.path.join(self.root, str(batch), name)
                    quota = min(size, count - first)
                    out.append(StreamPartition(path, address, queue, quota, self.auto_abort_ms))
        return out

    def read(self, partition: InputPartition) -> Iterator[Any]:
        assert isinstance(partition, StreamPartition)
        return read_partition(partition)

    def __getstate__(self) -> dict[str, Any]:
        """Spark ships `read` to the executors with its reader: the driver's state stays behind."""
        return {}

    # -- committing -----------------------------------------------------------------------------

    def commit(self, end: dict[str, Any]) -> None:
        with self.lock:
            self._confirm_up_to(int(end.get("batch", -1)))

    def _confirm_up_to(self, committed: int) -> None:
        """Confirm the reads of every logged batch the sink has committed, then forget the batch.

        A log file whose server could not take the confirm stays in the log, pending: it is tried
        again at every planning and commit (and by a query restarted from the checkpoint)."""
        for batch in wal.batches(self.root):
            if batch > committed:
                break
            pending = 0
            for path in wal.batch_files(self.root, batch):
                if wal.is_confirmed(path) or self._confirm(path):
                    wal.forget_file(path)
                else:
                    pending += 1
            if not pending:
                wal.forget_batch(self.root, batch)

    def _confirm(self, path: str) -> bool:
        """Confirm one log file's reads, over any connection to their server, and mark it so.

        False when the server did not take it (unreachable, shutting down, refusing), or failed a
        call less than a second ago (servers.RETRY_S): the file stays as it was, to be tried again. Reads
        the server no longer holds (a restart returned them, or autoAbortMs did; a read id from
        before a restart closes nothing, as a server never hands out an id twice) had their items
        put back in the queue: they are delivered again, and counted as possible duplicates in the
        log's `returned` file."""
        header, ids = wal.read_ids(path)
        if ids:
            if not self.reach.due(header.server):
                return False
            wal.mark_confirming(path)
            try:
                queue = header.queue or self.queues[0]
                closed = self.cluster.server(header.server).confirm(queue, set(ids))
            except KestrelClientError as e:
                wal.unmark_confirming(path)
                self.reach.failed(header.server, "confirm (kept in the log, tried again)", e)
                return False
            self.reach.answered(header.server)
            if closed < len(ids):
                total = wal.count_returned(self.root, len(ids) - closed)
                log.warning("reads no longer open (a server restart or autoAbortMs returned them): their "
                            "items are delivered again", server=header.server, items=len(ids) - closed,
                            returned_so_far=total)
        wal.mark_confirmed(path)
        return True

    def _keep_reads_alive(self) -> None:
        """Confirm in-flight reads at half their auto-abort time (their items are in the log)."""
        period = self.auto_abort_ms / 8000.0
        while not self._stopped.wait(period):
            with self.lock:
                for batch in wal.batches(self.root):
                    for path in wal.batch_files(self.root, batch):
                        if wal.is_confirmed(path):
                            continue
                        header, _ = wal.read_ids(path)
                        if time.time() - header.fetched_at > self.auto_abort_ms / 2000.0:
                            self._confirm(path)

    def stop(self) -> None:
        """Confirm what the sink committed. The reads of a batch it did not commit stay open: the
        next query from this checkpoint replays that batch from the log and confirms them (or,
        after autoAbortMs, they return to their queue)."""
        self._stopped.set()
        with self.lock:
            self._confirm_up_to(self.spark_log.committed())
        self.cluster.close()


class RefusedStream(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """A stream whose options were refused: its first call from Spark raises the refusal."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def _refuse(self) -> NoReturn:
        raise self.error

    def initialOffset(self) -> dict[str, Any]:
        self._refuse()

    def getDefaultReadLimit(self) -> ReadLimit:
        self._refuse()

    def prepareForTriggerAvailableNow(self) -> None:
        self._refuse()

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        self._refuse()

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> list[InputPartition]:
        self._refuse()

    def read(self, partition: InputPartition) -> Iterator[Any]:
        self._refuse()

    def commit(self, end: dict[str, Any]) -> None:
        pass

    def stop(self) -> None:
        pass


K = TypeVar("K", str, tuple[str, str])


def partition_size(total: int, per_partition: int, min_partitions: int | None) -> int:
    """Items per partition: `itemsPerPartition`, or fewer so that a batch of `total` items makes at
    least `minPartitions` partitions (each server's and queue's share is split on its own)."""
    if not min_partitions:
        return per_partition
    return max(1, min(per_partition, total // min_partitions))


def share(waiting: dict[K, int], cap: int | None) -> dict[K, int]:
    """How many to take from each server (and queue): everything, or `cap` split in proportion to
    what waits."""
    total = sum(waiting.values())
    if total == 0:
        return {}
    if cap is None or cap >= total:
        return {a: n for a, n in waiting.items() if n}
    take = {a: n * cap // total for a, n in waiting.items()}
    for address in sorted(waiting, key=lambda a: waiting[a] - take[a], reverse=True):
        if sum(take.values()) >= cap:
            break
        if take[address] < waiting[address]:
            take[address] += 1
    return {a: n for a, n in take.items() if n}
