"""`spark.read.format("kestrel-journal")`: journal files as DataFrames, with no server.

Default mode: one row per journal record (one partition per journal file), read with the storage
engine's own reader. `mode=items`: the items each queue holds after replay, open reads included
and marked, replayed by the storage engine itself on a private copy of the queue's files, so the
operator's directory (even a running server's) is never changed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.types import (
    BinaryType,
    BooleanType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
)

RECORDS_SCHEMA = StructType([
    StructField("queue", StringType(), False),
    StructField("file", StringType(), False),
    StructField("offset", LongType(), False),
    StructField("opcode", StringType(), True),
    StructField("xid", IntegerType(), True),
    StructField("add_time", LongType(), True),  # ms since the epoch
    StructField("expiry", LongType(), True),  # ms since the epoch, 0 = never
    StructField("data", BinaryType(), True),
    StructField("status", StringType(), False),  # ok, torn (incomplete final record) or corrupt: ...
])

ITEMS_SCHEMA = StructType([
    StructField("queue", StringType(), False),
    StructField("position", LongType(), False),  # 0 = the head
    StructField("data", BinaryType(), False),
    StructField("add_time", LongType(), False),
    StructField("expiry", LongType(), False),
    StructField("open", BooleanType(), False),  # an open read when the journal was copied
    StructField("xid", IntegerType(), True),
])


class JournalPartition(InputPartition):
    def __init__(self, queue: str, paths: list[str]) -> None:
        super().__init__(queue)
        self.queue = queue
        self.paths = paths


def _queue_files(path: str, only: str | None) -> list[tuple[str, list[str]]]:
    """(queue, its journal files in replay order) for every queue in the directory."""
    from storage.journal import scan_queue_dir

    out = []
    for name, files in sorted(scan_queue_dir(path).queues.items()):
        if only and name != only:
            continue
        paths = files.replay_order() + [p for _, p in files.packs]
        if paths:
            out.append((name, paths))
    return out


def record_rows(queue: str, path: str) -> Iterator[tuple[Any, ...]]:
    """One row per record of one journal file; damage becomes a final row, not an error."""
    from storage.codec import OPCODE_NAMES
    from storage.errors import CorruptJournalError
    from storage.journal import RecordReader

    reader = RecordReader(path)
    try:
        for offset, record in reader:
            yield (queue, path, offset, OPCODE_NAMES[type(record)], getattr(record, "xid", None),
                   getattr(record, "add_time", None), getattr(record, "expiry", None),
                   getattr(record, "data", None), "ok")
        left = reader.leftover()
        if left:
            yield (queue, path, reader.offset, None, None, None, None, None, "torn")
    except CorruptJournalError as e:
        yield (queue, path, e.offset, None, None, None, None, None, f"corrupt: {e.reason}")
    finally:
        reader.close()


def item_rows(queue: str, paths: list[str]) -> Iterator[tuple[Any, ...]]:
    """The queue as the server would load it, replayed on a private copy of its files."""
    from storage import PersistentQueue, QueueConfig

    scratch = tempfile.mkdtemp(prefix="kestrel-items-")
    try:
        for path in paths:
            shutil.copy2(path, os.path.join(scratch, os.path.basename(path)))
        q = PersistentQueue(queue, scratch, QueueConfig(max_memory_size=64 * 1024 * 1024), salvage=True)
        q.setup(reopen=False)
        position = 0
        for item in q.open_reads():
            yield (queue, position, item.data, item.add_time, item.expiry, True, item.xid)
            position += 1
        while batch := q.remove_many(1000):
            for item in batch:
                yield (queue, position, item.data, item.add_time, item.expiry, False, None)
                position += 1
        q.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


class JournalReader(DataSourceReader):
    def __init__(self, path: str, mode: str, queue: str | None) -> None:
        self.path, self.mode, self.queue = path, mode, queue

    def partitions(self) -> list[InputPartition]:
        queues = _queue_files(self.path, self.queue)
        if self.mode == "items":
            return [JournalPartition(name, paths) for name, paths in queues] or [JournalPartition("", [])]
        parts = [JournalPartition(name, [p]) for name, paths in queues for p in paths]
        return parts or [JournalPartition("", [])]  # type: ignore[return-value]

    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...]]:
        assert isinstance(partition, JournalPartition)
        if not partition.paths:
            return
        if self.mode == "items":
            yield from item_rows(partition.queue, partition.paths)
        else:
            yield from record_rows(partition.queue, partition.paths[0])


class KestrelJournalDataSource(DataSource):
    """Options: `path` (the queue path, or pass it to load()), `mode` (records | items), `queue`."""

    @classmethod
    def name(cls) -> str:
        return "kestrel-journal"

    def _mode(self) -> str:
        mode = self.options.get("mode", "records")
        if mode not in ("records", "items"):
            raise ValueError(f"option 'mode' must be records or items, got {mode!r}")
        return mode

    def schema(self) -> StructType:
        return ITEMS_SCHEMA if self._mode() == "items" else RECORDS_SCHEMA

    def reader(self, schema: StructType) -> DataSourceReader:
        path = self.options.get("path")
        if not path or not os.path.isdir(path):
            raise ValueError(f"kestrel-journal needs the queue path as load(path); "
                             f"{path!r} is not a directory")
        return JournalReader(path, self._mode(), self.options.get("queue"))
