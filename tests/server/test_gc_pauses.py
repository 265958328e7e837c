"""Full garbage collections kept short (src/kestrel/service/gc_pauses.py): what they walk, counted
in objects rather than timed."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kestrel.service.gc_pauses import FREEZE_ABOVE, FROZEN_COUNT_AGE_S, WALK_ABOVE, Pauses
from tests.support.lines import exchange
from tests.support.wire import conn, memcache_stats

QUEUES = 3000


@pytest.fixture
def pauses() -> Iterator[Pauses]:
    """A `Pauses` watching this process's collections; everything thawed after."""
    watched = Pauses(freeze_above=10_000)
    gc.callbacks.append(watched)
    try:
        yield watched
    finally:
        watched.uninstall()
        gc.unfreeze()


def test_a_full_collection_that_leaves_many_objects_freezes_them(pauses: Pauses) -> None:
    gc.collect()
    gc.unfreeze()  # whatever the first collection froze of the test process
    kept = [[n] for n in range(20_000)]
    gc.collect()
    assert pauses.freezes >= 1 and pauses.full_collections >= 2
    assert len(gc.get_objects()) < 100 and gc.get_freeze_count() > len(kept)
    freezes = pauses.freezes
    few = [[n] for n in range(1000)]
    gc.collect()  # what is left is under the bound: walked again next time, not frozen
    assert pauses.freezes == freezes and len(gc.get_objects()) >= len(few)


def test_the_oldest_generation_is_walked_on_the_loop_once_it_holds_more_than_the_bound() -> None:
    """Python's own rule would wait for the old objects to grow by a quarter of the heap and for a
    hundred middle collections: here neither comes, and the walk is the server's."""
    asked: list[Callable[[], None]] = []
    pauses = Pauses(freeze_above=5_000, walk_above=10_000)
    thresholds = gc.get_threshold()
    gc.collect()
    gc.freeze()  # the test process: not what is counted
    pauses.install(asked.append)
    try:
        few = [[n] for n in range(2_000)]
        gc.collect(1)  # a middle collection: its survivors go to the oldest generation
        gc.collect(1)
        assert len(asked) == 1, "one look asked until it has run"
        asked.pop()()
        assert pauses.full_collections == 0, "a walk under the bound"
        many = [[n] for n in range(20_000)]
        gc.collect(1)
        assert len(asked) == 1
        frozen = gc.get_freeze_count()
        asked.pop()()
        assert pauses.full_collections == 1 and pauses.freezes == 1
        assert gc.get_freeze_count() - frozen >= len(many) + len(few)
        assert len(gc.get_objects(generation=2)) < 100
    finally:
        pauses.uninstall()
        gc.set_threshold(*thresholds)
        gc.unfreeze()
    gc.collect(1)
    assert not asked, "no look asked once uninstalled"


def test_the_frozen_objects_are_counted_again_once_their_count_is_a_second_old_or_after_a_freeze() -> None:
    now = [0.0]
    pauses = Pauses(clock=lambda: now[0])
    try:
        counted = pauses.frozen_objects()
        assert counted == gc.get_freeze_count()
        kept = [[n] for n in range(1000)]
        gc.collect(1)
        gc.freeze()  # not the server's freeze: the figure stays until its count is old
        assert pauses.frozen_objects() == counted
        now[0] += FROZEN_COUNT_AGE_S
        assert pauses.frozen_objects() >= counted + len(kept)
        more = [[n] for n in range(1000)]
        gc.collect(1)
        pauses.freeze()  # the server's own: counted again at once
        assert pauses.frozen_objects() >= counted + len(kept) + len(more)
    finally:
        gc.unfreeze()


def test_a_wave_of_closes_thaws_only_after_a_freeze_with_clients_connected(pauses: Pauses) -> None:
    pauses.freeze_loaded()
    assert pauses.freezes == 1 and len(gc.get_objects()) < 100
    assert not pauses.thaw_after_closes()  # frozen before any client: nothing of one to free
    pauses.freeze()  # as after a long collection, clients connected
    assert pauses.thaw_after_closes() and gc.get_freeze_count() == 0
    assert not pauses.thaw_after_closes()


def make_queues(port: int, count: int) -> None:
    with conn(port) as s:
        for start in range(0, count, 500):
            names = range(start, min(count, start + 500))
            exchange(s, b"".join(b"set q%05d 0 0 1\r\nx\r\n" % i for i in names), b"STORED\r\n" * len(names))


@pytest.mark.slow
def test_the_queues_a_server_loads_are_never_walked_by_a_full_collection(server_factory: Any) -> None:
    """Each queue accounts for ten to a dozen tracked objects (ten in the compiled build): 3,000
    loaded queues would add 30,000 or more to every full collection's walk. Frozen at start-up, they
    add none; deleted, they are freed all the same, each by reference counting at its delete (a
    frozen cycle would stay, and nothing holds a deleted queue for a later tick:
    docs/queue-lifetime.md)."""
    server = server_factory()
    empty = int(memcache_stats(server.memcache_port)["gc_frozen_objects"])
    make_queues(server.memcache_port, QUEUES)
    server.restart()
    stats = memcache_stats(server.memcache_port)
    assert stats["curr_items"] == str(QUEUES)
    frozen = int(stats["gc_frozen_objects"])
    assert (frozen - empty) / QUEUES >= 5, "the loaded queues are not frozen"
    assert int(stats["gc_objects"]) == 0 and int(stats["gc_freezes"]) >= 1
    # Each delete closes a journal (an fsync) and removes its file: 3,000 of them take a loaded disk
    # far longer than a reply's usual deadline.
    with conn(server.memcache_port) as s:
        deletes = b"".join(b"delete q%05d\r\n" % i for i in range(QUEUES))
        assert exchange(s, deletes, b"DELETED\r\n" * QUEUES, wait=300) == b"DELETED\r\n" * QUEUES
    # Freed once the replies have come: no wait for that, so no time a busy machine could run out
    # of; the wait is for the figure, counted again once a second. The frozen objects are back to
    # an empty server's, within a hundred: a deleted queue kept alive keeps ten or more, and a thaw
    # would leave none frozen at all.
    time.sleep(FROZEN_COUNT_AGE_S)
    left = int(memcache_stats(server.memcache_port)["gc_frozen_objects"])
    assert abs(left - empty) < 100, \
        f"frozen objects: {empty} in an empty server, {frozen} loaded, {left} after the deletes"


@pytest.mark.slow
def test_queues_created_while_serving_are_frozen_a_bounded_walk_at_a_time(server_factory: Any) -> None:
    """3,000 queues made while serving are some 33,000 tracked objects: more than a walk may hold,
    and far from what Python's own rule waits for (a hundred middle collections). The server walks
    them itself as they come, and freezes what each walk leaves."""
    server = server_factory()
    before = memcache_stats(server.memcache_port)
    assert before["gc_freezes"] == "1", "start-up's freeze alone"
    make_queues(server.memcache_port, QUEUES)
    stats = memcache_stats(server.memcache_port)
    assert stats["curr_items"] == str(QUEUES)
    assert int(stats["gc_freezes"]) >= 2 and int(stats["gc_full_collections"]) >= 1, stats
    assert int(stats["gc_frozen_objects"]) - int(before["gc_frozen_objects"]) >= WALK_ABOVE // 2
    assert int(stats["gc_objects"]) <= FREEZE_ABOVE, "a walk left more than it freezes above"
