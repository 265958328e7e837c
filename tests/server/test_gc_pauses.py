"""Full garbage collections kept short (src/kestrel/service/gc_pauses.py): what they walk, counted
in objects rather than timed."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kestrel.service.gc_pauses import FROZEN_COUNT_AGE_S, Pauses
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
