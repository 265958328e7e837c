"""The engine's one exception tree. Each protocol maps these to its own wire error in one place."""

from __future__ import annotations


class KestrelError(Exception):
    """Root of every error the engine raises on purpose."""


class InvalidQueueName(KestrelError, ValueError):
    """Raised when a queue name could not be a journal file name (slash, squiggle, dot, stray plus)."""


class QueueFull(KestrelError):
    """Raised when an add is refused because the queue reached `max_items` or `max_size`."""


class ItemTooLarge(KestrelError):
    """Raised when an item is larger than its queue's `max_item_size`."""


class QueueClosed(KestrelError):
    """Raised when a queue is used after it was closed or deleted."""


class ConfigError(KestrelError, ValueError):
    """Raised when a setting cannot be parsed; the message names the key path."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"{key}: {reason}")
        self.key = key
        self.reason = reason


class CorruptJournalError(KestrelError):
    """Raised when a journal holds a record that cannot be read and is not a torn tail."""

    def __init__(self, path: str, offset: int, opcode: int | None, reason: str) -> None:
        op = "?" if opcode is None else str(opcode)
        super().__init__(f"corrupt journal {path} at offset {offset} (opcode {op}): {reason}")
        self.path = path
        self.offset = offset
        self.opcode = opcode
        self.reason = reason


class Refused(KestrelError):
    """Raised when the server's status (read-only, quiescent) forbids an operation."""
