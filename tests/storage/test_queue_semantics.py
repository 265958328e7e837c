"""PersistentQueue and QueueCollection as a library: limits, expiry, fanout, aliases, names, waits."""

from __future__ import annotations

import os
import re
from functools import partial
from pathlib import Path

import gevent
import pytest

from kestrel.storage import QueueCollection, QueueConfigs, disk, fanout
from kestrel.storage.clock import FakeClock
from kestrel.storage.config import MB, QueueConfig, parse_duration_ms, parse_size
from kestrel.storage.errors import ConfigError, InvalidQueueName
from kestrel.storage.runtime import ManualRuntime
from tests.support.queues import drain, one, opened, reopen

T0 = 1_700_000_000_000


def make(tmp_path: Path, queues: dict | None = None, default: dict | None = None,
         aliases: dict | None = None, clock: FakeClock | None = None) -> QueueCollection:
    coll = opened(QueueCollection(str(tmp_path), QueueConfigs(default, queues), aliases, clock or FakeClock(T0)))
    coll.load()
    return coll


def test_fifo_order_and_peek(tmp_path: Path) -> None:
    coll = make(tmp_path)
    coll.put("q", [b"1", b"2", b"3"])
    head = coll.peek("q")
    assert head is not None and head.data == b"1"
    assert drain(coll, "q") == [b"1", b"2", b"3"]
    assert one(coll.remove("q")) is None


def test_max_items_and_max_size_refuse(tmp_path: Path) -> None:
    coll = make(tmp_path, {"small": {"max_items": 2}, "bytes": {"max_size": "10"}})
    assert coll.put("small", [b"a", b"b", b"c"]) == 2
    assert coll.put("bytes", [b"12345678"])
    assert coll.put("bytes", [b"12345"])
    assert not coll.put("bytes", [b"x"])  # 13 bytes already >= 10
    assert drain(coll, "small") == [b"a", b"b"]


def test_discard_old_when_full(tmp_path: Path) -> None:
    coll = make(tmp_path, {"q": {"max_items": 2, "discard_old_when_full": True}})
    assert coll.put("q", [b"a", b"b", b"c", b"d"]) == 4
    assert coll.queue("q").discarded == 2
    coll = reopen(coll)
    assert drain(coll, "q") == [b"c", b"d"]


def test_max_item_size_refuses_the_item(tmp_path: Path) -> None:
    coll = make(tmp_path, {"q": {"max_item_size": "4"}})
    assert not coll.put("q", [b"12345"])
    assert coll.put("q", [b"1234"])
    assert coll.queue("q").put([b"12345"]) == 0 and coll.queue("q").length == 1


def test_expiry_on_remove_peek_and_sweep(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    coll = make(tmp_path, clock=clock)
    coll.put("q", [b"soon"], expiry_ms=T0 + 1000)
    coll.put("q", [b"later"], expiry_ms=T0 + 5000)
    coll.put("q", [b"never"])
    clock.advance(1000)
    head = coll.peek("q")
    assert head is not None and head.data == b"later"
    clock.advance(4000)
    assert coll.sweep() == 1
    assert coll.queue("q").expired_items == 2
    assert drain(coll, "q") == [b"never"]


def test_expiry_survives_restart_as_removes(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    coll = make(tmp_path, clock=clock)
    coll.put("q", [b"old"], expiry_ms=T0 + 10)
    coll.put("q", [b"new"])
    clock.advance(20)
    coll.sweep()
    coll = reopen(coll)
    assert drain(coll, "q") == [b"new"]


def test_max_age_caps_expiry(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    coll = make(tmp_path, {"q": {"max_age": "1s"}}, clock=clock)
    coll.put("q", [b"capped"])
    coll.put("q", [b"also"], expiry_ms=T0 + 60_000)
    item = coll.peek("q")
    assert item is not None and item.expiry == T0 + 1000
    clock.advance(1001)
    assert one(coll.remove("q")) is None


def test_max_expire_sweep_limits_a_round(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    coll = make(tmp_path, {"q": {"max_expire_sweep": 2}}, clock=clock)
    coll.put("q", [b"a", b"b", b"c"], expiry_ms=T0 + 1)
    clock.advance(5)
    assert coll.sweep() == 2
    assert coll.sweep() == 1


def test_expire_to_queue(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    coll = make(tmp_path, {"q": {"expire_to_queue": "dead"}}, clock=clock)
    coll.put("q", [b"x"], expiry_ms=T0 + 1)
    clock.advance(2)
    coll.sweep()
    item = one(coll.remove("dead"))
    assert item is not None and item.data == b"x" and item.expiry == 0


def test_max_queue_age_deletes_an_empty_queue(tmp_path: Path) -> None:
    clock = FakeClock(T0)
    coll = make(tmp_path, {"tmp": {"max_queue_age": "10s"}}, clock=clock)
    coll.put("tmp", [b"x"])
    clock.advance(11_000)
    coll.sweep()
    assert "tmp" in coll.queue_names()  # not empty: it stays
    coll.remove("tmp")
    coll.sweep()
    assert "tmp" not in coll.queue_names()
    assert coll.queue_expires == 1 and coll.queue_deletes == 1
    assert not (tmp_path / "tmp").exists()


def test_reliable_read_confirm_and_abort(tmp_path: Path) -> None:
    coll = make(tmp_path)
    coll.put("q", [b"a", b"b"])
    a = one(coll.remove("q", transaction=True))
    assert a is not None and a.xid != 0
    first_xid = a.xid
    assert coll.queue("q").open_transactions == 1
    assert coll.unremove("q", [first_xid])
    assert not coll.unremove("q", [first_xid])  # already closed
    a2 = one(coll.remove("q", transaction=True))
    assert a2 is not None and a2.data == b"a" and a2.xid != first_xid
    assert coll.confirm("q", [a2.xid])
    assert not coll.confirm("q", [999])
    assert drain(coll, "q") == [b"b"]


def test_xids_keep_increasing_across_restarts(tmp_path: Path) -> None:
    coll = make(tmp_path)
    coll.put("q", [b"a", b"b", b"c"])
    first = one(coll.remove("q", transaction=True))
    assert first is not None
    coll.confirm("q", [first.xid])
    coll = reopen(coll)
    second = one(coll.remove("q", transaction=True))
    assert second is not None and second.xid > first.xid


def test_kestrel2_xids_skip_open_ones_and_zero_and_wrap_as_kestrel_counts_them(tmp_path: Path) -> None:
    """The next free xid: the one after the last, passing over those still open and 0, wrapping at
    the i32's end."""
    coll = make(tmp_path, default={"journal_format": "kestrel2"})
    coll.put("q", [b"%d" % n for n in range(6)])
    queue = coll.queue("q")
    queue._xid = 2**31 - 3  # type: ignore[attr-defined]
    held = coll.remove("q", 1, transaction=True)[0]
    assert held.xid == 2**31 - 2
    queue._xid = 2**31 - 4  # type: ignore[attr-defined]  # the next one is open: passed over
    taken = coll.remove("q", 3, transaction=True)
    assert [item.xid for item in taken] == [2**31 - 3, 2**31 - 1, -(2**31)]
    queue._xid = -2  # type: ignore[attr-defined]
    assert [item.xid for item in coll.remove("q", 2, transaction=True)] == [-1, 1]
    coll.unremove("q", [-1, 1, held.xid, *(item.xid for item in taken)])
    queue._xid = 2**31 - 3  # type: ignore[attr-defined]  # a run across the end, none open
    assert [item.xid for item in coll.remove("q", 3, transaction=True)] == [2**31 - 2, 2**31 - 1, -(2**31)]
    coll = reopen(coll)  # the replay counts them alike: every read open at the stop comes back
    assert sorted(drain(coll, "q")) == sorted([b"%d" % n for n in range(6)])


def test_flush_and_delete(tmp_path: Path) -> None:
    coll = make(tmp_path)
    coll.put("q", [b"a", b"b"])
    coll.flush("q")
    assert one(coll.remove("q")) is None and coll.queue("q").total_flushes == 1
    coll.put("q", [b"c"])
    coll = reopen(coll)
    assert drain(coll, "q") == [b"c"]
    coll.delete("q")
    assert not (tmp_path / "q").exists()
    assert "q" not in coll.queue_names()


def test_fanout_children_get_only_later_items(tmp_path: Path) -> None:
    coll = make(tmp_path)
    coll.put("orders", [b"before"])
    coll.queue("orders+audit")
    coll.put("orders", [b"after"])
    assert drain(coll, "orders+audit") == [b"after"]
    coll.put("orders", [b"third"])
    coll = reopen(coll)
    assert drain(coll, "orders") == [b"before", b"after", b"third"]
    assert drain(coll, "orders+audit") == [b"third"]
    coll.delete("orders+audit")
    coll.put("orders", [b"fourth"])
    assert coll.get("orders+audit") is None


@pytest.mark.parametrize("items", [[b"x" * (fanout.FEED_PACE // 8)],
                                   [b"%015d" % n for n in range(fanout.FEED_PACE // 8 // (15 + fanout.FEED_ITEM_COST))]],
                         ids=["large", "many"])
def test_a_put_to_many_fanout_children_lets_other_tasks_in_between_runs_of_them(tmp_path: Path,
                                                                                 items: list[bytes]) -> None:
    """2,000 children each given 15 items of 64 KB (or 5,000 small ones) held the loop for 4 s (1.5 s):
    the children are fed in runs of about FEED_PACE of work, the other tasks let in between runs; a
    child deleted meanwhile is passed over, and every other child takes the put."""
    coll = make(tmp_path)
    children = [f"q+c{n:02d}" for n in range(20)]
    for name in children:
        coll.queue(name)
    let_in: list[int] = []

    def between_runs() -> None:
        let_in.append(sum(1 for q in coll.queues() if q.name in children and q.length))
        coll.delete(children[-1])

    gevent.spawn(between_runs)
    assert coll.put("q", items) == len(items)
    assert let_in and 0 < let_in[0] <= 8  # after the first run, of 7 or 8 children
    assert {q.name for q in coll.queues()} == {"q", *children[:-1]}
    assert all(drain(coll, name) == items for name in ["q", *children[:-1]])


@pytest.mark.parametrize("journal_format", ["kestrel2", "kestrel3"])
def test_a_fanout_child_is_offered_its_parents_items_as_kestrels_put_offers_them_one_by_one(
        tmp_path: Path, journal_format: str) -> None:
    coll = make(tmp_path, {"q": {"max_items": 2}, "q+all": {"max_items": 10},
                           "q+small": {"max_items": 10, "max_item_size": 4}}, {"journal_format": journal_format})
    coll.queue("q+all")
    coll.queue("q+small")
    # The put stops after the parent's first refusal: the children were offered that item too,
    # not the ones after it.
    assert coll.put("q", [b"1", b"too long", b"3", b"4"]) == 2
    assert drain(coll, "q+all") == [b"1", b"too long", b"3"]
    # Each on its own: an item over a child's max_item_size does not stop it taking the next.
    assert drain(coll, "q+small") == [b"1", b"3"]
    assert drain(coll, "q") == [b"1", b"too long"]


@pytest.mark.parametrize("journal_format", ["kestrel2", "kestrel3"])
def test_the_server_s_total_items_is_every_queue_s_adds_however_they_came(tmp_path: Path,
                                                                          journal_format: str) -> None:
    clock = FakeClock(T0)
    coll = make(tmp_path, {"q": {"expire_to_queue": "dead"}, "jobs": {"max_errors": 1, "error_queue": "failed"}},
                {"journal_format": journal_format}, aliases={"both": ["x", "y"]}, clock=clock)
    coll.queue("fan+a")
    coll.queue("fan+b")
    coll.put("fan", [b"1", b"2"])  # to the parent and to each child: 6 adds
    coll.put("q", [b"x"], expiry_ms=T0 + 1)  # and to `dead` when it expires: 2
    clock.advance(2)
    coll.sweep()
    coll.put("jobs", [b"bad"])  # and to `failed` when it is aborted: 2
    read = one(coll.remove("jobs", transaction=True))
    assert read is not None and coll.unremove("jobs", [read.xid])
    coll.put("both", [b"b"])  # to each destination: 2
    added = {q.name: q.total_items for q in coll.queues()}
    assert added == {"fan": 2, "fan+a": 2, "fan+b": 2, "q": 1, "dead": 1, "jobs": 1, "failed": 1, "x": 1, "y": 1}
    assert coll.total_items_added == sum(added.values()) == 12
    coll.delete("fan+b")
    assert coll.total_items_added == 12  # since start: a deleted queue's adds stay counted


@pytest.mark.parametrize("journal_format", ["kestrel2", "kestrel3"])
def test_a_fanout_only_parent_s_put_counts_at_the_server_not_at_the_parent(tmp_path: Path,
                                                                          journal_format: str) -> None:
    """As Kestrel counts it: the server's `total_items` counts each put a queue accepted, a
    fanout-only parent's too, and each copy its children took; the parent, which holds nothing,
    counts nothing of its own."""
    coll = make(tmp_path, {"feed": {"fanout_only": True}}, {"journal_format": journal_format})
    coll.queue("feed+a")
    coll.queue("feed+b")
    assert coll.put("feed", [b"1", b"2"]) == 2
    added = {q.name: q.total_items for q in coll.queues()}
    assert added == {"feed": 0, "feed+a": 2, "feed+b": 2}
    assert coll.total_items_added == 6


def test_fanout_only_parent_keeps_no_journal(tmp_path: Path) -> None:
    coll = make(tmp_path, {"feed": {"fanout_only": True}})
    coll.queue("feed+a")
    coll.queue("feed+b")
    assert coll.put("feed", [b"x"])
    assert not (tmp_path / "feed").exists()
    assert one(coll.remove("feed")) is None
    assert drain(coll, "feed+a") == [b"x"] and drain(coll, "feed+b") == [b"x"]


def test_alias_writes_to_destinations_and_reads_empty(tmp_path: Path) -> None:
    coll = make(tmp_path, aliases={"both": ["x", "y"]})
    assert coll.put("both", [b"hi"])
    assert one(coll.remove("both")) is None
    coll.flush("both")
    coll.delete("both")
    assert drain(coll, "x") == [b"hi"] and drain(coll, "y") == [b"hi"]


def test_keep_journal_false_is_memory_only(tmp_path: Path) -> None:
    coll = make(tmp_path, {"mem": {"keep_journal": False}})
    coll.put("mem", [b"x"])
    assert not (tmp_path / "mem").exists()
    coll = reopen(coll)
    assert one(coll.remove("mem")) is None


@pytest.mark.parametrize("name, reason", [
    ("a/b", "path separator"), ("a~b", "temporary"), ("a.b", "reserved"), ("+x", "parent+child"),
    ("a+b+c", "parent+child"), ("", "empty"), ("a b", "whitespace"), ("../x", "path separator"),
    ("..", "reserved"), ("a\x7fb", "control character"), ("a\x85b", "control character"),
    ("a\x01b", "control character"),
])
def test_bad_queue_names_are_refused_with_a_reason(tmp_path: Path, name: str, reason: str) -> None:
    coll = make(tmp_path)
    with pytest.raises(InvalidQueueName, match=re.escape(reason)):
        coll.put(name, [b"x"])
    with pytest.raises(InvalidQueueName, match=re.escape(reason)):
        coll.remove(name, 0)  # a read of no items still names what was wrong
    assert os.listdir(tmp_path) == []


def test_names_are_case_sensitive(tmp_path: Path) -> None:
    coll = make(tmp_path)
    coll.put("Work", [b"upper"])
    coll.put("work", [b"lower"])
    assert drain(coll, "Work") == [b"upper"]
    assert drain(coll, "work") == [b"lower"]


def test_directory_scan_ignores_subdirectories_and_temporaries(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "q~~123").write_bytes(b"\xff garbage")
    coll = make(tmp_path)
    assert coll.queue_names() == []


def test_waiting_remove_is_woken_by_an_add(tmp_path: Path) -> None:
    runtime = ManualRuntime()
    coll = QueueCollection(str(tmp_path), runtime=runtime)
    waiter = gevent.spawn(partial(coll.remove, "q", 1, False, 5.0))
    gevent.sleep(0)
    assert coll.queue("q").waiters == 1
    runtime.advance(4_000)
    coll.put("q", [b"x"])
    item = one(waiter.get(timeout=2))
    assert item is not None and item.data == b"x"
    assert runtime.timers == 0  # the wait's deadline is gone with it


def test_waiting_remove_times_out(tmp_path: Path) -> None:
    runtime = ManualRuntime()
    coll = QueueCollection(str(tmp_path), runtime=runtime)
    waiter = gevent.spawn(partial(coll.remove, "q", 1, False, 0.05))
    gevent.sleep(0)
    runtime.advance(49)
    gevent.sleep(0)
    assert not waiter.ready()
    runtime.advance(1)
    assert waiter.get(timeout=2) == []
    assert coll.queue("q").waiters == 0


def test_waiters_are_served_in_arrival_order(tmp_path: Path) -> None:
    coll = QueueCollection(str(tmp_path), runtime=ManualRuntime())
    got: list[tuple[int, bytes]] = []

    def wait(n: int) -> None:
        item = one(coll.remove("q", timeout=5.0))
        assert item is not None
        got.append((n, item.data))

    greenlets = []
    for n in range(3):
        greenlets.append(gevent.spawn(partial(wait, n)))
        gevent.sleep(0)
    for data in (b"a", b"b", b"c"):
        coll.put("q", [data])
        gevent.sleep(0)
    gevent.joinall(greenlets, timeout=2)
    assert got == [(0, b"a"), (1, b"b"), (2, b"c")]


def test_inheritance_2_3_4() -> None:
    configs = QueueConfigs({"max_memory_size": "8MB"}, {
        "q": {"max_items": 500}, "q+fanout": {"max_age": "1min"}, "x": {"max_memory_size": "16MB"}})
    assert configs.for_queue("q").max_memory_size == 8 * MB
    assert configs.for_queue("q+fanout").max_memory_size == 8 * MB
    assert configs.for_queue("x").max_memory_size == 16 * MB
    assert configs.for_queue("q").max_items == 500
    assert configs.for_queue("q+fanout").max_items == 500
    assert configs.for_queue("q+fanout").max_age == 60_000
    assert configs.for_queue("other").max_items == QueueConfig().max_items


def test_guide_defaults() -> None:
    cfg = QueueConfig()
    sizes = (cfg.max_memory_size, cfg.default_journal_size, cfg.max_journal_size)
    assert sizes == (128 * MB, 16 * MB, 1024 * MB)
    assert cfg.keep_journal and not cfg.discard_old_when_full and cfg.sync_journal is None


def test_sizes_and_durations_parse() -> None:
    assert parse_size("k", "16MB") == 16 * MB
    assert parse_size("k", "512 KB") == 512 * 1024
    assert parse_size("k", 100) == 100
    assert parse_duration_ms("k", "500ms") == 500
    assert parse_duration_ms("k", "1s") == 1000
    assert QueueConfig.from_mapping({"sync_journal": "10ms"}).sync_journal == 10
    assert QueueConfig.from_mapping({"sync_journal": "always"}).sync_journal == 0
    assert QueueConfig.from_mapping({"sync_journal": "never"}).sync_journal is None


@pytest.mark.parametrize("settings, key", [
    ({"max_size": "lots"}, "queues.q.max_size"),
    ({"max_age": "5"}, "queues.q.max_age"),
    ({"keep_journal": "yes"}, "queues.q.keep_journal"),
    ({"max_itemz": 3}, "queues.q.max_itemz"),
    ({"sync_journal": "sometimes"}, "queues.q.sync_journal"),
])
def test_bad_settings_name_the_key(settings: dict, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        QueueConfigs({}, {"q": settings})
    assert err.value.key == key


def _opened(tmp_path: Path, name: str) -> tuple[QueueCollection, list[int]]:
    coll = make(tmp_path / name)
    coll.put("q", [b"a", b"b", b"c", b"d"])
    return coll, [item.xid for item in coll.remove("q", 4, transaction=True)]


def _journal_bytes(coll: QueueCollection) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(Path(coll.path).glob("q*")))


@pytest.mark.parametrize("many", ["confirm", "unremove"])
def test_closing_reads_in_a_batch_journals_as_one_by_one_in_one_write(tmp_path: Path, many: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    single, xids = _opened(tmp_path, "single")
    batch, batch_xids = _opened(tmp_path, "batch")
    assert xids == batch_xids
    closing = [xids[2], xids[0], 999]  # 999 is not open: skipped, as a single close skips it
    close = getattr(single, many)
    assert [close("q", [xid]) for xid in closing] == [1, 1, 0]
    appends: list[bytes] = []
    write = disk.write
    monkeypatch.setattr(disk, "write", lambda fd, data: (appends.append(data), write(fd, data))[1])
    assert getattr(batch, many)("q", closing) == 2
    assert len(appends) == 1
    assert _journal_bytes(single) == _journal_bytes(batch)
    left = drain(reopen(batch), "q")  # replayed, the reads still open are handed out again
    assert left == drain(reopen(single), "q")
    assert sorted(left) == ([b"b", b"d"] if many == "confirm" else [b"a", b"b", b"c", b"d"])


def _put_on_past_refusals(coll: QueueCollection, name: str, items: list[bytes]) -> list[bool]:
    """Each item's answer when the items are put at once and, after each refusal, the rest again
    (as a pipelined run of memcache sets is put)."""
    answers: list[bool] = []
    while len(answers) < len(items):
        accepted = coll.put(name, items[len(answers):])
        answers += [True] * accepted
        if len(answers) < len(items):
            answers.append(False)
    return answers


@pytest.mark.parametrize("journal_format", ["kestrel2", "kestrel3"])
@pytest.mark.parametrize("limits", [{"max_items": 3}, {"max_size": "300"},
                                    {"max_items": 3, "discard_old_when_full": True}, {"max_items": 0},
                                    {"max_item_size": 150}])
def test_a_put_on_past_each_refusal_answers_as_single_puts(tmp_path: Path, limits: dict,
                                                          journal_format: str) -> None:
    settings = {**limits, "journal_format": journal_format}
    batched, single = make(tmp_path / "batched", {"q": settings}), make(tmp_path / "single", {"q": settings})
    items = [bytes([n]) * (100 if n % 3 else 200) for n in range(6)]
    assert _put_on_past_refusals(batched, "q", items) == [bool(single.put("q", [data])) for data in items]
    assert drain(batched, "q") == drain(single, "q")


@pytest.mark.parametrize("journal_format", ["kestrel2", "kestrel3"])
def test_through_aliases_and_fanouts_a_put_on_past_refusals_answers_as_single_puts(
        tmp_path: Path, journal_format: str) -> None:
    queues = {"small": {"max_item_size": 8}, "full": {"max_items": 2}, "fan": {"max_items": 2},
              "fan+a": {"max_items": 3, "max_item_size": 8}}
    batched, single = (make(tmp_path / name, queues, {"journal_format": journal_format},
                            aliases={"both": ["small", "full"]}) for name in ("batched", "single"))
    for coll in (batched, single):
        coll.queue("fan+a")
    items = [b"tiny", b"far too big", b"ok", b"one", b"two"]
    for name in ("small", "both", "fan"):
        assert _put_on_past_refusals(batched, name, items) == [bool(single.put(name, [data])) for data in items]
    for name in ("small", "full", "fan", "fan+a"):
        assert drain(batched, name) == drain(single, name), name


def test_a_name_not_configured_shares_its_parents_or_the_defaults_settings() -> None:
    configs = QueueConfigs({"max_items": 7}, {"q": {"max_items": 500}})
    assert configs.for_queue("other") is configs.default and configs.for_queue("other").max_items == 7
    assert configs.for_queue("q+new") is configs.for_queue("q")
    assert configs.for_queue("other+new") is configs.default


CHURN = """
import sys, tempfile, tracemalloc
import gevent, structlog
structlog.configure(logger_factory=structlog.ReturnLoggerFactory())
from kestrel.storage import QueueCollection, QueueConfigs
coll = QueueCollection(tempfile.mkdtemp(dir=sys.argv[1]), QueueConfigs({}, {"q": {"max_items": 5}}))
coll.load()

def churn(first, count):
    for n in range(first, first + count):
        name = f"job-{n:08d}" if n % 2 else f"q+job-{n:08d}"
        coll.put(name, [b"x"])
        coll.delete(name)
        gevent.sleep(0)  # the loop turns, as a server's does

churn(0, 500)  # what the first names make for good
ours = [tracemalloc.Filter(True, "*/kestrel/*"), tracemalloc.Filter(True, "<string>")]
tracemalloc.start()
before = tracemalloc.take_snapshot().filter_traces(ours)
churn(500, 4000)
after = tracemalloc.take_snapshot().filter_traces(ours)
print(sum(stat.size_diff for stat in after.compare_to(before, "filename")))
"""


def test_queues_made_and_deleted_leave_nothing_behind(tmp_path: Path) -> None:
    """Clients naming a new queue for each job: every name made and deleted. The server kept each
    name's settings for good (about 100 bytes a name, a million names 100 MB). Measured in a
    process of its own, whose loop runs what a delete leaves to do (this one's keeps its tasks)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", CHURN, str(tmp_path)], capture_output=True, text=True,
                          timeout=300, check=True)
    grown = int(done.stdout.split()[-1])
    assert grown < 4000 * 20, f"{grown} bytes more after 4,000 queues made and deleted"
