"""`format("kestrel")`: the data source over live servers (batch read, stream read, write).

- `spark.read` looks without taking: when the job is planned, the driver notes where each queue's
  items are (`peek_items`: the head's position and the length, on each server holding it) and
  splits them into partitions; each task looks at its share with `peek_items`, which opens,
  counts and journals nothing. So whatever Spark does with the rows (count twice, show, take,
  limit...), the queues are as they were: no error count moves towards `max_errors`, no counter,
  no order. The rows are the queues' items as they stood when the read was planned, less any
  taken meanwhile by other readers.
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
from kestrel.pipeline.options import (
    Option,
    parse_options,
    queue_names,
    reader_name,
    text,
    unknown_option,
    whole,
)
from kestrel.pipeline.rows import QUEUE_SCHEMA, queue_rows
from kestrel.pipeline.servers import ServersUnreachable, connect, extend_timed, parse_servers
from kestrel.pipeline.subscription import Subscription
from kestrel.pipeline.worker import spare_collections

log = structlog.get_logger("kestrel.pipeline")

READ_OPTIONS = [
    Option("servers", text, doc="host:port,host:port,..."),
    Option("queue", queue_names, doc="one queue, or several comma-separated; `*`, `?` and `[...]` make a "
                                     "pattern over the queues the servers hold"),
    Option("reader", reader_name, None, "read each queue's fanout child <queue>+<reader>"),
    Option("maxItems", whole(1), None, "refuse the read when the queues hold more items than this"),
    Option("itemsPerPartition", whole(1), 10_000, "a queue's items on one server are split into partitions "
                                                  "of this size"),
]

LOOK_CHUNK = 10_000  # items one peek_items call asks for (the server stops at 8,192 or 512 KB)


class LookPartition(InputPartition):
    """Positions `first` to `first + count` of one queue on one server, as planned on the driver;
    `opened_at` says which opening of the queue the positions count from."""

    def __init__(self, index: int, server: str, queue: str, opened_at: int, first: int, count: int) -> None:
        super().__init__(index)
        self.server, self.queue, self.opened_at = server, queue, opened_at
        self.first, self.count = first, count


class Looked:
    """The items one partition looked at, with their add times and expiries (ms; expiry 0: never)."""

    def __init__(self) -> None:
        self.items: list[bytes] = []
        self.added: list[int] = []
        self.expiry: list[int] = []


def look(partition: LookPartition) -> Looked:
    """The partition's items, left in place (`peek_items`, a chunk at a time). Items taken by other
    readers since planning are gone and left out. A server that cannot be reached fails the task,
    naming it and what it had shown; so do a queue the server reopened since the planning (a
    restart or a delete: its positions count anew) and a queue the server keeps partly on disk
    (read-behind), which a look cannot show: never a short answer passed off as the whole."""
    looked = Looked()
    position, end = partition.first, partition.first + partition.count
    where = f"kestrel read of queue {partition.queue!r}: server {partition.server}"
    with connect(partition.server) as server:
        while position < end:
            try:
                at = server.peek_items(partition.queue, position, min(end - position, LOOK_CHUNK))
            except KestrelClientError as e:
                raise ServersUnreachable(f"{where} failed after {len(looked.items)} items: {e}") from e
            if at.opened_at != partition.opened_at:
                raise RuntimeError(f"{where} reopened the queue during the read (a restart, or the "
                                   f"queue was deleted): run the read again")
            position = max(position, at.head)
            stop = min(end, at.head + at.items)
            if at.after <= position and position < stop:
                raise ValueError(f"{where} keeps the queue partly on disk (read-behind: more than its "
                                 f"max_memory_size), and a look shows only items held in memory, the first "
                                 f"{position - at.head} of {at.items}. Read its journal instead (format("
                                 f"'kestrel-journal').option('view', 'items')), or raise max_memory_size")
            extend_timed(looked.items, looked.added, looked.expiry, at.shown)
            if at.after >= stop:
                break
            position = at.after
    return looked


class KestrelBatchReader(DataSourceReader):
    def __init__(self, options: Mapping[str, str]) -> None:
        o = parse_options(options, READ_OPTIONS, "kestrel read", required=("servers", "queue"))
        self.servers = parse_servers(o["servers"])
        self.subscription = Subscription(tuple(o["queue"]), o["reader"])
        self.max_items: int | None = o["maxItems"]
        self.per_partition: int = o["itemsPerPartition"]

    def partitions(self) -> list[InputPartition]:
        """The queues' items as they stand now, in partitions of `itemsPerPartition` per server and
        queue. A queue (or pattern) no server holds fails the read, naming it, and so does a total
        over `maxItems`. Asked with calls that create nothing (a `get` or `peek` would create the queue)."""
        what = f"kestrel read of {','.join(self.subscription.entries)!r}"
        held: dict[str, list[str]] = {}
        for address in self.servers:
            with connect(address) as server:
                try:
                    held[address] = server.queue_names()
                except KestrelClientError as e:
                    raise ServersUnreachable(f"{what}: server {address} could not list its queues: "
                                             f"{e}") from e
        missing = self.subscription.unmatched(held.values())
        if missing:
            reader = self.subscription.reader
            named = [f"{self.subscription.target(e)!r} (reader {reader!r} of {e!r}: a stream creates it, a "
                     f"batch read does not)" if reader else repr(e) for e in missing]
            raise ValueError(f"kestrel read: no server holds queue {', '.join(named)} "
                             f"(servers {', '.join(self.servers)}; nothing was created)")
        spans: list[tuple[str, str, int, int, int]] = []  # server, queue, opened_at, head, items
        for address in self.servers:
            with connect(address) as server:
                for queue in self.subscription.queues(held[address]):
                    try:
                        at = server.peek_items(queue, 0, 0)
                    except KestrelClientError as e:
                        raise ServersUnreachable(f"{what}: server {address} could not show queue {queue!r}: "
                                                 f"{e}") from e
                    spans.append((address, queue, at.opened_at, at.head, at.items))
        total = sum(span[4] for span in spans)
        if self.max_items is not None and total > self.max_items:
            raise ValueError(f"kestrel read: the queues hold {total:,} items, more than maxItems "
                             f"({self.max_items:,}): raise maxItems, or leave it out to read them all")
        out: list[InputPartition] = []
        for address, queue, opened_at, head, items in spans:
            for first in range(head, head + items, self.per_partition):
                count = min(self.per_partition, head + items - first)
                out.append(LookPartition(len(out), address, queue, opened_at, first, count))
        return out

    def read(self, partition: InputPartition) -> Iterator[Any]:
        assert isinstance(partition, LookPartition)
        spare_collections()
        looked = look(partition)
        yield from queue_rows(looked.items, partition.queue, partition.server, looked.added, looked.expiry)


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
