"""Released Kestrel 2.4's journal replay, modelled from its sources, to check that our journals
load there as they load here; its pack writer (`dump`), to check that its files load here; and its
start-up scan of a queue path (`open_queue_path`, from Kestrel 2.4.1's
`Journal.getQueueNamesFromFolder`, `Journal.archivedFilesForQueue` and
`QueueCollection.buildQueue`), to check which directories it can open.

Written from Kestrel 2.4.1's `Journal.readJournalEntry` and `PersistentQueue.replayJournal`, not
from our codec: opcode 3 is read as xid 0 (every Kestrel from 2.1 to 2.4 does), opcode 9 carries
its xid, and a tentative remove sets the xid counter to its xid. Expiry plays no part in replay.
"""

from __future__ import annotations

import os
import struct
from collections import deque


def replay(data: bytes) -> tuple[list[bytes], dict[int, bytes]]:
    """The queue's items and open reads (xid -> data) after replaying `data`, before Kestrel backs
    the open reads out at the end of start-up."""
    queue: deque[bytes] = deque()
    opens: dict[int, bytes] = {}
    i = 0
    while i < len(data):
        op = data[i]
        i += 1
        if op == 2:  # ADDX
            (size,) = struct.unpack_from("<i", data, i)
            queue.append(data[i + 20:i + 4 + size])
            i += 4 + size
        elif op == 7:  # ADD_XID
            (size,) = struct.unpack_from("<i", data, i + 4)
            queue.append(data[i + 24:i + 8 + size])
            i += 8 + size
        elif op == 1:  # REMOVE
            if queue:
                queue.popleft()
        elif op in (3, 9):  # REMOVE_TENTATIVE, REMOVE_TENTATIVE_XID
            xid = 0
            if op == 9:
                (xid,) = struct.unpack_from("<i", data, i)
                i += 4
            if queue:
                opens[xid] = queue.popleft()
        elif op in (4, 5, 6):  # SAVE_XID, UNREMOVE, CONFIRM_REMOVE
            (xid,) = struct.unpack_from("<i", data, i)
            i += 4
            if op == 5 and xid in opens:
                queue.appendleft(opens.pop(xid))
            elif op == 6:
                opens.pop(xid, None)
        else:
            raise AssertionError(f"opcode {op} at offset {i - 1}: not one our writer may use")
    return list(queue), opens


def load(data: bytes) -> list[bytes]:
    """The queue as Kestrel 2.4 serves it after start-up: open reads back at the head, lowest xid first."""
    queue, opens = replay(data)
    return [opens[x] for x in sorted(opens)] + queue


def _addx(add_time: int, expiry: int, data: bytes) -> bytes:
    return bytes([2]) + struct.pack("<iqq", len(data) + 16, add_time, expiry) + data


def dump(reserved: list[tuple[int, bytes]], queue: list[bytes], pent_up_deletes: int = 0,
         add_time: int = 1_700_000_000_000) -> bytes:
    """A pack as Kestrel 2.4.1's `Journal.dump` writes it: each open read as ADDX (`QItem.pack`,
    no xid) + REMOVE_TENTATIVE_XID, an empty ADDX (no expiry) per pent-up delete, then the items as
    ADDX. No SAVE_XID, no ADD_XID; an empty queue with no open read gives an empty file."""
    out = []
    for xid, data in reserved:
        out.append(_addx(add_time, 0, data) + bytes([9]) + struct.pack("<i", xid))
    out.extend(_addx(add_time, 0, b"") for _ in range(pent_up_deletes))
    out.extend(_addx(add_time, 0, data) for data in queue)
    return b"".join(out)


# ---------------------------------------------------------------------------------------------
# Kestrel 2.4.1's start-up scan of a queue path


class KestrelCannotStart(Exception):
    """What Kestrel 2.4.1's start-up would throw on this directory (and so not start)."""


def _java_split_dot(name: str) -> list[str]:
    """Java's `String.split("\\.")`: trailing empty strings dropped, a leading one kept."""
    parts = name.split(".")
    while len(parts) > 1 and parts[-1] == "":
        parts.pop()
    return [""] if parts == [""] else parts


def _java_parse_long(text: str) -> int:
    """Scala's `String.toLong` (`java.lang.Long.parseLong`): an optional sign, then ASCII digits."""
    digits = text[1:] if text[:1] in "+-" else text
    if not digits or not all("0" <= c <= "9" for c in digits):
        raise KestrelCannotStart(f'java.lang.NumberFormatException: For input string: "{text}"')
    value = int(text)
    if not -(2**63) <= value < 2**63:
        raise KestrelCannotStart(f'java.lang.NumberFormatException: For input string: "{text}"')
    return value


def queue_names(path: str) -> set[str]:
    """`Journal.getQueueNamesFromFolder`: every file that is not a directory and holds no `~~`,
    named up to its first dot."""
    return {_java_split_dot(name)[0] for name in os.listdir(path)
            if not os.path.isdir(os.path.join(path, name)) and "~~" not in name}


def archived_files(path: str, queue: str) -> list[str]:
    """`Journal.archivedFilesForQueue`: every name in the directory (directories too) starting with
    `<queue>.`, its second dot-separated part parsed as a timestamp, in timestamp order; a `.pack`
    among them finishes the pack first (in this model, without touching the directory)."""
    names = os.listdir(path)
    while True:
        timed = []
        for name in names:
            if name.startswith(queue + "."):
                parts = _java_split_dot(name)
                if len(parts) < 2:
                    raise KestrelCannotStart(f"java.lang.ArrayIndexOutOfBoundsException: 1 ({name})")
                timed.append((name, _java_parse_long(parts[1])))
        timed.sort(key=lambda nt: nt[1])
        pack = next(((n, t) for n, t in timed if n.endswith(".pack")), None)
        if pack is None:
            return [n for n, _ in timed]
        doomed = {n for n, t in timed if t <= pack[1] and not n.endswith(".pack")}
        names = [n for n in names if n not in doomed and n != pack[0]] + [pack[0][:-5]]


def open_queue_path(path: str) -> dict[str, list[str]]:
    """What Kestrel 2.4.1's `QueueCollection.loadQueues` does with `path`: each queue name found,
    checked as `buildQueue` checks it, with the journal files `Journal.replay` reads in order (the
    live journal, a plain file, last). Raises KestrelCannotStart where Kestrel throws."""
    found = {}
    for queue in sorted(queue_names(path)):
        if any(c in queue for c in "./~"):
            raise KestrelCannotStart(f"Queue name contains illegal characters (one of: ~ . /): {queue!r}")
        files = [*archived_files(path, queue), queue]
        for name in files:
            if os.path.isdir(os.path.join(path, name)):
                raise KestrelCannotStart(f"java.io.FileNotFoundException: {name} (Is a directory)")
        found[queue] = files
    return found
