"""The per-queue manifest: which files make up a queue, with sizes and checksums.

Kestrel 2 journals carry no checksums, and neither format can see in its bytes that a whole file
is missing, stray or replaced. Like the MANIFEST of LevelDB and RocksDB, `<queue>.manifest` in the
server's own directory (`.kestrel/`, `filenames.manifest_name`) lists every file of the queue: a
sealed file (one that will not change again: a rotated journal, a pack, an older Kestrel 3 writer
file) with its size and the CRC32C of its bytes; a growing file (the live journal, the newest
writer file, a reader checkpoint) with the size and CRC32C of the prefix that was checked when it
was last written whole, if any. Start-up compares the queue path with it before anything is
replayed, deleted or rewritten.

It is rewritten whole, atomically (temporary, fsync, rename, fsync of the directory), at rotation,
pack, checkpoint rewrite, deletion of consumed files, conversion and start-up; never by an append.

Byte layout (this module is the only code that knows it), UTF-8 text:

    kestrel-manifest 1 <crc32c of the body, 8 hex digits>\\n
    <body: one JSON object>

body: {"format": "kestrel2" | "kestrel3", "high_id": <int>,
       "files": {<file name>: [<size>, <crc32c> | null, <first id>, <last id>
                               (, <previous size>, <previous crc32c>)], ...},
       "packs": [<file name>, ...]}

`packs` names the Kestrel 2 files that are packs of ours (absent in manifests written before it
was kept: then which files are packs is not known).

A reader checkpoint is rewritten (temporary, rename) after the manifest lists its new checksum with
the previous one beside it: a crash on either side of the rename leaves a file the manifest accepts.

`high_id` (Kestrel 3) is the highest item id ever written when the manifest was written; the ids
of a writer file are its first and last item ids (0 for a Kestrel 2 journal).
"""

from __future__ import annotations

import errno
import json
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

import structlog
from gevent import monkey

from kestrel.storage import damage, filenames, layout
from kestrel.storage.crc32c import crc32c, file_crc32c, read_crc32c
from kestrel.storage.disk import fsync_path, open_to_read, replace_file
from kestrel.storage.errors import UNREADABLE_JSON, CorruptJournalError

log = structlog.get_logger("kestrel.manifest")

MAGIC = "kestrel-manifest"
VERSION = 1

FileId = tuple[int, int]  # (st_dev, st_ino): a file, whatever its name


@dataclass
class Entry:
    """One file: `size` bytes whose CRC32C is `crc` (None: only its presence and a size it has at
    least are known, a file that still grows and was never written whole)."""

    size: int = 0
    crc: int | None = None
    first_id: int = 0
    last_id: int = 0
    previous: tuple[int, int] | None = None  # (size, crc) also accepted: a rewrite under way
    pack: bool = False  # a Kestrel 2 pack of ours (a rotated journal otherwise)

    @property
    def sealed(self) -> bool:
        return self.crc is not None


@dataclass
class Manifest:
    format: str
    files: dict[str, Entry] = field(default_factory=dict)
    high_id: int = 0
    knows_packs: bool = True  # False when read from a manifest written before packs were marked


def path_of(queue_path: str, queue: str) -> str:
    return filenames.own_path(queue_path, filenames.manifest_name(queue))


def encode(manifest: Manifest) -> bytes:
    body = json.dumps({"format": manifest.format, "high_id": manifest.high_id,
                       "files": {name: [e.size, e.crc, e.first_id, e.last_id, *(e.previous or ())]
                                 for name, e in sorted(manifest.files.items())},
                       "packs": sorted(name for name, e in manifest.files.items() if e.pack)},
                      separators=(",", ":")).encode()
    return f"{MAGIC} {VERSION} {crc32c(body):08x}\n".encode() + body


def decode(path: str, data: bytes) -> Manifest:
    """The manifest in `data` (read from `path`). Raises CorruptJournalError saying what is wrong."""
    head, newline, body = data.partition(b"\n")
    parts = head.split(b" ")
    if not newline or len(parts) != 3 or parts[0] != MAGIC.encode():
        raise CorruptJournalError(path, 0, None, "not a queue manifest (its first line is damaged)")
    if parts[1] != str(VERSION).encode():
        raise CorruptJournalError(path, 0, None, f"manifest version {parts[1]!r} is not {VERSION}")
    if parts[2] != f"{crc32c(body):08x}".encode():
        raise CorruptJournalError(path, len(head) + 1, None, "the manifest's checksum does not match its "
                                  f"contents ({len(body)} bytes): it is damaged or cut short")
    try:
        raw = json.loads(body)
        files = {str(name): _entry(*fields) for name, fields in raw["files"].items()}
        for name in raw.get("packs", ()):
            files[str(name)].pack = True
        return Manifest(str(raw["format"]), files, int(raw["high_id"]), "packs" in raw)
    except UNREADABLE_JSON as e:
        raise CorruptJournalError(path, len(head) + 1, None, f"unreadable manifest: {e}") from None


def _entry(size: int, crc: int | None, first: int, last: int, *previous: int) -> Entry:
    if len(previous) not in (0, 2):
        raise ValueError(f"{len(previous)} fields after the ids, not 0 or 2")
    return Entry(int(size), None if crc is None else int(crc), int(first), int(last),
                 (int(previous[0]), int(previous[1])) if previous else None)


def read(queue_path: str, queue: str, fmt: str | None = None) -> Manifest | None:
    """The queue's manifest, or None when it has none (written before manifests, or never rotated).

    Raises CorruptJournalError when it cannot be read, or records files of another format than `fmt`.
    """
    path = path_of(queue_path, queue)
    try:
        with open_to_read(path) as f:
            data = f.read()
    except FileNotFoundError:
        return None
    record = decode(path, data)
    if fmt is not None and record.format != fmt:
        raise CorruptJournalError(path, 0, None, f"the manifest lists {record.format} files where the "
                                  f"queue's files are {fmt}")
    return record


def read_for_start(queue_path: str, queue: str, fmt: str, salvage: bool, stamp: int) -> Manifest | None:
    """`read` at start-up: a manifest that cannot be read refuses the queue; with `salvage` it is set
    aside (`.kestrel/aside/<queue>.manifest.corrupt-<stamp>`) and the queue loads as one without."""
    try:
        return read(queue_path, queue, fmt)
    except CorruptJournalError as e:
        finding = damage.Finding(e.path, e.reason, damage.Remedy.SET_ASIDE, e.offset,
                                 also="the queue then loads as one without a manifest")
        damage.settle(queue_path, queue, [finding], salvage, stamp)
        return None


def set_aside_stray(queue_path: str, queue: str, stamp: int) -> None:
    """A manifest of a queue that has no file at all (left by a copy, or a queue deleted elsewhere)
    says nothing about the queue of that name: set aside with a warning, never a refusal."""
    copy = layout.set_aside(queue_path, path_of(queue_path, queue), "stray", stamp)
    log.warning("stray manifest: the queue has no file it could list; set aside and ignored", queue=queue,
                copy=copy)


def write(queue_path: str, queue: str, manifest: Manifest) -> None:
    """Replace the manifest in one step: temporary, fsync, rename, fsync of the directory."""
    writer = f"-{os.getpid()}-{threading.get_ident()}"
    temporary = os.path.join(layout.ensure(queue_path), filenames.manifest_temporary_name(queue, writer))
    replace_file(path_of(queue_path, queue), encode(manifest), temporary)


def remove(queue_path: str, queue: str) -> None:
    """Delete the manifest (the queue is being deleted), durably: before any file it lists."""
    path = path_of(queue_path, queue)
    try:
        os.unlink(path)
    except FileNotFoundError:
        return
    fsync_path(os.path.dirname(path))


def seal(path: str, size: int | None = None, first_id: int = 0, last_id: int = 0,
         of: FileId | None = None) -> Entry:
    """The entry of a file that will not change again (or of its first `size` bytes), its size and
    checksum read through one descriptor: of one file, whatever takes its name meanwhile. Raises
    FileNotFoundError when the name holds no file, or another than `of` (a rotated journal that a
    pack was put in place over)."""
    with open_to_read(path) as f:
        found = os.fstat(f.fileno())
        if of is not None and file_id(found) != of:
            raise FileNotFoundError(errno.ENOENT, "another file holds its name now", path)
        if size is None:
            size = found.st_size
        return Entry(size, read_crc32c(f, size, path), first_id, last_id)


def file_id(found: os.stat_result) -> FileId:
    """Which file `found` (a stat of it) describes, whatever name it has."""
    return found.st_dev, found.st_ino


def describe(entry: Entry | None, size: int | None, checked: bool) -> str:
    """What the manifest records of a file now `size` bytes long, in words; `checked`: it matched
    at start-up. A listed size of -1 marks a Kestrel 3 writer file being deleted."""
    if entry is None:
        return "not listed"
    if entry.size < 0:
        return "listed as being deleted: every reader has passed it"
    if entry.crc is None:
        words = f"listed, without a checksum yet (at least {entry.size} bytes)"
    elif entry.size == size:
        words = f"{entry.size} bytes with CRC32C {entry.crc:08x}"
    else:
        words = f"its first {entry.size} bytes with CRC32C {entry.crc:08x}"
    return f"{words}; matched at start-up" if checked else words


def mismatch(path: str, entry: Entry, growing: bool = False) -> str | None:
    """Why the file at `path` is not what `entry` records, or None if it is.

    A `growing` file may be longer than recorded; its recorded prefix must still match. A file
    whose `previous` content matches is what it was before a rewrite a crash cut off.
    """
    why = _mismatch(path, entry, growing)
    if why is not None and entry.previous is not None:
        size, crc = entry.previous
        if _mismatch(path, Entry(size, crc), growing) is None:
            return None
    return why


def _mismatch(path: str, entry: Entry, growing: bool) -> str | None:
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        return f"missing: the manifest lists it with {entry.size} bytes"
    if size < entry.size:
        return f"cut short: it holds {size} bytes where the manifest records {entry.size}"
    if size > entry.size and not growing and entry.sealed:
        return f"grown: it holds {size} bytes where the manifest records {entry.size}"
    if entry.crc is not None and file_crc32c(path, entry.size) != entry.crc:
        return (f"changed: the CRC32C of its first {entry.size} bytes is not the one the manifest "
                f"records ({entry.crc:08x})")
    return None


class Keeper:
    """A queue's manifest in memory and on disk; changes are written at once, one at a time
    (a pack may write from a thread).

    `listed` is what the manifest lists as last written, a copy replaced after each write and read
    without the lock: a thread holds the lock across the manifest's fsyncs (a seal, a checkpoint's
    rewrite: seconds on a disk that stalls), and the figures of the stats and the dashboard, asked
    on the loop, waited for them there, every client with them."""

    def __init__(self, queue_path: str, queue: str, manifest: Manifest) -> None:
        self.queue_path = queue_path
        self.queue = queue
        self.manifest = manifest
        # The operating system's lock, not gevent's: sealing threads and the hub take it, and no
        # holder yields (the writes are plain system calls).
        self.lock: threading.Lock = monkey.get_original("threading", "Lock")()
        self.listed: Mapping[str, Entry] = dict(manifest.files)

    def update(self, changes: dict[str, Entry | None], high_id: int | None = None,
               unlisted: dict[str, Entry] | None = None) -> None:
        """Set (an Entry) or drop (None) the entries of `changes`, and those of `unlisted` that are
        not listed (a rotated file's seal, from a thread, may list it meanwhile); then write."""
        with self.lock:
            for name, growing in (unlisted or {}).items():
                self.manifest.files.setdefault(name, growing)
            for name, entry in changes.items():
                if entry is None:
                    self.manifest.files.pop(name, None)
                else:
                    self.manifest.files[name] = entry
            if high_id is not None:
                self.manifest.high_id = max(self.manifest.high_id, high_id)
            self.save()

    def save(self) -> None:
        """Write the manifest as it stands in memory (the caller holds `lock`), then make `listed`
        what it lists."""
        write(self.queue_path, self.queue, self.manifest)
        self.listed = dict(self.manifest.files)

    def list_sealed(self, path: str, first_id: int, last_id: int) -> None:
        """A rotated file holding ids `first_id` to `last_id` is fsynced (in a thread): listed as
        sealed. Files are sealed in rotation order, so every older one is listed already or deleted."""
        self.update({os.path.basename(path): seal(path, first_id=first_id, last_id=last_id)}, high_id=last_id)
