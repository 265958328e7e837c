"""`format("kestrel")`: the data source over live servers (batch read, stream read, write).

- `spark.read` looks without taking: each task takes up to its share as open reads and aborts them
  all before handing Spark a row, so the items are back at the head of their queue in order
  whatever Spark then does with the rows (count twice, show, take, limit, first, isEmpty...).
- Taking items for good is a write-side operation: `kestrel.pipeline.drain` (a stream that runs until the
  queues are empty, confirming each batch only after the sink wrote it) or `spark.readStream`.
- `df.write` and `writeStream` put rows (see src/kestrel/pipeline/writer.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import structlog
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    DataSourceStreamWriter,
    DataSourceWriter,
    InputPartition,
)
from pyspark.sql.types import StructType

from kestrel.client import KestrelClientError
from kestrel.pipeline.options import Option, parse_options, queue_names, text, unknown_option, whole
from kestrel.pipeline.rows import QUEUE_SCHEMA, queue_rows
from kestrel.pipeline.servers import (
    ServersUnreachable,
    TakenReads,
    fresh_connections,
    parse_servers,
    take_open_reads,
)

log = structlog.get_logger("kestrel.pipeline")

READ_OPTIONS = [
    Option("servers", text, doc="host:port,host:port,..."),
    Option("queue", queue_names, doc="one queue, or several comma-separated"),
    Option("maxItems", whole(1), 10_000, "at most this many items, shared evenly over servers and queues"),
    Option("autoAbortMs", whole(1000), 60_000, "a task that dies leaves its reads to return this soon"),
]


class PeekPartition(InputPartition):
    def __init__(self, index: int, server: str, queue: str, quota: int, auto_abort_ms: int) -> None:
        super().__init__(index)
        self.server, self.queue, self.quota, self.auto_abort_ms = server, queue, quota, auto_abort_ms


def look(partition: PeekPartition) -> TakenReads:
    """The first `quota` items of one server's queue, left in place: taken as open reads, then
    aborted (read ids are unique on a server, so any connection may give them back).

    A server that cannot be reached, or fails before the quota or the queue's end, fails the task
    rather than make a short answer look whole (`count()` of 0 for a server that is down); what was
    taken is given back first."""
    taken = take_open_reads(partition.server, partition.queue, partition.quota, partition.auto_abort_ms)
    if taken.ids:
        try:
            fresh_connections(partition.server).abort(partition.queue, set(taken.ids))
        except KestrelClientError as e:
            log.warning("could not give back looked-at items; they return after autoAbortMs",
                        server=partition.server, items=len(taken.ids), error=str(e))
    if taken.failure is not None:
        raise ServersUnreachable(f"kestrel read of queue {partition.queue!r}: server {partition.server} "
                                 f"failed after {len(taken.ids)} items: {taken.failure}")
    return taken


class KestrelBatchReader(DataSourceReader):
    def __init__(self, options: Mapping[str, str]) -> None:
        o = parse_options(options, READ_OPTIONS, "kestrel read", required=("servers", "queue"))
        self.servers = parse_servers(o["servers"])
        self.queues: list[str] = o["queue"]
        self.max_items: int = o["maxItems"]
        self.auto_abort_ms: int = o["autoAbortMs"]

    def partitions(self) -> list[InputPartition]:
        """One partition per server and queue that server holds; a queue held by no server fails the
        read, naming it. Asked with a call that creates nothing (a `get` would create the queue)."""
        held = {server: set(self._queue_names(server)) for server in self.servers}
        missing = [queue for queue in self.queues if not any(queue in names for names in held.values())]
        if missing:
            raise ValueError(f"kestrel read: no server holds queue {', '.join(map(repr, missing))} "
                             f"(servers {', '.join(self.servers)}; nothing was created)")
        pairs = [(server, queue) for queue in self.queues for server in self.servers if queue in held[server]]
        share, extra = divmod(self.max_items, len(pairs))
        return [PeekPartition(i, server, queue, share + (1 if i < extra else 0), self.auto_abort_ms)
                for i, (server, queue) in enumerate(pairs)]

    def _queue_names(self, server: str) -> list[str]:
        try:
            return fresh_connections(server).queue_names()
        except KestrelClientError as e:
            raise ServersUnreachable(f"kestrel read of queue {','.join(self.queues)!r}: server {server} "
                                     f"could not list its queues: {e}") from e

    def read(self, partition: InputPartition) -> Iterator[Any]:
        assert isinstance(partition, PeekPartition)
        if partition.quota:
            taken = look(partition)
            yield from queue_rows(taken.items, partition.queue, partition.server, taken.added, taken.expiry)


class KestrelDataSource(DataSource):
    """Options: `servers` (host:port,...) and `queue`; the rest per operation (see the README)."""

    @classmethod
    def name(cls) -> str:
        return "kestrel"

    def schema(self) -> StructType:
        """Spark asks for the schema at `load()`, before it says which operation follows: the one
        moment a stream's options can be checked before `start()`. A name no operation takes fails
        here, with the name likely meant; each operation checks its own options and values too."""
        check_option_names(self.options)
        return QUEUE_SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        return KestrelBatchReader(self.options)

    def writer(self, schema: StructType, overwrite: bool) -> DataSourceWriter:
        from kestrel.pipeline.writer import KestrelWriter

        if overwrite:
            raise ValueError("kestrel writer: a queue cannot be overwritten (Spark's message for its default "
                             "save mode offers Overwrite, but only Append is possible): use mode('append')")
        return KestrelWriter(self.options, schema)

    def streamWriter(self, schema: StructType, overwrite: bool) -> DataSourceStreamWriter:
        from kestrel.pipeline.writer import KestrelStreamWriter

        if overwrite:
            raise ValueError("kestrel stream writer: a queue cannot be overwritten (output mode complete): "
                             "use outputMode('append')")
        return KestrelStreamWriter(self.options, schema)

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        from kestrel.pipeline.stream_source import KestrelStreamReader, RefusedStream

        # PySpark 4.3 stops the reader in a `finally` around its creation, so an error raised here
        # reaches the user behind an UnboundLocalError of PySpark's own: the reader raises it instead.
        try:
            return KestrelStreamReader(self.options)
        except (ValueError, TypeError) as e:
            return RefusedStream(e)


def check_option_names(options: Mapping[str, str]) -> None:
    """Refuse an option name that no operation of the source takes (naming the one likely meant)."""
    from kestrel.pipeline.stream_source import STREAM_OPTIONS
    from kestrel.pipeline.writer import WRITE_OPTIONS

    every: dict[str, Option] = {}
    for option in READ_OPTIONS + STREAM_OPTIONS + WRITE_OPTIONS:
        every.setdefault(option.name, option)
    known = {spelling.lower() for o in every.values() for spelling in (o.name, o.alias)}
    for key in options:
        if key.lower() not in known:
            raise ValueError(unknown_option("kestrel", key, list(every.values())))
