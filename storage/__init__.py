"""Kestrel's storage engine: journaled FIFO queues, usable as a library without any server."""

from storage.collection import QueueCollection
from storage.config import QueueConfig, QueueConfigs
from storage.errors import (
    ConfigError,
    CorruptJournalError,
    InvalidQueueName,
    ItemTooLarge,
    JournalWriteError,
    KestrelError,
    QueueClosed,
    TooManyQueues,
)
from storage.item import QItem
from storage.queue import PersistentQueue

__all__ = [
    "ConfigError",
    "CorruptJournalError",
    "InvalidQueueName",
    "ItemTooLarge",
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
