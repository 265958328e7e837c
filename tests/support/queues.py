"""Helpers for the storage tests."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, TypeVar

from kestrel.storage import QueueCollection, QueueConfigs

T = TypeVar("T")


# Collections a test's helper `opened`: those the test left open are closed after it
# (`close_left_open`, tests/conftest.py), so that a test process does not hold every test's journals.
# Only for collections no test "crashes": closing one that a test left for dead would write to files
# the test has since cut or removed, as no killed process does.
_opened: list[QueueCollection] = []


def opened(coll: QueueCollection) -> QueueCollection:
    """`coll`, to be closed after the running test if the test leaves it open."""
    _opened.append(coll)
    return coll


def close_left_open() -> None:
    """Close the collections `opened` in the test just run that it left open, the last first."""
    while _opened:
        coll = _opened.pop()
        if not coll.closed:
            coll.close()


def open_collection(path: Any, defaults: dict[str, Any] | None = None, queues: dict[str, Any] | None = None,
                    **options: Any) -> QueueCollection:
    """A loaded collection on `path`: `defaults` for every queue, `queues` by name, and the
    collection's own keyword options (clock, runtime, commit_log, ...)."""
    coll = QueueCollection(str(path), QueueConfigs(defaults or {}, queues or {}), **options)
    coll.load()
    return coll


def one(items: list[T]) -> T | None:
    """The item a remove of one took, or None when it took none."""
    return items[0] if items else None


def journal_files(path: Path) -> list[str]:
    """The files of a queue path, the server's own directory (`.kestrel/`) left out."""
    return sorted(n for n in os.listdir(path) if n != ".kestrel")


def aside(path: Path) -> dict[str, bytes]:
    """The copies damage handling kept (`.kestrel/aside/`), by name."""
    folder = path / ".kestrel" / "aside"
    return {n: (folder / n).read_bytes() for n in sorted(os.listdir(folder))} if folder.exists() else {}


def manifest_path(path: Path, queue: str = "q") -> Path:
    return path / ".kestrel" / f"{queue}.manifest"


def drain(coll: QueueCollection, name: str) -> list[bytes]:
    """Remove every item of a queue, a batch at a time, returning their data in order."""
    out = []
    while taken := coll.remove(name, 100):
        out += [item.data for item in taken]
    return out


def held_in_memory(coll: QueueCollection) -> int:
    """What the collection's queues hold in memory (items and open reads, counted item by item, and
    read-behind buffers, as their cursors report them): the running total the collection keeps as
    they change (`coll.ledger`) must equal it."""
    queues = [coll.get(name) for name in coll.queue_names()]
    return sum(q.memory_bytes + sum(len(i.data) for i in q.open_reads()) + q.held_bytes()[2]
               for q in queues if q is not None)


def reopen(coll: QueueCollection) -> QueueCollection:
    """Close the collection and load its directory again, as a restart does (`opened`, as it was)."""
    coll.close()
    again = QueueCollection(coll.path, coll.configs, coll.aliases, coll.clock)
    if any(held is coll for held in _opened):
        opened(again)
    again.load()
    return again


def load_strictly(coll: QueueCollection) -> QueueCollection:
    """Load, then raise the CorruptJournalError of the first queue refused (the collection itself
    refuses a damaged queue alone and loads the others)."""
    coll.load()
    for error in coll.refused.values():
        raise error
    return coll
