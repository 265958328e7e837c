"""The server's own directory in a queue path, and moving an earlier layout's files into it.

Only journals (and their `~~` temporaries) stay beside each other in the queue path, named as
Kestrel names them; everything else of the server's lives in `<queue_path>/.kestrel/`
(`filenames.OWN_DIRECTORY`), which Kestrel's scans never read (docs/durability.md, "Files
Kestrel can open"). Versions before it kept the lock (`.lock`), the read-id floor (`.read_ids`), the
server's status (`.status`), a conversion's record (`.convert`), the manifests (`<queue>.manifest`),
the commit log (`commit-log/`) and the copies damage handling set aside (`<file>.torn-<ms>`,
`<file>.corrupt-<ms>`) beside the journals; `migrate` moves them, once: the owner of the path
does so when it takes the path's lock (src/kestrel/storage/lock.py), before it reads anything else.
"""

from __future__ import annotations

import contextlib
import os

import structlog

from kestrel.storage import filenames
from kestrel.storage.disk import fsync_path

log = structlog.get_logger("kestrel.layout")

# An earlier layout's file names in the queue path, and their names in the server's own directory.
_MOVED = {".read_ids": filenames.READ_IDS_NAME, ".convert": filenames.CONVERT_NAME,  # files
          ".status": filenames.STATUS_NAME}
_MOVED_DIRECTORY = {"commit-log": filenames.COMMIT_LOG_NAME}  # a file of that name is a queue's journal
_DROPPED = (".lock", ".convert" + filenames.TEMPORARY_MARK, ".read_ids" + filenames.TEMPORARY_MARK)
_COPY_LABELS = (".torn-", ".corrupt-")


def ensure(queue_path: str, *folder: str) -> str:
    """The server's own directory (or a folder in it), created, durably, if missing."""
    path = filenames.own_path(queue_path, *folder)
    if not os.path.isdir(path):
        parent = os.path.dirname(path)
        if folder:
            ensure(queue_path, *folder[:-1])
        with contextlib.suppress(FileExistsError):
            os.mkdir(path)
        fsync_path(parent)
    return path


def aside_path(queue_path: str, file_name: str, label: str, stamp: int) -> str:
    """Where a copy of what damage handling cuts, replaces or sets aside from the file `file_name`
    goes (`filenames.set_aside_path`), its folder created."""
    ensure(queue_path, filenames.ASIDE_NAME)
    return filenames.set_aside_path(queue_path, file_name, label, stamp)


def set_aside(queue_path: str, path: str, label: str, stamp: int) -> str:
    """Move the file `path` of the queue path into `.kestrel/aside/`, durably; the copy's path."""
    copy = aside_path(queue_path, os.path.basename(path), label, stamp)
    os.rename(path, copy)
    fsync_path(os.path.dirname(copy))
    fsync_path(os.path.dirname(path))
    return copy


def earlier_name(name: str, is_dir: bool) -> str | None:
    """Where a file (or directory) an earlier version kept in the queue path goes, relative to the
    own directory; None when it is not one of those."""
    if is_dir:
        return _MOVED_DIRECTORY.get(name)
    if name in _MOVED:
        return _MOVED[name]
    if filenames.queue_of_manifest(name) is not None:
        return name
    if any(label in name for label in _COPY_LABELS) and not filenames.is_temporary(name):
        return os.path.join(filenames.ASIDE_NAME, name)
    return None


def owned(queue_path: str) -> bool:
    """Whether a server or a tool has owned the directory as a queue path: its own directory, or
    an earlier layout's files, is there. Where neither is, there is no commit log, conversion record
    or manifest to act on, nor a lock file: the tools leave such a directory as they find it."""
    return any(entry.name == filenames.OWN_DIRECTORY or entry.name in _DROPPED
               or earlier_name(entry.name, entry.is_dir()) is not None for entry in os.scandir(queue_path))


def current_path(queue_path: str, path: str) -> str:
    """`path`, or where `migrate` moves it when it names a file an earlier version kept beside the
    journals (a setting written for that version: `status_file: "{queue_path}/.status"`)."""
    if os.path.normpath(os.path.dirname(path)) != os.path.normpath(queue_path):
        return path
    target = earlier_name(os.path.basename(path), is_dir=False)
    return path if target is None else filenames.own_path(queue_path, target)


def migrate(queue_path: str) -> list[str]:
    """Move the files an earlier version kept beside the journals into the server's own directory;
    return their names. Drops what only the earlier version used (its lock file, which its owner
    has released: the caller holds the path; stale temporaries). Idempotent; raises OSError."""
    moved = []
    dropped = False
    for entry in os.scandir(queue_path):
        name = entry.name
        if name in _DROPPED or (filenames.is_temporary(name) and "manifest" in name.partition("~~")[2]):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
            dropped = True
            continue
        target = earlier_name(name, entry.is_dir())
        if target is None:
            continue
        folder = [os.path.dirname(target)] if os.path.dirname(target) else []
        destination = os.path.join(ensure(queue_path, *folder), os.path.basename(target))
        if os.path.exists(destination):
            log.warning("an earlier layout's file is also in the server's own directory; both kept",
                        file=entry.path, kept=destination)
            continue
        os.rename(entry.path, destination)
        moved.append(name)
    if moved:
        fsync_path(filenames.own_path(queue_path))
        with contextlib.suppress(FileNotFoundError):
            fsync_path(filenames.own_path(queue_path, filenames.ASIDE_NAME))
        log.info("moved the server's own files out of the journals' way, into its own directory",
                 queue_path=queue_path, files=sorted(moved))
    if moved or dropped:
        fsync_path(queue_path)
    return moved


def tidy(queue_path: str) -> None:
    """Remove the temporaries a crash left in the server's own directory (a manifest or read-id
    floor being written), as start-up removes the journals' (the queue path itself is not read)."""
    own = filenames.own_path(queue_path)
    if not os.path.isdir(own):
        return
    for entry in os.scandir(own):
        if filenames.is_temporary(entry.name) and entry.is_file():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
