"""The same random operations on a Kestrel 2 and a Kestrel 3 queue (each with a fanout child),
with restarts: both agree with a plain model and with each other.

The one difference is the order after a restart: Kestrel 2 serves the reads that were open first
(lowest xid first), Kestrel 3 serves everything it still holds in the order it was put.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kestrel.storage import QueueCollection, QueueConfigs
from kestrel.storage.clock import FakeClock
from kestrel.storage.runtime import ManualRuntime
from tests.support.power_loss import Disk
from tests.support.queues import held_in_memory, one

FORMATS = ("kestrel2", "kestrel3")
QUEUES = ("q", "q+c")
# Bytes are checked against each model only: after a restart the two may hold different items.
COMPARED = ("items", "open_transactions", "expired_items", "total_items", "transactions",
            "canceled_transactions", "total_flushes", "discarded")
MEMORY = 300
# max_items of each queue, and whether it discards old items to make room (or refuses new ones).
LIMITS = {"q": (14, False), "q+c": (6, True)}

Item = tuple[int, int, bytes]  # put number, expiry (ms, 0 = never), data


class Side:
    """One format: its collection and, per queue, the model of its items and open reads."""

    def __init__(self, fmt: str, clock: FakeClock, budget: int, always: bool = False,
                 disk: Disk | None = None) -> None:
        self.fmt = fmt
        self.budget = budget
        self.always = always  # `sync_journal: always` with the commit log, on a runtime `Disk` sees
        self.dir = tempfile.mkdtemp(prefix=f"kestrel-{fmt}-")
        if disk is not None:  # its power cuts start from this empty folder
            disk.watch(self.dir)
        settings_ = {"max_memory_size": MEMORY, "default_journal_size": 400, "journal_format": fmt,
                     "max_items": LIMITS["q"][0], **({"sync_journal": "always"} if always else {})}
        child = {"max_items": LIMITS["q+c"][0], "discard_old_when_full": LIMITS["q+c"][1]}
        self.configs = QueueConfigs({}, {"q": settings_, "q+c": child})
        self.clock = clock
        self.items: dict[str, list[Item]] = {q: [] for q in QUEUES}
        self.opens: dict[str, dict[int, Item]] = {q: {} for q in QUEUES}  # xid -> item
        self.expired = {q: 0 for q in QUEUES}
        self.coll = self.open()
        self.crashed: list[QueueCollection] = []  # left open by a crash; closed at the end

    def open(self) -> QueueCollection:
        if self.always:  # no group commit: every fsync is one `Disk` sees
            coll = QueueCollection(self.dir, self.configs, runtime=ManualRuntime(clock=self.clock),
                                   max_memory_total=self.budget, commit_log=True)
        else:
            coll = QueueCollection(self.dir, self.configs, clock=self.clock, max_memory_total=self.budget)
        coll.load()
        for name in QUEUES:
            coll.queue(name)
        return coll

    def settle(self) -> None:
        """Let Kestrel 2's background packs finish (a stop waits for them too)."""
        for name in QUEUES:
            side_queue = self.coll.queue(name)
            side_queue.wait_for_packing()

    def expire_head(self, queue: str) -> None:
        items = self.items[queue]
        while items and items[0][1] and items[0][1] <= self.clock.now_ms():
            items.pop(0)
            self.expired[queue] += 1


class FormatsAgree(RuleBasedStateMachine):
    budget = 0  # the server's max_memory_total (0: none), whose governor ticks as a rule
    always = False
    disk: Disk | None = None  # the power cuts' file layer, if any

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.sides = [Side(fmt, self.clock, self.budget, self.always, self.disk) for fmt in FORMATS]
        self.counter = 0
        # Queues whose two formats have held their items in different orders since the last
        # restart (a restart reorders them differently): from then on their figures may differ too
        # (another item at the head expires, or is discarded), each still agreeing with its model.
        self.diverged: set[str] = set()

    def teardown(self) -> None:
        for side in self.sides:
            side.settle()
            side.coll.close()
            for coll in side.crashed:  # their descriptors, not their files: those are gone
                with contextlib.suppress(FileNotFoundError):  # a commit log recovered since
                    coll.close()
            shutil.rmtree(side.dir, ignore_errors=True)

    @rule(to=st.sampled_from(QUEUES), sizes=st.lists(st.integers(0, 60), min_size=1, max_size=4),
          ttl=st.sampled_from([0, 0, 50, 200]))
    def add(self, to: str, sizes: list[int], ttl: int) -> None:
        batch = []
        for size in sizes:
            self.counter += 1
            batch.append(b"%d." % self.counter + b"x" * size)
        now = self.clock.now_ms()
        expiry = now + ttl if ttl else 0
        first = self.counter - len(batch) + 1
        for side in self.sides:
            accepted = {}
            offered = len(batch)
            for queue in QUEUES if to == "q" else (to,):
                # Both formats expire the head of each queue the put reaches before adding.
                side.expire_head(queue)
                items = side.items[queue]
                limit, discard = LIMITS[queue]
                accepted[queue] = 0
                for i, data in enumerate(batch[:offered]):
                    if len(items) >= limit and not discard:
                        # A child is offered the parent's items up to the first it refused, as
                        # Kestrel's put offers them one by one (the child discards: it takes each).
                        offered = i + 1
                        break
                    while len(items) >= limit:  # aborts may have put it over its limit
                        items.pop(0)
                    items.append((first + i, expiry, data))
                    accepted[queue] += 1
            assert side.coll.put(to, batch, expiry) == accepted[to]

    def _take(self, side: Side, queue: str) -> Item | None:
        side.expire_head(queue)
        return side.items[queue].pop(0) if side.items[queue] else None

    @rule(queue=st.sampled_from(QUEUES), transaction=st.booleans())
    def remove(self, queue: str, transaction: bool) -> None:
        for side in self.sides:
            got = one(side.coll.remove(queue, 1, transaction))
            expected = self._take(side, queue)
            assert (got.data if got else None) == (expected[2] if expected else None)
            if got is not None and expected is not None and transaction:
                assert got.xid not in side.opens[queue]
                side.opens[queue][got.xid] = expected

    @rule(queue=st.sampled_from(QUEUES), count=st.integers(1, 6), transaction=st.booleans())
    def remove_batch(self, queue: str, count: int, transaction: bool) -> None:
        for side in self.sides:
            got = side.coll.remove(queue, count, transaction)
            expected = [e for _ in range(count) if (e := self._take(side, queue)) is not None]
            assert [i.data for i in got] == [e[2] for e in expected]
            if transaction:
                for item, entry in zip(got, expected, strict=True):
                    side.opens[queue][item.xid] = entry

    @precondition(lambda self: any(self.sides[0].opens.values()))
    @rule(queue=st.sampled_from(QUEUES), pick=st.integers(0, 100), confirm=st.booleans())
    def close_read(self, queue: str, pick: int, confirm: bool) -> None:
        for side in self.sides:
            opens = side.opens[queue]
            if not opens:
                continue
            xid = sorted(opens)[pick % len(opens)]
            if confirm:
                assert side.coll.confirm(queue, [xid])
                del opens[xid]
            else:
                assert side.coll.unremove(queue, [xid])
                side.items[queue].insert(0, opens.pop(xid))

    @rule(queue=st.sampled_from(QUEUES))
    def flush(self, queue: str) -> None:
        for side in self.sides:
            side.coll.flush(queue)
            side.expire_head(queue)  # the expired head expires first (counted), as a get would
            side.items[queue].clear()

    @rule(queue=st.sampled_from(QUEUES))
    def peek(self, queue: str) -> None:
        for side in self.sides:
            got = side.coll.peek(queue)
            side.expire_head(queue)
            head = side.items[queue][0][2] if side.items[queue] else None
            assert (got.data if got else None) == head

    @rule(ms=st.sampled_from([10, 100, 300]))
    def time_passes(self, ms: int) -> None:
        self.clock.advance(ms)

    @rule()
    def sweep(self) -> None:
        for side in self.sides:
            side.coll.sweep()
            for queue in QUEUES:
                side.expire_head(queue)

    @precondition(lambda self: self.budget)
    @rule()
    def govern(self) -> None:
        """A tick of each side's memory governor: shares from rates, and paging out."""
        for side in self.sides:
            assert side.coll.governor is not None
            side.coll.governor.tick()

    @rule(crash=st.booleans())
    def restart(self, crash: bool) -> None:
        self._restart(crash)

    def _restart(self, crash: bool) -> None:
        for side in self.sides:
            side.settle()
            if crash:
                side.crashed.append(side.coll)
            else:
                side.coll.close()
            side.coll = side.open()
            for queue in QUEUES:
                opens, items = side.opens[queue], side.items[queue]
                if side.configs.for_queue("q").journal_format == "kestrel2":
                    # Reads that were open come back to the head, the lowest xid first.
                    side.items[queue] = [opens[x] for x in sorted(opens)] + items
                else:
                    # Nothing open was consumed: every item comes back in the order it was put.
                    side.items[queue] = sorted([*opens.values(), *items])
                opens.clear()
                side.expired[queue] = 0
        self.diverged.clear()  # the figures start again from 0 in both

    @invariant()
    def each_agrees_with_its_model_and_both_with_each_other(self) -> None:
        figures = []
        for side in self.sides:
            per_queue = {}
            for queue in QUEUES:
                q = side.coll.queue(queue)
                stats = q.stats()
                assert stats["items"] == len(side.items[queue]), (side.fmt, queue)
                assert stats["bytes"] == sum(len(i[2]) for i in side.items[queue])
                assert stats["open_transactions"] == len(side.opens[queue])
                assert stats["expired_items"] == side.expired[queue]
                per_queue[queue] = {k: stats[k] for k in COMPARED}
            figures.append(per_queue)
        for side in self.sides:
            assert side.coll.ledger.total == held_in_memory(side.coll)
        for queue in QUEUES:
            orders = [([i[0] for i in side.items[queue]], sorted(i[0] for i in side.opens[queue].values()))
                      for side in self.sides]
            if orders[0] != orders[1]:
                self.diverged.add(queue)
            if queue not in self.diverged:
                assert figures[0][queue] == figures[1][queue], figures


FormatsAgree.TestCase.settings = settings(
    max_examples=50, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestFormatsAgree = FormatsAgree.TestCase


class FormatsAgreeUnderBudget(FormatsAgree):
    """The same, both queues' memory also bounded by a server budget smaller than their own."""

    budget = 400


TestFormatsAgreeUnderBudget = FormatsAgreeUnderBudget.TestCase


class FormatsAgreeAcrossPowerCuts(FormatsAgree):
    """The same under `sync_journal: always` with the commit log on, where a crash may also be a
    power cut: every file keeps what an fsync covered and a prefix of the rest
    (tests/support/power_loss.py). Both formats' files are fsynced only by the log's checkpoints, so
    its recovery, by position in Kestrel 2 journals and Kestrel 3 writer files and by meaning in
    Kestrel 3 reader checkpoints, carries every change the engine acknowledged, once."""

    always = True

    def __init__(self) -> None:
        self.disk = Disk().install()
        super().__init__()

    @rule(keep=st.integers(0, 40))
    def power_cut(self, keep: int) -> None:
        for side in self.sides:  # both, before either is cut: a wait lets the other side's tasks run
            side.settle()
        for side in self.sides:
            self.disk.power_cut(side.dir, keep)
        self._restart(crash=True)

    @rule()
    def checkpoint(self) -> None:
        for side in self.sides:
            assert side.coll.commit_log is not None
            side.coll.commit_log.checkpoint()

    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            self.disk.uninstall()


FormatsAgreeAcrossPowerCuts.TestCase.settings = settings(
    max_examples=40, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestFormatsAgreeAcrossPowerCuts = FormatsAgreeAcrossPowerCuts.TestCase
