"""One journal file on disk, in either format: appending with a sync policy (`JournalWriter`),
reading through a buffer (`BufferedFile`), cutting a damaged tail off keeping a copy, and the
timings of writes and fsyncs. The system calls that write and fsync are `disk.py`'s.

Which files a queue has is `queue_path.py`'s; the byte layouts are the codecs'
(`kestrel2/codec.py`, `kestrel3/codec.py`): this module moves bytes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Callable
from typing import Any, Final

import structlog
from mypy_extensions import trait

# (imported whole: the compiled build holds the module in a C static, where a name imported from its
# package is looked up in this module's dictionary on each append; its functions stay looked up on
# it each call, so that the fault tests' replacements are seen)
import kestrel.storage.disk as disk
from kestrel.storage.clock import perf_counter
from kestrel.storage.deferred_log import log_later
from kestrel.storage.errors import JournalNotWritable
from kestrel.storage.runtime import DEFAULT_RUNTIME, Event, Runtime, Timer
from kestrel.storage.shared_fsync import SharedFsync
from kestrel.storage.timing import Timing
from kestrel.storage.write_gate import LARGE_APPEND, WriteGate

# `disk`'s dictionary, where each append finds `write` or `writev_all`: compiled, a key of it costs
# about 130 instructions and the module's attribute a generic look-up of about 270; either way the
# fault tests' replacement of the function is what is called.
_disk_names: Final[dict[str, Any]] = vars(disk)

log = structlog.get_logger("kestrel.journal")

READ_CHUNK = 1 << 20
# What a read-behind cursor reads at a time: it keeps the rest buffered, and hundreds of queues in
# read-behind must not hold a megabyte each (src/kestrel/storage/memory.py counts it).
CURSOR_CHUNK = 64 << 10


def copy_from(path: str, offset: int, copy: str) -> None:
    """Save the bytes of `path` from `offset` on, durably, as `copy` (its folder exists). Raises
    OSError (and leaves no copy)."""
    try:
        with disk.open_to_read(path) as src, open(copy, "wb") as dst:
            src.seek(offset)
            shutil.copyfileobj(src, dst)
            dst.flush()
            os.fsync(dst.fileno())
        disk.fsync_path(os.path.dirname(copy))
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(copy)
        raise


def cut_keeping_copy(path: str, offset: int, copy: str) -> str:
    """Cut `path` at `offset`, first saving what is cut, durably, as `copy` (its folder exists);
    return the copy's path. Raises OSError (and changes nothing) when the copy cannot be written,
    JournalNotWritable when the file cannot be cut (append-only, its owner, a read-only mount): the
    copy is removed again and nothing changed, and a queue is refused alone, as one whose journal
    cannot be opened is."""
    copy_from(path, offset, copy)
    try:
        os.truncate(path, offset)
    except OSError as e:
        with contextlib.suppress(OSError):
            os.unlink(copy)
        raise JournalNotWritable(path, e) from None
    return copy


def check_writable(path: str) -> None:
    """Raise JournalNotWritable if the file at `path` exists and cannot be opened for appending:
    start-up finds it, rather than every change (a queue's files are opened by its first change)."""
    try:
        os.close(disk.open_file(path, os.O_WRONLY | os.O_APPEND))
    except FileNotFoundError:
        return
    except OSError as e:
        raise JournalNotWritable(path, e) from None


# ---------------------------------------------------------------------------------------------
# Reading


class BufferedFile:
    """A file read forward through a buffer (the record readers of both journal formats).

    A record larger than the buffer is read whole, or its item on its own, in one read of the size
    its header gives (`read_at`), never gathered in chunks. A reader with the `gate` of its
    journal's queue (a read-behind cursor) reads from the disk off the loop through it
    (src/kestrel/storage/write_gate.py): a record from `LARGE_APPEND` bytes, and whatever the page
    cache does not hold.
    """

    def __init__(self, path: str, offset: int, gate: WriteGate | None = None) -> None:
        self.path = path
        self.chunk = READ_CHUNK  # bytes read at a time (CURSOR_CHUNK for a read-behind cursor)
        self.gate = gate  # where a large record is read off the loop (None: on the caller's thread)
        self.fd = disk.open_file(path, os.O_RDONLY)
        self._buf = b""
        self._buf_start = offset  # file offset of _buf[0]
        self._pos = 0  # position in _buf

    @property
    def offset(self) -> int:
        """File offset of the next record."""
        return self._buf_start + self._pos

    @property
    def buffered(self) -> int:
        """Bytes read ahead and held."""
        return len(self._buf)

    def read_at(self, size: int, at: int) -> bytes:
        """`size` bytes of the file at `at` (fewer if it ends first), in one read: a record larger
        than the buffer, once the caller found the file holds it (a damaged size field allocates
        nothing). Where the reader has a gate, as `fill_at` reads."""
        gate = self.gate
        if gate is None:
            return disk.pread(self.fd, size, at)
        return self._read_gated(gate, size, at)

    def fill_at(self, size: int, at: int) -> bytes:
        """The buffer's next `size` bytes, from `at` (fewer if the file ends first). A reader with a
        gate (a read-behind cursor, reading inside a change) never waits for the disk on the loop
        (`_read_gated`); one without (replay, the tools) reads on the caller's thread."""
        gate = self.gate
        if gate is None:
            return os.pread(self.fd, size, at)
        return self._read_gated(gate, size, at)

    def _read_gated(self, gate: WriteGate, size: int, at: int) -> bytes:
        """What the page cache holds is read on the loop, below `LARGE_APPEND` bytes (more would
        hold the loop for its copy); the rest, which waits for the disk (seconds on one that
        stalls), on the thread pool through the gate, the change waiting (`WriteGate.read`)."""
        data = disk.pread_cached(self.fd, size, at) if size < LARGE_APPEND else b""
        got = len(data)
        if got == size or at + got >= os.fstat(self.fd).st_size:
            return data
        rest = gate.read(disk.pread, self.fd, size - got, at + got)
        return data + rest if got else rest

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


# ---------------------------------------------------------------------------------------------
# Writing


class Timings:
    """Each storage event's Timing, given the seconds one took, set by the server to record timings
    (storage knows no metrics library); None: not recorded. One report per event, as every
    request's append reports its write: an attribute each, where a lookup by the event's name in a
    dict cost an append about 130 instructions."""

    __slots__ = ("write", "fsync", "pack")

    def __init__(self) -> None:
        self.write: Timing | None = None  # one append
        self.fsync: Timing | None = None
        self.pack: Timing | None = None  # one whole pack


timings: Final = Timings()


def record_timing(timing: Timing | None, started: float) -> None:
    """Report the time since `started` (a `perf_counter()` reading) to `timing`, one of `timings`."""
    if timing is not None:
        timing.observe(perf_counter() - started)


@trait
class AppendLog:
    """A commit log's side of a file that logs its appends (`commit_log.FileLog`, which the log's
    module, importing this one, derives from it): a trait, so that the compiled build calls its
    methods through the class's table, not by name (two calls a change under `always`)."""

    def appended(self, journal: JournalWriter, offset: int, data: bytes | list[bytes]) -> None: ...

    def commit(self, journal: JournalWriter) -> None: ...

    def falls_back(self) -> bool:
        raise NotImplementedError


class JournalWriter:
    """Appends records to the live journal and keeps the promise of its sync policy.

    `sync_ms` 0: every append waits for an fsync covering it, in the next round of the group commit
    (`src/kestrel/storage/fsync/group_commit.py`), which every journal with unsynced records shares. N > 0: an
    fsync at most every N ms after a write.
    None: never fsync (records still reach the OS on every append, so a process crash loses
    nothing; a power cut may).
    """

    def __init__(self, path: str, sync_ms: int | None, runtime: Runtime = DEFAULT_RUNTIME,
                 end: int | None = None) -> None:
        self.path = path
        self.runtime = runtime
        self.sync_ms = sync_ms
        self.fd = -1  # opened by the first change (`open`): an idle queue holds no descriptor
        # A preallocated file (zeros written and synced ahead, past `end`) is written over by
        # position, so that an fdatasync after a write commits no new size or block.
        self.preallocated = end is not None
        if end is not None:
            self.size = end
        else:
            try:
                self.size = os.stat(path).st_size
            except FileNotFoundError:
                self.size = 0
        self.synced = self.size  # how far the file is known to be on disk
        self.damaged = False
        # The commit log this file's appends go to as well, if it logs them
        # (src/kestrel/storage/commit_log.py): its sync policy is then kept through the log. Its
        # records name the file, so creating it fsyncs its directory whatever the policy.
        self.log: AppendLog | None = None
        # Where a large append is written off the loop, the changes of its journal waiting
        # (src/kestrel/storage/write_gate.py); None: every append on the caller's thread.
        self.gate: WriteGate | None = None
        # Its file was created and its name is not durable yet where `names_durably` asks
        # (`sync_name` makes it so): an `open` for an append, or its first fsync, sees to it first.
        self.unnamed = False
        # A file `open` creates has its name made durable by `sync_name` (its first fsync, or the
        # caller) rather than on the loop before anything is written: where nothing relies on the
        # name before the file's first fsync (a Kestrel 3 writer file a rotation starts).
        self.names_later = False
        # The file this one follows in its log (a rotation's), until its bytes are known durable:
        # this file is created only after them, so that a power cut can tear a log's last file only
        # (src/kestrel/storage/torn_tail.py), never one a later file's name outlived (`create`,
        # `_follow_on_loop`). Set where the policy fsyncs (`names_durably`): under `never` without
        # the log nothing survives a power cut by promise, and no fsync is made for it.
        self.follows: JournalWriter | None = None
        self._naming = SharedFsync(runtime)  # the folder's fsync of `sync_name`
        self._syncing = SharedFsync(runtime)  # outside gevent: the file's fsync of `sync_to`
        self._timer: Timer | None = None
        # uses of the descriptor off the loop now (fsyncs, large appends: `hold`), and the descriptors
        # closed meanwhile, which the last of them closes (`release`); None while there are none
        self._holds = 0
        self._closed_held: list[int] | None = None

    @property
    def names_durably(self) -> bool:
        """Whether a file this writer creates has its folder fsynced, so that its name survives a
        power cut: under every policy that fsyncs the file (a periodic sync's fsyncs vouch for
        nothing under a name a power cut may take back), and wherever the commit log's records
        name it; not under `never` without the log."""
        return self.sync_ms is not None or self.log is not None

    def set_sync(self, sync_ms: int | None) -> None:
        """A reload's sync policy. A file made where no name was made durable (`never` without the
        log) and kept under one that fsyncs has its name made durable before the first fsync it
        answers for (`sync_to`), or that fsync would vouch for bytes under a name a power cut can
        take back."""
        if sync_ms is not None and not self.names_durably:
            self.unnamed = True
        self.sync_ms = sync_ms

    def open(self) -> None:
        """Open the file for appending if it is not open yet (raises OSError, e.g. out of descriptors).
        A file it creates, or one `create` made whose name is not durable yet (`unnamed`), has its
        name made durable too where `names_durably` asks: by an fsync of its folder on the loop (a
        change never yields), before anything is written to it; or, where the writer `names_later`,
        by `sync_name`, which the caller (a queue's creation, which may wait) or the file's first
        fsync (`sync_to`) calls."""
        if self.fd >= 0:
            return
        created = not os.path.exists(self.path)
        if created and self.follows is not None:
            self._follow_on_loop()
        appending = 0 if self.preallocated else os.O_APPEND
        self.fd = disk.open_file(self.path, os.O_WRONLY | os.O_CREAT | appending)
        if (created or self.unnamed) and self.names_durably:
            if self.names_later:
                self.unnamed = True
            else:
                disk.fsync_path(os.path.dirname(self.path) or ".")  # its name must survive a power cut too
                self.unnamed = False

    def sync_name(self) -> None:
        """Make the name of the file `open` (`names_later`) or `create` made durable, if it is not
        yet (`unnamed`): its folder's fsync on the runtime's thread pool, the caller waiting and the
        other tasks going on. A caller that finds one under way waits for it (it began once the
        file was made, so it covers the name), and fsyncs the folder itself should it fail. Raises
        OSError (and the name is still to be made durable)."""
        self._naming.until(lambda: not self.unnamed, self._fsync_folder)

    def _fsync_folder(self) -> None:
        """Make the file's name durable: its folder's fsync, on the thread pool."""
        self.runtime.run_blocking(disk.fsync_path, os.path.dirname(self.path) or ".")
        self.unnamed = False

    def create(self) -> None:
        """Create the file, empty, if it does not exist (a new queue's journal, as Kestrel's setup
        creates it: the queue is found again after a restart; a rotation's new live journal), its
        name made durable where `names_durably` asks, by its folder's fsync on the runtime's thread
        pool (the caller waits, the other tasks go on). Meanwhile an `open` for an append makes the
        name durable itself, on the loop, before it writes: no record goes to a file whose name a
        power cut may lose; where the writer `names_later`, the append goes on, and this, or the
        file's first fsync, makes the name durable (a file an append created first included).
        Raises OSError."""
        if self.fd < 0 and not self.size and not os.path.exists(self.path):
            if self.follows is not None and self.follows.fd >= 0:  # (closed: fsynced first, or not kept)
                self.follows.sync_to(self.follows.size)
            self.follows = None
            os.close(disk.open_file(self.path, os.O_WRONLY | os.O_CREAT))
            self.unnamed = self.names_durably
        self.sync_name()

    def _follow_on_loop(self) -> None:
        """Make the bytes of the file this one follows durable before this one is created, by an
        fdatasync on the caller's thread (an `open` for an append, which never yields, creating
        the file before the task `create` runs in): a folder's fsync, this file's or any other
        made meanwhile, would make the new name durable while the bytes before it may be lost."""
        before, self.follows = self.follows, None
        if before is None or before.synced >= before.size:
            return
        target, fd = before.size, before.hold()
        if fd < 0:  # closed: a close fsyncs first (`close`), or it was not to be kept
            return
        try:
            os.fdatasync(fd)
        finally:
            before.release()
        before.synced = max(before.synced, target)

    def append(self, data: bytes) -> None:
        """Hand `data` (one or many encoded records) to the OS. Never yields to other greenlets
        (what it logs is written after: `src/kestrel/storage/deferred_log.py`), but for an append
        of `LARGE_APPEND` bytes or more, written off the loop while its journal's changes wait at
        the `gate` (`src/kestrel/storage/write_gate.py`).

        If the write fails (disk full, I/O error) the file is cut back to where it was, so that
        nothing half-written stays at its end, and the OSError is raised.
        """
        started = perf_counter()
        if self.damaged or self.fd < 0:
            self._ready()
        try:
            if self.preallocated:
                written = disk.pwrite(self.fd, data, self.size)
                if written < len(data):
                    disk.pwrite_all(self.fd, data[written:], self.size + written)
            elif len(data) >= LARGE_APPEND and self.gate is not None:
                self._off_loop(self.gate, disk.write_all, data)
            else:
                written = _disk_names["write"](self.fd, data)
                if written < len(data):
                    disk.write_all(self.fd, memoryview(data)[written:])
        except OSError:
            self._cut_back()
            raise
        offset = self.size
        self.size += len(data)
        record_timing(timings.write, started)
        if self.log is not None:
            self.log.appended(self, offset, data)  # (no list made and freed a change)

    def append_parts(self, parts: list[bytes]) -> None:
        """`append` the records given as pieces, in one gathering write (`disk.writev_all`): the pieces
        (an item among them) reach the OS from where they are, not copied into one string."""
        started = perf_counter()
        if self.damaged or self.fd < 0:
            self._ready()
        gate = self.gate
        size = 0  # (a loop the compiled build runs in C: `sum(map(len, ...))` looks up three builtins)
        for part in parts:
            size += len(part)
        try:
            if gate is not None and size >= LARGE_APPEND:
                written = self._off_loop(gate, disk.writev_all, parts)
            else:
                written = _disk_names["writev_all"](self.fd, parts)
        except OSError:
            self._cut_back()
            raise
        offset = self.size
        self.size += written
        record_timing(timings.write, started)
        if self.log is not None:  # the pieces as they are: the log's write joins them with the rest
            self.log.appended(self, offset, parts)

    def _off_loop(self, gate: WriteGate, write: Callable[[int, Any], int | None], data: Any) -> int:
        """`write(fd, data)` on the thread pool through `gate`, the descriptor held meanwhile
        (`hold`) as every use of it off the loop holds it; what `write` returns (0 for None)."""
        fd = self.hold()
        try:
            return gate.off_loop(write, fd, data) or 0
        finally:
            self.release()

    def _ready(self) -> None:
        """Open the file for an append, or raise OSError when a failed one left it damaged."""
        if self.damaged:
            raise OSError(errno.EIO, f"a failed append could not be cut off {self.path}; restart to repair")
        if self.fd < 0:
            self.open()

    def _cut_back(self) -> None:
        """Remove whatever part of a failed append reached the file."""
        try:
            if os.fstat(self.fd).st_size != self.size:
                os.ftruncate(self.fd, self.size)
        except OSError as e:
            # Appending after the partial record would corrupt the journal: refuse from now on.
            self.damaged = True
            log_later(self.runtime, log.error, "cannot cut a failed append off the journal", file=self.path,
                      size=self.size, exc_info=e)

    def commit(self) -> None:
        """Wait as the sync policy requires for everything appended so far (through the commit
        log, if the file logs its appends)."""
        sync_ms = self.sync_ms
        if self.log is not None:
            self.log.commit(self)
        elif sync_ms is not None and sync_ms == 0:  # (`None == 0` compiled is a compare of two objects)
            self.sync_to(self.size)
        else:
            self.sync_later()

    def falls_back(self) -> bool:
        """Whether a commit now falls back on this file's own fsync though the caller holds its
        acknowledgements (`commit_log.FileLog.falls_back`)."""
        log = self.log
        return log is not None and log.falls_back()

    def sync_later(self) -> None:
        """Under a periodic sync: fsync what is appended within the interval."""
        if self.sync_ms and self._timer is None and self.synced < self.size:
            self._timer = self.runtime.call_later(self.sync_ms / 1000.0, self._periodic_sync)

    def sync_to(self, position: int) -> None:
        """Return once everything up to `position` is on disk (raises OSError when the fsync covering
        it failed). Where the runtime has a group commit (gevent: the server) it shares an fsync
        round with every other journal; elsewhere writers of this journal share its next fsync. A
        file whose name is not durable yet (`unnamed`) has it made so first."""
        if self.synced >= position:
            return
        if self.unnamed:  # its bytes on disk vouch for nothing while a power cut may lose its name
            self.sync_name()
        started = perf_counter()
        group_commit = self.runtime.group_commit()
        if group_commit is not None:
            group_commit.sync(self, position)
        else:
            self._sync_alone(position)
        record_timing(timings.fsync, started)

    def _sync_alone(self, position: int) -> None:
        self._syncing.until(lambda: self.synced >= position, self._fdatasync)

    def _fdatasync(self) -> None:
        """fsync what is appended now, the descriptor held meanwhile (`hold`)."""
        target = self.size
        fd = self.hold()
        if fd < 0:
            raise OSError(errno.EBADF, f"{self.path} was closed before its fsync")
        try:
            self.runtime.run_blocking(os.fdatasync, fd)  # the other tasks go on meanwhile
        finally:
            self.release()
        self.synced = max(self.synced, target)

    def hold(self) -> int:
        """The descriptor, for an fsync or a large append that runs off the loop (a thread, the C
        helper's threads, native AIO), kept open until its `release`; -1 once closed. A `close`
        meanwhile closes it when the last hold is released: closed under an fsync, it failed with
        EBADF, or its number, taken by another file opened meanwhile, fsynced that file instead."""
        fd = self.fd
        if fd >= 0:
            self._holds += 1
        return fd

    def release(self) -> None:
        """The use that took a `hold` has ended: the descriptors closed meanwhile are closed with
        the last. Never raises (an error closing is logged)."""
        self._holds -= 1
        closed = self._closed_held
        if self._holds or closed is None:
            return
        self._closed_held = None
        for fd in closed:
            try:
                os.close(fd)
            except OSError as e:
                log_later(self.runtime, log.error, "cannot close a journal file", file=self.path, exc_info=e)

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

    def close(self, sync: bool = True) -> None:
        """fsync what is unsynced (unless not to `sync`: a file about to be deleted) and close: the
        descriptor at once, or, while an fsync off the loop holds it, once the last ends (`hold`)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.fd >= 0:
            if sync:
                self.flush()
            fd, self.fd = self.fd, -1
            if not self._holds:
                os.close(fd)
            elif self._closed_held is None:
                self._closed_held = [fd]  # an fsync of it is in flight: closed when it ends (`release`)
            else:
                self._closed_held.append(fd)


class Seal:
    """One rotated file the `Sealer` finishes: `old`'s writer closed, then `then` run; a `held`
    place waits for `Sealer.release`. `path` names the file where it is now, in a log line."""

    def __init__(self, old: JournalWriter | None, then: Callable[[], None] | None,
                 held: bool = False, path: str | None = None) -> None:
        self.old = old
        self.then = then
        self.held = held
        self.path = path or (old.path if old is not None else None)


class Sealer:
    """Rotated files finished in the background, in order: each fsynced and closed, then, in a
    thread, its folder fsynced (a rotation renamed or created it on the loop without: the manifest
    must list no name a power cut can take back) and `then` run (the manifest reads the whole file
    for its checksum). `wait` (close) returns once
    every one is done, the ones in flight included. A file whose finish is not known yet (a pack
    taken at its rotation may replace it) holds its place in that order (`hold`) until `release`
    says what to run for it."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self._pending: list[Seal] = []
        self._running = 0
        self._done: Event | None = None

    def add(self, old: JournalWriter | None, then: Callable[[], None]) -> None:
        """Finish `old` (None: a file closed already), then run `then`."""
        self._pending.append(Seal(old, then))
        self.runtime.spawn(self.run)

    def hold(self, path: str) -> Seal:
        """A place in the order for the file at `path`, closed already, whose finish `release` gives
        later: the files rotated after it wait behind it meanwhile."""
        seal = Seal(None, None, held=True, path=path)
        self._pending.append(seal)
        return seal

    def release(self, seal: Seal, then: Callable[[], None] | None) -> None:
        """What to run for a held place (None: nothing, the file went with the pack)."""
        seal.then, seal.held = then, False
        self.runtime.spawn(self.run)

    def run(self) -> None:
        """Finish the pending files, one at a time and in rotation order (the manifest must never
        list a file while an older rotated one is not); a second caller leaves it to the first.

        A file that fails to finish stays first, and the newer ones wait behind it: the next
        rotation (or `wait`) tries it again; so do they behind a place held. Unlisted, they are all
        newer than every file listed, which the next start takes as rotations not yet recorded;
        listing a newer one would make it an older file missing from the manifest, refused as a
        stray."""
        if self._running:
            return
        self._running = 1
        try:
            while self._pending and not self._pending[0].held:
                seal = self._pending[0]
                try:
                    if seal.old is not None:
                        seal.old.close()
                    if seal.then is not None:
                        self.runtime.run_blocking(_named_then, seal.path, seal.then)
                except OSError:  # logged; the manifest on disk stays as it was (written whole or not at all)
                    log.exception("rotated journal file not sealed into the manifest; tried again at the "
                                  "next rotation", file=seal.path,
                                  waiting=len(self._pending) - 1)
                    return
                del self._pending[0]
        finally:
            self._running = 0
            if self._done is not None:
                self._done.set()
                self._done = None

    def wait(self) -> None:
        while self._running:
            done = self._done = self._done or self.runtime.event()
            done.wait()
        self.run()


def _named_then(path: str | None, then: Callable[[], None]) -> None:
    """Make the name `path` durable (its folder fsynced), then run `then` (blocking: in a thread)."""
    if path is not None:
        disk.fsync_path(os.path.dirname(path) or ".")
    then()
