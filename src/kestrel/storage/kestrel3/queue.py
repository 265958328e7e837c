"""Kestrel3Queue: a queue kept in Kestrel 3's journal, one copy of the data for many readers (the
journal: src/kestrel/storage/kestrel3/journal.py).

The queue's rules are `src/kestrel/storage/queue.py`'s; this is how the format keeps them. The queue's items
are written once, as PUT records, to its writer journal `<queue>.<number>`; each reader (the queue itself
is the reader with the empty name, its fanout child `queue+name` the reader `name`) keeps only its
progress in `<queue>.read.<reader>`: a head id below which every item is consumed, and the ids
consumed out of order above it. An item is consumed when it leaves its reader for good (removed,
confirmed, expired, discarded, flushed, poisoned, or refused because the reader was full); an open
read is not, so after a restart it is served again in id order. Writer files are deleted once every
reader's head has passed them. An item's id is its `xid` in memory too: an open read's id is its item's.

A change's consumed ids are written at its end; if that write fails the change is undone in memory
and refused. The ids of items that left by themselves during a put or a peek (expired, discarded,
refused) may wait instead: a crash before they are written serves them again, a duplicate, never a
loss. Each reader holds at most `max_memory_size` bytes of items in memory; the rest are counted and
read back from the writer files as the head drains (read-behind).
"""

from __future__ import annotations

import errno
import itertools
import os
import time
from collections.abc import Callable, Iterable
from operator import attrgetter
from typing import ClassVar, cast

import structlog

from kestrel.storage import disk, fanout
from kestrel.storage.clock import SYSTEM_CLOCK, Clock
from kestrel.storage.config import QueueConfig
from kestrel.storage.deferred_log import log_later
from kestrel.storage.errors import JournalWriteError, QueueClosed
from kestrel.storage.item import QItem, data_sizes
from kestrel.storage.journal_file import CURSOR_CHUNK
from kestrel.storage.kestrel3 import codec as k3
from kestrel.storage.kestrel3.files import RecordReader, ids_held
from kestrel.storage.kestrel3.journal import Kestrel3Journal, Kestrel3Journals, ReaderFile
from kestrel.storage.queue import PersistentQueue, ReaderPosition, capped_expiry
from kestrel.storage.queue_path import JournalFileFigures, JournalFiles
from kestrel.storage.read_behind import FileCursor
from kestrel.storage.runtime import GeventRuntime, Task, all_side_by_side
from kestrel.storage.write_gate import WriteGate

log = structlog.get_logger("kestrel.kestrel3")
# A flush lists the ids it consumes from their range while it holds at most this many times as many
# ids as items (and a little): past that, from the files.
SPARSE_IDS = 2

_XID = attrgetter("xid")

# What a change noted (`Kestrel3Queue._set_aside`): its consumed ids, the items that left the head,
# the open reads it closed and those it put back.
_Notes = tuple[list[int], list[QItem], list[QItem], list[QItem]]


def _reader_of(name: str) -> tuple[str, str]:
    """(writer queue, reader) of a queue name: `q` is q's default reader, `q+a` its reader `a`."""
    parent, _, child = name.partition("+")
    return parent, child


class Kestrel3Queue(PersistentQueue):
    """One reader of a Kestrel 3 writer journal.

    Parameters: those of `PersistentQueue`, and `journals` (the queue path's writer journals, shared
    by the readers of each). A fanout-only parent keeps no reader of its own, but for the one it kept
    before it was made fanout-only while that holds items (`_load_files`).
    """

    shares_writes: ClassVar[bool] = True
    journal_format: ClassVar[int] = 3

    def __init__(self, name: str, queue_path: str, config: QueueConfig, clock: Clock | None = None,
                 expire_to: Callable[[str], PersistentQueue | None] | None = None,
                 journals: Kestrel3Journals[Kestrel3Queue] | None = None) -> None:
        self._journals: Kestrel3Journals[Kestrel3Queue] = journals or Kestrel3Journals(
            queue_path, GeventRuntime(clock or SYSTEM_CLOCK))
        runtime = self._journals.runtime
        super().__init__(name, queue_path, config, clock or runtime.clock, runtime, expire_to)
        self.parent, self.reader = _reader_of(name)
        self.is_reader = not self.fanout_only  # (a fanout-only parent: decided as it loads)
        self._journal: Kestrel3Journal[Kestrel3Queue] | None = None
        self._file: ReaderFile | None = None
        self._seen = 0  # the newest id handed to this reader: read-behind loads nothing newer
        self._unsaved: set[int] = set()  # consumed, not yet in the checkpoint file (a write failed)
        self._compaction: Task | None = None  # the rewrite of a checkpoint grown large (`_compact`)
        # The change in progress: the ids it consumed (written by `_commit`), and what it did, to
        # be undone if that write fails.
        self._consumed: list[int] = []
        self._left: list[QItem] = []  # items that left the head (for good, or opened)
        self._confirmed: list[QItem] = []  # open reads closed
        self._returned: list[QItem] = []  # open reads back at the head

    # -----------------------------------------------------------------------------------------
    # Figures

    @property
    def head(self) -> int:
        """Every id at or below this one is consumed by this reader."""
        return self._file.head if self._file is not None else 2**64 - 1

    @property
    def journal_size(self) -> int:
        """Bytes of this reader's checkpoint, and of the writer files it reads where it is the one
        reader that counts them (`Kestrel3Journal.counts_writer_files`: the parent): the readers
        share those files, and the sum over the queues is the bytes on disk."""
        journal = self._journal
        if journal is None:
            return 0
        own = self._file.writer.size if self._file else 0
        return own + journal.writer.total_size if journal.counts_writer_files(self) else own

    @property
    def live_journal_size(self) -> int:
        """Bytes of the writer journal's current file."""
        return self._journal.writer.size if self._journal is not None else 0

    def readers_on_disk(self) -> list[str]:
        """The fanout readers whose checkpoints were found when the writer journal was opened."""
        return [r for r in (self._journal.readers_on_disk if self._journal else []) if r]

    @property
    def checkpoint_path(self) -> str | None:
        """This reader's checkpoint file (None for a fanout-only parent, which reads nothing)."""
        return self._file.path if self._file is not None else None

    def position(self) -> ReaderPosition:
        done = len(self._file.done) if self._file is not None else 0
        return ReaderPosition(self.name, self.head, done, self.length, self.open_transactions, self.tail_id)

    @property
    def tail_id(self) -> int:
        """The newest item id written to the shared writer journal (0 before it is open)."""
        return self._journal.writer.tail_id if self._journal is not None else 0

    def journal_files(self) -> list[JournalFileFigures]:
        return self._journal.file_figures() if self._journal is not None else []

    def reader_positions(self) -> list[ReaderPosition]:
        return self._journal.positions() if self._journal is not None else []

    # -----------------------------------------------------------------------------------------
    # Start-up

    def _load_files(self, reopen: bool, files: JournalFiles | None, fresh: bool) -> None:
        """Open the writer journal and this reader's checkpoint, and load the items it has still to
        consume, oldest first (those beyond `max_memory_size` are only counted).

        Reads open at a stop are served again in any case (they were never consumed), and the files
        are listed here unless `fresh` (none exists): `reopen` and `files` are Kestrel 2's. Raises
        CorruptJournalError, ConfigError (the queue has Kestrel 2 journal files), JournalWriteError
        (a full disk: its first file could not be written, and nothing is left of it).
        """
        started = time.monotonic()
        try:
            self._journal = self._journals.journal(self.parent, self.config, fresh)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise JournalWriteError(self.name, e.filename or self.queue_path, e) from None  # nothing made
        if not self.reader:
            self._journal.parent_open = True
        self._lock = self._journal.lock
        self._gate = self._journal.gate
        if self.fanout_only:
            # Its checkpoint from before it was made fanout-only: it serves what that holds, and
            # consumes each put at once, as a full reader refuses it (`_put_shared`), so that a
            # restart without `fanout_only` serves none of the puts made meanwhile.
            self.is_reader = self._journal.found(self.reader)
        if not self.is_reader:
            return
        writer = self._journal.writer
        # A new reader starts at the tail as it stands at the gate's turn, where its checkpoint is
        # written with no yield between: one read before a wait there gave it the items a sibling
        # reader created meanwhile was put (they were never offered to it).
        self._gate.wait_turn()
        start = 0 if self.reader in self._journal.fresh else writer.tail_id
        checkpoint = ReaderFile(self.queue_path, self.parent, self.reader, self.config.sync_journal,
                                start, self._journals.runtime, self._journal.checkpoint_written,
                                self._gate,
                                self._journal.commit_log if self.config.sync_journal is not None else None)
        for info in writer.files:
            if info.last_id > checkpoint.head:
                for run in self._journal.runs(info):
                    self._load(run, checkpoint)
        if self.fanout_only and not self.length:
            self._stop_reading(checkpoint)
        else:
            self._file = checkpoint
            self._journal.attach(self)
        self._journal.loaded()
        self._seen = writer.tail_id
        if self.length:
            log.info("loaded kestrel3 reader", queue=self.name, items=self.length, bytes=self.bytes,
                     seconds=round(time.monotonic() - started, 3), read_behind=self.in_read_behind)
        self._journal.release()

    def _stop_reading(self, checkpoint: ReaderFile) -> None:
        """A fanout-only parent whose checkpoint from before holds no item keeps no reader: the
        checkpoint goes, rather than take each put's ids and hold the writer files back."""
        assert self._journal is not None
        self.is_reader = False
        checkpoint.close()
        self._journal.forget_reader(self.reader)
        self._delete_checkpoint(checkpoint)
        log.info("fanout-only queue's reader checkpoint removed: it held no item", queue=self.name,
                 file=checkpoint.path)

    def _delete_checkpoint(self, checkpoint: ReaderFile) -> None:
        """Delete this reader's closed checkpoint, unlisted first: a crash before the unlink keeps
        the reader. The manifest's write (its fsyncs) and the unlink run on the thread pool: the
        caller waits, the other queues are served."""
        if checkpoint.commit_log is not None:
            checkpoint.commit_log.checkpoint()  # no record in the log may name a reader deleted
        self.runtime.run_blocking(self._unlist_checkpoint, checkpoint.path)

    def _unlist_checkpoint(self, path: str) -> None:
        """On the thread pool: this reader's checkpoint at `path` leaves the manifest, then the disk
        (durably: `disk.remove_files`)."""
        journal = self._journal
        if journal is not None:
            journal.checkpoint_deleted(self.reader)
        disk.remove_files(os.path.dirname(path), [path])

    def _load(self, run: list[k3.PutRow], checkpoint: ReaderFile) -> None:
        """The items of `run` this reader has still to consume (by `checkpoint`), counted in at the tail."""
        for item_id, errors, add_time, expire_time, data in run:
            if not checkpoint.consumed(item_id):
                item = self._item_of(item_id, errors, add_time, expire_time, data)
                if self._append(item):
                    self._read_behind_from(self._start_read_behind(item))

    def _item_of(self, item_id: int, errors: int, add_time: int, expire_time: int | None,
                 data: bytes) -> QItem:
        """The item of a PUT as this reader holds it: its expiry capped by the reader's `max_age`."""
        return QItem(add_time, self._capped_expiry(add_time, expire_time or 0), data, item_id, errors)

    # -----------------------------------------------------------------------------------------
    # Read-behind

    def _start_read_behind(self, after: QItem | None) -> ReaderCursor:
        return ReaderCursor(self, (after.xid if after is not None else self._seen) + 1)

    def _cursor_at(self, first: QItem, count: int, before: QItem | None,
                   gate: WriteGate) -> ReaderCursor | None:
        """Read-behind from the id of `first`: every item ahead of it and every open read has a
        lower id (they were added before it), so read-back skips none of them twice. Placed by
        the ids in memory alone: nothing is read."""
        first_id = first.xid
        if before is not None and before.xid >= first_id:
            return None
        if any(item.xid >= first_id for item in self._opens.values()):
            return None
        if any(item.xid >= first_id for item in itertools.islice(self._mem, len(self._mem) - count)):
            return None
        return ReaderCursor(self, first_id)

    # -----------------------------------------------------------------------------------------
    # Adding: one write for every reader

    def _put_shared(self, items: list[bytes], expiry: int, now: int) -> int:
        """Write the items some target takes, once, and hand them to every reader: on a queue (the
        default reader) its readers are the targets, on a fanout child it alone. A target takes the
        items its limits admit (those before the first refused); a fanout child is offered what its
        parent was, and takes each on its own (src/kestrel/storage/fanout.py). The readers consume
        the rest at once. What the readers consume meanwhile left by itself (expired, discarded,
        refused): its record may wait. Returns how many this queue took. Raises JournalWriteError
        (nothing was written).
        """
        journal = self._journal
        assert journal is not None
        readers = list(journal.readers.values())
        marks = [(len(q._consumed), len(q._left)) for q in readers]
        taking: dict[str, list[tuple[int, int]]] = {}  # by reader: the (start, stop) runs of items it takes
        try:
            given = items
            if not self.fanout_only:
                taken = self._admit(items, now)[0]
                taking[self.reader] = [(0, taken)] if taken else []
                if taken < len(items) and len(readers) > 1:
                    given = fanout.offered(items, taken)
            if not self.reader:
                for q in readers:
                    if q is not self:
                        taking[q.reader] = q._admit_each(given, now)
            count = max((runs[-1][1] for runs in taking.values() if runs), default=0)
            if count:
                writer = journal.writer
                written = _journaled_expiry([q for q in readers if taking.get(q.reader)], now, expiry)
                try:
                    first = writer.append(items[:count], now, written or None)[0].id
                except OSError as e:
                    raise self._write_error(writer.current.path, e) from None
                for q in readers:
                    done = 0
                    for start, stop in taking.get(q.reader, ()):
                        q._consumed.extend(range(first + done, first + start))  # refused: consumed at once
                        run = items if stop - start == len(items) else items[start:stop]
                        q._receive(run, data_sizes(run)[0], now, expiry, first + start)
                        done = stop
                    q._consumed.extend(range(first + done, first + count))
                    q._seen = first + count - 1
        finally:
            for q, mark in zip(readers, marks, strict=True):
                q._settle_later(mark)  # no yield before: the writer journal commits first
        if count:
            journal.writer.commit()
        for q in readers:
            if count or q.reader in taking:
                q._sync_checkpoint()
            if q is not self and q.may_expire:
                q._expiry_watch(q)  # each reader's new items, outside its own change
        runs = taking.get(self.reader)
        return runs[-1][1] if runs else 0

    def _admit_each(self, items: list[bytes], now: int) -> list[tuple[int, int]]:
        """The items of its parent's put a fanout child takes, each on its own, as (start, stop) runs."""
        keep = fanout.fitting(items, self.config.max_item_size)
        if keep is None:
            taken = self._admit(items, now)[0]
            return [(0, taken)] if taken else []
        taken = self._admit([items[n] for n in keep], now)[0]
        return list(fanout.runs(keep[:taken]))

    def _settle_later(self, mark: tuple[int, int]) -> None:
        """What this reader consumed since `mark` (lengths of `_consumed` and `_left`) left by
        itself: it is not undone, and its record may wait for a later write."""
        consumed, left = mark
        if len(self._left) > left:
            del self._left[left:]
        if len(self._consumed) > consumed:
            ids = self._consumed[consumed:]
            del self._consumed[consumed:]
            self._save_later(ids)

    # -----------------------------------------------------------------------------------------
    # Records of a change

    def _log_put(self, items: list[bytes], now: int, expiry: int, first_id: int) -> None:
        """Nothing to record, the PUTs are written: read-behind may load them from now on."""
        if items:
            self._seen = first_id + len(items) - 1

    def _log_gone(self, items: list[QItem]) -> None:
        self._consumed.extend(map(_XID, items))
        self._left.extend(items)

    def _log_open(self, items: list[QItem]) -> None:
        self._left.extend(items)  # an open read's id is its item's

    def _log_confirm(self, items: list[QItem]) -> None:
        self._consumed.extend(map(_XID, items))
        self._confirmed.extend(items)

    def _log_return(self, items: list[QItem]) -> None:
        self._returned.extend(items)

    def _drop_items(self) -> None:
        """Consume every item with one checkpoint rewrite (open reads stay open).

        Raises JournalWriteError (nothing was dropped).
        """
        assert self._journal is not None
        if self._file is not None:
            tail = max(self._journal.writer.tail_id, self._file.head)
            head = min(self._opens, default=tail + 1) - 1
            head = max(head, self._file.head)
            ids: Iterable[int] = range(head + 1, tail + 1)
            if tail - head > SPARSE_IDS * (self.length + len(self._opens) + len(self._file.done)) + 1024:
                # More ids than items: the range skips (an id damaged high made one of 2**62 ids
                # and the set grew until memory ran out). The files say which ids they hold.
                log.warning("the queue's ids skip; the ids of its items read from its files", queue=self.name,
                            head=head, tail=tail, items=self.length)
                ids = ids_held(self._journal.writer.files, head, tail)
            done = {i for i in ids if i not in self._opens}
            try:
                self._file.replace(head, done)
            except OSError as e:
                raise self._write_error(self._file.path, e) from None
            self._unsaved.clear()
            self._journal.release()
        self._forget_items()

    def _commit(self, housekeeping: bool = False) -> None:
        """Write the ids the change consumed (raises JournalWriteError, and the change is undone;
        for housekeeping they wait instead), then wait as the sync policy says.

        What the change noted for an undo is its own while it waits: another change of this reader
        goes on meanwhile with lists of its own, so that one whose write fails undoes only itself
        (undoing this one too put its items back at the head as it handed them out, its ids on
        disk). If the wait fails, this change's notes come back, first, for its undo."""
        ids = self._consumed
        if ids:
            self._consumed = []
            if housekeeping:
                self._save_later(ids)
            else:
                self._save(ids)
        notes = self._set_aside()
        if notes is None:
            self._sync_checkpoint()
            return
        try:
            self._sync_checkpoint()
        except BaseException:
            self._take_back(notes)
            raise

    def _set_aside(self) -> _Notes | None:
        """The change's consumed ids not yet written and what it noted for an undo, the lists
        started afresh for the reader's other changes (None: nothing noted)."""
        notes = self._consumed, self._left, self._confirmed, self._returned
        if not any(notes):
            return None
        self._consumed, self._left, self._confirmed, self._returned = [], [], [], []
        return notes

    def _take_back(self, notes: object) -> None:
        if notes is not None:
            consumed, left, confirmed, returned = cast(_Notes, notes)
            self._consumed[:0], self._left[:0] = consumed, left
            self._confirmed[:0], self._returned[:0] = confirmed, returned

    def _save(self, ids: list[int]) -> None:
        """Append consumed ids (with any a failed write left over) to the checkpoint, without
        waiting for the sync policy. Raises JournalWriteError: nothing new is recorded."""
        if self._file is None or not ids:
            return  # what a failed write left over waits for the next write
        try:
            moved = self._file.save([*self._unsaved, *ids])
        except OSError as e:
            raise self._write_error(self._file.path, e) from None
        self._unsaved.clear()
        if moved and self._journal is not None:
            self._journal.release()

    def _save_later(self, ids: list[int]) -> None:
        """Consumed ids whose record may wait: on a failed write they are kept for the next one
        (a crash before it serves them again: a duplicate, never a loss)."""
        try:
            self._save(ids)
        except JournalWriteError as e:
            self._own_failure = None  # this change goes on: the ids wait
            self._unsaved.update(ids)
            log_later(self.runtime, log.error, "cannot write a reader checkpoint; consumed ids kept for the "
                      "next write", queue=self.name, error=str(e))

    def _sync_checkpoint(self) -> None:
        """Wait as the sync policy says for what this reader's checkpoint was given; one grown large
        is rewritten after the change, in a change of its own (`_compact`)."""
        file = self._file
        if file is not None and not self.closed:
            if file.grown and self._compaction is None:
                self._compaction = self.runtime.spawn(self._compact)
            file.commit()

    def _compact(self) -> None:
        """Rewrite this reader's checkpoint grown large, off the loop while the readers of the writer
        journal wait at its gate (`ReaderFile.replace`): not in the change that grew it, which may be
        one answered without yielding. A write that fails leaves the file as it was, and the queue
        read-only until a probe succeeds, as any change's (logged there); the next change tries again.
        A close waits for it (`wait_for_packing`): nothing holds a deleted queue after its delete."""
        try:
            with self:
                file = self._file
                if file is not None and file.grown:
                    file.replace(file.head, file.done)
        except (JournalWriteError, QueueClosed):
            pass  # closed meanwhile, or the failure is logged and counted by the change
        finally:
            self._compaction = None

    def sync_head(self) -> None:
        """Return once what this reader's checkpoint was given is on disk as the sync policy requires
        (closed, it was fsynced). Raises OSError."""
        if self._file is not None and not self.closed:
            self._file.commit()

    # -----------------------------------------------------------------------------------------
    # Around each change (a failed write: the queue policy's, src/kestrel/storage/queue.py)

    def _prepare_change(self) -> None:
        """Nothing to open: the files are open from the start."""

    def _after_change(self) -> None:
        if self._left:
            self._left.clear()
        if self._confirmed:
            self._confirmed.clear()
        if self._returned:
            self._returned.clear()

    def _commit_logged(self) -> bool:
        """A change commits the writer journal and this reader's checkpoint: both log, if each was
        opened under a sync policy with the log on, and neither falls back on its own fsync."""
        journal, file = self._journal, self._file
        return (journal is not None and journal.commit_log is not None and not journal.writer.falls_back()
                and file is not None and file.commit_log is not None and not file.writer.falls_back())

    def _journal_path(self) -> str:
        if self._file is not None:
            return self._file.path
        return self._journal.writer.current.path if self._journal is not None else self.queue_path

    def _write_probe(self) -> None:
        """A READ_HEAD of the head as it stands changes nothing (the last, highest, head wins)."""
        if self._file is not None:
            self._file.writer.append(k3.encode(k3.ReadHead(self._file.head)))

    def _restore(self) -> None:
        """Undo the change in memory from what it noted: items back at the head, reads open again;
        its consumed ids are dropped."""
        opens = self._opens
        for item in reversed(self._returned):
            self._take_head(opened=True)
            opens[item.xid] = item
            self._ledger.total += len(item.data)
        for item in self._confirmed:
            opens[item.xid] = item
            self._ledger.total += len(item.data)
        for item in reversed(self._left):
            if opens.get(item.xid) is item:
                del opens[item.xid]
            else:  # it had left memory for good
                self._ledger.total += len(item.data)
            self._push_head(item)
        self._consumed.clear()
        self._abandon()

    def _abandon(self) -> None:
        """The change's consumed ids wait for the next write; what it noted for an undo is dropped."""
        self._left.clear()
        self._confirmed.clear()
        self._returned.clear()

    # -----------------------------------------------------------------------------------------
    # Settings and shutting down

    def wait_for_packing(self) -> None:
        """Kestrel 3 journals are never packed (their files are deleted): wait until this reader's
        checkpoint rewrite under way has ended, the files every reader has passed are deleted and
        every rotated writer file is in the manifest."""
        if (compaction := self._compaction) is not None:
            compaction.join()
        if self._journal is not None:
            self._journal.wait_for_release()
            self._journal.writer.wait_for_sealing()

    def reconfigure(self, config: QueueConfig) -> None:
        """New settings from a reload (whether a parent is fanout-only is fixed at creation)."""
        self.config = self.keeping_fixed(config)
        self._memory_ceiling_changed()
        if self._journal is not None and not self.reader:
            self._journal.writer.reconfigure(config.default_journal_size, config.sync_journal)
        if self._file is not None:
            self._file.writer.set_sync(config.sync_journal)

    def _close_files(self) -> None:
        """Close this reader's files (the writer journal closes with its last reader). Their final
        fsyncs run side by side, each making durable what is written already: this reader's
        checkpoint, and with the last reader the newest writer file and the manifest's drop of
        deleted files (`Kestrel3Journal.last_syncs`). No order among them changes what a power cut
        may leave (the kernel writes their pages back in whatever order it likes: a checkpoint's
        records may reach the disk before the PUTs they consume, whichever is fsynced first), and
        in turn a stop on a slow disk waited for one after another. One that fails leaves every
        file open (the commit log kept for recovery) and raises, as a close that failed did."""
        syncs = [self._file.writer.flush] if self._file is not None else []
        if self._journal is not None:
            syncs += self._journal.last_syncs(self)
        all_side_by_side(self.runtime, syncs)
        if self._file is not None:
            self._file.close()
        if self._journal is not None:
            if not self.reader:
                self._journal.parent_open = False
            self._journal.detach(self)

    def destroy(self) -> list[str]:
        """Close and delete this reader's checkpoint, and the writer files once no reader is left
        (found by listing the queue path: then the queue owns no file)."""
        journal = self._journal
        self.close()
        if self._file is not None and os.path.exists(self._file.path):
            self._delete_checkpoint(self._file)
        if journal is not None:
            journal.reader_deleted(self.reader)
        if journal is not None and journal.unread:
            journal.destroy()
            return [self.name, self.parent]
        return [self.name] if self.reader else []  # a reader's name owns no file; its parent's do


class ReaderCursor(FileCursor[RecordReader]):
    """A reader's read-behind cursor (src/kestrel/storage/read_behind.py): its items read back from
    the writer files from id `start` on, skipping those it consumed; an item of `LARGE_APPEND`
    bytes or more read off the loop while every reader of the writer journal waits at its gate
    (`RecordReader`)."""

    def __init__(self, queue: Kestrel3Queue, start: int) -> None:
        super().__init__(0)  # `at`: where in file `file` a released reader stopped (0: none was)
        self.queue = queue
        self.next_id = start  # the lowest id not yet read back
        self.file = 0  # number of the writer file `reader` reads, or read until released

    def open(self) -> RecordReader | None:
        """The reader of the writer file holding `next_id`, opened if it is not (where `release`
        left it, in that file); None while no file holds it. Raises OSError."""
        reader = self.reader
        if reader is None:
            journal = self.queue._journal
            assert journal is not None
            info = next((f for f in journal.writer.files if f.last_id >= self.next_id), None)
            if info is None:
                return None
            at = self.at if self.at and info.number == self.file else k3.MAGIC_SIZE
            reader = self.reader = RecordReader(info.path, k3.FileKind.WRITER, self.queue._gate, at)
            reader.chunk = CURSOR_CHUNK
            self.file = info.number
        return reader

    def sync(self) -> None:
        """Nothing to do: the writer appends every PUT at once."""

    def opening_reads(self) -> bool:
        return self.reader is None  # a writer file's reader checks the file's header as it opens

    def next_item(self, now: int) -> QItem | None:
        """The next item of the reader, or None once every item handed to it is in memory."""
        queue = self.queue
        checkpoint = queue._file
        assert checkpoint is not None
        while self.next_id <= queue._seen:
            record = self._next_record()
            if record is None or record.id > queue._seen:  # past it: a put is handing it out
                return None
            self.next_id = record.id + 1
            if not checkpoint.consumed(record.id) and record.id not in queue._unsaved:
                return queue._item_of(record.id, record.error_count, record.add_time, record.expire_time,
                                      record.data)
        return None

    def _next_record(self) -> k3.Put | None:
        """The next PUT at or after `next_id` (the file reader opened, or moved to the next file)."""
        journal = self.queue._journal
        assert journal is not None
        files = journal.writer.files
        while True:
            reader = self.open()
            if reader is None:
                return None
            entry = reader.next(self.next_id)
            if entry is None:
                if self.file == files[-1].number:
                    reader.grow()
                    entry = reader.next(self.next_id)
                    if entry is None:
                        return None
                else:
                    self.close()
                    continue
            record = entry[1]
            assert isinstance(record, k3.Put)
            if record.id >= self.next_id:
                return record


def _journaled_expiry(takers: list[Kestrel3Queue], now: int, expiry: int) -> int:
    """The expiry a PUT record carries: the put's, capped by `max_age` too where every reader taking
    the items has one (by the largest: each reader caps by its own as it reads the record), so that
    a `max_age` raised later, by a reload or a restart, lengthens no cap already given, as a Kestrel
    2 journal's ADD keeps its capped expiry."""
    ages = [q.config.max_age for q in takers]
    if not ages or not all(ages):
        return expiry
    return capped_expiry(now, expiry, max(age for age in ages if age))
