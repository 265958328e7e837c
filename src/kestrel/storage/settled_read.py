"""A running server's queue files, read until they held still through a reading.

A server rotates, packs and deletes a queue's files while a tool or a Spark job reads them, so a
reading counts only if the queue's file names held still through it; one that lost a file or saw
them change is read again, and a damaged record is believed only if no file changed while it was
read (an append being written looks torn until it is finished). `kestrel journal dump --queue` and
the Spark journal source's items view read a queue through `read_settled`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

from kestrel.storage.errors import CorruptJournalError

T = TypeVar("T")
READINGS = 5  # readings of a busy queue's files before giving up
SETTLE_PAUSE_S = 0.05  # between two readings: a rotation or a pack under way has time to finish


class FilesKeptChanging(Exception):
    """Every reading of a queue's files saw them change (a server rotating or packing them)."""


def queue_files(queue_path: str, owner: str) -> dict[str, int]:
    """The journal files of `owner` (a Kestrel 2 queue, a Kestrel 3 unit) and their sizes, temporaries
    left out."""
    files = {}
    with os.scandir(queue_path) as entries:
        for entry in entries:
            if entry.name == owner or entry.name.startswith(owner + "."):
                try:
                    files[entry.name] = entry.stat().st_size
                except FileNotFoundError:  # deleted since the listing: changed all the same
                    files[entry.name] = -1
    return files


def read_settled(queue_path: str, owner: str, read: Callable[[], T]) -> T:
    """`read()`, read again until the file names of `owner` held still through it.

    Raises CorruptJournalError (damage read while no file changed), OSError, FilesKeptChanging.
    """
    for reading in range(1, READINGS + 1):
        before = queue_files(queue_path, owner)
        try:
            result = read()
        except FileNotFoundError:
            pass  # a file listed was gone when opened: rotated, packed or consumed meanwhile
        except CorruptJournalError:
            if reading == READINGS or queue_files(queue_path, owner) == before:
                raise
        else:
            if queue_files(queue_path, owner).keys() == before.keys():
                return result
        time.sleep(SETTLE_PAUSE_S)
    raise FilesKeptChanging(f"{queue_path}: the files of queue {owner!r} changed during each of {READINGS} "
                            "readings (a busy server rotating or packing them); try again")
