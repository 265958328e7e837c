"""What creates a queue, and what a created queue leaves on disk (as Kestrel's QueueCollection)."""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import gevent
import pytest

from kestrel.storage import QueueCollection, manifest
from kestrel.storage.collection import FLUSH_PACE
from kestrel.storage.config import QueueConfigs
from kestrel.storage.errors import ConfigError, JournalWriteError
from kestrel.storage.queue import PersistentQueue
from kestrel.storage.runtime import PACE, ManualRuntime, Runtime, ThreadsRuntime
from tests.support.descriptors import descriptors
from tests.support.power_loss import Disk
from tests.support.queues import drain, manifest_path, open_collection, reopen
from tests.support.slow_disk import HeldFileWrites, slow_fdatasyncs, slow_fsyncs, until_begun

FORMATS = ["kestrel2", "kestrel3"]


def _collection(path: Path, fmt: str) -> QueueCollection:
    return open_collection(path, {"journal_format": fmt})


@pytest.mark.parametrize("fmt", FORMATS)
def test_operations_that_only_read_or_destroy_create_no_queue(tmp_path: Path, fmt: str) -> None:
    coll = _collection(tmp_path, fmt)
    coll.flush("ghost")
    coll.flush_all()
    coll.delete("ghost")
    assert not coll.confirm("ghost", [1]) and not coll.unremove("ghost", [1])
    assert coll.confirm("ghost", [1]) == 0 and coll.unremove("ghost", [1]) == 0
    assert coll.get("ghost") is None and coll.queue_names() == [] and coll.queue_creates == 0
    assert os.listdir(tmp_path) == []
    coll.close()


def test_flush_all_lets_other_tasks_in_once_it_has_dropped_many_items(tmp_path: Path) -> None:
    """12 million items in 2,000 queues held the loop for 1.6 s: the others are let in between
    queues after each FLUSH_PACE items dropped, and a queue deleted meanwhile is passed over."""
    coll = _collection(tmp_path, "kestrel2")
    for name in ("a", "b", "c"):
        coll.put(name, [b"x"] * (FLUSH_PACE * 6 // 10))
    let_in: list[dict[str, int]] = []

    def between() -> None:
        let_in.append({q.name: q.length for q in coll.queues()})
        coll.delete("c")

    gevent.spawn(between)
    coll.flush_all()
    assert let_in == [{"a": 0, "b": 0, "c": FLUSH_PACE * 6 // 10}]  # after a and b
    assert coll.queue_names() == ["a", "b"]
    coll.close()


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_queue_created_and_left_empty_survives_a_restart(tmp_path: Path, fmt: str) -> None:
    coll = _collection(tmp_path, fmt)
    coll.queue("empty")
    assert os.listdir(tmp_path)  # its journal file exists at once, as Kestrel's setup creates it
    again = reopen(coll)
    assert again.queue_names() == ["empty"] and again.get("empty") is not None
    again.close()


@pytest.mark.parametrize("fmt, created", [("kestrel2", ["jobs+audit"]), ("kestrel3", ["jobs", "jobs+audit"])])
def test_a_fanout_child_created_and_left_empty_survives_a_restart(tmp_path: Path, fmt: str,
                                                                   created: list[str]) -> None:
    """A Kestrel 2 child stands alone, as Kestrel's does (naming `parent+child` created `parent` too,
    and for an alias `parent` a queue file the alias hid); a Kestrel 3 child is a reader of its
    parent's journal, so the parent comes with it."""
    coll = _collection(tmp_path, fmt)
    coll.queue("jobs+audit")
    assert coll.queue_names() == created and coll.queue_creates == len(created)
    again = reopen(coll)
    assert again.queue_names() == created
    assert again.put("jobs", [b"a"]) == 1 and again.remove("jobs+audit") != []  # the parent feeds it
    again.close()


def test_a_kestrel_3_child_on_disk_loads_when_an_alias_now_hides_its_parent(tmp_path: Path) -> None:
    """A new child of an alias is refused (it would read a journal nobody writes); one on disk from
    before the alias loads, masked with its parent, where its refusal ended the whole start."""
    coll = _collection(tmp_path, "kestrel3")
    coll.queue("p+c")
    coll.put("p", [b"kept"])
    coll.put("other", [b"serves"])
    coll.close()
    again = QueueCollection(coll.path, coll.configs, {"p": ["x"]}, coll.clock)
    again.load()
    assert "p+c" in again.queue_names() and again.refused == {}
    assert [i.data for i in again.remove("other")] == [b"serves"]
    assert [i.data for i in again.remove("p+c")] == [b"kept"]
    again.close()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", ["jobs", "jobs+audit"])
def test_a_queue_named_by_many_clients_at_once_is_created_once(tmp_path: Path, fmt: str, name: str) -> None:
    """Creating a queue may wait (a Kestrel 3 queue's first writer file is fsynced under `always`);
    the clients naming it meanwhile wait for that queue rather than create a second one beside it
    (two Kestrel 3 writers of one queue gave the same ids twice, and the next start refused it)."""
    coll = open_collection(tmp_path, {"journal_format": fmt, "sync_journal": "always"})

    def put(who: int) -> PersistentQueue:
        coll.put(name, [b"%d-%d" % (who, i) for i in range(3)])
        return coll.queue(name)

    puts = [gevent.spawn(partial(put, who)) for who in range(4)]
    gevent.joinall(puts, raise_error=True)
    assert len({id(p.value) for p in puts}) == 1 and coll.queue_creates == 1 + ("+" in name and fmt == "kestrel3")
    again = reopen(coll)
    assert again.refused == {}
    assert sorted(drain(again, name)) == sorted(b"%d-%d" % (who, i) for who in range(4) for i in range(3))
    again.close()


# How a queue was used before its delete: its settings and the server's memory budget. Each puts it
# where the collection's background work keeps queues: the governor's changed queues (at ease), its
# records, shares and paging candidates (engaged: the budget is tight and the queue in read-behind),
# the expiry schedule (items with a `max_age`), a waiting reader.
USES = {
    "at ease": ({}, 1 << 30),
    "engaged, in read-behind": ({"max_memory_size": "1k"}, 8_000),
    "expiring": ({"max_age": "1h"}, 1 << 30),
    "waited on": ({}, 1 << 30),
}


def of_collection(o: object, path: str) -> bool:
    """Whether `o` is an object of the engine's with its files under `path` (a queue, its journal,
    file or cursor: what a cycle of a deleted queue's objects would hold). The garbage of another
    test's objects is left out: the rest of a test process runs meanwhile (its background work still
    on the hub, a commit log's tick of a collection left open, drops cycles of its own whenever this
    test yields)."""
    return type(o).__module__.startswith("kestrel") and any(
        isinstance(value := getattr(o, name, None), str) and value.startswith(path)
        for name in ("queue_path", "path"))


@contextlib.contextmanager
def freed_by_reference_counting(coll: QueueCollection, name: str) -> Iterator[None]:
    """Asserts that, once the block has run, no queue `name` of the collection is alive and none of
    its objects was left for the garbage collector (which a frozen object never meets again)."""
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds unreachable is kept in gc.garbage
    try:
        yield
        alive = [o for o in gc.get_objects()  # this collection's: another test's may be alive still
                 if isinstance(o, PersistentQueue) and o.queue_path == coll.path and o.name == name]
        gc.collect()
        left = [type(o).__qualname__ for o in gc.garbage if of_collection(o, coll.path)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert alive == [], "a deleted queue is still referred to"
    assert left == [], "a deleted queue's objects were freed only by the garbage collector"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("use", USES)
def test_a_deleted_queue_is_freed_at_its_delete_by_reference_counting_alone(
        tmp_path: Path, fmt: str, use: str) -> None:
    """The server freezes the objects of the queues it loaded (src/kestrel/service/gc_pauses.py),
    and the garbage collector never looks at a frozen object again: a queue deleted later must leave
    no reference cycle behind, or its objects would never be freed. Nor may anything hold it until a
    later tick, sweep or timeout: it is freed when its delete returns (docs/queue-lifetime.md), with
    no tick, no sweep and no collection in between."""
    settings, budget = USES[use]
    runtime = ManualRuntime()
    coll = open_collection(tmp_path, {"journal_format": fmt, **settings}, runtime=runtime,
                           max_memory_total=budget)
    assert coll.governor is not None  # the server's
    coll.governor.start()
    coll.put("warm", [b"x"])
    coll.delete("warm")  # what the first queue makes once for all (caches, the governor's lists)
    with freed_by_reference_counting(coll, "gone"):
        if use == "waited on":
            coll.queue("gone")
            waiting = gevent.spawn(partial(coll.remove, "gone", 1, timeout=60.0))
            gevent.sleep(0)  # it waits for an item
        else:
            coll.put("gone", [b"%04d" % n * 25 for n in range(40)])
            coll.put("kept", [b"%04d" % n * 25 for n in range(20)])
            runtime.advance(1000)  # the governor's ticks look at both queues
            read = coll.remove("gone", 1, transaction=True)
            assert read
            coll.unremove("gone", [read[0].xid])
            runtime.advance(1000)
            gone = coll.queue("gone")
            assert gone.in_read_behind == (use == "engaged, in read-behind")
            assert gone.may_expire == (use == "expiring")
            del gone, read
        coll.delete("gone")
        if use == "waited on":
            gevent.sleep(0)  # the reader, woken by the delete, answers empty-handed
            assert waiting.ready() and waiting.value == []
            del waiting
    coll.close()


def test_a_kestrel2_queue_deleted_while_its_first_manifest_is_written_is_freed_at_its_delete(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rotation refused while the queue's first manifest is written ahead leaves its journal
    holding the queue's call until that write ends (the queue decides again then). A delete meanwhile
    waits for the write, rotates nothing after it, and the queue is freed at its delete by reference
    counting alone, as any other (docs/queue-lifetime.md)."""
    coll = open_collection(tmp_path, {"default_journal_size": 4096, "max_memory_size": 1 << 20})
    items = [b"%04d" % n * 25 for n in range(60)]
    with HeldFileWrites(monkeypatch, "gone~~manifest") as manifest_write:
        assert coll.put("gone", items) == 60  # past half way to its rotation: the manifest written ahead
        until_begun(manifest_write.started)
        assert len(coll.remove("gone", 60)) == 60  # emptied: due to rotate and pack, refused for now
        with freed_by_reference_counting(coll, "gone"):
            deleting = gevent.spawn(partial(coll.delete, "gone"))
            gevent.sleep(0)  # into its close's wait for the manifest
            assert not deleting.ready()
            manifest_write.release()
            deleting.get(timeout=60)
    assert [n for n in os.listdir(tmp_path) if n.startswith("gone")] == []
    assert not manifest_path(tmp_path, "gone").exists()
    coll.close()


@pytest.mark.parametrize("fmt, setting, before, after", [("kestrel2", "keep_journal", False, True),
                                                         ("kestrel3", "fanout_only", False, True)])
def test_a_reload_names_the_queue_settings_it_leaves_until_a_restart(tmp_path: Path, fmt: str, setting: str,
                                                                     before: bool, after: bool) -> None:
    """A queue keeps what it took at its creation (a journal, or none): a reload that changes it
    says so, where it was silent and an operator turning a journal on went on losing items at a crash."""
    from structlog.testing import capture_logs

    from kestrel.storage import QueueConfigs

    coll = open_collection(tmp_path, {"journal_format": fmt}, {"q": {setting: before}})
    coll.put("q", [b"x"])
    coll.put("other", [b"y"])
    with capture_logs() as logs:
        coll.reload(QueueConfigs({"journal_format": fmt}, {"q": {setting: after}, "other": {"max_items": 5}}), {})
    assert getattr(coll.queue("q").config, setting) is before
    assert coll.queue("other").config.max_items == 5  # the rest of the reload applied
    kept = [e for e in logs if e["event"].startswith("reload ignored")]
    assert [e["queues"] for e in kept] == [{"q": [setting]}] and kept[0]["log_level"] == "warning"
    coll.close()
    coll = open_collection(tmp_path, {"journal_format": fmt}, {"q": {setting: after}})
    assert getattr(coll.queue("q").config, setting) is after  # a restart applies it
    coll.close()


def test_a_restart_turning_keep_journal_off_says_its_journal_s_items_are_not_served(tmp_path: Path) -> None:
    """Started without a journal, a queue whose journal files are on disk held none of their items
    and said nothing; they stay on disk, served again once a restart sets `keep_journal`."""
    from structlog.testing import capture_logs

    coll = open_collection(tmp_path, {"journal_format": "kestrel2"}, {"q": {"keep_journal": True}})
    coll.put("q", [b"x", b"y"])
    coll.close()
    with capture_logs() as logs:
        coll = open_collection(tmp_path, {"journal_format": "kestrel2"}, {"q": {"keep_journal": False}})
    assert coll.queue("q").length == 0
    said = [e for e in logs if e["event"].startswith("queue keeps no journal")]
    assert [(e["queue"], e["log_level"]) for e in said] == [("q", "warning")] and said[0]["files"] >= 1
    coll.close()
    coll = open_collection(tmp_path, {"journal_format": "kestrel2"}, {"q": {"keep_journal": True}})
    assert [item.data for item in coll.remove("q", 10)] == [b"x", b"y"]
    coll.close()


@pytest.mark.parametrize("fmt", ["kestrel2", "kestrel3"])
def test_a_reload_turning_fanout_only_off_leaves_no_acknowledged_item_to_a_restart(tmp_path: Path,
                                                                                   fmt: str) -> None:
    """A Kestrel 2 fanout-only parent keeps no journal, from its creation: a reload turning
    `fanout_only` off made it hold the items put to it in memory alone, each acknowledged and lost
    at the next restart, clean or not. In either format the parent keeps `fanout_only` until a
    restart, and the warning names it."""
    from structlog.testing import capture_logs

    from kestrel.storage import QueueConfigs

    coll = open_collection(tmp_path, {"journal_format": fmt}, {"p": {"fanout_only": True}})
    coll.queue("p+c")
    coll.put("p", [b"w"])
    with capture_logs() as logs:
        coll.reload(QueueConfigs({"journal_format": fmt}, {"p": {"fanout_only": False}}), {})
    kept = [e["queues"]["p"] for e in logs if e["event"].startswith("reload ignored")]
    assert len(kept) == 1 and "fanout_only" in kept[0]
    coll.put("p", [b"x", b"y"])
    held = {name: coll.queue(name).length for name in ("p", "p+c")}
    coll.close()
    coll = open_collection(tmp_path, {"journal_format": fmt}, {"p": {"fanout_only": False}})
    assert {name: coll.queue(name).length for name in ("p", "p+c")} == held == {"p": 0, "p+c": 3}
    coll.close()


@pytest.mark.parametrize("fmt", ["kestrel2", "kestrel3"])
def test_a_reload_changing_a_parent_s_fanout_only_leaves_its_children_sharing_its_settings(
        tmp_path: Path, fmt: str) -> None:
    """A child takes its parent's settings and is never fanout-only: a reload turning the parent
    fanout-only named each child among the queues keeping a changed setting until a restart, and gave
    each a copy of the settings of its own, held apart from its parent's later reloads."""
    from structlog.testing import capture_logs

    from kestrel.storage import QueueConfigs

    coll = open_collection(tmp_path, {"journal_format": fmt}, {"p": {"max_items": 10}})
    coll.queue("p")
    coll.queue("p+c")
    with capture_logs() as logs:
        coll.reload(QueueConfigs({"journal_format": fmt}, {"p": {"max_items": 10, "fanout_only": True}}), {})
    assert [e["queues"] for e in logs if e["event"].startswith("reload ignored")] == [{"p": ["fanout_only"]}]
    assert coll.queue("p+c").config is coll.configs.for_queue("p+c")
    # What a reload changed, and `dump_config`, say what applies: the child was said to have turned
    # fanout-only (false to true) and listed so, though it stores every item.
    assert [e["queues"] for e in logs if e["event"] == "reload changed queue settings"] == []
    assert coll.queue("p+c").settings()["fanout_only"] is coll.queue("p").settings()["fanout_only"] is False
    coll.put("p", [b"x"])
    assert (coll.queue("p").length, coll.queue("p+c").length) == (1, 1)  # the parent keeps it until a restart
    coll.close()


@pytest.mark.parametrize("fmt", ["kestrel2", "kestrel3"])
def test_a_parent_made_fanout_only_by_a_restart_serves_what_it_held_and_stores_no_put(tmp_path: Path,
                                                                                     fmt: str) -> None:
    """As Kestrel's: a fanout-only parent stores no put, and serves the items it held before, which
    the start names in a warning. It served none and said nothing; Kestrel 3 then served them, once
    `fanout_only` was off again, with every put made meanwhile."""
    from structlog.testing import capture_logs

    plain, fanout_only = {"journal_format": fmt}, {"p": {"fanout_only": True}}
    coll = open_collection(tmp_path, plain)
    coll.put("p", [b"a", b"b", b"c"])
    coll.close()
    with capture_logs() as logs:
        coll = open_collection(tmp_path, plain, fanout_only)
    warned = [(e["queue"], e["items"], e["log_level"]) for e in logs if e["event"].startswith("fanout-only queue")]
    assert warned == [("p", 3, "warning")]
    coll.queue("p+c")
    assert coll.put("p", [b"new"]) == 1
    assert [item.data for item in coll.remove("p")] == [b"a"]
    coll.close()
    coll = open_collection(tmp_path, plain)
    assert drain(coll, "p") == [b"b", b"c"] and drain(coll, "p+c") == [b"new"]
    coll.put("p", [b"d"])
    coll.close()
    coll = open_collection(tmp_path, plain, fanout_only)
    assert drain(coll, "p") == [b"d"]  # drained: the next start finds it holding nothing
    coll.close()
    with capture_logs() as logs:
        coll = open_collection(tmp_path, plain, fanout_only)
    assert not [e for e in logs if e["event"].startswith("fanout-only queue holds")]
    if fmt == "kestrel3":  # a reader that held nothing would take each put's ids, and hold files back
        assert coll.queue("p").checkpoint_path is None and "p.read." not in os.listdir(tmp_path)
    coll.put("p", [b"later"])
    coll.close()
    coll = open_collection(tmp_path, plain)
    assert drain(coll, "p") == [] and drain(coll, "p+c") == [b"d", b"later"]
    coll.close()


@pytest.mark.parametrize("fmt", ["kestrel2", "kestrel3"])
def test_after_a_reload_the_queues_of_no_settings_of_their_own_share_the_default_s_one_object(
        tmp_path: Path, fmt: str) -> None:
    """As at their creation (`QueueConfig.from_mapping`): every put and get reads it, and a reload
    gave each queue a copy of its own, made on the event loop, 10,000 of them for 10,000 queues."""
    from kestrel.storage import QueueConfigs

    coll = open_collection(tmp_path, {"journal_format": fmt}, {"own": {"max_items": 3}})
    for name in ("a", "b", "own"):
        coll.put(name, [b"x"])
    assert coll.queue("a").config is coll.queue("b").config
    coll.reload(QueueConfigs({"journal_format": fmt, "max_items": 5}, {"own": {"max_items": 4}}), {})
    assert coll.queue("a").config is coll.queue("b").config is coll.configs.default
    assert coll.queue("a").config.max_items == 5 and coll.queue("own").config.max_items == 4
    coll.close()


def test_a_reload_logs_each_change_it_makes_naming_the_queues_and_the_keys(tmp_path: Path) -> None:
    """A file cut short resets the queues it no longer names to the defaults (`sync_journal: always`
    to `never`): each change a reload makes gets one line naming the keys, before and after, and the
    queues it made it to (a changed default many queues inherit is one line, the first
    LOGGED_NAMES of them named, with their count); a queue it leaves as it was, none."""
    from structlog.testing import capture_logs

    from kestrel.storage import QueueConfigs
    from kestrel.storage.collection import LOGGED_NAMES

    coll = open_collection(tmp_path, {}, {"jobs": {"sync_journal": "always", "max_items": 5}, "mail": {"max_items": 3}})
    for name in ("jobs", "mail", "other"):
        coll.put(name, [b"x"])
    try:
        with capture_logs() as logs:
            coll.reload(QueueConfigs({}, {"mail": {"max_items": 3}}), {})
        changed = [e for e in logs if e["event"] == "reload changed queue settings"]
        assert [(e["queues"], e["count"], e["keys"], e["was"], e["now"]) for e in changed] == [
            (["jobs"], 1, ["max_items", "sync_journal"], {"max_items": 5, "sync_journal": "always"},
             {"max_items": 2**63 - 1, "sync_journal": "never"})]
        assert changed[0]["log_level"] == "info"
        with capture_logs() as logs:
            coll.reload(QueueConfigs({"max_age": "1h"}, {"mail": {"max_items": 3}}), {})
        changed = [e for e in logs if e["event"] == "reload changed queue settings"]
        assert [(sorted(e["queues"]), e["count"], e["keys"]) for e in changed] == [
            (["jobs", "mail", "other"], 3, ["max_age"])]
        with capture_logs() as logs:
            coll.reload(QueueConfigs({"max_age": "1h"}, {"mail": {"max_items": 3}}), {})
        assert not [e for e in logs if e["event"] == "reload changed queue settings"]
        many = [f"q{i:03}" for i in range(LOGGED_NAMES + 20)]
        for name in many:
            coll.put(name, [b"x"])
        with capture_logs() as logs:
            coll.reload(QueueConfigs({"max_age": "2h"}, {"mail": {"max_items": 3}}), {})
        changed = [e for e in logs if e["event"] == "reload changed queue settings"]
        assert len(changed) == 1 and changed[0]["count"] == len(many) + 3
        assert len(changed[0]["queues"]) == LOGGED_NAMES
    finally:
        coll.close()


def _paced_queues(tmp_path: Path) -> tuple[QueueCollection, list[str]]:
    """A collection under gevent holding three slices of queues (`runtime.PACE` each) and one more."""
    coll = open_collection(tmp_path)
    names = [f"q{i:05}" for i in range(3 * PACE + 1)]
    for name in names:  # made empty: no file is written before a queue's first change
        coll.queue(name)
    return coll, names


def test_a_reload_over_many_queues_lets_the_other_tasks_in_between_slices(tmp_path: Path) -> None:
    """A new default 10,000 queues inherit was applied in one walk that held every client (a quarter
    of a second on a slow machine); the walk now pauses every `PACE` queues, and each queue still
    ends with the new settings."""
    coll, names = _paced_queues(tmp_path)
    turns = 0

    def other_task() -> None:
        nonlocal turns
        while True:
            gevent.sleep(0)
            turns += 1

    task = gevent.spawn(other_task)
    try:
        coll.reload(QueueConfigs({"max_items": 7}, {}), {})  # this greenlet never yields but to pause
        assert turns >= 3
        assert {coll.queue(name).config.max_items for name in names} == {7}
    finally:
        task.kill()
        coll.close()


def test_a_queue_deleted_while_a_reload_pauses_is_passed_over_and_one_made_again_has_its_settings(
        tmp_path: Path) -> None:
    coll, names = _paced_queues(tmp_path)
    late = names[2 * PACE]  # in the walk's third slice
    gone = coll.queue(late)
    before = gone.config

    def delete_then_make_again() -> None:
        coll.delete(late)
        coll.put(late, [b"x"])

    task = gevent.spawn(delete_then_make_again)  # runs at the walk's first pause
    try:
        coll.reload(QueueConfigs({"max_items": 7}, {}), {})
        task.join()
        assert gone.config is before  # the deleted queue was not reconfigured
        again = coll.queue(late)
        assert again is not gone and again.config.max_items == 7 and again.length == 1
    finally:
        coll.close()


def test_a_queue_made_while_a_reload_looks_at_the_formats_is_looked_at_too(tmp_path: Path) -> None:
    """The look at every queue's format pauses too; a queue made meanwhile, in the settings still in
    force, in a format the new ones would change, refuses the reload as a queue made before it does
    (accepted, the next start refused its files)."""
    coll, _ = _paced_queues(tmp_path)
    before = coll.configs
    task = gevent.spawn(partial(coll.put, "late", [b"x"]))  # made at the look's first pause
    try:
        with pytest.raises(ConfigError, match="queue 'late' has Kestrel 2 journal files"):
            coll.reload(QueueConfigs({}, {"late": {"journal_format": "kestrel3"}}), {})
        task.join()
        assert coll.configs is before
        late = coll.get("late")
        assert late is not None and late.journal_format == 2
    finally:
        coll.close()


def test_a_reload_asked_for_while_one_pauses_begins_once_it_has_ended(tmp_path: Path) -> None:
    """Two reloads' walks, interleaved, would each log the other's changes as its own."""
    from structlog.testing import capture_logs

    coll, names = _paced_queues(tmp_path)
    try:
        with capture_logs() as logs:
            first = gevent.spawn(partial(coll.reload, QueueConfigs({"max_items": 7}, {}), {}))
            second = gevent.spawn_later(0, partial(coll.reload, QueueConfigs({"max_items": 9}, {}), {}))
            gevent.joinall([first, second], raise_error=True)
        ends = [(e["event"], e.get("now")) for e in logs
                if e["event"] in ("reload changed queue settings", "queue settings reloaded")]
        assert ends == [("reload changed queue settings", {"max_items": 7}), ("queue settings reloaded", None),
                        ("reload changed queue settings", {"max_items": 9}), ("queue settings reloaded", None)]
        changed = [e for e in logs if e["event"] == "reload changed queue settings"]
        assert [e["count"] for e in changed] == [len(names), len(names)]
        assert {coll.queue(name).config.max_items for name in names} == {9}
    finally:
        coll.close()


def test_a_queue_an_alias_hides_is_named_at_the_reload_and_at_the_start(tmp_path: Path) -> None:
    """A get of an alias's name reads the alias (no item, as Kestrel answers), so the items of a queue
    on disk under that name cannot be read while the alias exists: the log says so, where it was
    silent and the queue's items seemed lost."""
    from structlog.testing import capture_logs

    coll = open_collection(tmp_path)
    coll.put("jobs", [b"j1", b"j2"])
    with capture_logs() as logs:
        coll.reload(QueueConfigs(), {"jobs": ["other"]})
    assert coll.remove("jobs") == []
    masked = [e for e in logs if e["event"].startswith("queue name(s) masked by alias(es)")]
    assert [(e["queues"], e["log_level"]) for e in masked] == [({"jobs": 2}, "warning")]
    coll.close()
    with capture_logs() as logs:
        coll = QueueCollection(str(tmp_path), QueueConfigs(), aliases={"jobs": ["other"]})
        coll.load()
    assert [e["queues"] for e in logs if e["event"].startswith("queue name(s) masked")] == [{"jobs": 2}]
    coll.close()
    coll = open_collection(tmp_path)  # the alias gone: every item served
    assert drain(coll, "jobs") == [b"j1", b"j2"]
    coll.close()


def test_an_alias_a_reload_no_longer_names_is_gone_once_it_applies(tmp_path: Path) -> None:
    """The file is what is served: Kestrel 2.4 kept an alias removed from its file until the next
    start (its reload adds and updates aliases, never removes one), so puts went on being copied to
    destinations the file no longer named and the queue under that name stayed masked."""
    coll = open_collection(tmp_path)
    coll.put("jobs", [b"j1"])
    coll.reload(QueueConfigs(), {"jobs": ["other"]})
    assert coll.put("jobs", [b"copied"]) and coll.remove("jobs") == []
    coll.reload(QueueConfigs(), {})
    assert not coll.aliases
    assert coll.put("jobs", [b"j2"])
    assert drain(coll, "jobs") == [b"j1", b"j2"]  # unmasked at once, and the put went to the queue
    assert drain(coll, "other") == [b"copied"]
    coll.close()


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_queue_whose_creation_failed_on_the_disk_is_created_again_from_what_it_left(
        tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An fsync error (EIO) failing a creation may leave files behind (a Kestrel 3 writer file,
    made before the manifest's fsync failed): the next creation reads them rather than start new
    ones beside them, which the next start refused as an older writer file the manifest does not
    list."""
    coll = _collection(tmp_path, fmt)
    coll.queue("other")

    def failing(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing)
    with contextlib.suppress(JournalWriteError):  # (Kestrel 2 creates its journal without an fsync)
        coll.put("fresh", [b"one"])
    monkeypatch.undo()
    time.sleep(0.002)  # a later millisecond: a new writer file would have a name of its own
    assert coll.put("fresh", [b"two"]) == 1
    again = reopen(coll)
    assert again.refused == {} and drain(again, "fresh")[-1:] == [b"two"]
    again.close()


def _open_in(path: Path) -> set[str]:
    """The files under `path` this process holds a descriptor of."""
    return {name for name in descriptors(os.getpid()).values() if name.startswith(str(path))}


@pytest.mark.parametrize("sync, failing", [("never", ""), ("always", ""), ("always", "~~manifest")],
                         ids=["manifest", "writer-file", "manifest-after-writer-file"])
def test_a_kestrel3_creation_the_disk_fails_holds_no_descriptor_and_its_retry_takes_up_its_files(
        tmp_path: Path, sync: str, failing: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A creation whose first writer file was made but whose manifest could not be written (an fsync
    error, EIO) kept that file's descriptor open, and the retry warned of NO MANIFEST as for files no
    manifest vouches for. Now nothing is held open, and the retry takes up the files the first try
    left, which hold no item (it acknowledged nothing), as its own: no warning, then or at a restart."""
    from structlog.testing import capture_logs

    coll = open_collection(tmp_path, {"journal_format": "kestrel3", "sync_journal": sync})
    coll.put("other", [b"kept"])
    before = _open_in(tmp_path)
    real = os.fsync

    def fsync(fd: int) -> None:
        if failing in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EIO, "Input/output error")
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(JournalWriteError, match="'fresh'.*Input/output error"):
        coll.put("fresh", [b"one"])
    monkeypatch.undo()
    assert _open_in(tmp_path) == before
    assert any(name.startswith("fresh.") for name in os.listdir(tmp_path))  # its writer file stays
    time.sleep(0.002)  # a later millisecond: a new writer file would have a name of its own
    with capture_logs() as logs:
        assert coll.put("fresh", [b"two"]) == 1
    assert [e["event"] for e in logs if e["log_level"] in ("warning", "error")] == []
    assert [e["files"] for e in logs if e["event"].startswith("taking up the files a failed creation")]
    coll.close()
    with capture_logs() as logs:
        again = open_collection(tmp_path, {"journal_format": "kestrel3", "sync_journal": sync})
    assert [e["event"] for e in logs if e["log_level"] in ("warning", "error")] == []
    assert again.refused == {} and drain(again, "fresh") == [b"two"] and drain(again, "other") == [b"kept"]
    again.close()


@pytest.mark.parametrize("fmt, sync", [("kestrel2", "always"), ("kestrel3", "never"), ("kestrel3", "always")])
def test_a_creation_the_disk_fails_says_which_queue_and_why(
        tmp_path: Path, fmt: str, sync: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An fsync error (EIO) failing a new queue's files is a journal write that failed, named as
    every other is (the queue, the system's reason), not an OSError the protocols answer as an
    internal error; nothing is created, and the next reference tries again."""
    coll = open_collection(tmp_path, {"journal_format": fmt, "sync_journal": sync})

    def failing(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing)
    with pytest.raises(JournalWriteError, match="queue 'fresh' .*: Input/output error") as err:
        coll.put("fresh", [b"one"])
    assert err.value.queue == "fresh" and not err.value.disk_full
    assert coll.get("fresh") is None and coll.queue_creates == 0
    monkeypatch.undo()
    assert coll.put("fresh", [b"two"]) == 1
    assert drain(coll, "fresh") == [b"two"]
    coll.close()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("runtime", [ThreadsRuntime, ManualRuntime])
def test_a_close_fsyncs_the_queues_side_by_side(tmp_path: Path, fmt: str, runtime: type[Runtime],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A stop waits for about one fsync, not one a queue: every queue's final fsync is in flight at
    once (a thread each, or the runtime's pool), and what they made durable is all there after."""
    coll = open_collection(tmp_path, {"journal_format": fmt}, runtime=runtime())
    names = [f"q{i}" for i in range(4)]
    for name in names:
        coll.put(name, [name.encode()])
    real, guard, inside, peak = os.fdatasync, threading.Lock(), [0], [0]

    def slow(fd: int) -> None:
        with guard:
            inside[0] += 1
            peak[0] = max(peak[0], inside[0])
        time.sleep(0.5)
        with guard:
            inside[0] -= 1
        real(fd)

    monkeypatch.setattr(os, "fdatasync", slow)
    coll.close()
    monkeypatch.undo()
    assert peak[0] == len(names)
    again = open_collection(tmp_path, {"journal_format": fmt})
    assert {name: drain(again, name) for name in names} == {name: [name.encode()] for name in names}
    again.close()


def test_a_close_that_fails_closes_every_other_queue_and_keeps_the_first_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One queue whose final fsync fails stops no other queue's close; the close raises its error."""
    coll = open_collection(tmp_path, runtime=ManualRuntime())
    for name in ("a", "b", "c"):
        coll.put(name, [b"x"])
    real = os.fdatasync

    def failing(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith("/b"):
            raise OSError(errno.EIO, "Input/output error")
        real(fd)

    monkeypatch.setattr(os, "fdatasync", failing)
    with pytest.raises(OSError, match="Input/output error"):
        coll.close()
    assert [q.closed for q in (coll.get("a"), coll.get("c"))] == [True, True]


@pytest.mark.parametrize("fmt, sync, name", [("kestrel2", "always", "fresh"), ("kestrel3", "never", "fresh"),
                                             ("kestrel3", "always", "fresh"), ("kestrel3", "never", "jobs+audit")])
def test_a_creation_waits_for_its_fsyncs_off_the_loop_and_is_made_once(
        tmp_path: Path, fmt: str, sync: str, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A new queue's fsyncs (its journal's folder; a Kestrel 3 queue's first file, manifest and
    checkpoint) run on the runtime's pool: the creating call waits for them while every other task
    runs on, and a second call naming the queue meanwhile waits for that one creation."""
    coll = open_collection(tmp_path, {"journal_format": fmt, "sync_journal": sync})
    coll.put("jobs", [b"parent"])  # (a child reads the journal of a parent already serving)
    fsynced_in = slow_fsyncs(monkeypatch, 0.4)
    turns = 0
    creating = [gevent.spawn(partial(coll.put, name, [b"x"])) for _ in range(2)]
    while not all(g.ready() for g in creating):
        gevent.sleep(0.01)
        turns += 1
    monkeypatch.undo()
    assert [g.get() for g in creating] == [1, 1]
    # It waited for its fsyncs, the loop turning meanwhile, and none of them ran on the loop's thread.
    assert fsynced_in and turns > 1 and threading.get_ident() not in fsynced_in
    assert coll.queue_creates == 2 and drain(coll, name) == [b"x", b"x"]
    again = reopen(coll)
    assert again.refused == {} and name in again.queue_names()
    again.close()


@pytest.mark.parametrize("fmt, name", [("kestrel2", "jobs"), ("kestrel3", "jobs"), ("kestrel3", "jobs+audit")])
def test_a_delete_removes_its_files_off_the_loop(tmp_path: Path, fmt: str, name: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A delete's fsyncs (its manifest's write or removal, their folder's; a Kestrel 3 reader's
    checkpoint leaving the manifest) run on the runtime's pool: the deleting call waits for them
    while every other task runs on. A Kestrel 2 queue that rotated has a manifest to remove."""
    coll = open_collection(tmp_path, {"journal_format": fmt, "default_journal_size": 200, "max_memory_size": 100})
    coll.queue(name)  # a Kestrel 3 child reads its parent's files: they stay
    for _ in range(20):
        coll.put("jobs", [b"x" * 50])
    coll.get("jobs").wait_for_packing()
    assert manifest_path(tmp_path, "jobs").exists()
    fsynced_in = slow_fsyncs(monkeypatch, 0.2)
    deleting = gevent.spawn(partial(coll.delete, name))
    turns = 0
    while not deleting.ready():
        gevent.sleep(0.01)
        turns += 1
    monkeypatch.undo()
    deleting.get()
    assert fsynced_in and turns > 1 and threading.get_ident() not in fsynced_in
    again = reopen(coll)
    assert again.refused == {} and again.queue_names() == ([] if name == "jobs" else ["jobs"])
    again.close()


@pytest.mark.parametrize("fmt, name", [("kestrel2", "d"), ("kestrel2", "q+d"), ("kestrel3", "d"),
                                       ("kestrel3", "q+d")])
def test_a_deleted_queue_or_fanout_reader_stays_deleted_after_a_power_cut(tmp_path: Path, fmt: str,
                                                                         name: str) -> None:
    """A delete's unlinks are made durable (their folder fsynced) before it returns: undone by a
    power cut, they brought the queue, or the Kestrel 3 reader, back at the next start."""
    configs = {"journal_format": fmt, "sync_journal": "always"}
    with Disk(tmp_path) as disk:
        coll = open_collection(tmp_path, configs, runtime=ManualRuntime())
        coll.put("q", [b"kept"])
        coll.put(name, [b"deleted"])
        coll.delete(name)
        disk.power_cut(str(tmp_path))
    again = open_collection(tmp_path, configs, runtime=ManualRuntime())
    assert again.queue_names() == ["q"] and drain(again, "q") == [b"kept"]
    again.close()


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_queue_named_while_its_delete_waits_is_created_anew_after_it(
        tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A delete waits for its queue's final fsync before removing the files: a put naming the queue
    meanwhile waits for the delete, then creates it from nothing, rather than take up the files the
    delete then removed under it (its item lost, a Kestrel 3 queue refused at the next start)."""
    coll = open_collection(tmp_path, {"journal_format": fmt}, runtime=ThreadsRuntime())
    coll.put("jobs", [b"old"])  # unsynced: the delete's close fsyncs it
    closing = slow_fdatasyncs(monkeypatch, 0.3).begun
    deleting = threading.Thread(target=coll.delete, args=("jobs",))
    deleting.start()
    assert closing.wait(5)
    assert coll.put("jobs", [b"new"]) == 1
    deleting.join()
    monkeypatch.undo()
    assert coll.queue_creates == 2
    again = reopen(coll)
    assert again.refused == {} and drain(again, "jobs") == [b"new"]
    again.close()


@pytest.mark.parametrize("fmt, sync, name", [("kestrel2", "always", "fresh"), ("kestrel3", "never", "fresh"),
                                             ("kestrel3", "never", "jobs+audit")])
def test_a_reload_while_a_queue_is_created_applies_to_it(
        tmp_path: Path, fmt: str, sync: str, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A creation waits for its fsyncs, and a reload meanwhile sees no such queue yet: the queue
    takes the settings reloaded as it is set up, not those it was begun with."""
    defaults = {"journal_format": fmt, "sync_journal": sync}
    coll = open_collection(tmp_path, defaults)
    coll.put("jobs", [b"parent"])
    slow_fsyncs(monkeypatch, 0.2)
    creating = gevent.spawn(partial(coll.put, name, [b"1"]))
    gevent.sleep(0.05)
    assert not creating.ready()
    coll.reload(QueueConfigs(defaults, {name: {"max_items": 1}}), {})
    assert creating.get() == 1
    monkeypatch.undo()
    assert coll.put(name, [b"2"]) == 0  # full at the one item the reload allows
    coll.close()


@pytest.mark.parametrize("fmt, sync, name", [("kestrel2", "always", "fresh"), ("kestrel3", "always", "jobs+audit")])
def test_a_close_waits_for_a_creation_under_way_and_closes_its_queue(
        tmp_path: Path, fmt: str, sync: str, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A creation still waiting for an fsync as the server closes (its client's connection outlived
    the shutdown timeout) ends first, and its queue closes with the others: one made after them was
    never closed, and held a Kestrel 3 parent's journal open past the commit log's close."""
    coll = open_collection(tmp_path, {"journal_format": fmt, "sync_journal": sync}, commit_log=True)
    coll.put("jobs", [b"parent"])
    assert coll.commit_log is not None
    log_folder = coll.commit_log.directory
    slow_fsyncs(monkeypatch, 0.2)
    creating = gevent.spawn(partial(coll.queue, name))
    gevent.sleep(0.05)
    assert not creating.ready()
    coll.close()
    monkeypatch.undo()
    assert creating.get().closed and all(coll.get(n).closed for n in coll.queue_names())
    assert not os.path.isdir(log_folder) or os.listdir(log_folder) == []  # no segment kept for recovery
    again = open_collection(tmp_path, {"journal_format": fmt, "sync_journal": sync}, commit_log=True)
    assert again.refused == {} and name in again.queue_names()
    again.close()


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_delete_the_disk_fails_says_which_queue_and_why_and_its_files_stay(
        tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A delete whose close cannot fsync is answered as a failed journal write, as a creation's is,
    not as an internal error; the files stay, and naming the queue again takes them up."""
    coll = open_collection(tmp_path, {"journal_format": fmt}, runtime=ManualRuntime())
    coll.put("jobs", [b"kept"])

    def failing(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", failing)
    with pytest.raises(JournalWriteError, match="'jobs'.*Input/output error"):
        coll.delete("jobs")
    monkeypatch.undo()
    assert drain(coll, "jobs") == [b"kept"]
    coll.close()


def test_a_reload_changing_the_format_of_a_queue_being_created_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A live queue keeps its files' format, and a reload changing it is refused; a queue whose
    creation waits for an fsync is made in the format it was begun in, so the same reload is refused
    for it too (accepted, the next start refused the queue's files)."""
    defaults = {"journal_format": "kestrel2", "sync_journal": "always"}
    coll = open_collection(tmp_path, defaults)
    slow_fsyncs(monkeypatch, 0.2)
    creating = gevent.spawn(partial(coll.put, "fresh", [b"1"]))
    gevent.sleep(0.05)
    assert not creating.ready()
    with pytest.raises(ConfigError, match="Kestrel 2 journal files"):
        coll.reload(QueueConfigs(defaults, {"fresh": {"journal_format": "kestrel3"}}), {})
    assert creating.get() == 1
    monkeypatch.undo()
    assert coll.get("fresh") is not None and coll.get("fresh").journal_format == 2
    coll.close()


def test_a_creation_killed_between_its_calls_on_the_thread_pool_leaves_nothing_open(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Kestrel 3 queue's creation whose client is killed while its manifest is written (a
    connection ended at a stop's time-out) stops as its reader's checkpoint would be written, the
    kill raised as that next call on the thread pool begins: what it opened is closed, else its
    journal stayed open past the commit log's close (its segments kept, an error logged)."""
    coll = open_collection(tmp_path, {"journal_format": "kestrel3", "sync_journal": "always"}, commit_log=True)
    assert coll.commit_log is not None
    log_folder = coll.commit_log.directory
    real = manifest.Keeper.update
    writing = threading.Event()

    def slow(keeper: manifest.Keeper, *args: Any) -> None:
        if not writing.is_set():  # the first: the new queue's manifest
            writing.set()
            time.sleep(0.2)
        real(keeper, *args)

    monkeypatch.setattr(manifest.Keeper, "update", slow)
    creating = gevent.spawn(partial(coll.queue, "fresh"))
    until_begun(writing)
    creating.kill()
    monkeypatch.undo()
    assert isinstance(creating.value, gevent.GreenletExit) and coll.queue_names() == []
    coll.close()
    assert not os.path.isdir(log_folder) or os.listdir(log_folder) == []  # no segment kept for recovery
    again = open_collection(tmp_path, {"journal_format": "kestrel3", "sync_journal": "always"}, commit_log=True)
    assert again.refused == {}
    again.put("fresh", [b"1"])
    assert drain(again, "fresh") == [b"1"]
    again.close()


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_second_close_waits_for_the_first_and_changes_nothing(
        tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Closing a collection twice raised FileNotFoundError from removing the commit log's folder a
    second time. A second close changes nothing: made while the first is under way it returns once
    that one has ended, made after it at once, neither raising; a restart finds every item."""
    defaults = {"journal_format": fmt, "sync_journal": "always"}
    coll = open_collection(tmp_path, defaults, commit_log=True, runtime=ThreadsRuntime())
    coll.put("jobs", [b"kept"])
    real, inside, go = os.fsync, threading.Event(), threading.Event()

    def held(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".kestrel"):  # the commit log's folder removed
            inside.set()
            go.wait(30)
        real(fd)

    failed: list[BaseException] = []

    def close() -> None:
        try:
            coll.close()
        except BaseException as e:
            failed.append(e)

    monkeypatch.setattr(os, "fsync", held)
    first = threading.Thread(target=close)
    first.start()
    assert inside.wait(30)
    second = threading.Thread(target=close)
    second.start()
    second.join(0.2)
    assert second.is_alive()  # the first is still closing: the second waits for it
    go.set()
    first.join()
    second.join()
    monkeypatch.undo()
    coll.close()
    assert failed == []
    assert not os.path.exists(tmp_path / ".kestrel" / "commit-log")
    again = open_collection(tmp_path, defaults, commit_log=True)
    assert again.refused == {} and drain(again, "jobs") == [b"kept"]
    again.close()


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_delete_killed_inside_its_queues_close_still_closes_and_deletes_it(
        tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A delete whose client is killed while its queue's close waits for an fsync (a connection
    ended at a stop's time-out): the close goes on to its end, and the stop waits for it as for any
    delete under way. Cut short, it left the queue half closed and out of the collection: a Kestrel 3
    journal open past the commit log's close (its segments kept, an error logged)."""
    settings = {"journal_format": fmt, "sync_journal": "always"}
    coll = open_collection(tmp_path, settings, runtime=ManualRuntime(), commit_log=True)
    assert coll.commit_log is not None
    log_folder = coll.commit_log.directory
    coll.put("jobs", [b"a", b"b"])
    assert [item.data for item in coll.remove("jobs")] == [b"a"]  # its checkpoint and its writer file unsynced
    syncing = slow_fdatasyncs(monkeypatch, 0.2).begun
    deleting = gevent.spawn(partial(coll.delete, "jobs"))
    until_begun(syncing)
    deleting.kill()
    coll.close()
    monkeypatch.undo()
    assert syncing.is_set() and isinstance(deleting.value, gevent.GreenletExit)
    assert coll.queue_deletes == 1 and coll.queue_names() == []
    assert not os.path.isdir(log_folder) or os.listdir(log_folder) == []  # no segment kept for recovery
    again = open_collection(tmp_path, settings, commit_log=True)
    assert again.refused == {} and again.queue_names() == []
    again.close()


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_queue_reloaded_from_never_to_always_keeps_its_items_after_a_power_cut(tmp_path: Path,
                                                                                 fmt: str) -> None:
    """Under `never` without the commit log a journal's name is not made durable (nothing it holds is
    promised past a crash of the process); a reload to `always` makes it so before the first fsync
    it answers for, or a put and a get acknowledged after their fsyncs were under names a power cut
    took back (a Kestrel 3 reader's checkpoint too: the manifest, fsynced, lists it)."""
    never = QueueConfigs({"journal_format": fmt, "sync_journal": "never"})
    always = QueueConfigs({"journal_format": fmt, "sync_journal": "always"})
    with Disk(tmp_path) as disk:
        coll = QueueCollection(str(tmp_path), never, runtime=ManualRuntime())
        coll.load()
        coll.put("q", [b"under never"])
        coll.reload(always, {})
        assert coll.put("q", [b"acknowledged"]) == 1
        assert [item.data for item in coll.remove("q", 1)] == [b"under never"]
        disk.power_cut(str(tmp_path))
    again = QueueCollection(str(tmp_path), always, runtime=ManualRuntime())
    again.load()
    assert drain(again, "q") == [b"acknowledged"]
    again.close()
