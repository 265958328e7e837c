"""One connection's open reads: the per-queue cap, oldest-first closing, and reads by id left alone."""

from __future__ import annotations

from kestrel.service.session.open_reads import OpenReads


def test_max_open_reads_is_counted_per_queue() -> None:
    reads = OpenReads(max_open_reads=2)
    reads.open("a", 1, 1)
    assert (reads.room("a"), reads.room("b")) == (1, 2)
    reads.open("a", 1, 2)
    reads.open("a", 1, 3)  # the caller asks `room` first; the count never goes negative
    assert reads.room("a") == 0 and reads.holds("a") and not reads.holds("b")


def test_reads_close_oldest_first_and_the_queue_is_forgotten_when_empty() -> None:
    reads = OpenReads(max_open_reads=10)
    for xid in (5, 6, 7):
        reads.open("q", 1, xid)
    assert [r.xid for r in reads.take_oldest("q", 2)] == [5, 6]
    assert [r.xid for r in reads.take_oldest("q")] == [7]
    assert not reads.holds("q") and reads.queues() == [] and reads.room("q") == 10


def test_reads_with_an_id_are_closed_by_id_only() -> None:
    reads = OpenReads(max_open_reads=10)
    [by_id] = reads.open_run("q", 1, [1], 1 << 40)
    reads.open("q", 1, 2)
    assert [r.xid for r in reads.take_oldest("q")] == [2]  # what a closing connection aborts
    assert reads.holds("q") and reads.room("q") == 9
    reads.forget(by_id)  # confirmed by id, from any connection, or aborted by its timer
    assert not reads.holds("q")
