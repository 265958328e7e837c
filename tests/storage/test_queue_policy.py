"""The queue rules both journal formats share (`src/kestrel/storage/queue.py`), each checked against both: limits
and discard-old, expiry at the head, open reads, poison items, waits, read-behind, refused writes."""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import gevent
import pytest

from kestrel.storage import JournalWriteError, QueueCollection, QueueConfigs
from kestrel.storage.clock import FakeClock
from kestrel.storage.runtime import ManualRuntime, Runtime, ThreadsRuntime
from tests.end_to_end.test_disk_full import FailingDisk
from tests.end_to_end.test_disk_full import disk as disk  # the fixture
from tests.support.queues import drain, one, reopen

T0 = 1_700_000_000_000

FORMATS = pytest.mark.parametrize("journal_format", ["kestrel2", "kestrel3"])


def make(path: Path, journal_format: str, queues: dict[str, Any] | None = None,
         clock: FakeClock | None = None, runtime: Runtime | None = None) -> QueueCollection:
    """A loaded collection whose every queue keeps the given format."""
    configs = QueueConfigs({"journal_format": journal_format}, queues)
    if runtime is not None:
        coll = QueueCollection(str(path), configs, runtime=runtime)
    else:
        coll = QueueCollection(str(path), configs, clock=clock or FakeClock(T0))
    coll.load()
    return coll


@FORMATS
def test_limits_refuse_what_does_not_fit_and_count_a_prefix(tmp_path: Path, journal_format: str) -> None:
    coll = make(tmp_path, journal_format, {"items": {"max_items": 2}, "bytes": {"max_size": "10"},
                                           "big": {"max_item_size": "4"}})
    assert coll.put("items", [b"a", b"b", b"c"]) == 2
    assert not coll.put("items", [b"d"])
    assert coll.put("bytes", [b"12345678", b"90", b"x"]) == 2  # the second crosses the limit
    assert coll.put("big", [b"ok", b"too big", b"ok"]) == 1  # items before the first too big
    assert coll.queue("big").put([b"too big"]) == 0
    assert coll.queue("big").put([b"ok", b"too big"]) == 1
    assert coll.queue("big").length == 2
    coll = reopen(coll)
    assert drain(coll, "items") == [b"a", b"b"] and drain(coll, "bytes") == [b"12345678", b"90"]


@FORMATS
def test_discard_old_makes_room_for_new_items(tmp_path: Path, journal_format: str) -> None:
    coll = make(tmp_path, journal_format, {"q": {"max_items": 3, "discard_old_when_full": True},
                                           "none": {"max_items": 0, "discard_old_when_full": True}})
    assert coll.put("q", [b"1", b"2", b"3", b"4"]) == 4
    assert coll.put("q", [b"5"])
    q = coll.queue("q")
    assert (q.length, q.stats()["discarded"]) == (3, 2)
    assert coll.put("none", [b"x"]) == 0  # nothing to discard: refused
    coll = reopen(coll)
    assert drain(coll, "q") == [b"3", b"4", b"5"]


@FORMATS
def test_items_expire_at_the_head_and_move_to_the_expiry_queue(tmp_path: Path, journal_format: str) -> None:
    clock = FakeClock(T0)
    coll = make(tmp_path, journal_format, {"q": {"expire_to_queue": "late"}, "capped": {"max_age": "1s"}},
                clock)
    coll.put("q", [b"soon"], T0 + 10)
    coll.put("q", [b"later"], T0 + 50)
    coll.put("q", [b"never"])
    coll.put("capped", [b"capped"])
    clock.advance(20)
    head = coll.peek("q")
    assert head is not None and head.data == b"later"
    assert coll.queue("q").stats()["expired_items"] == 1
    clock.advance(40)
    item = one(coll.remove("q", transaction=True))
    assert item is not None and item.data == b"never"
    assert drain(coll, "late") == [b"soon", b"later"]
    clock.advance(1_000)
    assert coll.queue("capped").discard_expired() == 1  # max_age capped its expiry at 1 s
    coll = reopen(coll)
    assert drain(coll, "q") == [b"never"] and drain(coll, "capped") == []


@FORMATS
def test_the_sweeper_expires_at_most_its_limit_per_queue(tmp_path: Path, journal_format: str) -> None:
    clock = FakeClock(T0)
    coll = make(tmp_path, journal_format, {"q": {"max_expire_sweep": 2}}, clock)
    coll.put("q", [b"a", b"b", b"c"], T0 + 5)
    coll.put("q", [b"kept"])
    clock.advance(10)
    assert coll.sweep() == 2
    assert coll.sweep() == 1
    assert drain(coll, "q") == [b"kept"]


@FORMATS
def test_aborted_reads_return_to_the_head_and_confirmed_ones_are_gone(tmp_path: Path,
                                                                      journal_format: str) -> None:
    coll = make(tmp_path, journal_format)
    coll.put("q", [b"a", b"b", b"c", b"d"])
    reads = coll.remove("q", 3, transaction=True)
    assert [r.data for r in reads] == [b"a", b"b", b"c"] and len({r.xid for r in reads}) == 3
    q = coll.queue("q")
    assert (q.length, q.open_transactions) == (1, 3)
    assert [i.data for i in q.open_reads()] == [b"a", b"b", b"c"]
    assert coll.confirm("q", [reads[1].xid])
    assert not coll.confirm("q", [reads[1].xid])  # closed already
    assert coll.unremove("q", [reads[2].xid, reads[0].xid]) == 2  # the last given ends up first
    assert not coll.unremove("q", [reads[0].xid])
    assert q.stats()["canceled_transactions"] == 2 and q.stats()["transactions"] == 3
    held = one(coll.remove("q", transaction=True))
    assert held is not None and held.data == b"a"
    coll = reopen(coll)
    assert drain(coll, "q") == [b"a", b"c", b"d"]  # the read open at the stop is served again


@FORMATS
def test_poison_items_leave_after_max_errors_or_return_when_refused(tmp_path: Path,
                                                                     journal_format: str) -> None:
    coll = make(tmp_path, journal_format, {"q": {"max_errors": 2, "error_queue": "dead"},
                                           "dead": {"max_items": 1}})
    coll.put("dead", [b"filler"])
    coll.put("q", [b"bad", b"good"])
    for _ in range(2):
        item = one(coll.remove("q", transaction=True))
        assert item is not None and item.data == b"bad" and coll.unremove("q", [item.xid])
    q = coll.queue("q")
    assert q.length == 2 and q.stats()["poisoned"] == 0  # the error queue is full: back at the head
    assert drain(coll, "dead") == [b"filler"]
    item = one(coll.remove("q", transaction=True))
    assert item is not None and item.errors == 2 and coll.unremove("q", [item.xid])
    assert q.length == 1 and q.stats()["poisoned"] == 1
    coll = reopen(coll)
    assert drain(coll, "dead") == [b"bad"] and drain(coll, "q") == [b"good"]


@FORMATS
def test_a_look_changes_nothing_and_is_no_delivery(tmp_path: Path, journal_format: str) -> None:
    clock = FakeClock(T0)
    coll = make(tmp_path, journal_format, {"q": {"max_errors": 2, "error_queue": "dead"},
                                           "big": {"max_memory_size": 1000}}, clock=clock)
    coll.put("q", [b"%d" % i for i in range(10)])
    coll.put("q", [b"brief"], T0 + 1000)
    q = coll.queue("q")
    before = (q.stats(), q.journal_size, [i.data for i in q.look(0, 100).shown])
    for _ in range(5):  # as many looks as max_errors twice over: none counts as a failed delivery
        looked = q.look(0, 100)
    assert looked.shown[0].errors == 0
    assert (q.stats(), q.journal_size, [i.data for i in q.look(0, 100).shown]) == before
    assert looked == (q.create_time, 0, 11, 11, looked.shown) and len(looked.shown) == 11
    assert coll.get("dead") is None
    # Positions stay with their items: taking from the head moves the head on, a read put back one back.
    taken = coll.remove("q", 3, transaction=True)
    assert q.look(0, 2)[1:4] == (3, 8, 5) and [i.data for i in q.look(0, 2).shown] == [b"3", b"4"]
    assert [i.data for i in q.look(6, 2).shown] == [b"6", b"7"]
    assert coll.unremove("q", [taken[2].xid])
    assert q.look(0, 1)[1:4] == (2, 9, 3) and [i.data for i in q.look(2, 1).shown] == [b"2"]
    assert [i.data for i in q.look(6, 2).shown] == [b"6", b"7"]
    assert q.look(11, 5)[1:4] == (2, 9, 11) and q.look(11, 5).shown == []  # past the end
    clock.advance(1000)
    assert [i.data for i in q.look(9, 5).shown] == [b"9"]  # an expired item is left out, as a get would
    assert q.look(9, 5).after == 11
    # Only what memory holds is shown: the look stops where read-behind keeps the rest on disk.
    items = [b"%04d" % i + b"." * 96 for i in range(30)]
    coll.put("big", items)
    big = coll.queue("big")
    assert big.in_read_behind
    held = len(big.look(0, 100).shown)
    assert 0 < held < 30 and big.look(0, 100).after == held and big.look(held, 5).after == held
    assert [i.data for i in big.look(0, 100).shown] == items[:held]
    # Positions count from the queue's opening: after a restart the head is at 0 again, not behind it.
    assert one(coll.remove("q", transaction=True)) is not None  # open at the stop, as b"0" and b"1"
    coll = reopen(coll)
    q = coll.queue("q")
    looked = q.look(0, 100)
    assert looked[1:4] == (0, 11, 11) and [i.data for i in looked.shown] == [b"%d" % i for i in range(10)]
    assert one(coll.remove("q")) is not None and q.look(0, 1)[1] == 1


@FORMATS
def test_a_wait_ends_at_its_deadline_or_with_the_item_that_arrives(tmp_path: Path,
                                                                    journal_format: str) -> None:
    runtime = ManualRuntime()
    coll = make(tmp_path, journal_format, runtime=runtime)
    coll.queue("q")  # (first: a creation waits for its files' fsyncs off the loop, in real time)
    late = gevent.spawn(partial(coll.remove, "q", 1, False, 0.05))
    gevent.sleep(0)
    runtime.advance(49)
    gevent.sleep(0)
    assert not late.ready() and coll.queue("q").waiters == 1
    runtime.advance(1)
    assert late.get(timeout=2) == [] and coll.queue("q").waiters == 0
    waiters = [gevent.spawn(partial(coll.remove, "q", 1, True, 5.0)) for _ in range(2)]
    gevent.sleep(0)
    runtime.advance(4_000)
    coll.put("q", [b"x", b"y"])
    got = [w.get(timeout=2) for w in waiters]
    assert [i.data for taken in got for i in taken] == [b"x", b"y"]
    assert runtime.timers == 0  # the waits' deadlines are gone with them
    peeker = gevent.spawn(partial(coll.peek, "q", 5.0))
    gevent.sleep(0)
    coll.end_waits()
    assert peeker.get(timeout=2) is None


@FORMATS
def test_waits_end_on_a_queue_nobody_waited_on(tmp_path: Path, journal_format: str) -> None:
    """A queue keeps no list of waiting readers until one waits; ending the waits, or closing the
    queue, before any wait still stops every later read from waiting."""
    runtime = ManualRuntime()
    coll = make(tmp_path, journal_format, runtime=runtime)
    coll.put("ended", [b"x"])
    coll.put("closed", [b"x"])
    assert coll.remove("ended") and coll.remove("closed")
    assert coll.queue("ended").waiters == 0 and not coll.queue("ended").waits_ended
    coll.queue("ended").end_waits()
    assert coll.queue("ended").waits_ended
    assert coll.remove("ended", 1, False, 5.0) == []  # at once: the manual clock never moves
    assert coll.peek("ended", 5.0) is None
    closed = coll.queue("closed")
    closed.close()
    assert closed.waits_ended  # a wait that began now would return at once
    coll.put("ended", [b"y"])  # a put with nobody waiting wakes nobody
    assert one(coll.remove("ended", 1, False, 5.0)).data == b"y"  # type: ignore[union-attr]
    coll.close()


@FORMATS
def test_items_past_the_memory_budget_are_read_back_in_order(tmp_path: Path, journal_format: str) -> None:
    coll = make(tmp_path, journal_format, {"q": {"max_memory_size": 1000}})
    items = [b"%04d" % i + b"." * 96 for i in range(60)]
    for i in range(0, 60, 7):
        coll.put("q", items[i:i + 7])
    q = coll.queue("q")
    assert q.in_read_behind and q.length == 60 and q.memory_bytes <= 1100
    assert [r.data for r in coll.remove("q", 5, transaction=True)] == items[:5]
    coll = reopen(coll)
    got = []  # the reads open at the stop come back first, at the head (Kestrel 2: beyond the budget)
    while (item := one(coll.remove("q"))) is not None:
        got.append(item.data)
        assert coll.queue("q").memory_bytes <= 1100 + 500
    assert got == items and not coll.queue("q").in_read_behind
    coll.close()


@FORMATS
def test_a_change_that_cannot_be_written_is_refused_and_changes_nothing(tmp_path: Path, journal_format: str,
                                                                         disk: FailingDisk) -> None:
    coll = make(tmp_path, journal_format)
    coll.put("q", [b"one", b"two", b"three"])
    opened = one(coll.remove("q", transaction=True))
    assert opened is not None
    disk.full = True
    with pytest.raises(JournalWriteError):
        coll.remove("q", 2)
    with pytest.raises(JournalWriteError):
        coll.confirm("q", [opened.xid])
    with pytest.raises(JournalWriteError):
        coll.flush("q")
    q = coll.queue("q")
    assert (q.length, q.open_transactions) == (2, 1)
    disk.full = False
    assert coll.confirm("q", [opened.xid])
    assert drain(coll, "q") == [b"two", b"three"]
    coll = reopen(coll)
    assert drain(coll, "q") == []


@FORMATS
def test_a_failed_write_makes_the_queue_read_only_until_a_probe_write_succeeds(
        tmp_path: Path, journal_format: str, disk: FailingDisk, capsys: pytest.CaptureFixture[str]) -> None:
    """One policy for both formats: the change is refused and undone, the queue goes read-only (in
    its stats, logged once, each failure counted), peeks still answer, and the first change after
    the disk recovers probes the journal and goes ahead."""
    coll = make(tmp_path, journal_format)
    coll.put("q", [b"one", b"two", b"three"])
    disk.full = True
    capsys.readouterr()
    with pytest.raises(JournalWriteError):
        coll.remove("q")
    q = coll.queue("q")
    assert q.stats()["read_only"] == 1 and q.stats()["journal_write_errors"] == 1
    with pytest.raises(JournalWriteError):
        coll.put("q", [b"four"])  # refused by the probe: nothing written, nothing more counted
    with pytest.raises(JournalWriteError):
        coll.remove("q")
    assert q.stats()["read_only"] == 1 and q.length == 3
    assert coll.peek("q") is not None and coll.peek("q").data == b"one"  # type: ignore[union-attr]
    gevent.idle()  # a change's lines are logged after it (src/kestrel/storage/deferred_log.py)
    assert len([line for line in capsys.readouterr().out.splitlines() if "read-only until it can" in line]) == 1
    disk.full = False
    assert coll.put("q", [b"four"])
    gevent.idle()
    assert q.stats()["read_only"] == 0 and "can be written again" in capsys.readouterr().out
    assert drain(coll, "q") == [b"one", b"two", b"three", b"four"]
    coll = reopen(coll)
    assert drain(coll, "q") == []


@pytest.mark.parametrize("handed_out", [False, True])
def test_an_owed_return_the_failing_journal_refused_is_made_once_it_can_be_written_again(
        tmp_path: Path, handed_out: bool, disk: FailingDisk) -> None:
    """The server takes open reads from whoever held them before it returns them (a get that ended
    without a reply puts back what it took; an abort, an auto-abort, a connection closing): when the
    journal refused the return, nobody was left to try again and they stayed open reads until the
    next start. They now go back once the journal can be written again, at the head in their order.
    (A Kestrel 3 return writes nothing.)"""
    coll = make(tmp_path, "kestrel2")
    coll.put("q", [b"one", b"two", b"three"])
    taken = coll.remove("q", 2, transaction=True)
    disk.full = True
    with pytest.raises(JournalWriteError):
        coll.unremove("q", [item.xid for item in reversed(taken)], handed_out, owed=True)
    disk.full = False
    assert coll.put("q", [b"four"])  # the probe succeeds: the owed return follows this change
    gevent.idle()
    q = coll.queue("q")
    assert q.stats()["open_transactions"] == 0
    assert drain(coll, "q") == [b"one", b"two", b"three", b"four"]
    coll = reopen(coll)
    assert drain(coll, "q") == []


@FORMATS
def test_an_abort_the_journal_refused_counts_its_errors_once_when_it_is_made(
        tmp_path: Path, journal_format: str, disk: FailingDisk) -> None:
    """An item's abort counts once toward `max_errors`, however many times its write was tried: the
    try the journal refused counted nothing, the owed return paid later counts it. (Once counted at
    each, an item aborted once was poisoned with `max_errors: 2`.) A Kestrel 3 return writes
    nothing: here the write is that of the poison item's confirm, in the same abort."""
    coll = make(tmp_path, journal_format, {"q": {"max_errors": 2}})
    coll.put("q", [b"bad", b"fine"])
    first = one(coll.remove("q", transaction=True))
    assert first is not None
    coll.unremove("q", [first.xid])  # bad: its first error
    taken = coll.remove("q", 2, transaction=True)
    disk.full = True
    with pytest.raises(JournalWriteError):  # bad's second error poisons it; fine's first
        coll.unremove("q", [item.xid for item in reversed(taken)], owed=True)
    q = coll.queue("q")
    assert (q.poisoned, q.canceled_transactions) == (0, 1)
    disk.full = False
    assert coll.put("q", [b"after"])  # the probe succeeds: the owed return follows this change
    gevent.idle()
    left = [(item.data, item.errors) for item in coll.remove("q", 10)]
    if journal_format == "kestrel2":
        # The failure rebuilt memory from the journal, which has no error counts (docs/sessions.md).
        assert left == [(b"bad", 1), (b"fine", 1), (b"after", 0)] and q.poisoned == 0
    else:
        assert left == [(b"fine", 1), (b"after", 0)] and q.poisoned == 1
    assert q.canceled_transactions == 3


@FORMATS
def test_plain_threads_put_and_take_every_item_once(tmp_path: Path, journal_format: str) -> None:
    """Each change holds the queue's lock: with threads, no item is lost or served twice, and a
    Kestrel 3 put to the parent reaches its fanout child whatever the child's readers do."""
    coll = make(tmp_path, journal_format, runtime=ThreadsRuntime())
    coll.queue("q+c")
    taken: dict[str, list[bytes]] = {"q": [], "q+c": []}

    def produce(n: int) -> None:
        for i in range(200):
            coll.put("q", [b"%d-%d" % (n, i)])

    def consume(name: str) -> None:
        while True:
            item = one(coll.remove(name, transaction=True, timeout=0.01))
            if item is None:
                if produced.is_set():
                    return
                continue
            taken[name].append(item.data)
            if not coll.confirm(name, [item.xid]):
                failures.append(f"{name}: read {item.xid} was not open")

    def guarded(work: Callable[..., None], *args: Any) -> Callable[[], None]:
        def run() -> None:
            try:
                work(*args)
            except Exception as e:
                failures.append(repr(e))
        return run

    failures: list[str] = []
    produced = threading.Event()
    producers = [threading.Thread(target=guarded(produce, n)) for n in range(3)]
    consumers = [threading.Thread(target=guarded(consume, name)) for name in ("q", "q", "q+c")]
    for thread in producers + consumers:
        thread.start()
    for thread in producers:
        thread.join(timeout=60)
    produced.set()
    for thread in consumers:
        thread.join(timeout=60)
    assert failures == []
    expected = sorted(b"%d-%d" % (n, i) for n in range(3) for i in range(200))
    assert sorted(taken["q"]) == expected and sorted(taken["q+c"]) == expected
    coll.close()
