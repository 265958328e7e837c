"""A read-only replay of one queue's journal files: the items the server would load, files untouched.

Built on storage's public record reader; it never writes, truncates or renames anything, so it can
run over a live server's queue path. It follows the server's replay rules: a pack supersedes the
rotated journals at or before its timestamp, an incomplete record is a torn tail only at the very end
of the last file, and open reads come back first, oldest first.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from storage.codec import (
    Add,
    AddX,
    AddXid,
    ConfirmRemove,
    Continue,
    Record,
    Remove,
    RemoveTentative,
    RemoveTentativeXid,
    SaveXid,
    StateDump,
    Unremove,
)
from storage.errors import CorruptJournalError
from storage.journal import RecordReader, list_journal_files


@dataclass(slots=True)
class ReplayedItem:
    add_time: int  # ms since the epoch
    expiry: int  # ms since the epoch, 0 = never
    data: bytes
    xid: int = 0


def replay_files(queue_path: str, queue: str) -> list[str]:
    """The files the server would replay for `queue`, in order."""
    files = list_journal_files(queue_path, queue)
    pack = files.packs[-1] if files.packs else None
    rotated = [path for ts, path in files.rotated if pack is None or ts > pack[0]]
    return ([pack[1]] if pack else []) + rotated + ([files.live] if files.live else [])


class Replay:
    """Applies records in order; `opens` are the open reads by xid, `items` the queue from its head."""

    def __init__(self) -> None:
        self.items: deque[ReplayedItem] = deque()
        self.opens: dict[int, ReplayedItem] = {}
        self.xid = 0

    def run(self, paths: list[str]) -> None:
        """Raises CorruptJournalError at the first damaged record."""
        for index, path in enumerate(paths):
            reader = RecordReader(path)
            try:
                for _offset, record in reader:
                    self.apply(record)
                left = reader.leftover()
                if left and index < len(paths) - 1:
                    raise CorruptJournalError(path, reader.offset, None,
                                              f"{left} bytes of an incomplete record before the next file")
            finally:
                reader.close()

    def apply(self, record: Record) -> None:
        if isinstance(record, AddX | Continue):
            if isinstance(record, Continue):
                self.opens.pop(record.xid, None)
            self.items.append(ReplayedItem(record.add_time, record.expiry, record.data))
        elif isinstance(record, AddXid):
            self.items.append(ReplayedItem(record.add_time, record.expiry, record.data, record.xid))
        elif isinstance(record, Add):
            self.items.append(ReplayedItem(0, record.expiry_s * 1000, record.data))
        elif isinstance(record, Remove):
            if self.items:
                self.items.popleft()
        elif isinstance(record, RemoveTentative | RemoveTentativeXid):
            if self.items:
                item = self.items.popleft()
                if isinstance(record, RemoveTentativeXid):
                    item.xid = self.xid = record.xid
                elif not item.xid:
                    item.xid = self._next_xid()
                self.opens[item.xid] = item
        elif isinstance(record, ConfirmRemove):
            self.opens.pop(record.xid, None)
        elif isinstance(record, Unremove):
            back: ReplayedItem | None = self.opens.pop(record.xid, None)
            if back is not None:
                self.items.appendleft(back)
        elif isinstance(record, SaveXid | StateDump):
            self.xid = record.xid

    def _next_xid(self) -> int:
        xid = self.xid
        while True:
            xid = (xid + 1) & 0xFFFFFFFF
            if xid >= 2**31:
                xid -= 2**32
            if xid and xid not in self.opens:
                self.xid = xid
                return xid
