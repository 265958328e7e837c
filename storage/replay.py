"""A read-only replay of one queue's journal files: its items and open reads, nothing on disk changed.

What the dump tool, the Spark journal source and other readers of a live server's queue path need:
it never writes, truncates, renames, rotates or copies a file. It follows the queue's replay rules
(`PersistentQueue._apply`): xids are taken exactly as the live queue took them, a pack supersedes
the rotated journals at or before its timestamp, an incomplete record is a torn tail only at the
end of the last file (anywhere else it raises CorruptJournalError), and replay never expires
anything (a pack's placeholders are kept as the queue keeps them: empty, expired 1 ms after the
epoch). The state-machine test checks it against the queue after every step.
"""

from __future__ import annotations

from collections import deque

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
from storage.item import QItem
from storage.journal import RecordReader, list_journal_files


def replay_files(queue_path: str, queue: str) -> list[str]:
    """The files a start-up would replay for `queue`, in order (an unfinished pack included)."""
    files = list_journal_files(queue_path, queue)
    pack = files.packs[-1] if files.packs else None
    rotated = [path for ts, path in files.rotated if pack is None or ts > pack[0]]
    return ([pack[1]] if pack else []) + rotated + ([files.live] if files.live else [])


class QueueReplay:
    """Applies records in order: `items` is the queue from its head, `opens` the open reads by xid.

    `anomalies` counts records that had nothing to act on (a sign of a missing journal file).
    """

    def __init__(self) -> None:
        self.items: deque[QItem] = deque()
        self.opens: dict[int, QItem] = {}
        self.xid = 0
        self.anomalies: dict[str, int] = {}
        self.torn_tail: tuple[str, int] | None = None  # (file, offset) of an unfinished last record

    def run(self, paths: list[str], now: int = 0, check_sizes: bool = True) -> None:
        """Replay `paths` in order; `now` is the add time of starling ADD records (they have none).

        Raises CorruptJournalError at the first damaged record.
        """
        for index, path in enumerate(paths):
            reader = RecordReader(path, check_sizes=check_sizes)
            try:
                for _offset, record in reader:
                    self.apply(record, now)
                left = reader.leftover()
                if left and index < len(paths) - 1:
                    raise CorruptJournalError(path, reader.offset, None,
                                              f"{left} bytes of an incomplete record before the next file")
                if left:
                    self.torn_tail = (path, reader.offset)
            finally:
                reader.close()

    def restart_order(self) -> list[QItem]:
        """The queue as a restart serves it: the open reads back at the head, lowest xid first."""
        return [self.opens[xid] for xid in sorted(self.opens)] + list(self.items)

    def apply(self, record: Record, now: int = 0) -> None:
        if isinstance(record, AddX):
            self.items.append(QItem(record.add_time, record.expiry, record.data))
        elif isinstance(record, AddXid):
            self.items.append(QItem(record.add_time, record.expiry, record.data, record.xid))
        elif isinstance(record, Add):
            self.items.append(QItem(now, record.expiry_s * 1000 if record.expiry_s else 0, record.data))
        elif isinstance(record, Remove):
            if not self.items:
                self._note("remove_of_nothing")
            else:
                self.items.popleft()
        elif isinstance(record, RemoveTentative | RemoveTentativeXid):
            self._open_head(record)
        elif isinstance(record, ConfirmRemove):
            if self.opens.pop(record.xid, None) is None:
                self._note("confirm_of_no_open_read")
        elif isinstance(record, Unremove):
            back = self.opens.pop(record.xid, None)
            if back is None:
                self._note("abort_of_no_open_read")
            else:
                back.xid = 0
                self.items.appendleft(back)
        elif isinstance(record, SaveXid | StateDump):
            self.xid = record.xid
        elif isinstance(record, Continue):
            self.opens.pop(record.xid, None)
            self.items.append(QItem(record.add_time, record.expiry, record.data))

    def _open_head(self, record: RemoveTentative | RemoveTentativeXid) -> None:
        if not self.items:
            self._note("open_of_nothing")
            return
        item = self.items.popleft()
        if isinstance(record, RemoveTentative):
            item.xid = item.xid or self._next_xid()
        else:
            if not item.xid and record.xid != self._next_xid(take=False):
                self._note("xid_jumps")
            item.xid = self.xid = record.xid
        self.opens[item.xid] = item

    def _note(self, what: str) -> None:
        self.anomalies[what] = self.anomalies.get(what, 0) + 1

    def _next_xid(self, take: bool = True) -> int:
        """The next free xid (taken unless `take` is False), as Kestrel counts them."""
        xid = self.xid
        while True:
            xid = (xid + 1) & 0xFFFFFFFF
            if xid >= 2**31:
                xid -= 2**32  # xids are i32 on disk
            if xid != 0 and xid not in self.opens:
                if take:
                    self.xid = xid
                return xid


def replay_queue(queue_path: str, queue: str, now: int = 0) -> QueueReplay:
    """Replay `queue`'s files in `queue_path` without changing them. Raises CorruptJournalError."""
    replay = QueueReplay()
    replay.run(replay_files(queue_path, queue), now)
    return replay
