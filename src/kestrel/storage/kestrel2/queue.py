"""Kestrel2Queue: a queue kept in Kestrel 2's journal, one record per change.

The queue's rules are `src/kestrel/storage/queue.py`'s; this is how the format keeps them. Every change is
applied in memory first and its records are written to the journal as one append, before anything
can yield; only then does the caller wait for the sync policy. So the journal's order is always the
order in which the changes happened, and replaying it (through `replay.py`'s rules) rebuilds the
queue exactly, xids included (a REMOVE_TENTATIVE takes the next free xid, as it did live). A write
that fails makes the queue read-only and brings its memory back to what the journal holds. The
journal's files, rotation and packs are `journal.py`'s.

Read-behind: once the queue holds `max_memory_size` bytes, new items are only counted and written
to the journal; a cursor (`read_behind.py`) reads them back as the head drains, and each rotation
meanwhile takes a checkpoint (`checkpoints.py`) so that the backlog's files are packed as it drains.
"""

from __future__ import annotations

import contextlib
import errno
import time
from array import array
from collections.abc import Callable, Sequence
from typing import ClassVar, Final

import structlog

from kestrel.storage.clock import Clock
from kestrel.storage.commit_log import CommitLog
from kestrel.storage.config import QueueConfig
from kestrel.storage.deferred_log import log_later
from kestrel.storage.errors import JournalWriteError, QueueClosed
from kestrel.storage.item import QItem, data_sizes
from kestrel.storage.journal_file import CURSOR_CHUNK, check_writable
from kestrel.storage.kestrel2 import codec, packer
from kestrel.storage.kestrel2.checkpoints import RotationCheckpoint
from kestrel.storage.kestrel2.journal import QueueJournal
from kestrel.storage.kestrel2.read_behind import LIVE, JournalCursor
from kestrel.storage.kestrel2.reader import JournalReader
from kestrel.storage.kestrel2.replay import ADDS, QueueReplay, next_free_xid
from kestrel.storage.queue import PersistentQueue
from kestrel.storage.queue_path import JournalFileFigures, JournalFiles, list_journal_files
from kestrel.storage.runtime import DEFAULT_RUNTIME, GeventRuntime, Runtime
from kestrel.storage.write_gate import WriteGate

log = structlog.get_logger("kestrel.queue")

# A queue that empties with its live journal past `default_journal_size` packs at once only while it
# holds at most this many open reads: the pack writes every open read's item again, and a batch
# held open until its consumer commits (a Spark stream's, tens of thousands) is closed soon after,
# when the confirm that closes it takes a pack of almost nothing. Past `max_journal_size` a queue
# packs whatever it holds open.
EMPTY_PACK_OPEN_READS: Final = 1000

# A put with an item of this many bytes or more is written with its items where they are (one
# gathering write of headers and items) instead of copied into one string of records: copying a
# small item costs less than a piece of the write.
WRITTEN_WHERE_THEY_ARE: Final = 512

# Called by every put, bound once: a name imported from a module the build leaves interpreted
# (`storage.item`) is looked up in this module's dictionary each call; a `Final` one is a C static.
_data_sizes: Final = data_sizes


class Kestrel2Queue(PersistentQueue):
    """A queue journaled in Kestrel 2's format.

    Parameters: those of `PersistentQueue`, and `salvage` (load what precedes a corrupt record
    instead of refusing to load); `commit_log`, the server's (`src/kestrel/storage/commit_log.py`), if it
    keeps one; `runtime` is gevent's unless given (see `src/kestrel/storage/runtime.py`) and
    `clock` the runtime's unless given.
    """

    _placeholder_expiry: ClassVar[int] = codec.PLACEHOLDER_EXPIRY
    journal_format: ClassVar[int] = 2
    undo_waits_in_read_behind: ClassVar[bool] = True  # `_rebuild` waits for packs, then refills
    fixed_settings: ClassVar[tuple[str, ...]] = (*PersistentQueue.fixed_settings, "keep_journal")

    # What every change reads, laid out together after the fields of `PersistentQueue` (as its own
    # are, for the same reason).
    _journal: QueueJournal
    _rb: JournalCursor | None
    _orphans: Sequence[int]
    _rebuilding: bool
    _left_read_behind: bool

    def __init__(self, name: str, queue_path: str, config: QueueConfig, clock: Clock | None = None,
                 expire_to: Callable[[str], PersistentQueue | None] | None = None,
                 salvage: bool = False, runtime: Runtime | None = None,
                 commit_log: CommitLog | None = None) -> None:
        if runtime is None:
            runtime = DEFAULT_RUNTIME if clock is None else GeventRuntime(clock)
        super().__init__(name, queue_path, config, clock if clock is not None else runtime.clock, runtime,
                         expire_to)
        self._reads_behind = config.keep_journal  # fixed at creation (`reconfigure`)
        self._journal = QueueJournal(queue_path, name, config.sync_journal, _rotate_at(config), runtime,
                                     self._lock, salvage, commit_log, self._gate)
        self._xid = 0
        self._rb: JournalCursor | None = None  # the read-behind cursor
        # Oldest first, one per rotation in read-behind; told of each departure (changed in place).
        self._checkpoints: list[RotationCheckpoint] = []
        self._watchers = self._checkpoints
        self._rebuilding = False
        self._left_read_behind = False  # the cursor caught up: pack the backlog's leftovers away
        self._pack_horizon = 0  # the latest rotation packed with every item in memory
        # Reads open at start-up, not yet journaled back to the head (a tuple when none: each change
        # looks, and an empty one shared by every queue costs no look at memory of this queue's).
        self._orphans: Sequence[int] = ()

    @property
    def journal_size(self) -> int:
        return self._journal.size

    @property
    def live_journal_size(self) -> int:
        return self._journal.writer.size if self._journal.writer is not None else 0

    def journal_files(self) -> list[JournalFileFigures]:
        return self._journal.file_figures()

    # -----------------------------------------------------------------------------------------
    # Start-up: replay

    def _load_files(self, reopen: bool, files: JournalFiles | None, fresh: bool) -> None:
        """Replay the journal files (if the queue keeps a journal) and open the live one.

        `files` is this queue's share of one scan of the queue path (start-up); without it the
        path is scanned for this queue alone and its temporaries are removed (unless `fresh`: the
        collection knows the path holds no file of it, so creating a queue reads no directory).
        Reads that were open
        go back to the head unless `reopen` is False (inspection tools). A fanout-only parent keeps
        no journal, but for the one it kept before it was made fanout-only: its items are served
        until drained, and their removes journaled (no put is stored in it: `put`).
        """
        if not self.config.keep_journal:
            if files is not None and (files.live or files.rotated or files.packs):
                # Not erased, as Kestrel's would be: an operator's mistake costs no item.
                log.warning("queue keeps no journal (keep_journal: false), and its journal files on "
                            "disk are neither read nor removed: their items are served again once "
                            "a restart sets keep_journal", queue=self.name,
                            files=len(files.rotated) + len(files.packs) + (files.live is not None))
            return
        if fresh:
            files = JournalFiles()  # the queue path holds no file of it: nothing to look for
        elif files is None:
            files = self._journal.scan()
        if self.fanout_only and not (files.live or files.rotated or files.packs):
            return
        if files.live is not None:
            check_writable(files.live)  # the file appended to (rotated ones are only read)
        started = time.monotonic()
        replayed = self._replay(files, repair=True)
        self._journal.open_live()
        if files.live is None:
            assert self._journal.writer is not None
            self._journal.writer.create()
        if replayed:
            log.info("replayed journal", queue=self.name, items=self.length, bytes=self.bytes,
                     open_reads=len(self._opens), journal_bytes=replayed,
                     seconds=round(time.monotonic() - started, 3), read_behind=self._rb is not None)
        self._journal.keep_taken_pack()  # the replayed cursor passed a checkpoint
        self._journal.start_next_pack()
        if self._opens and reopen:
            self._orphans = sorted(self._opens, reverse=True)
            try:
                self._return_orphans()
            except OSError as e:  # read-only: they go back to the head once the journal can be written
                with contextlib.suppress(JournalWriteError):
                    self._change_failed(e)

    def _return_orphans(self) -> None:
        """Reads that were open when the process stopped go back to the head, newest first, so
        that the oldest is fetched first. They are journaled as UNREMOVEs, as Kestrel does."""
        returned = []
        for xid in self._orphans:
            item = self._opens.get(xid)
            if item is not None:
                self._unremove(xid)
                returned.append(item)
        self._log_return(returned)
        self._commit()
        self._orphans = ()

    def _replay(self, files: JournalFiles, repair: bool) -> int:
        """Rebuild the queue from its journal files (`QueueJournal.replay`); the bytes replayed."""
        with self._recounted():
            replayed = self._journal.replay(files, repair, _QueueReplay(self))
        if self._rb is not None:
            self._rb.stop = None  # the whole journal is applied: the cursor may read to its end
        return replayed

    def _next_xid(self) -> int:
        """Take the next free xid, as Kestrel counts them: the one after the last, unless that
        wraps or is open (`next_free_xid`, which runs interpreted, finds it then)."""
        xid = self._xid + 1
        if not 0 < xid < 2**31 or xid in self._opens:
            xid = next_free_xid(self._xid, self._opens)
        self._xid = xid
        return xid

    # -----------------------------------------------------------------------------------------
    # Read-behind

    def _open_cursor(self, key: int, offset: int, stop: tuple[int, int] | None) -> JournalCursor:
        """A cursor reading items back from file `key` at `offset`."""
        self._rb = JournalCursor(self._journal.files, key, offset, self._cursor_left,
                                 self._journal.flush, self._gate)
        self._rb.stop = stop
        return self._rb

    def _start_read_behind(self, after: QItem | None) -> JournalCursor:
        """Read-behind starts after the last record journaled (`after`'s, if given)."""
        writer = self._journal.writer
        assert writer is not None
        self._journal.flush()
        return self._open_cursor(LIVE, writer.size, None)

    def _read_behind_ended(self) -> None:
        if self._rb is not None:
            self._left_read_behind = self._rb.stop is None  # caught up with the live journal
            self._rb = None

    def _cursor_at(self, first: QItem, count: int, before: QItem | None,
                   gate: WriteGate) -> JournalCursor | None:
        """Read-behind from the ADD record of `first`: the tail it starts is the newest `count` adds
        held (all of them, or those before the cursor in read-behind), so their records are the last
        `count` adds before the journal's end or the cursor, found by reading the files there
        forward, through `gate` (what the page cache does not hold off the loop, or inside a put
        not at all: `shed`). Not while a pack may replace those files.

        Bounded: the records are read through the compiled decoder a buffer at a time, and only the
        offsets of the last `count` adds of a file are kept (8 bytes each, in an `array`, with 64 K
        spare), so paging out holds at most 8 bytes per item it frees, 512 KB and one read buffer
        besides (docs/memory.md)."""
        journal = self._journal
        if journal.writer is None or journal.pack_pending or self._rebuilding:
            return None
        journal.flush()
        end = (self._rb.key, self._rb.offset) if self._rb is not None else (LIVE, 2**63)
        have = 0
        for key, path in reversed(journal.files()):
            if key > end[0] or (key == LIVE and journal.writer.size == 0):
                continue  # past the cursor, or a live journal just rotated to (no file until written)
            offsets = _last_add_offsets(path, count - have, end[1] if key == end[0] else 2**63, gate)
            have += len(offsets)
            if have >= count:
                break
        else:
            return None
        offset = offsets[0]  # the oldest file read holds the first of the tail
        reader = JournalReader(path, offset, gate=gate)
        reader.chunk = CURSOR_CHUNK  # a read of the page cache, not a megabyte that reads the disk
        try:
            entry = reader.next()
        finally:
            reader.close()
        if entry is None or not isinstance(entry[1], ADDS) or entry[1].data != first.data:
            log_later(self.runtime, log.warning, "cannot page out: the journal does not end with the items "
                      "in memory", queue=self.name)
            return None
        return self._open_cursor(key, offset, None)  # the queue closes the one open now

    def _cursor_left(self, passed: int) -> None:
        """The read-behind cursor has read the whole of file `passed`: every item queued at a
        checkpoint up to it is in memory now."""
        passed_checkpoints = [cp for cp in self._checkpoints if cp.timestamp <= passed]
        if passed_checkpoints:
            # The state at the latest checkpoint passed is taken now; it is written once the change
            # in progress is journaled (`_after_change`), and dropped if that change fails.
            del self._checkpoints[:len(passed_checkpoints)]
            self._journal.take_pack(self._take_pack(passed_checkpoints[-1]))

    # -----------------------------------------------------------------------------------------
    # Records of a change

    def _log_put(self, items: list[bytes], now: int, expiry: int, first_id: int) -> None:
        if self._journal.writer is None:
            return
        if _data_sizes(items)[1] >= WRITTEN_WHERE_THEY_ARE:  # the largest, in one call: no Python per item
            self._journal.write_parts(codec.addx_parts(now, expiry, items))
        else:
            self._journal.write(codec.encode_addx_many(now, expiry, items))

    def _log_gone(self, items: list[QItem]) -> None:
        self._journal.write(codec.REMOVE_BYTES * len(items))

    def _log_open(self, items: list[QItem]) -> None:
        xids = []
        for item in items:
            item.xid = xid = self._next_xid()
            xids.append(xid)
        self._journal.write(codec.encode_xids(codec.REMOVE_TENTATIVE_XID, xids))

    def _log_confirm(self, items: list[QItem]) -> None:
        for checkpoint in self._checkpoints:
            for item in items:
                checkpoint.note_confirm(item)
        self._journal.write(codec.encode_xids(codec.CONFIRM_REMOVE, [item.xid for item in items]))

    def _log_return(self, items: list[QItem]) -> None:
        self._journal.write(codec.encode_xids(codec.UNREMOVE, [item.xid for item in items]))
        for item in items:
            item.xid = 0  # its next open takes the next free xid

    def _drop_items(self) -> None:
        """Every item leaves the head, journaled as one REMOVE each."""
        removed = 0
        while self._take_head() is not None:
            removed += 1
        self._journal.write(codec.REMOVE_BYTES * removed)

    def _commit(self, housekeeping: bool = False) -> None:
        """Append, wait as the sync policy says, then consider rotating. Last step of each change."""
        journal = self._journal
        journal.flush()
        if journal.sync():
            self._maybe_rotate()

    # -----------------------------------------------------------------------------------------
    # Around each change (a failed write: the queue policy's, src/kestrel/storage/queue.py)

    def _prepare_change(self) -> None:
        """Open the live journal if it is not (raises JournalWriteError: nothing changed, the next
        change tries again), and journal the reads open at start-up back to the head."""
        journal = self._journal
        if self._rebuilding:
            raise JournalWriteError(self.name, journal.live_path, None)
        if journal.writer is not None and journal.writer.fd < 0:
            try:
                journal.writer.open()
            except OSError as e:  # nothing changed yet: this change is refused
                failure = JournalWriteError(self.name, journal.live_path, e)
                if e.errno not in (errno.EMFILE, errno.ENFILE):  # out of descriptors: this change alone
                    self.journal_write_errors += 1
                    self._went_read_only(journal.live_path, failure)  # the next change probes
                raise failure from None
        if self._orphans:
            try:
                self._return_orphans()
            except (OSError, JournalWriteError) as failed:
                self._change_failed(failed)
                raise

    def _after_change(self) -> None:
        """Schedule what packing the change made possible. The pack of what the backlog left
        behind waits for a change ending while no other is half made (`_maybe_rotate`): its
        rotation wrote that one's pending records (a get handing an expired item over, the item's
        REMOVE before `expire_to_queue` had it: lost, should that queue refuse it)."""
        journal = self._journal
        if journal.pack_ready is None and journal.pack_queued is None and not self._left_read_behind:
            return  # the common change: no pack to schedule
        journal.keep_taken_pack()
        if self._left_read_behind and self._gate.busy is None:
            self._left_read_behind = False
            # Unless the change read behind again after catching up (its later adds filled memory
            # again): then items are on disk only, a pack of memory would drop them, and the new
            # spell's rotation checkpoints pack the files as it drains.
            if self._rb is None:
                self._checkpoints.clear()  # every one was passed on the way to the live journal
                rotated = journal.rotated
                if rotated and rotated[-1][0] > self._pack_horizon and journal.writer is not None:
                    self._pack_now()  # what the backlog left behind: at most max_memory_size of items
        journal.start_next_pack()

    def _commit_logged(self) -> bool:
        """The journal logs to the commit log if it was made under a sync policy with the log on,
        and does not fall back on its own fsync."""
        journal = self._journal
        writer = journal.writer
        return journal.commit_log is not None and (writer is None or not writer.falls_back())

    def _journal_path(self) -> str:
        return self._journal.live_path if self._journal.writer is not None else self.queue_path

    def _write_probe(self) -> None:
        """A SAVE_XID of the xid counter as it stands changes nothing."""
        if self._rebuilding:
            raise JournalWriteError(self.name, self._journal.live_path, None)
        self._journal.append_now(codec.encode_xid(codec.SAVE_XID, self._xid))

    def _restore(self) -> None:
        self._rebuild()

    def _abandon(self) -> None:
        """Nothing noted: the records of a change are written at its end, in one append."""

    def _rebuild(self) -> None:
        """Replay the journal into a fresh memory state: it is the truth once a write has failed.

        The writer cut the failed append off, so the journal holds exactly the changes that were
        acknowledged or are being acknowledged. Open reads keep their xids. Not while another
        change is half made (handing items to another queue, its records pending: `WriteGate`):
        its memory would be rebuilt under it, the items it handed over back at the head; the
        rebuild waits its turn, and then the journal holds that change too.
        """
        self._gate.wait_turn()
        self._rebuilding = True
        try:
            self._journal.wait_for_packing()
            files = list_journal_files(self.queue_path, self.name)
            self._journal.discard_pending()
            self._reset_memory()
            self._replay(files, repair=False)
        finally:
            self._rebuilding = False

    def _reset_memory(self) -> None:
        """Forget every item, open read and xid, ready for a replay from the first journal file."""
        self._forget_items()
        self._checkpoints.clear()
        self._journal.forget_packs()
        self._left_read_behind = False
        self._pack_horizon = 0
        self._ledger.total -= self._open_bytes()
        self._opens.clear()
        self._xid = 0

    # -----------------------------------------------------------------------------------------
    # Rotation and packing

    def _maybe_rotate(self) -> None:
        """Rotate (and pack) where the live journal is due. Not while its gate is held: a change
        that went on after its fsync would otherwise rotate while another change's append waits off
        the loop half made (or its hand-over of items to another queue), its records pending
        (written a second time by the rotation's flush, the file then refused at the next start as
        grown past its manifest entry) and its items in the state the rotation takes for a pack; a
        later change rotates."""
        journal = self._journal
        writer = journal.writer
        if writer is None or journal.pack_pending or self._gate.busy is not None:
            return
        cfg = self.config
        if (self.length == 0 and len(self._opens) <= EMPTY_PACK_OPEN_READS and not self._checkpoints
                and writer.size >= cfg.default_journal_size):
            self._pack_now()
            journal.start_next_pack()
        elif writer.size >= cfg.max_memory_size:
            if self._rb is not None:
                self._rotate(checkpoint=True)
            elif journal.size > cfg.max_journal_size:
                self._pack_now()
                journal.start_next_pack()
            else:
                self._rotate(checkpoint=False)

    def _rotate(self, checkpoint: bool, packed: bool = False) -> bool:
        """Rotate the live journal; with `checkpoint`, note the state at the rotation for a pack
        (`packed`: one taken at once, which replaces the rotated file). Whether it rotated.

        A rotation comes after the change that made it due is journaled: one that fails (a disk
        error; nothing is changed then) fails no change, which would otherwise be undone in memory
        only, its records kept (a remove's items gone, never handed out). The live journal grows
        on, and a later change that finds it due tries again."""
        try:
            stamp = self._journal.rotate(packed, self._manifest_written)
        except OSError as e:
            log_later(self.runtime, log.error, "cannot rotate the journal; a later change tries again",
                      queue=self.name, file=self._journal.live_path, error=str(e))
            return False
        if stamp is None:  # not yet: its first manifest is being written (`_manifest_written`)
            return False
        if self._rb is not None:
            self._rb.live_rotated(stamp)
        if checkpoint:
            self._checkpoints.append(RotationCheckpoint(stamp, self._xid, list(self._opens.items())))
        return True

    def _manifest_written(self) -> None:
        """The journal refused a rotation while its first manifest was written ahead, and that
        write has ended (`QueueJournal.rotate`): the queue decides again now, as at the end of a
        change (`_maybe_rotate`), in a change of its own that writes nothing else. A queue that
        emptied past `default_journal_size` meanwhile rotates and packs then, where it waited for a
        later change, which an idle queue may never see, and kept its whole live journal.

        As a change, it waits its turn at the gate (and the lock) and is refused by a closed queue
        or one being rebuilt; `_maybe_rotate` then leaves what a change would leave to a later one.
        A read-only queue, or one whose close is under way, is left as it is: a later change probes
        first, and a close rotates nothing."""
        if self.closed or self.closing or self.read_only:
            return
        try:
            with self:
                if not self.closing:
                    self._maybe_rotate()
        except (QueueClosed, JournalWriteError):
            return  # closed, or being rebuilt, meanwhile: a later change decides

    def _pack_now(self) -> None:
        """Rotate and queue a pack of the state now: every item is in memory (not in read-behind)."""
        if not self._rotate(checkpoint=True, packed=True):
            return
        self._pack_horizon = self._journal.rotated[-1][0]
        self._journal.queue_pack(self._take_pack(self._checkpoints.pop()))

    def _take_pack(self, checkpoint: RotationCheckpoint) -> packer.PackRequest:
        """The checkpoint's state as a pack to write (every item queued then is in memory now)."""
        return checkpoint.pack_request(self.queue_path, self.name, list(self._mem), self.clock.now_ms())

    def wait_for_packing(self) -> None:
        """Return once every pack taken so far is written (or has failed) and every rotated
        journal is in the manifest."""
        self._journal.wait_for_packing()

    # -----------------------------------------------------------------------------------------
    # Settings and shutting down

    def reconfigure(self, config: QueueConfig) -> None:
        """New settings from a reload. Whether the queue keeps a journal, and whether it is
        fanout-only (which decides that for a parent), are fixed at creation."""
        self.config = self.keeping_fixed(config)
        self._memory_ceiling_changed()
        self._journal.set_sync(config.sync_journal, _rotate_at(config))

    def _close_files(self) -> None:
        self._journal.close()

    def destroy(self) -> list[str]:
        """Close and delete every journal file of this queue (the `delete` command), found by
        listing the queue path: none is left."""
        self.close()
        self._journal.delete_files()
        return [self.name]


def _last_add_offsets(path: str, keep: int, stop: int, gate: WriteGate) -> array[int]:
    """The offsets of the last `keep` (at most) ADD records of file `path` before offset `stop`,
    read through `gate` (`BufferedFile.fill_at`)."""
    offsets: array[int] = array("q")
    reader = JournalReader(path, gate=gate)
    reader.chunk = CURSOR_CHUNK  # no megabyte buffers for the allocator to keep
    try:
        while True:
            count, ops, at = reader.common_columns(2**62)[:3]
            if count:
                runs = zip(memoryview(ops).cast("b"), memoryview(at).cast("q"), strict=True)
                offsets.extend(o for op, o in runs if op in _ADD_OPS and o < stop)
            else:
                entry = reader.next()
                if entry is None or entry[0] >= stop:
                    break
                if isinstance(entry[1], ADDS):
                    offsets.append(entry[0])
            if len(offsets) > keep + _SPARE_OFFSETS:
                del offsets[:-keep]
    finally:
        reader.close()
    del offsets[:max(len(offsets) - keep, 0)]  # in place: a slice would copy them
    return offsets


_ADD_OPS = (codec.ADDX, codec.ADD_XID)
_ANY_SIZE = 2**62  # no limit to the adds of a run in read-behind: they are only counted
_SPARE_OFFSETS = 1 << 16  # offsets kept beyond those wanted before the older ones are dropped


def _rotate_at(config: QueueConfig) -> int:
    """The live journal's size from which a change considers rotating it."""
    return min(config.default_journal_size, config.max_memory_size)


class _QueueReplay(QueueReplay):
    """The replay rules (`replay.py`) applied to a live queue: its figures, read-behind and
    checkpoints kept as the records are applied; runs of common records take the fast path."""

    def __init__(self, queue: Kestrel2Queue) -> None:  # the state is the queue's own: no super()
        self.queue = queue
        self.items = queue._mem
        self.opens = queue._opens
        self.anomalies = {}
        self.key = LIVE
        self.path = ""
        self.reader: JournalReader | None = None

    @property
    def xid(self) -> int:
        return self.queue._xid

    @xid.setter
    def xid(self, value: int) -> None:
        self.queue._xid = value

    def append(self, item: QItem, end: int | None = None) -> None:
        """The item joins the tail; if it fills memory, read-behind starts after its record, which
        ends at `end` (at the reader's offset unless given)."""
        queue = self.queue
        if queue._append(item):
            assert self.reader is not None
            offset = self.reader.offset if end is None else end
            queue._read_behind_from(queue._open_cursor(self.key, offset, (self.key, offset)))

    def take_head(self, opened: bool) -> QItem | None:
        return self.queue._take_head(opened)

    def put_back(self, xid: int) -> bool:
        item = self.opens.get(xid)
        if item is None:
            return False
        self.queue._unremove(xid)
        item.xid = 0  # a REMOVE_TENTATIVE without an xid takes the next free one
        return True

    def grow(self, count: int, size: int) -> None:
        queue = self.queue
        queue.length += count
        queue.bytes += size
        queue.memory_bytes += size

    def replay_file(self, key: int, path: str, reader: JournalReader) -> None:
        queue = self.queue
        self.key, self.path, self.reader = key, path, reader
        self.anomalies = {}
        now = queue.clock.now_ms()
        limit = queue.memory_target
        while True:
            # Runs of common records take a fast path: while no add there can reach the memory
            # limit (read-behind starts on the general path, record by record), and in read-behind,
            # where an add is only counted (the backlog a budget leaves on disk at start-up).
            if queue._rb is not None:
                run = reader.common_run(_ANY_SIZE)
                if run:
                    self.apply_behind(run, key, reader.offset)
                    continue
            else:
                room = limit - queue.memory_bytes
                if not queue._checkpoints and room > 0:
                    run = reader.common_run(room)
                    if run:
                        self.apply_common(run)
                        continue
            entry = reader.next()
            if entry is None:
                break
            if queue._rb is not None:
                queue._rb.stop = (key, reader.offset)  # the cursor may read what is applied
            self.apply(entry[1], now, entry[0])

    def apply_behind(self, run: list[codec.Common], key: int, end: int) -> None:
        """`apply` for a run of common records (ending at offset `end` of file `key`) while the queue
        reads behind: an add is only counted, as `_append` counts it, and its item is read back when
        the head reaches it; what takes the head takes it through the queue, whose cursor may read
        the adds applied so far. Should read-behind end within the run, the adds after that join
        memory as on the general path."""
        queue = self.queue
        opens = self.opens
        last = len(run) - 1
        for i, (op, offset, xid, add_time, expiry, data) in enumerate(run):
            if op == codec.ADDX or op == codec.ADD_XID:
                if queue._behind is not None:
                    queue.length += 1
                    queue.bytes += len(data)
                else:
                    self.append(QItem(add_time, expiry, data, xid), run[i + 1][1] if i < last else end)
            elif op == codec.CONFIRM_REMOVE:
                if opens.pop(xid, None) is None:
                    self.note("confirm_of_no_open_read", offset)
            else:
                if queue._rb is not None:
                    queue._rb.stop = (key, offset)
                opened = op != codec.REMOVE
                item = queue._take_head(opened)
                if item is None:
                    self.note("open_of_nothing" if opened else "remove_of_nothing", offset)
                elif opened:  # REMOVE_TENTATIVE_XID
                    if not item.xid and xid != self.next_xid(take=False):
                        self.note("xid_jumps", offset)
                    item.xid = xid
                    opens[xid] = item
                    self.xid = xid
        if queue._rb is not None:
            queue._rb.stop = (key, end)

    def file_replayed(self, key: int) -> None:
        queue = self.queue
        if key != LIVE and queue._rb is not None:
            # The state at this rotation, as it stood then: packing resumes after a restart.
            queue._checkpoints.append(RotationCheckpoint(key, queue._xid, list(queue._opens.items())))

    def restart(self) -> None:
        self.queue._reset_memory()
