"""What the queue path holds: each queue's journal files in either format (named as
`filenames.py` says), which queue a file belongs to, and the temporaries a crash left.

Reading and writing a journal file is `journal_file.py`'s; the byte layouts are the codecs'.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field

import structlog

from kestrel.storage import filenames

log = structlog.get_logger("kestrel.journal")


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
    owners: set[str] = field(default_factory=set)  # `file_owner` of every file seen, either format
    readers: int = 0  # named readers' checkpoints: Kestrel 3 fanout children, loaded with their queue
    # Every reader checkpoint (`q.read.<reader>`, the queue's own `q.read.` too), by its queue.
    checkpoints: dict[str, list[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class JournalFileFigures:
    """One of a queue's files as an operator reads it (the admin page's list of a queue's files)."""

    name: str
    role: str  # "live journal", "rotated journal", "writer file", "reader checkpoint"
    size: int | None  # bytes on disk now (None: deleted meanwhile, a pack or a consumed writer file)
    manifest: str  # what the queue's manifest records of it, in words (src/kestrel/storage/manifest.py)


def size_on_disk(path: str) -> int | None:
    """The file's size now, or None if it is gone."""
    try:
        return os.path.getsize(path)
    except FileNotFoundError:
        return None


def file_owner(file_name: str) -> str:
    """The queue whose files a file name may be: the name up to its first `.` or `~` (queue names
    hold neither). Kestrel 2's `q`, `q.<ms>`, `q.<ms>.pack`, `q~~<ms>`, Kestrel 3's `q.<n>`,
    `q.read.<reader>` and their temporaries all belong to `q` (a Kestrel 2 fanout child's to `q+c`)."""
    end = len(file_name)
    for mark in ".~":
        at = file_name.find(mark)
        if 0 <= at < end:
            end = at
    return file_name[:end]


def scan_queue_dir(queue_path: str, prefix: str = "") -> QueueDirectory:
    """Read the queue path once (start-up stays linear in the number of files).

    With `prefix`, only files whose names start with it are looked at (one queue's files).
    """
    found = QueueDirectory()
    for entry in os.scandir(queue_path):
        if not entry.name.startswith(prefix) or not entry.is_file():
            continue
        found.owners.add(file_owner(entry.name))
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
        elif (checkpoint := filenames.checkpoint_of(entry.name)) is not None:
            queue, reader = checkpoint
            found.checkpoints.setdefault(queue, []).append(entry.path)
            if reader:
                found.readers += 1
    for files in found.queues.values():
        files.rotated.sort()
        files.packs.sort()
    return found


def list_journal_files(queue_path: str, name: str) -> JournalFiles:
    """The files of one queue (a queue created after start-up, or deleted)."""
    return scan_queue_dir(queue_path, name).queues.get(name, JournalFiles())


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
