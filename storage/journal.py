"""A queue's journal on disk: file names, reading records back, appending with a sync policy.

Files for queue `q` in the queue path: `q` is the live journal; `q.<ms>` are rotated journals,
replayed in timestamp order before the live one; `q.<ms>.pack` is a finished pack that makes every
rotated journal with a timestamp at or below its own dead; anything with `~~` is a temporary.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import gevent
import gevent.event
import structlog

from storage import codec
from storage.codec import Incomplete, Malformed, Record
from storage.errors import CorruptJournalError

log = structlog.get_logger("kestrel.journal")

READ_CHUNK = 1 << 20
_ROTATED = re.compile(r"^(?P<name>[^.~]+)\.(?P<ts>\d+)$")
_PACKED = re.compile(r"^(?P<name>[^.~]+)\.(?P<ts>\d+)\.pack$")


# ---------------------------------------------------------------------------------------------
# File names


@dataclass
class JournalFiles:
    """What the queue path holds for one queue."""

    rotated: list[tuple[int, str]] = field(default_factory=list)  # (timestamp, path), oldest first
    packs: list[tuple[int, str]] = field(default_factory=list)
    live: str | None = None

    def replay_order(self) -> list[str]:
        return [p for _, p in self.rotated] + ([self.live] if self.live else [])


def scan_queue_names(queue_path: str) -> set[str]:
    """Names of every queue with a journal in `queue_path` (sub-directories and temporaries ignored)."""
    names = set()
    for entry in os.scandir(queue_path):
        if not entry.is_file() or "~~" in entry.name:
            continue
        m = _ROTATED.match(entry.name) or _PACKED.match(entry.name)
        if m:
            names.add(m.group("name"))
        elif "." not in entry.name and "~" not in entry.name:
            names.add(entry.name)
    return names


def list_journal_files(queue_path: str, name: str) -> JournalFiles:
    files = JournalFiles()
    for entry in os.scandir(queue_path):
        if not entry.is_file() or "~~" in entry.name:
            continue
        if entry.name == name:
            files.live = entry.path
            continue
        m = _ROTATED.match(entry.name)
        if m and m.group("name") == name:
            files.rotated.append((int(m.group("ts")), entry.path))
            continue
        m = _PACKED.match(entry.name)
        if m and m.group("name") == name:
            files.packs.append((int(m.group("ts")), entry.path))
    files.rotated.sort()
    files.packs.sort()
    return files


def finish_interrupted_packs(queue_path: str, name: str) -> JournalFiles:
    """Complete a pack that a crash interrupted, as the format document prescribes.

    A `.pack` file is the state of every rotated journal at or before its timestamp: those are
    deleted and the pack takes the rotated name. Returns the files left to replay.
    """
    files = list_journal_files(queue_path, name)
    for ts, pack_path in files.packs:
        for rts, rpath in files.rotated:
            if rts <= ts:
                log.warning("deleting journal superseded by pack", file=rpath, pack=pack_path)
                os.unlink(rpath)
        os.rename(pack_path, os.path.join(queue_path, f"{name}.{ts}"))
        files = list_journal_files(queue_path, name)
    remove_temporaries(queue_path, name)
    return files


def remove_temporaries(queue_path: str, name: str) -> None:
    prefix = name + "~~"
    for entry in os.scandir(queue_path):
        if entry.is_file() and entry.name.startswith(prefix):
            os.unlink(entry.path)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------------
# Reading


class RecordReader:
    """Reads records forward from one journal file, resuming where it stopped.

    The file may still be growing (the live journal, read by read-behind): `next()` returns None
    when no complete record is there yet. Replay calls `finish()` at the end to learn whether the
    file ends in a torn record.
    """

    def __init__(self, path: str, offset: int = 0) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        self._buf = b""
        self._buf_start = offset  # file offset of _buf[0]
        self._pos = 0  # position in _buf
        self._eof = False

    @property
    def offset(self) -> int:
        """File offset of the next record."""
        return self._buf_start + self._pos

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

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
            except Incomplete:
                was_eof = self._eof
                if not self._fill() and was_eof:
                    return None
                continue
            except Malformed as e:
                raise CorruptJournalError(self.path, self.offset, e.opcode, e.reason) from None
            at = self.offset
            self._pos = stop
            return at, record

    def leftover(self) -> int:
        """Bytes after the last complete record (non-zero means a torn tail)."""
        size = os.fstat(self.fd).st_size
        return size - self.offset

    def __iter__(self) -> Iterator[tuple[int, Record]]:
        while (entry := self.next()) is not None:
            yield entry


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


def _fsync_in_pool(fd: int) -> None:
    """fsync on the hub's threadpool, so that the event loop keeps serving meanwhile."""
    gevent.get_hub().threadpool.apply(os.fsync, (fd,))


class JournalWriter:
    """Appends records to the live journal and keeps the promise of its sync policy.

    `sync_ms` 0: every append waits for an fsync covering it; writers that arrive while one fsync
    runs share the next (group commit). N > 0: an fsync at most every N ms after a write.
    None: never fsync (records still reach the OS on every append, so a process crash loses
    nothing; a power cut may).
    """

    def __init__(self, path: str, sync_ms: int | None) -> None:
        self.path = path
        self.sync_ms = sync_ms
        created = not os.path.exists(path)
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.size = os.fstat(self.fd).st_size
        if created and sync_ms == 0:
            fsync_dir(os.path.dirname(path) or ".")  # the new file's name must survive a power cut too
        self._synced = self.size
        self._syncing: gevent.event.Event | None = None
        self._timer: gevent.Greenlet | None = None

    def append(self, data: bytes) -> None:
        """Hand `data` (one or many encoded records) to the OS. Never yields to other greenlets."""
        started = time.perf_counter()
        written = os.write(self.fd, data)
        if written != len(data):  # a short write on a regular file: disk full or similar
            self._write_rest(data, written)
        self.size += len(data)
        record_timing("write", started)

    def commit(self) -> None:
        """Wait as the sync policy requires for everything appended so far."""
        if self.sync_ms == 0:
            self.sync_to(self.size)
        elif self.sync_ms is not None and self._timer is None and self._synced < self.size:
            self._timer = gevent.spawn_later(self.sync_ms / 1000.0, self._periodic_sync)

    def _write_rest(self, data: bytes, done: int) -> None:
        view = memoryview(data)
        while done < len(data):
            n = os.write(self.fd, view[done:])
            if n <= 0:
                raise OSError(f"cannot append to journal {self.path}")
            done += n

    def sync_to(self, position: int) -> None:
        """Return once everything up to `position` is on disk, sharing fsyncs with other writers."""
        while self._synced < position:
            if self._syncing is not None:
                self._syncing.wait()
                continue
            done = self._syncing = gevent.event.Event()
            target = self.size
            try:
                started = time.perf_counter()
                _fsync_in_pool(self.fd)
                record_timing("fsync", started)
                self._synced = max(self._synced, target)
            finally:
                self._syncing = None
                done.set()

    def _periodic_sync(self) -> None:
        self._timer = None
        if self.fd >= 0:
            self.sync_to(self.size)

    def flush(self) -> None:
        """fsync whatever is unsynced (shutdown, rotation)."""
        if self.fd >= 0:
            self.sync_to(self.size)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.kill(block=False)
            self._timer = None
        if self.fd >= 0:
            self.flush()
            os.close(self.fd)
            self.fd = -1

    def truncate(self, size: int) -> None:
        """Cut a torn tail found on replay before anything is appended after it."""
        os.ftruncate(self.fd, size)
        self.size = self._synced = size
