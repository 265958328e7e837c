"""A server that runs for months holds a descriptor only for what is still there: queues made, used and
deleted (fanout children, Kestrel 3 queues and queues under the commit log among them), journals
rotated and read behind, connections opened and dropped (one with an open read) leave no
descriptor behind, over every protocol."""

from __future__ import annotations

import json
import os
import resource
import socket
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from pymemcache.client.base import Client as MemcacheClient

from kestrel.client import Server
from kestrel.client.errors import Refused
from tests.conftest import ServerProcess, wait_until
from tests.support.descriptors import descriptors, sockets

SETTINGS = {
    "queues": {
        "k3": {"journal_format": "kestrel3"},
        "durable": {"sync_journal": "always"},  # through the commit log
        "small": {"default_journal_size": "1KB", "max_memory_size": "2KB"},  # rotates, reads behind
    },
}


def lifetimes(srv: ServerProcess, round_: int) -> None:
    """One round of everything that opens a descriptor and should close it again."""
    gone = f"gone{round_}"
    with socket.create_connection(("127.0.0.1", srv.text_port), timeout=10) as text:
        text.sendall(b"put k3:\nt\n\n")
        assert text.recv(100) == b"+1\n"
    with Server("127.0.0.1", srv.thrift_port) as thrift:
        assert thrift.put(gone, [b"a", b"b"]) == 2
        taken = thrift.get(gone, 1, auto_abort_ms=60_000)
        thrift.abort(gone, {taken[0].id})
        thrift.put("k3", [b"k"])
        assert [item.data for item in thrift.get("k3", 2)] == [b"t", b"k"]
        thrift.put("durable", [b"d"])
        assert [item.data for item in thrift.get("durable", 1)] == [b"d"]
        for name in (gone, "k3", "durable"):  # made again by the next round
            thrift.call("delete_queue", name)
    memcache = MemcacheClient(("127.0.0.1", srv.memcache_port), timeout=10)
    assert memcache.get(f"fan{round_}+child") is None  # made by its first look, empty
    assert memcache.set(f"fan{round_}", b"f")
    assert memcache.get(f"fan{round_}+child") == b"f"
    for n in range(30):
        memcache.set("small", b"s%03d" % n + b"." * 300)
    for n in range(30):
        assert memcache.get("small") == b"s%03d" % n + b"." * 300
    assert memcache.delete(f"fan{round_}+child", noreply=False)
    assert memcache.delete(f"fan{round_}", noreply=False)
    reading = f"read{round_}"
    memcache.set(reading, b"read, never confirmed")
    assert memcache.get(f"{reading}/open") == b"read, never confirmed"
    memcache.close()  # the open read goes back to its queue
    memcache = MemcacheClient(("127.0.0.1", srv.memcache_port), timeout=10)
    assert memcache.delete(reading, noreply=False)
    memcache.close()
    socket.create_connection(("127.0.0.1", srv.thrift_port), timeout=10).close()  # in and straight out


def left_behind(srv: ServerProcess, held: dict[int, str], baseline: int) -> list[str]:
    """What `held` (a server's descriptors) keeps of what is gone: deleted files, files of queues
    that no longer exist or were deleted by the rounds, and descriptors past the `baseline` count."""
    files = [name for name in held.values() if name.startswith("/")]
    found = [f"open though deleted: {name}" for name in files if name.endswith(" (deleted)")]
    queues = set(os.listdir(srv.queue_path))
    for name in {Path(name).name for name in files if Path(name).parent == srv.queue_path}:
        if name not in queues or name.startswith(("gone", "fan", "read", "k3", "durable")):
            found.append(f"a file of a deleted queue: {name}")
    if len(held) > baseline:
        found.append(f"{len(held)} descriptors where there were {baseline}: {sorted(held.values())}")
    return found


def test_a_long_run_holds_no_descriptor_of_what_is_gone(server_factory: Any) -> None:
    srv = server_factory(SETTINGS)
    assert srv.proc is not None
    pid = srv.proc.pid
    listening = sockets(pid)  # no client has come yet
    lifetimes(srv, 0)  # what the server opens once, and keeps, it opens here
    wait_until(lambda: sockets(pid) <= listening, "the round's connections to be closed")
    baseline = len(descriptors(pid))
    for round_ in range(1, 41):
        lifetimes(srv, round_)
    # Closing a connection, and the work a delete leaves to a thread, end on their own time.
    found: list[str] = []

    def settled() -> bool:
        found[:] = left_behind(srv, descriptors(pid), baseline)
        return not found

    try:
        wait_until(settled, "the descriptors of what the rounds ended to be closed")
    except AssertionError:
        raise AssertionError("; ".join(found)) from None


def test_the_helpers_see_what_the_process_holds(tmp_path: Path) -> None:
    """`descriptors` names this process's own files and sockets."""
    with open(tmp_path / "held", "w"), socket.socket() as s:
        named = descriptors(os.getpid())
        assert str(tmp_path / "held") in named.values()
        assert named[s.fileno()].startswith("socket:")
        assert sockets(os.getpid()) >= 1
    assert str(tmp_path / "held") not in descriptors(os.getpid()).values()


def test_queues_whose_items_wait_on_disk_hold_their_journals_alone_and_a_read_short_of_one_is_retried(
        server_factory: Any) -> None:
    """Under the memory budget, a queue whose items waited in its journal (read-behind) held two
    descriptors while left alone, its journal's and its cursor's: 10,000 such queues needed 20,000.
    It holds its journal's alone now; a read opens the cursor's file. Out of descriptors, that read
    is answered with an error naming the queue and the cause, nothing taken, and the same read,
    descriptors free again, reads on in order."""
    srv = server_factory({"max_memory_total": "1MB", "default_queue": {"max_memory_size": "4MB"}})
    assert srv.proc is not None
    pid = srv.proc.pid
    listening = sockets(pid)  # no client has come yet
    names = [f"p{q}" for q in range(20)]
    items = {name: [b"%s:%04d:" % (name.encode(), n) + b"x" * 1000 for n in range(100)] for name in names}

    def held() -> list[str]:  # the queues' files the server holds open
        return sorted(Path(path).name for path in descriptors(pid).values()
                      if Path(path).parent == srv.queue_path and Path(path).name in names)

    with Server("127.0.0.1", srv.thrift_port) as thrift:
        for name in names:  # 2 MB, twice the budget: the later queues' items go to their journals
            assert thrift.put(name, items[name]) == 100
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.admin_port}/stats.json", timeout=10) as r:
            stats = json.loads(r.read())["queues"]
        behind = [name for name in names if stats[name]["read_behind"]]
        assert len(behind) >= 5, behind
        assert held() == sorted(names), "each queue's journal, and no cursor"
        got = {name: [item.data for item in thrift.get(name, 5)] for name in behind[:2]}
        assert held() == sorted(names + behind[:2]), "the two queues read hold their cursors' files"
        # No descriptor below the limit may come free after it is set: the stats request's goes first.
        wait_until(lambda: sockets(pid) <= listening + 1, "the stats request's connection to be closed")
        lowest_free = next(fd for fd in range(1 << 20) if fd not in descriptors(pid))
        soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (lowest_free, hard))  # nothing more opens
        try:
            with pytest.raises(Refused, match=f"cannot read the items of queue '{behind[2]}' back "
                               ".*Too many open files"):
                thrift.get(behind[2], 5)
        finally:
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))
        for name in names:
            while batch := thrift.get(name, 50):
                got.setdefault(name, []).extend(item.data for item in batch)
        assert got == items
