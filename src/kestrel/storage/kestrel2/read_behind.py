"""A Kestrel 2 queue's read-behind cursor (src/kestrel/storage/read_behind.py): where the next item
not held in memory is, in the queue's journal files.

Once a queue holds `max_memory_size` bytes, new items are only counted and journaled; this cursor
reads their add records back, file after file, as the head drains. It stops at its `stop` (while a
replay has applied the journal only that far) or at the end of the last file, the live journal
(the queue caught up: it leaves read-behind).
"""

from __future__ import annotations

from collections.abc import Callable

from kestrel.storage.item import QItem
from kestrel.storage.journal_file import CURSOR_CHUNK
from kestrel.storage.kestrel2.reader import JournalReader
from kestrel.storage.kestrel2.replay import ADDS, item_of
from kestrel.storage.read_behind import FileCursor
from kestrel.storage.write_gate import WriteGate

Files = list[tuple[int, str]]  # (sort key, path) in replay order: rotated timestamps, then LIVE
LIVE = 2**63  # sort key of the live journal, after every rotated timestamp


class JournalCursor(FileCursor[JournalReader]):
    """Reads add records forward from (`key`, `offset`), crossing into later files of `files()`.

    `on_leave(key)` is told each time the cursor has read the whole of file `key` and moved on;
    `sync` appends what the journal holds pending, before a fill reads; a record of `LARGE_APPEND`
    bytes or more is read off the loop through the queue's `gate` (`JournalReader`).
    """

    def __init__(self, files: Callable[[], Files], key: int, offset: int,
                 on_leave: Callable[[int], None] | None = None,
                 sync: Callable[[], None] | None = None, gate: WriteGate | None = None) -> None:
        super().__init__(offset)
        self._files = files
        self._on_leave = on_leave
        self._sync = sync
        self._gate = gate
        self.key = key
        self.stop: tuple[int, int] | None = None  # (file key, offset) the cursor may not pass

    @property
    def offset(self) -> int:
        """Offset of the next record in file `key`."""
        return self.reader.offset if self.reader is not None else self.at

    def open(self) -> JournalReader:
        """The reader of file `key`, opened at the cursor's place if it is not. Raises OSError."""
        reader = self.reader
        if reader is None:
            path = next((p for k, p in self._files() if k == self.key), "")
            reader = self.reader = self._open(path, self.at)
        return reader

    def sync(self) -> None:
        if self._sync is not None:
            self._sync()

    def opening_reads(self) -> bool:
        return False  # a journal reader reads nothing until asked for a record

    def next_item(self, now: int) -> QItem | None:
        """The next journaled item, or None once the cursor is at `stop` or at the end of the
        live journal; `now` is the add time of a starling ADD record."""
        stop = self.stop
        reader = self.open()
        while True:
            if stop is not None and self.key == stop[0] and reader.offset >= stop[1]:
                return None
            entry = reader.next()
            if entry is None:
                if not self._advance():
                    return None
                reader = self.open()
                continue
            record = entry[1]
            if isinstance(record, ADDS):
                return item_of(record, now)

    def _advance(self) -> bool:
        """Move to the next file; False when there is none (the cursor is in the live journal)."""
        if self.key == LIVE:
            return False
        following = next((k for k, _ in self._files() if k > self.key), None)
        if following is None:
            return False
        left = self.key
        self.release()
        self.key, self.at = following, 0
        if self._on_leave is not None:
            self._on_leave(left)
        return True

    def _open(self, path: str, offset: int) -> JournalReader:
        reader = JournalReader(path, offset, gate=self._gate)
        reader.chunk = CURSOR_CHUNK
        return reader

    def live_rotated(self, stamp: int) -> None:
        """The live journal was renamed to the rotated file `stamp`: a cursor in it is there now."""
        if self.key == LIVE:
            self.key = stamp
