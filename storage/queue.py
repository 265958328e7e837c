"""QueueBase: what both kinds of queue share, so that the collection and every protocol use either.

PersistentQueue (`storage/queue.py`, Kestrel's journal) and Kestrel3Queue (`storage/kestrel3_queue.py`,
Kestrel 3's writer journal and reader checkpoints) keep their items differently; the guide's figures,
the waiting readers, the hand-off of poison items and the one-item forms of add and remove are the
same, and live here once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sized

import structlog

from kestrel.storage.clock import Clock
from kestrel.storage.config import QueueConfig
from kestrel.storage.errors import KestrelError, QueueClosed
from kestrel.storage.item import QItem
from kestrel.storage.runtime import Runtime
from kestrel.storage.wait_list import WaitList

log = structlog.get_logger("kestrel.queue")


class QueueBase(ABC):
    """The state and figures every queue keeps; subclasses hold the items (`_mem`, `_opens`)."""

    _mem: Sized  # the items held in memory

    def __init__(self, name: str, queue_path: str, config: QueueConfig, clock: Clock, runtime: Runtime,
                 expire_to: Callable[[str], QueueBase | None] | None) -> None:
        self.name = name
        self.queue_path = queue_path
        self.config = config
        self.clock = clock
        self._expire_to = expire_to  # looks up the queue that expired items move to
        self._opens: dict[int, QItem] = {}  # open reads by xid
        self._waits = WaitList(runtime)
        self.poison: Callable[[QItem], None] | None = None  # takes items aborted max_errors times
        self.closed = False
        # The journal cannot be written: changes are refused until it can (PersistentQueue; in a
        # Kestrel3Queue a failed write refuses that one change only, and this stays False).
        self.read_only = False
        self.length = 0
        self.bytes = 0
        self.memory_bytes = 0
        self.create_time = clock.now_ms()
        self.total_items = 0
        self.expired_items = 0
        self.discarded = 0
        self.total_flushes = 0
        self.total_transactions = 0
        self.canceled_transactions = 0
        self.poisoned_items = 0
        self.current_age = 0
        self.journal_write_errors = 0

    # -----------------------------------------------------------------------------------------
    # Figures

    @property
    def open_transactions(self) -> int:
        return len(self._opens)

    @property
    def waiters(self) -> int:
        return len(self._waits)

    @property
    def waits_ended(self) -> bool:
        return self._waits.ended

    @property
    @abstractmethod
    def in_read_behind(self) -> bool:
        """Whether items beyond `max_memory_size` are only counted, to be read back from disk."""

    @property
    @abstractmethod
    def journal_size(self) -> int:
        """Bytes of the journal files this queue reads."""

    def stats(self) -> dict[str, int]:
        """The guide's per-queue figures, under its names, and ours (read-only, write errors, poison)."""
        age = self.current_age if self.length else 0
        return {
            "items": self.length,
            "bytes": self.bytes,
            "total_items": self.total_items,
            "logsize": self.journal_size,
            "expired_items": self.expired_items,
            "mem_items": len(self._mem),
            "mem_bytes": self.memory_bytes,
            "age": age,
            "discarded": self.discarded,
            "waiters": len(self._waits),
            "open_transactions": len(self._opens),
            "transactions": self.total_transactions,
            "canceled_transactions": self.canceled_transactions,
            "total_flushes": self.total_flushes,
            "age_msec": age,
            "create_time": self.create_time,
            "read_only": int(self.read_only),
            "journal_write_errors": self.journal_write_errors,
            "poisoned_items": self.poisoned_items,
        }

    def open_reads(self) -> list[QItem]:
        """The items of the open reads, lowest xid first."""
        return [self._opens[xid] for xid in sorted(self._opens)]

    # -----------------------------------------------------------------------------------------
    # Adding and removing

    def _check_open(self) -> None:
        if self.closed:
            raise QueueClosed(f"queue {self.name!r} is closed")

    def add(self, data: bytes, expiry: int = 0, add_time: int | None = None) -> bool:
        """Add an item at the tail; False when the queue is full and refuses it.

        `expiry` is absolute milliseconds since the epoch (0 = never), capped by `max_age`.
        Raises ItemTooLarge when the item is over `max_item_size`.
        """
        return self.add_many([data], expiry, add_time) == 1

    @abstractmethod
    def add_many(self, items: list[bytes], expiry: int = 0, add_time: int | None = None) -> int:
        """Add several items with one journal write; how many were accepted, in order."""

    def remove(self, transaction: bool = False) -> QItem | None:
        """Take the head item; with `transaction`, open a read on it (its `xid` is set)."""
        taken = self.remove_many(1, transaction)
        return taken[0] if taken else None

    @abstractmethod
    def remove_many(self, count: int, transaction: bool = False) -> list[QItem]:
        """Take up to `count` items from the head with one journal write."""

    @abstractmethod
    def peek(self) -> QItem | None:
        """The head item, left in the queue."""

    def _handed_to_poison(self, item: QItem) -> bool:
        """Give an item aborted `max_errors` times to `poison` (None drops it); False when that
        refuses it (its error queue full or unwritable), and the abort returns it to the head instead.

        Called before the read is closed, so a failure here loses nothing (at worst, a read
        closed meanwhile by another client leaves a copy in the error queue).
        """
        if self.poison is None:
            return True
        try:
            self.poison(item)
        except KestrelError as e:
            log.warning("poison item refused by its error queue; back at the head", queue=self.name,
                        errors=item.errors, reason=str(e))
            return False
        return True

    # -----------------------------------------------------------------------------------------
    # Waiting

    def end_waits(self) -> None:
        """Waiting readers return empty-handed now and later reads do not wait (the server is stopping)."""
        self._waits.end()

    def wait_remove(self, timeout: float, transaction: bool = False) -> QItem | None:
        """Remove, waiting up to `timeout` seconds for an item; waiters are served first come first."""
        return self._waits.wait(lambda: self.remove(transaction), timeout)

    def wait_peek(self, timeout: float) -> QItem | None:
        item = self._waits.wait(self.peek, timeout)
        if item is not None:
            self._waits.wake_one()  # a peek takes nothing: let the next waiter look too
        return item
