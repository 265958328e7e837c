"""Read-behind (Kestrel's guide): once a queue holds `max_memory_size` bytes of items (less while the
memory governor gives it a smaller share, src/kestrel/storage/memory.py), new items are only
counted and stay in the journal; a cursor reads them back, oldest first, as the head drains, and
read-behind ends once the cursor has read every one back. The memory governor pages a queue out the
same way: the items held beyond its share leave memory, and a cursor placed at the first of them
reads them back later (`PersistentQueue.shed`).

The queue (src/kestrel/storage/queue.py) holds a `ReadBehind` while it reads behind, and asks it to
fill its memory; each format supplies the cursor: Kestrel 2 reads add records forward through its
journal files (src/kestrel/storage/kestrel2/read_behind.py), Kestrel 3 a reader's items from the
writer files (src/kestrel/storage/kestrel3/queue.py).

A cursor holds a descriptor only while its queue is read: placed, it opens nothing; a change of
the queue opens its file before anything changes (out of descriptors, that change alone is refused:
`JournalReadError`), and the memory governor closes it again once the queue idles: queues paged
out and left alone hold none for their items on disk.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, Protocol, TypeVar

import structlog

from kestrel.storage.deferred_log import log_later
from kestrel.storage.item import QItem
from kestrel.storage.journal_file import BufferedFile
from kestrel.storage.runtime import Runtime

log = structlog.get_logger("kestrel.queue")


class Cursor(Protocol):
    """A format's cursor over the items a queue only counted, oldest first."""

    def open(self) -> object:
        """Open its file if it is not (it opens none until it reads, and closes it at `release`).
        Raises OSError."""

    def sync(self) -> None:
        """Before a fill: the files hold everything the cursor is to read."""

    def next_item(self, now: int) -> QItem | None:
        """The next item (`now` is the add time of a record that has none), or None once every
        item is in memory."""

    def buffered(self) -> int:
        """Bytes it keeps buffered (the memory governor counts them)."""

    def holds_file(self) -> bool:
        """Whether its file is open (until `release`)."""

    def opening_reads(self) -> bool:
        """Whether `open` would read its file now (which may wait for the disk), before a change."""

    def release(self) -> None:
        """Drop its buffer and close its file, keeping its place (`open` takes it up again)."""

    def close(self) -> None:
        """Close its file for good."""


R = TypeVar("R", bound=BufferedFile)


class FileCursor(Generic[R]):
    """What both formats' cursors do with their file: a record reader that their `open` opens for
    a read, closed again at `release`, where it stopped (`at`) kept for the next `open`."""

    def __init__(self, at: int) -> None:
        self.reader: R | None = None
        self.at = at  # where the next record starts, while no reader is open

    def buffered(self) -> int:
        return self.reader.buffered if self.reader is not None else 0

    def holds_file(self) -> bool:
        return self.reader is not None

    def release(self) -> None:
        reader = self.reader
        if reader is not None:
            self.at = reader.offset
            self.reader = None
            reader.close()

    def close(self) -> None:
        self.release()
        self.at = 0


class ReadBehind:
    """One queue's read-behind, from its start to the moment every item is back in memory."""

    __slots__ = ("queue", "cursor", "filled", "runtime")

    def __init__(self, queue: str, cursor: Cursor, runtime: Runtime) -> None:
        self.queue = queue
        self.cursor = cursor
        self.runtime = runtime  # for its log line, written after the change (deferred_log.py)
        self.filled = 0  # bytes the last `fill` read into memory, even where reading raised

    def fill(self, mem: deque[QItem], held: int, target: int, now: int) -> bool:
        """Read items onto the tail of `mem` (holding `held` bytes) up to `target` bytes, the head
        at least, whatever the target; True once every item is in memory (read-behind is over)."""
        cursor = self.cursor
        cursor.sync()
        self.filled = 0
        while held + self.filled < target or not mem:
            item = cursor.next_item(now)
            if item is None:
                return True
            mem.append(item)
            self.filled += len(item.data)
        return False

    def moved(self, cursor: Cursor) -> None:
        """Reading resumes from `cursor` (paged out again: it starts further ahead)."""
        if cursor is not self.cursor:
            self.cursor.close()
            self.cursor = cursor

    def end(self, items: int) -> None:
        """Every item is in memory, or gone (a flush, a rebuild, a close)."""
        self.cursor.close()
        log_later(self.runtime, log.info, "queue leaving read-behind", queue=self.queue, items=items)
