"""`df.write.format("kestrel")`: put a DataFrame's `data` column into a queue on a list of servers.

Each task puts its rows in batches through a client `Cluster`, spreading batches over the servers
round-robin from a task-dependent start (Kestrel's cluster model: servers never coordinate); a
batch a server cannot take goes on to the next server, and when no server can take it, the client
tries them all again (`retries` times, the pauses from `retryBackoffMs` doubling): the one layer
that retries, so the writer adds none on top. Everything that can be known before a row is written
is checked when the job is planned: the servers, the options and the column's type. A put retried
after a lost reply may add its batch twice (at-least-once).

`writeStream.format("kestrel")` puts each micro-batch the same way (`KestrelStreamWriter`), also at
least once: a batch that Spark runs again after a failure (its rows put, its commit not yet
recorded) is put again, so the items of the batches in flight at a failure may be queued twice.
"""

from __future__ import annotations

import functools
import sys
from array import array
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import structlog
from pyspark.sql.datasource import DataSourceArrowWriter, DataSourceStreamArrowWriter, WriterCommitMessage
from pyspark.sql.types import BinaryType, StringType, StructType

from kestrel.client import Cluster, PackedItems
from kestrel.pipeline.options import Option, choice, parse_options, queue_name, text, whole
from kestrel.pipeline.servers import parse_servers
from kestrel.pipeline.worker import spare_collections

log = structlog.get_logger("kestrel.pipeline")

WRITE_OPTIONS = [
    Option("servers", text, doc="host:port,host:port,... (port 2229 by default)"),
    Option("queue", queue_name, doc="the queue to put into"),
    Option("batchSize", whole(1), 10_000, "items per put, at most"),
    Option("batchBytes", whole(1), 4 << 20, "bytes of items per put, at most (a server refuses a put over "
                                            "its max_batch_bytes, 16 MB by default); a larger item alone"),
    Option("retries", whole(0), 5, "passes over the servers again when none could take a put"),
    Option("retryBackoffMs", whole(1), 100, "the pause before the first of them; doubled each time, at most "
                                            "10 s, each shortened at random by up to half"),
    Option("onFull", choice("fail", "count"), "fail", "items every server's queue refused (full, or over "
                                                       "its max_item_size) fail the job or count"),
    Option("onNull", choice("fail", "count"), "fail", "a null fails the job, or is skipped and counted"),
    Option("column", text, None, "the column to put (default: `data`, else `value`, else the only one)"),
]


MAX_BACKOFF_MS = 10_000


class QueueFullError(RuntimeError):
    """Raised when a queue refuses items and the writer was not told to count refusals."""


class NullDataError(ValueError):
    """Raised when a row's data is null and the writer was not told to count nulls."""


@dataclass
class PutReport(WriterCommitMessage):
    written: int
    refused: int
    nulls: int


def data_column(schema: StructType, chosen: str | None) -> str:
    """The column to put; refused unless it is a string or binary column."""
    names = schema.fieldNames()
    if chosen is not None:
        name = chosen
    elif "data" in names:
        name = "data"
    elif "value" in names:
        name = "value"
    elif len(names) == 1:
        name = names[0]
    else:
        raise ValueError(f"kestrel writer: the DataFrame needs a 'data' (or 'value') column, or option "
                         f"'column'; it has {names}")
    if name not in names:
        raise ValueError(f"kestrel writer: no column {name!r}; the DataFrame has {names}")
    kind = schema[name].dataType
    if not isinstance(kind, StringType | BinaryType):
        raise TypeError(f"kestrel writer: column {name!r} is {kind.simpleString()}; only string or binary "
                        f"columns can be put (cast it first, e.g. to_json(...) or cast(... as string))")
    return name


def packed(pieces: list[Any], size: int) -> PackedItems:
    """Arrow binary slices (no nulls) of `size` bytes of items in all, laid out as a put carries them:
    each item's 4-byte big-endian length, then its bytes. Arrow lays the lengths and the items end to
    end and takes them in turn (`_in_turn`), a copy of each; the bytes of what it took are the put's
    body. So a put costs no Python object per item (Arrow's join of each item to its length cost
    four times as much as the take)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    column = pieces[0] if len(pieces) == 1 else pa.concat_arrays(pieces)
    count = len(column)
    lengths = array("i")
    lengths.frombytes(pc.binary_length(column).buffers()[1][:4 * count])
    if sys.byteorder == "little":
        lengths.byteswap()
    prefixes = pa.Array.from_buffers(pa.binary(4), count, [None, pa.py_buffer(lengths)]).cast(pa.binary())
    body = pa.concat_arrays([prefixes, column]).take(_in_turn(count)).buffers()[2]  # a new array: from byte 0
    return PackedItems(memoryview(body)[:4 * count + size], count)


@functools.lru_cache(maxsize=8)
def _in_turn(count: int) -> Any:
    """The positions 0, count, 1, count + 1, ...: of `count` lengths followed by `count` items, each
    length then its item. Made once for each size of put (a writer's puts mostly share one)."""
    import pyarrow as pa

    order = array("i", bytes(8 * count))
    order[0::2] = array("i", range(count))
    order[1::2] = array("i", range(count, 2 * count))
    return pa.Array.from_buffers(pa.int32(), 2 * count, [None, pa.py_buffer(order)])


class KestrelWriter(DataSourceArrowWriter):
    def __init__(self, options: Mapping[str, str], schema: StructType) -> None:
        o = parse_options(options, WRITE_OPTIONS, "kestrel writer", required=("servers", "queue"))
        self.servers: list[str] = parse_servers(o["servers"])
        self.queue: str = o["queue"]
        self.batch_size: int = o["batchSize"]
        self.batch_bytes: int = o["batchBytes"]
        self.retries: int = o["retries"]
        self.backoff_ms: int = o["retryBackoffMs"]
        self.on_full: str = o["onFull"]
        self.on_null: str = o["onNull"]
        self.column = data_column(schema, o["column"])
        spare_collections()  # in the Python worker that plans the write

    def write(self, iterator: Iterator[Any]) -> PutReport:
        import pyarrow as pa
        import pyarrow.compute as pc
        from pyspark import TaskContext

        spare_collections()
        context = TaskContext.get()
        turn = context.partitionId() % len(self.servers) if context is not None else 0
        # Tasks start on different servers; the client retries, the writer does not retry on top.
        cluster = Cluster(self.servers[turn:] + self.servers[:turn], retries=self.retries,
                          backoff_ms=self.backoff_ms, max_backoff_ms=MAX_BACKOFF_MS)
        written = refused = nulls = 0
        pending: list[Any] = []  # Arrow slices of the next put
        pending_count = pending_bytes = 0

        def put(items: PackedItems) -> None:
            nonlocal written, refused
            left, lost = items, 0
            refused_size: int | None = None  # the smallest item every server refused in this put
            while left:
                if refused_size is not None and left.first_size() >= refused_size:
                    # Refused as well, over max_item_size or by full queues, without a call each:
                    # a full queue's batch costs one put, not one per item and server.
                    lost += 1
                    left = left[1:]
                    continue
                # Raises NoServers once no server could be reached through the client's retries; servers
                # lost mid-batch raise rather than count as refusing. A put answers how many items came
                # before the first one refused, not why: one that every server refused (over
                # max_item_size, or full queues) is refused alone, and the smaller items after it
                # offered again.
                accepted = cluster.put_many(self.queue, left)
                written += accepted
                if not accepted:
                    size = left.first_size()
                    refused_size = size if refused_size is None else min(refused_size, size)
                    lost += 1
                left = left[accepted or 1:]
            refused += lost
            if lost and self.on_full == "fail":
                raise QueueFullError(
                    f"queue {self.queue!r} refused {lost} of {len(items)} items on every server: full, or "
                    f"an item over its max_item_size (a put answers how many it took, not why) (set "
                    f"onFull=count to go on)")

        # One put in flight while the next rows are read and cut: the server stores a batch while
        # Spark hands over the next, rather than each waiting on the other. Puts stay in row order.
        putting = ThreadPoolExecutor(1, thread_name_prefix="kestrel-put")
        in_flight: Future[None] | None = None

        def send(pieces: list[Any], size: int) -> None:
            nonlocal in_flight
            items = packed(pieces, size)
            if in_flight is not None:
                in_flight.result()  # raises what the put raised
            in_flight = putting.submit(put, items)

        try:
            for batch in iterator:
                column = batch.column(batch.schema.get_field_index(self.column))
                if column.null_count:
                    if self.on_null == "fail":
                        raise NullDataError(f"kestrel writer: column {self.column!r} has a null value "
                                            f"(set onNull=count to skip and count them)")
                    nulls += column.null_count
                    column = pc.drop_null(column)
                if not pa.types.is_binary(column.type):  # string, large_string or large_binary
                    column = column.cast(pa.binary())
                for piece, size in self._pieces(column):
                    if pending and (pending_count + len(piece) > self.batch_size
                                    or pending_bytes + size > self.batch_bytes):
                        send(pending, pending_bytes)
                        pending, pending_count, pending_bytes = [], 0, 0
                    pending.append(piece)
                    pending_count += len(piece)
                    pending_bytes += size
            if pending:
                send(pending, pending_bytes)
            if in_flight is not None:
                in_flight.result()
        finally:
            putting.shutdown(wait=True)  # a put in flight ends before its connection is closed
            cluster.close()
        return PutReport(written, refused, nulls)

    def _pieces(self, column: Any) -> Iterator[tuple[Any, int]]:
        """The column in slices that each fit one put (`batchSize` rows, `batchBytes` bytes, or one
        larger row alone), with their bytes: measured by Arrow, a slice at a time, not row by row."""
        import pyarrow.compute as pc

        for first in range(0, len(column), self.batch_size):
            todo = [column.slice(first, self.batch_size)]
            while todo:
                piece = todo.pop()
                size = pc.sum(pc.binary_length(piece)).as_py() or 0
                if size <= self.batch_bytes or len(piece) == 1:
                    yield piece, size
                else:
                    half = len(piece) // 2
                    todo += [piece.slice(half), piece.slice(0, half)]  # the first half comes out first

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        self.report(messages)

    def report(self, messages: list[WriterCommitMessage | None], **batch: int) -> None:
        spare_collections()  # in the Python worker that commits the write
        reports = [m for m in messages if isinstance(m, PutReport)]
        written = sum(r.written for r in reports)
        refused = sum(r.refused for r in reports)
        nulls = sum(r.nulls for r in reports)
        log.info("kestrel write committed", queue=self.queue, written=written, refused=refused,
                 null_rows_skipped=nulls, **batch)
        if refused or nulls:
            log.warning("rows not put", queue=self.queue, refused_by_full_queues=refused,
                        null_rows_skipped=nulls, **batch)

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        log.warning("kestrel write aborted: items already put stay in the queues", queue=self.queue)


class KestrelStreamWriter(DataSourceStreamArrowWriter):
    """`writeStream.format("kestrel")`: each micro-batch put as `df.write` puts a DataFrame, with the
    same options, checks and retries. At least once: a batch run again after a failure is put again."""

    def __init__(self, options: Mapping[str, str], schema: StructType) -> None:
        # The query's own option, passed to its sink as well; the sink keeps nothing there.
        given = {k: v for k, v in options.items() if k.lower() != "checkpointlocation"}
        self.puts = KestrelWriter(given, schema)

    def write(self, iterator: Iterator[Any]) -> PutReport:
        return self.puts.write(iterator)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        self.puts.report(messages, batch=batchId)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        log.warning("kestrel stream write aborted: items already put stay in the queues, and the batch "
                    "is put again if Spark runs it again", queue=self.puts.queue, batch=batchId)
