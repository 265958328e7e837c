"""One queue's Kestrel 2 journal: its file set, as Kestrel's `Journal` keeps it.

The live journal `<name>` and the rotated ones `<name>.<ms>` (file names: `src/kestrel/storage/filenames.py`).
This module replays them in order with the torn-tail and salvage policy, appends records with the
sync policy, rotates the live journal, and writes packs one after another in the background. What
the records mean is the queue's business (it replays them through `src/kestrel/storage/kestrel2/replay.py`).
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable
from functools import partial
from typing import Protocol

import structlog

from kestrel.storage import damage, filenames, journal_file, layout, manifest
from kestrel.storage.clock import perf_counter
from kestrel.storage.commit_log import JOURNAL, CommitLog, FileLog
from kestrel.storage.deferred_log import log_later
from kestrel.storage.disk import fsync_path, remove_files
from kestrel.storage.errors import CorruptJournalError, JournalWriteError
from kestrel.storage.journal_file import JournalWriter
from kestrel.storage.kestrel2 import packer
from kestrel.storage.kestrel2.read_behind import LIVE, Files
from kestrel.storage.kestrel2.reader import JournalReader
from kestrel.storage.kestrel2.replay import ADDS
from kestrel.storage.no_lock import NO_LOCK
from kestrel.storage.queue_path import (
    JournalFileFigures,
    JournalFiles,
    list_journal_files,
    remove_temporaries,
    size_on_disk,
)
from kestrel.storage.runtime import DEFAULT_RUNTIME, Event, Lock, Runtime
from kestrel.storage.write_gate import WriteGate

log = structlog.get_logger("kestrel.queue")


class FileReplay(Protocol):
    """What applies the records of each file while the journal is replayed (the queue)."""

    anomalies: dict[str, int]  # records of the file just replayed that had nothing to act on

    def replay_file(self, key: int, path: str, reader: JournalReader) -> None:
        """Apply the file's records from `reader` to its end. Raises CorruptJournalError."""

    def file_replayed(self, key: int) -> None:
        """Every record of file `key` is applied (and none was cut off)."""

    def restart(self) -> None:
        """Forget everything applied: replay starts again from the first file."""


class PackState(enum.Enum):
    IDLE = "idle"  # no pack being written: a queued one may start
    WRITING = "writing"  # a pack is being written in the background
    STOPPED = "stopped"  # a failed pack left a `.pack` that only the next start-up may finish


class _PackJob:
    """One pack being written; finished (the file list updated) once, by whoever comes first."""

    def __init__(self, request: packer.PackRequest, dead: list[str], written: Event) -> None:
        self.request = request
        self.dead = dead
        self.written = written
        self.final: str | None = None  # the pack's path once written
        self.listed: tuple[int, int] | None = None  # its size and CRC32C, once listed as being put in place
        self.finished = False


class QueueJournal:
    """The journal files of queue `name` in `queue_path`, and its writer once `open_live` is called.

    `lock` is the queue's: the background pack takes it to update the file list. With a
    `commit_log`, a journal created under `sync_journal: always` logs every append there too and
    waits for the log's fsync instead of its own (`src/kestrel/storage/commit_log.py`); whether it logs is
    fixed at creation, so that its records in the log never skip bytes of the journal.
    """

    def __init__(self, queue_path: str, name: str, sync_ms: int | None, rotate_at: int,
                 runtime: Runtime, lock: Lock, salvage: bool = False,
                 commit_log: CommitLog | None = None, gate: WriteGate | None = None) -> None:
        self.queue_path = queue_path
        self.name = name
        self.sync_ms = sync_ms
        self.rotate_at = rotate_at  # the live journal's size that makes the queue consider rotating
        self.runtime = runtime
        self.clock = runtime.clock
        self.salvage = salvage
        self._lock = lock
        self.gate = gate  # the queue's: each live journal's large appends are written through it (None: none)
        self.writer: JournalWriter | None = None
        self.rotated: Files = []  # (timestamp, path), oldest first
        self.archived_size = 0
        self._pending: list[bytes] = []  # records of changes made in memory, not yet appended
        self.commit_log = commit_log if sync_ms is not None else None
        self._gathered = False  # some of them are pieces to write as they are (`write_parts`)
        # A pack taken while a change is in progress is `ready`; it is `queued` once the change is
        # journaled. Packs are written one at a time; a newer queued pack supersedes an older one.
        self.pack_ready: packer.PackRequest | None = None
        self.pack_queued: packer.PackRequest | None = None
        self.pack_state = PackState.IDLE
        self._pack_job: _PackJob | None = None
        self._manifest: manifest.Keeper | None = None  # kept once the queue has rotated journals
        self._sealed: dict[str, manifest.Entry] = {}  # checked at start-up, not to be read twice
        self._checked = False  # the files were compared with the manifest
        self._on_disk: manifest.Manifest | None = None  # the manifest as start-up found it
        self.matched_at_start: set[str] = set()  # names of the files start-up found as it lists them
        self._sealer = journal_file.Sealer(runtime)  # rotated journals, until they are in the manifest
        # The first manifest, written ahead (`_manifest_ahead`): set while a task for it is under way
        self._manifest_task: Event | None = None
        self._manifest_writing = False  # ... and once its write has begun
        # What to call once that write has ended, given by a rotation refused meanwhile (`rotate`):
        # held only until then, so that no bound method of the queue stays here (a deleted queue
        # is freed by reference counting alone). `_handoff` orders the two under plain threads, and
        # makes the check for the first manifest and the claim to write it one step, in the write
        # ahead and in a rotation (which holds it while it writes): one of them writes it.
        self._after_manifest: Callable[[], None] | None = None
        self._handoff = runtime.lock()
        # Rotated journals a pack taken at their rotation replaces: neither fsynced nor listed
        # unless that pack fails (`rotate`); each holds its place in the sealing order meanwhile,
        # and is known by its file (`_seal_one`).
        self._replaced: dict[str, tuple[journal_file.Seal, manifest.FileId]] = {}

    @property
    def live_path(self) -> str:
        return filenames.live_path(self.queue_path, self.name)

    @property
    def size(self) -> int:
        return self.archived_size + (self.writer.size if self.writer else 0)

    @property
    def paths(self) -> list[str]:
        live = [self.writer.path] if self.writer else []
        return [p for _, p in self.rotated] + live

    @property
    def epoch(self) -> int:
        """Which journal file the live one is, for the commit log: the latest rotation's stamp."""
        return self.rotated[-1][0] if self.rotated else 0

    def files(self) -> Files:
        """The files in replay order, the live journal last (what the read-behind cursor crosses)."""
        return [*self.rotated, (LIVE, self.live_path)]

    # -----------------------------------------------------------------------------------------
    # Replay

    def scan(self) -> JournalFiles:
        """This queue's files on disk, alone (a queue created after start-up); temporaries removed."""
        files = list_journal_files(self.queue_path, self.name)
        remove_temporaries(self.queue_path, self.name)
        return files

    def replay(self, files: JournalFiles, repair: bool, target: FileReplay) -> int:
        """Replay the files into `target`; return how many bytes were replayed.

        With `repair`, an interrupted pack is finished, a torn tail is cut off (a copy kept) and
        salvage sets damage aside (src/kestrel/storage/damage.py); without it (rebuilding a running
        queue) nothing on disk changes. Raises CorruptJournalError (without salvage).
        """
        if repair and not self._checked:
            self._checked = True  # once: a salvage cut below changes files and replays again
            files = self._check_manifest(files)
        if repair:
            files = packer.finish_interrupted_packs(self.queue_path, self.name, files, self.salvage,
                                                     self.clock.now_ms())
        self.rotated = list(files.rotated)
        order = self.rotated + ([(LIVE, files.live)] if files.live else [])
        replayed = 0
        previous: str | None = None
        for index, (key, path) in enumerate(order):
            reader = JournalReader(path, check_sizes=True)
            try:
                cut = self._replay_file(key, path, reader, index == len(order) - 1, repair, target)
                replayed += reader.offset
            finally:
                reader.close()
            self._report_anomalies(target.anomalies, path, previous)
            previous = path
            if cut is not None:
                # The damage may lie in a record already applied (a size field found wrong only by
                # what follows it): replay again, the damaged file now ending before the damage.
                damage.carry_out(self.queue_path, self.name, [cut], self.clock.now_ms())
                target.restart()
                return self.replay(list_journal_files(self.queue_path, self.name), repair, target)
            target.file_replayed(key)
        self.rotated = [(ts, p) for ts, p in self.rotated if os.path.exists(p)]
        self.archived_size = sum(os.path.getsize(p) for _, p in self.rotated)
        if repair:
            self._record_files()
        return replayed

    # -----------------------------------------------------------------------------------------
    # The manifest (src/kestrel/storage/manifest.py)

    def _check_manifest(self, files: JournalFiles) -> JournalFiles:
        """Compare the files on disk with the manifest before anything is replayed or changed.

        A listed file missing, cut short or changed, or a file the manifest does not list (a stray
        pack or journal), refuses the queue naming it and what salvage would set aside; with
        salvage the remedy is carried out (src/kestrel/storage/damage.py). A queue without a
        manifest loads with a warning; a manifest of a queue with no file at all is stray: set
        aside with a warning. Returns the files to replay.
        """
        stamp = self.clock.now_ms()
        record = self._on_disk = manifest.read_for_start(self.queue_path, self.name, "kestrel2",
                                                         self.salvage, stamp)
        if record is not None and not (files.live or files.rotated or files.packs):
            manifest.set_aside_stray(self.queue_path, self.name, stamp)
            record = self._on_disk = None
        if record is None:
            if files.rotated or files.packs:
                log.warning("NO MANIFEST for this queue: a journal file missing, stray or changed cannot "
                            "be detected at this start; one is written now", queue=self.name,
                            manifest=manifest.path_of(self.queue_path, self.name))
            return files
        findings = self._compare(record, files)
        damage.settle(self.queue_path, self.name, findings, self.salvage, stamp,
                      f"; compared with {manifest.path_of(self.queue_path, self.name)}; nothing was changed")
        if not findings:
            self.matched_at_start = set(self._sealed)
            return files
        self._sealed.clear()
        return list_journal_files(self.queue_path, self.name)

    def _compare(self, record: manifest.Manifest, files: JournalFiles) -> list[damage.Finding]:
        """What does not match the manifest, oldest file first."""
        on_disk = {os.path.basename(p): (ts, p) for ts, p in files.rotated}
        packs = {os.path.basename(p): (ts, p) for ts, p in files.packs}
        listed_packs = {}  # final name -> (timestamp, entry) of a pack being put in place
        listed = {}  # name -> (timestamp, entry) of a rotated journal
        for name, entry in record.files.items():
            parsed = filenames.parse_journal_name(name)
            if parsed is None or parsed[1] != self.name or parsed[0] == "live":
                continue
            if parsed[0] == "pack":
                listed_packs[filenames.rotated_name(self.name, parsed[2])] = (parsed[2], entry)
            else:
                listed[name] = (parsed[2], entry)
        found: list[tuple[int, damage.Finding]] = []
        verified = self._sealed  # file name (a pack by its final name) -> the entry it matched
        covered = 0  # rotated journals at or before a listed pack's timestamp may be gone
        pending = 0  # ... and those still there are deleted by the `.pack` that replaces them
        # ... and none is left: the pack took its final name once they were deleted
        renamed = max((ts for n, (ts, entry) in listed.items() if entry.pack and n in on_disk), default=0)
        for final, (ts, entry) in listed_packs.items():
            pack = filenames.pack_name(self.name, ts)
            if pack in packs:
                why = manifest.mismatch(packs[pack][1], entry)
                pending = max(pending, ts) if why is None else pending
            elif final in on_disk and manifest.mismatch(on_disk[final][1], entry) is None:
                why = None  # renamed to its final name before the crash
                renamed = max(renamed, ts)
            else:  # a crash before its rename, or before its failure was recorded: its journals stand
                log.info("a pack listed in the manifest is not in place (the process stopped before its "
                         "rename, or before recording that it failed); the journals it would have "
                         "replaced are replayed", queue=self.name, file=os.path.join(self.queue_path, pack))
                continue
            if why is None:
                covered = max(covered, ts)
                verified[final] = entry
            else:
                found.append((ts, _mismatched(packs[pack][1], entry, why)))
        in_place = filenames.rotated_name(self.name, renamed)  # the newest pack at its final name
        unseen = self._unseen_pack(record, {n: (ts, e) for n, (ts, e) in listed.items() if ts > covered},
                                   on_disk, verified)
        if unseen is not None:
            stale, path = unseen
            covered = max(covered, stale)
            found.append((0, damage.Finding(
                manifest.path_of(self.queue_path, self.name),
                f"the manifest is older than the files: it lists journals that {os.path.basename(path)}, "
                "a complete pack it does not know, replaced", damage.Remedy.SET_ASIDE,
                also="the queue's files are kept and the manifest written anew")))
            listed = {n: (ts, e) for n, (ts, e) in listed.items() if ts > stale}
        for name, (ts, entry) in listed.items():
            if name in verified:
                continue
            if name in on_disk and ts < renamed:
                found.append((ts, _replaced_copy(on_disk[name][1], in_place)))
            elif name in on_disk:
                why = manifest.mismatch(on_disk[name][1], entry)
                if why is None:
                    verified[name] = entry
                else:
                    found.append((ts, _mismatched(on_disk[name][1], entry, why)))
            elif ts > covered:
                found.append((ts, damage.Finding(os.path.join(self.queue_path, name),
                                                 f"missing: the manifest lists it with {entry.size} bytes",
                                                 damage.Remedy.NONE, also="its records are lost")))
        # Rotated journals are listed in rotation order (`journal_file.Sealer`), a pack at its final
        # name once the journals it replaced are deleted, and a pack being put in place as it is
        # written, without waiting for those to be listed: a journal not listed yet is newer than
        # every file listed under a rotated name, or at or before a `.pack` that replaces it. One at
        # or before a pack found at its final name was deleted before that rename: a copy.
        newest = max((ts for ts, _ in listed.values()), default=0)
        unlisted = [(ts, p) for n, (ts, p) in on_disk.items() if n not in listed and n not in listed_packs]
        for ts, path in unlisted:
            if ts <= renamed:
                found.append((ts, _replaced_copy(path, in_place)))
            elif ts > newest or ts <= pending:
                log.info("journal not yet in the manifest: rotated just before a stop", queue=self.name,
                         file=path)
            else:
                found.append((ts, damage.Finding(path, "not listed in the manifest: a stray journal file (an "
                                                 "older copy, or one from elsewhere); it was not applied",
                                                 damage.Remedy.SET_ASIDE, items=count_items(path))))
        listed_pack_names = {filenames.pack_name(self.name, t) for t, _ in listed_packs.values()}
        for name, (ts, path) in packs.items():
            if name not in listed_pack_names:
                found.append((ts, damage.Finding(path, "a pack the manifest does not list (a stray or older "
                                                 "pack); it was not applied and no journal was deleted",
                                                 damage.Remedy.SET_ASIDE, items=count_items(path))))
        return [f for _, f in sorted(found, key=lambda tf: (tf[0], tf[1].path))]

    def _unseen_pack(self, record: manifest.Manifest, listed: dict[str, tuple[int, manifest.Entry]],
                     on_disk: dict[str, tuple[int, str]], known: dict[str, manifest.Entry]
                     ) -> tuple[int, str] | None:
        """A pack the manifest did not see (an older manifest put back after packs), as (timestamp,
        path): a complete pack of ours on disk that the manifest does not list as a pack, while a
        journal it lists at or before that pack is gone, as the pack replaced it. `listed` leaves
        out the journals a pack it lists replaced, and `known` names the files found as it lists
        them: a pack it lists as being put in place, found at its final name, is one it saw. Only
        a manifest that marks its packs can tell a pack it saw from one it did not."""
        missing = [ts for name, (ts, _) in listed.items() if name not in on_disk]
        if not record.knows_packs or not missing:
            return None
        for ts, path in sorted(on_disk.values(), reverse=True):
            name = os.path.basename(path)
            entry = record.files.get(name)
            if ts < min(missing) or (entry is not None and entry.pack) or name in known:
                continue
            if (entry is None or manifest.mismatch(path, entry) is not None) and packer.is_our_pack(path):
                return ts, path
        return None

    def _record_files(self) -> None:
        """Write the manifest as start-up leaves the files (a queue never rotated needs none)."""
        if self._manifest is None and not self.rotated and not os.path.exists(
                manifest.path_of(self.queue_path, self.name)):
            return
        entries = {}
        for _, path in self.rotated:
            name = os.path.basename(path)
            entry = self._sealed.get(name)
            size = os.path.getsize(path)
            if entry is None or entry.size != size:
                entry = manifest.seal(path, size)
                entry.pack = packer.is_our_pack(path)
            entries[name] = entry
        self._sealed.clear()
        fresh = manifest.Manifest("kestrel2", entries)
        self._manifest = manifest.Keeper(self.queue_path, self.name, fresh)
        if fresh != self._on_disk:  # unchanged since the last stop: no write (start-up of many queues)
            self._manifest.update({})

    def file_figures(self) -> list[JournalFileFigures]:
        """The rotated journals (packs among them) and the live one, each with its manifest's entry
        as last written (`Keeper.listed`: no wait for a write under way)."""
        listed = self._manifest.listed if self._manifest is not None else None
        out = []
        for _, path in self.rotated:
            name = os.path.basename(path)
            size = size_on_disk(path)
            words = ("no manifest: the queue has not rotated since it was written" if listed is None else
                     manifest.describe(listed.get(name), size, name in self.matched_at_start))
            out.append(JournalFileFigures(name, "rotated journal", size, words))
        if self.writer is not None:
            out.append(JournalFileFigures(
                os.path.basename(self.writer.path), "live journal", self.writer.size,
                "not listed: the live journal grows; replay checks each record"))
        return out

    def _keeper(self) -> manifest.Keeper:
        if self._manifest is None:
            self._manifest = manifest.Keeper(self.queue_path, self.name, manifest.Manifest("kestrel2"))
        return self._manifest

    def _seal_one(self, path: str, journal: manifest.FileId, unsynced: bool = False) -> None:
        """The rotated journal `journal` is on disk at `path`: list it in the manifest with its
        checksum (in a thread); fsynced first when it was closed `unsynced` (a pack meant to replace
        it failed).

        A pack does not wait for the seals of the journals it replaces: one is done when its
        journal is no longer under its name, deleted by a pack or replaced by the pack taken at
        its rotation, which bears its name once in place (written first: a slow fsync here). The
        file under the name is told by what it is, not by what the manifest says of it: the pack
        takes the name before the manifest records it there, and may take it while the seal reads."""
        keeper = self._keeper()
        with keeper.lock:  # a pack deleting it meanwhile drops its entry after this one is written
            try:
                if unsynced:
                    fsync_path(path)
                keeper.manifest.files[os.path.basename(path)] = manifest.seal(path, of=journal)
            except FileNotFoundError:  # packed away meanwhile
                return
            keeper.save()

    def _pack_placed(self, pack: str, size: int, crc: int) -> None:
        """The pack is written and fsynced: listed before it becomes `<name>.<ts>.pack`."""
        if self._pack_job is not None:
            self._pack_job.listed = (size, crc)
        self._keeper().update({os.path.basename(pack): manifest.Entry(size, crc, pack=True)})

    def _pack_finished(self, pack: str, final: str, dead: list[str], size: int, crc: int) -> None:
        changes: dict[str, manifest.Entry | None] = {os.path.basename(p): None for p in [pack, *dead]}
        changes[os.path.basename(final)] = manifest.Entry(size, crc, pack=True)
        self._keeper().update(changes)

    def _replay_file(self, key: int, path: str, reader: JournalReader, last: bool, repair: bool,
                     target: FileReplay) -> damage.Finding | None:
        """Replay one file; return where salvage must cut it, if it must.

        A torn tail of the last file is cut off (a copy kept); damage raises CorruptJournalError
        naming what salvage would set aside, or with salvage is returned to be cut.
        """
        try:
            target.replay_file(key, path, reader)
        except CorruptJournalError as e:
            if not repair:
                raise
            return self._damaged(e)
        left = reader.leftover()
        if not left or not repair:
            return None
        error = reader.tail_damage(last)
        if error is None:
            copy = self._cut_keeping_copy(path, reader.offset, "torn")
            log.warning("torn record at the end of the journal; cut off, a copy kept", queue=self.name,
                        file=path, offset=reader.offset, bytes=left, copy=copy)
            return None
        return self._damaged(error)

    def _damaged(self, error: CorruptJournalError) -> damage.Finding:
        """A damaged record: refused (raises, naming what salvage would cut), or cut with salvage."""
        finding = damage.record_damage(error)
        if not self.salvage:
            raise damage.refuse_record(error)
        return finding

    def _cut_keeping_copy(self, path: str, offset: int, label: str) -> str:
        """Cut `path` at `offset`, first saving what is cut in `.kestrel/aside/`.

        Raises JournalWriteError (and changes nothing) when the copy cannot be written.
        """
        stamp = self.clock.now_ms()
        name = os.path.basename(path)
        copy = filenames.set_aside_path(self.queue_path, name, label, stamp)
        try:
            aside = layout.aside_path(self.queue_path, name, label, stamp)
            return journal_file.cut_keeping_copy(path, offset, aside)
        except OSError as e:
            raise JournalWriteError(self.name, copy, e) from None

    def _report_anomalies(self, anomalies: dict[str, int], path: str, previous: str | None) -> None:
        if anomalies:
            log.warning("JOURNAL RECORDS WITH NOTHING TO ACT ON: a journal file before this one may be "
                        "missing or damaged, and items may have been lost or brought back",
                        queue=self.name, file=path, previous_file=previous or "(none)", **anomalies)

    # -----------------------------------------------------------------------------------------
    # Writing

    def open_live(self) -> None:
        """Start appending to the live journal (after replay)."""
        self.writer = self._live_writer()

    def _live_writer(self) -> JournalWriter:
        writer = JournalWriter(self.live_path, self.sync_ms, self.runtime)
        writer.gate = self.gate
        if self.commit_log is not None:  # its name is durable before any record of its epoch is logged
            writer.log = FileLog(self.commit_log, JOURNAL, self.name, self.epoch)
        return writer

    def write(self, data: bytes) -> None:
        """Queue records for the next `flush` (nothing is written for a queue without a journal)."""
        if self.writer is not None and data:
            self._pending.append(data)

    def write_parts(self, parts: list[bytes]) -> None:
        """Queue records given as pieces (headers, and items not copied) for the next `flush`,
        which writes them as they are (a gathering write) rather than joined."""
        if self.writer is not None:
            self._pending.extend(parts)
            self._gathered = True

    def discard_pending(self) -> None:
        self._pending.clear()
        self._gathered = False

    def flush(self) -> None:
        """Append the pending records in one write (no yield between a change and its record, but
        for a large append, written off the loop while the queue's changes wait: `JournalWriter.append`).
        Raises OSError (the records are dropped: the queue rebuilds from the journal)."""
        pending = self._pending
        if not pending:
            return
        writer = self.writer
        assert writer is not None
        try:
            if not self._gathered:
                # logged too, if the journal logs (`JournalWriter.log`)
                writer.append(pending[0] if len(pending) == 1 else b"".join(pending))
            else:
                writer.append_parts(pending)
        finally:
            pending.clear()
            self._gathered = False

    def sync(self) -> bool:
        """After `flush`: wait as the sync policy says; whether the live journal is due for rotation."""
        writer = self.writer
        if writer is None:
            return False
        writer.commit()
        size = writer.size
        if size * 2 >= self.rotate_at and self._manifest is None and self._manifest_task is None:
            self._manifest_ahead()  # half way to the first rotation
        return size >= self.rotate_at

    def append_now(self, data: bytes) -> None:
        """Append `data` at once (a probe, while no record is pending). Raises OSError."""
        self.write(data)
        self.flush()

    def set_sync(self, sync_ms: int | None, rotate_at: int) -> None:
        self.sync_ms = sync_ms
        self.rotate_at = rotate_at
        if self.writer is not None:
            self.writer.set_sync(sync_ms)

    # -----------------------------------------------------------------------------------------
    # Rotation and packing

    def rotate(self, packed: bool = False, refused: Callable[[], None] | None = None) -> int | None:
        """Rename the live journal to `<name>.<ms>` and start a new one; return the timestamp, or
        None when it cannot rotate yet: its first manifest is being written on the thread pool, and
        `refused` (the owner's) is called once that write has ended, in its task, so that the owner
        decides again then rather than at its next change, which may never come
        (`_write_first_manifest`).

        The queue's first rotated file is never without a manifest: one is written before it (the
        rotated file is listed once sealed, or taken at the next start for a rotation not yet
        recorded), so that a crash just after leaves whole-file checks in force. It is written
        ahead, on the thread pool, once the live journal is half way to its rotation (`sync`); here
        only where that write could not run first (the loop did not turn since, or one change took
        the journal past both marks) or failed.

        With `packed` a pack of the state at this rotation is taken with it, and it replaces the
        rotated file: a queue that empties rotates every `default_journal_size` and packs at once.
        Where that pack starts at once (no other is being written or waiting) and the file is one
        nothing waits to see fsynced (`sync_journal: never`, no commit log: under `always` a change
        being acknowledged waits for this very file's fsync, and closing it first would fail that
        change and leave the queue read-only), the file is closed without an fsync and not sealed
        (neither read for its checksum nor listed): the pack, fsynced and listed, takes its place,
        and the kernel need never write the file's pages, which the pack deletes. It holds its
        place in the sealing order until the pack is done, so that a journal rotated meanwhile is
        never listed before it: should the pack fail, it is sealed then as any other
        (`_finish_pack`); a crash before the pack is in place finds it unlisted and newer than what
        the manifest lists (`_compare`).

        The new live journal is created once the rotated one's bytes are durable, with its name
        made durable (where its sync policy or the commit log asks: `JournalWriter.names_durably`),
        which makes the rename durable too, before any record of it is written: the commit log names
        a Kestrel 2 journal by the epoch of its rotation, so a record of the new one placed after a
        power cut that lost the rename would land in the old one. Those fsyncs run on the thread
        pool while the queue's changes wait at its gate (`_name_live`); a change already in progress
        that appends to the new journal first makes both durable itself (`JournalWriter.open`).
        Never yields.
        """
        assert self.writer is not None
        self.flush()
        if self._manifest is None and not self._write_first_manifest_here(refused):
            return None  # once it is written
        last = self.rotated[-1][0] if self.rotated else 0
        stamp = max(self.clock.now_ms(), last + 1)
        old = self.writer
        old.open()  # a live journal started by a rotation earlier in this change may not exist yet
        journal = manifest.file_id(os.fstat(old.fd))  # what its seal lists, unless a pack took its name first
        rotated = filenames.rotated_path(self.queue_path, self.name, stamp)
        os.rename(old.path, rotated)  # its descriptor stays valid: finish it in the background
        old.path = rotated  # what its seal's errors name, the live journal now being a new file
        self.rotated.append((stamp, rotated))
        self.archived_size += old.size
        live = self.writer = self._live_writer()
        if packed and old.sync_ms is None and old.log is None and self.pack_state is PackState.IDLE \
                and not self.pack_pending:
            old.close(sync=False)
            self._replaced[rotated] = (self._sealer.hold(rotated), journal)
        else:
            self._sealer.add(old, partial(self._seal_one, rotated, journal))
        if live.names_durably:
            live.follows = old  # made durable before the new journal is created (`_name_live`)
            self._name_live(live)
        return stamp

    def _write_first_manifest_here(self, refused: Callable[[], None] | None) -> bool:
        """The rotation's own write of the queue's first manifest, where the write ahead has not
        begun; False (and `refused` kept for that write's end) where it has. `_handoff` is held while
        it writes: a write ahead starting meanwhile waits, then skips."""
        with self._handoff:
            if self._manifest_writing:
                if refused is not None:
                    self._after_manifest = refused
                return False
            if self._manifest is None:  # (else the write ahead ended meanwhile, and wrote it)
                keeper = manifest.Keeper(self.queue_path, self.name, manifest.Manifest("kestrel2"))
                keeper.update({})  # kept once written: a rotation that failed here is tried again whole
                self._manifest = keeper
        return True

    def _name_live(self, live: JournalWriter) -> None:
        """Create the new live journal once the rotated one's bytes are durable, with its name (and
        the rename before it) made durable: in a task of its own, the queue's changes waiting at
        its gate until the rotated journal's fsync (a change under `always` without the commit log
        waited for it already) and its folder's, on the thread pool, have ended. Created before
        those bytes were, its name could outlive them in a power cut (any fsync of the folder makes
        it durable), and the rotated journal, no longer the last, would be refused as damaged for
        the torn write at its end. At once where the queue has no gate, or under plain threads,
        whose lock holds the changes and which have no loop to hold: then only an error is logged
        (the next append makes the bytes and the name durable itself, or fails its change)."""
        gate = self.gate
        if gate is None or self._lock is not NO_LOCK:
            self._create_live(live)
            return
        gate.hold()
        self.runtime.spawn(partial(self._create_live, live, gate))

    def _create_live(self, live: JournalWriter, gate: WriteGate | None = None) -> None:
        try:
            live.create()
        except OSError as e:
            log_later(self.runtime, log.error, "cannot make the rotated journal's bytes and the new live "
                      "journal's name durable; its first append tries again",
                      queue=self.name, file=live.path, error=str(e))
        finally:
            if gate is not None:
                gate.release()

    def _manifest_ahead(self) -> None:
        """Write the queue's first manifest in a task of its own, on the thread pool, before the
        rotation that needs it (`rotate`), which waits for it once its write has begun; a close
        waits for it too (`wait_for_packing`)."""
        done = self._manifest_task = self.runtime.event()
        self.runtime.spawn(partial(self._write_first_manifest, done))

    def _write_first_manifest(self, done: Event) -> None:
        """The task of `_manifest_ahead`. Once the write has ended (written, or failed: then the
        rotation writes it), a rotation refused meanwhile is told, after `done` is set: what it
        does next (a rotation, a pack) waits its own turn, and whoever waits for the write (a close,
        a rebuild inside a change) is never held by it."""
        try:
            with self._handoff:  # claimed in one step with the check, as a rotation does (`rotate`)
                claimed = self._manifest_writing = self._manifest is None  # (else a rotation wrote it)
            if claimed:
                keeper = manifest.Keeper(self.queue_path, self.name, manifest.Manifest("kestrel2"))
                self.runtime.run_blocking(keeper.update, {})
                self._manifest = keeper
        except OSError as e:
            log.warning("cannot write the queue's first manifest ahead of its rotation; the rotation "
                        "writes it", queue=self.name, error=str(e))
        finally:
            with self._handoff:
                self._manifest_writing = False
                self._manifest_task = None
                refused, self._after_manifest = self._after_manifest, None
            done.set()
        if refused is not None:
            refused()

    @property
    def pack_pending(self) -> bool:
        """A pack is being written or waits to be: no rotation may happen meanwhile."""
        return (self.pack_state is PackState.WRITING or self.pack_ready is not None
                or self.pack_queued is not None)

    def take_pack(self, request: packer.PackRequest) -> None:
        """A pack taken during a change: queued if the change is journaled (`keep_taken_pack`)."""
        self.pack_ready = request

    def queue_pack(self, request: packer.PackRequest) -> None:
        self.pack_queued = request

    def keep_taken_pack(self) -> None:
        """The change in progress is journaled: its pack (if one was taken) is queued."""
        if self.pack_ready is not None:
            self.pack_queued, self.pack_ready = self.pack_ready, None

    def forget_packs(self) -> None:
        """Drop packs taken or queued and not yet started (their state is being replayed away)."""
        self.pack_ready = self.pack_queued = None

    def start_next_pack(self) -> None:
        """Write the queued pack in the background, unless one is being written; it replaces every
        journal up to its timestamp (reckoned now: packs are written one after another)."""
        request = self.pack_queued
        if request is None or self.pack_state is not PackState.IDLE:
            return
        self.pack_queued = None
        dead = [p for ts, p in self.rotated if ts <= request.timestamp]
        job = self._pack_job = _PackJob(request, dead, self.runtime.event())
        self.pack_state = PackState.WRITING
        self.runtime.spawn(lambda: self._write_pack(job))

    def _write_pack(self, job: _PackJob) -> None:
        started = perf_counter()
        try:
            if self.commit_log is not None:
                self.commit_log.checkpoint()  # no record in the log may name a file the pack replaces
            job.final = self.runtime.run_blocking(packer.write_pack, job.request, job.dead,
                                                  self._pack_placed, self._pack_finished)
            journal_file.record_timing(journal_file.timings.pack, started)
        except Exception:
            log.exception("packing failed", queue=self.name)
        job.written.set()
        if self.gate is not None:  # not while a change of the queue reads or writes off the loop
            self.gate.wait_turn()
        with self._lock:
            self._finish_pack(job)

    def _finish_pack(self, job: _PackJob) -> None:
        """Record how the pack ended. The places its journals rotated unsynced hold in the sealing
        order are released: with nothing to run once it is in place, else (it failed before) each
        fsynced and listed, and its `q.<ts>.pack` entry taken out with the newest of them (or after
        the seals queued before it): an entry left there outlived later packs, and made the next
        start take an older copy of that journal for the pack's own."""
        if job.finished:
            return
        job.finished = True
        self._pack_job = None
        self.pack_state = PackState.IDLE
        stamp = job.request.timestamp
        pack = packer.pack_path(job.request)
        final = filenames.rotated_path(self.queue_path, self.name, stamp)
        held = [(path, self._replaced.pop(path)) for path in job.dead if path in self._replaced]
        record: Callable[[], None] | None = None  # the manifest's record of how the pack ended
        if job.final is None and job.listed is not None and os.path.exists(final) and \
                manifest.mismatch(final, manifest.Entry(*job.listed)) is None:
            # In place, its journals deleted, but a disk error after its last rename kept the
            # manifest from recording it there.
            log.warning("the pack is in place despite the error after its rename; recorded so in the "
                        "manifest now", queue=self.name, file=final)
            job.final = final
            record = partial(self._pack_finished, pack, final, job.dead, *job.listed)
        seals: list[Callable[[], None] | None] = [None] * len(held)
        if job.final is not None:
            self.rotated = [(ts, p) for ts, p in self.rotated if ts > stamp]
            self.rotated.insert(0, (stamp, job.final))
            self.archived_size = sum(os.path.getsize(p) for _, p in self.rotated)
        elif os.path.exists(pack):
            # Complete but not yet in place: only the next start-up may finish it, and no later
            # pack may be written before (it would be replayed after this one).
            self.pack_state = PackState.STOPPED
            log.error("packing failed half way; no more packs until the next start", queue=self.name)
        else:
            log.error("packing failed; the old journal files stay and remain correct", queue=self.name)
            seals = [partial(self._seal_one, path, journal, True) for path, (_, journal) in held]
            if job.listed is not None:
                record = partial(self._keeper().update, {os.path.basename(pack): None})
        if record is not None and held:
            seals[-1] = _then(seals[-1], record)
        elif record is not None:
            self._sealer.add(None, record)
        for (_, (place, _)), seal in zip(held, seals, strict=True):
            self._sealer.release(place, seal)
        self.start_next_pack()

    def wait_for_packing(self) -> None:
        """Return once every pack taken so far is written (or has failed) and every rotated journal
        is in the manifest (but one whose seal failed, and the ones after it: `Sealer.run`). The
        caller may hold the queue's lock: the pack is then finished here rather than by its own
        task. The queue's first manifest written ahead (`_manifest_ahead`) is waited for too."""
        while (writing := self._manifest_task) is not None:
            writing.wait()
        while (job := self._pack_job) is not None:
            job.written.wait()
            with self._lock:
                self._finish_pack(job)
        self._sealer.wait()

    # -----------------------------------------------------------------------------------------
    # Closing

    def close(self) -> None:
        """Finish any pack, fsync and close the live journal."""
        self.wait_for_packing()
        if self.writer is not None:
            self.writer.close()

    def delete_files(self) -> None:
        """Delete every file of this journal (the queue is closed); the manifest first, so that a
        crash part way finds no listed file gone. The removal (the manifest's, its folder's fsync,
        the unlinks) runs on the thread pool: the caller waits, the other queues are served.
        Raises OSError."""
        if self.commit_log is not None:
            self.commit_log.checkpoint()  # no record in the log may outlive the files it names
        self.runtime.run_blocking(self._remove_files, self.paths)
        self._manifest = None
        self._checked = False

    def _remove_files(self, paths: list[str]) -> None:
        """On the thread pool: the manifest, then `paths` (the files kept in memory) and every other
        journal and pack of the queue on disk, durably (`disk.remove_files`), and its temporaries.
        Raises OSError."""
        manifest.remove(self.queue_path, self.name)
        files = list_journal_files(self.queue_path, self.name)
        remove_files(self.queue_path, paths + files.replay_order() + [p for _, p in files.packs])
        remove_temporaries(self.queue_path, self.name)


def _mismatched(path: str, entry: manifest.Entry, why: str) -> damage.Finding:
    """A listed file that does not match its entry: a file cut short keeps its whole records (what
    it lost is gone already); a changed or grown one is set aside whole, none of its records being
    provably intact."""
    if os.path.getsize(path) < entry.size:
        return damage.Finding(path, why, damage.Remedy.NONE,
                              also="its whole records are kept, what it lost is gone")
    return damage.Finding(path, why, damage.Remedy.SET_ASIDE, items=count_items(path))


def _then(first: Callable[[], None] | None, then: Callable[[], None]) -> Callable[[], None]:
    """`first` (if any), then `then`: one step of the sealing order."""
    def both() -> None:
        if first is not None:
            first()
        then()
    return both


def _replaced_copy(path: str, pack: str) -> damage.Finding:
    """A journal found beside a pack in place at a later timestamp, which replaced every journal up
    to its own and took its final name once they were deleted: a copy put back, whose records
    replayed before the pack would bring removed items back."""
    return damage.Finding(path, f"a journal older than the pack {pack} in place, which replaced it "
                          "(deleted before the pack took its name): a stray copy; it was not applied",
                          damage.Remedy.SET_ASIDE, items=count_items(path))


def count_items(path: str) -> int | None:
    """The items a journal file adds, counted up to its end or its first damage."""
    return damage.items_before_damage(partial(JournalReader, path), lambda entry: isinstance(entry[1], ADDS))


def manifest_findings(queue_path: str, name: str) -> list[damage.Finding]:
    """What in a Kestrel 2 queue's files does not match its manifest, changing nothing (the
    converter, `kestrel journal check`). Raises CorruptJournalError when the manifest cannot be read."""
    files = list_journal_files(queue_path, name)
    record = manifest.read(queue_path, name, "kestrel2")
    if record is None or not (files.live or files.rotated or files.packs):
        return []
    queue = QueueJournal(queue_path, name, None, 1 << 62, DEFAULT_RUNTIME, DEFAULT_RUNTIME.lock())
    return queue._compare(record, files)


def check_files(queue_path: str, name: str) -> None:
    """Refuse a Kestrel 2 queue whose files do not match its manifest, changing nothing (the
    converter). Raises CorruptJournalError."""
    damage.settle(queue_path, name, manifest_findings(queue_path, name), False, 0,
                  f"; compared with {manifest.path_of(queue_path, name)}")
