"""`spark.readStream.format("kestrel")`: queues as a stream, exactly-once into idempotent sinks.

How a micro-batch lives:
1. Planning (driver, `latestOffset`): peek every server over one long-lived connection each and
   decide how many items to take from each, within `maxItemsPerTrigger`. No items are taken yet;
   an idle stream only peeks, over the same connections.
2. Reading (executors, `read`): each partition takes its share as open reads and writes them, with
   their read ids, to the write-ahead log under the checkpoint before Spark sees a row. A replayed
   batch reads the log instead of the servers, so it yields the same rows.
3. Committing: once Spark's commit log shows the batch committed by the sink (checked at every
   planning, so an idle stream commits too) or Spark calls `commit`, its read ids are confirmed.
   Open reads never time out while their batch is in flight: reads older than half of
   `autoAbortMs` are confirmed early, their items already safe in the log.

Read ids are confirmed only over the driver connection that was open when their batch was planned.
When that connection is lost the server may have restarted and the ids may name other clients'
reads, so they are dropped: their items come back by themselves (at-least-once). Duplicates come
only from such drops: at most the items of the batch in flight per server restart, driver restart
or stop (Spark does not call `stop()` when a query stops, so those reads return after autoAbortMs).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import structlog
from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)

from pipeline import wal
from pipeline.client import Connection, Server, ServerUnreachable, parse_servers
from pipeline.options import Option, parse_options, text, whole
from pipeline.rows import queue_rows

log = structlog.get_logger("kestrel.pipeline")

STREAM_OPTIONS = [
    Option("servers", text, doc="host:port,host:port,..."),
    Option("queue", text),
    Option("checkpointLocation", text, doc="the query's checkpoint location (the log goes there)"),
    Option("maxItemsPerTrigger", whole(1), None, "a cap on the items of one micro-batch, over all servers"),
    Option("itemsPerPartition", whole(1), 10_000, "a server's share is split into partitions of this size"),
    Option("autoAbortMs", whole(1000), 60_000, "open reads return to their queue if not confirmed in time"),
]


class StreamPartition(InputPartition):
    """One task's share of one server in one micro-batch."""

    def __init__(self, path: str, server: Server, queue: str, quota: int, epoch: str,
                 auto_abort_ms: int) -> None:
        super().__init__(path)
        self.path, self.server, self.queue, self.quota = path, server, queue, quota
        self.epoch, self.auto_abort_ms = epoch, auto_abort_ms


def fetch(partition: StreamPartition) -> tuple[list[int], list[bytes], float]:
    """Up to `quota` open reads without waiting. A server caps the open reads of one connection and
    Thrift open reads outlive their connection, so each round uses a fresh connection until the
    quota is met or a fresh connection finds the queue empty. A lost server ends the fetch early."""
    ids: list[int] = []
    items: list[bytes] = []
    started = time.time()
    while len(ids) < partition.quota:
        connection = Connection(partition.server)
        try:
            got = connection.open_reads(partition.queue, partition.quota - len(ids), partition.auto_abort_ms)
        except ServerUnreachable as e:
            log.warning("fetch ended early", server=partition.server.address, error=str(e))
            break
        finally:
            connection.close()
        if not got:
            break
        ids.extend(i for i, _ in got)
        items.extend(d for _, d in got)
    return ids, items, started


def read_partition(partition: StreamPartition) -> Iterator[Any]:
    """The partition's rows: from the log if it exists, else fetched and logged first."""
    if os.path.exists(partition.path):
        items = wal.read_items(partition.path)
    else:
        ids, items, started = fetch(partition)
        header = wal.WalHeader(partition.server.address, partition.epoch, started, len(ids))
        if not wal.write_partition(partition.path, header, ids, items):
            items = wal.read_items(partition.path)  # another attempt logged first: its rows stand
    yield from queue_rows(items, partition.queue, partition.server.address)


class KestrelStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, options: Mapping[str, str]) -> None:
        o = parse_options(options, STREAM_OPTIONS, "kestrel stream",
                          required=("servers", "queue", "checkpointLocation"))
        self.servers = parse_servers(o["servers"])
        self.queue: str = o["queue"]
        self.max_per_trigger: int | None = o["maxItemsPerTrigger"]
        self.per_partition: int = o["itemsPerPartition"]
        self.auto_abort_ms: int = o["autoAbortMs"]
        self.checkpoint = wal.checkpoint_dir(o["checkpointLocation"])
        key = hashlib.sha1(f"{self.queue}@{o['servers']}".encode()).hexdigest()[:12]
        self.source_key = f"{self.queue}-{key}"
        self.root = os.path.join(self.checkpoint, "kestrel", self.source_key)
        self.spark_log = wal.SparkCommitLog(self.checkpoint, self.source_key)
        self.connections = {s.address: Connection(s) for s in self.servers}
        self.handed_over: set[str] = set()  # log files whose ids were confirmed before commit
        self.available_now: dict[str, int] | None = None  # what is left to take, per server
        self.lock = threading.Lock()
        self._stopped = threading.Event()
        self._keeper: threading.Thread | None = None  # started by the first planning, in the driver

    # -- planning -------------------------------------------------------------------------------

    def initialOffset(self) -> dict[str, Any]:
        return {"source": self.source_key, "batch": -1}

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadMaxRows(self.max_per_trigger) if self.max_per_trigger else ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        """Take what is there now and no more; every server must answer before anything is taken."""
        with self.lock:
            self.available_now = {address: self._available(c, strict=True)
                                  for address, c in self.connections.items()}

    def _available(self, connection: Connection, strict: bool) -> int:
        try:
            return connection.available(self.queue)
        except ServerUnreachable as e:
            if strict:
                raise ServerUnreachable(f"{e}: nothing was taken from any server") from e
            log.warning("server unreachable; planning without it", server=connection.address, error=str(e))
            return 0

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        if self._keeper is None:
            if not os.path.exists(os.path.join(self.checkpoint, "metadata")):
                raise ValueError(f"kestrel stream: option 'checkpointLocation' ({self.checkpoint}) holds no "
                                 f"Spark checkpoint: give the source the query's own checkpointLocation")
            self._keeper = threading.Thread(target=self._keep_reads_alive, daemon=True, name="kestrel-keeper")
            self._keeper.start()
        with self.lock:
            self._confirm_up_to(self.spark_log.committed())
            waiting = {address: self._available(c, strict=False) for address, c in self.connections.items()}
            if self.available_now is not None:
                waiting = {a: min(n, self.available_now.get(a, 0)) for a, n in waiting.items()}
            cap = limit.max_rows if isinstance(limit, ReadMaxRows) else None
            take = share(waiting, cap)
            if not take:
                return start
            if self.available_now is not None:
                for address, n in take.items():
                    self.available_now[address] -= n
            return {"source": self.source_key, "batch": int(start.get("batch", -1)) + 1, "take": take}

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> list[InputPartition]:
        if end.get("batch") == start.get("batch") or "take" not in end:
            return []
        batch = int(end["batch"])
        out: list[InputPartition] = []
        with self.lock:
            for address, count in sorted(end["take"].items()):
                epoch = self._epoch(address)
                server = parse_servers(address)[0]
                for part, first in enumerate(range(0, count, self.per_partition)):
                    path = os.path.join(self.root, str(batch), f"{address.replace(':', '_')}-{part}")
                    if epoch is None and not os.path.exists(path):
                        continue  # nothing logged and nothing can be taken now: skipped
                    quota = min(self.per_partition, count - first)
                    out.append(StreamPartition(path, server, self.queue, quota, epoch or "",
                                               self.auto_abort_ms))
        return out

    def _epoch(self, address: str) -> str | None:
        """The planning connection's epoch, None if the server is unlisted or unreachable. A logged
        partition is read back whatever its server's state: its items may live only in the log."""
        connection = self.connections.get(address)
        if connection is None:
            log.warning("server no longer listed: only what the log holds for it is read", server=address)
            return None
        try:
            return connection.open_epoch()
        except ServerUnreachable as e:
            log.warning("server unreachable: only what the log holds for it is read", server=address,
                        error=str(e))
            return None

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
        for batch in wal.batches(self.root):
            if batch > committed:
                break
            for path in wal.batch_files(self.root, batch):
                if path not in self.handed_over:
                    self._confirm(path)
                self.handed_over.discard(path)
            wal.forget_batch(self.root, batch)

    def _confirm(self, path: str) -> None:
        """Confirm one log file's reads if their connection is still the one they were planned on."""
        header, ids = wal.read_ids(path)
        connection = self.connections.get(header.server)
        if not ids:
            return
        if connection is None or connection.epoch != header.epoch:
            log.warning("read ids from an earlier connection are not confirmed: the server may have "
                        "restarted; their items return after autoAbortMs", server=header.server,
                        items=len(ids))
            return
        try:
            connection.confirm(self.queue, ids)
        except ServerUnreachable as e:
            log.warning("confirm failed; the items return by themselves", server=header.server,
                        items=len(ids), error=str(e))

    def _keep_reads_alive(self) -> None:
        """Confirm in-flight reads at half their auto-abort time (their items are in the log)."""
        period = self.auto_abort_ms / 8000.0
        while not self._stopped.wait(period):
            with self.lock:
                for batch in wal.batches(self.root):
                    for path in wal.batch_files(self.root, batch):
                        if path in self.handed_over:
                            continue
                        header, _ = wal.read_ids(path)
                        if time.time() - header.fetched_at > self.auto_abort_ms / 2000.0:
                            self._confirm(path)
                            self.handed_over.add(path)

    def stop(self) -> None:
        """Confirm what the sink committed; give back the reads of a batch it never committed."""
        self._stopped.set()
        with self.lock:
            self._confirm_up_to(self.spark_log.committed())
            for batch in wal.batches(self.root):
                for path in wal.batch_files(self.root, batch):
                    if path not in self.handed_over:
                        self._abort(path)
            for connection in self.connections.values():
                connection.close()

    def _abort(self, path: str) -> None:
        header, ids = wal.read_ids(path)
        connection = self.connections.get(header.server)
        if ids and connection is not None and connection.epoch == header.epoch:
            try:
                connection.abort(self.queue, ids)
            except ServerUnreachable:
                pass


def share(waiting: dict[str, int], cap: int | None) -> dict[str, int]:
    """How many to take from each server: everything, or `cap` split in proportion to what waits."""
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
