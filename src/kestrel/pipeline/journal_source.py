"""`spark.read.format("kestrel-journal").load(queue_path)`: journal files as DataFrames, no server.

Several queue paths (several servers' spools) load together with `load([path, ...])`; the records
view's `file` column says which path a row came from.

- `view=records` (default): one row per record, read with the storage engine's own reader, one
  partition per file (files over `maxPartitionBytes` split at record boundaries), rows handed over
  as Arrow batches.
- `view=items`: the items each queue would hold after a restart (open reads first, marked), from a
  read-only replay of the files in place (src/kestrel/storage/kestrel2/replay.py): nothing is copied or
  changed, and a queue's files are listed when its partition is read and read again until they held
  still through a reading (src/kestrel/storage/settled_read.py), so a running server's directory is
  safe to read. The records view reads the files the job planned: one a running server removed
  since fails the job, naming it.
- `mode`: PERMISSIVE (default) reports damage as a row with `status` "torn" or "corrupt: ..."
  (records) or stops that queue's items at the damage with a logged error (items); FAILFAST fails
  the job naming the file and offset.
- `queue`: only these queues (comma-separated); their files alone are opened. With
  `filterPushdown=true` (which needs `spark.sql.python.filterPushdown.enabled`), `where queue = ...`
  and `queue in (...)` do the same.

Kestrel 2 journals only: a Kestrel 3 queue among those to read fails the job as it is planned.
"""

from __future__ import annotations

import bisect
import dataclasses
import errno
import os
import sys
from collections.abc import Iterable, Iterator
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
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

from kestrel.pipeline.options import Option, choice, parse_options, queue_names, text, whole
from kestrel.pipeline.rows import TIMESTAMP, timestamps
from kestrel.pipeline.worker import spare_collections

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
    Option("paths", text, doc="several queue paths: what load([path, ...]) passes (a JSON list)"),
    Option("view", choice("records", "items"), "records"),
    Option("mode", choice("PERMISSIVE", "FAILFAST"), "PERMISSIVE", "what damage does"),
    Option("queue", queue_names, None, "only these queues, comma-separated"),
    Option("filterPushdown", choice("true", "false"), "false", "take `queue` filters from `where`"),
    Option("maxPartitionBytes", whole(1), 128 << 20, "larger files are split at record boundaries"),
]

# A batch ends at whichever comes first. Spark takes batches of about a megabyte fastest: measured
# on 1 KB records in one local[2] session (best of five), batches of 10,000 rows (10 MB) took 2.7 s
# for 210 MB where 500 to 2,000 rows took 0.7 to 0.8 s.
ROWS_PER_BATCH = 10_000
BYTES_PER_BATCH = 1 << 20


class JournalPartition(InputPartition):
    """A queue of a queue path (items view: `path` is the queue path), or one file's records from
    byte `start` up to `end` (records view: `path` is the file; `last`: the file is its queue's last,
    whose tail may be torn). An empty `path` is the one partition of a read that found no queue."""

    def __init__(self, queue: str, path: str, start: int = 0, end: int | None = None,
                 last: bool = True) -> None:
        super().__init__(queue)
        self.queue, self.path, self.start, self.end, self.last = queue, path, start, end, last


def split_points(path: str, max_bytes: int) -> list[tuple[int, int | None]]:
    """Byte ranges of about `max_bytes` that start on record boundaries, found by walking the file
    with the storage reader (only for files larger than `max_bytes`). Damage ends the walk: the rest
    of the file is the last range, where the reader meets the damage again."""
    from kestrel.storage.errors import CorruptJournalError
    from kestrel.storage.kestrel2.reader import JournalReader

    if os.path.getsize(path) <= max_bytes:
        return [(0, None)]
    starts = [0]
    reader = JournalReader(path)
    try:
        for offset, _ in reader:
            if offset >= starts[-1] + max_bytes:
                starts.append(offset)
    except CorruptJournalError:
        pass
    finally:
        reader.close()
    return [(a, b) for a, b in zip(starts, starts[1:], strict=False)] + [(starts[-1], None)]


RECORDS_ARROW = pa.schema([
    pa.field("queue", pa.string(), False), pa.field("file", pa.string(), False),
    pa.field("offset", pa.int64(), False), pa.field("opcode", pa.string()), pa.field("xid", pa.int32()),
    pa.field("timestamp", TIMESTAMP), pa.field("expiry", TIMESTAMP),
    pa.field("data", pa.binary()), pa.field("status", pa.string(), False)])


def _record_kinds() -> tuple[dict[type, int], Any, Any, Any]:
    """A small code per record type (its opcode; CONTINUE, which shares opcode 8 with STATE_DUMP,
    gets 10), the opcode name of each code, and the codes whose records carry an xid or data."""
    from kestrel.storage.kestrel2 import codec

    codes = {codec.Add: codec.ADD, codec.Remove: codec.REMOVE, codec.AddX: codec.ADDX,
             codec.RemoveTentative: codec.REMOVE_TENTATIVE, codec.SaveXid: codec.SAVE_XID,
             codec.Unremove: codec.UNREMOVE, codec.ConfirmRemove: codec.CONFIRM_REMOVE,
             codec.AddXid: codec.ADD_XID, codec.StateDump: codec.STATE_DUMP,
             codec.RemoveTentativeXid: codec.REMOVE_TENTATIVE_XID, codec.Continue: 10}
    by_code = {code: codec.OPCODE_NAMES[kind] for kind, code in codes.items()}
    names = pa.array([by_code[code] for code in range(len(by_code))], pa.string())
    fields = {code: {f.name for f in dataclasses.fields(kind)} for kind, code in codes.items()}
    with_xid = pa.array(sorted(code for code, names in fields.items() if "xid" in names), pa.int8())
    with_data = pa.array(sorted(code for code, names in fields.items() if "data" in names), pa.int8())
    return codes, names, with_xid, with_data


KIND_CODES, KIND_NAMES, KINDS_WITH_XID, KINDS_WITH_DATA = _record_kinds()


class RecordColumns:
    """The columns of one batch of records: runs of common records as the storage reader's column
    buffers (wrapped by Arrow without a copy), other records one at a time into Python lists."""

    def __init__(self) -> None:
        self.runs: list[list[Any]] = []  # per run: opcodes, offsets, xids, add times, expiries, data
        self.codes: list[int | None] = []
        self.offsets: list[int] = []
        self.xids: list[int] = []
        self.added: list[int] = []
        self.expiry: list[int] = []
        self.data: list[bytes] = []
        self.rows = 0
        self.bytes = 0  # of item data

    def __len__(self) -> int:
        return self.rows

    def full(self) -> bool:
        return self.rows >= ROWS_PER_BATCH or self.bytes >= BYTES_PER_BATCH

    def add_run(self, columns: Any) -> None:
        """Records from `JournalReader.common_columns`."""
        self._close_records()
        n, codes, offsets, xids, added, expiry, ends, data = columns
        fixed = [(codes, pa.int8()), (offsets, pa.int64()), (xids, pa.int32()), (added, pa.int64()),
                 (expiry, pa.int64())]
        values = pa.Array.from_buffers(pa.binary(), n, [None, pa.py_buffer(ends), pa.py_buffer(data)])
        self.runs.append([pa.Array.from_buffers(kind, n, [None, pa.py_buffer(b)]) for b, kind in fixed]
                         + [values])
        self.rows += n
        self.bytes += len(data)

    def add(self, offset: int, record: Any) -> None:
        """One record of any kind, or None for a damage row (no opcode, no fields)."""
        self.codes.append(None if record is None else KIND_CODES[type(record)])
        self.offsets.append(offset)
        self.xids.append(getattr(record, "xid", 0))
        self.added.append(getattr(record, "add_time", 0))
        self.expiry.append(getattr(record, "expiry", 0) or getattr(record, "expiry_s", 0) * 1000)
        self.data.append(getattr(record, "data", b""))
        self.rows += 1
        self.bytes += len(self.data[-1])

    def _close_records(self) -> None:
        """The records added one at a time, as a run of Arrow columns (keeping the order)."""
        if self.offsets:
            self.runs.append([pa.array(self.codes, pa.int8()), pa.array(self.offsets, pa.int64()),
                              pa.array(self.xids, pa.int32()), pa.array(self.added, pa.int64()),
                              pa.array(self.expiry, pa.int64()), pa.array(self.data, pa.binary())])
            for column in (self.codes, self.offsets, self.xids, self.added, self.expiry, self.data):
                column.clear()

    def batch(self, queue: str, path: str, status: str) -> Any:
        """The Arrow batch, each column built in one call (no Python work per row)."""
        self._close_records()
        codes, offsets, xids, added, expiry, data = (
            column[0] if len(column) == 1 else pa.concat_arrays(column)
            for column in zip(*self.runs, strict=True))
        n = self.rows
        has_xid = pc.is_in(codes, value_set=KINDS_WITH_XID)  # a damage row's null code: False
        has_data = pc.is_in(codes, value_set=KINDS_WITH_DATA)
        return pa.RecordBatch.from_arrays([
            pa.repeat(pa.scalar(queue, pa.string()), n), pa.repeat(pa.scalar(path, pa.string()), n),
            offsets, pc.take(KIND_NAMES, codes), _valid_where(xids, has_xid),
            timestamps(added), timestamps(expiry), _valid_where(data, has_data),
            pa.repeat(pa.scalar(status, pa.string()), n)], schema=RECORDS_ARROW)


def _valid_where(values: Any, valid: Any) -> Any:
    """`values` (no nulls, offset 0) with a null wherever `valid` (booleans, no nulls) is False."""
    return pa.Array.from_buffers(values.type, len(values), [valid.buffers()[1], *values.buffers()[1:]])


def _first_records(run: Any, count: int) -> Any:
    """The first `count` records of a run of column buffers (`JournalReader.common_columns`)."""
    _, codes, offsets, xids, added, expiry, ends, data = run
    data_end = memoryview(ends).cast("i")[count]
    return (count, codes[:count], offsets[:8 * count], xids[:4 * count], added[:8 * count],
            expiry[:8 * count], ends[:4 * (count + 1)], data[:data_end])


def record_batches(queue: str, path: str, failfast: bool, start: int = 0,
                   end: int | None = None, last: bool = True) -> Iterator[Any]:
    """The records starting in [start, end) as Arrow batches of at most ROWS_PER_BATCH rows and
    about BYTES_PER_BATCH of data; damage is a final row, or an error under FAILFAST. An incomplete
    record at the end is torn only in the queue's `last` file, damage in any other."""
    from kestrel.storage.errors import CorruptJournalError
    from kestrel.storage.kestrel2.reader import JournalReader

    limit = end if end is not None else sys.maxsize
    columns = RecordColumns()
    damage: tuple[int, str] | None = None
    try:
        reader = JournalReader(path, start)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, "journal file gone since the job was planned (a running "
                                "server rotated, packed or consumed it): read the items view, a stopped "
                                "server's queue path or a copy", path) from None
    try:
        try:
            while True:
                if columns.full():
                    yield columns.batch(queue, path, "ok")
                    columns = RecordColumns()
                run = reader.common_columns(BYTES_PER_BATCH - columns.bytes)
                if run[0]:
                    offsets = memoryview(run[2]).cast("q")
                    if offsets[-1] >= limit:  # the range ends inside this run
                        run = _first_records(run, bisect.bisect_left(offsets, limit))
                        if run[0]:
                            columns.add_run(run)
                        break
                    columns.add_run(run)
                    continue
                entry = reader.next()
                if entry is None or entry[0] >= limit:
                    break
                columns.add(*entry)
            if end is None and reader.leftover():  # the one torn-tail rule: torn, or a damaged size
                error = reader.tail_damage(last)
                if error is not None:
                    raise error
                damage = (reader.offset, "torn")
        except CorruptJournalError as e:
            damage = (e.offset, f"corrupt: {e.reason}")
    finally:
        reader.close()
    if len(columns):
        yield columns.batch(queue, path, "ok")
    if damage is not None:
        if failfast:
            raise CorruptJournalError(path, damage[0], None, f"{damage[1]} (mode FAILFAST)")
        columns = RecordColumns()
        columns.add(damage[0], None)
        yield columns.batch(queue, path, damage[1])


def item_batches(queue: str, queue_path: str, failfast: bool) -> Iterator[Any]:
    """The queue as the server would load it, open reads first, from its files as they are now."""
    import structlog  # only here: a planning worker that reads no items does not pay for it

    from kestrel.storage.errors import CorruptJournalError
    from kestrel.storage.kestrel2.replay import QueueReplay, replay_files
    from kestrel.storage.settled_read import read_settled

    def replayed() -> tuple[QueueReplay, CorruptJournalError | None]:
        replay = QueueReplay()
        try:
            replay.run(replay_files(queue_path, queue))
        except CorruptJournalError as e:
            return replay, e  # what came before the damage, shown in PERMISSIVE mode
        return replay, None

    replay, damage = read_settled(queue_path, queue, replayed)
    if damage is not None:
        if failfast:
            raise damage
        structlog.get_logger("kestrel.pipeline").error(
            "damaged journal: items after the damage are not shown (mode PERMISSIVE)", queue=queue,
            file=damage.path, offset=damage.offset, reason=damage.reason)
    elif replay.torn_tail is not None:  # as the records view's row `torn`: the items are those before it
        path, offset = replay.torn_tail
        if failfast:
            raise CorruptJournalError(path, offset, None, "torn (mode FAILFAST)")
        structlog.get_logger("kestrel.pipeline").warning(
            "torn journal: the items are those before the torn write, as the next start loads them (mode "
            "PERMISSIVE)", queue=queue, file=path, offset=offset)
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
            timestamps([i.add_time for i in chunk]), timestamps([i.expiry or 0 for i in chunk]),
            pa.array(is_open, pa.bool_()),
            pa.array([i.xid if o else None for i, o in zip(chunk, is_open, strict=True)], pa.int32())],
            schema=arrow)


class JournalReader(DataSourceReader):
    def __init__(self, paths: list[str], view: str, failfast: bool, queues: set[str] | None,
                 max_partition_bytes: int) -> None:
        self.paths, self.view, self.failfast, self.queues = paths, view, failfast, queues
        self.max_partition_bytes = max_partition_bytes

    def partitions(self) -> list[InputPartition]:
        from kestrel.storage import commit_log, formats
        from kestrel.storage.queue_path import scan_queue_dir

        out: list[InputPartition] = []
        kestrel3: list[str] = []
        for queue_path in self.paths:
            if (note := commit_log.pending_note(queue_path)) is not None:
                import structlog

                structlog.get_logger("kestrel.pipeline").warning(note)
            for name, files in sorted(scan_queue_dir(queue_path).queues.items()):
                if self.queues is not None and name not in self.queues:
                    continue
                if formats.format_of(files) == formats.KESTREL3:
                    kestrel3.append(os.path.join(queue_path, name))
                    continue
                if self.view == "items":
                    out.append(JournalPartition(name, queue_path))
                else:
                    paths = [p for _, p in files.packs] + files.replay_order()
                    out.extend(JournalPartition(name, p, start, end, p == paths[-1]) for p in paths
                               for start, end in split_points(p, self.max_partition_bytes))
        if kestrel3:
            # Their writer files are named as rotated Kestrel 2 journals are: read as such, they were
            # rows of damage ("unknown opcode 39" at offset 0).
            raise ValueError(f"kestrel-journal reads Kestrel 2 journals, and these queues are Kestrel 3's "
                             f"(journal_format: kestrel3): {', '.join(kestrel3)}. Read a copy of the queue "
                             f"path converted with `kestrel journal convert --to kestrel2`, or leave them "
                             f"out with the option queue")
        return out or [JournalPartition("", "")]

    def read(self, partition: InputPartition) -> Iterator[Any]:
        assert isinstance(partition, JournalPartition)
        spare_collections()
        if not partition.path:
            return
        if self.view == "items":
            yield from item_batches(partition.queue, partition.path, self.failfast)
        else:
            yield from record_batches(partition.queue, partition.path, self.failfast, partition.start,
                                      partition.end, partition.last)


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
        paths = queue_paths(o["path"], o["paths"])
        queues = set(o["queue"]) if o["queue"] else None
        kind = FilteringJournalReader if o["filterPushdown"] == "true" else JournalReader
        return kind(paths, o["view"], o["mode"] == "FAILFAST", queues, o["maxPartitionBytes"])


def queue_paths(path: str | None, paths: str | None) -> list[str]:
    """The queue paths to read: `load(path)` passes `path`, `load([path, ...])` a JSON list as
    `paths`; each must be a directory, and each is read once."""
    import json

    given = [path] if path else []
    if paths:
        try:
            listed = json.loads(paths)
        except ValueError:
            listed = None
        if not isinstance(listed, list) or not all(isinstance(p, str) for p in listed):
            raise ValueError(f"kestrel-journal: option 'paths' must be a JSON list of paths, got {paths!r}")
        given += listed
    if not given:
        raise ValueError("kestrel-journal needs the queue path as load(path), or several paths as "
                         "load([path, ...])")
    out: list[str] = []
    for p in given:
        if not os.path.isdir(p):
            raise ValueError(f"kestrel-journal: queue path {p!r} is not a directory")
        if os.path.realpath(p) not in {os.path.realpath(q) for q in out}:
            out.append(p)
    return out
