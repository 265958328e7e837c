"""`spark.read.format("kestrel-journal").load(queue_path)`: journal files as DataFrames, no server.

- `view=records` (default): one row per record, read with the storage engine's own reader, one
  partition per file (files over `maxPartitionBytes` split at record boundaries), rows handed over
  as Arrow batches.
- `view=items`: the items each queue would hold after a restart (open reads first, marked), from a
  read-only replay of the files in place (pipeline/replay.py): nothing is copied or changed, so a
  running server's directory is safe to read.
- `mode`: PERMISSIVE (default) reports damage as a row with `status` "torn" or "corrupt: ..."
  (records) or stops that queue's items at the damage with a logged error (items); FAILFAST fails
  the job naming the file and offset.
- `queue`: only these queues (comma-separated); their files alone are opened. With
  `filterPushdown=true` (which needs `spark.sql.python.filterPushdown.enabled`), `where queue = ...`
  and `queue in (...)` do the same.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from typing import Any

import pyarrow as pa
import structlog
from pyspark.sql.datasource import DataSource, DataSourceReader, EqualTo, Filter, In, InputPartition
from pyspark.sql.types import (
    BinaryType,
    BooleanType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from pipeline.options import Option, choice, parse_options, text, whole

log = structlog.get_logger("kestrel.pipeline")

RECORDS_SCHEMA = StructType([
    StructField("queue", StringType(), False),
    StructField("file", StringType(), False),
    StructField("offset", LongType(), False),
    StructField("opcode", StringType(), True),
    StructField("xid", IntegerType(), True),
    StructField("timestamp", TimestampType(), True),  # when the item was added
    StructField("expiry", TimestampType(), True),  # null: never expires
    StructField("data", BinaryType(), True),
    StructField("status", StringType(), False),  # ok, torn (incomplete final record) or corrupt: ...
])

ITEMS_SCHEMA = StructType([
    StructField("queue", StringType(), False),
    StructField("position", LongType(), False),  # 0 = the head
    StructField("data", BinaryType(), False),
    StructField("timestamp", TimestampType(), True),
    StructField("expiry", TimestampType(), True),  # null: never expires
    StructField("open", BooleanType(), False),  # an open read when the journal was written
    StructField("xid", IntegerType(), True),
])

JOURNAL_OPTIONS = [
    Option("path", text, doc="the queue path (or pass it to load())"),
    Option("view", choice("records", "items"), "records"),
    Option("mode", choice("PERMISSIVE", "FAILFAST"), "PERMISSIVE", "what damage does"),
    Option("queue", text, None, "only these queues, comma-separated"),
    Option("filterPushdown", choice("true", "false"), "false", "take `queue` filters from `where`"),
    Option("maxPartitionBytes", whole(1), 128 << 20, "larger files are split at record boundaries"),
]

ROWS_PER_BATCH = 10_000
TIMESTAMP = pa.timestamp("us", tz="UTC")  # Spark's TimestampType in Arrow


class JournalPartition(InputPartition):
    """A queue's files (items view), or one file's records from byte `start` up to `end` (records)."""

    def __init__(self, queue: str, paths: list[str], start: int = 0, end: int | None = None) -> None:
        super().__init__(queue)
        self.queue, self.paths, self.start, self.end = queue, paths, start, end


def split_points(path: str, max_bytes: int) -> list[tuple[int, int | None]]:
    """Byte ranges of about `max_bytes` that start on record boundaries, found by walking the file
    with the storage reader (only for files larger than `max_bytes`). Damage ends the walk: the rest
    of the file is the last range, where the reader meets the damage again."""
    from storage.errors import CorruptJournalError
    from storage.journal import RecordReader

    if os.path.getsize(path) <= max_bytes:
        return [(0, None)]
    starts = [0]
    reader = RecordReader(path)
    try:
        for offset, _ in reader:
            if offset >= starts[-1] + max_bytes:
                starts.append(offset)
    except CorruptJournalError:
        pass
    finally:
        reader.close()
    return [(a, b) for a, b in zip(starts, starts[1:], strict=False)] + [(starts[-1], None)]


def _timestamps(ms: Iterable[int | None]) -> Any:
    """Milliseconds since the epoch (0 or None: no time) as Spark's TimestampType in Arrow."""
    return pa.array([v * 1000 if v else None for v in ms], TIMESTAMP)


RECORDS_ARROW = pa.schema([
    pa.field("queue", pa.string(), False), pa.field("file", pa.string(), False),
    pa.field("offset", pa.int64(), False), pa.field("opcode", pa.string()), pa.field("xid", pa.int32()),
    pa.field("timestamp", TIMESTAMP), pa.field("expiry", TIMESTAMP),
    pa.field("data", pa.binary()), pa.field("status", pa.string(), False)])


def _records_batch(queue: str, path: str, offsets: list[int], records: list[Any], status: str) -> Any:
    """Columns built a whole batch at a time (one pass per column beats appending per record)."""
    from storage.codec import OPCODE_NAMES

    n = len(offsets)
    return pa.RecordBatch.from_arrays([
        pa.repeat(pa.scalar(queue, pa.string()), n), pa.repeat(pa.scalar(path, pa.string()), n),
        pa.array(offsets, pa.int64()),
        pa.array([OPCODE_NAMES[type(r)] if r is not None else None for r in records], pa.string()),
        pa.array([getattr(r, "xid", None) for r in records], pa.int32()),
        _timestamps([getattr(r, "add_time", None) for r in records]),
        _timestamps([getattr(r, "expiry", None) or getattr(r, "expiry_s", 0) * 1000 for r in records]),
        pa.array([getattr(r, "data", None) for r in records], pa.binary()),
        pa.repeat(pa.scalar(status, pa.string()), n)], schema=RECORDS_ARROW)


def record_batches(queue: str, path: str, failfast: bool, start: int = 0,
                   end: int | None = None) -> Iterator[Any]:
    """The records starting in [start, end) as Arrow batches; damage is a final row, or an error
    under FAILFAST."""
    from storage.errors import CorruptJournalError
    from storage.journal import RecordReader

    offsets: list[int] = []
    records: list[Any] = []
    damage: tuple[int, str] | None = None
    reader = RecordReader(path, start)
    try:
        try:
            for offset, record in reader:
                if end is not None and offset >= end:
                    break
                offsets.append(offset)
                records.append(record)
                if len(offsets) >= ROWS_PER_BATCH:
                    yield _records_batch(queue, path, offsets, records, "ok")
                    offsets.clear()
                    records.clear()
            if end is None and reader.leftover():
                damage = (reader.offset, "torn")
        except CorruptJournalError as e:
            damage = (e.offset, f"corrupt: {e.reason}")
    finally:
        reader.close()
    if offsets:
        yield _records_batch(queue, path, offsets, records, "ok")
    if damage is not None:
        if failfast:
            raise CorruptJournalError(path, damage[0], None, f"{damage[1]} (mode FAILFAST)")
        yield _records_batch(queue, path, [damage[0]], [None], damage[1])


def item_batches(queue: str, paths: list[str], failfast: bool) -> Iterator[Any]:
    """The queue as the server would load it, open reads first."""
    from pipeline.replay import Replay
    from storage.errors import CorruptJournalError

    replay = Replay()
    try:
        replay.run(paths)
    except CorruptJournalError as e:
        if failfast:
            raise
        log.error("damaged journal: items after the damage are not shown (mode PERMISSIVE)", queue=queue,
                  file=e.path, offset=e.offset, reason=e.reason)
    opens = [replay.opens[xid] for xid in sorted(replay.opens)]
    items = opens + list(replay.items)
    arrow = pa.schema([
        pa.field("queue", pa.string(), False), pa.field("position", pa.int64(), False),
        pa.field("data", pa.binary(), False), pa.field("timestamp", TIMESTAMP),
        pa.field("expiry", TIMESTAMP), pa.field("open", pa.bool_(), False),
        pa.field("xid", pa.int32())])
    for first in range(0, len(items), ROWS_PER_BATCH):
        chunk = items[first:first + ROWS_PER_BATCH]
        n = len(chunk)
        is_open = [first + i < len(opens) for i in range(n)]
        yield pa.RecordBatch.from_arrays([
            pa.array([queue] * n, pa.string()), pa.array(range(first, first + n), pa.int64()),
            pa.array([i.data for i in chunk], pa.binary()),
            _timestamps([i.add_time for i in chunk]), _timestamps([i.expiry for i in chunk]),
            pa.array(is_open, pa.bool_()),
            pa.array([i.xid if o else None for i, o in zip(chunk, is_open, strict=True)], pa.int32())],
            schema=arrow)


class JournalReader(DataSourceReader):
    def __init__(self, path: str, view: str, failfast: bool, queues: set[str] | None,
                 max_partition_bytes: int) -> None:
        self.path, self.view, self.failfast, self.queues = path, view, failfast, queues
        self.max_partition_bytes = max_partition_bytes

    def partitions(self) -> list[InputPartition]:
        from pipeline.replay import replay_files
        from storage.journal import scan_queue_dir

        out: list[InputPartition] = []
        for name, files in sorted(scan_queue_dir(self.path).queues.items()):
            if self.queues is not None and name not in self.queues:
                continue
            if self.view == "items":
                out.append(JournalPartition(name, replay_files(self.path, name)))
            else:
                paths = [p for _, p in files.packs] + files.replay_order()
                out.extend(JournalPartition(name, [p], start, end) for p in paths
                           for start, end in split_points(p, self.max_partition_bytes))
        return out or [JournalPartition("", [])]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        assert isinstance(partition, JournalPartition)
        if not partition.paths:
            return
        if self.view == "items":
            yield from item_batches(partition.queue, partition.paths, self.failfast)
        else:
            yield from record_batches(partition.queue, partition.paths[0], self.failfast, partition.start,
                                      partition.end)


class FilteringJournalReader(JournalReader):
    """Takes `queue = ...` and `queue in (...)` from the query's filters."""

    def pushFilters(self, filters: list[Filter]) -> Iterable[Filter]:
        for f in filters:
            if isinstance(f, EqualTo | In) and f.attribute == ("queue",):
                wanted = {f.value} if isinstance(f, EqualTo) else set(f.value)
                self.queues = wanted if self.queues is None else self.queues & wanted
            else:
                yield f


class KestrelJournalDataSource(DataSource):
    """Options: see the module docstring."""

    @classmethod
    def name(cls) -> str:
        return "kestrel-journal"

    def _options(self) -> dict[str, Any]:
        return parse_options(self.options, JOURNAL_OPTIONS, "kestrel-journal")

    def schema(self) -> StructType:
        return ITEMS_SCHEMA if self._options()["view"] == "items" else RECORDS_SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        o = self._options()
        path = o["path"]
        if not path or not os.path.isdir(path):
            raise ValueError(f"kestrel-journal needs the queue path as load(path); {path!r} is not a "
                             f"directory")
        queues = {q.strip() for q in o["queue"].split(",")} if o["queue"] else None
        kind = FilteringJournalReader if o["filterPushdown"] == "true" else JournalReader
        return kind(path, o["view"], o["mode"] == "FAILFAST", queues, o["maxPartitionBytes"])
