"""Kestrel3Queue: a queue kept in Kestrel 3's journal, one copy of the data for many readers.

The queue's items are written once, as PUT records, to its writer journal `<queue>.<number>`; each
reader (the queue itself is the reader with the empty name, its fanout child `queue+name` the reader
`name`) keeps only its progress in `<queue>.read.<reader>`: a head id below which every item is
consumed, and the ids consumed out of order above it. An item is consumed when it leaves its reader
for good (removed, confirmed, expired, discarded, flushed, poisoned, or refused because the reader
was full); an open read is not, so after a restart it is served again in id order. Writer files are
deleted once every reader's head has passed them.

Each reader holds at most `max_memory_size` bytes of items in memory; the rest are counted and read
back from the writer files as the head drains (read-behind). The public interface is
PersistentQueue's, so the collection and every protocol use either class alike.
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import replace

import structlog

from kestrel.storage import formats
from kestrel.storage.clock import SYSTEM_CLOCK, Clock
from kestrel.storage.config import QueueConfig
from kestrel.storage.errors import ItemTooLarge, JournalWriteError
from kestrel.storage.filenames import reader_file_name
from kestrel.storage.files import JournalWriter, list_journal_files
from kestrel.storage.formats import KESTREL3
from kestrel.storage.item import QItem
from kestrel.storage.kestrel3 import codec as k3
from kestrel.storage.kestrel3.files import (
    ReaderCheckpoint,
    RecordReader,
    WriterJournal,
    list_queue_files,
    read_checkpoint,
    write_checkpoint,
)
from kestrel.storage.queue import QueueBase
from kestrel.storage.runtime import DEFAULT_RUNTIME, GeventRuntime, Runtime

log = structlog.get_logger("kestrel.kestrel3")

COMPACT_AT = 64 * 1024  # a checkpoint file this large is rewritten, if that makes it much smaller

Entry = tuple[int, QItem]  # an item and its id


def _expiry(record: k3.Put, config: QueueConfig) -> int:
    """The item's expiry for one reader: the PUT's, capped by the reader's `max_age` (0 = never)."""
    expiry = record.expire_time or 0
    if config.max_age:
        cap = record.add_time + config.max_age
        expiry = min(expiry, cap) if expiry else cap
    return expiry


def _reader_of(name: str) -> tuple[str, str]:
    """(writer queue, reader) of a queue name: `q` is q's default reader, `q+a` its reader `a`."""
    parent, _, child = name.partition("+")
    return parent, child


class Kestrel3Journals:
    """The writer journals of one queue path's Kestrel 3 queues, shared by each queue's readers."""

    def __init__(self, queue_path: str, runtime: Runtime = DEFAULT_RUNTIME) -> None:
        self.queue_path = queue_path
        self.runtime = runtime
        self._journals: dict[str, Kestrel3Journal] = {}

    def journal(self, name: str, config: QueueConfig) -> Kestrel3Journal:
        """The writer journal of queue `name`, opened on first use. Raises CorruptJournalError."""
        journal = self._journals.get(name)
        if journal is None or journal.closed:
            journal = Kestrel3Journal(self, name, config)
            self._journals[name] = journal
        return journal

    def forget(self, journal: Kestrel3Journal) -> None:
        if self._journals.get(journal.name) is journal:
            del self._journals[journal.name]


class Kestrel3Journal:
    """One queue's writer journal and the readers attached to it."""

    def __init__(self, owner: Kestrel3Journals, name: str, config: QueueConfig) -> None:
        self.owner = owner
        self.name = name
        self.queue_path = owner.queue_path
        found = list_journal_files(self.queue_path, name)
        if found.live or found.rotated or found.packs:  # a queue created after start-up, too
            formats.check_format(self.queue_path, name, found, KESTREL3)
        on_disk = list_queue_files(self.queue_path, name)
        self.readers_on_disk = sorted(on_disk.readers)
        # Heads of readers found on disk and not attached yet: their files must stay until they are.
        self._unattached: dict[str, int] = {}
        floor = 0
        for reader, path in on_disk.readers.items():
            progress = read_checkpoint(path)
            self._unattached[reader] = progress.head
            floor = max(floor, progress.head, max(progress.done, default=0))
        self.writer = WriterJournal(self.queue_path, name, config.default_journal_size,
                                    config.sync_journal, owner.runtime.clock, after_id=floor,
                                    runtime=owner.runtime)
        self.readers: dict[str, Kestrel3Queue] = {}
        self.closed = False

    def attach(self, queue: Kestrel3Queue) -> None:
        self.readers[queue.reader] = queue
        self._unattached.pop(queue.reader, None)

    @property
    def unread(self) -> bool:
        """No reader is attached, nor found on disk waiting to be."""
        return not self.readers and not self._unattached

    def detach(self, queue: Kestrel3Queue) -> None:
        """The reader is closed or deleted; the journal closes with its last reader."""
        if self.readers.get(queue.reader) is queue:
            del self.readers[queue.reader]
        if not self.readers and not self.closed:
            self.closed = True
            self.writer.close()
            self.owner.forget(self)

    def destroy(self) -> None:
        """Delete every writer file (no reader is left)."""
        self.closed = True
        self.writer.close()
        self.owner.forget(self)
        for _, path in list_queue_files(self.queue_path, self.name).writers:
            os.unlink(path)

    def put(self, items: list[bytes], expiry: int, add_time: int,
            targets: list[Kestrel3Queue]) -> dict[str, int]:
        """Write the items that some target accepts, once, and hand them to every reader.

        Each target takes the items it has room for (the others it consumes at once); a reader
        that is not a target consumes them all. Returns how many each target (by reader name)
        took. Raises JournalWriteError (nothing was written).
        """
        taken = {q.reader: q.admit(items, add_time) for q in targets}
        count = max(taken.values(), default=0)
        if not count:
            for reader in targets:
                reader.commit()
            return taken
        try:
            records = self.writer.append(items[:count], add_time, expiry or None)
        except OSError as e:
            raise JournalWriteError(self.name, self.writer.current.path, e) from None
        readers = list(self.readers.values())
        for reader in readers:
            reader.receive(records, taken.get(reader.reader, 0))
        self.writer.commit()
        for reader in readers:
            reader.commit()
        return taken

    def release(self) -> None:
        """Delete the writer files every reader has passed."""
        if len(self.writer.files) > 1 and not self.closed:
            heads = [*(q.head for q in self.readers.values()), *self._unattached.values()]
            removed = self.writer.remove_consumed_files(heads)
            for path in removed:
                log.info("deleted writer journal file every reader has passed", queue=self.name, file=path)


class _ReaderFile:
    """One reader's checkpoint file: appended to as items are consumed, rewritten when it grows."""

    def __init__(self, queue_path: str, queue: str, reader: str, sync_ms: int | None, start: int,
                 runtime: Runtime) -> None:
        self.queue_path = queue_path
        self.runtime = runtime
        self.queue = queue
        self.reader = reader
        self.path = os.path.join(queue_path, reader_file_name(queue, reader))
        if os.path.exists(self.path):
            progress = read_checkpoint(self.path)
        else:  # a new reader: the items already written are not its own
            progress = ReaderCheckpoint(start)
            write_checkpoint(queue_path, queue, reader, progress, sync=sync_ms is not None)
        self.head = progress.head
        self.done = set(progress.done)
        self.writer = JournalWriter(self.path, sync_ms, runtime)

    def consumed(self, item_id: int) -> bool:
        return item_id <= self.head or item_id in self.done

    def save(self, ids: Iterable[int]) -> bool:
        """Record `ids` as consumed (appended, without waiting for the sync policy); whether the
        head moved. Raises OSError, and then nothing is recorded."""
        ids = [i for i in ids if not self.consumed(i)]
        if not ids:
            return False
        head, fresh = self.head, set(ids)
        while head + 1 in self.done or head + 1 in fresh:
            head += 1
        above = tuple(sorted(i for i in fresh if i > head))
        data = (k3.encode(k3.ReadDone(above)) if above else b"") + (
            k3.encode(k3.ReadHead(head)) if head != self.head else b"")
        self.writer.append(data)
        moved = head != self.head
        self.done.update(above)
        for passed in range(self.head + 1, head + 1):
            self.done.discard(passed)
        self.head = head
        return moved

    def replace(self, head: int, done: set[int]) -> None:
        """Write the whole checkpoint anew (a flush, or a file grown large), without yielding to
        other greenlets: the old file's descriptor is closed in the background. Raises OSError."""
        old = self.writer
        write_checkpoint(self.queue_path, self.queue, self.reader, ReaderCheckpoint(head, frozenset(done)),
                         sync=old.sync_ms is not None)
        self.head, self.done = head, set(done)
        self.writer = JournalWriter(self.path, old.sync_ms, self.runtime)
        self.runtime.spawn(old.close)

    def commit(self) -> None:
        """Rewrite the file if it grew much larger than its state, then wait as the sync policy requires."""
        if self.writer.size > COMPACT_AT and self.writer.size > 4 * (24 + 8 * len(self.done)):
            self.replace(self.head, self.done)
        self.writer.commit()

    def close(self) -> None:
        self.writer.close()


class Kestrel3Queue(QueueBase):
    """One reader of a Kestrel 3 writer journal, with PersistentQueue's interface.

    Parameters: `name` (`q`, or `q+reader` for a fanout child), `queue_path`, `config`, `clock`,
    `expire_to` (looks up the queue expired items move to), `journals` (the queue path's writer
    journals, shared by the readers of each). A fanout-only parent keeps no reader of its own.
    """

    def __init__(self, name: str, queue_path: str, config: QueueConfig, clock: Clock | None = None,
                 expire_to: Callable[[str], QueueBase | None] | None = None,
                 journals: Kestrel3Journals | None = None) -> None:
        self._journals = journals or Kestrel3Journals(queue_path, GeventRuntime(clock or SYSTEM_CLOCK))
        runtime = self._journals.runtime
        super().__init__(name, queue_path, config, clock or runtime.clock, runtime, expire_to)
        self.parent, self.reader = _reader_of(name)
        self.is_reader = not (config.fanout_only and not self.reader)
        self._journal: Kestrel3Journal | None = None
        self._file: _ReaderFile | None = None
        self._mem: deque[Entry] = deque()
        self._behind: int | None = None  # while in read-behind: the lowest id not yet loaded
        self._seen = 0  # the newest id handed to this reader: read-behind loads nothing newer
        self._cursor: RecordReader | None = None
        self._cursor_file = 0  # number of the writer file the cursor reads
        self._unsaved: set[int] = set()  # consumed, not yet in the checkpoint file (a write failed)

    # -----------------------------------------------------------------------------------------
    # Figures

    @property
    def in_read_behind(self) -> bool:
        return self._behind is not None

    @property
    def head(self) -> int:
        """Every id at or below this one is consumed by this reader."""
        return self._file.head if self._file is not None else 2**64 - 1

    @property
    def journal_size(self) -> int:
        """Bytes of the writer journal this reader reads, and of its checkpoint."""
        if self._journal is None:
            return 0
        return self._journal.writer.total_size + (self._file.writer.size if self._file else 0)

    @property
    def journal_files(self) -> list[str]:
        own = [self._file.path] if self._file else []
        return own + ([f.path for f in self._journal.writer.files] if self._journal else [])

    def reader_names_on_disk(self) -> list[str]:
        """The fanout readers whose checkpoints were found when the writer journal was opened."""
        return [r for r in (self._journal.readers_on_disk if self._journal else []) if r]

    # -----------------------------------------------------------------------------------------
    # Start-up

    def setup(self, reopen: bool = True, files: object = None) -> None:
        """Open the writer journal and this reader's checkpoint, and load the items it has still to
        consume, oldest first (those beyond `max_memory_size` are only counted).

        `reopen` and `files` are PersistentQueue's: reads open at a stop are served again in any
        case (they were never consumed), and the files are listed here. Raises CorruptJournalError,
        ConfigError (the queue has Kestrel 2 journal files).
        """
        started = time.monotonic()
        self._journal = self._journals.journal(self.parent, self.config)
        if not self.is_reader:
            return
        writer = self._journal.writer
        self._file = _ReaderFile(self.queue_path, self.parent, self.reader, self.config.sync_journal,
                                 writer.tail_id, self._journals.runtime)
        self._journal.attach(self)
        for info in writer.files:
            if info.last_id <= self._file.head:
                continue
            reader = RecordReader(info.path, k3.FileKind.WRITER)
            try:
                for _, record in reader:
                    assert isinstance(record, k3.Put)
                    if not self._file.consumed(record.id):
                        self._load(record)
            finally:
                reader.close()
        self._seen = writer.tail_id
        if self.length:
            log.info("loaded kestrel3 reader", queue=self.name, items=self.length, bytes=self.bytes,
                     seconds=round(time.monotonic() - started, 3), read_behind=self.in_read_behind)
        self._journal.release()

    def _load(self, record: k3.Put) -> None:
        """A pending item of this reader, held in memory unless memory is full (then only counted)."""
        size = len(record.data)
        self.length += 1
        self.bytes += size
        if self._behind is not None:
            return
        item = QItem(record.add_time, _expiry(record, self.config), record.data, errors=record.error_count)
        self._mem.append((record.id, item))
        self.memory_bytes += size
        if self.memory_bytes >= self.config.max_memory_size:
            self._behind = record.id + 1
            log.info("queue entering read-behind", queue=self.name, bytes=self.bytes)

    # -----------------------------------------------------------------------------------------
    # Read-behind

    def _fill(self) -> None:
        """Read items forward from the writer files until memory is full or every item is loaded."""
        assert self._file is not None
        while self._behind is not None and self.memory_bytes < self.config.max_memory_size:
            record = self._next_behind() if self._behind <= self._seen else None
            if record is None or record.id > self._seen:  # past it: a put `receive` is handing out
                self._end_read_behind()  # every item handed to this reader is in memory
                return
            self._behind = record.id + 1
            if not self._file.consumed(record.id) and record.id not in self._unsaved:
                item = QItem(record.add_time, _expiry(record, self.config), record.data,
                             errors=record.error_count)
                self._mem.append((record.id, item))
                self.memory_bytes += len(record.data)

    def _next_behind(self) -> k3.Put | None:
        """The next PUT at or after `_behind`, from the cursor (opened, or moved to the next file)."""
        assert self._journal is not None and self._behind is not None
        files = self._journal.writer.files
        while True:
            if self._cursor is None:
                info = next((f for f in files if f.last_id >= self._behind), None)
                if info is None:
                    return None
                self._cursor = RecordReader(info.path, k3.FileKind.WRITER)
                self._cursor_file = info.number
            entry = self._cursor.next()
            if entry is None:
                if self._cursor_file == files[-1].number:
                    self._cursor.grow()
                    entry = self._cursor.next()
                    if entry is None:
                        return None
                else:
                    self._close_cursor()
                    continue
            record = entry[1]
            assert isinstance(record, k3.Put)
            if record.id >= self._behind:
                return record

    def _close_cursor(self) -> None:
        if self._cursor is not None:
            self._cursor.close()
            self._cursor = None

    def _end_read_behind(self) -> None:
        if self._behind is not None:
            self._behind = None
            self._close_cursor()
            log.info("queue leaving read-behind", queue=self.name, items=self.length)

    # -----------------------------------------------------------------------------------------
    # The in-memory mechanics

    def _pop_head(self) -> Entry | None:
        if not self._mem and self._behind is not None:
            self._fill()
        if not self._mem:
            return None
        entry = self._mem.popleft()
        size = len(entry[1].data)
        self.length -= 1
        self.bytes -= size
        self.memory_bytes -= size
        if self._behind is not None and self.memory_bytes < self.config.max_memory_size:
            self._fill()
        return entry

    def _push_head(self, entries: list[Entry]) -> None:
        """Put entries back at the head, the first given first in line."""
        for entry in reversed(entries):
            self._mem.appendleft(entry)
            size = len(entry[1].data)
            self.length += 1
            self.bytes += size
            self.memory_bytes += size

    def _take_expired(self, now: int, limit: int | None = None) -> list[Entry]:
        """Pop expired items off the head (at most `limit`)."""
        expired: list[Entry] = []
        while limit is None or len(expired) < limit:
            if not self._mem and self._behind is not None:
                self._fill()
            if not self._mem:
                break
            expiry = self._mem[0][1].expiry
            if not expiry or expiry > now:
                break
            entry = self._pop_head()
            assert entry is not None
            expired.append(entry)
        return expired

    def _expired(self, entries: list[Entry]) -> None:
        """Count expired items (already consumed) and move them to `expire_to_queue`."""
        self.expired_items += len(entries)
        target_name = self.config.expire_to_queue
        if not entries or not target_name or self._expire_to is None:
            return
        target = self._expire_to(target_name)
        if target is not None and target is not self:
            for _, item in entries:
                target.add(item.data)

    def _save(self, ids: Iterable[int], commit: bool = True) -> None:
        """Record consumed ids (with any a failed write left over) in the checkpoint and, with
        `commit`, wait as the sync policy says. Raises JournalWriteError: nothing new is recorded."""
        if self._file is None:
            return
        ids = list(ids)
        if not ids:
            return  # what a failed write left over waits for the next write
        try:
            moved = self._file.save([*self._unsaved, *ids])
        except OSError as e:
            self.journal_write_errors += 1
            raise JournalWriteError(self.name, self._file.path, e) from None
        self._unsaved.clear()
        if moved and self._journal is not None:
            self._journal.release()
        if commit:
            self._file.commit()

    def commit(self) -> None:
        """Wait as the sync policy says for what this reader's checkpoint was given."""
        if self._file is not None and not self.closed:
            self._file.commit()

    def _save_later(self, ids: list[int], commit: bool = True) -> None:
        """Consumed ids whose record may wait: on a failed write they are kept for the next one
        (a crash before it serves them again: a duplicate, never a loss)."""
        try:
            self._save(ids, commit)
        except JournalWriteError as e:
            self._unsaved.update(ids)
            log.error("cannot write a reader checkpoint; consumed ids kept for the next write",
                      queue=self.name, error=str(e))

    # -----------------------------------------------------------------------------------------
    # Adding

    def add_many(self, items: list[bytes], expiry: int = 0, add_time: int | None = None) -> int:
        """Add items with one journal write; how many were accepted, in order. On a queue (the
        default reader) they go to every reader of its journal, on a fanout child to it alone.

        Raises ItemTooLarge, JournalWriteError (nothing was added).
        """
        for data in items:
            if len(data) > self.config.max_item_size:
                raise ItemTooLarge(f"item of {len(data)} bytes is over max_item_size "
                                   f"{self.config.max_item_size} of queue {self.name!r}")
        return self.fan_out(items, expiry, add_time)

    def fan_out(self, items: list[bytes], expiry: int = 0, add_time: int | None = None) -> int:
        """`add_many` as the collection puts: each reader takes the items before the first one over
        its own `max_item_size`. Returns how many this queue accepted (a fanout-only parent: how
        many fit). Raises JournalWriteError."""
        self._check_open()
        assert self._journal is not None
        now = self.clock.now_ms() if add_time is None else add_time
        targets = [q for q in self._journal.readers.values() if not self.reader or q is self]
        taken = self._journal.put(items, expiry, now, targets)
        return taken.get(self.reader, 0) if self.is_reader else self._fitting(items)

    def _fitting(self, items: list[bytes]) -> int:
        return next((i for i, data in enumerate(items) if len(data) > self.config.max_item_size), len(items))

    def admit(self, items: list[bytes], now: int) -> int:
        """How many of `items` (a prefix) this reader takes: what fits its limits, old items
        discarded to make room if it is set to. Expired items leave the head first."""
        self._check_open()
        expired = self._take_expired(now) if self._mem or self._behind is not None else []
        if expired:
            self._save_later([i for i, _ in expired], commit=False)  # `put` commits: no yield here
            self._expired(expired)
        cfg = self.config
        fitting = self._fitting(items)
        if cfg.discard_old_when_full:
            taken = 0 if cfg.max_items == 0 or cfg.max_size == 0 else fitting
        else:
            length, size, taken = self.length, self.bytes, 0
            for data in items[:fitting]:
                if length >= cfg.max_items or size >= cfg.max_size:
                    break
                length += 1
                size += len(data)
                taken += 1
        return taken

    def receive(self, records: list[k3.Put], taken: int) -> None:
        """Items just written: the first `taken` are this reader's, the rest it consumes at once."""
        consumed = [r.id for r in records[taken:]]
        cfg = self.config
        discarded: list[int] = []
        mine = records[:taken]
        size = sum(len(r.data) for r in mine)
        if (self._behind is None and self.length + taken < cfg.max_items and self.bytes + size < cfg.max_size
                and self.memory_bytes + size < cfg.max_memory_size):
            # All fit in memory with room to spare: no per-item checks (the common batch).
            self._mem.extend((r.id, QItem(r.add_time, _expiry(r, cfg), r.data, errors=r.error_count))
                             for r in mine)
            self.length += taken
            self.bytes += size
            self.memory_bytes += size
            mine = []
        for record in mine:
            while self.length and (self.length >= cfg.max_items or self.bytes >= cfg.max_size):
                entry = self._pop_head()
                assert entry is not None
                discarded.append(entry[0])
            self._load(record)
            self._seen = record.id
        self._seen = records[-1].id
        self.discarded += len(discarded)
        self.total_items += taken
        self._save_later(consumed + discarded, commit=False)  # the writer journal commits first
        for _ in range(taken):
            if not self._waits.wake_one():
                break

    # -----------------------------------------------------------------------------------------
    # Removing

    def remove_many(self, count: int, transaction: bool = False) -> list[QItem]:
        """Take up to `count` items from the head, with one checkpoint write.

        Raises JournalWriteError (nothing was taken).
        """
        self._check_open()
        now = self.clock.now_ms()
        popped: list[Entry] = []
        expired: list[Entry] = []
        taken: list[Entry] = []
        while len(taken) < count:
            gone = self._take_expired(now)
            expired += gone
            popped += gone
            entry = self._pop_head()
            if entry is None:
                break
            popped.append(entry)
            taken.append(entry)
        consumed = [i for i, _ in expired] + ([] if transaction else [i for i, _ in taken])
        try:
            self._save(consumed, commit=False)
        except JournalWriteError:
            self._push_head(popped)
            raise
        if transaction:
            for item_id, item in taken:
                item.xid = item_id
                self._opens[item_id] = item
            self.total_transactions += len(taken)
        if taken:
            self.current_age = max(0, now - taken[-1][1].add_time)
        self.commit()  # may yield: every change above is already in memory and appended
        self._expired(expired)
        return [item for _, item in taken]

    def peek(self) -> QItem | None:
        """The head item, left in place (expired items are dropped first)."""
        self._check_open()
        expired = self._take_expired(self.clock.now_ms())
        if expired:
            self._save_later([i for i, _ in expired])
            self._expired(expired)
        if not self._mem and self._behind is not None:
            self._fill()
        return self._mem[0][1] if self._mem else None

    def confirm(self, xid: int) -> bool:
        """Close open read `xid` for good; False if no such read is open. Raises JournalWriteError."""
        return self.confirm_many([xid]) == 1

    def confirm_many(self, xids: Iterable[int]) -> int:
        """Close these open reads for good with one checkpoint write; how many were open.

        Raises JournalWriteError (the reads stay open).
        """
        self._check_open()
        ids = list(dict.fromkeys(x for x in xids if x in self._opens))
        if ids:
            self._save(ids, commit=False)
            for xid in ids:
                del self._opens[xid]
            self.commit()
        return len(ids)

    def unremove(self, xid: int) -> bool:
        """Abort open read `xid`: its item goes back to the head; False if no such read is open."""
        return self.unremove_many([xid]) == 1

    def unremove_many(self, xids: Iterable[int]) -> int:
        """Abort these open reads, each item going back to the head in turn (the last one given ends
        up first); how many were open. An item aborted for the `max_errors`th time is handed to
        `poison` and then leaves for good (journaled as consumed); if `poison` refuses it, it goes
        back to the head instead. Raises JournalWriteError (the reads stay open; an item already
        handed to `poison` may then be there too: a copy, never a loss).
        """
        self._check_open()
        ids = list(dict.fromkeys(x for x in xids if x in self._opens))
        limit = self.config.max_errors
        poisoned = []
        for xid in ids:
            item = self._opens[xid]
            item.errors += 1
            if 0 < limit <= item.errors and self._handed_to_poison(item):
                poisoned.append(xid)
        ids = [x for x in ids if x in self._opens]  # the hand-over may have let another client close one
        poisoned = [x for x in poisoned if x in self._opens]
        self._save(poisoned, commit=False)
        for xid in ids:
            item = self._opens.pop(xid)
            item.xid = 0
            if xid not in poisoned:
                self._push_head([(xid, item)])
        self.canceled_transactions += len(ids)
        self.poisoned_items += len(poisoned)
        for _ in range(len(ids) - len(poisoned)):
            if not self._waits.wake_one():
                break
        if poisoned:
            self.commit()
        return len(ids)

    def flush(self) -> None:
        """Consume every item (open reads stay open), with one checkpoint rewrite.

        Raises JournalWriteError (nothing was dropped).
        """
        self._check_open()
        assert self._journal is not None
        if self._file is not None:
            tail = max(self._journal.writer.tail_id, self._file.head)
            head = min(self._opens, default=tail + 1) - 1
            head = max(head, self._file.head)
            done = {i for i in range(head + 1, tail + 1) if i not in self._opens}
            try:
                self._file.replace(head, done)
            except OSError as e:
                self.journal_write_errors += 1
                raise JournalWriteError(self.name, self._file.path, e) from None
            self._unsaved.clear()
            self._journal.release()
        self._mem.clear()
        self._end_read_behind()
        self.length = self.bytes = self.memory_bytes = 0
        self.total_flushes += 1

    def discard_expired(self, limit: int | None = None) -> int:
        """Drop expired items from the head (at most `limit`); the sweeper calls this.

        Raises JournalWriteError (nothing was dropped).
        """
        if self.closed or not self.is_reader:
            return 0
        expired = self._take_expired(self.clock.now_ms(), limit)
        try:
            self._save([i for i, _ in expired], commit=False)
        except JournalWriteError:
            self._push_head(expired)
            raise
        self.commit()
        self._expired(expired)
        return len(expired)

    # -----------------------------------------------------------------------------------------
    # Settings and shutting down

    def reconfigure(self, config: QueueConfig) -> None:
        """New settings from a reload (whether a parent is fanout-only is fixed at creation)."""
        self.config = replace(config, fanout_only=self.config.fanout_only)
        if self._journal is not None and not self.reader:
            self._journal.writer.reconfigure(config.default_journal_size, config.sync_journal)
        if self._file is not None:
            self._file.writer.sync_ms = config.sync_journal

    def wait_for_packing(self) -> None:
        """Nothing to wait for: Kestrel 3 journals are never packed, their files are deleted."""

    def close(self) -> None:
        """Close this reader's files (the writer journal closes with its last reader)."""
        if self.closed:
            return
        self.closed = True
        self._waits.end()
        self._close_cursor()
        if self._file is not None:
            self._file.close()
        if self._journal is not None:
            self._journal.detach(self)

    def destroy(self) -> None:
        """Close and delete this reader's checkpoint, and the writer files once no reader is left."""
        journal = self._journal
        self.close()
        if self._file is not None and os.path.exists(self._file.path):
            os.unlink(self._file.path)
        if journal is not None and journal.unread:
            journal.destroy()
