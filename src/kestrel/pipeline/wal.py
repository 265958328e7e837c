"""The streaming source's write-ahead log, kept under the query's checkpoint.

Each task of a micro-batch writes one file holding the items it fetched and their read ids before
Spark sees a row, so that a replayed batch yields exactly the same rows. A file appears whole or
not at all (written aside, fsynced, then hard-linked into place: the first writer wins).

Layout: `<checkpoint>/kestrel/<source>/<batch>/<partition>`; a file is a magic line, a JSON header
line (server, fetch time, count, queue, timed), the read ids (int64 each), each item as a
uint32 length and its bytes, then (when `timed`) each item's add time and expiry (int64 ms since the
epoch each; expiry 0: never); files of earlier versions have no times (their rows' times are null).
A file's name is `<host>_<port>-<part>`, preceded by `<queue>~` when the
source reads several queues (`~` is never part of a queue's name). An empty `<partition>.confirmed`
beside it says its reads were confirmed, and `<partition>.confirming` that a confirm was sent and
its answer not yet noted (the server may have closed them);
`<checkpoint>/kestrel/<source>/returned` counts the items possibly delivered again because their
reads had gone back to the queue when they were confirmed (see the stream's `_note_closed`), and
`<checkpoint>/kestrel/<source>/driver-mark` holds a token the driver writes and every task checks
before it takes anything: a task that does not find it does not share the checkpoint with the driver.

This module also reads Spark's own checkpoint logs (`commits/`, `offsets/`) to learn which batches
the sink has committed, since Spark tells a source only when it plans the next batch.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import uuid
from dataclasses import dataclass
from itertools import chain
from typing import Any

from kestrel.storage.disk import fsync_path, replace_file

MAGIC = b"KESTREL-WAL 1\n"
CONFIRMED = ".confirmed"  # beside a file whose reads were confirmed
CONFIRMING = ".confirming"  # beside a file whose reads a confirm was sent for, its answer not yet noted
RETURNED = "returned"  # in the source's folder: items possibly delivered again, counted
TOKEN = "driver-mark"  # in the source's folder: written by the driver, checked by the executors
_LEN = struct.Struct("<I")


@dataclass
class WalHeader:
    server: str
    fetched_at: float  # seconds since the epoch, when the first item was taken
    count: int
    queue: str | None = None  # absent from files of versions that read one queue per source
    timed: bool = False  # each item's add time and expiry follow the items (absent from earlier files)
    opened_at: int | None = None  # when the server had opened the queue (peek_items), at planning
    took: float | None = None  # seconds the fetch took, on the monotonic clock (earlier versions: the wall)
    auto_abort_ms: int | None = None  # what the reads were opened with (absent from earlier files)

    def returned_at(self, auto_abort_ms: int) -> float:
        """When the server puts back reads never confirmed: by the autoAbortMs they were opened with,
        which a restarted query's option need not be; a file that does not say is judged by it."""
        return self.fetched_at + (self.auto_abort_ms or auto_abort_ms) / 1000.0


@dataclass
class Logged:
    """A file's items, with their add times and expiries (ms; None in a file without times)."""

    items: list[bytes]
    added: list[int] | None = None
    expiry: list[int] | None = None


def checkpoint_dir(location: str) -> str:
    """A local path from a checkpoint location (plain path or file: URI); other schemes refused."""
    if location.startswith("file:"):
        location = location[len("file:"):]
        while location.startswith("//"):
            location = location[1:]
    elif "://" in location:
        raise ValueError(f"option 'checkpointLocation': only local or mounted paths are supported, got "
                         f"{location!r}")
    return os.path.abspath(location)


def write_partition(path: str, header: WalHeader, ids: list[int], logged: Logged) -> bool:
    """Write the file whole; False when another attempt wrote it first (theirs stands)."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    aside = f"{path}.{uuid.uuid4().hex}.tmp"
    header.timed = logged.added is not None and logged.expiry is not None
    head = json.dumps(header.__dict__).encode() + b"\n"
    with open(aside, "wb") as f:
        f.write(MAGIC + head)
        f.write(struct.pack(f"<{len(ids)}q", *ids))
        # each item's length, then the item, laid out in one compiled pass
        lengths = map(_LEN.pack, map(len, logged.items))
        f.write(b"".join(chain.from_iterable(zip(lengths, logged.items, strict=True))))
        if logged.added is not None and logged.expiry is not None:
            f.write(struct.pack(f"<{2 * len(ids)}q", *logged.added, *logged.expiry))
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(aside, path)
        won = True
    except FileExistsError:
        won = False
    finally:
        os.unlink(aside)
    fsync_path(folder)
    return won


def _read_head(f: Any, path: str) -> tuple[WalHeader, list[int]]:
    if f.readline() != MAGIC:
        raise ValueError(f"{path}: not a kestrel write-ahead log file")
    fields = json.loads(f.readline())
    fields.pop("epoch", None)  # written by earlier versions, which confirmed ids only over one connection
    header = WalHeader(**fields)
    raw = f.read(8 * header.count)
    return header, list(struct.unpack(f"<{header.count}q", raw))


def read_ids(path: str) -> tuple[WalHeader, list[int]]:
    with open(path, "rb") as f:
        return _read_head(f, path)


def read_items(path: str) -> Logged:
    with open(path, "rb") as f:
        header, _ = _read_head(f, path)
        body = f.read()
    items, at = [], 0
    for _ in range(header.count):
        (size,) = _LEN.unpack_from(body, at)
        items.append(body[at + 4:at + 4 + size])
        at += 4 + size
    if not header.timed:
        return Logged(items)
    times = struct.unpack_from(f"<{2 * header.count}q", body, at)
    return Logged(items, list(times[:header.count]), list(times[header.count:]))


def batches(root: str) -> list[int]:
    """Batch numbers that still have a log folder, oldest first."""
    if not os.path.isdir(root):
        return []
    return sorted(int(name) for name in os.listdir(root) if name.isdigit())


def batch_files(root: str, batch: int) -> list[str]:
    folder = os.path.join(root, str(batch))
    if not os.path.isdir(folder):
        return []
    names = sorted(os.listdir(folder))
    return [os.path.join(folder, n) for n in names if not n.endswith((".tmp", CONFIRMED, CONFIRMING))]


def mark_confirming(path: str, sent: float) -> None:
    """Note, before the confirm is sent (at `sent`, seconds since the epoch), that the server may
    close a file's reads from now on: a confirm whose answer was lost, or a process killed before
    `mark_confirmed`, leaves this behind (see `held_early`)."""
    with open(path + CONFIRMING, "w", encoding="ascii") as f:
        f.write(f"{sent}\n")


def confirming_since(path: str) -> float | None:
    """When the first confirm of a file's reads whose answer was never noted was sent (0.0: at a
    time not noted, by an earlier version); None if there is none."""
    try:
        with open(path + CONFIRMING, encoding="ascii") as f:
            return float(f.read().strip() or 0.0)
    except FileNotFoundError:
        return None


def token_path(root: str) -> str:
    return os.path.join(root, TOKEN)


def write_token(root: str, token: str) -> str:
    """Mark a stream's log with `token` (written once, by the driver): an executor that does not
    find it there does not share the checkpoint with the driver."""
    os.makedirs(root, exist_ok=True)
    replace_file(token_path(root), token.encode("ascii"), f"{token_path(root)}.{uuid.uuid4().hex}.tmp")
    return token


def read_token(root: str) -> str | None:
    try:
        with open(token_path(root), encoding="ascii") as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


def unmark_confirming(path: str) -> None:
    """The confirm was not taken: the reads are as they were."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path + CONFIRMING)


def mark_confirmed(path: str) -> None:
    """Note that a file's reads were confirmed (its rows stay, for a replay of its batch), so that
    no later planning or restarted query confirms them again."""
    with open(path + CONFIRMED, "wb"):
        pass
    unmark_confirming(path)


def is_confirmed(path: str) -> bool:
    return os.path.exists(path + CONFIRMED)


def forget_file(path: str) -> None:
    """Drop one file of a committed batch whose reads are confirmed (the rest of it is pending)."""
    for name in (path, path + CONFIRMED, path + CONFIRMING):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)


def forget_batch(root: str, batch: int) -> None:
    shutil.rmtree(os.path.join(root, str(batch)), ignore_errors=True)


def count_returned(root: str, items: int) -> int:
    """Add to the source's count of items possibly delivered again because their reads had returned
    to the queue when confirmed (possible duplicates); returns the new total."""
    path = os.path.join(root, RETURNED)
    total = returned(root) + items
    os.makedirs(root, exist_ok=True)
    replace_file(path, f"{total}\n".encode(), path + ".tmp", sync=False)  # a count of duplicates, not data
    return total


def returned(root: str) -> int:
    """The source's count of possible duplicates so far (see count_returned)."""
    try:
        with open(os.path.join(root, RETURNED), encoding="ascii") as f:
            return int(f.read().strip() or 0)
    except FileNotFoundError:
        return 0


def held_early(location: str) -> int:
    """Items of batches the sink has not committed whose reads were confirmed early (the batch ran
    longer than half of autoAbortMs), or may have been (a confirm sent, the process killed before
    its answer was noted): nothing but the log under checkpoint `location` may hold them, until a
    query from it replays their batch."""
    checkpoint = checkpoint_dir(location)
    top = os.path.join(checkpoint, "kestrel")
    held = 0
    for source in sorted(os.listdir(top)) if os.path.isdir(top) else []:
        root = os.path.join(top, source)
        committed = SparkCommitLog(checkpoint, source).committed()
        for batch in batches(root):
            if batch > committed:
                held += sum(read_ids(path)[0].count for path in batch_files(root, batch)
                            if is_confirmed(path) or os.path.exists(path + CONFIRMING))
    return held


class SparkCommitLog:
    """The highest batch of one source that the query's sink has committed, from Spark's own logs."""

    def __init__(self, checkpoint: str, source_key: str) -> None:
        self.checkpoint, self.source_key = checkpoint, source_key
        self._seen_commit = -1
        self._committed = -1

    def committed(self) -> int:
        commits = os.path.join(self.checkpoint, "commits")
        try:
            done = [int(n) for n in os.listdir(commits) if n.isdigit()]
        except FileNotFoundError:
            return self._committed
        if done and max(done) != self._seen_commit:
            latest = max(done)
            batch = self._source_batch(latest)
            if batch is not None:
                self._seen_commit, self._committed = latest, max(self._committed, batch)
        return self._committed

    def _source_batch(self, spark_batch: int) -> int | None:
        try:
            with open(os.path.join(self.checkpoint, "offsets", str(spark_batch))) as f:
                lines = f.read().splitlines()
        except FileNotFoundError:
            return None
        for line in lines[2:]:  # a version line, the batch's metadata, then one offset per source
            try:
                offset = json.loads(line)
            except ValueError:
                continue
            if isinstance(offset, dict) and offset.get("source") == self.source_key:
                return int(offset["batch"])
        return None
