"""A queue's journal on disk: its files (named as `storage/filenames.py` says), reading records
back, appending with a sync policy.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import structlog

from storage import codec, filenames
from storage.codec import Incomplete, Malformed, Record
from storage.errors import CorruptJournalError
from storage.runtime import DEFAULT_RUNTIME, Event, Runtime, Timer

log = structlog.get_logger("kestrel.journal")

READ_CHUNK = 1 << 20
SIZE_CHECK_WINDOW = 1 << 16  # bytes read past unreadable ones to look for a size field one bit small


# ---------------------------------------------------------------------------------------------
# The files of a queue


@dataclass
class JournalFiles:
    """What the queue path holds for one queue."""

    rotated: list[tuple[int, str]] = field(default_factory=list)  # (timestamp, path), oldest first
    packs: list[tuple[int, str]] = field(default_factory=list)
    live: str | None = None

    def replay_order(self) -> list[str]:
        return [p for _, p in self.rotated] + ([self.live] if self.live else [])


@dataclass
class QueueDirectory:
    """One scan of the queue path: every queue's files, and the temporaries to clean up."""

    queues: dict[str, JournalFiles] = field(default_factory=dict)
    temporaries: list[str] = field(default_factory=list)


def scan_queue_dir(queue_path: str, prefix: str = "") -> QueueDirectory:
    """Read the queue path once (start-up stays linear in the number of files).

    With `prefix`, only files whose names start with it are looked at (one queue's files).
    """
    found = QueueDirectory()
    for entry in os.scandir(queue_path):
        if not entry.name.startswith(prefix) or not entry.is_file():
            continue
        if filenames.is_temporary(entry.name):
            found.temporaries.append(entry.path)
            continue
        parsed = filenames.parse_journal_name(entry.name)
        if parsed is not None:
            kind, name, ts = parsed
            files = found.queues.setdefault(name, JournalFiles())
            if kind == "live":
                files.live = entry.path
            else:
                (files.rotated if kind == "rotated" else files.packs).append((ts, entry.path))
    for files in found.queues.values():
        files.rotated.sort()
        files.packs.sort()
    return found


def list_journal_files(queue_path: str, name: str) -> JournalFiles:
    """The files of one queue (a queue created after start-up, or deleted)."""
    return scan_queue_dir(queue_path, name).queues.get(name, JournalFiles())


def check_pack(path: str) -> str | None:
    """Why the `.pack` at `path` is not a complete pack, or None if it is.

    A pack we write ends with SAVE_XID after its last item and is fsynced before it is renamed to
    `.pack`: a file that is empty, does not read to its end, or ends otherwise is not one.
    """
    reader = RecordReader(path)
    last: Record | None = None
    try:
        for _, record in reader:
            last = record
        if reader.leftover():
            return f"it ends inside a record at offset {reader.offset}"
    except CorruptJournalError as e:
        return e.reason + f" at offset {e.offset}"
    finally:
        reader.close()
    if last is None:
        return "it is empty"
    if not isinstance(last, codec.SaveXid):
        return "it does not end with the SAVE_XID that closes a complete pack"
    return None


def finish_interrupted_packs(queue_path: str, name: str, files: JournalFiles, salvage: bool,
                             stamp: int) -> JournalFiles:
    """Complete a pack that a crash interrupted, as the format document prescribes.

    A `.pack` file is the state of every rotated journal at or before its timestamp: those are
    deleted and the pack takes the rotated name. A `.pack` that is not complete deletes nothing:
    it raises CorruptJournalError, or with `salvage` is set aside as `<file>.corrupt-<stamp>`.
    Returns the files left to replay.
    """
    for ts, pack_path in files.packs:
        reason = check_pack(pack_path)
        if reason is not None:
            if not salvage:
                raise CorruptJournalError(pack_path, 0, None, f"incomplete pack, not applied: {reason}; "
                                          "no journal was deleted")
            log.error("incomplete pack set aside; no journal deleted (salvage)", file=pack_path,
                      reason=reason)
            os.rename(pack_path, filenames.set_aside_path(pack_path, "corrupt", stamp))
            continue
        for rts, rpath in files.rotated:
            if rts <= ts:
                log.warning("deleting journal superseded by pack", file=rpath, pack=pack_path)
                os.unlink(rpath)
        final = filenames.rotated_path(queue_path, name, ts)
        os.rename(pack_path, final)
        files.rotated = [(rts, rpath) for rts, rpath in files.rotated if rts > ts] + [(ts, final)]
        files.rotated.sort()
    files.packs = []
    return files


def remove_temporaries(queue_path: str, name: str) -> None:
    """Delete one queue's `~~` temporaries."""
    prefix = filenames.temporary_prefix(name)
    delete_temporaries([e.path for e in os.scandir(queue_path) if e.is_file() and e.name.startswith(prefix)])


def delete_temporaries(paths: list[str]) -> None:
    """Delete `~~` temporaries (half-written packs) left by a crash."""
    for path in paths:
        log.info("removing temporary journal file", file=path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def write_all(fd: int, data: bytes) -> None:
    """os.write until every byte is written (a short write means the disk is full: it raises)."""
    done = os.write(fd, data)
    while done < len(data):
        n = os.write(fd, memoryview(data)[done:])
        if n <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        done += n


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# Reading


class BufferedFile:
    """A file read forward through a buffer (the record readers of both journal formats)."""

    def __init__(self, path: str, offset: int) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        self._buf = b""
        self._buf_start = offset  # file offset of _buf[0]
        self._pos = 0  # position in _buf

    @property
    def offset(self) -> int:
        """File offset of the next record."""
        return self._buf_start + self._pos

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class RecordReader(BufferedFile):
    """Reads records forward from one journal file, resuming where it stopped.

    The file may still be growing (the live journal, read by read-behind): `next()` returns None
    when no complete record is there yet. With `check_sizes` (replay) a record whose size field
    looks one bit off is reported as corrupt. Replay calls `finish()` at the end to learn whether the
    file ends in a torn record.
    """

    def __init__(self, path: str, offset: int = 0, check_sizes: bool = False) -> None:
        super().__init__(path, offset)
        self.check_sizes = check_sizes  # replay: look for size fields that swallow records
        self._previous: int | None = None  # offset of the record just read, if it has a size field
        self._eof = False

    def _fill(self) -> bool:
        """Read more of the file after the buffer; False at end of file."""
        rest = self._buf[self._pos:]
        self._buf_start += self._pos
        self._pos = 0
        want = max(READ_CHUNK, len(rest))
        chunk = os.pread(self.fd, want, self._buf_start + len(rest))
        self._buf = rest + chunk
        self._eof = len(chunk) < want
        return bool(chunk)

    def next(self) -> tuple[int, Record] | None:
        while True:
            try:
                record, stop = codec.decode(self._buf, self._pos, self._eof)
                if isinstance(record, codec.Remove | codec.RemoveTentative):
                    self._check_after_one_byte_record(record, stop)
                elif self.check_sizes and stop - self._pos > 21:
                    real_end = codec.misplaced_end(self._buf, self._pos, stop)
                    if real_end is not None:
                        raise Malformed(self._buf[self._pos],
                                        _size_damage(self.offset, self._buf_start + real_end))
            except Incomplete:
                was_eof = self._eof
                if not self._fill() and was_eof:
                    return None
                continue
            except Malformed as e:
                raise self._damage_before(e) or CorruptJournalError(self.path, self.offset, e.opcode,
                                                                    e.reason) from None
            at = self.offset
            self._pos = stop
            self._previous = at if isinstance(record, codec.SIZED_RECORDS) else None
            return at, record

    def common_run(self, budget: int) -> list[codec.Common]:
        """The run of common records whole in the buffer from here (`codec.decode_common`), read.

        Empty when the next record needs `next()`: another kind, not yet read from the file,
        damaged, or an add past `budget` bytes of data. Records are checked as `next()` checks them.
        """
        run, self._pos, previous = codec.decode_common(self._buf, self._pos, self._buf_start, budget,
                                                       self.check_sizes)
        if run:
            self._previous = self._buf_start + previous if previous >= 0 else None
        return run

    def common_columns(self, budget: int) -> codec.CommonColumns:
        """`common_run`'s records as column buffers (`codec.decode_common_columns`)."""
        columns, self._pos, previous = codec.decode_common_columns(self._buf, self._pos, self._buf_start,
                                                                   budget, self.check_sizes)
        if columns[0]:
            self._previous = self._buf_start + previous if previous >= 0 else None
        return columns

    def _damage_before(self, error: Malformed) -> CorruptJournalError | None:
        """The record just before unreadable bytes, if its size field looks one bit too small.

        A size one bit too small ends a record inside its own data, which then reads as garbage:
        the record at fault is the one before, and it is named instead of the garbage. Not when
        whole records already start between the garbage and that end: stray bytes explain it too.
        """
        previous = self._previous
        if not self.check_sizes or previous is None:
            return None
        window = os.pread(self.fd, self.offset - previous + SIZE_CHECK_WINDOW, previous)
        end = codec.misplaced_end(window, 0, len(window), grow=True)
        unreadable = self.offset - previous
        if end is None or codec.resyncs_between(window, unreadable + 1, end, len(window)):
            return None
        return CorruptJournalError(self.path, previous, window[0], _size_damage(previous, previous + end)
                                   + f" (the bytes at offset {self.offset} are unreadable: {error.reason})")

    def _check_after_one_byte_record(self, record: Record, stop: int) -> None:
        """A REMOVE or REMOVE_TENTATIVE must be followed by an opcode (or the end of the file).

        If it is not, the one-byte record is most likely the damaged one (an add whose opcode byte
        was overwritten): the error names its offset, and nothing of it is applied.
        """
        if stop >= len(self._buf):
            if not self._eof:
                raise Incomplete
            return
        following = self._buf[stop]
        if following > codec.MAX_OPCODE:
            name = codec.OPCODE_NAMES[type(record)]
            raise Malformed(self._buf[self._pos], f"{name} at offset {self.offset} is followed by "
                                f"unknown opcode {following} at offset {self.offset + 1}: the record at "
                                f"{self.offset} is damaged (likely an add whose opcode byte was overwritten)")

    def leftover(self) -> int:
        """Bytes after the last complete record (non-zero means a torn tail)."""
        size = os.fstat(self.fd).st_size
        return size - self.offset

    def __iter__(self) -> Iterator[tuple[int, Record]]:
        while (entry := self.next()) is not None:
            yield entry


def torn_tail_damage(path: str, offset: int) -> str | None:
    """Why the incomplete record at `offset` (the end of the last file) is damage, not a torn write.

    A torn write leaves the first bytes of one record; a damaged size field leaves a record that
    claims to run past the end while whole records follow it (`codec.misplaced_end`).
    """
    with open(path, "rb") as f:
        f.seek(offset)
        tail = f.read()
    end = codec.misplaced_end(tail, 0, len(tail))
    if end is None:
        return None
    return _size_damage(offset, offset + end)


def _size_damage(offset: int, real_end: int) -> str:
    return (f"the size field of the record at offset {offset} looks damaged: with one bit changed it "
            f"would end at offset {real_end}, where whole records follow")


def read_records(path: str) -> Iterator[tuple[int, Record]]:
    """Every complete record of one file with its offset; a torn tail is simply not yielded."""
    reader = RecordReader(path)
    try:
        yield from reader
    finally:
        reader.close()


# ---------------------------------------------------------------------------------------------
# Writing


# Set by the server to record timings (storage knows no metrics library): called as
# timing(event, seconds) with event "write" (one append), "fsync" or "pack" (one whole pack).
timing: Callable[[str, float], None] | None = None


def record_timing(event: str, started: float) -> None:
    """Report the time since `started` (a `time.perf_counter()` reading) to `timing`, if set."""
    if timing is not None:
        timing(event, time.perf_counter() - started)


class JournalWriter:
    """Appends records to the live journal and keeps the promise of its sync policy.

    `sync_ms` 0: every append waits for an fsync covering it, in the next round of the group commit
    (`storage/group_commit.py`), which every journal with unsynced records shares. N > 0: an fsync
    at most every N ms after a write.
    None: never fsync (records still reach the OS on every append, so a process crash loses
    nothing; a power cut may).
    """

    def __init__(self, path: str, sync_ms: int | None, runtime: Runtime = DEFAULT_RUNTIME) -> None:
        self.path = path
        self.runtime = runtime
        self.sync_ms = sync_ms
        self.fd = -1  # opened by the first change (`open`): an idle queue holds no descriptor
        try:
            self.size = os.stat(path).st_size
        except FileNotFoundError:
            self.size = 0
        self.synced = self.size  # how far the file is known to be on disk
        self.damaged = False
        self._syncing: Event | None = None  # outside gevent: the fsync in progress, shared
        self._timer: Timer | None = None

    def open(self) -> None:
        """Open the file for appending if it is not open yet (raises OSError, e.g. out of descriptors)."""
        if self.fd >= 0:
            return
        created = not os.path.exists(self.path)
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        if created and self.sync_ms == 0:
            fsync_dir(os.path.dirname(self.path) or ".")  # the new file's name must survive a power cut too

    def append(self, data: bytes) -> None:
        """Hand `data` (one or many encoded records) to the OS. Never yields to other greenlets.

        If the write fails (disk full, I/O error) the file is cut back to where it was, so that
        nothing half-written stays at its end, and the OSError is raised.
        """
        started = time.perf_counter()
        if self.damaged:
            raise OSError(errno.EIO, f"a failed append could not be cut off {self.path}; restart to repair")
        if self.fd < 0:
            self.open()
        try:
            write_all(self.fd, data)
        except OSError:
            self._cut_back()
            raise
        self.size += len(data)
        record_timing("write", started)

    def _cut_back(self) -> None:
        """Remove whatever part of a failed append reached the file."""
        try:
            if os.fstat(self.fd).st_size != self.size:
                os.ftruncate(self.fd, self.size)
        except OSError:
            # Appending after the partial record would corrupt the journal: refuse from now on.
            self.damaged = True
            log.exception("cannot cut a failed append off the journal", file=self.path, size=self.size)

    def commit(self) -> None:
        """Wait as the sync policy requires for everything appended so far."""
        if self.sync_ms == 0:
            self.sync_to(self.size)
        elif self.sync_ms is not None and self._timer is None and self.synced < self.size:
            self._timer = self.runtime.call_later(self.sync_ms / 1000.0, self._periodic_sync)

    def sync_to(self, position: int) -> None:
        """Return once everything up to `position` is on disk (raises OSError when the fsync covering
        it failed). Where the runtime has a group commit (gevent: the server) it shares an fsync
        round with every other journal; elsewhere writers of this journal share its next fsync."""
        if self.synced >= position:
            return
        started = time.perf_counter()
        group_commit = self.runtime.group_commit()
        if group_commit is not None:
            group_commit.sync(self, position)
        else:
            self._sync_alone(position)
        record_timing("fsync", started)

    def _sync_alone(self, position: int) -> None:
        while self.synced < position:
            if self._syncing is not None:
                self._syncing.wait()
                continue
            done = self._syncing = self.runtime.event()
            target = self.size
            try:
                self.runtime.run_blocking(os.fdatasync, self.fd)  # the other tasks go on meanwhile
                self.synced = max(self.synced, target)
            finally:
                self._syncing = None
                done.set()

    def _periodic_sync(self) -> None:
        self._timer = None
        if self.fd >= 0:
            try:
                self.sync_to(self.size)
            except OSError:
                log.exception("periodic fsync of the journal failed", file=self.path)

    def flush(self) -> None:
        """fsync whatever is unsynced (shutdown, rotation)."""
        if self.fd >= 0:
            self.sync_to(self.size)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.fd >= 0:
            self.flush()
            os.close(self.fd)
            self.fd = -1

