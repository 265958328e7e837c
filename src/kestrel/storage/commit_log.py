"""The commit log: one write-ahead log for every queue under `sync_journal: always` or a periodic
sync, in either format (`commit_log: on`, the default; docs/durability.md).

Why: with a journal per queue, a turn of the event loop in which 16 such queues change costs 16
fdatasyncs. With the commit log, each change's bytes are still appended to its queue's files (so
every reader of them sees the change at once), and also to one log shared by the server: every
change of a loop turn in one `write`, and the replies of that turn wait for one fdatasync of that
log instead of one of each journal (a periodic sync's interval, for one round of the log within
it). A background checkpoint then fdatasyncs the files that took records and deletes the log's
older segments.

Files: `<queue_path>/.kestrel/commit-log/<seq>` segments, replayed in order (in the server's own
directory, which no scan of journals reads). A segment starts with `MARK`, then records, then
zeros to its end: each segment is laid down ahead (its mark and zeros written and made durable,
off the event loop, while the one before it fills), and records are written over the zeros by
position, so that the fdatasync a round waits for commits data alone, no new size or block. Where
the zeros begin, the records end (a segment outgrowing what was laid down grows by appending).
Segments of format version 1 (`MARK_V1`) were appended and end with their last record; they are
still read. A record:

    u32 body size | u32 CRC-32 of the body | body
    body: u16 queue name size | queue name (UTF-8) | u64 kind << 56 | epoch | u64 offset | bytes

The kind says which file of the queue the bytes went to, and how recovery puts them back:

- JOURNAL (0), a Kestrel 2 journal, by position. `epoch` names the file without its name, which
  rotation changes: the stamp of the queue's latest rotation when the bytes were written (0 before
  any). Bytes of epoch S belong to the live journal while the queue has no rotated journal newer
  than S, else to the oldest one newer than S. `offset` is where they start in that file.
- WRITER (1), a Kestrel 3 writer file, by position: `epoch` is the file's number (`<queue>.<epoch>`),
  and a new file's header is logged too, at offset 0.
- READER (2), a Kestrel 3 reader checkpoint (the queue's name is the reader's: `q` or `q+child`),
  by meaning: the bytes are the READ_DONE and READ_HEAD records appended. A checkpoint is rewritten
  whole now and then (durably, before anything later is logged), so a position in it does not last;
  but what a reader consumed stays consumed, so recovery appends what the checkpoint lacks of
  them, whatever version of the file it finds.
- DAMAGED (3), among a refused queue's held records alone (`held-<queue>`, `recover`): bytes of
  the log that were damaged where a record of that queue may be (`offset`: where they were in their
  segment). No file takes them: each later recovery judges them again, so that the queue stays
  refused until its files hold what they seem to, or `--salvage` sets them aside.

So recovery is idempotent: a record is applied only where its file lacks it, and never twice.

Two rules keep the positions true: a new file's name is durable (its directory fsynced, which also
makes a rotation's rename durable) before any record of it could be placed in another file: a
Kestrel 2 live journal's before any record of it is written, since a record of epoch S placed after
a power cut that lost the rename would land in the journal that had the name before; a Kestrel 3
writer file's before a checkpoint drops its records (its first fsync makes it so: recovery makes a
file whose creation a power cut lost again from its logged header, by its number). And no file
records name is deleted or replaced (a pack, a writer file every reader passed, a deleted queue or
reader) before a checkpoint has dropped every record written before.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import re
import struct
import zlib
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Final, cast

import gevent
import structlog

from kestrel.storage import acknowledgements, filenames, layout, torn_tail
from kestrel.storage.acknowledgements import Acknowledgements, Settled
from kestrel.storage.clock import perf_counter
from kestrel.storage.disk import fsync_path, open_file, open_to_read, pwrite_all, write_all
from kestrel.storage.errors import CommitLogDamaged, CorruptJournalError, InvalidQueueName
from kestrel.storage.fsync.group_commit import Round
from kestrel.storage.journal_file import (
    AppendLog,
    JournalWriter,
    copy_from,
    cut_keeping_copy,
    record_timing,
    timings,
)
from kestrel.storage.kestrel2.codec import Incomplete, Malformed
from kestrel.storage.kestrel3.files import checkpoint_lacks
from kestrel.storage.no_lock import NO_LOCK
from kestrel.storage.queue_path import JournalFiles, file_owner, list_journal_files
from kestrel.storage.runtime import Event, OneAtATime, Runtime, Timer, all_side_by_side

log = structlog.get_logger("kestrel.commit_log")

HELD_PREFIX = "held-"  # records kept for a queue recovery refused: `held-<queue>`
MARK = b"KCLOG\x00\x00\x02"  # what a segment starts with (format version 2: laid down ahead)
MARK_V1 = b"KCLOG\x00\x00\x01"  # a segment of version 1: appended, no zeros after its records
PREPARED_NAME = f"next{filenames.TEMPORARY_MARK}"  # the next segment, laid down ahead
# The least a segment is laid down with (more when the last one took more): a server logging a
# change a second writes 64 KB of zeros a second ahead, not a megabyte.
PREALLOCATE_BYTES = 1 << 16
_HEAD = struct.Struct("<II")  # body size, CRC-32 of the body
_NAME = struct.Struct("<H")
_PLACE = struct.Struct("<QQ")  # kind << 56 | epoch, offset
_U64 = struct.Struct("<Q")
JOURNAL, WRITER, READER, DAMAGED = 0, 1, 2, 3  # the kinds of record (the module's doc)
_KINDS = (JOURNAL, WRITER, READER, DAMAGED)
_EPOCH = (1 << 56) - 1
_MIN_BODY = _NAME.size + 1 + _PLACE.size  # a name of one byte, no journal bytes
MAX_FILE_OFFSET = (1 << 63) - 1  # what a seek takes
MAX_BODY = 1 << 31
CHECKPOINT_SECONDS = 1.0  # how often the journals that took records are made durable
SEGMENT_BYTES = 64 << 20  # a segment this large asks for a checkpoint at once
GATHER_SECONDS = 0.002  # the longest a round waits for the changes the last one let it expect

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
    """Bytes of one queue: which of its files they go to (`kind`, `epoch`), where (`offset`, for
    the kinds placed by position), and what they are."""

    queue: str
    epoch: int
    offset: int
    data: bytes
    kind: int = JOURNAL


def encode_record(queue: str, epoch: int, offset: int, data: bytes, kind: int = JOURNAL) -> bytes:
    out = bytearray()
    append_record(out, record_head(queue, kind, epoch), offset, data)
    return bytes(out)


def record_head(queue: str, kind: int, epoch: int) -> bytes:
    """The fields that begin the body of every record of one file: the queue's name with its size,
    and the file's kind and epoch (`kind << 56 | epoch`)."""
    name = queue.encode("utf-8")
    return _NAME.pack(len(name)) + name + _U64.pack(kind << 56 | epoch)


def append_record_python(out: bytearray, head: bytes, offset: int, data: bytes | list[bytes]) -> bool:
    """Append a record to `out`: its head encoded already (`record_head`), as a file that logs keeps
    it, then `offset`, and its bytes as the one piece or the pieces they were appended from (not
    joined first). The reference of the compiled `_log_record.append_record`
    (src/kestrel/storage/_log_record.c); True, as it says."""
    if not isinstance(data, list):
        data = [data]
    fields = _U64.pack(offset)
    crc = zlib.crc32(fields, zlib.crc32(head))
    size = len(head) + len(fields)
    for part in data:
        crc = zlib.crc32(part, crc)
        size += len(part)
    out += _HEAD.pack(size, crc)
    out += head
    out += fields
    for part in data:
        out += part
    return True


def _zero_shifts() -> list[list[int]]:
    """The operators appending 2**k zero bytes to a CRC-32 (k from 0 to 39), each as its 32 columns
    (zlib's crc32_combine squares them again at every call): made once, on the first combine."""
    shifts: list[list[int]] = []
    one_bit = [0xEDB88320] + [1 << n for n in range(31)]  # one zero bit
    operator = one_bit
    for _ in range(3):  # one zero bit squared three times: one zero byte
        operator = [_gf2_times(operator, column) for column in operator]
    for _ in range(40):
        shifts.append(operator)
        operator = [_gf2_times(operator, column) for column in operator]
    return shifts


def _gf2_times(operator: list[int], vector: int) -> int:
    total = 0
    column = 0
    while vector:
        if vector & 1:
            total ^= operator[column]
        vector >>= 1
        column += 1
    return total


_shifts: list[list[int]] = []


def crc32_combine_python(crc1: int, crc2: int, length: int) -> int:
    """The CRC-32 (zlib's) of two ranges joined, from the first's, the second's and the second's
    `length`: the reference of the compiled `_log_record.crc32_combine` (zlib's own)."""
    if not _shifts:
        _shifts.extend(_zero_shifts())
    k = 0
    while length:
        if length & 1:
            crc1 = _gf2_times(_shifts[k], crc1)
        length >>= 1
        k += 1
    return crc1 ^ crc2


try:
    from kestrel.storage._log_record import append_record as _compiled
    from kestrel.storage._log_record import crc32_combine as _combine
except ImportError:  # built without a C compiler (or zlib): the Python alone
    _compiled = append_record_python
    _combine = crc32_combine_python
_append_compiled: Final = _compiled  # a C static in the compiled build, not a lookup a record
crc32_combine: Final = _combine


def append_record(out: bytearray, head: bytes, offset: int, data: bytes | list[bytes]) -> None:
    """`append_record_python`, compiled where the build made src/kestrel/storage/_log_record.c (every
    change under `always` encodes a record: one call, no struct packer or checksum call per field);
    what it declines (a part not bytes) the Python encodes."""
    if not _append_compiled(out, head, offset, data):
        append_record_python(out, head, offset, data)


def _decode_body(body: bytes | memoryview) -> Record | None:
    """The record a body holds, or None if its fields do not fit together (its checksum unchecked).
    The fields are read first and the data copied last: bytes that merely claim a record's size
    cost no copy unless their fields fit (the torn-tail rule asks this at every place of a torn
    record)."""
    fields = _body_fields(body)
    return None if fields is None else _record(body, fields)


def _record(body: bytes | memoryview, fields: tuple[str, int, int, int]) -> Record:
    queue, kind_epoch, offset, data_at = fields
    return Record(queue, kind_epoch & _EPOCH, offset, bytes(body[data_at:]), kind_epoch >> 56)


def _body_fields(body: bytes | memoryview) -> tuple[str, int, int, int] | None:
    """The queue, `kind << 56 | epoch` and offset a body holds, and where its bytes start, or None
    if its fields do not fit together: among them a name no queue can have and an offset no file
    can reach, which the log never writes (a damaged record's claims built paths and seeks of them)."""
    if len(body) < _MIN_BODY:
        return None
    (name_size,) = _NAME.unpack_from(body, 0)
    place = _NAME.size + name_size
    if name_size == 0 or place + _PLACE.size > len(body):
        return None
    kind_epoch, offset = _PLACE.unpack_from(body, place)
    if kind_epoch >> 56 not in _KINDS or offset > MAX_FILE_OFFSET:
        return None
    try:
        queue = str(body[_NAME.size:place], "utf-8")
        filenames.check_queue_name(queue)
    except (UnicodeDecodeError, InvalidQueueName):
        return None
    return queue, kind_epoch, offset, place + _PLACE.size


def _read_record(data: bytes, at: int, checksums: RangeChecksums | None = None
                 ) -> tuple[Record | None, int, str, bool]:
    """The record at `at` if it reads whole and verifies, the offset after it, and otherwise why
    not and whether its first bytes could start a record (a plausible size). Its body's checksum
    is taken only once its fields fit, from `checksums` when given (places whose claimed bodies
    overlap), else over the body."""
    if len(data) - at < _HEAD.size:
        return None, len(data), "a record header cut short", True
    size, crc = _HEAD.unpack_from(data, at)
    start = at + _HEAD.size
    end = start + size
    if size < _MIN_BODY or size > MAX_BODY:
        return None, end, f"a record size of {size} bytes", False
    if end > len(data):
        return None, end, "a record running past the end of the file", True
    body = memoryview(data)[start:end]
    fields = _body_fields(body)
    if fields is None or (zlib.crc32(body) if checksums is None else checksums.crc(start, end)) != crc:
        return None, end, "a record whose checksum or fields are wrong", True
    return _record(body, fields), end, "", True


class RangeChecksums:
    """CRC-32s of ranges of `data` (zlib's, as `zlib.crc32` of the range), each taken in time
    bounded by `STEP` bytes whatever its length: from the CRC-32s of `data`'s prefixes at every
    `STEP` bytes, taken once when first asked, joined by `crc32_combine`. The torn-tail rule checks
    the bodies claimed at place after place of one tail: crafted bytes can make those bodies long
    and overlapping, and checking each whole would grow with places × body sizes."""

    STEP: Final = 1 << 10

    def __init__(self, data: bytes) -> None:
        self.data = data
        self._view = memoryview(data)
        self._prefixes: list[int] = []

    def crc(self, start: int, end: int) -> int:
        if end - start <= 2 * self.STEP:
            return zlib.crc32(self._view[start:end])
        return crc32_combine(self._prefix(start), self._prefix(end), end - start)

    def _prefix(self, at: int) -> int:
        """The CRC-32 of `data[:at]`."""
        prefixes, view, step = self._prefixes, self._view, self.STEP
        if not prefixes:
            crc = 0
            prefixes.append(crc)
            for mark in range(step, len(view) + 1, step):
                crc = zlib.crc32(view[mark - step:mark], crc)
                prefixes.append(crc)
        mark = at // step
        return zlib.crc32(view[mark * step:at], prefixes[mark])


class LogRecords:
    """How the log's records read, for the one torn-tail rule (src/kestrel/storage/torn_tail.py): a
    record whose checksum verifies is evidence enough. One for each segment judged: it keeps the
    prefix checksums of the tail it is asked about (`RangeChecksums`)."""

    def __init__(self) -> None:
        self._checksums = RangeChecksums(b"")

    def body_start(self, data: bytes, at: int) -> int:
        return at + _HEAD.size

    evidence_at_end = 1
    evidence_before_nonsense = 1

    def starts(self, data: bytes) -> re.Pattern[bytes]:
        """Where a record's head could be: a size field whose last byte lets the record end within
        `data` (below 16 MB: zero), and a name size that is not zero. Item data whose every place
        reads as a head is rare; without this, each place was read in Python."""
        most = min(len(data) >> 24, MAX_BODY >> 24)
        return re.compile(rb"(?=[\s\S]{3}[\x00-\x%02x][\s\S]{4}(?:[^\x00]|\x00[^\x00]))" % most)

    def record_at(self, data: bytes, pos: int) -> tuple[int, int] | None:
        if self._checksums.data is not data:
            self._checksums = RangeChecksums(data)
        record, end, _, _ = _read_record(data, pos, self._checksums)
        return None if record is None else (end, 1)

    def explain(self, data: bytes, at: int, end: int, offset: int, chains: torn_tail.Chains) -> str | None:
        return None


@dataclass(frozen=True)
class Damage:
    """Bytes of a segment that are neither records nor a torn tail: `at` to `end`. `record` is what
    they hold when only the size field was damaged (the body between the two verifies); `claims`,
    what they seem to hold without verifying, for naming the queue they belong to. `hides`: whether
    a record could be lost in them (not in a damaged mark: its place and size are the mark's).
    `data`: the bytes, kept with the records of a queue they refuse."""

    at: int
    end: int
    reason: str
    record: Record | None = None
    claims: Record | None = None
    hides: bool = True
    data: bytes = b""


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
    with open_to_read(path) as f:
        data = f.read()
    segment = Segment(path)
    laid_down = data.startswith(MARK)
    if not laid_down and not data.startswith(MARK_V1):
        if MARK.startswith(data) or torn_tail.zeros_only(data):
            segment.torn_at = 0 if data else None  # created and cut short before its mark was written
            return segment
        # Damage like any other: whole records are looked for after it (those of a segment whose
        # mark alone was damaged are all there; in a file that is no segment, none is found), and
        # none of its bytes is believed a torn write: what cannot be read may hide records.
        segment.damage.append(Damage(0, len(MARK), f"its mark {data[:len(MARK)]!r} is damaged", hides=False))
        laid_down = _differing(data, MARK) <= _differing(data, MARK_V1)  # the version it is nearer
        last = False
    at = len(MARK)
    log_records = LogRecords()
    held = torn_tail.Held(data, log_records)
    while at < len(data):
        record, end, reason, startable = _read_record(data, at)
        if record is not None:
            segment.records.append((at, record))
            at = end
            continue
        if laid_down and held.ends_cleanly(at):
            break
        error = torn_tail.judge(path, at, reason, log_records, last, startable, held=held)
        if error is None:
            segment.torn_at = at
            break
        found = held.resumes(at)
        resume = len(data) if found is None else found
        damage = _damage(data, at, resume, error.reason)
        segment.damage.append(damage)
        if damage.record is not None:
            segment.records.append((at, damage.record))
        at = resume
    return segment


def _differing(data: bytes, mark: bytes) -> int:
    """How many bytes of `data`'s start differ from `mark`."""
    return sum(a != b for a, b in zip(data, mark, strict=False)) + max(len(mark) - len(data), 0)


def _damage(data: bytes, at: int, end: int, reason: str) -> Damage:
    """The damaged span `at`..`end`, with the record it held if its body verifies."""
    body = data[at + _HEAD.size:end]
    claims = _decode_body(body)
    if claims is not None and zlib.crc32(body) == _HEAD.unpack_from(data, at)[1]:
        return Damage(at, end, reason, record=claims)
    return Damage(at, end, reason, claims=claims, data=data[at:end])


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
    return bool(held_paths(queue_path)) or any(_holds_records(p) for p in segments)


def _holds_records(path: str) -> bool:
    """Whether a segment holds anything but its mark and the zeros laid down after it."""
    with open_to_read(path) as f:
        f.seek(len(MARK))
        return not torn_tail.zeros_only(f.read())


def pending_note(queue_path: str) -> str | None:
    """What the offline readers of journals say of the commit log before they read them: that
    recovery is pending, or which segment could not be read to tell (one line, never a traceback:
    the journals are read all the same); None when neither."""
    try:
        held = pending(queue_path)
    except OSError as e:
        return (f"cannot read {e.filename or directory(queue_path)}: {e.strerror or e}: whether the commit "
                "log holds records the journals lack is unknown (`kestrel journal check` names it "
                "too)")
    if not held:
        return None
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


# The zeros a segment is laid down with, made once: a buffer of this size is mapped by the allocator
# as zero pages that are never written, so it takes no memory, where one made for each segment was
# a megabyte allocated on the laying-down thread at every checkpoint.
_ZEROS: Final = memoryview(bytes(1 << 20))


def _lay_down(path: str, size: int) -> None:
    """A segment laid down ahead at `path`: its mark and zeros up to `size` bytes, written and
    made durable (its name is not: `CommitLog._install`)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write_all(fd, MARK)
        at = len(MARK)
        while at < size:
            chunk = min(len(_ZEROS), size - at)
            write_all(fd, _ZEROS[:chunk])
            at += chunk
        os.fsync(fd)
    finally:
        os.close(fd)


def _drop_prepared(queue_path: str) -> None:
    """Delete the next segment laid down ahead, if any: it holds nothing."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(directory(queue_path), PREPARED_NAME))


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
    queues: set[str] = field(default_factory=set)  # those whose files it wrote into (a reader's: its parent)


def _journal_for(queue_path: str, files: JournalFiles, record: Record) -> str | None:
    """The Kestrel 2 journal file the record's bytes belong to, of its queue's `files` (see the
    module's doc on epochs); None when only a pack is newer than its epoch."""
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
        self._dry_ends: dict[str, int] = {}  # in a dry run: where each journal would end once written

    def holds(self, claims: Record) -> bool:
        """Whether a damaged record's file holds what it claims at its offset (a reader checkpoint:
        what they consume). Its fields are not verified: one that the reading fails on (an offset
        past what the file system takes, bytes no reader records are) is not held."""
        try:
            if claims.kind == READER:
                return checkpoint_lacks(self.checkpoint(claims.queue), [claims.data], repair=False) == b""
            journal = self.journal(claims)
            if journal is None:
                return False
            with open_to_read(journal) as f:
                f.seek(claims.offset)
                return f.read(len(claims.data)) == claims.data
        except (OSError, CorruptJournalError, Incomplete, Malformed):
            return False

    def checkpoint(self, queue: str) -> str:
        """The checkpoint file of reader queue `queue` (`q` or `q+child`)."""
        parent, _, reader = queue.partition("+")
        return os.path.join(self.queue_path, filenames.reader_file_name(parent, reader))

    def journal(self, record: Record) -> str | None:
        if record.kind == WRITER:
            return os.path.join(self.queue_path, filenames.writer_file_name(record.queue, record.epoch))
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
        if size <= record.offset <= self._dry_ends.get(journal, -1):
            size = record.offset  # the records a dry run placed before this one end here: appended
        present = b""
        if size > record.offset:
            with open_to_read(journal) as f:
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
        self.recovery.queues.add(record.queue)
        if self.dry_run:
            self._dry_ends[journal] = max(self._dry_ends.get(journal, -1), end)
            return None
        _step("write")
        fd = open_file(journal, os.O_WRONLY | os.O_CREAT)
        try:
            pwrite_all(fd, record.data, record.offset)
        finally:
            os.close(fd)
        self.journals.add(journal)
        return None

    def apply(self, queue: str, logged: list[Record]) -> str | None:
        """Append to reader queue `queue`'s checkpoint what it lacks of the ids the `logged` records
        consume (applied by meaning, whatever version of the file is there; a torn tail is cut
        off first, a copy kept); why it cannot be, if it cannot."""
        path = self.checkpoint(queue)
        if not os.path.exists(path):
            return (f"reader checkpoint {path} is missing: what the commit log says reader {queue!r} "
                    "consumed cannot be recorded")
        try:
            _step("read-checkpoint")
            lacking = checkpoint_lacks(path, [r.data for r in logged], repair=not self.dry_run)
        except CorruptJournalError as e:
            return f"reader checkpoint {path} is damaged ({e}): the commit log's records cannot be added"
        self.journals.add(path)  # fsynced before the log is deleted, whatever it lacked
        if not lacking:
            return None
        self.recovery.written += 1
        self.recovery.queues.add(queue.partition("+")[0])
        if self.dry_run:
            return None
        _step("write")
        fd = open_file(path, os.O_WRONLY | os.O_APPEND)
        try:
            write_all(fd, lacking)
        finally:
            os.close(fd)
        self.journals.add(path)
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


def _refusal(queue: str, where: str, at: int, reason: str, held: list[Record],
             damaged: dict[str, list[Record]]) -> CommitLogDamaged:
    """The refusal of `queue`, counting the records `held` and the damaged spans held with them."""
    return CommitLogDamaged(where, at, None, reason, queue, len(held), len(damaged.get(queue, ())))


def recover(queue_path: str, now_ms: int, salvage: bool = False, dry_run: bool = False) -> Recovery:
    """Put what the commit log holds into the journals, make them durable and empty the log.
    Idempotent: killed at any step, it can run again.

    Each record that verifies (or whose body verifies once only its size field was found damaged)
    is placed by position (`_Placing.place`). A queue is refused where that is impossible: its
    journal ends before a record's offset, only a pack is newer than a record's epoch, or the log
    is damaged where no record of it can be read (a damaged span naming no queue refuses every
    queue with records in the log, since it may be any of theirs); its records are kept in
    `held-<queue>` and read again at the next recovery, with the damaged bytes that refused it (as
    DAMAGED records, judged again there). With `salvage` a refused queue's journal is
    kept as it is and its records set aside (`.kestrel/aside/`) instead. A torn last write of the
    log is cut off, a copy kept as `<segment>.torn-<ms>`. With `dry_run` nothing is changed: the
    result says what would be done (`kestrel journal check`). Raises OSError.
    """
    recovery = Recovery()
    held = held_paths(queue_path)
    paths = list(held.values()) + segment_paths(queue_path)
    last = max([i for i, p in enumerate(paths) if _holds_records(p)], default=len(paths) - 1)
    segments = [read_segment(p, i >= last) for i, p in enumerate(paths)]
    placing = _Placing(queue_path, now_ms, recovery, dry_run)
    reasons: dict[str, tuple[str, int, str]] = {}  # refused queue -> (where, offset, why)
    damaged: dict[str, list[Record]] = {}  # refused queue -> the damaged bytes held with its records
    named = {r.queue for s in segments for _, r in s.records}
    known: set[str] | None = None  # the queues named or owning files: what a claimed name may be
    for segment, at, damage, kept_for in _damage_found(segments):
        claims = damage.claims
        if claims is not None and placing.holds(claims):
            continue  # the journal holds what the damaged record seems to: its good copy
        if known is None:
            known = named | {file_owner(name) for name in os.listdir(queue_path)}
        if claims is not None and not {claims.queue, claims.queue.partition("+")[0]} & known:
            claims = None  # a name no record and no file knows is damaged too: it names no queue
        why = f"the commit log is damaged ({damage.reason})"
        queues = [kept_for] if kept_for else [claims.queue] if claims is not None else sorted(named)
        if claims is None and not kept_for:
            why += ", where no record can be read: it may be this queue's"
        # held with the queue's records: its bytes where it refuses one queue (a span refusing them
        # all, which names none at every start, is held as its place alone: one copy is kept)
        data = damage.data if len(queues) == 1 else b""
        for queue in queues:
            reasons.setdefault(queue, (segment.path, at, why))
            damaged.setdefault(queue, []).append(Record(queue, 0, damage.at, data, DAMAGED))
    records: dict[str, list[Record]] = {}
    readers: dict[str, tuple[str, int, list[Record]]] = {}  # applied by meaning, once all are read
    for segment in segments:
        for at, record in segment.records:
            if record.kind == DAMAGED:
                continue  # judged with the damage found
            records.setdefault(record.queue, []).append(record)
            if record.queue in reasons:
                continue
            if record.kind == READER:
                readers.setdefault(record.queue, (segment.path, at, []))[2].append(record)
                continue
            refusal = placing.place(segment.path, at, record)
            if refusal is not None:
                reasons[record.queue] = (segment.path, at, refusal)
    for queue, (where, at, logged) in readers.items():
        if queue not in reasons and (refusal := placing.apply(queue, logged)) is not None:
            reasons[queue] = (where, at, refusal)
    if dry_run:
        recovery.refused = {q: _refusal(q, where, at, why, records.get(q, []), damaged)
                            for q, (where, at, why) in sorted(reasons.items())}
        return recovery
    _drop_prepared(queue_path)
    for queue, (where, at, why) in sorted(reasons.items()):
        kept = records.get(queue, [])
        if salvage:
            copy = _keep_aside(queue_path, queue, kept + damaged.get(queue, []), now_ms)
            recovery.copies.append(copy)
            log.error("commit log records of a queue cannot be placed; its journal is kept as it is and "
                      "the records set aside (salvage)", queue=queue, reason=why, records=len(kept),
                      copy=copy)
        else:
            _step("hold")
            _hold(queue_path, queue, kept + damaged.get(queue, []))
            recovery.refused[queue] = _refusal(queue, where, at, why, kept, damaged)
    for journal in sorted(placing.journals):
        _step("fsync-journal")
        fsync_path(journal)
    if placing.journals:
        fsync_path(queue_path)  # a journal recovery created
    for segment in segments:
        if segment.torn_at is not None or segment.damage:
            at = 0 if segment.damage or segment.torn_at is None else segment.torn_at  # damage: all of it
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
    if segments or os.path.isdir(directory(queue_path)):
        _remove_directory(queue_path)
    if placing.journals or recovery.refused:
        log.info("commit log recovered", segments=len(segments), journals=len(placing.journals),
                 records=sum(len(s.records) for s in segments), written=recovery.written,
                 refused=sorted(recovery.refused))
    return recovery


def _damage_found(segments: list[Segment]) -> Iterator[tuple[Segment, int, Damage, str]]:
    """The damage that may hide records, where it is, and the queue it was kept for: what reading
    the segments found, and the DAMAGED records a queue's held records keep from an earlier
    recovery (judged again alike; found where the records first were, they refuse that queue)."""
    for segment in segments:
        for damage in segment.damage:
            if damage.record is None and damage.hides:
                yield segment, damage.at, damage, ""
        for at, record in segment.records:
            if record.kind == DAMAGED:
                reason = f"bytes damaged at offset {record.offset} of a segment, held with its records"
                span = Damage(record.offset, record.offset + len(record.data), reason,
                              claims=_decode_body(record.data[_HEAD.size:]), data=record.data)
                yield segment, at, span, record.queue


def _hold(queue_path: str, queue: str, records: list[Record]) -> None:
    """Keep a refused queue's records, durably, in `held-<queue>` (replacing what it held)."""
    folder = layout.ensure(queue_path, filenames.COMMIT_LOG_NAME)
    path = os.path.join(folder, HELD_PREFIX + queue)
    temporary = path + filenames.TEMPORARY_MARK
    with contextlib.suppress(FileNotFoundError):
        os.unlink(temporary)
    _create_segment(temporary, _encode_records(records))
    os.replace(temporary, path)
    fsync_path(folder)


def _keep_aside(queue_path: str, queue: str, records: list[Record], now_ms: int) -> str:
    """Salvage: a refused queue's records, as a segment, in `.kestrel/aside/`; the copy's path."""
    copy = layout.aside_path(queue_path, f"commit-log-{queue}", "unplaced", now_ms)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(copy)
    _create_segment(copy, _encode_records(records))
    return copy


def _encode_records(records: list[Record]) -> bytes:
    """Records read back, encoded again, each of its own kind (a segment's records, `_create_segment`)."""
    return b"".join(encode_record(r.queue, r.epoch, r.offset, r.data, r.kind) for r in records)


# ---------------------------------------------------------------------------------------------
# The live log


class FileLog(AppendLog):
    """What a file that logs its appends keeps (`JournalWriter.log`): which file it is (the kind of
    its records, its queue's name and epoch, encoded once as its records' head) and the turns that
    hold what it appended since it last waited: one, but for a change logged without a group
    commit, whose every record is a turn (no list made and dropped a change)."""

    __slots__ = ("log", "kind", "epoch", "head", "turn", "later", "segment")

    def __init__(self, log: CommitLog, kind: int, queue: str, epoch: int = 0) -> None:
        self.log = log
        self.kind = kind
        self.epoch = epoch
        # its records' first fields, encoded once: passed as one string, where the name's CRC-32 and
        # the place passed as numbers cost each record an int made and freed
        self.head = record_head(queue, kind, epoch)
        self.turn: Turn | None = None  # the first turn holding what it appended since it last waited
        self.later: list[Turn] | None = None  # the turns after that one, if any
        self.segment: _Segment | None = None  # the last segment told that this file has records in it

    def appended(self, journal: JournalWriter, offset: int, data: bytes | list[bytes]) -> None:
        """`data` (one piece or many) was just appended to `journal` at `offset`: log it. Never yields."""
        turn = self.log.add(journal, self, offset, data)
        first = self.turn
        if first is None:
            self.turn = turn
        elif first is not turn:
            later = self.later
            if later is None:
                self.later = [turn]
            elif later[-1] is not turn:
                later.append(turn)

    def falls_back(self) -> bool:
        """Whether a commit now falls back on the file's own fsync, in the caller, even where it
        holds its acknowledgements: a turn holding what the file appended since it last waited is
        settled without being durable (bytes no change waited for, a probe's before a change that
        failed, in a turn the log could not take). The rule of the hub asks (`never_waits`)."""
        turn = self.turn
        if turn is None:
            return False
        return any(each.settled and not each.durable for each in (turn, *(self.later or ())))

    def commit(self, journal: JournalWriter) -> None:
        """Wait as `journal`'s sync policy says for what it appended: under `always`, for the log
        (or not at all where acknowledgements are held); under a periodic sync, not at all (a
        round of the log is due within the interval). Raises OSError."""
        turn = self.turn
        if turn is None:
            return
        later = self.later
        self.turn = self.later = None  # what is appended while this waits waits in its own change
        sync_ms = journal.sync_ms
        if sync_ms is not None and sync_ms == 0:
            log = self.log
            log.sync(turn, journal, journal.size)
            if later is not None:  # (rare: no iterator made over an empty tuple a change)
                for each in later:
                    log.sync(each, journal, journal.size)


class Turn(Settled):
    """The records of one loop turn, made durable together: under a group commit, written with the
    other turns of their round in one `write` when the round starts (`CommitLog._join`).

    `done` is true once they are durable (or could not be made so: `error`) where the runtime has a
    group commit, else once they are written and each waiter syncs the log itself (`durable` is
    False then). The changes of connections that hold their acknowledgements (`holders`,
    src/kestrel/storage/acknowledgements.py) do not wait for `done`: the turn is `settled` for them,
    in the order turns are numbered (`seq`), once it is durable or their journals' own fsyncs stood
    in for it. So an event is made only for a waiter that finds the turn not done (`waiting`,
    `CommitLog._wait`): the server's turns have none."""

    __slots__ = ("records", "changes", "periodic", "segment", "position", "error", "durable", "done",
                 "waiting", "started", "seq", "holders", "settled", "falling_back", "fallen_back")

    def __init__(self, seq: int) -> None:
        self.records = bytearray()  # encoded, as they are written
        self.changes = 0  # records of journals under `always`: what a round that takes it carries
        # journals under a periodic sync with records in it -> their interval in ms: the turn is due
        # within the shortest, and were the log to fail, each journal's own periodic fsync takes over
        self.periodic: dict[JournalWriter, int] = {}
        self.segment: _Segment | None = None  # where they were written (None: not yet)
        self.position = 0  # the end of its records there
        self.error: OSError | None = None
        self.durable = False
        self.done = False
        self.waiting: Event | None = None  # set with `done`, made by the first waiter
        self.started = 0.0  # when they were written (`perf_counter`), for the fsync timing
        self.seq = seq
        self.holders: list[Acknowledgements] = []
        self.settled = False
        self.falling_back = False  # not durable in the log: the holders' journals are being fsynced
        self.fallen_back = False  # and have been


class _Segment:
    def __init__(self, writer: JournalWriter) -> None:
        self.writer = writer
        # the journals with records here (a checkpoint fsyncs each as far as it is written then)
        self.journals: set[JournalWriter] = set()
        self.failed = False  # an fsync of it failed: its waiters rely on their journals instead


class CommitLog:
    """The server's commit log (`open` it once recovery has run; `close` it after every queue).

    Under the gevent runtime a turn, once it has run (a callback), waits for the group commit's
    next round with the others gathered (`_gather`); when that round is joined, their records are
    written in one `write` (`_join`), and each turn is settled once the round has run: its waiters
    wake, and the connections holding their acknowledgements are told. No greenlet runs for a
    turn, and a change made where acknowledgements are held does not wait at all. Elsewhere each
    record is written at once, and its waiter fsyncs the log.

    Rounds grow with the load: one round of the log is in flight at a time, and when it has run,
    the next waits for as many changes as the round just run carried and the turns written
    meanwhile hold (the clients it released come back with their next changes, and one round
    then takes them all), though never longer than that round took, at most GATHER_SECONDS. With
    one client, its next change starts the next round at once.
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
        self._locks = self._lock is not NO_LOCK  # gevent's does nothing: a change does not enter it
        self._segments: list[_Segment] = []  # oldest first; the last takes records
        self._seq = 0
        self._turn: Turn | None = None
        self._turns = 0  # turns numbered so far
        self._unsettled: deque[Turn] = deque()  # written, oldest first, until settled
        self._gathered: list[Turn] = []  # run, not yet in a round (written by `_join` or `_switch`)
        self._gathered_changes = 0
        self._in_flight = False  # a round of the log's runs or waits to
        self._wanted = 0  # changes the next round waits for
        self._gather_seconds = 0.0  # and for how long at most,
        self._gather_from: float | None = None  # from when (the runtime's monotonic clock)
        self._due = math.inf  # when the earliest periodic sync gathered is due
        # starts the next round at `_join_at`: a timer of the loop that calls `_join` itself (no
        # greenlet a round; `GroupCommit.later`)
        self._gathering: Any = None
        self._join_at = math.inf
        self._checkpoints = OneAtATime(self.runtime)
        self._after_checkpoint: list[Callable[[], None]] = []
        self._timer: Timer | None = None
        self._closing = False  # the queues are closing (`closing`): no checkpoint of its own starts
        self.checkpoints = 0
        self.rounds = 0  # group commit rounds the log's turns went to
        self._prepared = False  # the next segment is laid down (`PREPARED_NAME`)
        self._lay_down_bytes = self._lay_down_size(0)

    def open(self) -> None:
        """Start the first segment (the log holds none: recovery ran). Raises OSError, leaving no
        segment behind."""
        layout.ensure(self.queue_path, filenames.COMMIT_LOG_NAME)  # its name durable, in `.kestrel/`
        self._seq = 1
        path = os.path.join(self.directory, str(self._seq))
        try:
            self._install(path, False)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(path)
            with contextlib.suppress(OSError):
                _drop_prepared(self.queue_path)
                _remove_directory(self.queue_path)
            raise
        self._segments.append(_Segment(JournalWriter(path, 0, self.runtime, end=len(MARK))))
        self._timer = self.runtime.call_later(self.checkpoint_seconds, self._tick)

    # -----------------------------------------------------------------------------------------
    # Appending and waiting

    def add(self, journal: JournalWriter, file: FileLog, offset: int, data: bytes | list[bytes]) -> Turn:
        """Log bytes just appended (one piece or many) to `journal` at `offset`, where it ends now; the turn
        to wait for. Never yields."""
        if self._locks:
            with self._lock:
                return self._add(journal, file, offset, data)
        return self._add(journal, file, offset, data)

    def _add(self, journal: JournalWriter, file: FileLog, offset: int, data: bytes | list[bytes]) -> Turn:
        """`add`, in the lock where the runtime has one."""
        segment = self._segments[-1]
        if file.segment is not segment:  # the file's first record there
            file.segment = segment
            segment.journals.add(journal)
        turn = self._turn
        if turn is None:
            self._turns += 1
            turn = self._turn = Turn(self._turns)
            if self._group_commit is not None:
                gevent.get_hub().loop.run_callback(self._end_turn)
        append_record(turn.records, file.head, offset, data)
        sync_ms = journal.sync_ms
        if sync_ms is not None:  # an int compared as one, not as an object
            if sync_ms == 0:
                turn.changes += 1
            else:
                turn.periodic[journal] = sync_ms
        if self._group_commit is None:
            self._end_turn()
        return turn

    def _end_turn(self) -> None:
        """The turn has run: under a group commit it waits for a round (`_gather`), which writes
        it; elsewhere it is written at once, and each waiter fsyncs the log itself."""
        with self._lock:
            turn = self._turn
            if turn is None:
                return
            self._turn = None
            self._unsettled.append(turn)
            if self._group_commit is not None:
                self._gather(turn)
                return
            try:
                self._write([turn])
            finally:
                self._periodic_fall_back(turn)
                self._done(turn)
                self._settle()

    def _write(self, turns: list[Turn]) -> None:
        """Write the records of `turns`, in order, to the last segment in one `write`, cut back if
        it fails (`JournalWriter.append`): each turn then has its `segment` and `position`, or,
        every one of them, the `error`."""
        segment = self._segments[-1]
        writer = segment.writer
        start = writer.size
        try:
            writer.append(bytes(turns[0].records) if len(turns) == 1
                          else b"".join([turn.records for turn in turns]))
        except OSError as e:
            for turn in turns:
                turn.error = e
        except BaseException as other:  # no waiter may wait for a write that will never end
            for turn in turns:
                turn.error = OSError(errno.EIO, f"writing the commit log failed: {other!r}")
            raise
        else:
            started = perf_counter()
            end = start
            for turn in turns:
                end += len(turn.records)
                turn.segment = segment
                turn.position = end
                turn.started = started
        finally:
            for turn in turns:
                turn.records = bytearray()
        if writer.size >= self.segment_bytes and not self._checkpoints.running:
            self.runtime.spawn(self._checkpoint_logged)

    def _write_gathered(self) -> None:
        """Write the turns gathered and not written yet, together (`_write`): when a round takes
        them, or a new segment starts, or, for periodic syncs alone, when they are gathered (a
        process killed meanwhile leaves them in the log as it did in their journals, rather than
        an interval later). Those it could not write, or wrote to a segment whose fsync failed,
        leave the gathering: their waiters fall back on their journals."""
        written = [turn for turn in self._gathered if turn.segment is not None]  # before a switch
        if len(written) == len(self._gathered):
            return
        unwritten = [turn for turn in self._gathered if turn.segment is None]
        segment = self._segments[-1]
        try:
            self._write(unwritten)
        finally:  # whatever happens, no waiter waits on for a round that will not take its turn
            if unwritten[0].error is not None or segment.failed:
                self._gathered = written
                self._gathered_changes = sum(turn.changes for turn in written)
                for turn in unwritten:
                    self._periodic_fall_back(turn)
                    self._done(turn)
                self._settle()

    def _gather(self, turn: Turn) -> None:
        """The turn waits for the next round (`_decide`)."""
        self._gathered.append(turn)
        self._gathered_changes += turn.changes
        if turn.periodic:
            self._due = min(self._due, self.runtime.clock.monotonic() + min(turn.periodic.values()) / 1000.0)
        self._decide()

    def _decide(self) -> None:
        """Start the next round when none is in flight and the changes gathered are those the last
        round let it expect; else once they are, or once gathering has lasted as long as it may,
        or once a periodic sync's interval is up (turns of periodic syncs alone start no round
        before)."""
        if self._in_flight or not self._gathered:
            return
        changes = self._gathered_changes
        if changes and changes >= self._wanted:
            self._join()
            return
        if not changes:  # periodic syncs alone, whose round may be an interval away: written now
            self._write_gathered()
            if not self._gathered:
                return
        now = self.runtime.clock.monotonic()
        at = self._due
        if changes:
            if self._gather_from is None:
                self._gather_from = now
            at = min(at, self._gather_from + self._gather_seconds)
        if at == math.inf:
            return  # records of queues reloaded to `never`: they ride the next round, whenever
        group_commit = self._group_commit
        assert group_commit is not None  # (turns gather only under a group commit)
        if self._gathering is not None:
            if self._join_at <= at:
                return  # a timer set already starts it soon enough
            self._gathering.stop()
        self._join_at = at
        self._gathering = group_commit.later(max(at - now, 0.0), self._join)

    def _join(self) -> None:
        """Put the gathered turns in the group commit's next round, together."""
        if self._gathering is not None:
            self._gathering.stop()
            self._gathering = None
        self._join_at = self._due = math.inf
        self._gather_from = None
        self._write_gathered()
        turns, self._gathered = self._gathered, []
        changes, self._gathered_changes = self._gathered_changes, 0
        if not turns:
            return
        assert self._group_commit is not None
        self._in_flight = True
        self.rounds += 1
        # one round, the next, whichever segments: begun here, the turns being in
        writers = {turn.segment.writer for turn in turns if turn.segment is not None}
        round_ = self._group_commit.join_now(writers)
        joined = perf_counter()
        round_.after(partial(self._round_run, round_, turns, changes, joined))

    def _round_run(self, round_: Round, turns: list[Turn], changes: int, joined: float) -> None:
        """The round has run: settle its turns, and say what the next round waits for."""
        took = perf_counter() - joined
        self._in_flight = False
        try:
            for turn in turns:
                self._turn_synced(turn, round_)
        finally:
            self._wanted = changes + self._gathered_changes
            self._gather_seconds = min(took, GATHER_SECONDS)
            self._decide()

    def _turn_synced(self, turn: Turn, round_: Round) -> None:
        """The group commit's round that took the turn's segment has run: wake the turn's waiters
        (with the round's error, which makes them fall back on their journals)."""
        segment = turn.segment
        assert segment is not None
        writer = segment.writer
        try:
            if writer.synced >= turn.position:  # the round, or a checkpoint, made the records durable
                turn.durable = True
                record_timing(timings.fsync, turn.started)
            else:
                error = round_.failed.get(writer)
                segment.failed = True  # no later fsync of it can vouch for what it holds
                turn.error = error or OSError(errno.EIO, f"the commit log {writer.path} was not synced")
                self._periodic_fall_back(turn)
        finally:
            self._done(turn)  # whatever happens, no waiter waits on for a round that has run
            self._settle()

    @staticmethod
    def _done(turn: Turn) -> None:
        """The turn's records are durable, or could not be made so: its waiters wake."""
        turn.done = True
        waiting = turn.waiting
        if waiting is not None:
            waiting.set()

    def _wait(self, turn: Turn) -> None:
        """Wait until the turn is done (`_done`)."""
        waiting = turn.waiting
        if waiting is None:
            waiting = turn.waiting = self.runtime.event()
        while not turn.done:
            waiting.wait()

    def _periodic_fall_back(self, turn: Turn) -> None:
        """The log could not take the turn: the journals of periodic syncs in it fsync themselves
        within their interval, as they do without a log."""
        for journal in turn.periodic:
            journal.sync_later()

    def _settle(self) -> None:
        """Settle the turns whose rounds have run, oldest first, telling each one's holders. A turn
        the log could not make durable first has its holders' journals fsynced (`_fall_back`)."""
        unsettled = self._unsettled
        while unsettled:
            turn = unsettled[0]
            if not turn.done:
                return
            if not turn.durable and turn.holders and not turn.fallen_back:
                if not turn.falling_back:
                    turn.falling_back = True
                    self.runtime.spawn(partial(self._fall_back, turn))
                return
            unsettled.popleft()
            turn.settled = True
            for holder in turn.holders:
                if holder.last is turn:
                    holder.all_settled()
                try:
                    holder.settled()
                except Exception:
                    log.exception("a holder of acknowledgements failed when told of its turn")

    def _fall_back(self, turn: Turn) -> None:
        """The log could not make the turn durable: each holder's journals are fsynced instead; a
        holder whose journal fails too is `failed` (its replies are never sent)."""
        try:
            log.warning("the commit log could not take a turn; its journals are fsynced instead",
                        error=str(turn.error))
            for holder in turn.holders:
                for journal, end in holder.written():
                    try:
                        journal.sync_to(end)
                    except OSError as e:
                        holder.failed = holder.failed or e
                        log.error("cannot make a change durable: the commit log and its journal both "
                                  "failed; the client's replies are withheld", file=journal.path,
                                  error=str(e))
        finally:
            turn.fallen_back = True
            self._settle()

    def sync(self, turn: Turn, journal: JournalWriter, journal_end: int) -> None:
        """Return once the turn's records are on disk; where the calling greenlet holds its
        acknowledgements (src/kestrel/storage/acknowledgements.py), at once, the turn telling its
        holder when. Where the log could not take them (a failed write or fsync of the log),
        `journal`'s own fsync up to `journal_end` keeps the promise.

        Raises OSError when that fails too.
        """
        if self._group_commit is not None and not turn.settled:
            holder = acknowledgements.holder()
            if holder is not None:
                last = cast("Turn | None", holder.last)  # a turn's `seq` read as its field is
                if last is not turn:
                    turn.holders.append(holder)
                    if last is None or turn.seq > last.seq:
                        holder.last = turn
                holder.wrote(journal, journal_end)
                return
        if not turn.done:
            self._wait(turn)
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

    def names(self, path: str) -> bool:
        """Whether the log holds records of file `path` (it may not be deleted before a checkpoint)."""
        return any(journal.path == path for segment in self._segments for journal in segment.journals)

    def after_checkpoint(self, then: Callable[[], None]) -> None:
        """Call `then` once the next checkpoint has dropped the segments it retires."""
        self._after_checkpoint.append(then)

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
        if self._segments and self._segments[-1].journals and not self._checkpoints.running:
            self._checkpoint_logged()
        if self._segments and not self._closing:
            self._timer = self.runtime.call_later(self.checkpoint_seconds, self._tick)

    def _checkpoint_logged(self) -> None:
        """A checkpoint of the log's own (its timer's, or a segment grown large), none once closing."""
        if self._closing:
            return
        try:
            self.checkpoint()
        except OSError as e:
            log.error("commit log checkpoint failed; its segments stay until one succeeds", error=str(e))

    def checkpoint(self) -> None:
        """Make durable every journal with records in the log up to now, then delete the segments
        holding those records. Returns once a checkpoint begun after the call has finished.

        Raises OSError (the segments stay; the next checkpoint tries again).
        """
        with self._checkpoints.turn():
            self._switch()
            retired = self._segments[:-1]
            taken = sum(segment.writer.size for segment in retired)
            ends = {journal: journal.size for segment in retired for journal in segment.journals}
            self._sync_journals(ends)
            for segment in retired:
                writer = segment.writer
                writer.synced = writer.size  # its records are in their journals: nothing to fsync
                writer.close()
                # off the loop: freeing the pages of a segment full of large items took over 10 ms
                self.runtime.run_blocking(os.unlink, writer.path)
                self._segments.remove(segment)
            self.runtime.run_blocking(fsync_path, self.directory)
            self.checkpoints += 1
            if self._segments and not self._closing:  # else `close` would delete it
                self._prepare(taken)
        waiting, self._after_checkpoint = self._after_checkpoint, []
        for then in waiting:
            try:
                then()
            except Exception:
                log.exception("work waiting for a checkpoint of the commit log failed")

    def _switch(self) -> None:
        """Start a new segment: what was logged so far is in the older ones."""
        path = os.path.join(self.directory, str(self._seq + 1))
        prepared, self._prepared = self._prepared, False
        self.runtime.run_blocking(self._install, path, prepared)
        with self._lock:
            self._seq += 1
            self._end_turn()  # what was logged so far goes to the older segment
            self._write_gathered()
            self._segments.append(_Segment(JournalWriter(path, 0, self.runtime, end=len(MARK))))

    def _install(self, path: str, prepared: bool) -> None:
        """Make the segment laid down ahead (laying it down now unless `prepared`) the segment
        `path`, durable with its name. Raises OSError."""
        laid_down = os.path.join(self.directory, PREPARED_NAME)
        if not prepared:
            _lay_down(laid_down, self._lay_down_bytes)
        os.rename(laid_down, path)
        fsync_path(self.directory)

    def _lay_down_size(self, taken: int) -> int:
        """How large a segment is laid down after one that took `taken` bytes: half again as large,
        at least PREALLOCATE_BYTES, at most the size that asks for a checkpoint."""
        return min(max(PREALLOCATE_BYTES, taken * 3 // 2), max(self.segment_bytes, len(MARK)))

    def _prepare(self, taken: int) -> None:
        """Lay down the next segment, off the loop (`_lay_down_size`)."""
        self._lay_down_bytes = self._lay_down_size(taken)
        try:
            self.runtime.run_blocking(_lay_down, os.path.join(self.directory, PREPARED_NAME),
                                      self._lay_down_bytes)
        except OSError as e:
            log.warning("cannot lay down the commit log's next segment ahead; it is laid down when "
                        "it is needed", error=str(e))
            return
        self._prepared = True

    def _sync_journals(self, ends: dict[JournalWriter, int]) -> None:
        """fdatasync the journals up to those positions, together (one group commit round)."""
        # A closed journal was flushed by its close; one whose close failed is still open.
        all_side_by_side(self.runtime, [partial(j.sync_to, e) for j, e in ends.items()
                                        if j.fd >= 0 and j.synced < e])

    # -----------------------------------------------------------------------------------------
    # Closing

    def closing(self) -> None:
        """The queues are closing, their closes fsyncing every journal before `close` deletes the
        segments: no checkpoint of the log's own starts from now on (one asked for, by a delete or
        a pack, still runs), and one under way lays no next segment down. On a disk whose fsyncs
        took seconds, a checkpoint begun by the timer during the queues' closes held the stop for
        its fsyncs, one after another (a segment's name, the journals, the folder, the next segment
        laid down)."""
        self._closing = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def close(self) -> None:
        """After every queue closed (their journals fsynced): delete the segments. Any journal
        still open (its close failed) keeps them for the next start's recovery."""
        self.closing()
        self._checkpoints.wait()
        self._end_turn()
        if self._group_commit is not None:
            self._join()  # what is gathered waits no longer: its round finds it durable
        segments, self._segments = self._segments, []
        with contextlib.suppress(OSError):
            _drop_prepared(self.queue_path)
        self._prepared = False
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
