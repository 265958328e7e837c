"""Full garbage collections kept short (src/kestrel/service/gc_pauses.py): what they walk, counted
in objects rather than timed."""

from __future__ import annotations

import gc
import resource
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kestrel.service.gc_pauses import FREEZE_ABOVE, FROZEN_COUNT_AGE_S, QUEUES_TO_FREEZE, WALK_ABOVE, Pauses
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


@pytest.fixture
def looks() -> Iterator[list[Callable[[], None]]]:
    """The looks a `Pauses` asks of the loop, run by the test; the test process frozen first (not
    what is counted), and everything thawed and Python's thresholds put back after."""
    asked: list[Callable[[], None]] = []
    thresholds = gc.get_threshold()
    gc.collect()
    gc.freeze()
    try:
        yield asked
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()


def test_the_oldest_generation_is_walked_on_the_loop_once_it_grew_by_the_bound(
        looks: list[Callable[[], None]]) -> None:
    """Python's own rule would wait for the old objects to grow by a quarter of the heap and for a
    hundred middle collections: here neither comes, and the walk is the server's."""
    pauses = Pauses(freeze_above=5_000, walk_above=10_000)
    pauses.install(looks.append)
    try:
        few = [[n] for n in range(2_000)]
        gc.collect(1)  # a middle collection: its survivors go to the oldest generation
        gc.collect(1)
        assert len(looks) == 1, "one look asked until it has run"
        looks.pop()()
        assert pauses.full_collections == 0, "grown by less than the bound"
        many = [[n] for n in range(20_000)]
        gc.collect(1)
        frozen = gc.get_freeze_count()
        looks.pop()()
        assert pauses.full_collections == 1 and pauses.freezes == 1
        assert gc.get_freeze_count() - frozen >= len(many) + len(few)
        assert len(gc.get_objects(generation=2)) < 100
    finally:
        pauses.uninstall()
    gc.collect(1)
    assert not looks, "no look asked once uninstalled"


def test_what_a_walk_leaves_is_frozen_only_where_the_queues_grew(looks: list[Callable[[], None]]) -> None:
    """Without new queues what lives is what clients hold, whose freeze a wave of closes would undo
    with a walk of the whole heap; the next walk then waits for as much growth again."""
    queues = [100]
    pauses = Pauses(freeze_above=5_000, walk_above=10_000)
    pauses.install(looks.append, lambda: queues[0])
    try:
        pauses.freeze()  # as at start-up: 100 queues
        held = [[n] for n in range(12_000)]
        gc.collect(1)
        looks.pop()()
        assert pauses.full_collections == 1 and pauses.freezes == 1, "walked, not frozen"
        assert pauses.left_unfrozen >= len(held)
        more = [[n] for n in range(5_000)]
        gc.collect(1)
        looks.pop()()
        assert pauses.full_collections == 1, "grown by less than the bound since the walk"
        queues[0] += QUEUES_TO_FREEZE
        most = [[n] for n in range(10_000)]
        gc.collect(1)
        looks.pop()()
        assert pauses.full_collections == 2 and pauses.freezes == 2, "the queues grew: frozen"
        assert len(gc.get_objects(generation=2)) < 100
        assert pauses.thaw_after_closes()  # a freeze with clients: after their wave of closes
        gc.collect()
        assert pauses.freezes == 3, "what survives the collection after a thaw is frozen again"
        assert len(held) + len(more) + len(most) > 0
    finally:
        pauses.uninstall()


def test_the_frozen_objects_follow_the_servers_freezes_and_are_counted_again_in_a_turn_of_their_own(
        looks: list[Callable[[], None]]) -> None:
    """Counting the frozen objects walks their list (5 ms at 200,000): the server counts them at its
    start, adds what its freezes freeze, and counts them again once the count is a second old, in a
    callback of the loop's own rather than in the read of the figures that found it old."""
    now = [0.0]
    pauses = Pauses(freeze_above=500, clock=lambda: now[0])
    pauses.install(looks.append)
    try:
        pauses.freeze_loaded()
        # (as below: other threads of the test process, some left by earlier tests, free a few)
        assert abs(pauses.frozen_objects() - gc.get_freeze_count()) < 100
        kept = [[n] for n in range(1000)]
        gc.collect()  # leaves more than 500: frozen, and added to the figure without a count
        # (what the collection left, counted in its callback: the callback's own objects aside)
        assert abs(pauses.frozen_objects() - gc.get_freeze_count()) < 100
        assert gc.get_freeze_count() >= len(kept)
        more = [[n] for n in range(1000)]
        gc.collect(1)
        gc.freeze()  # not the server's freeze: the figure stays until its count is old
        counted = pauses.frozen_objects()
        assert counted < gc.get_freeze_count() - len(more) // 2  # (other threads may free a few)
        now[0] += FROZEN_COUNT_AGE_S
        assert pauses.frozen_objects() == pauses.frozen_objects() == counted  # the count is asked, once
        count = [look for look in looks if look == pauses._count_frozen]
        assert len(count) == 1
        count[0]()  # the loop's turn
        # (counted afresh: another thread of the test process may free a few frozen objects since)
        assert abs(pauses.frozen_objects() - gc.get_freeze_count()) < 100 < gc.get_freeze_count() - counted
        assert pauses.thaw_after_closes() and pauses.frozen_objects() == 0
    finally:
        pauses.uninstall()


def test_without_a_loop_the_frozen_objects_are_counted_in_the_read_once_old() -> None:
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
    memcache_stats(server.memcache_port)  # finds the count old: the loop counts them in a turn of its own
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
    assert int(stats["gc_freezes"]) >= 2 and int(stats["gc_full_collections"]) >= 2, stats
    assert int(stats["gc_frozen_objects"]) - int(before["gc_frozen_objects"]) >= WALK_ABOVE // 2
    assert int(stats["gc_objects"]) <= FREEZE_ABOVE, "a walk left more than it freezes above"


@pytest.mark.slow
def test_what_clients_hold_is_walked_but_not_frozen(server_factory: Any) -> None:
    """1,500 connections, each after a request, are more than a walk's growth: the server walks
    them, but no queue came with them, so nothing is frozen that a wave of their closes would have
    to thaw (with a walk of the whole heap)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    server = server_factory()
    clients: list[socket.socket] = []
    try:
        before = memcache_stats(server.memcache_port)
        for _ in range(1_500):
            client = socket.create_connection(("127.0.0.1", server.memcache_port), timeout=30)
            client.sendall(b"version\r\n")
            clients.append(client)
        for client in clients:
            assert exchange(client, b"", b"\r\n").startswith(b"VERSION")
        stats = memcache_stats(server.memcache_port)
        assert int(stats["gc_full_collections"]) > int(before["gc_full_collections"]), "no walk"
        assert stats["gc_freezes"] == "1", "what the clients hold was frozen"
    finally:
        for client in clients:
            client.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
