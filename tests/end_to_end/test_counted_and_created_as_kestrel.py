"""What a request counts and which queues it creates, as Kestrel's own code does (its ThriftHandler,
KestrelHandler and QueueCollection), over real clients of each protocol: the figures a dashboard
compares across protocols, and the queue files an operator finds on disk."""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
from pymemcache.client.base import Client as MemcacheClient
from pymemcache.exceptions import MemcacheClientError

from tests.conftest import ServerProcess
from tests.support.clients import thrift
from tests.support.wire import memcache_stats


def _counts(srv: ServerProcess) -> tuple[int, int, int, int]:
    stats = memcache_stats(srv.memcache_port)
    return tuple(int(stats[k]) for k in ("cmd_get", "cmd_peek", "get_hits", "get_misses"))  # type: ignore[return-value]


def _moved(before: tuple[int, ...], after: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(b - a for a, b in zip(before, after, strict=True))


def test_a_thrift_get_counts_each_item_a_hit_and_a_miss_where_it_came_back_short(server: ServerProcess) -> None:
    """Kestrel's Thrift get is a loop of removes, each a hit or (on an empty queue) a miss: a get of 5
    from 2 items is 2 hits and a miss (it counted one hit), a get of 0 neither."""
    with thrift(server) as c:
        c.put("q", [b"a", b"b", b"c"], 0)
        before = _counts(server)
        assert len(c.get("q", 2, 0, 0)) == 2  # all it asked for: no miss
        assert _moved(before, _counts(server)) == (1, 0, 2, 0)
        before = _counts(server)
        assert len(c.get("q", 5, 0, 0)) == 1
        assert _moved(before, _counts(server)) == (1, 0, 1, 1)
        before = _counts(server)
        assert c.get("q", 0, 0, 0) == []
        assert _moved(before, _counts(server)) == (1, 0, 0, 0)


def test_a_thrift_peek_counts_a_hit_or_a_miss_as_memcache_and_text_peeks_do(server: ServerProcess) -> None:
    with thrift(server) as c:
        c.put("q", [b"a"], 0)
        before = _counts(server)
        assert c.peek("q").head_item == b"a"
        assert _moved(before, _counts(server)) == (0, 1, 1, 0)
        before = _counts(server)
        assert c.peek("empty").head_item is None
        assert _moved(before, _counts(server)) == (0, 1, 0, 1)
    mc = MemcacheClient(("127.0.0.1", server.memcache_port))
    try:
        before = _counts(server)
        assert mc.get("q/peek") == b"a"
        assert _moved(before, _counts(server)) == (0, 1, 1, 0)
    finally:
        mc.close()


def test_a_thrift_put_of_no_items_creates_no_queue(server: ServerProcess) -> None:
    """Kestrel's put loops over its items: none, nothing done (here it created the queue's journal)."""
    with thrift(server) as c:
        creates = int(memcache_stats(server.memcache_port)["queue_creates"])
        assert c.put("nothing", [], 0) == 0
        assert "nothing" not in c.queue_names()
    assert not (server.queue_path / "nothing").exists()
    stats = memcache_stats(server.memcache_port)
    assert int(stats["queue_creates"]) == creates and "queue_nothing_items" not in stats


@pytest.mark.parametrize("journal_format", ["kestrel2", "kestrel3"])
def test_naming_a_fanout_child_creates_its_parent_only_where_the_child_reads_the_parents_journal(
        server_factory: Any, journal_format: str) -> None:
    """A Kestrel 2 child is a queue of its own, created alone as Kestrel's is; a child of an alias
    left a queue file the alias hid, and every start after warned of it. A Kestrel 3 child is a
    reader of its parent's journal, which it needs."""
    srv = server_factory({"default_queue": {"journal_format": journal_format},
                          "aliases": {"al": {"destination_queues": ["x"]}}})
    mc = MemcacheClient(("127.0.0.1", srv.memcache_port))
    try:
        assert mc.get("parent+child/peek") is None
        if journal_format == "kestrel2":
            assert mc.get("al+child") is None
        else:  # it would read a journal the alias never writes, in a file the alias hides
            with pytest.raises(MemcacheClientError, match="an alias, which keeps none"):
                mc.get("al+child")
        stats = memcache_stats(srv.memcache_port)
        if journal_format == "kestrel2":
            assert int(stats["queue_creates"]) == 2
            assert sorted(n for n in os.listdir(srv.queue_path) if not n.startswith(".")) == [
                "al+child", "parent+child"]
            assert "queue_parent_items" not in stats and "queue_al_items" not in stats
        else:
            assert "queue_parent_items" in stats and "queue_al_items" not in stats
        mc.set("parent", b"item")  # the parent, created by its own first reference, feeds the child
        assert mc.get("parent+child") == b"item"
    finally:
        mc.close()


def test_a_flush_expires_the_expired_head_first_counted_and_moved_to_expire_to_queue(
        server_factory: Any) -> None:
    """Kestrel's flush is a loop of removes, each expiring the expired head first: those items count
    in `expired_items` and go to `expire_to_queue` (they were dropped uncounted when a flush came
    before the expiry sweep)."""
    srv = server_factory({"expiration_timer_frequency": 0, "queues": {"e": {"expire_to_queue": "dead"}}})
    mc = MemcacheClient(("127.0.0.1", srv.memcache_port))
    try:
        mc.set("dead", b"placeholder")  # the queue exists before the flush, holding one item
        expiry = int(time.time()) + 1
        mc.set("e", b"old-1", expire=expiry)
        mc.set("e", b"old-2", expire=expiry)
        mc.set("e", b"kept")
        time.sleep(max(expiry - time.time(), 0) + 0.2)
        assert mc.raw_command(b"flush e", b"END\r\n") == b""
        stats = memcache_stats(srv.memcache_port)
        assert (stats["queue_e_items"], stats["queue_e_expired_items"]) == ("0", "2")
        assert stats["queue_dead_items"] == "3"
        assert [mc.get("dead") for _ in range(3)] == [b"placeholder", b"old-1", b"old-2"]
    finally:
        mc.close()
