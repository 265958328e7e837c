"""Helpers for the storage tests."""

from __future__ import annotations

from kestrel.storage import QueueCollection


def drain(coll: QueueCollection, name: str) -> list[bytes]:
    """Remove every item of a queue, returning their data in order."""
    out = []
    while (item := coll.remove(name)) is not None:
        out.append(item.data)
    return out


def reopen(coll: QueueCollection) -> QueueCollection:
    """Close the collection and load its directory again, as a restart does."""
    coll.close()
    again = QueueCollection(coll.path, coll.configs, coll.aliases, coll.clock)
    again.load()
    return again


def load_strictly(coll: QueueCollection) -> QueueCollection:
    """Load, then raise the CorruptJournalError of the first queue refused (the collection itself
    refuses a damaged queue alone and loads the others)."""
    coll.load()
    for error in coll.refused.values():
        raise error
    return coll
