"""Read-behind checkpoints: the queue's state at each rotation, kept until the cursor passes it.

In read-behind every rotation of the live journal to `<name>.<T>` takes a checkpoint: the last xid,
the open reads, and from then on the items that leave the head, in order (the item while it may
still come back, None once it is gone for good). When the read-behind cursor leaves the file
`<name>.<T>`, every item that was queued at T and is still queued is in memory, so the state at T
can be written as a pack without reading any journal back (`packer.write_pack`), and the files up
to T are packed away while the rest of the backlog drains.

Several checkpoints are outstanding at once (one per file of the backlog); each keeps its own
departure log, so the cost is one list entry per departure per outstanding checkpoint.
"""

from __future__ import annotations

from kestrel.storage.item import QItem
from kestrel.storage.kestrel2 import packer


class RotationCheckpoint:
    """The queue's state at rotation time `timestamp`, and what has left the head since."""

    def __init__(self, timestamp: int, xid: int, open_reads: list[tuple[int, QItem]]) -> None:
        self.timestamp = timestamp
        self.xid = xid
        self.open_reads = open_reads
        self._open_at = {id(item) for _, item in open_reads}  # these items are kept alive above
        self._departed: list[QItem | None] = []
        self._slots: dict[int, int] = {}  # id of a departed item that may come back -> its entry

    def note_departure(self, item: QItem, opened: bool) -> None:
        """`item` left the head: opened (it may come back) or gone for good."""
        key = id(item)
        if key in self._open_at:
            return  # an open read at T: the pack writes it as one, later records act on it
        slot = self._slots.get(key)
        if slot is None:
            if opened:
                self._slots[key] = len(self._departed)
                self._departed.append(item)  # keeps the item alive, so its id stays its own
            else:
                self._departed.append(None)
        elif not opened:
            self._departed[slot] = None
            del self._slots[key]

    def note_confirm(self, item: QItem) -> None:
        slot = self._slots.pop(id(item), None)
        if slot is not None:
            self._departed[slot] = None

    def pack_request(self, queue_path: str, name: str, memory: list[QItem],
                     placeholder_time: int) -> packer.PackRequest:
        """The state at T, once every item queued at T and still queued is in `memory`."""
        survivors: list[QItem | None] = [
            item for item in memory if id(item) not in self._slots and id(item) not in self._open_at]
        return packer.PackRequest(queue_path, name, self.timestamp, self.xid, self.open_reads,
                                  self._departed + survivors, placeholder_time)
