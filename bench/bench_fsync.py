"""The ceiling of `sync_journal: always` on this disk: group-commit rounds with no server around them.

N journals in a directory of the disk under test; each round appends one 150-byte record to every
journal and runs one round of the group commit (`src/kestrel/storage/fsync/group_commit.py`) over them, issued
each way the server can: Python threads, C threads (when the helper is built; the default), native AIO,
one syncfs of the file system a round (`KESTREL_FSYNC=syncfs`, `src/kestrel/storage/fsync/syncfs.py`); and, as
the floor, fdatasync of the journals one after another. Rounds/s times N is the most records/s a server
keeping one journal per queue can acknowledge with an fsync each, before any request is parsed.

    .venv/bin/python -m bench.bench_fsync [--journals 1 16] [--seconds 2] [--dir /var/tmp]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from functools import partial

import gevent

from bench.common import load_average, machine
from kestrel.storage.fsync.aio_fsync import AioFsync
from kestrel.storage.fsync.group_commit import (
    FsyncMany,
    GroupCommit,
    ThreadFsync,
    filesystem_sync,
    native_threads,
)

RECORD = b"x" * 150


class Journal:
    """A file appended to, as a round sees it."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self.size = 0
        self.synced = 0


class OneAfterAnother:
    """The floor: the same fsyncs, each waiting for the one before."""

    def fsync_all(self, fds: list[int]) -> list[OSError | None]:
        for fd in fds:
            os.fdatasync(fd)
        return [None] * len(fds)


def ways() -> dict[str, FsyncMany]:
    found: dict[str, FsyncMany] = {"Python threads": ThreadFsync()}
    native = native_threads()
    if native is not None:
        found["C threads"] = native
    aio = AioFsync.create()
    if aio is not None:
        found["native AIO"] = aio
    syncfs = filesystem_sync(found.get("C threads", found["Python threads"]))
    if syncfs is not None:
        found["syncfs"] = syncfs
    found["one after another"] = OneAfterAnother()
    return found


def rounds_per_second(way: FsyncMany, count: int, seconds: float, where: str) -> float:
    home = tempfile.mkdtemp(prefix="kestrel-fsync-", dir=where)
    try:
        journals = [Journal(os.path.join(home, f"q{i}")) for i in range(count)]
        commit = GroupCommit(way)
        started, rounds = time.monotonic(), 0
        while time.monotonic() - started < seconds:
            for journal in journals:
                os.write(journal.fd, RECORD)
                journal.size += len(RECORD)
            # Each waits in a greenlet of its own, as requests do: all join the round of this turn.
            waiting = [gevent.spawn(partial(commit.sync, j, j.size)) for j in journals]
            gevent.joinall(waiting, raise_error=True)
            rounds += 1
        for journal in journals:
            os.close(journal.fd)
        return rounds / (time.monotonic() - started)
    finally:
        shutil.rmtree(home, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--journals", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="a directory on the disk to measure")
    args = parser.parse_args()
    print(f"# group-commit rounds, {time.strftime('%Y-%m-%d %H:%M %Z')}, {machine()}, "
          f"load average {load_average()}, in {args.dir}")
    print("| journals | way | rounds/s | records/s |")
    print("| --- | --- | --- | --- |")
    for count in args.journals:
        for name, way in ways().items():
            rate = rounds_per_second(way, count, args.seconds, args.dir)
            print(f"| {count} | {name} | {rate:,.0f} | {rate * count:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
