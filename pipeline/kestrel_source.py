"""`format("kestrel")`: DataFrames into queues, queues into DataFrames and streams, over Thrift.

- write: each partition puts its `data` column in batches, spreading batches over the servers
  round-robin from a partition-dependent start (Kestrel's cluster model: servers never coordinate).
- read: drains up to `max_items`, each item an auto-abort open read confirmed only after its rows
  were handed to Spark; a task that dies leaves its items to come back by themselves.
- readStream: the driver fetches each micro-batch as open reads (auto-abort `auto_abort_ms`) and
  confirms them when Spark commits the batch; a failed or stopped query's items return to their
  queues (at-least-once into the sink). Spark commits a batch to its source only when it plans the
  next batch with data, so the last batch before a stop is delivered again after the restart.
  A micro-batch holds at most `max_batch_items` items per server, carried to the executors inside
  its partitions; keep `auto_abort_ms` well above the time a batch takes.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import structlog
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceWriter,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.types import BinaryType, StringType, StructField, StructType

from pipeline.client import KestrelClient, parse_servers

log = structlog.get_logger("kestrel.pipeline")

READ_SCHEMA = StructType([
    StructField("data", BinaryType(), False),
    StructField("server", StringType(), False),
])


def _int_option(options: Mapping[str, str], key: str, default: int) -> int:
    value = options.get(key, default)
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"option {key!r} must be a whole number, got {value!r}") from None
    if number < 0:
        raise ValueError(f"option {key!r} cannot be negative, got {number}")
    return number


def _queue(options: Mapping[str, str]) -> str:
    queue = options.get("queue")
    if not queue:
        raise ValueError("option 'queue' is required, e.g. .option('queue', 'jobs')")
    return queue


# ---------------------------------------------------------------------------------------------
# Writing


@dataclass
class PutReport(WriterCommitMessage):
    written: int
    refused: int


class QueueFullError(RuntimeError):
    """Raised when a queue refuses items and the writer was not told to count refusals."""


class KestrelWriter(DataSourceWriter):
    def __init__(self, options: Mapping[str, str], schema: StructType) -> None:
        self.servers = parse_servers(options.get("servers"))
        self.queue = _queue(options)
        self.batch_size = max(1, _int_option(options, "batch_size", 1000))
        self.retries = _int_option(options, "retries", 3)
        self.on_full = options.get("on_full", "fail")
        if self.on_full not in ("fail", "count"):
            raise ValueError(f"option 'on_full' must be fail or count, got {self.on_full!r}")
        names = schema.fieldNames()
        if "data" not in names and len(names) != 1:
            raise ValueError(f"the DataFrame needs a 'data' column (binary or string); it has {names}")
        self.column = "data" if "data" in names else names[0]

    def write(self, iterator: Iterator[Any]) -> PutReport:
        from pyspark import TaskContext

        context = TaskContext.get()
        turn = context.partitionId() if context is not None else 0
        clients = [KestrelClient(host, port, self.retries) for host, port in self.servers]
        written = refused = 0
        batch: list[bytes] = []

        def put() -> None:
            nonlocal turn, written, refused
            client = clients[turn % len(clients)]
            turn += 1
            accepted = client.call("put", self.queue, batch, 0)
            written += accepted
            if accepted < len(batch):
                refused += len(batch) - accepted
                if self.on_full == "fail":
                    raise QueueFullError(
                        f"queue {self.queue!r} on {client.address} is full: it refused "
                        f"{len(batch) - accepted} of {len(batch)} items (set on_full=count to go on)")
            batch.clear()

        try:
            for row in iterator:
                value = row[self.column]
                if value is None:
                    continue
                batch.append(value.encode("utf-8") if isinstance(value, str) else bytes(value))
                if len(batch) >= self.batch_size:
                    put()
            if batch:
                put()
        finally:
            for client in clients:
                client.close()
        return PutReport(written, refused)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        reports = [m for m in messages if isinstance(m, PutReport)]
        written = sum(r.written for r in reports)
        refused = sum(r.refused for r in reports)
        log.info("kestrel write committed", queue=self.queue, written=written, refused=refused)
        if refused:
            log.warning("full queues refused items", queue=self.queue, refused=refused)

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        log.warning("kestrel write aborted: items already put stay in the queues", queue=self.queue)


# ---------------------------------------------------------------------------------------------
# Draining in a batch job


class ServerPartition(InputPartition):
    def __init__(self, index: int, host: str, port: int, quota: int) -> None:
        super().__init__(index)
        self.host, self.port, self.quota = host, port, quota


class KestrelBatchReader(DataSourceReader):
    def __init__(self, options: Mapping[str, str]) -> None:
        self.servers = parse_servers(options.get("servers"))
        self.queue = _queue(options)
        self.max_items = _int_option(options, "max_items", 10_000)
        self.batch_size = max(1, _int_option(options, "batch_size", 1000))
        self.auto_abort_ms = max(1, _int_option(options, "auto_abort_ms", 300_000))
        self.timeout_ms = _int_option(options, "timeout_ms", 0)

    def partitions(self) -> list[InputPartition]:
        share, extra = divmod(self.max_items, len(self.servers))
        return [ServerPartition(i, host, port, share + (1 if i < extra else 0))
                for i, (host, port) in enumerate(self.servers)]

    def read(self, partition: InputPartition) -> Iterator[tuple[bytes, str]]:
        assert isinstance(partition, ServerPartition)
        client = KestrelClient(partition.host, partition.port)
        left = partition.quota
        try:
            while left > 0:
                items = client.call("get", self.queue, min(left, self.batch_size), self.timeout_ms,
                                    self.auto_abort_ms)
                if not items:
                    return
                for item in items:
                    yield (item.data, client.address)
                # Spark has taken these rows: now they may leave the queue for good.
                client.call("confirm", self.queue, {item.id for item in items})
                left -= len(items)
        finally:
            client.close()


# ---------------------------------------------------------------------------------------------
# Streaming


class BatchPartition(InputPartition):
    def __init__(self, batch: int, rows: list[tuple[bytes, str]]) -> None:
        super().__init__(batch)
        self.rows = rows


class KestrelStreamReader(DataSourceStreamReader):
    """Offsets are micro-batch numbers; the batches fetched but not yet committed live here."""

    def __init__(self, options: Mapping[str, str]) -> None:
        self.servers = parse_servers(options.get("servers"))
        self.queue = _queue(options)
        self.max_batch_items = max(1, _int_option(options, "max_batch_items", 10_000))
        self.auto_abort_ms = max(1, _int_option(options, "auto_abort_ms", 300_000))
        self.clients = [KestrelClient(host, port) for host, port in self.servers]
        self.batches: dict[int, list[tuple[int, int, bytes]]] = {}  # batch -> (server, id, data)
        self.last = -1

    def initialOffset(self) -> dict:
        return {"batch": -1}

    def latestOffset(self, start: dict, limit: Any) -> dict:
        self.last = max(self.last, int(start.get("batch", -1)))
        fetched: list[tuple[int, int, bytes]] = []
        for index, (host, port) in enumerate(self.servers):
            fetched.extend((index, read_id, data) for read_id, data in self._fetch(host, port))
        if not fetched:
            return {"batch": self.last}
        self.last += 1
        self.batches[self.last] = fetched
        return {"batch": self.last}

    def _fetch(self, host: str, port: int) -> list[tuple[int, bytes]]:
        """Up to `max_batch_items` open reads from one server.

        A server caps the open reads of one connection (`max_open_reads`), and this batch's reads
        stay open until Spark commits it. Thrift open reads outlive their connection and are
        confirmed by id, so each fetch uses fresh connections until it has enough or the queue is
        empty, and earlier uncommitted batches never block it.
        """
        out: list[tuple[int, bytes]] = []
        while len(out) < self.max_batch_items:
            client = KestrelClient(host, port)
            try:
                items = client.call("get", self.queue, self.max_batch_items - len(out), 0, self.auto_abort_ms)
            finally:
                client.close()
            if not items:
                break
            out.extend((item.id, item.data) for item in items)
        return out

    def partitions(self, start: dict, end: dict) -> list[InputPartition]:
        first, last = int(start.get("batch", -1)) + 1, int(end["batch"])
        out: list[InputPartition] = []
        for batch in range(first, last + 1):
            rows = [(data, self.clients[i].address) for i, _, data in self.batches.get(batch, [])]
            out.append(BatchPartition(batch, rows))
        return out

    def read(self, partition: InputPartition) -> Iterator[tuple[bytes, str]]:
        assert isinstance(partition, BatchPartition)
        yield from partition.rows

    def commit(self, end: dict) -> None:
        """Spark has the batches up to `end` safely in the sink: confirm their open reads."""
        for batch in sorted(b for b in self.batches if b <= int(end["batch"])):
            self._close(self.batches.pop(batch), "confirm")

    def _close(self, rows: list[tuple[int, int, bytes]], method: str) -> None:
        by_server: dict[int, set[int]] = {}
        for index, read_id, _ in rows:
            by_server.setdefault(index, set()).add(read_id)
        for index, ids in by_server.items():
            self.clients[index].call(method, self.queue, ids)

    def stop(self) -> None:
        """Items of batches Spark never committed go back to the head of their queues now."""
        for rows in self.batches.values():
            try:
                self._close(rows, "abort")
            except ConnectionError as e:
                log.warning("could not abort open reads; auto-abort will return them", error=str(e))
        self.batches.clear()
        for client in self.clients:
            client.close()


class KestrelDataSource(DataSource):
    """Options: `servers` (host:port,...), `queue`; see the module docstring for the rest."""

    @classmethod
    def name(cls) -> str:
        return "kestrel"

    def schema(self) -> StructType:
        return READ_SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        return KestrelBatchReader(self.options)

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        if overwrite:
            raise ValueError("a queue cannot be overwritten: use mode('append')")
        return KestrelWriter(self.options, schema)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return KestrelStreamReader(self.options)
