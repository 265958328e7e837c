"""Kestrel3Queue: a queue kept in Kestrel 3's journal, one copy of the data for many readers.

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

import itertools
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from operator import attrgetter

import structlog

from kestrel.storage import damage, formats, manifest
from kestrel.storage.clock import SYSTEM_CLOCK, Clock
from kestrel.storage.config import QueueConfig
from kestrel.storage.deferred_log import log_later
from kestrel.storage.errors import CorruptJournalError, JournalWriteError
from kestrel.storage.filenames import reader_file_name, reader_of, writer_file_number
from kestrel.storage.files import (
    CURSOR_CHUNK,
    JournalFileFigures,
    JournalFiles,
    JournalWriter,
    check_writable,
    list_journal_files,
    size_on_disk,
)
from kestrel.storage.formats import KESTREL3
from kestrel.storage.item import QItem
from kestrel.storage.kestrel3 import codec as k3
from kestrel.storage.kestrel3.files import (
    QueueFiles,
    ReaderCheckpoint,
    RecordReader,
    WriterFile,
    WriterJournal,
    checkpoint_entry,
    list_queue_files,
    read_checkpoint,
    write_checkpoint,
)
from kestrel.storage.queue import PersistentQueue, ReadBack, ReaderPosition
from kestrel.storage.runtime import DEFAULT_RUNTIME, GeventRuntime, Runtime

log = structlog.get_logger("kestrel.kestrel3")

COMPACT_AT = 64 * 1024  # a checkpoint file this large is rewritten, if that makes it much smaller

_XID = attrgetter("xid")


def _reader_of(name: str) -> tuple[str, str]:
    """(writer queue, reader) of a queue name: `q` is q's default reader, `q+a` its reader `a`."""
    parent, _, child = name.partition("+")
    return parent, child


DELETING = -1  # a writer file's manifest size while it is being deleted: it may be gone


@dataclass
class ManifestCheck:
    """Comparing a Kestrel 3 queue's files with its manifest: at start-up, and by the converter."""

    queue_path: str
    name: str
    salvage: bool
    stamp: int
    matched: set[str] = field(default_factory=set)  # names of the files found as the manifest lists them

    def files(self, record: manifest.Manifest, on_disk: QueueFiles
              ) -> tuple[list[tuple[str, manifest.Entry]], set[str]]:
        """Compare the files on disk with the manifest before any is read, cut or deleted.

        Returns the listed writer files that are missing (acceptable only if every reader had
        consumed them: a crash while they were deleted) and the readers whose checkpoint salvage
        set aside. Raises CorruptJournalError (without salvage) for anything else, naming what
        salvage would set aside (src/kestrel/storage/damage.py).
        """
        found, gone, fresh = self.compare(record, on_disk)
        self.settle(found)
        return gone, fresh

    def compare(self, record: manifest.Manifest, on_disk: QueueFiles
                ) -> tuple[list[damage.Finding], list[tuple[str, manifest.Entry]], set[str]]:
        """What does not match the manifest (changing nothing), the listed writer files missing,
        and the readers whose checkpoint does not match."""
        found: list[damage.Finding] = []
        fresh: set[str] = set()
        writers = {os.path.basename(p): (n, p) for n, p in on_disk.writers}
        listed = {}
        for name, entry in record.files.items():
            number = writer_file_number(self.name, name)
            if number is not None:
                listed[name] = (number, entry)
            elif (reader := reader_of(self.name, name)) is not None:
                path = on_disk.readers.get(reader) or os.path.join(self.queue_path, name)
                why = manifest.mismatch(path, entry, growing=True)
                if why is not None:
                    found.append(damage.Finding(path, why, damage.Remedy.SET_ASIDE,
                                                also=f"reader {reader!r} is served every item kept again"))
                    fresh.add(reader)
                else:
                    self.matched.add(name)
        gone = []
        for name, (_number, entry) in sorted(listed.items(), key=lambda kv: kv[1][0]):
            if name not in writers:
                gone.append((name, entry))
                continue
            path = writers[name][1]
            why = manifest.mismatch(path, entry, growing=not entry.sealed)
            if why is None:
                self.matched.add(name)
            elif os.path.getsize(path) < entry.size:
                found.append(damage.Finding(path, why, damage.Remedy.NONE,
                                            also="its whole records are kept, what it lost is gone"))
            else:
                found.append(damage.Finding(path, why, damage.Remedy.SET_ASIDE, items=count_items(path)))
        newest = max((n for n, _ in listed.values()), default=0)
        for name, (number, path) in writers.items():
            if name not in listed and number < newest:
                found.append(damage.Finding(path, "a writer file the manifest does not list (a stray or "
                                            "older copy); it was not read", damage.Remedy.SET_ASIDE,
                                            items=count_items(path)))
        for reader, path in on_disk.readers.items():
            if reader_file_name(self.name, reader) not in record.files:
                log.info("reader checkpoint not yet in the manifest (a reader created just before a stop)",
                         queue=self.name, file=path)
        return found, gone, fresh

    def settle(self, found: list[damage.Finding]) -> None:
        damage.settle(self.queue_path, self.name, found, self.salvage, self.stamp,
                      f"; compared with {manifest.path_of(self.queue_path, self.name)}; nothing was changed")

    def lost_files(self, gone: list[tuple[str, manifest.Entry]], heads: Iterable[int]) -> None:
        """Listed writer files that are missing: refused unless every reader had consumed them (a
        crash while they were deleted)."""
        self.settle(self.lost(gone, heads))

    def lost(self, gone: list[tuple[str, manifest.Entry]], heads: Iterable[int]) -> list[damage.Finding]:
        lowest = min(heads, default=0)
        return [damage.Finding(os.path.join(self.queue_path, n), "missing: the manifest lists it with "
                               f"{e.size} bytes (ids {e.first_id} to {e.last_id}, not all consumed)",
                               damage.Remedy.NONE, also=f"items {e.first_id} to {e.last_id} are lost")
                for n, e in gone if e.size != DELETING and (e.last_id > lowest or not e.sealed)]


def count_items(path: str) -> int | None:
    """The items a writer file holds, counted up to its end or its first damage."""
    try:
        reader = RecordReader(path, k3.FileKind.WRITER)
    except (OSError, CorruptJournalError):
        return None
    count = 0
    try:
        for _ in reader:
            count += 1
    except CorruptJournalError:
        pass
    finally:
        reader.close()
    return count


def manifest_findings(queue_path: str, name: str) -> list[damage.Finding]:
    """What in a Kestrel 3 queue's files does not match its manifest, changing nothing (the
    converter, `kestrel journal check`). Raises CorruptJournalError when the manifest, or a
    checkpoint the manifest vouches for, cannot be read."""
    record = manifest.read(queue_path, name, KESTREL3)
    on_disk = list_queue_files(queue_path, name)
    if record is None or not (on_disk.writers or on_disk.readers):
        return []
    check = ManifestCheck(queue_path, name, False, 0)
    found, gone, fresh = check.compare(record, on_disk)
    high = max(record.high_id, _last_id(on_disk))
    heads = [read_checkpoint(path, high, repair=False).head for r, path in on_disk.readers.items()
             if r not in fresh]
    return found + check.lost(gone, heads)


def check_files(queue_path: str, name: str) -> None:
    """Refuse a Kestrel 3 queue whose files do not match its manifest, changing nothing (the
    converter). Raises CorruptJournalError."""
    damage.settle(queue_path, name, manifest_findings(queue_path, name), False, 0,
                  f"; compared with {manifest.path_of(queue_path, name)}")


def _checkpoint_on_disk(path: str, listed: manifest.Entry | None) -> manifest.Entry:
    """The entry of a checkpoint file that verified: the listed one when the file holds it (not
    only its previous content), else one read from the file."""
    if listed is not None and listed.crc is not None:
        listed = replace(listed, previous=None)
        if manifest.mismatch(path, listed, growing=True) is None:
            return listed
    return manifest.seal(path)


def _last_id(on_disk: QueueFiles) -> int:
    """The last item id in the newest writer file (0 if none; a torn last record left out)."""
    last = 0
    if on_disk.writers:
        reader = RecordReader(on_disk.writers[-1][1], k3.FileKind.WRITER)
        try:
            for _offset, record in reader:
                assert isinstance(record, k3.Put)
                last = record.id
        finally:
            reader.close()
    return last


class Kestrel3Journals:
    """The writer journals of one queue path's Kestrel 3 queues, shared by each queue's readers."""

    def __init__(self, queue_path: str, runtime: Runtime = DEFAULT_RUNTIME, salvage: bool = False) -> None:
        self.queue_path = queue_path
        self.runtime = runtime
        self.salvage = salvage  # set damage aside rather than refuse it (src/kestrel/storage/manifest.py)
        self._journals: dict[str, Kestrel3Journal] = {}

    def journal(self, name: str, config: QueueConfig, new: bool = False) -> Kestrel3Journal:
        """The writer journal of queue `name`, opened on first use (`new`: the queue path holds no
        file of it, so none is looked for). Raises CorruptJournalError."""
        journal = self._journals.get(name)
        if journal is None or journal.closed:
            journal = Kestrel3Journal(self, name, config, new)
            self._journals[name] = journal
        return journal

    def forget(self, journal: Kestrel3Journal) -> None:
        if self._journals.get(journal.name) is journal:
            del self._journals[journal.name]


class Kestrel3Journal:
    """One queue's writer journal and the readers attached to it."""

    def __init__(self, owner: Kestrel3Journals, name: str, config: QueueConfig, new: bool = False) -> None:
        self.owner = owner
        self.name = name
        self.queue_path = owner.queue_path
        if not new:
            found = list_journal_files(self.queue_path, name)
            if found.live or found.rotated or found.packs:  # a queue created after start-up, too
                formats.check_format(self.queue_path, name, found, KESTREL3)
        self.salvage = owner.salvage
        self._stamp = owner.runtime.clock.now_ms()
        record = manifest.read_for_start(self.queue_path, name, KESTREL3, self.salvage, self._stamp)
        self._check = ManifestCheck(self.queue_path, name, self.salvage, self._stamp)
        on_disk = QueueFiles() if new else list_queue_files(self.queue_path, name)
        for path in [*(p for _, p in on_disk.writers[-1:]), *on_disk.readers.values()]:
            check_writable(path)  # the files appended to (older writer files are only read)
        if record is not None and not (on_disk.writers or on_disk.readers):
            manifest.set_aside_stray(self.queue_path, name, self._stamp)
            record = None
        if record is None and (on_disk.writers or on_disk.readers):
            log.warning("NO MANIFEST for this queue: a writer file or reader checkpoint missing, stray or "
                        "changed cannot be detected at this start; one is written now", queue=name,
                        manifest=manifest.path_of(self.queue_path, name))
        gone: list[tuple[str, manifest.Entry]] = []  # listed writer files missing: consumed, or lost
        fresh: set[str] = set()  # readers whose checkpoint was set aside: they start again at id 0
        if record is not None:
            gone, fresh = self._check.files(record, on_disk)
            on_disk = list_queue_files(self.queue_path, name)
        self.writer = self._open_writer(config, new, owner.runtime)
        # The highest id ever written bounds every checkpoint (unknowable without a manifest when the
        # newest writer file holds no item).
        high: int | None = max(record.high_id if record else 0, self.writer.tail_id)
        if record is None and not self.writer.current.last_id:
            high = None
        self.readers_on_disk = sorted(set(on_disk.readers) | fresh)
        self.fresh = fresh  # these readers start again at the oldest item (salvage)
        # Heads of readers found on disk and not attached yet: their files must stay until they are.
        self._unattached: dict[str, int] = {}
        floor = 0
        for reader, path in on_disk.readers.items():
            progress = self._read_checkpoint(reader, path, high, fresh)
            self._unattached[reader] = progress.head
            floor = max(floor, progress.head, max(progress.done, default=0))
        for reader in fresh:
            self._unattached[reader] = 0
        self.writer.tail_id = max(self.writer.tail_id, floor)
        self._check.lost_files(gone, self._unattached.values())
        # What each checkpoint file holds now (it verified), for the manifest written below.
        listed = record.files if record else {}
        checkpoints = {r: _checkpoint_on_disk(path, listed.get(os.path.basename(path)))
                       for r, path in on_disk.readers.items() if r not in fresh}
        self._keeper = manifest.Keeper(self.queue_path, name, record or manifest.Manifest(KESTREL3))
        self._sealed = {n: e for n, e in (record.files.items() if record else ()) if e.sealed}
        self.writer.sealed = self._writer_sealed
        self.record_files(checkpoints, {} if new else None)
        self.readers: dict[str, Kestrel3Queue] = {}
        self.lock = owner.runtime.lock()  # every reader's: a put changes each of them
        self.closed = False

    # -----------------------------------------------------------------------------------------
    # The manifest (src/kestrel/storage/manifest.py)

    def _open_writer(self, config: QueueConfig, new: bool, runtime: Runtime) -> WriterJournal:
        """The writer journal, its files scanned. A damaged record refuses the queue naming what
        salvage would cut; with salvage the file is cut there (a copy kept) and scanned again."""
        done: set[tuple[str, int]] = set()
        while True:
            try:
                return WriterJournal(self.queue_path, self.name, config.default_journal_size,
                                     config.sync_journal, runtime.clock, runtime=runtime,
                                     writers=[] if new else None)
            except CorruptJournalError as e:
                if not self.salvage or (e.path, e.offset) in done:  # cut already: it did not go away
                    raise damage.refuse_record(e, k3.MAGIC_SIZE) from None
                done.add((e.path, e.offset))
                damage.carry_out(self.queue_path, self.name, [damage.record_damage(e, k3.MAGIC_SIZE)],
                                 self._stamp)

    def _read_checkpoint(self, reader: str, path: str, high: int | None, fresh: set[str]) -> ReaderCheckpoint:
        """A reader's checkpoint. A damaged record refuses the queue; with salvage what precedes it is
        kept (the reader is served again what it consumed after that), a copy of the rest set aside."""
        again = f"reader {reader!r} is served again what it consumed after that"
        done: set[int] = set()
        while True:
            try:
                return read_checkpoint(path, high)
            except CorruptJournalError as e:
                if not self.salvage or e.offset in done:  # cut already: it did not go away
                    raise damage.refuse_record(e, k3.MAGIC_SIZE, again) from None
                done.add(e.offset)
                finding = damage.record_damage(e, k3.MAGIC_SIZE, again)
                damage.carry_out(self.queue_path, self.name, [finding], self._stamp)
                if finding.remedy is damage.Remedy.SET_ASIDE:
                    fresh.add(reader)
                    return ReaderCheckpoint()

    def record_files(self, checkpoints: dict[str, manifest.Entry], readers: dict[str, str] | None = None
                     ) -> None:
        """At start-up, write the manifest as the files now stand, with `checkpoints` (by reader) as they
        verified; `readers` (checkpoint paths by reader) when known without listing the queue path."""
        files: dict[str, manifest.Entry | None] = {}
        for info in self.writer.files[:-1]:
            name = os.path.basename(info.path)
            entry = self._keeper.manifest.files.get(name) or self._sealed.get(name)
            if entry is None or not entry.sealed or entry.size != os.path.getsize(info.path):
                entry = manifest.seal(info.path, first_id=info.first_id, last_id=info.last_id)
            files[name] = entry
        files[os.path.basename(self.writer.current.path)] = manifest.Entry(0, None)
        if readers is None:
            readers = list_queue_files(self.queue_path, self.name).readers
        for reader, path in readers.items():
            files[os.path.basename(path)] = checkpoints.get(reader, manifest.Entry(0, None))
        self._sealed = {}
        fresh = manifest.Manifest(KESTREL3, {n: e for n, e in files.items() if e is not None},
                                  max(self._keeper.manifest.high_id, self.writer.tail_id))
        if fresh != self._keeper.manifest:  # unchanged since the last stop: no write
            self._keeper.manifest.files = {}
            self._keeper.update(dict(files), high_id=self.writer.tail_id)

    def _unlisted(self) -> dict[str, manifest.Entry]:
        """Writer files the manifest does not list yet (rotated, not yet sealed), as growing entries:
        a manifest listing a newer file lists every older one too, or start-up takes them for strays."""
        listed = self._keeper.manifest.files
        return {name: manifest.Entry(0, None, f.first_id, f.last_id) for f in self.writer.files
                if (name := os.path.basename(f.path)) not in listed}

    def _deleting(self, going: list[WriterFile]) -> None:
        """Consumed writer files about to be deleted: listed as such first (size -1), so that a crash
        part way is not taken for lost files."""
        self._keeper.update({os.path.basename(f.path): manifest.Entry(DELETING, None, f.first_id, f.last_id)
                             for f in going}, self.writer.tail_id, self._unlisted())

    def _writer_sealed(self, info: WriterFile) -> None:
        """A rotated writer file is fsynced (in a thread). Files are sealed in rotation order, so
        every older one is listed already or deleted; the writer's list is not read here, as the
        queue changes it meanwhile."""
        entry = manifest.seal(info.path, first_id=info.first_id, last_id=info.last_id)
        self._keeper.update({os.path.basename(info.path): entry}, high_id=info.last_id)

    def checkpoint_written(self, reader: str, entry: manifest.Entry, now: manifest.Entry | None) -> None:
        """A reader's checkpoint was just created as `entry` records it, or is about to be rewritten
        so over what `now` records: listed with both, as a crash before the rename leaves `now`."""
        if now is not None:
            entry = replace(entry, previous=(now.size, now.crc)) if now.crc is not None else manifest.Entry()
        self._keeper.update({reader_file_name(self.name, reader): entry}, self.writer.tail_id,
                            self._unlisted())

    def checkpoint_deleted(self, reader: str) -> None:
        self._keeper.update({reader_file_name(self.name, reader): None})

    def file_figures(self) -> list[JournalFileFigures]:
        """The writer files, oldest first, then each attached reader's checkpoint, with the manifest's
        entry of each."""
        with self._keeper.lock:  # a sealing thread may be adding an entry
            listed = dict(self._keeper.manifest.files)
        matched = self._check.matched
        paths = [("writer file", f.path) for f in self.writer.files]
        paths += [("reader checkpoint", path) for _, q in sorted(self.readers.items())
                  if (path := q.checkpoint_path) is not None]
        newest = self.writer.current.path
        out = []
        for role, path in paths:
            name = os.path.basename(path)
            size = size_on_disk(path)
            entry = listed.get(name)
            words = ("not listed yet: the newest writer file grows; replay checks each record"
                     if entry is None and path == newest else manifest.describe(entry, size, name in matched))
            out.append(JournalFileFigures(name, role, size, words))
        return out

    def positions(self) -> list[ReaderPosition]:
        """Where each attached reader stands, the queue's own first."""
        return [q.position() for _, q in sorted(self.readers.items())]

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
        manifest.remove(self.queue_path, self.name)  # first: a crash part way finds no listed file gone
        for _, path in list_queue_files(self.queue_path, self.name).writers:
            os.unlink(path)

    def release(self) -> None:
        """Delete the writer files every reader has passed."""
        if len(self.writer.files) > 1 and not self.closed:
            heads = [*(q.head for q in self.readers.values()), *self._unattached.values()]
            removed = self.writer.remove_consumed_files(heads, self._deleting)
            for path in removed:
                log_later(self.owner.runtime, log.info, "deleted writer journal file every reader has passed",
                          queue=self.name, file=path)
            if removed:
                self._keeper.update({os.path.basename(p): None for p in removed}, self.writer.tail_id,
                                    self._unlisted())


class _ReaderFile:
    """One reader's checkpoint file: appended to as items are consumed, rewritten when it grows."""

    def __init__(self, queue_path: str, queue: str, reader: str, sync_ms: int | None, start: int,
                 runtime: Runtime, written: Callable[[str, manifest.Entry, manifest.Entry | None], None]
                 ) -> None:
        self.queue_path = queue_path
        self.written = written  # the manifest learns of each whole write
        self.runtime = runtime
        self.queue = queue
        self.reader = reader
        self.path = os.path.join(queue_path, reader_file_name(queue, reader))
        if os.path.exists(self.path):
            progress = read_checkpoint(self.path)
            self.entry = manifest.seal(self.path)  # what the file holds (appends only extend it)
        else:  # a new reader: the items already written are not its own
            progress = ReaderCheckpoint(start)
            write_checkpoint(queue_path, queue, reader, progress, sync=sync_ms is not None)
            self.entry = checkpoint_entry(progress)
            written(reader, self.entry, None)
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
        state = ReaderCheckpoint(head, frozenset(done))
        entry = checkpoint_entry(state)
        self.written(self.reader, entry, self.entry)  # listed first, beside what the file holds now
        write_checkpoint(self.queue_path, self.queue, self.reader, state, sync=old.sync_ms is not None)
        self.entry = entry
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


class Kestrel3Queue(PersistentQueue):
    """One reader of a Kestrel 3 writer journal.

    Parameters: those of `PersistentQueue`, and `journals` (the queue path's writer journals, shared
    by the readers of each). A fanout-only parent keeps no reader of its own.
    """

    shares_writes = True
    journal_format = 3

    def __init__(self, name: str, queue_path: str, config: QueueConfig, clock: Clock | None = None,
                 expire_to: Callable[[str], PersistentQueue | None] | None = None,
                 journals: Kestrel3Journals | None = None) -> None:
        self._journals = journals or Kestrel3Journals(queue_path, GeventRuntime(clock or SYSTEM_CLOCK))
        runtime = self._journals.runtime
        super().__init__(name, queue_path, config, clock or runtime.clock, runtime, expire_to)
        self.parent, self.reader = _reader_of(name)
        self.is_reader = not (config.fanout_only and not self.reader)
        self._journal: Kestrel3Journal | None = None
        self._file: _ReaderFile | None = None
        self._behind_id = 0  # while in read-behind: the lowest id not yet read back
        self._seen = 0  # the newest id handed to this reader: read-behind loads nothing newer
        self._cursor: RecordReader | None = None
        self._cursor_file = 0  # number of the writer file the cursor reads
        self._unsaved: set[int] = set()  # consumed, not yet in the checkpoint file (a write failed)
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
        """Bytes of the writer journal this reader reads, and of its checkpoint."""
        if self._journal is None:
            return 0
        return self._journal.writer.total_size + (self._file.writer.size if self._file else 0)

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

    def setup(self, reopen: bool = True, files: JournalFiles | None = None, fresh: bool = False) -> None:
        """Open the writer journal and this reader's checkpoint, and load the items it has still to
        consume, oldest first (those beyond `max_memory_size` are only counted).

        Reads open at a stop are served again in any case (they were never consumed), and the files
        are listed here unless `fresh` (none exists): `reopen` and `files` are Kestrel 2's. Raises
        CorruptJournalError, ConfigError (the queue has Kestrel 2 journal files).
        """
        started = time.monotonic()
        self._journal = self._journals.journal(self.parent, self.config, fresh)
        self._lock = self._journal.lock
        if not self.is_reader:
            return
        writer = self._journal.writer
        start = 0 if self.reader in self._journal.fresh else writer.tail_id
        self._file = _ReaderFile(self.queue_path, self.parent, self.reader, self.config.sync_journal,
                                 start, self._journals.runtime, self._journal.checkpoint_written)
        self._journal.attach(self)
        for info in writer.files:
            if info.last_id <= self._file.head:
                continue
            reader = RecordReader(info.path, k3.FileKind.WRITER)
            try:
                for _, record in reader:
                    assert isinstance(record, k3.Put)
                    if not self._file.consumed(record.id):
                        item = self._item_of(record)
                        if self._append(item):
                            self._read_behind_from(self._start_read_behind(item))
            finally:
                reader.close()
        self._seen = writer.tail_id
        if self.length:
            log.info("loaded kestrel3 reader", queue=self.name, items=self.length, bytes=self.bytes,
                     seconds=round(time.monotonic() - started, 3), read_behind=self.in_read_behind)
        self._journal.release()

    def _item_of(self, record: k3.Put) -> QItem:
        """The item of a PUT as this reader holds it: its expiry capped by the reader's `max_age`."""
        return QItem(record.add_time, self._capped_expiry(record.add_time, record.expire_time or 0),
                     record.data, record.id, record.error_count)

    # -----------------------------------------------------------------------------------------
    # Read-behind

    def _start_read_behind(self, after: QItem) -> ReadBack:
        self._behind_id = after.xid + 1
        return self._read_back

    def _read_back(self, now: int) -> QItem | None:
        """The next item of this reader from the writer files, or None once every item handed to it
        is in memory."""
        assert self._file is not None
        while self._behind_id <= self._seen:
            record = self._next_behind()
            if record is None or record.id > self._seen:  # past it: a put is handing it out
                return None
            self._behind_id = record.id + 1
            if not self._file.consumed(record.id) and record.id not in self._unsaved:
                return self._item_of(record)
        return None

    def _next_behind(self) -> k3.Put | None:
        """The next PUT at or after `_behind_id`, from the cursor (opened, or moved to the next file)."""
        assert self._journal is not None
        files = self._journal.writer.files
        while True:
            if self._cursor is None:
                info = next((f for f in files if f.last_id >= self._behind_id), None)
                if info is None:
                    return None
                self._cursor = RecordReader(info.path, k3.FileKind.WRITER)
                self._cursor.chunk = CURSOR_CHUNK
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
            if record.id >= self._behind_id:
                return record

    def _sync_cursor(self) -> None:
        """Nothing to do: the writer appends every PUT at once."""

    def _stop_read_behind(self) -> None:
        self._close_cursor()

    def _cursor_at(self, first: QItem, count: int, before: QItem | None) -> ReadBack | None:
        """Read-behind from the id of `first`: every item ahead of it and every open read has a
        lower id (they were added before it), so read-back skips none of them twice."""
        first_id = first.xid
        if before is not None and before.xid >= first_id:
            return None
        if any(item.xid >= first_id for item in self._opens.values()):
            return None
        if any(item.xid >= first_id for item in itertools.islice(self._mem, len(self._mem) - count)):
            return None
        self._close_cursor()
        self._behind_id = first_id
        return self._read_back

    def _cursor_buffer(self) -> int:
        return self._cursor.buffered if self._cursor is not None else 0

    def _release_cursor_buffer(self) -> None:
        if self._cursor is not None:
            self._cursor.release_buffer()

    def _close_cursor(self) -> None:
        if self._cursor is not None:
            self._cursor.close()
            self._cursor = None

    # -----------------------------------------------------------------------------------------
    # Adding: one write for every reader

    def _put_shared(self, items: list[bytes], expiry: int, now: int) -> int:
        """Write the items some target takes, once, and hand them to every reader: on a queue (the
        default reader) its readers are the targets, on a fanout child it alone. Each target takes
        the items its limits admit; the readers consume the rest at once. What the readers consume
        meanwhile left by itself (expired, discarded, refused): its record may wait. Returns how
        many this queue took. Raises JournalWriteError (nothing was written).
        """
        journal = self._journal
        assert journal is not None
        readers = list(journal.readers.values())
        marks = [(len(q._consumed), len(q._left)) for q in readers]
        admitted: dict[str, tuple[int, int]] = {}
        count = 0
        try:
            for q in readers:
                if not self.reader or q is self:
                    taken, _ = admitted[q.reader] = q._admit(items, now)
                    if taken > count:
                        count = taken
            if count:
                writer = journal.writer
                try:
                    first = writer.append(items[:count], now, expiry or None)[0].id
                except OSError as e:
                    raise self._write_error(writer.current.path, e) from None
                for q in readers:
                    taken, size = admitted.get(q.reader, (0, 0))
                    if taken:
                        q._receive(items if taken == len(items) else items[:taken], size, now, expiry, first)
                    q._consumed.extend(range(first + taken, first + count))  # refused: consumed at once
                    q._seen = first + count - 1
        finally:
            for q, mark in zip(readers, marks, strict=True):
                q._settle_later(mark)  # no yield before: the writer journal commits first
        if count:
            journal.writer.commit()
        for q in readers:
            if count or q.reader in admitted:
                q._sync_checkpoint()
        return admitted.get(self.reader, (0, 0))[0]

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

    def _log_adds(self, items: list[bytes], now: int, expiry: int) -> None:
        """Nothing to record: the PUTs are written, and `_put_shared` moves `_seen` past them."""

    def _log_add(self, item: QItem) -> None:
        self._seen = item.xid  # read-behind may load it from now on

    def _log_gone(self, item: QItem) -> None:
        self._consumed.append(item.xid)
        self._left.append(item)

    def _log_gone_many(self, items: list[QItem]) -> None:
        self._consumed.extend(map(_XID, items))
        self._left.extend(items)

    def _log_open(self, item: QItem) -> int:
        self._left.append(item)
        return item.xid

    def _log_confirm(self, xid: int, item: QItem) -> None:
        self._consumed.append(xid)
        self._confirmed.append(item)

    def _log_return(self, xid: int, item: QItem) -> None:
        self._returned.append(item)

    def _drop_items(self) -> None:
        """Consume every item with one checkpoint rewrite (open reads stay open).

        Raises JournalWriteError (nothing was dropped).
        """
        assert self._journal is not None
        if self._file is not None:
            tail = max(self._journal.writer.tail_id, self._file.head)
            head = min(self._opens, default=tail + 1) - 1
            head = max(head, self._file.head)
            done = {i for i in range(head + 1, tail + 1) if i not in self._opens}
            try:
                self._file.replace(head, done)
            except OSError as e:
                raise self._write_error(self._file.path, e) from None
            self._unsaved.clear()
            self._journal.release()
        self._forget_items()

    def _commit(self, housekeeping: bool = False) -> None:
        """Write the ids the change consumed (raises JournalWriteError, and the change is undone;
        for housekeeping they wait instead), then wait as the sync policy says."""
        ids = self._consumed
        if ids:
            self._consumed = []
            if housekeeping:
                self._save_later(ids)
            else:
                self._save(ids)
        self._sync_checkpoint()

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
        """Wait as the sync policy says for what this reader's checkpoint was given."""
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
        """Kestrel 3 journals are never packed (their files are deleted): wait until every rotated
        writer file is in the manifest."""
        if self._journal is not None:
            self._journal.writer.wait_for_sealing()

    def reconfigure(self, config: QueueConfig) -> None:
        """New settings from a reload (whether a parent is fanout-only is fixed at creation)."""
        self.config = replace(config, fanout_only=self.config.fanout_only)
        self._memory_ceiling_changed()
        if self._journal is not None and not self.reader:
            self._journal.writer.reconfigure(config.default_journal_size, config.sync_journal)
        if self._file is not None:
            self._file.writer.sync_ms = config.sync_journal

    def _close_files(self) -> None:
        """Close this reader's files (the writer journal closes with its last reader)."""
        if self._file is not None:
            self._file.close()
        if self._journal is not None:
            self._journal.detach(self)

    def destroy(self) -> list[str]:
        """Close and delete this reader's checkpoint, and the writer files once no reader is left
        (found by listing the queue path: then the queue owns no file)."""
        journal = self._journal
        self.close()
        if self._file is not None and os.path.exists(self._file.path):
            if journal is not None:  # unlisted first: a crash before the unlink keeps the reader
                journal.checkpoint_deleted(self.reader)
            os.unlink(self._file.path)
        if journal is not None and journal.unread:
            journal.destroy()
            return [self.name, self.parent]
        return [self.name] if self.reader else []  # a reader's name owns no file; its parent's do
