"""A Kestrel 3 queue's journal: one writer journal per queue, shared by the queue's readers (the
queue itself and its fanout children, src/kestrel/storage/kestrel3/queue.py), each reader's
checkpoint file, and the files compared with the queue's manifest (src/kestrel/storage/manifest.py)
at start-up.

The writer journal's files are `src/kestrel/storage/kestrel3/files.py`'s and their byte layout
`src/kestrel/storage/kestrel3/codec.py`'s; this module keeps which files a queue's journal has, what
each reader has consumed, and when a writer file every reader has passed is deleted.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Generic, Protocol, TypeVar

import structlog

from kestrel.storage import damage, disk, formats, manifest
from kestrel.storage.commit_log import READER, WRITER, CommitLog, FileLog
from kestrel.storage.config import QueueConfig
from kestrel.storage.errors import CorruptJournalError
from kestrel.storage.filenames import reader_file_name, reader_of, writer_file_number
from kestrel.storage.formats import KESTREL3
from kestrel.storage.journal_file import JournalWriter, check_writable
from kestrel.storage.kestrel3 import codec as k3
from kestrel.storage.kestrel3.files import (
    QueueFiles,
    ReaderCheckpoint,
    RecordReader,
    WriterFile,
    WriterJournal,
    checkpoint_entry,
    delete_writer_files,
    header_unwritten,
    list_queue_files,
    read_checkpoint,
    write_checkpoint,
)
from kestrel.storage.queue import ReaderPosition
from kestrel.storage.queue_path import JournalFileFigures, list_journal_files, size_on_disk
from kestrel.storage.runtime import DEFAULT_RUNTIME, Event, Runtime
from kestrel.storage.write_gate import WriteGate

log = structlog.get_logger("kestrel.kestrel3")

COMPACT_AT = 64 * 1024  # a checkpoint file this large is rewritten, if that makes it much smaller
# At start-up, the bytes of sealed writer files whose runs of PUTs the first reader to read them keeps
# for the readers found on disk still to load (`Kestrel3Journal.runs`): one reading serves them all.
RUNS_KEPT = 64 * 1024 * 1024


class Reader(Protocol):
    """What a writer journal knows of each reader attached to it."""

    reader: str  # its name: "" for the queue itself, `a` for its fanout child `q+a`

    @property
    def head(self) -> int:
        """Every id at or below this one is consumed by the reader."""

    @property
    def checkpoint_path(self) -> str | None:
        """Its checkpoint file (None: it reads nothing)."""

    def position(self) -> ReaderPosition:
        """Where it stands in the journal."""

    def sync_head(self) -> None:
        """Return once its checkpoint is on disk as its sync policy requires (a writer file its head
        passed is deleted only then). Raises OSError."""


R = TypeVar("R", bound=Reader)


DELETING = -1  # a writer file's manifest size from just before it is deleted until the next release or close


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
    return damage.items_before_damage(partial(RecordReader, path, k3.FileKind.WRITER), lambda _record: True)


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
    if on_disk.writers and not header_unwritten(on_disk.writers[-1][1]):
        reader = RecordReader(on_disk.writers[-1][1], k3.FileKind.WRITER)
        try:
            while run := reader.puts():
                last = run[-1][0]
        finally:
            reader.close()
    return last


class Kestrel3Journals(Generic[R]):
    """The writer journals of one queue path's Kestrel 3 queues, shared by each queue's readers."""

    def __init__(self, queue_path: str, runtime: Runtime = DEFAULT_RUNTIME, salvage: bool = False) -> None:
        self.queue_path = queue_path
        self.runtime = runtime
        self.salvage = salvage  # set damage aside rather than refuse it (src/kestrel/storage/manifest.py)
        # The server's commit log, once open: the files of a queue created under `sync_journal: always`
        # or a periodic sync log their appends there (src/kestrel/storage/commit_log.py).
        self.commit_log: CommitLog | None = None
        self._journals: dict[str, Kestrel3Journal[R]] = {}
        # Queues whose new journal failed as it was made (an fsync): the files it left (a writer file,
        # no manifest yet) hold no item, and the next try takes them up as its own, not as files a
        # missing manifest leaves unchecked.
        self._left: set[str] = set()

    def journal(self, name: str, config: QueueConfig, new: bool = False) -> Kestrel3Journal[R]:
        """The writer journal of queue `name`, opened on first use (`new`: the queue path holds no
        file of it, so none is looked for). Raises CorruptJournalError, OSError."""
        journal = self._journals.get(name)
        if journal is None or journal.closed:
            try:
                journal = Kestrel3Journal(self, name, config, new, left=name in self._left)
            except BaseException:
                if new:
                    self._left.add(name)
                raise
            self._left.discard(name)
            self._journals[name] = journal
        return journal

    def forget(self, journal: Kestrel3Journal[R]) -> None:
        if self._journals.get(journal.name) is journal:
            del self._journals[journal.name]

    def loaded(self) -> None:
        """Start-up has loaded every queue: runs kept for a reader that never loaded (refused) go."""
        for journal in self._journals.values():
            journal.forget_runs()


class Kestrel3Journal(Generic[R]):
    """One queue's writer journal and the readers attached to it."""

    def __init__(self, owner: Kestrel3Journals[R], name: str, config: QueueConfig, new: bool = False,
                 left: bool = False) -> None:
        """`new`: the queue path holds no file of the queue; `left`: its files are what a failed
        creation of it in this process left (`Kestrel3Journals.journal`)."""
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
        if record is None and (on_disk.writers or on_disk.readers) and left:
            log.info("taking up the files a failed creation of this queue left; its manifest is written now",
                     queue=name, files=[os.path.basename(p) for _, p in on_disk.writers])
        elif record is None and (on_disk.writers or on_disk.readers):
            log.warning("NO MANIFEST for this queue: a writer file or reader checkpoint missing, stray or "
                        "changed cannot be detected at this start; one is written now", queue=name,
                        manifest=manifest.path_of(self.queue_path, name))
        gone: list[tuple[str, manifest.Entry]] = []  # listed writer files missing: consumed, or lost
        fresh: set[str] = set()  # readers whose checkpoint was set aside: they start again at id 0
        # The id ranges of the sealed writer files the manifest's checksums found as they were sealed.
        verified: dict[str, tuple[int, int]] = {}
        if record is not None:
            gone, fresh = self._check.files(record, on_disk)
            on_disk = list_queue_files(self.queue_path, name)
            verified = {n: (e.first_id, e.last_id) for n, e in record.files.items() if e.sealed
                        and n in self._check.matched and writer_file_number(name, n) is not None}
        # Whether its files log their appends is fixed here, at the queue's creation.
        self.commit_log = owner.commit_log if config.sync_journal is not None else None
        self.gate = WriteGate(owner.runtime)  # every reader's: they wait while a large put is written
        self.writer = self._open_writer(config, new, owner.runtime, verified)
        try:
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
            # The keeper, not this journal, told of each seal: a journal's writer refers to nothing that
            # refers back to the journal (a deleted queue is freed by reference counting alone).
            self.writer.sealed = self._keeper.list_sealed
            self.record_files(checkpoints, {} if new else None)
        except BaseException:
            # (an fsync of the manifest failed) its descriptor, which no journal holds: the files stay
            # for the next try to take up
            self.writer.close(sync=False)
            raise
        self.readers: dict[str, R] = {}
        # The queue of this name (the parent, a fanout-only one too) is set up and not closed: its
        # `journal_size` counts the writer files (`counts_writer_files`).
        self.parent_open = False
        self.lock = owner.runtime.lock()  # every reader's: a put changes each of them
        self.closed = False
        self._release_after_checkpoint = False
        self._going: list[WriterFile] = []  # taken by `release`, to be deleted off the loop
        self._gone: list[str] = []  # deleted, and their folder fsynced, but still marked in the manifest
        self._releasing: Event | None = None  # set while `_delete_released` runs
        # Sealed files' runs of PUTs, by path, read once for every reader loading (`runs`).
        self._runs: dict[str, list[list[k3.PutRow]]] = {}
        self._runs_bytes = 0

    # -----------------------------------------------------------------------------------------
    # The manifest (src/kestrel/storage/manifest.py)

    def _open_writer(self, config: QueueConfig, new: bool, runtime: Runtime,
                     verified: dict[str, tuple[int, int]]) -> WriterJournal:
        """The writer journal, its files scanned but those `verified` (WriterJournal). A damaged record
        refuses the queue naming what salvage would cut; with salvage the file is cut there (a copy
        kept) and scanned again."""
        done: set[tuple[str, int]] = set()
        logs = None if self.commit_log is None else partial(FileLog, self.commit_log, WRITER, self.name)
        while True:
            try:
                return WriterJournal(self.queue_path, self.name, config.default_journal_size,
                                     config.sync_journal, runtime.clock, runtime=runtime,
                                     writers=[] if new else None, file_log=logs, gate=self.gate,
                                     verified=verified)
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
            # on the thread pool, with its fsyncs (a new queue's creation waits, the loop serves on)
            self.owner.runtime.run_blocking(self._keeper.update, dict(files), self.writer.tail_id)

    def _unlisted(self) -> dict[str, manifest.Entry]:
        """Writer files the manifest does not list yet (rotated, not yet sealed), as growing entries:
        a manifest listing a newer file lists every older one too, or start-up takes them for strays;
        none whose name may not be durable yet, nor any after it (`WriterJournal.listable`).

        Told from the manifest as last written (`Keeper.listed`, a copy replaced whole after each
        write), not from the entries a thread changes in place under the keeper's lock (a seal):
        asked from the thread pool (a checkpoint's rewrite) and on the loop (a release), it read
        them as they changed. Not under that lock either: a release on the loop waited out a
        seal's fsyncs there. What it tells goes to `Keeper.update`, which decides under the lock
        and lists a file only where it is not listed yet: one listed since is kept as listed."""
        listed = self._keeper.listed
        files = self.writer.listable()  # one copy: a checkpoint rewrite asks from the thread pool
        return {name: manifest.Entry(0, None, f.first_id, f.last_id) for f in files
                if (name := os.path.basename(f.path)) not in listed}

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
        entry of each as last written (`Keeper.listed`: no wait for a write under way)."""
        listed = self._keeper.listed
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

    def counts_writer_files(self, queue: R) -> bool:
        """Whether `queue`'s `journal_size` holds the writer files, which every reader reads: the
        parent's while it is open, else (the parent deleted while its children read on) the first
        child's attached, by name. One queue's, so that summed over the queues (/metrics'
        `kestrel_journal_bytes`) each file on disk counts once, not once a reader."""
        if self.parent_open:
            return not queue.reader
        readers = self.readers
        return bool(readers) and readers[min(readers)] is queue

    def positions(self) -> list[ReaderPosition]:
        """Where each attached reader stands, the queue's own first."""
        return [q.position() for _, q in sorted(self.readers.items())]

    def found(self, reader: str) -> bool:
        """Whether `reader`'s checkpoint was found on disk, and no queue has attached it yet."""
        return reader in self._unattached

    def attach(self, queue: R) -> None:
        self.readers[queue.reader] = queue
        self._unattached.pop(queue.reader, None)

    def reader_deleted(self, reader: str) -> None:
        """`reader` and its checkpoint were deleted: its parent, created again while the journal
        stays open, no longer makes it anew (it did, fed from then on, from `readers_on_disk`)."""
        if reader in self.readers_on_disk:
            self.readers_on_disk.remove(reader)

    def forget_reader(self, reader: str) -> None:
        """`reader`'s checkpoint found on disk is not attached, and goes (a fanout-only parent's that
        held no item): it holds no writer file back."""
        self._unattached.pop(reader, None)

    def runs(self, info: WriterFile) -> Iterator[list[k3.PutRow]]:
        """The runs of whole PUTs of writer file `info`, for a reader loading its items. While readers
        found on disk are still to load theirs, a sealed file's runs are kept (up to `RUNS_KEPT`
        bytes of files) and theirs come from that one reading, sharing its items' bytes too."""
        kept = self._runs.get(info.path)
        if kept is not None:
            yield from kept
            return
        keeping = (bool(self._unattached) and info is not self.writer.current
                   and self._runs_bytes < RUNS_KEPT)
        read: list[list[k3.PutRow]] = []
        reader = RecordReader(info.path, k3.FileKind.WRITER)
        try:
            while run := reader.puts():
                if keeping:
                    read.append(run)
                yield run
        finally:
            reader.close()
        if keeping:  # (read whole: a reading cut short keeps nothing)
            self._runs[info.path] = read
            self._runs_bytes += os.path.getsize(info.path)

    def loaded(self) -> None:
        """A reader has loaded its items: once every reader found on disk has, the runs kept go."""
        if not self._unattached:
            self.forget_runs()

    def forget_runs(self) -> None:
        self._runs = {}
        self._runs_bytes = 0

    @property
    def unread(self) -> bool:
        """No reader is attached, nor found on disk waiting to be."""
        return not self.readers and not self._unattached

    def last_syncs(self, queue: R) -> list[Callable[[], None]]:
        """What closing `queue` makes durable of the journal besides its checkpoint: where it is the
        last reader attached (the journal closes with it, `detach`), the newest writer file's fsync
        and the manifest's drop of the files deleted last (`_drop_gone`), else nothing."""
        if self.closed or any(reader is not queue for reader in self.readers.values()):
            return []
        return [self.writer.flush, self._drop_gone]

    def detach(self, queue: R) -> None:
        """The reader is closed or deleted; the journal closes with its last reader."""
        if self.readers.get(queue.reader) is queue:
            del self.readers[queue.reader]
        if not self.readers and not self.closed:
            self.closed = True
            self.writer.close()
            self._drop_gone()
            self.owner.forget(self)

    def destroy(self) -> None:
        """Delete every writer file (no reader is left), once a release under way has ended; the
        manifest and the files go on the thread pool (the caller waits, the other queues are served)."""
        self.closed = True
        self.writer.close()
        self.owner.forget(self)
        self.wait_for_release()
        if self.commit_log is not None:
            self.commit_log.checkpoint()  # no record in the log may outlive the files it names
        self.owner.runtime.run_blocking(self._remove_files)

    def _remove_files(self) -> None:
        """On the thread pool: the manifest, then every writer file, durably. Raises OSError."""
        manifest.remove(self.queue_path, self.name)  # first: a crash part way finds no listed file gone
        writers = list_queue_files(self.queue_path, self.name).writers
        disk.remove_files(self.queue_path, [path for _, path in writers])

    def release(self) -> None:
        """Take the writer files every reader has passed, but none the commit log's records still
        name (those once a checkpoint of the log has dropped them), and delete them off the loop
        (`_delete_released`): the change that moved a head does not wait for it."""
        if len(self.writer.files) > 1 and not self.closed:
            heads = [*(q.head for q in self.readers.values()), *self._unattached.values()]
            logged = self.commit_log.names if self.commit_log is not None else None
            going = self.writer.take_consumed_files(heads, logged)
            if going:
                self._going += going
                if self._releasing is None:
                    done = self._releasing = self.owner.runtime.event()
                    self.owner.runtime.spawn(partial(self._delete_released, done))
            files = self.writer.files
            if (self.commit_log is not None and not self._release_after_checkpoint and len(files) > 1
                    and files[0].last_id <= min(heads, default=0)):
                self._release_after_checkpoint = True  # what the log names goes after its checkpoint
                self.commit_log.after_checkpoint(self._release_again)

    def _delete_released(self, done: Event) -> None:
        """Delete the files `release` took, a batch at a time (the files taken meanwhile make the
        next: one release runs at a time). Each batch: every reader's checkpoint on disk as its
        sync policy requires (no file goes before the heads that passed it), the rotated files
        sealed (no seal lists a file after it is marked), then off the loop one manifest write
        marking the batch as being deleted (and dropping the previous batch, gone for good), the
        unlinks, and one fsync of the folder. A batch that fails is kept for the next release."""
        try:
            while True:
                with self.lock:
                    if not self._going or self.closed:  # closed: the files stay listed for the next start
                        return
                    going, self._going = self._going, []
                    readers = list(self.readers.values())
                    unlisted = self._unlisted()
                try:
                    for q in readers:
                        q.sync_head()
                    self.writer.wait_for_sealing()
                    self.owner.runtime.run_blocking(self._delete, going, self._gone, unlisted)
                except OSError as e:
                    with self.lock:
                        self._going[:0] = going
                    log.error("cannot delete the writer journal files every reader has passed; tried "
                              "again at the next release", queue=self.name, error=str(e))
                    return
                self._gone = [os.path.basename(f.path) for f in going]
                for info in going:
                    log.info("deleted writer journal file every reader has passed", queue=self.name,
                             file=info.path)
        finally:
            self._releasing = None
            done.set()

    def _delete(self, going: list[WriterFile], gone: list[str], unlisted: dict[str, manifest.Entry]) -> None:
        """Off the loop: mark `going` in the manifest as being deleted (size -1), so that a crash part
        way is not taken for lost files, drop `gone` (deleted by the batch before) and list the
        `unlisted` files (`_unlisted`); then delete `going`. Raises OSError."""
        marks: dict[str, manifest.Entry | None] = dict.fromkeys(gone)
        marks.update({os.path.basename(f.path): manifest.Entry(DELETING, None, f.first_id, f.last_id)
                      for f in going})
        self._keeper.update(marks, self.writer.tail_id, unlisted)
        delete_writer_files(self.queue_path, going)

    def _drop_gone(self) -> None:
        """At close: the files the last release deleted leave the manifest, which then lists just
        the files there are (should that write fail, the next start drops them)."""
        if self._gone:
            gone: dict[str, manifest.Entry | None] = dict.fromkeys(self._gone)
            self._gone = []
            try:
                self.owner.runtime.run_blocking(self._keeper.update, gone)
            except OSError as e:
                log.warning("cannot drop deleted writer journal files from the manifest; the next start "
                            "does", queue=self.name, error=str(e))

    def wait_for_release(self) -> None:
        """Return once no release is deleting files (a close, a delete of the queue)."""
        while (running := self._releasing) is not None:
            running.wait()

    def _release_again(self) -> None:
        """After a checkpoint of the commit log: delete what its records named."""
        self._release_after_checkpoint = False
        with self.lock:
            self.release()


class ReaderFile:
    """One reader's checkpoint file: appended to as items are consumed, rewritten when it grows."""

    def __init__(self, queue_path: str, queue: str, reader: str, sync_ms: int | None, start: int,
                 runtime: Runtime, written: Callable[[str, manifest.Entry, manifest.Entry | None], None],
                 gate: WriteGate, commit_log: CommitLog | None = None) -> None:
        self.queue_path = queue_path
        self.commit_log = commit_log  # its appends go there too, by meaning (`commit_log.READER`)
        self.written = written  # the manifest learns of each whole write
        self.gate = gate  # the writer journal's: its readers' changes wait there while this file is rewritten
        self.runtime = runtime
        self.queue = queue
        self.reader = reader
        self.path = os.path.join(queue_path, reader_file_name(queue, reader))
        if os.path.exists(self.path):
            progress = read_checkpoint(self.path)
            self.entry = manifest.seal(self.path)  # what the file holds (appends only extend it)
        else:  # a new reader: the items already written are not its own
            progress = ReaderCheckpoint(start)
            self.entry = checkpoint_entry(progress)
            # Its file, then its manifest entry, with their fsyncs, off the loop: every reader of the
            # writer journal waits at its gate meanwhile (the tail this reader starts at stays put,
            # no file it reads goes), the other queues are served.
            gate.off_loop(self._create, progress, sync_ms is not None)
        self.head = progress.head
        self.done = set(progress.done)
        self.writer = self._writer(sync_ms)

    def _create(self, progress: ReaderCheckpoint, sync: bool) -> None:
        """On the thread pool: a new reader's checkpoint file written, then listed in the manifest."""
        write_checkpoint(self.queue_path, self.queue, self.reader, progress, sync=sync)
        self.written(self.reader, self.entry, None)

    def _writer(self, sync_ms: int | None) -> JournalWriter:
        writer = JournalWriter(self.path, sync_ms, self.runtime)
        if self.commit_log is not None:
            name = f"{self.queue}+{self.reader}" if self.reader else self.queue  # the reader's queue
            writer.log = FileLog(self.commit_log, READER, name)
        return writer

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
        """Write the whole checkpoint anew (a flush, or a file `grown` large) off the loop, its
        manifest entry and the file each with their fsyncs, while every reader of the writer
        journal waits at its gate (nothing is appended to the old file meanwhile): the caller, a
        change, has its turn there. The old file's descriptor is closed in the background. Raises
        OSError, and then the reader is as it was."""
        old = self.writer
        state = ReaderCheckpoint(head, frozenset(done))
        entry = checkpoint_entry(state)
        self.gate.off_loop(self._write_whole, state, entry, self.entry, old.sync_ms is not None)
        self.entry = entry
        self.head, self.done = head, set(done)
        self.writer = self._writer(old.sync_ms)
        self.runtime.spawn(old.close)

    def _write_whole(self, state: ReaderCheckpoint, entry: manifest.Entry, now: manifest.Entry,
                     sync: bool) -> None:
        """On the thread pool: list `entry` in the manifest beside `now` (what the file holds: a
        crash before the rename leaves it), then write the file anew in one step."""
        self.written(self.reader, entry, now)
        write_checkpoint(self.queue_path, self.queue, self.reader, state, sync=sync)

    @property
    def grown(self) -> bool:
        """Whether the file grew much larger than its state: time to rewrite it (`replace`)."""
        size = self.writer.size
        return size > COMPACT_AT and size > 4 * (24 + 8 * len(self.done))

    def commit(self) -> None:
        """Wait as the sync policy requires for what the file was given."""
        self.writer.commit()

    def close(self) -> None:
        self.writer.close()
