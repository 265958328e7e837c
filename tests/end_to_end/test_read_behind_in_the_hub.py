"""A request answered in the hub's callback never waits for the disk: a change of a queue in
read-behind whose file must be read first goes to its connection's greenlet.

Found from outside: a Kestrel 3 queue in read-behind opens its cursor's file before a change,
reading its header, and a Kestrel 2 queue's undo of a failed write replays its journal; where the
page cache did not hold those bytes (a cold start, a file system without cache-only reads, a full
disk), a put answered in the hub looped forever at 100% CPU and no port answered again.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from pymemcache.client.base import Client
from pymemcache.exceptions import MemcacheServerError

from tests.conftest import ServerProcess
from tests.end_to_end.test_disk_full import fill, small_disk  # noqa: F401  (the small disk)
from tests.support.wire import memcache_stats

ITEM = b"x" * 200


def evict(path: Path) -> None:
    """Drop every file under `path` from the page cache, as a restart after a reboot finds them."""
    for file in path.rglob("*"):
        if file.is_file():
            fd = os.open(file, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def paged_out(srv: ServerProcess, items: int) -> Client:
    mc = Client(("127.0.0.1", srv.memcache_port), timeout=15)
    for n in range(items):
        assert mc.set("q", b"%05d" % n + ITEM, noreply=False)
    assert int(memcache_stats(srv.memcache_port)["queue_q_mem_items"]) < items  # in read-behind
    return mc


def test_a_put_to_a_queue_in_read_behind_after_a_cold_start_is_answered(server_factory: Any) -> None:
    srv = server_factory({"default_queue": {"journal_format": "kestrel3", "max_memory_size": "8KB"}})
    paged_out(srv, 2_000).close()
    srv.restart()
    evict(srv.queue_path)  # after the start-up's replay, which read every file
    mc = Client(("127.0.0.1", srv.memcache_port), timeout=15)
    assert mc.set("q", b"after" + ITEM, noreply=False)
    assert [mc.get("q") for _ in range(2)] == [b"00000" + ITEM, b"00001" + ITEM]
    mc.close()


def test_a_failed_put_to_a_queue_in_read_behind_is_refused_and_the_server_goes_on(
        small_disk: Path, server_factory: Any) -> None:  # noqa: F811  (the fixture)
    srv = server_factory({"queue_path": str(small_disk / "queues"),
                          "default_queue": {"journal_format": "kestrel2", "max_memory_size": "8KB"}})
    mc = paged_out(srv, 600)
    for _ in range(100):  # the head drains: the journal holds removes too
        assert mc.get("q") is not None
    filler = fill(small_disk, 4096)
    acknowledged = 600
    with pytest.raises(MemcacheServerError, match="disk is full"):
        for n in range(600, 10_000):
            mc.set("q", b"%05d" % n + ITEM, noreply=False)
            acknowledged += 1
    assert int(memcache_stats(srv.memcache_port)["queue_q_items"]) == acknowledged - 100
    filler.unlink()
    mc.close()
    mc = Client(("127.0.0.1", srv.memcache_port), timeout=15)
    assert [mc.get("q") for _ in range(acknowledged - 100)] == [b"%05d" % n + ITEM for n in range(100, acknowledged)]
    mc.close()
