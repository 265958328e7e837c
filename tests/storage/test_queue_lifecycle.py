"""What creates a queue, and what a created queue leaves on disk (as Kestrel's QueueCollection)."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import gevent
import pytest

from kestrel.storage import QueueCollection
from kestrel.storage.queue import PersistentQueue
from tests.support.queues import drain, load_strictly, open_collection, reopen

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


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_queue_created_and_left_empty_survives_a_restart(tmp_path: Path, fmt: str) -> None:
    coll = _collection(tmp_path, fmt)
    coll.queue("empty")
    assert os.listdir(tmp_path)  # its journal file exists at once, as Kestrel's setup creates it
    again = reopen(coll)
    assert again.queue_names() == ["empty"] and again.get("empty") is not None
    again.close()


def test_a_fanout_child_created_and_left_empty_survives_a_restart(tmp_path: Path) -> None:
    coll = _collection(tmp_path, "kestrel2")
    coll.queue("jobs+audit")
    again = reopen(coll)
    assert again.queue_names() == ["jobs", "jobs+audit"]
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

    puts = [gevent.spawn(put, who) for who in range(4)]
    gevent.joinall(puts, raise_error=True)
    assert len({id(p.value) for p in puts}) == 1 and coll.queue_creates == 1 + ("+" in name)
    again = load_strictly(reopen(coll))
    assert sorted(drain(again, name)) == sorted(b"%d-%d" % (who, i) for who in range(4) for i in range(3))
    again.close()


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_deleted_queue_is_freed_by_reference_counting_alone(tmp_path: Path, fmt: str) -> None:
    """The server freezes the objects of the queues it loaded (src/kestrel/service/gc_pauses.py),
    and the garbage collector never looks at a frozen object again: a queue deleted later must leave
    no reference cycle behind, or its objects would never be freed."""
    coll = open_collection(tmp_path, {"journal_format": fmt}, max_memory_total=1 << 30)
    assert coll.governor is not None  # the server's: it forgets a deleted queue at its next look
    coll.put("warm", [b"x"])
    coll.delete("warm")  # what the first queue makes once for all (caches, the governor's lists)
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds unreachable is kept in gc.garbage
    try:
        coll.put("gone", [b"a", b"b", b"c"])
        read = coll.remove("gone", 1, transaction=True)
        assert read
        coll.unremove("gone", [read[0].xid])
        coll.delete("gone")
        coll.governor.tick()
        gc.collect()
        left = [type(o).__qualname__ for o in gc.garbage if type(o).__module__.startswith("kestrel")]
        alive = [o for o in gc.get_objects()  # this collection's: another test's may be alive still
                 if isinstance(o, PersistentQueue) and o.queue_path == coll.path]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert left == [], "a deleted queue's objects were freed only by the garbage collector"
    assert alive == [], "a deleted queue is still referred to"
    coll.close()
