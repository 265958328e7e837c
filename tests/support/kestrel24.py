"""Released Kestrel 2.4's journal replay, modelled from its sources, to check that our journals
load there as they load here; and its pack writer (`dump`), to check that its files load here.

Written from Kestrel 2.4.1's `Journal.readJournalEntry` and `PersistentQueue.replayJournal`, not
from our codec: opcode 3 is read as xid 0 (every Kestrel from 2.1 to 2.4 does), opcode 9 carries
its xid, and a tentative remove sets the xid counter to its xid. Expiry plays no part in replay.
"""

from __future__ import annotations

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
