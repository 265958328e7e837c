"""The expiry sweep (src/kestrel/storage/expiry.py) in both journal formats: it looks only at the
queues whose head is due (never at a queue that can expire nothing), and expires exactly what
Kestrel's sweep does (expired items at the head, at most `max_expire_sweep` a round; an empty queue
past `max_queue_age`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gevent
import pytest

from kestrel.storage import QueueCollection, QueueConfigs
from kestrel.storage.clock import FakeClock
from kestrel.storage.queue import PersistentQueue
from kestrel.storage.runtime import ThreadsRuntime
from tests.support.queues import drain, one, opened, reopen

T0 = 1_700_000_000_000

FORMATS = pytest.mark.parametrize("journal_format", ["kestrel2", "kestrel3"])


def make(path: Path, journal_format: str, clock: FakeClock, queues: dict[str, Any] | None = None) -> QueueCollection:
    coll = opened(QueueCollection(str(path), QueueConfigs({"journal_format": journal_format}, queues), clock=clock))
    coll.load()
    return coll


@pytest.fixture
def looks(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the queues whose heads a sweep looks at, in order."""
    seen: list[str] = []
    head_expiry = PersistentQueue.head_expiry

    def counted(q: PersistentQueue) -> int:
        seen.append(q.name)
        return head_expiry(q)

    monkeypatch.setattr(PersistentQueue, "head_expiry", counted)
    return seen


@pytest.mark.pure_build
@FORMATS
def test_a_sweep_looks_at_the_queues_that_are_due_or_changed_and_no_other(
        tmp_path: Path, journal_format: str, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock(T0)
    coll = make(tmp_path, journal_format, clock)
    for i in range(300):
        coll.put(f"q{i:03}", [b"never expires"])
    coll.put("q150", [b"soon"], T0 + 5_000)
    calls: list[str] = []
    discard = PersistentQueue.discard_expired

    def counted(q: PersistentQueue, limit: int | None = None) -> int:
        calls.append(q.name)
        return discard(q, limit)

    monkeypatch.setattr(PersistentQueue, "discard_expired", counted)
    for _ in range(4):  # an idle server: no queue is touched
        clock.advance(1_000)
        assert coll.sweep() == 0
    assert calls == []
    assert one(coll.remove("q150")) is not None  # its head is now "soon", due in a second
    clock.advance(1_000)
    assert coll.sweep() == 1 and calls == ["q150"]
    clock.advance(1_000)
    assert coll.sweep() == 0 and calls == ["q150"]
    assert coll.queue("q150").length == 0 and coll.queue("q150").expired_items == 1


@pytest.mark.pure_build
@FORMATS
def test_an_item_behind_a_head_that_never_expires_waits_until_it_reaches_the_head(
        tmp_path: Path, journal_format: str, looks: list[str]) -> None:
    clock = FakeClock(T0)
    coll = make(tmp_path, journal_format, clock)
    coll.put("q", [b"never"])
    coll.put("q", [b"soon"], T0 + 1_000)
    coll.put("q", [b"later"], T0 + 3_000)
    clock.advance(2_000)
    assert coll.sweep() == 0  # as Kestrel: the sweep looks at the head only
    looks.clear()
    clock.advance(1_000)
    assert coll.sweep() == 0 and looks == []  # nothing due at the head, nothing changed
    assert one(coll.remove("q")).data == b"never"  # type: ignore[union-attr]
    assert coll.queue("q").length == 2  # a get leaves the expired item it reveals to the sweep
    assert coll.sweep() == 2 and set(looks) == {"q"} and coll.queue("q").expired_items == 2


@FORMATS
def test_an_aborted_read_of_an_expired_item_is_swept_once_it_is_back_at_the_head(
        tmp_path: Path, journal_format: str) -> None:
    clock = FakeClock(T0)
    coll = make(tmp_path, journal_format, clock, {"q": {"expire_to_queue": "dead"}})
    coll.put("q", [b"x"], T0 + 1_000)
    coll.put("q", [b"y"])
    taken = one(coll.remove("q", transaction=True))
    assert taken is not None
    clock.advance(2_000)
    assert coll.sweep() == 0
    assert coll.unremove("q", [taken.xid])
    assert coll.sweep() == 1
    assert drain(coll, "q") == [b"y"] and drain(coll, "dead") == [b"x"]


@FORMATS
def test_expired_items_the_expire_to_queue_refuses_are_dropped_and_said_so(
        tmp_path: Path, journal_format: str) -> None:
    """Kestrel drops them; here they vanished without a word, `expired_items` counting them and the
    target holding fewer (README: "move there instead of being dropped")."""
    from structlog.testing import capture_logs

    clock = FakeClock(T0)
    coll = make(tmp_path, journal_format, clock, {"q": {"expire_to_queue": "dead"}, "dead": {"max_items": 1}})
    coll.put("q", [b"a", b"b", b"c"], T0 + 1_000)
    clock.advance(2_000)
    with capture_logs() as logs:
        assert coll.sweep() == 3
        gevent.sleep(0)  # the warning is written in a task of its own (`log_later`)
    (said,) = [e for e in logs if e["event"].startswith("expire_to_queue refused")]
    assert (said["queue"], said["expire_to_queue"], said["dropped"]) == ("q", "dead", 2)
    assert drain(coll, "dead") == [b"a"]


@pytest.mark.pure_build
@FORMATS
def test_the_head_comes_due_without_a_change_and_a_round_stops_at_max_expire_sweep(
        tmp_path: Path, journal_format: str, looks: list[str]) -> None:
    clock = FakeClock(T0)
    coll = make(tmp_path, journal_format, clock, {"q": {"max_expire_sweep": 3}})
    coll.put("q", [b"a", b"b", b"c", b"d", b"e"], T0 + 10_000)
    coll.put("q", [b"kept"])
    coll.sweep()
    for _ in range(9):
        clock.advance(1_000)
        looks.clear()
        assert coll.sweep() == 0 and looks == []  # not due yet: not looked at
    clock.advance(1_000)
    assert coll.sweep() == 3
    assert coll.sweep() == 2
    assert drain(coll, "q") == [b"kept"]


@pytest.mark.pure_build
@FORMATS
def test_a_queue_past_max_queue_age_is_deleted_at_its_time_without_a_change(
        tmp_path: Path, journal_format: str, looks: list[str]) -> None:
    clock = FakeClock(T0)
    coll = make(tmp_path, journal_format, clock, {"tmp": {"max_queue_age": "10s"}})
    assert one(coll.remove("tmp")) is None  # creates it, empty
    coll.sweep()
    looks.clear()
    clock.advance(9_000)
    coll.sweep()
    assert "tmp" in coll.queue_names() and looks == []
    clock.advance(1_001)
    coll.sweep()
    assert "tmp" not in coll.queue_names() and coll.queue_expires == 1


@FORMATS
def test_items_due_at_start_up_are_swept_after_the_restart(tmp_path: Path, journal_format: str) -> None:
    clock = FakeClock(T0)
    coll = make(tmp_path, journal_format, clock)
    coll.put("q", [b"a", b"b"], T0 + 1_000)
    coll.put("q", [b"kept"])
    coll.put("other", [b"untouched"])
    clock.advance(2_000)
    coll = reopen(coll)
    assert coll.sweep() == 2
    assert drain(coll, "q") == [b"kept"]


@FORMATS
def test_many_reschedules_keep_the_schedule_small(tmp_path: Path, journal_format: str) -> None:
    clock = FakeClock(T0)
    coll = make(tmp_path, journal_format, clock)
    for n in range(2_000):  # each get reveals a head with a later expiry: the queue moves in the heap
        coll.put("q", [b"%d" % n], T0 + 1_000_000 - n)
    for _ in range(1_999):
        coll.remove("q")
        coll.sweep()
    assert len(coll._expiry._heap) <= 2 * 1 + 64


@pytest.mark.pure_build
@FORMATS
def test_a_queue_that_can_expire_nothing_is_never_looked_at(
        tmp_path: Path, journal_format: str, looks: list[str]) -> None:
    clock = FakeClock(T0)
    coll = make(tmp_path, journal_format, clock, {"aged": {"max_age": "1h"}})
    for _ in range(5):  # puts, gets, reliable reads and aborts, the sweep every round
        for i in range(100):
            coll.put(f"q{i:03}", [b"never expires"] * 2)
            taken = one(coll.remove(f"q{i:03}", transaction=True))
            assert taken is not None and coll.unremove(f"q{i:03}", [taken.xid])
            assert one(coll.remove(f"q{i:03}")) is not None
        clock.advance(1_000)
        assert coll.sweep() == 0
    coll = reopen(coll)
    coll.sweep()
    assert looks == []
    coll.put("aged", [b"capped by max_age"])  # a queue whose settings age its items is watched
    assert drain(coll, "q000") == [b"never expires"] * 5 and set(looks) == {"aged"}
    coll.put("q000", [b"soon"], T0 + 10_000)  # and one given an item with an expiry, from then on
    assert set(looks) == {"aged", "q000"}
    clock.advance(5_000)
    assert coll.sweep() == 1 and coll.queue("q000").length == 0


@FORMATS
def test_items_on_disk_at_start_up_expire_once_they_reach_the_head(tmp_path: Path, journal_format: str) -> None:
    clock = FakeClock(T0)
    coll = make(tmp_path, journal_format, clock, {"q": {"max_memory_size": 1000}})
    coll.put("q", [b"n" * 100] * 20)  # never expire, and fill memory: read-behind
    coll.put("q", [b"a", b"b"], T0 + 1_000)
    coll.put("q", [b"kept"])
    coll = reopen(coll)
    assert coll.queue("q").in_read_behind
    clock.advance(2_000)
    assert coll.sweep() == 0  # the head never expires
    assert len(coll.remove("q", 20)) == 20
    assert coll.sweep() == 2
    assert drain(coll, "q") == [b"kept"] and coll.queue("q").expired_items == 2


@FORMATS
def test_a_fanout_child_given_items_with_an_expiry_is_swept(tmp_path: Path, journal_format: str) -> None:
    clock = FakeClock(T0)
    coll = make(tmp_path, journal_format, clock)
    coll.queue("q+a")
    coll.put("q", [b"x", b"y"], T0 + 1_000)
    coll.put("q", [b"kept"])
    clock.advance(2_000)
    assert coll.sweep() == 4
    assert drain(coll, "q") == [b"kept"] and drain(coll, "q+a") == [b"kept"]


@FORMATS
def test_new_settings_that_age_queues_bring_them_under_the_sweep(tmp_path: Path, journal_format: str) -> None:
    clock = FakeClock(T0)
    coll = make(tmp_path, journal_format, clock)
    assert one(coll.remove("tmp")) is None  # created, empty
    coll.put("q", [b"old"])
    coll.reload(QueueConfigs({"journal_format": journal_format},
                             {"tmp": {"max_queue_age": "10s"}, "q": {"max_age": "5s"}}), {})
    coll.put("q", [b"capped"])
    clock.advance(6_000)
    # "old" came before max_age, and is aged by it all the same (Kestrel's adjustExpiry)
    assert coll.sweep() == 2 and coll.queue("q").length == 0
    clock.advance(5_000)
    coll.sweep()
    assert "tmp" not in coll.queue_names() and coll.queue_expires == 1


@FORMATS
def test_under_plain_threads_every_expiring_item_is_swept(tmp_path: Path, journal_format: str) -> None:
    """Changes in other threads while sweeps run: no queue's look is lost."""
    import threading

    clock = FakeClock(T0)
    coll = QueueCollection(str(tmp_path), QueueConfigs({"journal_format": journal_format}), clock=clock,
                           runtime=ThreadsRuntime())
    coll.load()
    stop = threading.Event()

    def sweeping() -> None:
        while not stop.is_set():
            coll.sweep()

    sweeper = threading.Thread(target=sweeping)
    sweeper.start()
    try:
        for i in range(200):
            coll.put(f"q{i % 20}", [b"soon", b"soon"], T0 + 1_000 + i)
            coll.remove(f"q{i % 20}")
    finally:
        stop.set()
        sweeper.join()
    clock.advance(2_000)
    assert coll.sweep() == 200
    assert all(coll.queue(f"q{i}").length == 0 for i in range(20))


@FORMATS
def test_a_lower_max_age_ages_the_items_already_queued(tmp_path: Path, journal_format: str) -> None:
    """Kestrel reads `max_age` at each look at the head: a reload, or a restart with new settings,
    ages the items queued before, open reads and items read back from disk among them; a raised one
    lengthens no expiry already given."""
    clock = FakeClock(T0)
    coll = make(tmp_path, journal_format, clock, {"q": {"max_memory_size": "4", "max_age": "1h"}})
    coll.put("q", [b"%d" % i for i in range(8)])  # past 4 bytes: read-behind holds the rest on disk
    assert coll.queue("q").in_read_behind
    [read] = coll.remove("q", transaction=True)  # an open read
    clock.advance(30_000)
    coll.reload(QueueConfigs({"journal_format": journal_format}, {"q": {"max_memory_size": "4", "max_age": "10s"}}), {})
    assert coll.queue("q").head_expiry() == T0 + 10_000 and read.expiry == T0 + 10_000
    coll.unremove("q", [read.xid])
    assert coll.sweep() == 8 and coll.queue("q").length == 0  # from memory, then read back
    coll.put("q", [b"kept"])
    coll.reload(QueueConfigs({"journal_format": journal_format}, {"q": {"max_age": "1h"}}), {})
    assert coll.queue("q").head_expiry() == T0 + 40_000  # its 10 s from the put, not an hour
    coll.close()

    clock = FakeClock(T0)
    coll = make(tmp_path / "restart", journal_format, clock, {"q": {"max_memory_size": "4"}})
    coll.put("q", [b"%d" % i for i in range(8)])  # no max_age: never expire
    coll.close()
    clock.advance(30_000)
    coll = make(tmp_path / "restart", journal_format, clock, {"q": {"max_memory_size": "4", "max_age": "10s"}})
    assert coll.sweep() == 8 and coll.queue("q").length == 0
    coll.close()


@FORMATS
def test_a_raised_max_age_lengthens_no_cap_already_given_to_items_on_disk(tmp_path: Path,
                                                                         journal_format: str) -> None:
    """A Kestrel 3 PUT kept the put's own expiry and each read back took the `max_age` of now: a
    raised `max_age` brought back the expired items read-behind held on disk (after a restart, all
    of them), where those in memory stayed expired."""
    clock = FakeClock(T0)
    small = {"max_memory_size": "4", "max_age": "3s"}
    coll = make(tmp_path, journal_format, clock, {"q": small})
    coll.put("q", [b"%d" % i for i in range(8)])  # past 4 bytes: read-behind holds the rest on disk
    assert coll.queue("q").in_read_behind
    clock.advance(4_000)
    coll.reload(QueueConfigs({"journal_format": journal_format}, {"q": {**small, "max_age": "1h"}}), {})
    assert coll.remove("q", 10) == []
    coll.close()
    coll = make(tmp_path / "restart", journal_format, FakeClock(T0), {"q": small})
    coll.put("q", [b"%d" % i for i in range(8)])
    coll.close()
    clock = FakeClock(T0 + 4_000)
    coll = make(tmp_path / "restart", journal_format, clock, {"q": {**small, "max_age": "1h"}})
    assert coll.remove("q", 10) == []
    coll.close()


@pytest.mark.parametrize("queues, default", [({"jobs": {"expire_to_queue": "both"}}, None),
                                             (None, {"expire_to_queue": "both"})])
def test_an_expire_to_queue_that_is_an_alias_is_refused_at_load_and_reload(tmp_path: Path, queues: Any,
                                                                          default: Any) -> None:
    """The items went to a queue made under the alias's name, which no read of the alias reaches."""
    from kestrel.storage.errors import ConfigError

    where = "queues.jobs" if queues else "default_queue"
    with pytest.raises(ConfigError) as raised:
        QueueCollection(str(tmp_path), QueueConfigs(default, queues), {"both": ["a", "b"]})
    assert str(raised.value) == f"{where}.expire_to_queue: 'both' is an alias; expired items need a queue"
    coll = opened(QueueCollection(str(tmp_path), QueueConfigs(default, queues), {}))
    coll.load()
    with pytest.raises(ConfigError):
        coll.reload(QueueConfigs(default, queues), {"both": ["a", "b"]})
    assert not coll.aliases  # nothing of the refused reload applied
    coll.close()
