"""The streaming source's write-ahead log, kept under the query's checkpoint.

Each task of a micro-batch writes one file holding the items it fetched and their read ids before
Spark sees a row, so that a replayed batch yields exactly the same rows. A file appears whole or
not at all (written aside, fsynced, then hard-linked into place: the first writer wins).

Layout: `<checkpoint>/kestrel/<source>/<batch>/<partition>`; a file is a magic line, a JSON header
line (server, fetch time, count), the read ids (int64 each), then each item as a
uint32 length and its bytes.

This module also reads Spark's own checkpoint logs (`commits/`, `offsets/`) to learn which batches
the sink has committed, since Spark tells a source only when it plans the next batch.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import uuid
from dataclasses import dataclass
from typing import Any

from storage.journal import fsync_dir

MAGIC = b"KESTREL-WAL 1\n"
_LEN = struct.Struct("<I")


@dataclass
class WalHeader:
    server: str
    fetched_at: float  # seconds since the epoch, when the first item was taken
    count: int


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


def write_partition(path: str, header: WalHeader, ids: list[int], items: list[bytes]) -> bool:
    """Write the file whole; False when another attempt wrote it first (theirs stands)."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    aside = f"{path}.{uuid.uuid4().hex}.tmp"
    head = json.dumps(header.__dict__).encode() + b"\n"
    with open(aside, "wb") as f:
        f.write(MAGIC + head)
        f.write(struct.pack(f"<{len(ids)}q", *ids))
        f.write(b"".join(_LEN.pack(len(item)) + item for item in items))
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(aside, path)
        won = True
    except FileExistsError:
        won = False
    finally:
        os.unlink(aside)
    fsync_dir(folder)
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


def read_items(path: str) -> list[bytes]:
    with open(path, "rb") as f:
        header, _ = _read_head(f, path)
        body = f.read()
    items, at = [], 0
    for _ in range(header.count):
        (size,) = _LEN.unpack_from(body, at)
        items.append(body[at + 4:at + 4 + size])
        at += 4 + size
    return items


def batches(root: str) -> list[int]:
    """Batch numbers that still have a log folder, oldest first."""
    if not os.path.isdir(root):
        return []
    return sorted(int(name) for name in os.listdir(root) if name.isdigit())


def batch_files(root: str, batch: int) -> list[str]:
    folder = os.path.join(root, str(batch))
    if not os.path.isdir(folder):
        return []
    return [os.path.join(folder, n) for n in sorted(os.listdir(folder)) if not n.endswith(".tmp")]


def forget_batch(root: str, batch: int) -> None:
    shutil.rmtree(os.path.join(root, str(batch)), ignore_errors=True)


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
