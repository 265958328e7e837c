"""Random operation sequences against the engine agree with a plain in-memory model."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, cast

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kestrel.storage import JournalWriteError, QueueCollection, QueueConfigs, disk
from kestrel.storage.clock import FakeClock
from kestrel.storage.kestrel2.replay import replay_queue
from kestrel.storage.queue_path import list_journal_files
from kestrel.storage.runtime import ManualRuntime
from tests.support import kestrel24
from tests.support.power_loss import Disk
from tests.support.queues import held_in_memory, one


class QueueModel(RuleBasedStateMachine):
    """The engine against a list (the queue) and a dict (open reads), with restarts.

    A small memory budget puts the queue in read-behind, so rotation and packing are exercised too;
    `budget` is the server's `max_memory_total` (0: none), whose governor ticks as a rule.
    """

    settings: dict[str, str] = {}  # more settings of the queue
    budget = 0

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kestrel-model-")
        self.configs = QueueConfigs({}, {"q": {"max_memory_size": 600, "default_journal_size": 400,
                                               **self.settings}})
        self.clock = FakeClock()
        self.coll = self._open()
        self.items: list[bytes] = []
        self.opens: dict[int, bytes] = {}
        self.counter = 0
        self.returned = 0  # bytes put back at the head, which may sit above the memory budget

    def _open(self) -> QueueCollection:
        coll = QueueCollection(self.dir, self.configs, clock=self.clock, max_memory_total=self.budget)
        coll.load()
        return coll

    def teardown(self) -> None:
        self.coll.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @rule(sizes=st.lists(st.integers(0, 120), min_size=1, max_size=4))
    def add(self, sizes: list[int]) -> None:
        batch = []
        for size in sizes:
            self.counter += 1
            batch.append(str(self.counter).encode() + b"." * size)
        assert self.coll.put("q", batch) == len(batch)
        self.items.extend(batch)

    @rule()
    def remove(self) -> None:
        item = one(self.coll.remove("q"))
        expected = self.items.pop(0) if self.items else None
        assert (item.data if item else None) == expected

    @rule()
    def open_read(self) -> None:
        item = one(self.coll.remove("q", transaction=True))
        expected = self.items.pop(0) if self.items else None
        assert (item.data if item else None) == expected
        if item is not None:
            assert item.xid not in self.opens
            self.opens[item.xid] = item.data

    @rule(count=st.integers(1, 6), transaction=st.booleans())
    def remove_batch(self, count: int, transaction: bool) -> None:
        items = self.coll.remove("q", count, transaction)
        expected, self.items = self.items[:count], self.items[count:]
        assert [i.data for i in items] == expected
        if transaction:
            for item in items:
                assert item.xid not in self.opens
                self.opens[item.xid] = item.data

    @precondition(lambda self: self.opens)
    @rule(data=st.data())
    def confirm(self, data: st.DataObject) -> None:
        xid = data.draw(st.sampled_from(sorted(self.opens)))
        assert self.coll.confirm("q", [xid])
        del self.opens[xid]

    @precondition(lambda self: self.opens)
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        xid = data.draw(st.sampled_from(sorted(self.opens)))
        assert self.coll.unremove("q", [xid])
        self.items.insert(0, self.opens.pop(xid))
        self.returned += len(self.items[0])

    @rule()
    def flush(self) -> None:
        self.coll.flush("q")
        self.items.clear()

    @rule()
    def peek(self) -> None:
        item = self.coll.peek("q")
        assert (item.data if item else None) == (self.items[0] if self.items else None)

    @rule(op=st.sampled_from(["add", "remove", "open", "batch", "confirm", "abort", "flush"]), data=st.data())
    def disk_full(self, op: str, data: st.DataObject) -> None:
        """One operation on a full disk: refused (or nothing to do), and the queue exactly as it was."""
        xid = data.draw(st.sampled_from(sorted(self.opens))) if self.opens else 12345
        calls = {
            "add": lambda: self.coll.put("q", [b"never-stored"]),
            "remove": lambda: one(self.coll.remove("q")),
            "open": lambda: one(self.coll.remove("q", transaction=True)),
            "batch": lambda: self.coll.remove("q", 3, True) or None,
            "confirm": lambda: self.coll.confirm("q", [xid]) or None,
            "abort": lambda: self.coll.unremove("q", [xid]) or None,
            "flush": lambda: self.coll.flush("q"),
        }
        real = disk.write

        def full(fd: int, payload: bytes | memoryview) -> int:
            os.write(fd, payload[: max(1, len(payload) // 2)])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        disk.write = full
        try:
            result = calls[op]()
        except JournalWriteError as e:
            assert "the disk is full" in str(e)
        else:
            assert result is None  # nothing to do, so nothing was written
        finally:
            disk.write = real

    @precondition(lambda self: self.budget)
    @rule(advance=st.integers(0, 500))
    def govern(self, advance: int) -> None:
        """A tick of the memory governor: shares from rates, and paging out."""
        self.clock.advance(advance)
        assert self.coll.governor is not None
        self.coll.governor.tick()

    @rule(crash=st.booleans())
    def restart(self, crash: bool) -> None:
        self.coll.queue("q").wait_for_packing()
        if crash:
            self._die()
        else:
            self.coll.close()
        self._restarted()

    def _die(self) -> None:
        """What a crash of the process leaves of the collection: its files as written, and nothing
        more done (its live journal closed unsynced, which cancels a periodic sync pending)."""
        writer = cast(Any, self.coll.queue("q"))._journal.writer
        if writer is not None:
            writer.close(sync=False)

    def _restarted(self) -> None:
        self.coll = self._open()
        # Reads that were open come back to the head, the lowest xid first.
        self.items = [self.opens[x] for x in sorted(self.opens)] + self.items
        self.returned += sum(len(v) for v in self.opens.values())
        self.opens.clear()

    @invariant()
    def kestrel_24_loads_the_journal_the_same(self) -> None:
        # Released Kestrel 2.4 replaying our files (rotated, packed and live) sees our queue.
        files = list_journal_files(self.dir, "q")
        data = b"".join(Path(p).read_bytes() for p in files.replay_order())
        items, opens = kestrel24.replay(data)
        assert opens == self.opens
        assert [i for i in items if i] == self.items  # empty: a pack's stand-in for a departed item

    @invariant()
    def read_only_replay_sees_the_queue_and_changes_nothing(self) -> None:
        self.coll.queue("q").wait_for_packing()  # no background write (a pack, the manifest) meanwhile
        before = sorted((n, os.path.getsize(os.path.join(self.dir, n))) for n in os.listdir(self.dir))
        state = replay_queue(self.dir, "q")
        assert {xid: i.data for xid, i in state.opens.items()} == self.opens
        assert [i.data for i in state.items if i.data] == self.items
        assert not state.anomalies
        assert sorted((n, os.path.getsize(os.path.join(self.dir, n))) for n in os.listdir(self.dir)) == before

    @invariant()
    def figures_agree(self) -> None:
        q = self.coll.queue("q")
        assert q.length == len(self.items)
        assert q.bytes == sum(len(i) for i in self.items)
        assert q.open_transactions == len(self.opens)
        if not self.items:
            self.returned = 0
        assert q.memory_bytes <= 600 + 130 + self.returned
        assert self.coll.ledger.total == held_in_memory(self.coll)


QueueModel.TestCase.settings = settings(
    max_examples=40, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestQueueModel = QueueModel.TestCase


class QueueModelUnderBudget(QueueModel):
    """The same, the queue's memory also bounded by a server budget smaller than its own."""

    budget = 400


TestQueueModelUnderBudget = QueueModelUnderBudget.TestCase


class PeriodicSyncModel(QueueModel):
    """The same under a periodic `sync_journal`, whose promise is the same as `never`'s for a crash
    of the process (every acknowledged change survives it, once): its fsyncs run in the background."""

    settings = {"sync_journal": "10ms"}


PeriodicSyncModel.TestCase.settings = settings(
    max_examples=40, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestPeriodicSyncModel = PeriodicSyncModel.TestCase


class PowerCutModel(QueueModel):
    """The same model under `sync_journal: always`, where a crash may also be a power cut: every
    file keeps what an fsync covered and a prefix of the rest (tests/support/power_loss.py); each change the
    engine acknowledged must survive it, once. With `commit_log` on, the journals are fsynced only
    by checkpoints, so the commit log's recovery carries the promise."""

    commit_log = False
    settings = {"sync_journal": "always"}

    def __init__(self) -> None:
        self.disk = Disk().install()
        super().__init__()

    def _open(self) -> QueueCollection:
        if self.dir not in self.disk.roots:  # made just now, empty
            self.disk.watch(self.dir)
        runtime = ManualRuntime(clock=self.clock)  # no group commit: its fsyncs are the ones `Disk` sees
        coll = QueueCollection(self.dir, self.configs, runtime=runtime, commit_log=self.commit_log,
                               max_memory_total=self.budget)
        coll.load()
        return coll

    @rule(keep=st.integers(0, 40))
    def power_cut(self, keep: int) -> None:
        self.coll.queue("q").wait_for_packing()
        self.disk.power_cut(self.dir, keep)
        self._restarted()

    # Waiting for an fsync lets a pack run meanwhile: the files are read once it is written.
    @invariant()
    def kestrel_24_loads_the_journal_the_same(self) -> None:
        self.coll.queue("q").wait_for_packing()
        super().kestrel_24_loads_the_journal_the_same()

    @invariant()
    def read_only_replay_sees_the_queue_and_changes_nothing(self) -> None:
        self.coll.queue("q").wait_for_packing()
        super().read_only_replay_sees_the_queue_and_changes_nothing()

    @precondition(lambda self: self.commit_log)
    @rule()
    def checkpoint(self) -> None:
        assert self.coll.commit_log is not None
        self.coll.commit_log.checkpoint()

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            self.disk.uninstall()


class CommitLogPowerCutModel(PowerCutModel):
    commit_log = True


for model in (PowerCutModel, CommitLogPowerCutModel):
    model.TestCase.settings = settings(
        max_examples=25, stateful_step_count=40, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
TestPowerCutModel = PowerCutModel.TestCase
TestCommitLogPowerCutModel = CommitLogPowerCutModel.TestCase
