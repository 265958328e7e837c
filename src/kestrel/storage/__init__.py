"""Kestrel's storage engine: journaled FIFO queues, usable as a library without any server.

The names below load on first use (PEP 562): a process that needs one module of the engine (the
journal reader in a Spark worker, the errors in a client) does not pay for importing all of it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kestrel.storage.collection import QueueCollection
    from kestrel.storage.config import QueueConfig, QueueConfigs
    from kestrel.storage.errors import (
        ConfigError,
        CorruptJournalError,
        InvalidQueueName,
        JournalWriteError,
        KestrelError,
        QueueClosed,
        TooManyQueues,
    )
    from kestrel.storage.item import QItem
    from kestrel.storage.queue import PersistentQueue

_MODULES = {  # where each name lives
    "kestrel.storage.collection": ("QueueCollection",),
    "kestrel.storage.config": ("QueueConfig", "QueueConfigs"),
    "kestrel.storage.errors": ("ConfigError", "CorruptJournalError", "InvalidQueueName",
                       "JournalWriteError", "KestrelError", "QueueClosed", "TooManyQueues"),
    "kestrel.storage.item": ("QItem",),
    "kestrel.storage.queue": ("PersistentQueue",),
}
_HOMES = {name: module for module, names in _MODULES.items() for name in names}

__all__ = [
    "ConfigError",
    "CorruptJournalError",
    "InvalidQueueName",
    "JournalWriteError",
    "KestrelError",
    "PersistentQueue",
    "QItem",
    "QueueClosed",
    "QueueCollection",
    "QueueConfig",
    "QueueConfigs",
    "TooManyQueues",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'storage' has no attribute {name!r}")
    value = getattr(importlib.import_module(home), name)
    globals()[name] = value
    return value
