"""Rotation and packing of a queue's journal files.

A checkpoint taken at rotation time T describes the queue as it stood when the live journal was
renamed to `<name>.<T>`: the last xid, the open reads, and the items in order. Packing writes that
state to a temporary file, renames it `<name>.<T>.pack`, deletes every rotated journal at or before
T, and finally renames the pack to `<name>.<T>`. A crash between any two steps leaves files that
`finish_interrupted_packs` completes on the next start.

Layout: SAVE_XID with the last-used xid (the mark of a pack written here), each open read as
ADD_XID + REMOVE_TENTATIVE_XID (its xid), then the items as ADDX, then SAVE_XID again. The closing
SAVE_XID leaves the xid counter where it stood in Kestrel 2.4 as here (REMOVE_TENTATIVE_XID moves
it), and marks the pack complete: a `.pack` of ours that does not end with it is not honoured
(`check_pack`).

Kestrel 2.4.1 writes its packs with `Journal.dump`: each open read as ADDX + REMOVE_TENTATIVE_XID,
then ADDX records only (no SAVE_XID, no ADD_XID; an empty queue gives an empty file), and renames
one to `.pack` only once it is complete. Such a file is honoured as Kestrel honours it, when it
reads to its end. A file holding a SAVE_XID or an ADD_XID is ours (packs written before the leading
mark start with ADD_XID when reads were open, and all end with SAVE_XID).

Items that left the queue after T are written as empty placeholders, already expired
(`codec.PLACEHOLDER_EXPIRY`): the REMOVE records in the later journals consume them on replay,
exactly as they consumed the real items live.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import structlog

from kestrel.storage import damage, filenames
from kestrel.storage.crc32c import crc32c
from kestrel.storage.disk import fsync_path, write_all
from kestrel.storage.errors import CorruptJournalError
from kestrel.storage.item import QItem
from kestrel.storage.kestrel2 import codec
from kestrel.storage.kestrel2.codec import Record
from kestrel.storage.kestrel2.reader import JournalReader
from kestrel.storage.queue_path import JournalFiles

log = structlog.get_logger("kestrel.packer")

WRITE_BATCH = 1 << 20

# Test hook: called with a step name before each file operation of a pack; raising stops the pack
# there, which is how the tests simulate a crash at every step.
failpoint: Callable[[str], None] | None = None


def _step(name: str) -> None:
    if failpoint is not None:
        failpoint(name)


@dataclass
class PackRequest:
    """The state to write: replaying it equals replaying every journal at or before `timestamp`."""

    queue_path: str
    name: str
    timestamp: int
    xid: int
    open_reads: list[tuple[int, QItem]]
    items: list[QItem | None]  # None: an item that has since left the queue for good
    placeholder_time: int


def pack_path(req: PackRequest) -> str:
    """Where the finished pack waits while the files it replaces are deleted."""
    return os.path.join(req.queue_path, filenames.pack_name(req.name, req.timestamp))


def write_pack(req: PackRequest, dead_files: list[str],
               placed: Callable[[str, int, int], None] | None = None,
               finished: Callable[[str, str, list[str], int, int], None] | None = None) -> str:
    """Carry out the pack; return the path of the packed journal (`<name>.<timestamp>`).

    `placed(pack, size, crc)` is called once the pack is written and fsynced, before it becomes the
    `.pack` and any journal is deleted, `finished(pack, final, dead, size, crc)` once it has its
    final name (the manifest).
    """
    temp = os.path.join(req.queue_path, filenames.pack_temporary_name(req.name, req.timestamp))
    pack = pack_path(req)
    final = filenames.rotated_path(req.queue_path, req.name, req.timestamp)
    _step("write")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        chunks = [codec.encode_xid(codec.SAVE_XID, req.xid)]  # the mark of a pack of ours
        size = 0
        total = crc = 0
        for xid, item in req.open_reads:
            chunks.append(codec.encode(codec.AddXid(xid, item.add_time, item.expiry, item.data)))
            chunks.append(codec.encode_xid(codec.REMOVE_TENTATIVE_XID, xid))
        placeholder = codec.encode_addx(req.placeholder_time, codec.PLACEHOLDER_EXPIRY, b"")
        for entry in req.items:
            if entry is None:
                chunk = placeholder
            else:
                chunk = codec.encode_addx(entry.add_time, entry.expiry, entry.data)
            chunks.append(chunk)
            size += len(chunk)
            if size >= WRITE_BATCH:
                data = b"".join(chunks)
                write_all(fd, data)
                crc, total = crc32c(data, crc), total + len(data)
                chunks.clear()
                size = 0
        chunks.append(codec.encode_xid(codec.SAVE_XID, req.xid))
        data = b"".join(chunks)
        write_all(fd, data)
        crc, total = crc32c(data, crc), total + len(data)
        _step("fsync")
        os.fsync(fd)
    except BaseException:
        _remove_temporary(temp, fd)
        raise
    os.close(fd)
    try:
        if placed is not None:  # listed first: a crash after the rename finds it expected
            placed(pack, total, crc)
        _step("rename-pack")
        os.rename(temp, pack)
    except BaseException:
        _remove_temporary(temp)
        raise
    fsync_path(req.queue_path)
    for path in dead_files:
        _step("delete")
        os.unlink(path)
    _step("rename-final")
    os.rename(pack, final)
    fsync_path(req.queue_path)
    if finished is not None:
        finished(pack, final, dead_files, total, crc)
    log.info("packed journal", queue=req.name, file=final, items=len(req.items),
             open_reads=len(req.open_reads), replaced=len(dead_files))
    return final


def _remove_temporary(temp: str, fd: int | None = None) -> None:
    """Close and delete the temporary file of a pack that failed, so that only the failure that
    stopped the pack is raised: a cleanup that fails too (the disk that failed the write may fail
    this as well) is logged, and leaves a `~~` temporary that only takes space until the next start
    deletes it (src/kestrel/storage/queue_path.py)."""
    steps = [("delete", partial(os.unlink, temp))]
    if fd is not None:
        steps.insert(0, ("close", partial(os.close, fd)))
    for step, run in steps:
        try:
            run()
        except OSError as e:
            log.warning("could not clean up after a failed pack", file=temp, step=step, error=str(e))


_PACK_RECORDS = (codec.SaveXid, codec.AddXid, codec.AddX, codec.RemoveTentativeXid)


def check_pack(path: str) -> str | None:
    """Why the `.pack` at `path` is not a complete pack, or None if it is.

    A file that does not read to its end is not one. A pack we write starts and ends with SAVE_XID
    and is fsynced before it is renamed to `.pack`: one of ours (it holds a SAVE_XID or an ADD_XID)
    that ends otherwise is not complete. A file of ADDX and REMOVE_TENTATIVE_XID records only, or an
    empty one, is Kestrel 2.4.1's `Journal.dump`, which Kestrel renames to `.pack` once complete.
    """
    reader = JournalReader(path)
    last: Record | None = None
    ours = False
    try:
        for offset, record in reader:
            last = record
            ours = ours or isinstance(record, codec.SaveXid | codec.AddXid)
            if not isinstance(record, _PACK_RECORDS):
                return f"it holds a {type(record).__name__} record at offset {offset}, which no pack holds"
        if reader.leftover():
            return f"it ends inside a record at offset {reader.offset}"
    except CorruptJournalError as e:
        return e.reason + f" at offset {e.offset}"
    finally:
        reader.close()
    if ours and not isinstance(last, codec.SaveXid):
        return "it does not end with the SAVE_XID that closes a complete pack"
    return None


def is_our_pack(path: str) -> bool:
    """Whether the file is a complete pack written here (it starts with the SAVE_XID mark)."""
    try:
        reader = JournalReader(path)
    except OSError:
        return False
    try:
        first = reader.next()
    except CorruptJournalError:
        return False
    finally:
        reader.close()
    return first is not None and isinstance(first[1], codec.SaveXid) and check_pack(path) is None


def finish_interrupted_packs(queue_path: str, name: str, files: JournalFiles, salvage: bool,
                             stamp: int) -> JournalFiles:
    """Complete a pack that a crash interrupted, as the format document prescribes.

    A `.pack` file is the state of every rotated journal at or before its timestamp: those are
    deleted and the pack takes the rotated name. A `.pack` that is not complete deletes nothing:
    it refuses the queue (CorruptJournalError), or with `salvage` is set aside
    (src/kestrel/storage/damage.py). Returns the files left to replay.
    """
    for ts, pack_path in files.packs:
        reason = check_pack(pack_path)
        if reason is not None:
            damage.settle(queue_path, name, [damage.Finding(
                pack_path, f"incomplete pack, not applied: {reason}; no journal was deleted",
                damage.Remedy.SET_ASIDE, also="the journals it would have replaced are replayed")],
                salvage, stamp)
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
