"""`kestrel journal recover QUEUE_PATH`: put what a commit log left by a crash holds into the
journals, offline, under the queue path's lock (src/kestrel/storage/commit_log.py; a server starting on the
path does the same). Afterwards the path holds plain journals that any reader sees whole.
"""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

from kestrel.storage import commit_log
from kestrel.storage.clock import SYSTEM_CLOCK
from kestrel.storage.errors import QueuePathInUse
from kestrel.storage.lock import QueuePathLock, left_alone


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("queue_path", metavar="QUEUE_PATH", help="the server's queue path")


def run(args: argparse.Namespace, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """0 when the journals are complete (recovered, or nothing was pending); 1 when a queue's
    records cannot be placed (each such queue named, its records kept for the next start) or on an
    error, naming the file; 3 while a server holds the path."""
    queue_path = args.queue_path
    try:
        if left_alone(queue_path):  # no commit log can be there
            out.write(f"{queue_path}: no commit log: nothing to recover\n")
            return 0
        with QueuePathLock(queue_path) as lock:
            lock.acquire("kestrel journal recover")
            segments = len(commit_log.segment_paths(queue_path)) + len(commit_log.held_paths(queue_path))
            recovery = commit_log.recover(queue_path, SYSTEM_CLOCK.now_ms())
    except QueuePathInUse as e:
        print(f"kestrel journal recover: {e}", file=err)
        return 3
    except OSError as e:
        print(f"kestrel journal recover: {e.filename or queue_path}: {e.strerror or e}", file=err)
        return 1
    if not segments:
        out.write(f"{queue_path}: no commit log: nothing to recover\n")
        return 0
    out.write(f"{queue_path}: recovered the commit log ({segments} segments): {recovery.written} records "
              "written to the journals\n")
    for copy in recovery.copies:
        out.write(f"{queue_path}: a copy of what was replaced or cut is kept as {copy}\n")
    for queue, error in sorted(recovery.refused.items()):
        print(f"kestrel journal recover: queue {queue!r} cannot be recovered: {error}; {error.remedy()}",
              file=err)
    return 1 if recovery.refused else 0
