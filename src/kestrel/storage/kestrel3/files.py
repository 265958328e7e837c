"""A Kestrel 3 queue on disk: reading records back, the writer journal, reader checkpoints.

The files are named as `src/kestrel/storage/filenames.py` says: writer journals `q.<number>` (PUT records,
oldest number first; the number is the time in ms at creation, or one more than the last number if
the clock is behind) and one checkpoint per reader, `q.read.<reader>`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from itertools import takewhile

import structlog

from kestrel.storage import disk, journal_file, layout, torn_tail
from kestrel.storage.clock import SYSTEM_CLOCK, Clock
from kestrel.storage.crc32c import crc32c
from kestrel.storage.deferred_log import log_later
from kestrel.storage.errors import CorruptJournalError
from kestrel.storage.filenames import (
    check_name_part,
    checkpoint_temporary_name,
    reader_file_name,
    reader_of,
    writer_file_name,
    writer_file_number,
)
from kestrel.storage.journal_file import AppendLog, JournalWriter
from kestrel.storage.kestrel2.codec import Incomplete, Malformed
from kestrel.storage.kestrel3 import codec as k3
from kestrel.storage.manifest import Entry
from kestrel.storage.runtime import DEFAULT_RUNTIME, Runtime
from kestrel.storage.write_gate import WriteGate

log = structlog.get_logger("kestrel.kestrel3")


@dataclass
class QueueFiles:
    """What the queue path holds for one Kestrel 3 queue."""

    writers: list[tuple[int, str]] = field(default_factory=list)  # (number, path), oldest first
    readers: dict[str, str] = field(default_factory=dict)  # reader name -> path


def list_queue_files(queue_path: str, queue: str) -> QueueFiles:
    check_name_part("queue", queue)
    files = QueueFiles()
    for entry in os.scandir(queue_path):
        if not entry.is_file() or "~" in entry.name:
            continue
        number = writer_file_number(queue, entry.name)
        if number is not None:
            files.writers.append((number, entry.path))
        elif (reader := reader_of(queue, entry.name)) is not None:
            files.readers[reader] = entry.path
    files.writers.sort()
    return files


# ---------------------------------------------------------------------------------------------
# Reading


class RecordReader(journal_file.BufferedFile):
    """Reads the records of one Kestrel 3 file forward, checking its header first.

    Every length is checked against what the file still holds before the record is read, so a
    damaged count costs an error, never an allocation. Iteration stops at the first record that
    runs past the end of the file, or where nothing but zeros follows; `torn` then says why, `offset`
    is where that record starts, and `tail_damage` judges it (src/kestrel/storage/torn_tail.py). A
    record that can never be valid raises CorruptJournalError naming file and offset. The file is
    read up to the size it had when opened.

    A PUT larger than the buffer has its header checked, then its item read on its own in one read
    of the size the header gives, as the item's bytes themselves (no chunks joined, no copy out);
    from `LARGE_APPEND` bytes off the loop through `gate`, the writer journal's
    (`BufferedFile.read_at`), as is a fill of the buffer the page cache cannot answer (`fill_at`).
    """

    def __init__(self, path: str, expect: k3.FileKind | None = None, gate: WriteGate | None = None,
                 offset: int = k3.MAGIC_SIZE) -> None:
        super().__init__(path, offset, gate)
        self.size = os.fstat(self.fd).st_size
        self.torn: str | None = None
        try:
            self.kind = self._read_header(expect)
        except BaseException:
            self.close()
            raise

    def _read_header(self, expect: k3.FileKind | None) -> k3.FileKind:
        header = self.fill_at(k3.MAGIC_SIZE, 0)
        kind = k3.kind_of(header)
        if kind is None:
            got = header.hex(" ") if header else "nothing"
            raise CorruptJournalError(self.path, 0, None, f"header {got} is neither a Kestrel 3 writer "
                                      f"journal ({k3.WRITER_MAGIC.hex(' ')}) nor a reader checkpoint "
                                      f"({k3.READER_MAGIC.hex(' ')})")
        if expect is not None and kind is not expect:
            raise CorruptJournalError(self.path, 0, None, f"a {kind.title} where a {expect.title} belongs")
        return kind

    def grow(self) -> None:
        """See what was appended since the file was opened (a reader following the newest file)."""
        self.size = os.fstat(self.fd).st_size

    def _have(self, want: int) -> bool:
        """Make `want` bytes from the current position available in the buffer, if the file has them."""
        if self._pos + want <= len(self._buf):
            return True
        if self.offset + want > self.size:
            return False
        rest = self._buf[self._pos:]
        self._buf_start += self._pos
        self._pos = 0
        need = min(max(self.chunk, want), self.size - self._buf_start) - len(rest)
        self._buf = rest + self.fill_at(need, self._buf_start + len(rest))
        return len(self._buf) >= want

    def next(self, from_id: int = 0) -> tuple[int, k3.Record] | None:
        """The next record and its offset, or None at the end of the file or at a torn record. A
        PUT larger than the buffer with an id below `from_id` (where a read-behind cursor starts)
        is passed over, its item not read."""
        while self.offset < self.size:
            try:
                if not self._have(min(5, self.size - self.offset)):
                    self.torn = f"{self.size - self.offset} bytes could not be read (the file shrank)"
                    return None
                try:
                    length = k3.record_length(self._buf, self._pos, self.kind)
                except Incomplete:
                    self.torn = f"{self.size - self.offset} bytes, too short for a record header"
                    return None
                if length > self.chunk and self.offset + length <= self.size \
                        and (start := k3.item_start(self._buf, self._pos)) is not None:
                    if not self._have(start):
                        self.torn = f"{self.size - self.offset} bytes could not be read (the file shrank)"
                        return None
                    fields = k3.put_fields(self._buf, self._pos)
                    if fields[0] >= from_id:
                        return self._read_item(start, length, fields)
                    self._buf, self._buf_start, self._pos = b"", self.offset + length, 0
                    continue
                if not self._have(length):
                    left = self.size - self.offset
                    self.torn = f"record of {length} bytes runs past the end of the file ({left} bytes left)"
                    return None
                record, stop = k3.decode_measured(self._buf, self._pos, self._pos + length)
            except Malformed as e:
                if self._zeros_to_end():
                    self.torn = f"{self.size - self.offset} bytes of zeros"
                    return None
                raise CorruptJournalError(self.path, self.offset, e.opcode, e.reason) from None
            at = self.offset
            self._pos = stop
            return at, record
        return None

    def puts(self) -> list[k3.PutRow]:
        """The next run of a writer journal's PUTs as rows, read together from the buffer
        (`k3.decode_puts`); one record at a time through `next` where a run cannot go on (the
        buffer's end, a large item, damage). Empty at the end of the file or at a torn record
        (`torn`); raises as `next` does."""
        run, stop = k3.decode_puts(self._buf, self._pos)
        if run:
            self._pos = stop
            return run
        entry = self.next()
        if entry is None:
            return []
        record = entry[1]
        if not isinstance(record, k3.Put):  # next() refuses it in a writer journal
            raise TypeError(f"{self.path} is not a writer journal")
        return [(record.id, record.error_count, record.add_time, record.expire_time, record.data)]

    def _read_item(self, start: int, length: int, fields: k3.PutFields) -> tuple[int, k3.Record] | None:
        """The PUT of `length` bytes here, which the file holds, with the `fields` of its header and
        its item read on its own from `start`; None if the file turns out shorter. The reader's
        place is taken from before the read, which may have let the loop run."""
        at = self.offset
        data = self.read_at(length - start, at + start)
        if len(data) < length - start:
            self.torn = f"{self.size - at} bytes could not be read (the file shrank)"
            return None
        self._buf, self._buf_start, self._pos = b"", at + length, 0
        item_id, errors, add_time, expire_time = fields
        return at, k3.Put(item_id, errors, add_time, expire_time, data)

    def __iter__(self) -> Iterator[tuple[int, k3.Record]]:
        while (entry := self.next()) is not None:
            yield entry

    def _zeros_to_end(self) -> bool:
        """Whether nothing but zeros follows the current position, up to the size read."""
        at = self.offset
        while at < self.size:
            chunk = os.pread(self.fd, min(self.chunk, self.size - at), at)
            if not chunk or chunk.strip(b"\0"):
                return False
            at += len(chunk)
        return True

    def tail_damage(self) -> CorruptJournalError | None:
        """What stopped the reader (`torn`): None for a torn write, else the damage.

        Every Kestrel 3 file's end is judged as a log's last file's: a reader checkpoint is a log of
        one file, and a writer file may end in a torn write although a later one exists, since a
        rotation starts the next file on the loop while the previous one's seal (its fsync) runs
        in the background, and any fsync of the folder can make the new name durable first. Cutting
        such a write loses nothing acknowledged and breaks nothing after it: a writer file holds
        puts alone, each independent of the others (what a reader consumed is in its checkpoint);
        an acknowledged put's record is durable (its file's fsync, or the commit log's, whose
        records recovery writes back before this is read); and a sealed file, fsynced whole, is
        vouched for by the manifest's checksum, which refuses one cut short."""
        byte = self._buf[self._pos] if self._pos < len(self._buf) else None
        return torn_tail.judge(self.path, self.offset, f"incomplete record: {self.torn}",
                               k3.TailRecords(self.kind), last=True, opcode=byte)

    def cut_torn_tail(self, stamp: int) -> str:
        """Cut the torn tail off the file, keeping a copy (`.kestrel/aside/`); the copy's path."""
        queue_path = os.path.dirname(self.path)
        copy = layout.aside_path(queue_path, os.path.basename(self.path), "torn", stamp)
        journal_file.cut_keeping_copy(self.path, self.offset, copy)
        return copy


def read_records(path: str, expect: k3.FileKind | None = None,
                 torn_tail: Callable[[str, int], None] | None = None) -> Iterator[tuple[int, k3.Record]]:
    """Every record of one file with its offset. What stops the reader is judged by the torn-tail
    rule (`RecordReader.tail_damage`): a torn write ends the records (the next start cuts it off),
    `torn_tail` hearing where it starts; anything else raises CorruptJournalError."""
    reader = RecordReader(path, expect)
    try:
        yield from reader
        if reader.torn:
            damage = reader.tail_damage()
            if damage is not None:
                raise damage
            if torn_tail is not None:
                torn_tail(path, reader.offset)
    finally:
        reader.close()


# ---------------------------------------------------------------------------------------------
# Reader checkpoints


@dataclass(frozen=True)
class ReaderCheckpoint:
    """One reader's progress: every id at or below `head` is consumed, and so is every id in `done`."""

    head: int = 0
    done: frozenset[int] = frozenset()
    torn_at: int | None = None  # read without repair: where a torn final record begins, left in place

    def is_done(self, item_id: int) -> bool:
        return item_id <= self.head or item_id in self.done

    def normalized(self) -> ReaderCheckpoint:
        """The same progress with the head moved over done ids that follow it, and only ids above it kept."""
        head = self.head
        while head + 1 in self.done:
            head += 1
        return ReaderCheckpoint(head, frozenset(i for i in self.done if i > head))


def read_checkpoint(path: str | None, high_id: int | None = None, repair: bool = True) -> ReaderCheckpoint:
    """A reader's checkpoint file (a missing file, or none named, is a reader that consumed nothing).

    The last READ_HEAD wins and READ_DONE records add up, as they are appended one by one. A torn
    final record (an append the process did not finish, so never acknowledged) is cut off, a copy
    kept. With
    `high_id` (the highest id ever written), an id above it is damage: nothing can consume an item
    not yet written, and taking it would silently empty the reader. Without `repair` a torn record
    is left where it is (read-only readers). Raises CorruptJournalError.
    """
    if path is None or not os.path.exists(path):
        return ReaderCheckpoint()
    head, done = 0, set[int]()
    reader = RecordReader(path, k3.FileKind.READER)
    try:
        for offset, record in reader:
            ids = (record.id,) if isinstance(record, k3.ReadHead) else (
                record.ids if isinstance(record, k3.ReadDone) else ())
            if high_id is not None and ids and max(ids) > high_id:
                raise CorruptJournalError(path, offset, None, f"consumed id {max(ids)} is above {high_id}, "
                                          "the highest id ever written: the checkpoint is damaged")
            if isinstance(record, k3.ReadHead):
                head = max(head, record.id)
            elif isinstance(record, k3.ReadDone):
                done.update(record.ids)
        if reader.torn:
            damage = reader.tail_damage()
            if damage is not None:
                raise damage
            if not repair:
                return replace(ReaderCheckpoint(head, frozenset(done)).normalized(),
                               torn_at=reader.offset)
            copy = reader.cut_torn_tail(SYSTEM_CLOCK.now_ms())
            log.warning("torn record at the end of a reader checkpoint; cut off, a copy kept", file=path,
                        offset=reader.offset, reason=reader.torn, copy=copy)
    finally:
        reader.close()
    return ReaderCheckpoint(head, frozenset(done)).normalized()


def checkpoint_lacks(path: str, logged: list[bytes], repair: bool = True) -> bytes:
    """What reader checkpoint `path` must have appended to hold every id consumed by `logged`,
    READ_DONE and READ_HEAD records as the commit log keeps them (src/kestrel/storage/commit_log.py):
    nothing when it holds them all. What a reader consumed stays consumed, so this holds whatever
    version of the file is there (it may have been rewritten whole since). A torn tail is cut off
    first, a copy kept, unless not `repair`. Raises CorruptJournalError (damage), OSError."""
    state = read_checkpoint(path, repair=repair)
    head, done = state.head, set(state.done)
    for chunk in logged:
        at = 0
        while at < len(chunk):
            record, at = k3.decode(chunk, at, k3.FileKind.READER)
            if isinstance(record, k3.ReadHead):
                head = max(head, record.id)
            elif isinstance(record, k3.ReadDone):
                done.update(record.ids)
    wanted = ReaderCheckpoint(head, frozenset(done)).normalized()
    if wanted == state:
        return b""
    extra = tuple(sorted(wanted.done - state.done))
    return ((k3.encode(k3.ReadDone(extra)) if extra else b"")
            + (k3.encode(k3.ReadHead(wanted.head)) if wanted.head != state.head else b""))


def encode_checkpoint(checkpoint: ReaderCheckpoint) -> bytes:
    """A whole checkpoint file: the header, the (normalized) head, then the ids done above it."""
    state = checkpoint.normalized()
    return (k3.READER_MAGIC + k3.encode(k3.ReadHead(state.head))
            + k3.encode(k3.ReadDone(tuple(sorted(state.done)))))


def checkpoint_entry(checkpoint: ReaderCheckpoint) -> Entry:
    """The manifest entry of a checkpoint file as `write_checkpoint` writes it: its whole bytes,
    which later appends extend."""
    data = encode_checkpoint(checkpoint)
    return Entry(len(data), crc32c(data))


def write_checkpoint(queue_path: str, queue: str, reader: str, checkpoint: ReaderCheckpoint,
                     sync: bool = True) -> str:
    """Replace the reader's checkpoint file in one step (temporary file, then rename); return its path.

    With `sync`, the new file and its name are on disk before this returns.
    """
    final = os.path.join(queue_path, reader_file_name(queue, reader))
    temporary = os.path.join(queue_path, checkpoint_temporary_name(queue, reader))
    disk.replace_file(final, encode_checkpoint(checkpoint), temporary, sync)
    return final


# ---------------------------------------------------------------------------------------------
# The writer journal


@dataclass
class WriterFile:
    """One segment of the writer journal and the ids it holds (0, 0 when it holds none)."""

    number: int
    path: str
    first_id: int = 0
    last_id: int = 0


def scan_writer_file(number: int, path: str, after_id: int, stamp: int = 0) -> WriterFile:
    """The id range of one writer file, checking that ids keep increasing past `after_id`.

    A torn final record is cut off, a copy kept (stamped `stamp`), where the torn-tail rule says it
    is one (`RecordReader.tail_damage`: in any writer file); anything else raises CorruptJournalError.
    """
    info = WriterFile(number, path)
    reader = RecordReader(path, k3.FileKind.WRITER)
    try:
        start = reader.offset
        while run := reader.puts():
            for at, row in enumerate(run):
                if row[0] <= after_id:
                    _check_order(path, start + sum(map(k3.row_length, run[:at])), row[0], after_id)
                after_id = row[0]
            info.first_id = info.first_id or run[0][0]
            info.last_id = after_id
            start = reader.offset
        if reader.torn:
            damage = reader.tail_damage()
            if damage is not None:
                raise damage
            copy = reader.cut_torn_tail(stamp or SYSTEM_CLOCK.now_ms())
            log.warning("torn record at the end of the writer journal; cut off, a copy kept", file=path,
                        offset=reader.offset, reason=reader.torn, copy=copy)
    finally:
        reader.close()
    return info


def header_unwritten(path: str) -> bool:
    """Whether the writer file at `path` was created but its header never reached the disk
    (`k3.unfinished_header`): it holds no item, and start-up writes the header.

    The newest file, when a process stopped between its creation and its header's write; any file
    the manifest does not list sealed (one listed is refused as cut short before this is asked),
    when a power cut kept a name its folder's fsync made durable for another file (a rotated file's
    seal, another queue's file) but none of the file's bytes: each item is acknowledged only once
    an fsync of its file (its header with it) or of the commit log holds it, so none was."""
    if os.path.getsize(path) >= k3.MAGIC_SIZE:  # every file but such a one: a stat, not a read
        return False
    with disk.open_to_read(path) as f:
        return k3.unfinished_header(f.read(k3.MAGIC_SIZE))


def ids_held(files: Iterable[WriterFile], low: int, high: int) -> list[int]:
    """The ids above `low` and up to `high` that the writer `files` hold, read from them: where ids
    skip (a writer started again past ids its readers had recorded, or an id damaged high), the
    range between two ids is no list of the items. Raises CorruptJournalError, OSError."""
    ids: list[int] = []
    for info in files:
        if not info.first_id or info.last_id <= low or info.first_id > high:
            continue
        reader = RecordReader(info.path, k3.FileKind.WRITER)
        try:
            while run := reader.puts():
                ids.extend(row[0] for row in run if low < row[0] <= high)
        finally:
            reader.close()
    return ids


def _check_order(path: str, offset: int, item_id: int, after_id: int) -> None:
    if item_id <= after_id:
        raise CorruptJournalError(path, offset, k3.command_byte(k3.PUT, 6),
                                  f"item id {item_id} does not follow id {after_id}: ids must increase")


class WriterJournal:
    """Appends PUT records to `<queue>.<number>`, starting a new file once one passes `max_file_size`.

    Opening scans every writer file for its id range (ids must increase from file to file) and cuts a
    torn record off the newest one; a file in `verified` (by name: the ids of a sealed file whose
    bytes the manifest's checksum found as they were sealed) is not read again for them.
    `sync_ms` is the sync policy of `files.JournalWriter`.
    New ids follow the newest file's, and `after_id` too: the files of consumed ids are deleted, so
    the readers' checkpoints may be all that remembers how far ids went. `writers`: the writer files,
    when the caller knows them (a new queue has none), instead of listing the queue path.
    `file_log`: where each file, by its number, logs its appends too (a new file's header with them).
    """

    def __init__(self, queue_path: str, queue: str, max_file_size: int, sync_ms: int | None = None,
                 clock: Clock = SYSTEM_CLOCK, after_id: int = 0, runtime: Runtime = DEFAULT_RUNTIME,
                 writers: list[tuple[int, str]] | None = None,
                 file_log: Callable[[int], AppendLog] | None = None, gate: WriteGate | None = None,
                 verified: Mapping[str, tuple[int, int]] | None = None) -> None:
        check_name_part("queue", queue)
        self.queue_path = queue_path
        self.queue = queue
        self.max_file_size = max_file_size
        self.sync_ms = sync_ms
        self.clock = clock
        self.runtime = runtime
        # Where each file's appends are logged too, by its number (src/kestrel/storage/commit_log.py)
        self.file_log = file_log
        self.gate = gate  # where each file's large appends are written off the loop (write_gate.py)
        self.files: list[WriterFile] = []
        # The writers of files started whose names may not be durable yet (`listable`)
        self._unnamed: list[JournalWriter] = []
        self._sealer = journal_file.Sealer(runtime)  # rotated files, until they are in the manifest
        # Told of each sealed file, its path and ids (the manifest's keeper); the writer's list is not
        # read there, as the queue changes it meanwhile.
        self.sealed: Callable[[str, int, int], None] | None = None
        found = list_queue_files(queue_path, queue).writers if writers is None else writers
        for _, path in found:
            if header_unwritten(path):
                self._rewrite_header(path)
        last_id = 0
        for i, (number, path) in enumerate(found):
            ids = verified.get(os.path.basename(path)) if verified and i < len(found) - 1 else None
            if ids is not None and last_id < ids[0] <= ids[1]:  # else read: no ids listed, or out of order
                info = WriterFile(number, path, *ids)
            else:
                info = scan_writer_file(number, path, last_id, clock.now_ms())
            last_id = info.last_id or last_id
            self.files.append(info)
        self.tail_id = max(last_id, after_id)
        self.archived_size = sum(os.path.getsize(f.path) for f in self.files[:-1])
        self._writer: JournalWriter | None = None
        if self.files:
            self._writer = self._file_writer(self.files[-1])
        else:
            self._start_first()

    def _start_first(self) -> None:
        """A new queue's first file, its name made durable off the loop (the creation waits). (A
        method of its own: read where `__init__` set it to None, `_writer` would be taken for None
        by the compiled build after `rotate` set it.)"""
        self.rotate()
        writer = self._writer
        assert writer is not None
        try:
            writer.sync_name()
            self.commit()
        except BaseException:
            writer.close(sync=False)  # its descriptor: no journal holds it (the file stays)
            raise

    @staticmethod
    def _rewrite_header(path: str) -> None:
        """A file was created but its header not (fully) written when the process stopped, or not
        fsynced when the power went (`header_unwritten`): written now, durably, as this start may
        list it sealed in the manifest."""
        log.warning("writer journal file without its header; writing it", file=path)
        with open(path, "wb") as f:
            f.write(k3.WRITER_MAGIC)
        disk.fsync_path(path)

    @property
    def current(self) -> WriterFile:
        return self.files[-1]

    @property
    def size(self) -> int:
        """Bytes in the current file."""
        assert self._writer is not None
        return self._writer.size

    @property
    def total_size(self) -> int:
        """Bytes in every writer file."""
        return self.archived_size + self.size

    def put(self, data: bytes, add_time: int, expire_time: int | None = None, error_count: int = 0) -> k3.Put:
        """Append one item under the next id and wait as the sync policy requires; return its record."""
        (record,) = self.append([data], add_time, expire_time, error_count)
        self.commit()
        return record

    def append(self, items: list[bytes], add_time: int, expire_time: int | None = None,
               error_count: int = 0) -> list[k3.Put]:
        """Append items under the next ids with one write, without waiting for the sync policy
        (`commit` does). Never yields: the ids are taken (the tail moved past them) before anything
        else, and nothing until they are written can let another put run (a rotation's log line
        waits: `src/kestrel/storage/deferred_log.py`; a large append is written off the loop while
        every reader's changes wait at the journal's gate: `JournalWriter.append`). Raises OSError
        (nothing was appended, no id taken)."""
        if not items:
            return []
        first = self.tail_id + 1
        self.tail_id = last = first + len(items) - 1
        try:
            records = [k3.Put(first + i, error_count, add_time, expire_time, data)
                       for i, data in enumerate(items)]
            encoded = b"".join(map(k3.encode, records))
            if self.current.last_id and self.size + len(encoded) > self.max_file_size:
                self.rotate()
            assert self._writer is not None
            self._writer.append(encoded)
        except BaseException:
            self.tail_id = first - 1  # nothing ran meanwhile: the ids are free again
            raise
        self.current.first_id = self.current.first_id or first
        self.current.last_id = last
        return records

    def commit(self) -> None:
        """Wait as the sync policy requires for everything appended so far."""
        if self._writer is not None:
            self._writer.commit()

    def falls_back(self) -> bool:
        """Whether a commit now falls back on the current file's own fsync
        (`JournalWriter.falls_back`)."""
        return self._writer is not None and self._writer.falls_back()

    def rotate(self) -> WriterFile:
        """Start the next file (an empty file holds just the header) without yielding to other
        greenlets; the previous one is fsynced and closed in the background, the header reaches the
        disk with the next commit, and the log line is written after. Its name is made durable off
        the loop by its first fsync (`JournalWriter.sync_name`, from `sync_to`: the commit that
        acknowledges a put under `always`, the commit log's checkpoint that drops its records, its
        close), not by an fsync of the folder on the loop: the commit log names a writer file by its
        number and makes one whose creation a power cut lost again from its logged header, and no
        manifest lists it before (`listable`). A new queue's first file has its name made durable by
        its creation (`_start_first`), which waits."""
        number = self.clock.now_ms()
        if self.files:
            number = max(number, self.current.number + 1)
        while os.path.exists(path := os.path.join(self.queue_path, writer_file_name(self.queue, number))):
            number += 1
        old = self._writer
        info = WriterFile(number, path)
        writer = self._file_writer(info)
        writer.names_later = True
        try:
            writer.open()
            writer.append(k3.WRITER_MAGIC)
        except BaseException:
            # (a full disk): the file it created holds nothing, and would be a stray at the next start
            writer.close(sync=False)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise
        # (before the file is in `files`: `listable` may be asked from the thread pool meanwhile)
        self._unnamed = [w for w in self._unnamed if w.unnamed] + ([writer] if writer.unnamed else [])
        self.files.append(info)
        self._writer = writer
        if old is not None:
            self.archived_size += old.size
            self._sealer.add(old, partial(self._seal, self.files[-2]))
        log_later(self.runtime, log.info, "started writer journal file", queue=self.queue, file=path)
        return self.current

    def listable(self) -> list[WriterFile]:
        """The files a manifest may list: those before the first whose name may not be durable yet.
        A manifest listing one could outlive it after a power cut, and the queue would be refused
        for a listed file missing; unlisted, it is newer than every listed file, which loads. (Asked
        from the thread pool too: the writers are read after the file list, which `rotate` extends
        after them.)"""
        files = list(self.files)
        unnamed = {w.path for w in self._unnamed if w.unnamed}
        if unnamed:
            files = list(takewhile(lambda f: f.path not in unnamed, files))
        return files

    def _file_writer(self, info: WriterFile) -> JournalWriter:
        writer = JournalWriter(info.path, self.sync_ms, self.runtime)
        writer.gate = self.gate
        if self.file_log is not None:
            writer.log = self.file_log(info.number)
        return writer

    def _seal(self, info: WriterFile) -> None:
        """A previous file is fsynced and closed: `sealed` lists it (in a thread)."""
        if self.sealed is not None:
            with contextlib.suppress(FileNotFoundError):  # every reader passed it: deleted meanwhile
                self.sealed(info.path, info.first_id, info.last_id)

    def take_consumed_files(self, heads: Iterable[int], logged: Callable[[str], bool] | None = None
                            ) -> list[WriterFile]:
        """Take out of the journal the files every reader has passed (all their ids at or below every
        head in `heads`), for `delete_writer_files` to delete. Deletes nothing and never yields.

        The current file is never taken, nor anything when `heads` is empty, nor a file `logged` says
        a commit log's records still name (nor any after it). Heads only move forward and only the
        current file is appended to, so a file taken stays deletable.
        """
        lowest = min(heads, default=0)
        going = list(takewhile(lambda f: f.last_id <= lowest and not (logged and logged(f.path)),
                               self.files[:-1]))
        if going:
            del self.files[:len(going)]
            self.archived_size -= sum(os.path.getsize(f.path) for f in going)
        return going

    def reconfigure(self, max_file_size: int, sync_ms: int | None) -> None:
        """New settings from a reload: the next rotation and the next commit follow them."""
        self.max_file_size = max_file_size
        self.sync_ms = sync_ms
        if self._writer is not None:
            self._writer.set_sync(sync_ms)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def wait_for_sealing(self) -> None:
        """Return once every rotated file is fsynced, closed and told to `sealed`."""
        self._sealer.wait()

    def close(self, sync: bool = True) -> None:
        """Close the current file, fsynced unless not to `sync` (a creation that failed: its files hold
        no item)."""
        self._sealer.wait()
        if self._writer is not None:
            self._writer.close(sync)
            self._writer = None


def delete_writer_files(queue_path: str, going: list[WriterFile]) -> None:
    """Delete the writer files taken by `take_consumed_files`, durably (`disk.remove_files`):
    blocking, it runs off the loop. Raises OSError."""
    disk.remove_files(queue_path, [info.path for info in going])


# ---------------------------------------------------------------------------------------------
# Replay


def replay(queue_path: str, queue: str, reader: str = "") -> Iterator[k3.Put]:
    """The items a reader has still to consume, oldest first: those after its head, minus its done set.

    Reads one chunk at a time, so memory stays small however long the journal. Meant for a queue
    whose WriterJournal is open (which cuts a torn final record); any damage raises
    CorruptJournalError naming file and offset.
    """
    checkpoint = read_checkpoint(os.path.join(queue_path, reader_file_name(queue, reader)))
    return pending_items(queue_path, queue, checkpoint)


def pending_items(queue_path: str, queue: str, checkpoint: ReaderCheckpoint,
                  torn_tail: Callable[[str, int], None] | None = None) -> Iterator[k3.Put]:
    """The queue's items that `checkpoint` has not consumed, oldest first, streamed from its writer files.

    A torn write at the end of a file ends its records, as a start cuts it off (`read_records`:
    `torn_tail` hears of it), and a file whose header never reached the disk holds none, as a start
    writes that header (`header_unwritten`). Raises CorruptJournalError as `replay` does.
    """
    last_id = 0
    for _number, path in list_queue_files(queue_path, queue).writers:
        if header_unwritten(path):
            continue
        for offset, record in read_records(path, k3.FileKind.WRITER, torn_tail):
            assert isinstance(record, k3.Put)
            _check_order(path, offset, record.id, last_id)
            last_id = record.id
            if not checkpoint.is_done(record.id):
                yield record
