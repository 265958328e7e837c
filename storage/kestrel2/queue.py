"""PersistentQueue: one named FIFO of items, kept in memory and in its journal.

Every change is applied in memory first and then written to the journal as one append, before
anything can yield; only then does the caller wait for the sync policy. So the journal's order is
always the order in which the changes happened, and replaying it (through `storage/replay.py`'s
rules) rebuilds the queue exactly, xids included (a REMOVE_TENTATIVE takes the next free xid, as it
did live). The journal's files, rotation and packs are `storage/queue_journal.py`'s.

Read-behind: once the queue holds `max_memory_size` bytes, new items are only counted and written
to the journal; a cursor (`storage/read_behind.py`) reads them back as the head drains.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import replace
from itertools import repeat, starmap

import structlog

from kestrel.storage.clock import Clock
from kestrel.storage.config import QueueConfig
from kestrel.storage.errors import ItemTooLarge, JournalWriteError
from kestrel.storage.files import JournalFiles, list_journal_files
from kestrel.storage.item import QItem, data_sizes, plain_size
from kestrel.storage.kestrel2 import codec, packer
from kestrel.storage.kestrel2.checkpoints import RotationCheckpoint
from kestrel.storage.kestrel2.journal import QueueJournal
from kestrel.storage.kestrel2.read_behind import LIVE, ReadBehind
from kestrel.storage.kestrel2.reader import JournalReader
from kestrel.storage.kestrel2.replay import QueueReplay, next_free_xid
from kestrel.storage.queue import QueueBase
from kestrel.storage.runtime import DEFAULT_RUNTIME, GeventRuntime, Runtime

log = structlog.get_logger("kestrel.queue")


class _Change:
    """What `PersistentQueue._change` returns: the queue's lock, `_before_change`, then
    `_after_change` or `_change_failed`. A class rather than a generator, since every add and
    remove enters it (a generator's context manager cost a microsecond each time). It keeps no
    state of its own, so one per queue serves every change, nested ones included."""

    __slots__ = ("queue",)

    def __init__(self, queue: PersistentQueue) -> None:
        self.queue = queue

    def __enter__(self) -> None:
        queue = self.queue
        queue._lock.__enter__()
        try:
            queue._before_change()
        except BaseException:
            queue._lock.__exit__(None, None, None)
            raise

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: object) -> None:
        queue = self.queue
        try:
            if error is None:
                queue._after_change()
            else:
                queue._change_failed(error)
        finally:
            queue._lock.__exit__(None, None, None)


class PersistentQueue(QueueBase):
    """A durable FIFO queue with reliable reads, expiry and read-behind.

    Parameters: `name` (also the journal's file name), `queue_path` (directory of journals),
    `config`, `clock` (the runtime's unless given), `expire_to` (looks up the queue that expired
    items move to), `salvage` (load what precedes a corrupt record instead of refusing to load),
    `runtime` (gevent unless given: see `storage/runtime.py`).
    """

    def __init__(self, name: str, queue_path: str, config: QueueConfig, clock: Clock | None = None,
                 expire_to: Callable[[str], QueueBase | None] | None = None,
                 salvage: bool = False, runtime: Runtime | None = None) -> None:
        if runtime is None:
            runtime = DEFAULT_RUNTIME if clock is None else GeventRuntime(clock)
        super().__init__(name, queue_path, config, clock if clock is not None else runtime.clock, runtime,
                         expire_to)
        self.runtime = runtime
        self._lock = runtime.lock()
        self._around_change = _Change(self)
        self._journal = QueueJournal(queue_path, name, config.sync_journal, _rotate_at(config), runtime,
                                     self._lock, salvage)
        self._mem: deque[QItem] = deque()
        self._xid = 0
        self._rb: ReadBehind | None = None
        self._checkpoints: list[RotationCheckpoint] = []  # oldest first, one per rotation in read-behind
        self._rebuilding = False
        self._left_read_behind = False  # the cursor caught up: pack the backlog's leftovers away
        self._pack_horizon = 0  # the latest rotation packed with every item in memory
        self._orphans: list[int] = []  # reads open at start-up, not yet journaled back to the head

    # -----------------------------------------------------------------------------------------
    # Figures

    @property
    def in_read_behind(self) -> bool:
        return self._rb is not None

    @property
    def journal_size(self) -> int:
        return self._journal.size

    @property
    def journal_files(self) -> list[str]:
        return self._journal.paths

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
            files = self._journal.scan()
        started = time.monotonic()
        replayed = self._replay(files, repair=True)
        self._journal.open_live()
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
        """Rebuild the queue from its journal files (`QueueJournal.replay`); the bytes replayed."""
        replayed = self._journal.replay(files, repair, _QueueReplay(self))
        if self._rb is not None:
            self._rb.stop = None  # the whole journal is applied: the cursor may read to its end
        return replayed

    # -----------------------------------------------------------------------------------------
    # The in-memory mechanics shared by replay and live operations

    def _next_xid(self) -> int:
        """Take the next free xid, as Kestrel counts them."""
        self._xid = next_free_xid(self._xid, self._opens)
        return self._xid

    def _open(self, item: QItem, xid: int) -> None:
        item.xid = xid
        self._opens[xid] = item

    def _append(self, item: QItem) -> bool:
        """Count `item` in at the tail (held in memory unless in read-behind); True when it fills
        the memory budget, so that read-behind must start after it."""
        size = len(item.data)
        self.length += 1
        self.bytes += size
        if self._rb is not None:
            return False
        self._mem.append(item)
        self.memory_bytes += size
        return self.memory_bytes >= self.config.max_memory_size and self.config.keep_journal

    def _start_read_behind(self, key: int, path: str, offset: int, stop: tuple[int, int] | None) -> None:
        """New items are read back from file `key` at `offset` from now on."""
        self._rb = ReadBehind(self._journal.files, key, path, offset, self._cursor_left)
        self._rb.stop = stop
        log.info("queue entering read-behind", queue=self.name, bytes=self.bytes)

    def _start_read_behind_at_end(self) -> None:
        """Read-behind starts after the last record journaled (live operation)."""
        writer = self._journal.writer
        assert writer is not None
        self._journal.flush()
        self._start_read_behind(LIVE, writer.path, writer.size, None)

    def _cursor_left(self, passed: int) -> None:
        """The read-behind cursor has read the whole of file `passed`: every item queued at a
        checkpoint up to it is in memory now."""
        passed_checkpoints = [cp for cp in self._checkpoints if cp.timestamp <= passed]
        if passed_checkpoints:
            # The state at the latest checkpoint passed is taken now; it is written once the change
            # in progress is journaled (`_change`), and dropped if that change fails.
            self._checkpoints = self._checkpoints[len(passed_checkpoints):]
            self._journal.take_pack(self._take_pack(passed_checkpoints[-1]))

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
        if rb is None:
            return
        self._journal.flush()
        now = self.clock.now_ms()
        while self.memory_bytes < self.config.max_memory_size:
            item = rb.next_item(now)
            if item is None:
                self._left_read_behind = rb.stop is None  # caught up with the live journal
                self._end_read_behind()
                return
            self._mem.append(item)
            self.memory_bytes += len(item.data)

    def _end_read_behind(self) -> None:
        if self._rb is not None:
            self._rb.close()
            self._rb = None
            log.info("queue leaving read-behind", queue=self.name, items=self.length)

    # -----------------------------------------------------------------------------------------
    # Live operations

    def _change(self) -> _Change:
        """Around every change: refused while the journal cannot be written, undone if its write fails.

        Raises JournalWriteError: the change did not happen, in memory or on disk.
        """
        return self._around_change

    def _before_change(self) -> None:
        """Under the lock, before a change: the journal must be writable (or become so now)."""
        self._check_open()
        if self.read_only or self._rebuilding:
            self._probe()
        journal = self._journal
        if journal.writer is not None and journal.writer.fd < 0:
            try:
                journal.writer.open()
            except OSError as e:  # nothing changed yet: refuse this change, the next one tries again
                raise JournalWriteError(self.name, journal.live_path, e) from None
        if self._orphans:
            try:
                self._return_orphans()
            except (OSError, JournalWriteError) as e:
                self._change_failed(e)
                raise

    def _change_failed(self, error: BaseException) -> None:
        """A change raised `error`: a failed write makes the queue read-only and raises
        JournalWriteError; a failed write of the queue this change fed (expire_to_queue) makes this
        one replay its journal. Anything else is the caller's to raise."""
        if isinstance(error, OSError):
            raise self._write_failed(error) from None
        if isinstance(error, JournalWriteError):
            self._rebuild()

    def _after_change(self) -> None:
        """Under the lock, after a change that succeeded: schedule what packing it made possible."""
        journal = self._journal
        if journal.pack_ready is None and journal.pack_queued is None and not self._left_read_behind:
            return  # the common change: no pack to schedule
        journal.keep_taken_pack()
        if self._left_read_behind:
            self._left_read_behind = False
            self._checkpoints = []  # every one was passed on the way to the live journal
            rotated = journal.rotated
            if rotated and rotated[-1][0] > self._pack_horizon and journal.writer is not None:
                self._pack_now()  # what the backlog left behind: at most max_memory_size of items
        journal.start_next_pack()

    def _probe(self) -> None:
        """While read-only: see whether the journal can be written again (a SAVE_XID changes nothing)."""
        path = self._journal.live_path
        if self._rebuilding:
            raise JournalWriteError(self.name, path, None)
        try:
            self._journal.append_now(codec.encode_xid(codec.SAVE_XID, self._xid))
        except OSError as e:
            raise JournalWriteError(self.name, path, e) from None
        self.read_only = False
        log.warning("journal can be written again; queue accepts changes", queue=self.name, file=path)

    def _write_failed(self, error: OSError) -> JournalWriteError:
        """A journal write failed: go read-only and bring memory back to what the journal holds."""
        path = self._journal.live_path if self._journal.writer is not None else self.queue_path
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
            self._journal.wait_for_packing()
            files = list_journal_files(self.queue_path, self.name)
            self._journal.discard_pending()
            self._reset_memory()
            self._replay(files, repair=False)
        finally:
            self._rebuilding = False

    def _reset_memory(self) -> None:
        """Forget every item, open read and xid, ready for a replay from the first journal file."""
        self._end_read_behind()
        self._checkpoints = []
        self._journal.forget_packs()
        self._left_read_behind = False
        self._pack_horizon = 0
        self._mem.clear()
        self._opens.clear()
        self._xid = 0
        self.length = self.bytes = self.memory_bytes = 0

    def _write(self, data: bytes) -> None:
        self._journal.write(data)

    def _commit(self) -> None:
        """Append, wait as the sync policy says, then consider rotating. Last step of each operation."""
        if self._journal.commit():
            self._maybe_rotate()

    def add_many(self, items: list[bytes], expiry: int = 0, add_time: int | None = None) -> int:
        """Add several items with one journal write; returns how many were accepted, in order.

        Raises ItemTooLarge, JournalWriteError (nothing was added).
        """
        with self._change():
            return self._add_many(items, expiry, add_time)

    def _add_many(self, items: list[bytes], expiry: int, add_time: int | None) -> int:
        cfg = self.config
        now = self.clock.now_ms() if add_time is None else add_time
        size, largest = data_sizes(items)
        if largest > cfg.max_item_size:
            raise ItemTooLarge(f"item of {largest} bytes is over max_item_size "
                               f"{cfg.max_item_size} of queue {self.name!r}")
        if self._rb is not None or (self._mem and self._mem[0].expiry):
            self._expire_head(now)
        if cfg.max_age:
            cap = now + cfg.max_age
            expiry = min(expiry, cap) if expiry else cap
        journaled = self._journal.writer is not None
        if (self._rb is None and self.length + len(items) < cfg.max_items and self.bytes + size < cfg.max_size
                and self.memory_bytes + size < cfg.max_memory_size):
            # All fit in memory with room to spare: no per-item limit checks (the common batch).
            if journaled:
                self._journal.write(codec.encode_addx_many(now, expiry, items))
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
                    self._write(codec.encode_addx(now, expiry, data))
                if self._append(QItem(now, expiry, data)):
                    self._start_read_behind_at_end()
                accepted += 1
        self.total_items += accepted
        if len(self._waits):
            for _ in range(accepted):
                if not self._waits.wake_one():
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
        taken = list(starmap(mem.popleft, repeat((), min(count, len(mem)))))  # popleft, count times
        size = plain_size(taken)
        if not taken or size < 0:
            mem.extendleft(reversed(taken))
            return None
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
            with self._lock:
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
        ends up first), their records in one journal write; how many were open. An item aborted for
        the `max_errors`th time leaves for good instead (journaled as a confirm) and goes to `poison`.

        Raises JournalWriteError (the reads stay open).
        """
        with self._change():
            aborted = returned = 0
            for xid in xids:
                item = self._opens.get(xid)
                if item is None:
                    continue
                item.errors += 1
                self.canceled_transactions += 1
                aborted += 1
                if 0 < self.config.max_errors <= item.errors and self._handed_to_poison(item):
                    if self._opens.pop(xid, None) is item:  # still open after the hand-over
                        for checkpoint in self._checkpoints:
                            checkpoint.note_confirm(item)
                        self._write(codec.encode_xid(codec.CONFIRM_REMOVE, xid))
                        self.poisoned_items += 1
                elif self._unremove(xid):
                    self._write(codec.encode_xid(codec.UNREMOVE, xid))
                    returned += 1
            for _ in range(returned):
                if not self._waits.wake_one():
                    break
            if aborted:
                self._commit()
            return aborted

    def reconfigure(self, config: QueueConfig) -> None:
        """New settings from a reload. Whether the queue keeps a journal is fixed at creation."""
        self.config = replace(config, keep_journal=self.config.keep_journal)
        self._journal.set_sync(config.sync_journal, _rotate_at(config))

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
    # Rotation and packing

    def _maybe_rotate(self) -> None:
        journal = self._journal
        writer = journal.writer
        if writer is None or journal.pack_pending:
            return
        cfg = self.config
        if self.length == 0 and not self._checkpoints and writer.size >= cfg.default_journal_size:
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

    def _rotate(self, checkpoint: bool) -> None:
        """Rotate the live journal; with `checkpoint`, note the state at the rotation for a pack."""
        stamp = self._journal.rotate()
        if self._rb is not None:
            self._rb.live_rotated(stamp)
        if checkpoint:
            self._checkpoints.append(RotationCheckpoint(stamp, self._xid, list(self._opens.items())))

    def _pack_now(self) -> None:
        """Rotate and queue a pack of the state now: every item is in memory (not in read-behind)."""
        self._rotate(checkpoint=True)
        self._pack_horizon = self._journal.rotated[-1][0]
        self._journal.queue_pack(self._take_pack(self._checkpoints.pop()))

    def _take_pack(self, checkpoint: RotationCheckpoint) -> packer.PackRequest:
        """The checkpoint's state as a pack to write (every item queued then is in memory now)."""
        return checkpoint.pack_request(self.queue_path, self.name, list(self._mem), self.clock.now_ms())

    def wait_for_packing(self) -> None:
        """Return once every pack taken so far is written (or has failed)."""
        self._journal.wait_for_packing()

    # -----------------------------------------------------------------------------------------
    # Shutting down

    def close(self) -> None:
        """Finish any pack, fsync and close the journal; waiting readers get nothing."""
        if self.closed:
            return
        self._journal.wait_for_packing()
        with self._lock:
            self.closed = True
            self._waits.end()
            self._journal.close()
            self._end_read_behind()

    def destroy(self) -> None:
        """Close and delete every journal file of this queue (the `delete` command)."""
        self.close()
        self._journal.delete_files()


def _rotate_at(config: QueueConfig) -> int:
    """The live journal's size from which a change considers rotating it."""
    return min(config.default_journal_size, config.max_memory_size)


class _QueueReplay(QueueReplay):
    """The replay rules (`storage/replay.py`) applied to a live queue: its figures, read-behind and
    checkpoints kept as the records are applied; runs of common records take the fast path."""

    def __init__(self, queue: PersistentQueue) -> None:  # the state is the queue's own: no super()
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

    def append(self, item: QItem) -> None:
        queue = self.queue
        if queue._append(item):
            assert self.reader is not None
            at = (self.key, self.reader.offset)
            queue._start_read_behind(self.key, self.path, self.reader.offset, at)

    def take_head(self, opened: bool) -> QItem | None:
        return self.queue._take_head(opened)

    def put_back(self, xid: int) -> bool:
        return self.queue._unremove(xid)

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
        limit = queue.config.max_memory_size
        while True:
            # Runs of common records take the fast path while no add there can reach the memory
            # limit (read-behind starts on the general path, record by record).
            room = limit - queue.memory_bytes
            if queue._rb is None and not queue._checkpoints and room > 0:
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

    def file_replayed(self, key: int) -> None:
        queue = self.queue
        if key != LIVE and queue._rb is not None:
            # The state at this rotation, as it stood then: packing resumes after a restart.
            queue._checkpoints.append(RotationCheckpoint(key, queue._xid, list(queue._opens.items())))

    def restart(self) -> None:
        self.queue._reset_memory()
