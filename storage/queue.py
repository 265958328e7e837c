"""PersistentQueue: one named FIFO of items, kept in memory and in its journal.

Every change is applied in memory first and then written to the journal as one append, before
anything can yield; only then does the caller wait for the sync policy. So the journal's order is
always the order in which the changes happened, and replaying it rebuilds the queue exactly,
xids included (a REMOVE_TENTATIVE takes the next free xid, as it did live).

Read-behind: once the queue holds `max_memory_size` bytes, new items are only counted and written
to the journal; a cursor reads them back from the journal files as the head drains.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace
from itertools import repeat
from operator import attrgetter

import gevent
import gevent.event
import structlog

from storage import codec, filenames, journal, packer
from storage.checkpoints import Checkpoint
from storage.clock import SYSTEM_CLOCK, Clock
from storage.codec import (
    Add,
    AddX,
    AddXid,
    ConfirmRemove,
    Continue,
    Record,
    Remove,
    RemoveTentative,
    RemoveTentativeXid,
    SaveXid,
    StateDump,
    Unremove,
)
from storage.config import QueueConfig
from storage.errors import CorruptJournalError, ItemTooLarge, JournalWriteError, QueueClosed
from storage.item import QItem
from storage.journal import JournalFiles, JournalWriter, RecordReader

log = structlog.get_logger("kestrel.queue")

LIVE = 2**63  # sort key of the live journal among rotated timestamps
_ADDS = (AddX, Add, AddXid, Continue)
_EXPIRY, _DATA = attrgetter("expiry"), attrgetter("data")


def _item_of(record: Record, now: int) -> QItem:
    """The item an add-type record carries."""
    if isinstance(record, Add):
        return QItem(now, record.expiry_s * 1000 if record.expiry_s else 0, record.data)
    assert isinstance(record, AddX | AddXid | Continue)
    item = QItem(record.add_time, record.expiry, record.data)
    if isinstance(record, AddXid):
        item.xid = record.xid
    return item


class _ReadBehind:
    """Where the next item not held in memory is: a file (by timestamp key) and a reader in it."""

    def __init__(self, key: int, path: str, offset: int) -> None:
        self.key = key
        self.reader = RecordReader(path, offset)

    def close(self) -> None:
        self.reader.close()


class PersistentQueue:
    """A durable FIFO queue with reliable reads, expiry and read-behind.

    Parameters: `name` (also the journal's file name), `queue_path` (directory of journals),
    `config`, `clock`, `expire_to` (looks up the queue that expired items move to), `salvage`
    (load what precedes a corrupt record instead of refusing to load).
    """

    def __init__(self, name: str, queue_path: str, config: QueueConfig, clock: Clock = SYSTEM_CLOCK,
                 expire_to: Callable[[str], PersistentQueue | None] | None = None,
                 salvage: bool = False) -> None:
        self.name = name
        self.queue_path = queue_path
        self.config = config
        self.clock = clock
        self._expire_to = expire_to
        self._salvage = salvage
        self._mem: deque[QItem] = deque()
        self._opens: dict[int, QItem] = {}
        self._xid = 0
        self.length = 0
        self.bytes = 0
        self.memory_bytes = 0
        self._writer: JournalWriter | None = None
        self._pending: list[bytes] = []  # records of changes made in memory, not yet appended
        self._rotate_at = min(config.default_journal_size, config.max_memory_size)
        self._rotated: list[tuple[int, str]] = []
        self._archived_size = 0
        self._rb: _ReadBehind | None = None
        self._replay_at: tuple[int, int] | None = None  # (file key, offset) while replaying
        self._replay_files: list[tuple[int, str]] = []
        self._checkpoints: list[Checkpoint] = []  # oldest first, one per rotation in read-behind
        self._packing: gevent.Greenlet | None = None
        self._waiters: deque[gevent.event.Event] = deque()
        self.closed = False
        self.waits_ended = False
        self.create_time = clock.now_ms()
        self.total_items = 0
        self.expired_items = 0
        self.discarded = 0
        self.total_flushes = 0
        self.total_transactions = 0
        self.canceled_transactions = 0
        self.current_age = 0
        self.read_only = False  # the journal cannot be written: changes are refused until it can
        self.journal_write_errors = 0
        self._rebuilding = False
        # A pack taken while a change is in progress, queued when the change is journaled; packs
        # are written one at a time, and a newer queued pack supersedes an older one.
        self._pack_ready: packer.PackRequest | None = None
        self._pack_queued: packer.PackRequest | None = None
        self._left_read_behind = False  # the cursor caught up: pack the backlog's leftovers away
        self._pack_horizon = 0  # the latest rotation packed with every item in memory
        self._packs_stopped = False  # a failed pack left a `.pack` that start-up must finish
        self._orphans: list[int] = []  # reads open at start-up, not yet journaled back to the head
        self._anomalies: dict[str, int] = {}

    # -----------------------------------------------------------------------------------------
    # Figures

    @property
    def open_transactions(self) -> int:
        return len(self._opens)

    @property
    def waiters(self) -> int:
        return len(self._waiters)

    @property
    def in_read_behind(self) -> bool:
        return self._rb is not None

    @property
    def journal_size(self) -> int:
        return self._archived_size + (self._writer.size if self._writer else 0)

    @property
    def journal_files(self) -> list[str]:
        live = [self._writer.path] if self._writer else []
        return [p for _, p in self._rotated] + live

    def stats(self) -> dict[str, int]:
        """The guide's per-queue figures, under its names."""
        age = self.current_age if self.length else 0
        return {
            "items": self.length,
            "bytes": self.bytes,
            "total_items": self.total_items,
            "logsize": self.journal_size,
            "expired_items": self.expired_items,
            "mem_items": len(self._mem),
            "mem_bytes": self.memory_bytes,
            "age": age,
            "discarded": self.discarded,
            "waiters": len(self._waiters),
            "open_transactions": len(self._opens),
            "transactions": self.total_transactions,
            "canceled_transactions": self.canceled_transactions,
            "total_flushes": self.total_flushes,
            "age_msec": age,
            "create_time": self.create_time,
            "read_only": int(self.read_only),
            "journal_write_errors": self.journal_write_errors,
        }

    # -----------------------------------------------------------------------------------------
    # Start-up: replay

    def setup(self, reopen: bool = True, files: JournalFiles | None = None) -> None:
        """Replay the journal files (if the queue keeps a journal) and open the live one.

        `files` is this queue's share of one scan of the queue path (start-up); without it the
        path is scanned for this queue alone and its temporaries are removed. Reads that were open
        go back to the head unless `reopen` is False (inspection tools).
        """
        if not self.config.keep_journal:
            return
        if files is None:
            files = journal.list_journal_files(self.queue_path, self.name)
            journal.remove_temporaries(self.queue_path, self.name)
        files = journal.finish_interrupted_packs(self.queue_path, self.name, files, self._salvage,
                                                 self.clock.now_ms())
        started = time.monotonic()
        replayed = self._replay(files, repair=True)
        live_path = os.path.join(self.queue_path, self.name)
        self._writer = JournalWriter(live_path, self.config.sync_journal)
        if replayed:
            log.info("replayed journal", queue=self.name, items=self.length, bytes=self.bytes,
                     open_reads=len(self._opens), journal_bytes=replayed,
                     seconds=round(time.monotonic() - started, 3), read_behind=self._rb is not None)
        if self._pack_ready is not None:  # the replayed cursor passed a checkpoint
            self._pack_queued, self._pack_ready = self._pack_ready, None
            self._start_next_pack()
        if self._opens and reopen:
            self._orphans = sorted(self._opens, reverse=True)
            try:
                self._return_orphans()
            except OSError as e:
                self._write_failed(e)  # they go back to the head once the journal can be written

    def _return_orphans(self) -> None:
        """Reads that were open when the process stopped go back to the head, newest first, so
        that the oldest is fetched first. They are journaled as UNREMOVEs, as Kestrel does."""
        for xid in self._orphans:
            if self._unremove(xid):
                self._write(codec.encode_xid(codec.UNREMOVE, xid))
        self._commit()
        self._orphans = []

    def _replay(self, files: JournalFiles, repair: bool) -> int:
        """Rebuild the queue from its journal files; return how many bytes were replayed.

        With `repair`, a torn tail is cut off (a copy kept) and salvage sets damage aside; without
        it (rebuilding a running queue) nothing on disk changes.
        """
        self._rotated = list(files.rotated)
        self._replay_files = self._rotated + ([(LIVE, files.live)] if files.live else [])
        replayed = 0
        previous: str | None = None
        for index, (key, path) in enumerate(self._replay_files):
            last = index == len(self._replay_files) - 1
            reader = RecordReader(path, check_sizes=True)
            self._anomalies = {}
            try:
                cut = self._replay_file(key, reader, last, repair)
                replayed += reader.offset
            finally:
                reader.close()
            self._report_anomalies(path, previous)
            previous = path
            if cut is None and key != LIVE and self._rb is not None:
                # The state at this rotation, as it stood then: packing resumes after a restart.
                self._checkpoints.append(Checkpoint(key, self._xid, list(self._opens.items())))
            if cut is not None:
                # The damage may lie in a record already applied (a size field found wrong only by
                # what follows it): replay again what is left, now ending before the damage.
                self._set_aside_after(index, cut)
                self._reset_memory()
                return self._replay(journal.list_journal_files(self.queue_path, self.name), repair)
        self._replay_at = None
        self._replay_files = []
        self._rotated = [(ts, p) for ts, p in self._rotated if os.path.exists(p)]
        self._archived_size = sum(os.path.getsize(p) for _, p in self._rotated)
        return replayed

    def _replay_file(self, key: int, reader: RecordReader, last: bool,
                     repair: bool) -> tuple[str, int] | None:
        """Apply one file's records; return (path, offset) where salvage must cut, if it must."""
        now = self.clock.now_ms()
        try:
            while True:
                # Runs of common records take the fast path while no add there can reach the
                # memory limit (read-behind starts on the general path, record by record).
                room = self.config.max_memory_size - self.memory_bytes
                if self._rb is None and not self._checkpoints and room > 0:
                    run = reader.common_run(room)
                    if run:
                        self._apply_common(run)
                        continue
                entry = reader.next()
                if entry is None:
                    break
                self._replay_at = (key, reader.offset)
                self._apply(entry[1], now, entry[0])
        except CorruptJournalError as e:
            if not self._salvage or not repair:
                raise
            log.error("corrupt journal record; keeping what precedes it (salvage)", queue=self.name,
                      file=e.path, offset=e.offset, opcode=e.opcode, reason=e.reason)
            return (e.path, e.offset)
        left = reader.leftover()
        if not left or not repair:
            return None
        if not last:
            reason = f"{left} bytes of an incomplete record before the next journal file"
        else:
            damage = journal.torn_tail_damage(reader.path, reader.offset)
            if damage is None:
                copy = self._cut_keeping_copy(reader.path, reader.offset, "torn")
                log.warning("torn record at the end of the journal; cut off, a copy kept", queue=self.name,
                            file=reader.path, offset=reader.offset, bytes=left, copy=copy)
                return None
            reason = damage
        error = CorruptJournalError(reader.path, reader.offset, None, reason)
        if not self._salvage:
            raise error
        log.error("damaged record inside the journal; keeping what precedes it (salvage)",
                  queue=self.name, file=reader.path, offset=reader.offset, reason=reason)
        return (reader.path, reader.offset)

    def _cut_keeping_copy(self, path: str, offset: int, label: str) -> str:
        """Cut `path` at `offset`, first saving what is cut as `<path>.<label>-<ms>`.

        Raises JournalWriteError (and changes nothing) when the copy cannot be written.
        """
        copy = filenames.set_aside_path(path, label, self.clock.now_ms())
        try:
            with open(path, "rb") as src, open(copy, "wb") as dst:
                src.seek(offset)
                shutil.copyfileobj(src, dst)
                dst.flush()
                os.fsync(dst.fileno())
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(copy)
            raise JournalWriteError(self.name, copy, e) from None
        os.truncate(path, offset)
        return copy

    def _set_aside_after(self, index: int, cut: tuple[str, int]) -> None:
        """Salvage: cut the damaged file at the damage (keeping a copy of what is cut) and set
        every later file aside."""
        path, offset = cut
        self._cut_keeping_copy(path, offset, "corrupt")
        stamp = self.clock.now_ms()
        for _, later in self._replay_files[index + 1:]:
            os.rename(later, filenames.set_aside_path(later, "corrupt", stamp))

    def _note_anomaly(self, what: str, offset: int) -> None:
        """A record with nothing to act on: a sign that a journal file before it is missing."""
        if not self._anomalies:
            self._anomalies["first_offset"] = offset
        self._anomalies[what] = self._anomalies.get(what, 0) + 1

    def _report_anomalies(self, path: str, previous: str | None) -> None:
        if self._anomalies:
            log.warning("JOURNAL RECORDS WITH NOTHING TO ACT ON: a journal file before this one may be "
                        "missing or damaged, and items may have been lost or brought back",
                        queue=self.name, file=path, previous_file=previous or "(none)", **self._anomalies)

    def _apply(self, record: Record, now: int, offset: int) -> None:
        """One replayed record. Replay never expires items, so it depends on nothing but the file."""
        if isinstance(record, AddX | AddXid | Add):
            self._append(_item_of(record, now))
        elif isinstance(record, Remove):
            if self._take_head() is None:
                self._note_anomaly("remove_of_nothing", offset)
        elif isinstance(record, RemoveTentative):
            item = self._take_head(opened=True)
            if item is None:
                self._note_anomaly("open_of_nothing", offset)
            else:
                self._open(item, item.xid or self._next_xid())
        elif isinstance(record, RemoveTentativeXid):
            item = self._take_head(opened=True)
            if item is None:
                self._note_anomaly("open_of_nothing", offset)
                return
            if not item.xid and record.xid != self._next_xid(take=False):
                self._note_anomaly("xid_jumps", offset)
            self._open(item, record.xid)
            self._xid = record.xid
        elif isinstance(record, ConfirmRemove):
            if self._opens.pop(record.xid, None) is None:
                self._note_anomaly("confirm_of_no_open_read", offset)
        elif isinstance(record, Unremove):
            if not self._unremove(record.xid):
                self._note_anomaly("abort_of_no_open_read", offset)
        elif isinstance(record, SaveXid | StateDump):
            self._xid = record.xid
        elif isinstance(record, Continue):
            self._opens.pop(record.xid, None)
            self._append(_item_of(record, now))

    def _apply_common(self, run: list[codec.Common]) -> None:
        """`_apply` for a run of common records, while nothing is in read-behind or checkpointed
        and no add in the run can reach the memory limit (the caller makes sure)."""
        mem = self._mem
        opens = self._opens
        count = size = 0
        for op, offset, xid, add_time, expiry, data in run:
            if op in (codec.ADDX, codec.ADD_XID):
                mem.append(QItem(add_time, expiry, data, xid))
                count += 1
                size += len(data)
            elif op == codec.REMOVE:
                if not mem:
                    self._note_anomaly("remove_of_nothing", offset)
                    continue
                count -= 1
                size -= len(mem.popleft().data)
            elif op == codec.CONFIRM_REMOVE:
                if opens.pop(xid, None) is None:
                    self._note_anomaly("confirm_of_no_open_read", offset)
            else:  # REMOVE_TENTATIVE_XID
                if not mem:
                    self._note_anomaly("open_of_nothing", offset)
                    continue
                item = mem.popleft()
                count -= 1
                size -= len(item.data)
                if not item.xid and xid != self._next_xid(take=False):
                    self._note_anomaly("xid_jumps", offset)
                item.xid = xid
                opens[xid] = item
                self._xid = xid
        self.length += count
        self.bytes += size
        self.memory_bytes += size

    # -----------------------------------------------------------------------------------------
    # The in-memory mechanics shared by replay and live operations

    def _next_xid(self, take: bool = True) -> int:
        """The next free xid (taken unless `take` is False), as Kestrel counts them."""
        xid = self._xid
        while True:
            xid = (xid + 1) & 0xFFFFFFFF
            if xid >= 2**31:
                xid -= 2**32  # xids are i32 on disk
            if xid != 0 and xid not in self._opens:
                if take:
                    self._xid = xid
                return xid

    def _open(self, item: QItem, xid: int) -> None:
        item.xid = xid
        self._opens[xid] = item

    def _append(self, item: QItem) -> None:
        size = len(item.data)
        self.length += 1
        self.bytes += size
        if self._rb is not None:
            return
        self._mem.append(item)
        self.memory_bytes += size
        if self.memory_bytes >= self.config.max_memory_size and self.config.keep_journal:
            self._start_read_behind()

    def _start_read_behind(self) -> None:
        if self._replay_at is not None:
            key, offset = self._replay_at
            path = next(p for k, p in self._replay_files if k == key)
        else:
            assert self._writer is not None
            self._flush()
            key, path, offset = LIVE, self._writer.path, self._writer.size
        self._rb = _ReadBehind(key, path, offset)
        log.info("queue entering read-behind", queue=self.name, bytes=self.bytes)

    def _take_head(self, opened: bool = False) -> QItem | None:
        """Pop the head item; `opened` says whether it becomes an open read or is gone for good."""
        if not self._mem and self._rb is not None:
            self._fill()
        if not self._mem:
            return None
        item = self._mem.popleft()
        size = len(item.data)
        self.length -= 1
        self.bytes -= size
        self.memory_bytes -= size
        for checkpoint in self._checkpoints:
            # Before refilling: crossing a checkpoint while refilling starts a pack that must see it.
            checkpoint.note_departure(item, opened)
        if self._rb is not None and self.memory_bytes < self.config.max_memory_size:
            self._fill()
        return item

    def _unremove(self, xid: int) -> bool:
        item = self._opens.pop(xid, None)
        if item is None:
            return False
        item.xid = 0
        size = len(item.data)
        self._mem.appendleft(item)
        self.length += 1
        self.bytes += size
        self.memory_bytes += size
        return True

    def _fill(self) -> None:
        """Read items forward from the journal until memory is full or the cursor catches up."""
        rb = self._rb
        if self._replay_at is None:
            self._flush()
        while rb is not None and self.memory_bytes < self.config.max_memory_size:
            if self._replay_at is not None:
                key, offset = self._replay_at
                if rb.key == key and rb.reader.offset >= offset:
                    self._end_read_behind()
                    return
            entry = rb.reader.next()
            if entry is None:
                if not self._advance_read_behind(rb):
                    self._end_read_behind()
                    self._left_read_behind = self._replay_at is None
                    return
                continue
            record = entry[1]
            if isinstance(record, _ADDS):
                item = _item_of(record, self.clock.now_ms())
                self._mem.append(item)
                self.memory_bytes += len(item.data)

    def _advance_read_behind(self, rb: _ReadBehind) -> bool:
        """Move the cursor to the next journal file; False when it is at the end of the live one."""
        if rb.key == LIVE:
            return False
        files = self._replay_files if self._replay_at is not None else self._rotated_and_live()
        nxt = next(((k, p) for k, p in files if k > rb.key), None)
        if nxt is None:
            return False
        passed = rb.key
        rb.close()
        rb.key = nxt[0]
        rb.reader = RecordReader(nxt[1])
        passed_checkpoints = [cp for cp in self._checkpoints if cp.timestamp <= passed]
        if passed_checkpoints:
            # The state at the latest checkpoint passed is taken now; it is written once the change
            # in progress is journaled (`_change`), and dropped if that change fails.
            self._checkpoints = self._checkpoints[len(passed_checkpoints):]
            self._pack_ready = self._take_pack(passed_checkpoints[-1])
        return True

    def _rotated_and_live(self) -> list[tuple[int, str]]:
        live = [(LIVE, self._writer.path)] if self._writer else []
        return self._rotated + live

    def _end_read_behind(self) -> None:
        if self._rb is not None:
            self._rb.close()
            self._rb = None
            log.info("queue leaving read-behind", queue=self.name, items=self.length)

    # -----------------------------------------------------------------------------------------
    # Live operations

    def _check_open(self) -> None:
        if self.closed:
            raise QueueClosed(f"queue {self.name!r} is closed")

    @contextlib.contextmanager
    def _change(self) -> Iterator[None]:
        """Around every change: refused while the journal cannot be written, undone if its write fails.

        Raises JournalWriteError: the change did not happen, in memory or on disk.
        """
        self._check_open()
        if self.read_only or self._rebuilding:
            self._probe()
        if self._writer is not None and self._writer.fd < 0:
            try:
                self._writer.open()
            except OSError as e:  # nothing changed yet: refuse this change, the next one tries again
                raise JournalWriteError(self.name, self._writer.path, e) from None
        try:
            if self._orphans:
                self._return_orphans()
            yield
        except OSError as e:
            raise self._write_failed(e) from None
        except JournalWriteError:  # from the queue this change feeds (expire_to_queue)
            self._rebuild()
            raise
        if self._pack_ready is not None:
            self._pack_queued, self._pack_ready = self._pack_ready, None
        if self._left_read_behind:
            self._left_read_behind = False
            self._checkpoints = []  # every one was passed on the way to the live journal
            if self._rotated and self._rotated[-1][0] > self._pack_horizon and self._writer is not None:
                self._pack_now()  # what the backlog left behind: at most max_memory_size of items
        self._start_next_pack()

    def _probe(self) -> None:
        """While read-only: see whether the journal can be written again (a SAVE_XID changes nothing)."""
        writer = self._writer
        assert writer is not None
        if self._rebuilding:
            raise JournalWriteError(self.name, writer.path, None)
        try:
            writer.append(codec.encode_xid(codec.SAVE_XID, self._xid))
        except OSError as e:
            raise JournalWriteError(self.name, writer.path, e) from None
        self.read_only = False
        log.warning("journal can be written again; queue accepts changes", queue=self.name, file=writer.path)

    def _write_failed(self, error: OSError) -> JournalWriteError:
        """A journal write failed: go read-only and bring memory back to what the journal holds."""
        path = self._writer.path if self._writer is not None else self.queue_path
        if not self.read_only:
            log.error("cannot write the journal; the queue is read-only until it can", queue=self.name,
                      file=path, error=str(error))
        self.read_only = True
        self.journal_write_errors += 1
        self._rebuild()
        return JournalWriteError(self.name, path, error)

    def _rebuild(self) -> None:
        """Replay the journal into a fresh memory state: it is the truth once a write has failed.

        The writer cut the failed append off, so the journal holds exactly the changes that were
        acknowledged or are being acknowledged. Open reads keep their xids.
        """
        self._rebuilding = True
        try:
            self.wait_for_packing()
            files = journal.list_journal_files(self.queue_path, self.name)
            self._pending.clear()
            self._reset_memory()
            self._replay(files, repair=False)
        finally:
            self._rebuilding = False

    def _reset_memory(self) -> None:
        """Forget every item, open read and xid, ready for a replay from the first journal file."""
        self._end_read_behind()
        self._checkpoints = []
        self._pack_ready = self._pack_queued = None
        self._left_read_behind = False
        self._pack_horizon = 0
        self._mem.clear()
        self._opens.clear()
        self._xid = 0
        self.length = self.bytes = self.memory_bytes = 0

    def _write(self, data: bytes) -> None:
        if self._writer is not None and data:
            self._pending.append(data)

    def _flush(self) -> None:
        """Append the pending records in one write (no yield between a change and its record)."""
        if self._pending:
            assert self._writer is not None
            data = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
            self._pending.clear()
            self._writer.append(data)

    def _commit(self) -> None:
        """Append, wait as the sync policy says, then consider rotating. Last step of each operation."""
        writer = self._writer
        if writer is None:
            return
        if self._pending:
            self._flush()
        if writer.sync_ms is not None:
            writer.commit()
        if writer.size >= self._rotate_at:
            self._maybe_rotate()

    def add(self, data: bytes, expiry: int = 0, add_time: int | None = None) -> bool:
        """Add an item at the tail; False when the queue is full and refuses it.

        `expiry` is absolute milliseconds since the epoch (0 = never), capped by `max_age`.
        Raises ItemTooLarge when the item is over `max_item_size`.
        """
        return self.add_many([data], expiry, add_time) == 1

    def add_many(self, items: list[bytes], expiry: int = 0, add_time: int | None = None) -> int:
        """Add several items with one journal write; returns how many were accepted, in order.

        Raises ItemTooLarge, JournalWriteError (nothing was added).
        """
        with self._change():
            return self._add_many(items, expiry, add_time)

    def _add_many(self, items: list[bytes], expiry: int, add_time: int | None) -> int:
        cfg = self.config
        now = self.clock.now_ms() if add_time is None else add_time
        if items and max(map(len, items)) > cfg.max_item_size:
            size = next(n for n in map(len, items) if n > cfg.max_item_size)
            raise ItemTooLarge(f"item of {size} bytes is over max_item_size "
                               f"{cfg.max_item_size} of queue {self.name!r}")
        if self._rb is not None or (self._mem and self._mem[0].expiry):
            self._expire_head(now)
        if cfg.max_age:
            cap = now + cfg.max_age
            expiry = min(expiry, cap) if expiry else cap
        journaled = self._writer is not None
        size = sum(map(len, items))
        if (self._rb is None and self.length + len(items) < cfg.max_items and self.bytes + size < cfg.max_size
                and self.memory_bytes + size < cfg.max_memory_size):
            # All fit in memory with room to spare: no per-item limit checks (the common batch).
            if journaled:
                self._pending.append(codec.encode_addx_many(now, expiry, items))
            self._mem.extend(map(QItem, repeat(now), repeat(expiry), items))
            accepted = len(items)
            self.length += accepted
            self.bytes += size
            self.memory_bytes += size
        else:
            accepted = 0
            for data in items:
                if (self.length >= cfg.max_items or self.bytes >= cfg.max_size) and not self._make_room():
                    break
                if journaled:
                    self._pending.append(codec.encode_addx(now, expiry, data))
                self._append(QItem(now, expiry, data))
                accepted += 1
        self.total_items += accepted
        if self._waiters:
            for _ in range(accepted):
                if not self._wake():
                    break
        self._commit()
        return accepted

    def _make_room(self) -> bool:
        """Whether one more item fits, discarding old ones if the queue is set to."""
        cfg = self.config
        while self.length >= cfg.max_items or self.bytes >= cfg.max_size:
            if not cfg.discard_old_when_full:
                return False
            if self._take_head() is None:
                return False
            self.discarded += 1
            self._write(codec.REMOVE_BYTES)
        return True

    def remove(self, transaction: bool = False) -> QItem | None:
        """Take the head item; with `transaction`, open a read on it (its `xid` is set)."""
        taken = self.remove_many(1, transaction)
        return taken[0] if taken else None

    def remove_many(self, count: int, transaction: bool = False) -> list[QItem]:
        """Take up to `count` items from the head with one journal write (what batch gets use).

        Raises JournalWriteError (nothing was taken).
        """
        with self._change():
            return self._remove_many(count, transaction)

    def _remove_many(self, count: int, transaction: bool) -> list[QItem]:
        now = self.clock.now_ms()
        if not transaction and self._rb is None and not self._checkpoints and count > 1:
            taken = self._take_plain(count, now)
            if taken is not None:
                return taken
        taken = []
        while len(taken) < count:
            if self._rb is not None or (self._mem and self._mem[0].expiry):
                self._expire_head(now)
            item = self._take_head(opened=transaction)
            if item is None:
                break
            if transaction:
                xid = self._next_xid()
                self._open(item, xid)
                self.total_transactions += 1
                self._write(codec.encode_xid(codec.REMOVE_TENTATIVE_XID, xid))
            else:
                self._write(codec.REMOVE_BYTES)
            taken.append(item)
        if taken:
            self.current_age = max(0, now - taken[-1].add_time)
        self._commit()
        return taken

    def _take_plain(self, count: int, now: int) -> list[QItem] | None:
        """A batch get's items in one go when none of them can expire (the common batch), else None
        and the queue as it was: no per-item checks, one REMOVE per item in one record string."""
        mem = self._mem
        taken = [mem.popleft() for _ in range(min(count, len(mem)))]
        if not taken or any(map(_EXPIRY, taken)):
            mem.extendleft(reversed(taken))
            return None
        size = sum(map(len, map(_DATA, taken)))
        self.length -= len(taken)
        self.bytes -= size
        self.memory_bytes -= size
        self._write(codec.REMOVE_BYTES * len(taken))
        self.current_age = max(0, now - taken[-1].add_time)
        self._commit()
        return taken

    def peek(self) -> QItem | None:
        """The head item, left in place (expired items are dropped first, unless read-only)."""
        self._check_open()
        if self.read_only:
            now = self.clock.now_ms()
            return next((i for i in self._mem if not i.expiry or i.expiry > now), None)
        with self._change():
            if self._expire_head(self.clock.now_ms()):
                self._commit()
            if not self._mem and self._rb is not None:
                self._fill()
            return self._mem[0] if self._mem else None

    def confirm(self, xid: int) -> bool:
        """Close open read `xid` for good; False if no such read is open.

        Raises JournalWriteError (the read stays open).
        """
        return self.confirm_many([xid]) == 1

    def confirm_many(self, xids: Iterable[int]) -> int:
        """Close these open reads for good, their records in one journal write; how many were open.

        Raises JournalWriteError (the reads stay open).
        """
        with self._change():
            closed = 0
            for xid in xids:
                item = self._opens.pop(xid, None)
                if item is None:
                    continue
                for checkpoint in self._checkpoints:
                    checkpoint.note_confirm(item)
                self._write(codec.encode_xid(codec.CONFIRM_REMOVE, xid))
                closed += 1
            if closed:
                self._commit()
            return closed

    def unremove(self, xid: int) -> bool:
        """Abort open read `xid`: its item goes back to the head; False if no such read is open.

        Raises JournalWriteError (the read stays open).
        """
        return self.unremove_many([xid]) == 1

    def unremove_many(self, xids: Iterable[int]) -> int:
        """Abort these open reads, each item going back to the head in turn (so the last one given
        ends up first), their records in one journal write; how many were open.

        Raises JournalWriteError (the reads stay open).
        """
        with self._change():
            aborted = 0
            for xid in xids:
                if not self._unremove(xid):
                    continue
                self.canceled_transactions += 1
                self._write(codec.encode_xid(codec.UNREMOVE, xid))
                aborted += 1
            for _ in range(aborted):
                if not self._wake():
                    break
            if aborted:
                self._commit()
            return aborted

    def reconfigure(self, config: QueueConfig) -> None:
        """New settings from a reload. Whether the queue keeps a journal is fixed at creation."""
        self.config = replace(config, keep_journal=self.config.keep_journal)
        self._rotate_at = min(config.default_journal_size, config.max_memory_size)
        if self._writer is not None:
            self._writer.sync_ms = config.sync_journal

    def open_reads(self) -> list[QItem]:
        """The items of the open reads, lowest xid first."""
        return [self._opens[xid] for xid in sorted(self._opens)]

    def flush(self) -> None:
        """Drop every item (open reads stay open), journaled as one REMOVE per item.

        Raises JournalWriteError (nothing was dropped).
        """
        with self._change():
            removed = 0
            while self._take_head() is not None:
                removed += 1
            self.total_flushes += 1
            self._write(codec.REMOVE_BYTES * removed)
            self._commit()

    def discard_expired(self, limit: int | None = None) -> int:
        """Drop expired items from the head (at most `limit`); the sweeper calls this."""
        if self.closed or self.read_only:
            return 0
        with self._change():
            expired = self._expire_head(self.clock.now_ms(), limit)
            if expired:
                self._commit()
            return expired

    def _expire_head(self, now: int, limit: int | None = None) -> int:
        """Remove expired items from the head (journaled as REMOVEs); return how many."""
        removed = 0
        while limit is None or removed < limit:
            if not self._mem and self._rb is not None:
                self._fill()
            if not self._mem:
                break
            head = self._mem[0]
            if not head.expiry or head.expiry > now:
                break
            self._take_head()
            self._write(codec.REMOVE_BYTES)
            removed += 1
            self.expired_items += 1
            target_name = self.config.expire_to_queue
            placeholder = not head.data and head.expiry == codec.PLACEHOLDER_EXPIRY
            if target_name and self._expire_to is not None and not placeholder:
                target = self._expire_to(target_name)
                if target is not None and target is not self:
                    target.add(head.data)
        return removed

    # -----------------------------------------------------------------------------------------
    # Waiting

    def _wake(self) -> bool:
        """Wake the longest-waiting reader that is not already woken."""
        for event in self._waiters:
            if not event.is_set():
                event.set()
                return True
        return False

    def end_waits(self) -> None:
        """Waiting readers return empty-handed now and later reads do not wait (the server is stopping)."""
        self.waits_ended = True
        for event in self._waiters:
            event.set()

    def _wait(self, fetch: Callable[[], QItem | None], timeout: float) -> QItem | None:
        item = fetch()
        if item is not None or timeout <= 0 or self.waits_ended:
            return item
        deadline = time.monotonic() + timeout
        event = gevent.event.Event()
        self._waiters.append(event)
        item = None
        try:
            while item is None and not self.closed and not self.waits_ended:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not event.wait(remaining):
                    break
                event.clear()
                if self.closed or self.waits_ended:
                    break
                item = fetch()
            return item
        finally:
            self._waiters.remove(event)
            if event.is_set() and item is None:
                self._wake()  # pass on a wake-up we did not use

    def wait_remove(self, timeout: float, transaction: bool = False) -> QItem | None:
        """Remove, waiting up to `timeout` seconds for an item; waiters are served first come first."""
        return self._wait(lambda: self.remove(transaction), timeout)

    def wait_peek(self, timeout: float) -> QItem | None:
        item = self._wait(self.peek, timeout)
        if item is not None:
            self._wake()  # a peek takes nothing: let the next waiter look too
        return item

    # -----------------------------------------------------------------------------------------
    # Rotation and packing

    def _maybe_rotate(self) -> None:
        writer = self._writer
        if writer is None or self._packing is not None or self._pack_ready or self._pack_queued:
            return
        cfg = self.config
        if self.length == 0 and not self._checkpoints and writer.size >= cfg.default_journal_size:
            self._pack_now()
            self._start_next_pack()
        elif writer.size >= cfg.max_memory_size:
            if self._rb is not None:
                self._rotate(checkpoint=True)
            elif self.journal_size > cfg.max_journal_size:
                self._pack_now()
                self._start_next_pack()
            else:
                self._rotate(checkpoint=False)

    def _rotate(self, checkpoint: bool) -> None:
        """Rename the live journal to `<name>.<ms>` and start a new one."""
        assert self._writer is not None
        self._flush()
        last = self._rotated[-1][0] if self._rotated else 0
        stamp = max(self.clock.now_ms(), last + 1)
        old = self._writer
        rotated = filenames.rotated_path(self.queue_path, self.name, stamp)
        os.rename(old.path, rotated)  # its descriptor stays valid: finish it in the background
        self._rotated.append((stamp, rotated))
        self._archived_size += old.size
        self._writer = JournalWriter(old.path, self.config.sync_journal)
        gevent.spawn(old.close)
        if self._rb is not None and self._rb.key == LIVE:
            self._rb.key = stamp
        if checkpoint:
            self._checkpoints.append(Checkpoint(stamp, self._xid, list(self._opens.items())))

    def _pack_now(self) -> None:
        """Rotate and queue a pack of the state now: every item is in memory (not in read-behind)."""
        self._rotate(checkpoint=True)
        self._pack_horizon = self._rotated[-1][0]
        self._pack_queued = self._take_pack(self._checkpoints.pop())

    def _take_pack(self, checkpoint: Checkpoint) -> packer.PackRequest:
        """The checkpoint's state as a pack to write (every item queued then is in memory now)."""
        return checkpoint.pack_request(self.queue_path, self.name, list(self._mem), self.clock.now_ms())

    def _start_next_pack(self) -> None:
        """Write the queued pack in the background, unless one is being written; it replaces every
        journal up to its timestamp (reckoned now: packs are written one after another)."""
        request = self._pack_queued
        if request is None or self._packing is not None or self._packs_stopped:
            return
        self._pack_queued = None
        dead = [p for ts, p in self._rotated if ts <= request.timestamp]
        self._packing = gevent.spawn(self._pack, request, dead)

    def _pack(self, request: packer.PackRequest, dead: list[str]) -> None:
        started = time.perf_counter()
        try:
            final = gevent.get_hub().threadpool.apply(packer.write_pack, (request, dead))
            journal.record_timing("pack", started)
        except Exception:
            if os.path.exists(packer.pack_path(request)):
                # Complete but not yet in place: only the next start-up may finish it, and no later
                # pack may be written before (it would be replayed after this one).
                self._packs_stopped = True
                log.exception("packing failed half way; no more packs until the next start",
                              queue=self.name)
            else:
                log.exception("packing failed; the old journal files stay and remain correct",
                              queue=self.name)
        else:
            stamp = request.timestamp
            self._rotated = [(ts, p) for ts, p in self._rotated if ts > stamp]
            self._rotated.insert(0, (stamp, final))
            self._archived_size = sum(os.path.getsize(p) for _, p in self._rotated)
        self._packing = None
        self._start_next_pack()

    def wait_for_packing(self) -> None:
        """Return once every pack taken so far is written (or has failed)."""
        while self._packing is not None:
            self._packing.join()

    # -----------------------------------------------------------------------------------------
    # Shutting down

    def close(self) -> None:
        """Finish any pack, fsync and close the journal; waiting readers get nothing."""
        if self.closed:
            return
        self.wait_for_packing()
        self.closed = True
        for event in self._waiters:
            event.set()
        if self._writer is not None:
            self._writer.close()
        self._end_read_behind()

    def destroy(self) -> None:
        """Close and delete every journal file of this queue (the `delete` command)."""
        self.close()
        for path in self.journal_files:
            if os.path.exists(path):
                os.unlink(path)
        files = journal.list_journal_files(self.queue_path, self.name)
        for path in files.replay_order() + [p for _, p in files.packs]:
            os.unlink(path)
        journal.remove_temporaries(self.queue_path, self.name)
