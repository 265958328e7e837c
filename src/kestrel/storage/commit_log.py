"""The commit log: one write-ahead log for every Kestrel 2 queue under `sync_journal: always`
(`commit_log: on`; docs/durability.md).

Why: with a journal per queue, a turn of the event loop in which 16 such queues change costs 16
fdatasyncs. With the commit log, each change's journal bytes are still appended to its queue's
journal (so every reader of the journal sees it at once), and also to one log shared by the
server: every change of a loop turn in one `write`, and the replies of that turn wait for one
fdatasync of that log instead of one of each journal. A background checkpoint then fdatasyncs
the journals that took records and deletes the log's older segments.

Files: `<queue_path>/.kestrel/commit-log/<seq>` segments, replayed in order (in the server's own
directory, which no scan of journals reads). A segment starts with `MARK`, then records:

    u32 body size | u32 CRC-32 of the body | body
    body: u16 queue name size | queue name (UTF-8) | u64 epoch | u64 offset | journal bytes

`epoch` names the journal file the bytes went to without its name, which rotation changes: the
stamp of the queue's latest rotation when they were written (0 before any). Bytes of epoch S belong
to the live journal while the queue has no rotated journal newer than S, else to the oldest one
newer than S. `offset` is where they start in that file. So recovery is idempotent by position: a
record is applied only where the journal ends before it, and never twice.

Two rules keep that mapping true: a queue's new live journal is created (its directory fsynced,
which makes the rename of the old one durable) before any record of its new epoch is written; and
no journal file is deleted or replaced (a pack, a deleted queue) before a checkpoint has dropped
every record written before.
"""

from __future__ import annotations

import contextlib
import errno
import os
import struct
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import gevent
import structlog

from kestrel.storage import filenames, layout, torn_tail
from kestrel.storage.disk import fsync_path, pwrite_all, write_all
from kestrel.storage.errors import CommitLogDamaged
from kestrel.storage.fsync.group_commit import Round
from kestrel.storage.journal_file import JournalWriter, copy_from, cut_keeping_copy, record_timing
from kestrel.storage.queue_path import JournalFiles, list_journal_files
from kestrel.storage.runtime import Event, Runtime, Timer

log = structlog.get_logger("kestrel.commit_log")

HELD_PREFIX = "held-"  # records kept for a queue recovery refused: `held-<queue>`
MARK = b"KCLOG\x00\x00\x01"  # what a segment starts with (format version 1)
_HEAD = struct.Struct("<II")  # body size, CRC-32 of the body
_NAME = struct.Struct("<H")
_PLACE = struct.Struct("<QQ")  # epoch, offset
_MIN_BODY = _NAME.size + 1 + _PLACE.size  # a name of one byte, no journal bytes
MAX_BODY = 1 << 31
CHECKPOINT_SECONDS = 1.0  # how often the journals that took records are made durable
SEGMENT_BYTES = 64 << 20  # a segment this large asks for a checkpoint at once

# Test hook: called with a step name before each file operation of a recovery; raising stops the
# recovery there, which is how the tests simulate a crash at every step.
failpoint: Callable[[str], None] | None = None


def _step(name: str) -> None:
    if failpoint is not None:
        failpoint(name)


# ---------------------------------------------------------------------------------------------
# Records


@dataclass(frozen=True)
class Record:
    """Journal bytes of one queue: where they go (`epoch`, `offset`) and what they are."""

    queue: str
    epoch: int
    offset: int
    data: bytes


def encode_record(queue: str, epoch: int, offset: int, data: bytes) -> bytes:
    name = queue.encode("utf-8")
    body = b"".join((_NAME.pack(len(name)), name, _PLACE.pack(epoch, offset), data))
    return _HEAD.pack(len(body), zlib.crc32(body)) + body


def _decode_body(body: bytes) -> Record | None:
    """The record a body holds, or None if its fields do not fit together."""
    if len(body) < _MIN_BODY:
        return None
    (name_size,) = _NAME.unpack_from(body, 0)
    place = _NAME.size + name_size
    if name_size == 0 or place + _PLACE.size > len(body):
        return None
    try:
        queue = body[_NAME.size:place].decode("utf-8")
    except UnicodeDecodeError:
        return None
    epoch, offset = _PLACE.unpack_from(body, place)
    return Record(queue, epoch, offset, body[place + _PLACE.size:])


def _read_record(data: bytes, at: int) -> tuple[Record | None, int, str, bool]:
    """The record at `at` if it reads whole and verifies, the offset after it, and otherwise why
    not and whether its first bytes could start a record (a plausible size)."""
    if len(data) - at < _HEAD.size:
        return None, len(data), "a record header cut short", True
    size, crc = _HEAD.unpack_from(data, at)
    end = at + _HEAD.size + size
    if size < _MIN_BODY or size > MAX_BODY:
        return None, end, f"a record size of {size} bytes", False
    if end > len(data):
        return None, end, "a record running past the end of the file", True
    body = data[at + _HEAD.size:end]
    record = _decode_body(body) if zlib.crc32(body) == crc else None
    if record is None:
        return None, end, "a record whose checksum or fields are wrong", True
    return record, end, "", True


class _LogRecords:
    """How the log's records read, for the one torn-tail rule (src/kestrel/storage/torn_tail.py): a
    record whose checksum verifies is evidence enough."""

    def body_start(self, tail: bytes) -> int:
        return _HEAD.size

    def whole_records_at(self, tail: bytes, pos: int, end: int) -> bool:
        return _read_record(tail, pos)[0] is not None

    def explain(self, tail: bytes, end: int, offset: int) -> str | None:
        return None


LOG_RECORDS = _LogRecords()


@dataclass(frozen=True)
class Damage:
    """Bytes of a segment that are neither records nor a torn tail: `at` to `end`. `record` is what
    they hold when only the size field was damaged (the body between the two verifies); `claims`,
    what they seem to hold without verifying, for naming the queue they belong to."""

    at: int
    end: int
    reason: str
    record: Record | None = None
    claims: Record | None = None


@dataclass
class Segment:
    """What one segment file holds: its records with their offsets, what is damaged, and where a
    torn tail begins."""

    path: str
    records: list[tuple[int, Record]] = field(default_factory=list)
    torn_at: int | None = None  # offset of an incomplete last write, if any
    damage: list[Damage] = field(default_factory=list)


def read_segment(path: str, last: bool) -> Segment:
    """Read a segment. What cannot be read whole is judged by the one torn-tail rule: a torn last
    write (`torn_at`, possible in the `last` segment alone), or damage, after which whole records
    are looked for again. A damaged span whose body verifies once the next record is found (only
    its size field was damaged) is a record too.
    """
    with open(path, "rb") as f:
        data = f.read()
    segment = Segment(path)
    if len(data) < len(MARK) or not data.startswith(MARK):
        if MARK.startswith(data) or not any(data):
            segment.torn_at = 0 if data else None  # created and cut short before its mark was written
        else:
            segment.damage.append(Damage(0, len(data), "not a commit log segment (no mark at its start)"))
        return segment
    at = len(MARK)
    while at < len(data):
        record, end, reason, startable = _read_record(data, at)
        if record is not None:
            segment.records.append((at, record))
            at = end
            continue
        error = torn_tail.judge(path, at, reason, LOG_RECORDS, last, startable, tail=(data[at:], True))
        if error is None:
            segment.torn_at = at
            break
        tail = data[at:]
        found = torn_tail.first_whole_records(tail, _HEAD.size, len(tail), LOG_RECORDS.whole_records_at)
        resume = len(data) if found is None else at + found
        damage = _damage(data, at, resume, error.reason)
        segment.damage.append(damage)
        if damage.record is not None:
            segment.records.append((at, damage.record))
        at = resume
    return segment


def _damage(data: bytes, at: int, end: int, reason: str) -> Damage:
    """The damaged span `at`..`end`, with the record it held if its body verifies."""
    body = data[at + _HEAD.size:end]
    claims = _decode_body(body)
    if claims is not None and zlib.crc32(body) == _HEAD.unpack_from(data, at)[1]:
        return Damage(at, end, reason, record=claims)
    return Damage(at, end, reason, claims=claims)


# ---------------------------------------------------------------------------------------------
# The files


def directory(queue_path: str) -> str:
    return filenames.own_path(queue_path, filenames.COMMIT_LOG_NAME)


def segment_paths(queue_path: str) -> list[str]:
    """The log's segments, oldest first (copies set aside, `<seq>.torn-<ms>`, are not segments)."""
    folder = directory(queue_path)
    try:
        names = [n for n in os.listdir(folder) if n.isdigit()]
    except FileNotFoundError:
        return []
    return [os.path.join(folder, n) for n in sorted(names, key=int)]


def held_paths(queue_path: str) -> dict[str, str]:
    """The records kept for queues that recovery refused, by queue (`held-<queue>`)."""
    folder = directory(queue_path)
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return {}
    return {n[len(HELD_PREFIX):]: os.path.join(folder, n) for n in names
            if n.startswith(HELD_PREFIX) and not filenames.is_temporary(n)}


def pending(queue_path: str) -> bool:
    """Whether the log holds records: a server runs on the path, or stopped without a clean
    shutdown (a clean one leaves no log), or recovery refused a queue and keeps its records."""
    segments = segment_paths(queue_path)
    return bool(held_paths(queue_path)) or any(os.path.getsize(p) > len(MARK) for p in segments)


def pending_message(queue_path: str) -> str:
    """What the offline readers of journals say while `pending`."""
    return (f"recovery is pending: the commit log {directory(queue_path)} holds records (a server runs "
            "on this path, or stopped without a clean shutdown); the journals hold every change "
            "unless the machine lost power since, which recovery repairs: start the server, or run "
            f"`kestrel journal recover {queue_path}` with it stopped")


def _remove_directory(queue_path: str) -> None:
    """Remove the log's directory once it holds no segment, so that the queue path holds exactly
    what it holds without a log (it stays while copies of torn tails or held records are kept in it)."""
    folder = directory(queue_path)
    try:
        os.rmdir(folder)
    except OSError as e:
        if e.errno != errno.ENOTEMPTY:
            raise
        fsync_path(folder)
        return
    fsync_path(os.path.dirname(folder))


def _create_segment(path: str, records: bytes = b"") -> None:
    """A new segment holding its mark (and `records`), durable with its name."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        write_all(fd, MARK + records)
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_path(os.path.dirname(path))


# ---------------------------------------------------------------------------------------------
# Recovery


@dataclass
class Recovery:
    """What recovery did: records written into journals, copies it kept, and the queues it
    refused (their records are kept in `held-<queue>` until they can be placed)."""

    written: int = 0
    refused: dict[str, CommitLogDamaged] = field(default_factory=dict)
    copies: list[str] = field(default_factory=list)


def _journal_for(queue_path: str, files: JournalFiles, record: Record) -> str | None:
    """The journal file the record's bytes belong to, of its queue's `files` (see the module's doc
    on epochs); None when only a pack is newer than its epoch."""
    stamps = [ts for ts, _ in files.rotated] + [ts for ts, _ in files.packs]
    if not stamps or record.epoch >= max(stamps):
        return filenames.live_path(queue_path, record.queue)
    newer = [(ts, p) for ts, p in files.rotated if ts > record.epoch]
    return min(newer)[1] if newer else None


class _Placing:
    """Records placed into their journals by position, in log order (`place`)."""

    def __init__(self, queue_path: str, now_ms: int, recovery: Recovery, dry_run: bool = False) -> None:
        self.queue_path = queue_path
        self.now_ms = now_ms
        self.recovery = recovery
        self.dry_run = dry_run  # count what would be written and copied; change nothing
        self.journals: set[str] = set()
        self._scanned: dict[str, JournalFiles] = {}
        self._copied: set[str] = set()  # journals whose replaced bytes are kept already

    def holds(self, record: Record) -> bool:
        """Whether the record's journal holds its bytes at its offset."""
        journal = self.journal(record)
        if journal is None:
            return False
        try:
            with open(journal, "rb") as f:
                f.seek(record.offset)
                return f.read(len(record.data)) == record.data
        except FileNotFoundError:
            return False

    def journal(self, record: Record) -> str | None:
        files = self._scanned.get(record.queue)
        if files is None:
            files = self._scanned[record.queue] = list_journal_files(self.queue_path, record.queue)
        return _journal_for(self.queue_path, files, record)

    def place(self, segment: str, at: int, record: Record) -> str | None:
        """Put the record's bytes at their offset in their journal; why it cannot be, if it cannot.

        Where the journal already holds them, nothing is written. Where it ends at their offset,
        they are appended; where it ends inside them, or holds other bytes there (a write the disk
        lost or damaged: zeros after a power cut, a changed byte), they are written over what is
        there, a copy of the journal from there on kept first (`.kestrel/aside/<file>.torn-<ms>`
        when it held the start of these bytes, `.replaced-<ms>` otherwise). Where it ends before
        their offset, the bytes between are missing and no copy holds them: nothing is written.
        """
        journal = self.journal(record)
        if journal is None:
            return f"no journal of queue {record.queue!r} for epoch {record.epoch}: only a pack is newer"
        try:
            size = os.path.getsize(journal)
        except FileNotFoundError:
            size = -1
        end = record.offset + len(record.data)
        present = b""
        if size > record.offset:
            with open(journal, "rb") as f:
                f.seek(record.offset)
                present = f.read(len(record.data))
            if present == record.data:
                self.journals.add(journal)
                return None
        elif size < record.offset and not (size == -1 and record.offset == 0):
            return (f"journal {journal} ends at {max(size, 0)}, before offset {record.offset} where the "
                    f"commit log's record {segment} offset {at} goes: the bytes between are missing and "
                    "no copy holds them")
        if size > record.offset and journal not in self._copied:
            self._copied.add(journal)
            torn = size < end and record.data.startswith(present)
            self._keep_copy(journal, record.offset, "torn" if torn else "replaced")
        self.recovery.written += 1
        if self.dry_run:
            return None
        _step("write")
        fd = os.open(journal, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            pwrite_all(fd, record.data, record.offset)
        finally:
            os.close(fd)
        self.journals.add(journal)
        return None

    def _keep_copy(self, journal: str, offset: int, label: str) -> None:
        """Copy the journal from `offset` on to `.kestrel/aside/` before it is written over."""
        name = os.path.basename(journal)
        if self.dry_run:
            self.recovery.copies.append(filenames.set_aside_path(self.queue_path, name, label, self.now_ms))
            return
        copy = layout.aside_path(self.queue_path, name, label, self.now_ms)
        _step("copy-journal")
        copy_from(journal, offset, copy)
        self.recovery.copies.append(copy)
        log.warning("journal lacks or holds other bytes where the commit log's record goes; the log's "
                    "record written over them, a copy kept", file=journal, offset=offset, copy=copy)


def _refusal(queue: str, where: str, at: int, reason: str, held: int) -> CommitLogDamaged:
    return CommitLogDamaged(where, at, None, reason, queue, held)


def recover(queue_path: str, now_ms: int, salvage: bool = False, dry_run: bool = False) -> Recovery:
    """Put what the commit log holds into the journals, make them durable and empty the log.
    Idempotent: killed at any step, it can run again.

    Each record that verifies (or whose body verifies once only its size field was found damaged)
    is placed by position (`_Placing.place`). A queue is refused where that is impossible: its
    journal ends before a record's offset, only a pack is newer than a record's epoch, or the log
    is damaged where no record of it can be read (a damaged span naming no queue refuses every
    queue with records in the log, since it may be any of theirs); its records are kept in
    `held-<queue>` and read again at the next recovery. With `salvage` a refused queue's journal is
    kept as it is and its records set aside (`.kestrel/aside/`) instead. A torn last write of the
    log is cut off, a copy kept as `<segment>.torn-<ms>`. With `dry_run` nothing is changed: the
    result says what would be done (`kestrel journal check`). Raises OSError.
    """
    recovery = Recovery()
    held = held_paths(queue_path)
    paths = list(held.values()) + segment_paths(queue_path)
    last = max([i for i, p in enumerate(paths) if os.path.getsize(p) > len(MARK)], default=len(paths) - 1)
    segments = [read_segment(p, i >= last) for i, p in enumerate(paths)]
    placing = _Placing(queue_path, now_ms, recovery, dry_run)
    reasons: dict[str, tuple[str, int, str]] = {}  # refused queue -> (where, offset, why)
    named = {r.queue for s in segments for _, r in s.records}
    for segment in segments:
        for damage in segment.damage:
            if damage.record is not None:
                continue
            claims = damage.claims
            if claims is not None and placing.holds(claims):
                continue  # the journal holds what the damaged record seems to: its good copy
            why = f"the commit log is damaged ({damage.reason})"
            for queue in [claims.queue] if claims is not None else sorted(named):
                reasons.setdefault(queue, (segment.path, damage.at, why + (
                    "" if claims is not None else ", where no record can be read: it may be this queue's")))
    records: dict[str, list[Record]] = {}
    for segment in segments:
        for at, record in segment.records:
            records.setdefault(record.queue, []).append(record)
            if record.queue in reasons:
                continue
            refusal = placing.place(segment.path, at, record)
            if refusal is not None:
                reasons[record.queue] = (segment.path, at, refusal)
    if dry_run:
        recovery.refused = {q: _refusal(q, where, at, why, len(records.get(q, [])))
                            for q, (where, at, why) in sorted(reasons.items())}
        return recovery
    for queue, (where, at, why) in sorted(reasons.items()):
        kept = records.get(queue, [])
        if salvage:
            copy = _keep_aside(queue_path, queue, kept, now_ms)
            recovery.copies.append(copy)
            log.error("commit log records of a queue cannot be placed; its journal is kept as it is and "
                      "the records set aside (salvage)", queue=queue, reason=why, records=len(kept),
                      copy=copy)
        else:
            _step("hold")
            _hold(queue_path, queue, kept)
            recovery.refused[queue] = _refusal(queue, where, at, why, len(kept))
    for journal in sorted(placing.journals):
        _step("fsync-journal")
        fsync_path(journal)
    if placing.journals:
        fsync_path(queue_path)  # a journal recovery created
    for segment in segments:
        if segment.torn_at is not None or segment.damage:
            at = segment.torn_at if segment.torn_at is not None else 0
            label = "torn" if not segment.damage else "damaged"
            _step("cut-segment")
            copy = cut_keeping_copy(segment.path, at, f"{segment.path}.{label}-{now_ms}")
            log.warning(f"{label} bytes in the commit log; a copy kept", file=segment.path, offset=at,
                        copy=copy)
        holder = next((q for q, p in held.items() if p == segment.path), None)
        if holder is not None and holder in recovery.refused:
            continue  # rewritten by `_hold`
        _step("delete-segment")
        os.unlink(segment.path)
    if segments:
        _remove_directory(queue_path)
    if placing.journals or recovery.refused:
        log.info("commit log recovered", segments=len(segments), journals=len(placing.journals),
                 records=sum(len(s.records) for s in segments), written=recovery.written,
                 refused=sorted(recovery.refused))
    return recovery


def _hold(queue_path: str, queue: str, records: list[Record]) -> None:
    """Keep a refused queue's records, durably, in `held-<queue>` (replacing what it held)."""
    folder = directory(queue_path)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, HELD_PREFIX + queue)
    temporary = path + filenames.TEMPORARY_MARK
    with contextlib.suppress(FileNotFoundError):
        os.unlink(temporary)
    _create_segment(temporary, b"".join(encode_record(r.queue, r.epoch, r.offset, r.data) for r in records))
    os.replace(temporary, path)
    fsync_path(folder)


def _keep_aside(queue_path: str, queue: str, records: list[Record], now_ms: int) -> str:
    """Salvage: a refused queue's records, as a segment, in `.kestrel/aside/`; the copy's path."""
    copy = layout.aside_path(queue_path, f"commit-log-{queue}", "unplaced", now_ms)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(copy)
    _create_segment(copy, b"".join(encode_record(r.queue, r.epoch, r.offset, r.data) for r in records))
    return copy


# ---------------------------------------------------------------------------------------------
# The live log


class Turn:
    """The records of one loop turn: written in one `write`, then made durable together.

    `done` is set once they are durable (or could not be made so: `error`) where the runtime has a
    group commit, else once they are written and each waiter syncs the log itself (`durable` is
    False then)."""

    __slots__ = ("chunks", "segment", "position", "error", "durable", "done", "started")

    def __init__(self, done: Event) -> None:
        self.chunks: list[bytes] = []
        self.segment: _Segment | None = None  # where they were written
        self.position = 0  # the segment's size once they were
        self.error: OSError | None = None
        self.durable = False
        self.done = done
        self.started = 0.0  # when they were written (`perf_counter`), for the fsync timing


class _Segment:
    def __init__(self, writer: JournalWriter) -> None:
        self.writer = writer
        self.journals: dict[JournalWriter, int] = {}  # journal -> end of its last record here
        self.failed = False  # an fsync of it failed: its waiters rely on their journals instead


class CommitLog:
    """The server's commit log (`open` it once recovery has run; `close` it after every queue).

    Under the gevent runtime the records of a turn are written once the turn has run, by a callback
    that also puts the log in the group commit's next round and wakes every waiter of the turn
    when that round has run: a change waits once, and no greenlet runs for the turn. Elsewhere
    each record is written at once, and its waiter fsyncs the log.
    """

    def __init__(self, queue_path: str, runtime: Runtime, checkpoint_seconds: float = CHECKPOINT_SECONDS,
                 segment_bytes: int = SEGMENT_BYTES) -> None:
        self.queue_path = queue_path
        self.directory = directory(queue_path)
        self.runtime = runtime
        self.checkpoint_seconds = checkpoint_seconds
        self.segment_bytes = segment_bytes
        self._group_commit = runtime.group_commit()
        self._lock = runtime.lock()
        self._segments: list[_Segment] = []  # oldest first; the last takes records
        self._seq = 0
        self._turn: Turn | None = None
        self._checkpointing: Event | None = None
        self._timer: Timer | None = None
        self.checkpoints = 0

    def open(self) -> None:
        """Start the first segment (the log holds none: recovery ran). Raises OSError."""
        os.makedirs(self.directory, exist_ok=True)
        fsync_path(self.queue_path)
        self._seq = 1
        path = os.path.join(self.directory, str(self._seq))
        _create_segment(path)
        self._segments.append(_Segment(JournalWriter(path, 0, self.runtime)))
        self._timer = self.runtime.call_later(self.checkpoint_seconds, self._tick)

    # -----------------------------------------------------------------------------------------
    # Appending and waiting

    def add(self, journal: JournalWriter, queue: str, epoch: int, offset: int, data: bytes) -> Turn:
        """Log bytes just appended to `journal` at `offset`; the turn to wait for. Never yields."""
        with self._lock:
            segment = self._segments[-1]
            segment.journals[journal] = offset + len(data)
            turn = self._turn
            if turn is None:
                turn = self._turn = Turn(self.runtime.event())
                if self._group_commit is not None:
                    gevent.get_hub().loop.run_callback(self._write_turn)
            turn.chunks.append(encode_record(queue, epoch, offset, data))
            if self._group_commit is None:
                self._write_turn()
            return turn

    def _write_turn(self) -> None:
        """Write the records of the turn in one `write` (cut back if it fails: `JournalWriter`);
        under a group commit, put the log in its next round, which sets the turn `done`."""
        with self._lock:
            turn = self._turn
            if turn is None:
                return
            self._turn = None
            segment = turn.segment = self._segments[-1]
            try:
                segment.writer.append(turn.chunks[0] if len(turn.chunks) == 1 else b"".join(turn.chunks))
                turn.position = segment.writer.size
                turn.started = time.perf_counter()
            except OSError as e:
                turn.error = e
            except BaseException as other:  # no waiter may wait for a write that will never end
                turn.error = OSError(errno.EIO, f"writing the commit log failed: {other!r}")
                raise
            finally:
                turn.chunks = []
                if turn.error is not None or self._group_commit is None or segment.failed:
                    turn.done.set()  # failed: its waiters fall back on their journals
                else:
                    round_ = self._group_commit.join(segment.writer)
                    round_.done.rawlink(lambda _: self._turn_synced(turn, round_))
            if segment.writer.size >= self.segment_bytes and self._checkpointing is None:
                self.runtime.spawn(self._checkpoint_logged)

    def _turn_synced(self, turn: Turn, round_: Round) -> None:
        """The group commit's round that took the turn's segment has run: wake the turn's waiters
        (with the round's error, which makes them fall back on their journals)."""
        segment = turn.segment
        assert segment is not None
        writer = segment.writer
        try:
            if writer.synced >= turn.position:  # the round, or a checkpoint, made the records durable
                turn.durable = True
                record_timing("fsync", turn.started)
            else:
                error = round_.failed.get(writer)
                segment.failed = True  # no later fsync of it can vouch for what it holds
                turn.error = error or OSError(errno.EIO, f"the commit log {writer.path} was not synced")
        finally:
            turn.done.set()  # whatever happens, no waiter waits on for a round that has run

    def sync(self, turn: Turn, journal: JournalWriter, journal_end: int) -> None:
        """Return once the turn's records are on disk. Where the log could not take them (a failed
        write or fsync of the log), `journal`'s own fsync up to `journal_end` keeps the promise.

        Raises OSError when that fails too.
        """
        if not turn.done.is_set():
            turn.done.wait()
        if turn.durable:
            return
        segment = turn.segment
        error = turn.error
        if error is None and segment is not None and segment.failed:
            error = OSError(errno.EIO, f"an fsync of the commit log {segment.writer.path} failed")
        if error is None and segment is not None:  # no group commit: this waiter syncs the log
            try:
                segment.writer.sync_to(turn.position)
                return
            except OSError as e:
                segment.failed = True
                error = e
        log.warning("the commit log could not take a change; its journal is fsynced instead",
                    file=journal.path, error=str(error))
        journal.sync_to(journal_end)

    def stats(self) -> dict[str, int]:
        """What the log holds now and how often it was checkpointed (the admin page's figures)."""
        with self._lock:
            return {"segments": len(self._segments),
                    "bytes": sum(segment.writer.size for segment in self._segments),
                    "journals": len({j for segment in self._segments for j in segment.journals}),
                    "checkpoints": self.checkpoints}

    # -----------------------------------------------------------------------------------------
    # Checkpoints

    def _tick(self) -> None:
        self._timer = None
        if self._segments and self._segments[-1].journals and self._checkpointing is None:
            self._checkpoint_logged()
        if self._segments:  # not closed
            self._timer = self.runtime.call_later(self.checkpoint_seconds, self._tick)

    def _checkpoint_logged(self) -> None:
        try:
            self.checkpoint()
        except OSError as e:
            log.error("commit log checkpoint failed; its segments stay until one succeeds", error=str(e))

    def checkpoint(self) -> None:
        """Make durable every journal with records in the log up to now, then delete the segments
        holding those records. Returns once a checkpoint begun after the call has finished.

        Raises OSError (the segments stay; the next checkpoint tries again).
        """
        while (running := self._checkpointing) is not None:
            running.wait()
        done = self._checkpointing = self.runtime.event()
        try:
            self._switch()
            retired = self._segments[:-1]
            ends: dict[JournalWriter, int] = {}
            for segment in retired:
                for journal, end in segment.journals.items():
                    ends[journal] = max(ends.get(journal, 0), end)
            self._sync_journals(ends)
            for segment in retired:
                writer = segment.writer
                writer.synced = writer.size  # its records are in their journals: nothing to fsync
                writer.close()
                os.unlink(writer.path)
                self._segments.remove(segment)
            self.runtime.run_blocking(fsync_path, self.directory)
            self.checkpoints += 1
        finally:
            self._checkpointing = None
            done.set()

    def _switch(self) -> None:
        """Start a new segment: what was logged so far is in the older ones."""
        path = os.path.join(self.directory, str(self._seq + 1))
        self.runtime.run_blocking(_create_segment, path)
        with self._lock:
            self._seq += 1
            self._write_turn()  # this turn's records so far go to the older segment
            self._segments.append(_Segment(JournalWriter(path, 0, self.runtime)))

    def _sync_journals(self, ends: dict[JournalWriter, int]) -> None:
        """fdatasync the journals up to those positions, together (one group commit round)."""
        errors: list[OSError] = []

        def sync(journal: JournalWriter, end: int) -> None:
            try:
                journal.sync_to(end)
            except OSError as e:
                errors.append(e)

        # A closed journal was flushed by its close; one whose close failed is still open.
        tasks = [self.runtime.spawn(lambda j=j, e=e: sync(j, e))  # type: ignore[misc]
                 for j, e in ends.items() if j.fd >= 0 and j.synced < e]
        for task in tasks:
            task.join()
        if errors:
            raise errors[0]

    # -----------------------------------------------------------------------------------------
    # Closing

    def close(self) -> None:
        """After every queue closed (their journals fsynced): delete the segments. Any journal
        still open (its close failed) keeps them for the next start's recovery."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while (running := self._checkpointing) is not None:
            running.wait()
        self._write_turn()
        segments, self._segments = self._segments, []
        still_open = [j.path for s in segments for j in s.journals if j.fd >= 0]
        for segment in segments:
            writer = segment.writer
            if not still_open:
                writer.synced = writer.size
            with contextlib.suppress(OSError):
                writer.close()
            if not still_open:
                os.unlink(writer.path)
        if still_open:
            log.error("journals still open at shutdown; the commit log is kept for recovery",
                      journals=still_open)
            return
        _remove_directory(self.queue_path)
