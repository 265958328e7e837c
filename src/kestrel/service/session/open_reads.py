"""Open reads: items handed out but not yet confirmed, in one model for every protocol.

A connection's open reads are kept per queue, oldest first, and `max_open_reads` caps each queue.
Memcache and text close them by count (`/close`, `confirm <n>`) or abort them all, and the
connection aborts what it still holds when it closes. Thrift reads also carry a server-wide id by
which any connection may confirm or abort them, and an auto-abort deadline (in one wait list) that
closes the rest; they outlive the connection that opened them.
"""

from __future__ import annotations

from collections.abc import Iterable

from kestrel.service.session.auto_abort import AutoAborts
from kestrel.service.session.read_ids import ReadIds
from kestrel.storage import QueueCollection


class OpenRead:
    """One open read: its queue, the `serial` of that queue (it closes on no other queue of the name:
    `QueueCollection.opened_on`) and the xid, the connection's reads it belongs to, and for Thrift the
    id the client closes it by (0 otherwise). (A class of its own `__init__`, not a dataclass:
    compiled, a dataclass's generated `__init__` stays interpreted, 1,870 instructions an open read.)"""

    __slots__ = ("queue", "serial", "xid", "owner", "read_id")

    def __init__(self, queue: str, serial: int, xid: int, owner: OpenReads, read_id: int = 0) -> None:
        self.queue, self.serial, self.xid, self.owner, self.read_id = queue, serial, xid, owner, read_id


def by_serial(reads: list[OpenRead]) -> dict[int, list[int]]:
    """The xids of `reads` (of one queue name), in their order, by the serial of the queue each was
    opened on: one, unless the queue was deleted and created again while they were open."""
    xids: dict[int, list[int]] = {}
    for read in reads:
        xids.setdefault(read.serial, []).append(read.xid)
    return xids


def return_all(collection: QueueCollection, returns: list[tuple[str, int, list[int]]],
               handed_out: bool = True) -> int:
    """Put each (queue, serial, xids) of open reads taken from their holder back at its head, in a
    change of its own, every one tried though one fails (the first error is raised after): a return
    the journal refused is owed by its queue (`unremove`); those after it, taken and never returned,
    stayed open until the next start. Reads never `handed_out` count no error. How many were open."""
    returned = 0
    failed: Exception | None = None
    for queue, serial, xids in returns:
        try:
            returned += collection.unremove(queue, xids, handed_out, serial, owed=True)
        except Exception as e:
            failed = failed or e
    if failed is not None:
        raise failed
    return returned


class OpenReads:
    """One connection's open reads, per queue and oldest first."""

    def __init__(self, max_open_reads: int) -> None:
        self.max_open_reads = max_open_reads
        self._by_queue: dict[str, dict[OpenRead, None]] = {}  # insertion-ordered sets

    def room(self, queue: str) -> int:
        """How many more reads this connection may open on `queue` (`max_open_reads` per queue)."""
        return max(self.max_open_reads - len(self._by_queue.get(queue, ())), 0)

    def holds(self, queue: str) -> bool:
        return queue in self._by_queue

    def forget_others(self, queue: str, serial: int | None) -> None:
        """Forget the reads on `queue` without an id that are not of its queue of `serial` (None:
        there is none now): they went with the items of a queue deleted since."""
        held = self._by_queue.get(queue, ())
        for read in [read for read in held if not read.read_id and read.serial != serial]:
            self.forget(read)

    def open(self, queue: str, serial: int, xid: int) -> OpenRead:
        read = OpenRead(queue, serial, xid, self)
        self._by_queue.setdefault(queue, {})[read] = None
        return read

    def open_run(self, queue: str, serial: int, xids: list[int], first_id: int) -> list[OpenRead]:
        """Open reads of `xids` on `queue` (of `serial`), their ids running on from `first_id`."""
        held = self._by_queue.setdefault(queue, {})
        reads = []
        read_id = first_id
        for xid in xids:  # (a loop: compiled, enumerate and dict.fromkeys go through generic calls)
            read = OpenRead(queue, serial, xid, self, read_id)
            held[read] = None
            reads.append(read)
            read_id += 1
        return reads

    def forget(self, read: OpenRead) -> None:
        """`read` is closed (here, by another connection, or by its timer)."""
        reads = self._by_queue.get(read.queue)
        if reads is not None and read in reads:
            del reads[read]  # (compiled, `pop` with a default is a generic method call)
            if not reads:
                del self._by_queue[read.queue]

    def give_back(self, reads: list[OpenRead]) -> None:
        """`reads`, taken to be closed (`take_oldest`, or by id), are open still (the journal refused
        their confirm): held again, ahead of those opened since, in their order."""
        for queue in dict.fromkeys(read.queue for read in reads):
            held = {read: None for read in reads if read.queue == queue}
            held.update(self._by_queue.get(queue, {}))
            self._by_queue[queue] = held

    def take_oldest(self, queue: str, count: int | None = None) -> list[OpenRead]:
        """Remove and return the oldest `count` open reads on `queue` (None: all of them) that have
        no id: those with one are closed by id only, and outlive the connection. A count of none,
        or of more than are open, takes none (Kestrel's `ItemIdList.pop`): `confirm q 5` with 3
        open is refused, and leaves all 3 open."""
        reads = [read for read in self._by_queue.get(queue, ()) if not read.read_id]
        if count is not None:
            if not 0 < count <= len(reads):
                return []
            reads = reads[:count]
        for read in reads:
            self.forget(read)
        return reads

    def queues(self) -> list[str]:
        return list(self._by_queue)


class ReadsById:
    """Thrift open reads by server-wide id: confirmed or aborted by id from any connection, or
    aborted when their auto-abort deadline comes."""

    def __init__(self, collection: QueueCollection, ids: ReadIds) -> None:
        self.collection = collection
        self.ids = ids
        self._reads: dict[int, OpenRead] = {}
        self.auto_aborts = AutoAborts(self._reads, self._auto_abort, collection.runtime)

    def open_many(self, reads: OpenReads, queue: str, serial: int, xids: list[int], auto_abort_ms: int
                  ) -> list[int]:
        """Open reads of `xids` on `queue` (of `serial`) for the connection holding `reads`, all due
        to abort at the same moment; their ids."""
        count = len(xids)
        if not count:
            return []
        first = self.ids.take(count)
        by_id = self._reads
        read_ids = []
        for read in reads.open_run(queue, serial, xids, first):
            by_id[read.read_id] = read
            read_ids.append(read.read_id)
        self.auto_aborts.add_run(first, count, self.auto_aborts.deadline_after(auto_abort_ms / 1000.0))
        return read_ids

    def _take(self, read_ids: list[int] | set[int]) -> dict[tuple[str, int], list[OpenRead]]:
        """Remove the open reads among `read_ids`, newest first so that aborted items end up at the
        head in the order they were read; by queue and serial."""
        reads: dict[tuple[str, int], list[OpenRead]] = {}
        by_id = self._reads
        for read_id in sorted(read_ids, reverse=True):
            read = by_id.pop(read_id, None)
            if read is None:
                continue
            read.owner.forget(read)
            reads.setdefault((read.queue, read.serial), []).append(read)
        return reads

    def put_back(self, read_ids: list[int]) -> int:
        """Reads whose ids never reached their client (the reply was not sent): back at the head of
        their queues in the order they were read, with no error counted, as a get puts back what
        it took; how many were open."""
        taken = self._take(read_ids)
        return return_all(self.collection, [(queue, serial, [read.xid for read in reads])
                                            for (queue, serial), reads in taken.items()], handed_out=False)

    def _auto_abort(self, read_ids: list[int]) -> None:
        """Reads whose deadline came go back to the head of their queues, one journal write each."""
        self._close(read_ids, confirm=False)

    def queues_of(self, ids: Iterable[int]) -> set[str]:
        """The queues the open reads among `ids` were read from (a call's ids, as decoded)."""
        by_id = self._reads
        return {read.queue for read_id in ids if (read := by_id.get(read_id)) is not None}

    def close(self, ids: set[int], confirm: bool) -> int:
        """Confirm (or abort) the open reads among `ids`, each in its own queue whatever queue the
        call named (Kestrel's `closePendingReads`), in one journal write a queue; how many were
        open."""
        return self._close(ids, confirm)

    def _close(self, ids: list[int] | set[int], confirm: bool) -> int:
        """Each queue's reads closed in their own change, every queue's tried though one fails (the
        first error is raised after): returned as `return_all` returns them, or confirmed, where a
        refused confirm leaves its reads open and held again by id (`give_back`), to be confirmed
        again or aborted at their deadline. Taken from their holder first, the reads of the queues
        after a failing one, and those of a refused confirm, stayed open with nobody to close them
        until the next start."""
        coll = self.collection
        taken = self._take(ids)
        if not confirm:
            return return_all(coll, [(queue, serial, [read.xid for read in reads])
                                     for (queue, serial), reads in taken.items()])
        closed = 0
        failed: Exception | None = None
        for (queue, serial), reads in taken.items():
            try:
                closed += coll.confirm(queue, [read.xid for read in reads], serial)
            except Exception as e:
                self._give_back(reads)
                failed = failed or e
        if failed is not None:
            raise failed
        return closed

    def _give_back(self, reads: list[OpenRead]) -> None:
        """`reads`, whose confirm failed, are held again by their ids and their connections (their
        auto-abort deadlines still stand in the wait list)."""
        reads = reads[::-1]  # oldest first again
        for read in reads:
            self._reads[read.read_id] = read
        for owner in dict.fromkeys(read.owner for read in reads):
            owner.give_back([read for read in reads if read.owner is owner])

    def cancel_timers(self) -> None:
        """Stop the auto-abort wait list (at shutdown: the reads stay open in their journals)."""
        self.auto_aborts.close()
