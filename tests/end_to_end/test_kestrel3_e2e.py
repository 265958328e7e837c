"""A kestrel3 queue with fanout children, end to end: the real server, thriftpy2 and pymemcache."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path
from typing import Any

import pytest
from pymemcache.client.base import Client

from kestrel.storage import QueueCollection, QueueConfigs
from kestrel.storage import commit_log as commit_log_module
from kestrel.storage.kestrel3 import files as kestrel3_files
from tests.conftest import ServerProcess, wait_until
from tests.support.clients import consume_until_stopped, every_item
from tests.support.queues import drain
from tests.support.wire import shared_server  # noqa: F401  (the module's `server`)
from tests.thrift.test_thrift_e2e import client

KESTREL3_QUEUE = {"journal_format": "kestrel3", "max_memory_size": "2KB", "default_journal_size": "4KB"}
KESTREL3 = {"queues": {"jobs": KESTREL3_QUEUE}}
# The module's `server`, for the tests that do not restart it: a kestrel3 queue each.
SHARED_SERVER_CONFIG = {"queues": {name: KESTREL3_QUEUE for name in ("writes", "deleted", "progress")}}


def files(srv: ServerProcess) -> list[str]:
    return sorted(os.listdir(srv.queue_path))


def memcache(srv: ServerProcess) -> Client:
    return Client(("127.0.0.1", srv.memcache_port), timeout=10, default_noreply=False)


def test_fanout_readers_share_one_writer_journal_through_thrift_and_memcache(server_factory: Any) -> None:
    srv = server_factory(KESTREL3)
    with client(srv) as c:
        assert c.get("jobs+a", 1, 0, 0) == [] and c.get("jobs+b", 1, 0, 0) == []  # readers created
        items = [b"job-%03d-" % i + b"x" * 60 for i in range(100)]  # 7KB: read-behind and rotation
        assert c.put("jobs", items, 0) == 100
        names = files(srv)
        assert [n for n in names if ".read." in n] == ["jobs.read.", "jobs.read.a", "jobs.read.b"]
        writers = [n for n in names if n.startswith("jobs.") and ".read." not in n]
        assert len(writers) == 1  # one copy of the data, in one file so far
        assert c.peek("jobs+a").items == 100

        # Reader a: reliable reads through Thrift; an aborted read comes back first.
        first = c.get("jobs+a", 3, 0, 30_000)
        assert [i.data for i in first] == items[:3]
        assert c.abort("jobs+a", {first[0].id}) == 1
        assert c.confirm("jobs+a", {first[1].id, first[2].id}) == 2
        assert [i.data for i in c.get("jobs+a", 98, 0, 0)] == [items[0], *items[3:]]
        assert c.peek("jobs+a").items == 0

    # Reader b through memcache, with /open and /close; the default reader is untouched.
    mc = memcache(srv)
    try:
        assert mc.get("jobs+b/open") == items[0]
        assert mc.get("jobs+b/close/open") == items[1]
        assert mc.get("jobs+b/abort") is None
        assert mc.get("jobs+b") == items[1]
        assert mc.get("jobs+b/peek") == items[2]
        stats = mc.stats()
        assert stats[b"queue_jobs+b_items"] == 98
        assert stats[b"queue_jobs_items"] == 100
        assert stats[b"queue_jobs+a_items"] == 0
    finally:
        mc.close()

    srv.restart()
    with client(srv) as c:
        assert c.peek("jobs").items == 100 and c.peek("jobs+a").items == 0 and c.peek("jobs+b").items == 98
        assert [i.data for i in c.get("jobs", 100, 0, 0)] == items
        assert [i.data for i in c.get("jobs+b", 100, 0, 0)] == items[2:]
        # Every reader passed every item: only the newest writer file is left.
        assert len([n for n in files(srv) if n.startswith("jobs.") and ".read." not in n]) == 1
        c.put("jobs", [b"after"], 0)
        assert c.get("jobs+a", 5, 0, 0)[0].data == b"after"


def test_put_writes_once_however_many_readers(server: ServerProcess) -> None:
    with client(server) as c:
        for reader in "abcdefgh":
            c.get(f"writes+{reader}", 1, 0, 0)
        c.put("writes", [b"z" * 1000], 0)
        writer_bytes = sum((server.queue_path / n).stat().st_size for n in files(server) if n.startswith("writes.") and ".read." not in n)
        assert 1000 < writer_bytes < 1100
        assert all(c.peek(f"writes+{r}").items == 1 for r in "abcdefgh")


def test_reads_open_at_a_restart_are_served_again_in_put_order(server_factory: Any) -> None:
    srv = server_factory(KESTREL3)
    with client(srv) as c:
        c.put("jobs", [b"one", b"two", b"three"], 0)
        opened = c.get("jobs", 1, 0, 60_000)
        assert opened[0].data == b"one"
        assert c.get("jobs", 1, 0, 0)[0].data == b"two"  # gone for good
    srv.restart()
    with client(srv) as c:
        assert [i.data for i in c.get("jobs", 5, 0, 0)] == [b"one", b"three"]


def test_poison_items_leave_after_max_errors_aborts(server_factory: Any) -> None:
    srv = server_factory({"queues": {"jobs": {"journal_format": "kestrel3", "max_errors": 2}}})
    with client(srv) as c:
        c.put("jobs", [b"bad", b"good"], 0)
        for _ in range(2):
            read = c.get("jobs", 1, 0, 30_000)
            assert read[0].data == b"bad"
            assert c.abort("jobs", {read[0].id}) == 1
        assert [i.data for i in c.get("jobs", 5, 0, 0)] == [b"good"]
    mc = memcache(srv)
    try:
        assert mc.stats()[b"queue_jobs_poisoned"] == 1
    finally:
        mc.close()


def test_auto_aborts_count_as_errors_on_a_fanout_reader(server_factory: Any) -> None:
    srv = server_factory({"queues": {"jobs": {"journal_format": "kestrel3", "max_errors": 2}}})
    with client(srv) as c:
        c.get("jobs+r", 1, 0, 0)
        c.put("jobs", [b"slow"], 0)
        for _ in range(2):
            assert [i.data for i in c.get("jobs+r", 1, 0, 50)] == [b"slow"]  # auto-abort after 50 ms
            wait_until(lambda: c.peek("jobs+r").open_transactions == 0, "the open reads to be aborted")
        assert c.peek("jobs+r").items == 0  # the second auto-abort made it poison
        assert c.peek("jobs").items == 1  # the other reader still has it
    srv.restart()
    with client(srv) as c:
        assert c.get("jobs+r", 1, 0, 0) == []


def test_delete_removes_a_reader_and_the_data_with_the_last(server: ServerProcess) -> None:
    mc = memcache(server)
    try:
        mc.get("deleted+a")
        mc.set("deleted", b"x")
        assert mc.delete("deleted")
        assert "deleted.read." not in files(server) and "deleted.read.a" in files(server)
        assert mc.get("deleted+a") == b"x"  # the child still reads the parent's writer journal
        assert mc.delete("deleted+a")
        assert [n for n in files(server) if n.startswith("deleted")] == []
    finally:
        mc.close()


@pytest.mark.parametrize("journal_format, sync, commit_log, budget, audit", [
    ("kestrel3", "always", "off", "0", True), ("kestrel3", "always", "off", "4KB", True),
    ("kestrel3", "never", "off", "4KB", True), ("kestrel3", "always", "on", "0", True),
    ("kestrel3", "always", "on", "4KB", True), ("kestrel3", "20ms", "on", "0", True),
    ("kestrel3", "always", "off", "0", False), ("kestrel3", "never", "off", "4KB", False),
    ("kestrel3", "always", "on", "0", False),
    ("kestrel2", "always", "off", "4KB", True), ("kestrel2", "always", "on", "0", True),
    ("kestrel2", "never", "on", "4KB", True), ("kestrel2", "20ms", "on", "4KB", True)])
def test_sigkill_under_load_keeps_every_acknowledged_put_once_and_no_confirmed_item(
        server_factory: Any, journal_format: str, sync: str, commit_log: str, budget: str, audit: bool) -> None:
    """Both formats (a Kestrel 2 queue in read-behind rotates and packs its journal meanwhile), with
    and without the commit log and a small memory budget. Without the `audit` reader, which keeps
    every Kestrel 3 writer file, the files the consumers pass are deleted off the loop meanwhile."""
    jobs = {"journal_format": journal_format, "sync_journal": sync, "default_journal_size": "16KB"}
    if journal_format == "kestrel2":
        jobs["max_memory_size"] = "32KB"
    srv = server_factory({"queues": {"jobs": jobs}, "commit_log": commit_log, "max_memory_total": budget})
    if audit:
        with client(srv) as c:
            c.get("jobs+audit", 1, 0, 0)
    acknowledged: list[bytes] = []
    confirmed: list[bytes] = []
    unanswered: list[bytes] = []  # confirmed when the server died: done or not, no one knows
    stop = threading.Event()

    def produce(worker: int) -> None:
        with client(srv) as c:
            n = 0
            while not stop.is_set():
                batch = [b"p%d-%06d" % (worker, n + i) for i in range(5)]
                try:
                    accepted = c.put("jobs", batch, 0)
                except Exception:
                    return
                acknowledged.extend(batch[:accepted])
                n += 5

    def consume() -> None:
        with client(srv) as c:
            consume_until_stopped(c, "jobs", 10, stop, confirmed, unanswered)

    threads = [threading.Thread(target=produce, args=(w,)) for w in range(2)]
    threads += [threading.Thread(target=consume) for _ in range(2)]
    for t in threads:
        t.start()
    wait_until(lambda: len(confirmed) >= 300 and len(acknowledged) >= 600, "300 confirmed and 600 acknowledged",
               timeout=120)
    if not audit:  # killed while the files passed are being deleted
        wait_until(lambda: srv.log().count("deleted writer journal file") >= 2, "writer files deleted",
                   timeout=120)
    srv.kill()
    stop.set()
    for t in threads:
        t.join(10)
    # The log holds the records of every round since its last checkpoint; a kill in the round after
    # a checkpoint (a pack asks for one) finds it empty, and the journals hold every change.
    logged = commit_log_module.pending(str(srv.queue_path))
    assert not logged or (commit_log == "on" and sync != "never")
    srv.start()
    assert ("commit log recovered" in srv.log()) == logged
    with client(srv) as c:
        left = every_item(c, "jobs")
        kept = every_item(c, "jobs+audit") if audit else []
    assert not set(left) & set(confirmed), "a confirmed item came back"
    assert len(left) == len(set(left)), "an item is there twice"
    missing = set(acknowledged) - set(left) - set(confirmed) - set(unanswered)
    assert not missing, f"{len(missing)} acknowledged items lost"
    if audit:
        assert set(acknowledged) <= set(kept) and len(kept) == len(set(kept))


def test_checkpoint_of_a_reader_reads_back_as_its_progress(server: ServerProcess) -> None:
    with client(server) as c:
        c.put("progress", [b"a", b"b", b"c", b"d"], 0)
        first, second = c.get("progress", 2, 0, 30_000)
        c.confirm("progress", {second.id})
    progress = kestrel3_files.read_checkpoint(str(server.queue_path / "progress.read."))
    assert (progress.head, sorted(progress.done)) == (0, [2])  # item 1 is open: the head waits for it


def test_a_reader_named_first_after_a_restart_is_created_once(tmp_path: Path) -> None:
    configs = QueueConfigs({}, {"jobs": {"journal_format": "kestrel3"}})
    coll = QueueCollection(str(tmp_path), configs)
    coll.queue("jobs+a")
    coll.put("jobs", [b"one", b"two"])
    coll.close()
    again = QueueCollection(str(tmp_path), configs)  # not loaded: queues are created on first use
    child = again.queue("jobs+a")
    assert again.queue("jobs+a") is child and child.length == 2
    assert again.put("jobs", [b"three"]) == 1
    assert drain(again, "jobs+a") == [b"one", b"two", b"three"]
    again.close()


def test_text_protocol_on_a_kestrel3_queue_and_its_reader(server_factory: Any) -> None:
    srv = server_factory(KESTREL3)
    with socket.create_connection(("127.0.0.1", srv.text_port), timeout=5) as s:
        lines = s.makefile("rwb")

        def say(request: bytes) -> bytes:
            lines.write(request)
            lines.flush()
            return lines.readline()

        assert say(b"get jobs+t\n") == b"*\n"  # the reader exists from now on
        lines.write(b"put jobs:\none\ntwo\n\n")
        assert say(b"") == b"+2\n"
        assert say(b"peek jobs+t\n") == b":one\n"
        assert say(b"get jobs+t\n") == b":one\n"  # an open read
        assert say(b"confirm jobs+t 1\n") == b"+1\n"
        assert say(b"get jobs\n") == b":one\n"
        assert say(b"flush jobs+t\n") == b"+0\n"
        assert say(b"get jobs+t\n") == b"*\n"
    srv.restart()
    with socket.create_connection(("127.0.0.1", srv.text_port), timeout=5) as s:
        lines = s.makefile("rwb")
        lines.write(b"get jobs\nget jobs\n")
        lines.flush()
        # The read of "one" was never confirmed: it is served again, in put order.
        assert [lines.readline(), lines.readline()] == [b":one\n", b":two\n"]
