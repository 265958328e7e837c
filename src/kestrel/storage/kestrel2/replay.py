"""A read-only replay of one queue's journal files: its items and open reads, nothing on disk changed.

What the dump tool, the Spark journal source and other readers of a live server's queue path need:
it never writes, truncates, renames, rotates or copies a file. Its rules are the queue's own (a
queue replays through `QueueReplay` too): xids are taken exactly as the live queue took them, a
pack supersedes the rotated journals at or before its timestamp, what is left after the last whole
record is a torn tail or damage as the one rule says (src/kestrel/storage/torn_tail.py), and replay
never expires anything (a pack's placeholders are kept as the queue keeps them: empty, expired 1 ms after the
epoch). The state-machine test checks it against the queue after every step.
"""

from __future__ import annotations

from collections import deque

from kestrel.storage.item import QItem
from kestrel.storage.kestrel2 import codec
from kestrel.storage.kestrel2.codec import (
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
from kestrel.storage.kestrel2.reader import JournalReader
from kestrel.storage.queue_path import list_journal_files


def replay_files(queue_path: str, queue: str) -> list[str]:
    """The files a start-up would replay for `queue`, in order (an unfinished pack included)."""
    files = list_journal_files(queue_path, queue)
    pack = files.packs[-1] if files.packs else None
    rotated = [path for ts, path in files.rotated if pack is None or ts > pack[0]]
    return ([pack[1]] if pack else []) + rotated + ([files.live] if files.live else [])


def item_of(record: Add | AddX | AddXid | Continue, now: int) -> QItem:
    """The item an add-type record carries; `now` is the add time of a starling ADD (it has none)."""
    if isinstance(record, Add):
        return QItem(now, record.expiry_s * 1000 if record.expiry_s else 0, record.data)
    return QItem(record.add_time, record.expiry, record.data,
                 record.xid if isinstance(record, AddXid) else 0)


ADDS = (AddX, Add, AddXid, Continue)


class QueueReplay:
    """Applies records in order: `items` is the queue from its head, `opens` the open reads by xid.

    The one set of replay rules. What a record does to the queue goes through three primitives
    (`append`, `take_head`, `put_back`) and `grow`; a live queue's replay overrides them to keep its
    figures and its read-behind. `anomalies` counts records that had nothing to act on (a sign of a
    missing journal file), with the offset of the first one.
    """

    def __init__(self) -> None:
        self.items: deque[QItem] = deque()
        self.opens: dict[int, QItem] = {}
        self.xid = 0
        self.anomalies: dict[str, int] = {}
        self.torn_tail: tuple[str, int] | None = None  # (file, offset) of an unfinished last record

    def run(self, paths: list[str], now: int = 0, check_sizes: bool = True) -> None:
        """Replay `paths` in order, record by record; `now` is the add time of starling ADD records.

        Raises CorruptJournalError at the first damaged record.
        """
        for index, path in enumerate(paths):
            reader = JournalReader(path, check_sizes=check_sizes)
            try:
                for offset, record in reader:
                    self.apply(record, now, offset)
                if reader.leftover():
                    error = reader.tail_damage(last=index == len(paths) - 1)
                    if error is not None:
                        raise error
                    self.torn_tail = (path, reader.offset)
            finally:
                reader.close()

    # -----------------------------------------------------------------------------------------
    # Replaying a queue's file set (`QueueJournal.replay`)

    def replay_file(self, key: int, path: str, reader: JournalReader) -> None:
        """Apply one file's records, record by record. Raises CorruptJournalError."""
        self.anomalies = {}
        for offset, record in reader:
            self.apply(record, 0, offset)

    def file_replayed(self, key: int) -> None:
        """Every record of file `key` is applied."""

    def restart(self) -> None:
        """Forget everything applied: replay starts again from the first file."""
        self.items.clear()
        self.opens.clear()
        self.xid = 0

    def restart_order(self) -> list[QItem]:
        """The queue as a restart serves it: the open reads back at the head, lowest xid first."""
        return [self.opens[xid] for xid in sorted(self.opens)] + list(self.items)

    # -----------------------------------------------------------------------------------------
    # Primitives

    def append(self, item: QItem) -> None:
        """An item joins the tail."""
        self.items.append(item)

    def take_head(self, opened: bool) -> QItem | None:
        """The head item leaves: `opened` (it becomes an open read) or for good; None if empty."""
        return self.items.popleft() if self.items else None

    def put_back(self, xid: int) -> bool:
        """Open read `xid` goes back to the head; False if no such read is open."""
        item = self.opens.pop(xid, None)
        if item is None:
            return False
        item.xid = 0
        self.items.appendleft(item)
        return True

    def grow(self, count: int, size: int) -> None:
        """`apply_common` changed `items` by `count` items of `size` bytes (either may be negative)."""

    # -----------------------------------------------------------------------------------------
    # Rules

    def apply(self, record: Record, now: int = 0, offset: int = 0) -> None:
        """One record at `offset`. Replay never expires items: it depends on nothing but the file."""
        if isinstance(record, AddX | AddXid | Add):
            self.append(item_of(record, now))
        elif isinstance(record, Remove):
            if self.take_head(opened=False) is None:
                self.note("remove_of_nothing", offset)
        elif isinstance(record, RemoveTentative | RemoveTentativeXid):
            self._open_head(record, offset)
        elif isinstance(record, ConfirmRemove):
            if self.opens.pop(record.xid, None) is None:
                self.note("confirm_of_no_open_read", offset)
        elif isinstance(record, Unremove):
            if not self.put_back(record.xid):
                self.note("abort_of_no_open_read", offset)
        elif isinstance(record, SaveXid | StateDump):
            self.xid = record.xid
        elif isinstance(record, Continue):
            self.opens.pop(record.xid, None)
            self.append(item_of(record, now))

    def apply_common(self, run: list[codec.Common]) -> None:
        """`apply` for a run of common records (`codec.decode_common`), the fast path of start-up.

        It works on `items` directly: only while nothing is in read-behind and no add in the run
        can reach the memory limit (the caller makes sure).
        """
        items = self.items
        opens = self.opens
        count = size = 0
        for op, offset, xid, add_time, expiry, data in run:
            if op in (codec.ADDX, codec.ADD_XID):
                items.append(QItem(add_time, expiry, data, xid))
                count += 1
                size += len(data)
            elif op == codec.REMOVE:
                if not items:
                    self.note("remove_of_nothing", offset)
                    continue
                count -= 1
                size -= len(items.popleft().data)
            elif op == codec.CONFIRM_REMOVE:
                if opens.pop(xid, None) is None:
                    self.note("confirm_of_no_open_read", offset)
            else:  # REMOVE_TENTATIVE_XID
                if not items:
                    self.note("open_of_nothing", offset)
                    continue
                item = items.popleft()
                count -= 1
                size -= len(item.data)
                if not item.xid and not is_next_free_xid(xid, self.xid, opens):
                    self.note("xid_jumps", offset)
                item.xid = xid
                opens[xid] = item
                self.xid = xid
        self.grow(count, size)

    def _open_head(self, record: RemoveTentative | RemoveTentativeXid, offset: int) -> None:
        item = self.take_head(opened=True)
        if item is None:
            self.note("open_of_nothing", offset)
            return
        if isinstance(record, RemoveTentative):
            item.xid = item.xid or self.next_xid()
        else:
            if not item.xid and not is_next_free_xid(record.xid, self.xid, self.opens):
                self.note("xid_jumps", offset)
            item.xid = self.xid = record.xid
        self.opens[item.xid] = item

    def note(self, what: str, offset: int) -> None:
        """A record with nothing to act on."""
        if not self.anomalies:
            self.anomalies["first_offset"] = offset
        self.anomalies[what] = self.anomalies.get(what, 0) + 1

    def next_xid(self, take: bool = True) -> int:
        """The next free xid (taken unless `take` is False), as Kestrel counts them."""
        xid = next_free_xid(self.xid, self.opens)
        if take:
            self.xid = xid
        return xid


def next_free_xid(last: int, opens: dict[int, QItem]) -> int:
    """The xid after `last` that is not 0 and not open, as Kestrel counts them (i32 on disk)."""
    xid = _following(last)
    while xid == 0 or xid in opens:
        xid = _following(xid)
    return xid


def _following(xid: int) -> int:
    """The xid after `xid`, as an i32 counts: after 2**31 - 1 comes -2**31."""
    return (xid + 1 + 2**31) % 2**32 - 2**31


def is_next_free_xid(xid: int, last: int, opens: dict[int, QItem]) -> bool:
    """Whether `xid` is `next_free_xid(last, opens)`, asking only the xids between the two, and
    none when more lie between than are open (each one passed over is open, or 0): the walk from
    `last` past every open xid, at each record of a journal opening xids in descending order,
    made its replay quadratic."""
    ahead = (xid - last) & 0xFFFFFFFF
    if not ahead or ahead > len(opens) + 2:
        return False
    between = last
    for _ in range(ahead - 1):
        between = _following(between)
        if between != 0 and between not in opens:
            return False
    return xid != 0 and xid not in opens


def replay_queue(queue_path: str, queue: str, now: int = 0) -> QueueReplay:
    """Replay `queue`'s files in `queue_path` without changing them. Raises CorruptJournalError."""
    replay = QueueReplay()
    replay.run(replay_files(queue_path, queue), now)
    return replay
