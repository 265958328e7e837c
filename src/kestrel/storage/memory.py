"""The memory governor: one budget (`max_memory_total`) for what every queue of a server holds.

Each queue keeps up to its `max_memory_size` of items in memory and pages the rest out
(read-behind). Alone that bounds nothing: 500 queues of 4 MB each hold 2 GB. The governor runs on
the runtime's timer, off the path of every put and get, and steers with three levers, as RabbitMQ's
memory monitor steers its variable queues (seeds/rabbitmq-variable-queue.md):

- Rates. Each queue's ingress and egress (bytes a second, smoothed), sampled at the ticks after
  which it changed and decayed in between: a tick costs the queues that changed, not the queues
  held, while memory is under the budget (`MemoryGovernor.tick`), and nothing at all while the
  queues hold under a quarter of it (the governor lets go: `_let_go`).
- Shares. Each queue gets a memory target, its share of the budget: while everything fits, what it
  holds and room for what arrives before the next tick; past the budget, its head (which no
  page-out drops) and what it will consume in the next D seconds (its "RAM duration"), D chosen so
  that the shares fill the budget; until the next such plan (at most REPLAN ticks later), a queue
  that changes gets its share for the same D, while the shares still fit. A hot
  queue's head stays in memory; an idle backlog keeps a small floor. The queue's read-behind rules
  use the target in place of `max_memory_size`, so a queue over it pages its new items out at
  once, and reads them back as its head drains and its target allows.
- Paging. While the total is over the budget, the queues over their targets drop the items they hold
  beyond them (`PersistentQueue.shed`: from the journal, never rewritten), those whose items wait
  longest first, until the total is back under the budget.

Between ticks the budget is kept where memory grows: a `MemoryLedger` holds the running total of
what the queues hold (each batch entering or leaving a queue's memory adds its bytes once, and each
read-behind buffer its size as it changes). A put that would take it over the budget calls
`make_room`, which pages out at once (the queues the last tick found over their shares, those whose
items wait longest first) or else sends the putting queue's new items to read-behind; a refill from
read-behind reads back no more than the room it leaves (`PersistentQueue._fill`). The tick still
computes every share from rates.

At start-up the same budget holds: before a queue replays its journal, `admit` gives it what the
budget has left as its target, so the replay leaves the rest on disk for read-behind, as a put would.

What paging cannot release (open reads, read-behind buffers, each queue's head and the items aborted
back to it) may still exceed the budget: then flow control holds puts briefly and refuses them with
`MemoryBudgetExceeded`, while gets, confirms and aborts go on, until the total is back under a
low-water mark, or under the budget with nothing left to page out. The per-put cost is one attribute
read (`flow_control`) and one comparison with the ledger.
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import NamedTuple

import structlog

from kestrel.storage.deferred_log import log_later
from kestrel.storage.errors import MemoryBudgetExceeded
from kestrel.storage.queue import MemoryAccount, PersistentQueue
from kestrel.storage.runtime import PACE, Runtime, Timer, paced

log = structlog.get_logger("kestrel.memory")

INTERVAL_MS = 250  # between ticks: short enough that a fast producer cannot outgrow its share much
HOLD_MS = 500  # how long a put waits under flow control before it is refused
SMOOTHING = 0.3  # weight of the newest rate sample (older ones decay: no flapping on one burst)
FLOOR = 64 * 1024  # a queue's smallest share, when the budget allows it: one read-back's worth
LOW_WATER = 0.9  # paging and flow control aim this far under the budget
IDLE = 1.0  # bytes a second in and out under which a queue in read-behind is idle (its cursor closes)
# The governor takes memory in hand once the queues hold more than ENGAGE of the budget, and lets go
# under LET_GO: meanwhile each queue holds up to its own max_memory_size, and no tick measures one.
ENGAGE = 0.5
LET_GO = 0.25
# Past the budget's fit, a tick plans every queue, and the ticks between plans give the queues that
# changed their shares by the last plan's rule while those fit: a plan at least every REPLAN ticks
# (10 s), which gives back what the shares of queues whose rates fell since hold unused. A share
# that outgrows the budget brings the plan at once.
REPLAN = 40
# Queues a tick pages out between two pauses for the other tasks, where they share one thread, and
# the most a put pages out before its own new items go to read-behind: each places a read-behind
# cursor in its journal (50-65 us), and a tick that paged out 10,000 queues at once held the loop
# 0.5-0.65 s.
SHED_PACE = 50


class MemoryLedger(MemoryAccount):
    """The bytes every queue of a server holds in memory now (its items in memory, its open reads
    and its read-behind cursor's buffer), kept as they change: a queue adds a batch's bytes once as
    it enters or leaves memory, so a put sees in one comparison whether it would take the server
    over `limit` (the budget; UNLIMITED without one), and a refill how much it may read back.

    Under gevent (the server) no two changes interleave and the total is exact; a tick that
    measures every queue without a pause sets it to what it measures all the same, which under
    plain threads corrects what two queues' changes racing on it may have lost.
    """

    __slots__ = ("governor",)

    def __init__(self) -> None:
        super().__init__()
        self.governor: MemoryGovernor | None = None

    def make_room(self, queue: PersistentQueue, size: int) -> None:
        """A put of `size` bytes into `queue`'s memory would take the total over `limit`."""
        if self.governor is not None:
            self.governor.make_room(queue, size)


@dataclass
class Demand:
    """What one queue asks of the budget this tick (bytes, and bytes a second)."""

    want: int  # what it could usefully hold (`wanted`)
    ceiling: int  # max_memory_size
    ingress: float
    egress: float
    pinned: int = 0  # the bytes no page-out can drop: its head item, and items aborted back to it

    @property
    def pageable(self) -> int:
        """What a page-out could drop of its want."""
        return max(self.want - self.pinned, 0)

    @property
    def rate(self) -> float:
        """The bytes a second it moves, in and out: what a pressed share is measured by."""
        return self.ingress + self.egress


def wanted(size: int, ceiling: int, ingress: float, interval_s: float) -> int:
    """What a queue could usefully hold: its items' bytes (`size`, in memory or on disk) and room
    for what arrives at `ingress` bytes a second before the tick after next, capped by its ceiling
    (max_memory_size)."""
    want = size + int(ingress * interval_s * 2)
    return want if want < ceiling else ceiling


class Shares:
    """The rule by which a plan shares the budget: each queue's target is `share(demand)`. (A base
    class rather than a union, so that the compiled build calls a share through its vtable.)"""

    def share(self, d: Demand) -> int:
        raise NotImplementedError


@dataclass(frozen=True)
class FittingShares(Shares):
    """How a plan shares a budget every want fits: each queue gets its want and a part of the
    `spare` bytes, half of them in equal parts among `queues`, half by ingress (a growing queue
    gets the room; `arriving` is every queue's ingress), up to its ceiling."""

    spare: int
    queues: int
    arriving: float

    def share(self, d: Demand) -> int:
        equal = self.spare / (2 * self.queues)
        by_ingress = self.spare / 2 * d.ingress / self.arriving if self.arriving else equal
        return min(d.ceiling, d.want + int(equal + by_ingress))


@dataclass(frozen=True)
class PressedShares(Shares):
    """How a plan shares a budget the wants do not fit: each queue keeps its pinned bytes and gets
    what it will consume or receive in the next `duration` seconds, between `floor` and the rest of
    its want. Until the next plan, a queue that changes gets its share by the same rule."""

    floor: int
    duration: float

    def share(self, d: Demand) -> int:
        pageable = d.pageable
        coming = int(d.rate * self.duration)
        return d.pinned + max(min(pageable, self.floor), min(pageable, coming))


# How a plan goes over the demands: at once, or pausing for the other tasks (`paced`).
Walk = Callable[[list[Demand]], Iterable[Demand]]


def plan(demands: list[Demand], budget: int, walk: Walk = iter) -> Shares:
    """The rule by which `demands` share `budget` (already net of open reads and cursor buffers):
    each queue's target is `share(demand)`, and the targets sum to at most `budget` where the
    queues' pinned bytes allow it. The rule is found here and the shares given by the caller, each
    in a `walk` that may pause (at 10,000 queues, a plan and its list of targets held the loop
    25-30 ms on the pure build).

    Everything fits: each gets its want and a part of the rest (`FittingShares`).
    Otherwise each keeps its pinned bytes, and the rest of the budget is shared: each gets what it
    will consume or receive in the next D seconds, between a floor and the rest of its want, D chosen
    so that the shares fill it (`PressedShares`). Shares that ignored the pinned bytes left a page-out
    short: each queue kept its head beyond its target, and memory stayed over the budget.
    """
    budget = max(budget, 0)
    total = pinned = 0
    arriving = 0.0
    for d in walk(demands):
        total += d.want
        pinned += d.pinned
        arriving += d.ingress
    if total <= budget:
        return FittingShares(budget - total, len(demands), arriving)
    room = budget - pinned
    floor = min(FLOOR, max(room, 0) // (4 * len(demands)))
    return PressedShares(floor, _fill_duration(walk(demands), floor, room))


def _fill_duration(demands: Iterable[Demand], floor: int, budget: int) -> float:
    """The D at which the pageable shares clamp(rate * D, floor, rest of want) sum to `budget`: the
    sum is piecewise linear in D, so walk its breakpoints in order (n log n in the queues that move;
    an idle queue's share is its floor whatever D is). 0 when the floors alone fill it."""
    constant = 0.0  # the sum of the shares held at a floor or at a want
    # (D, index, 0: leaves its floor / 1: reaches its want, the floor or the want, rate)
    events: list[tuple[float, int, int, int, float]] = []
    for i, d in enumerate(demands):
        pageable = d.pageable
        low = min(pageable, floor)
        constant += low
        rate = d.rate
        if rate > 0 and pageable > low:
            events.append((low / rate, i, 0, low, rate))
            events.append((pageable / rate, i, 1, pageable, rate))
    if constant >= budget:
        return 0.0  # pinned bytes and floors alone fill the budget: every queue keeps its floor
    events.sort()
    slope = 0.0
    for at, _, kind, bytes_, rate in events:
        if slope > 0 and constant + slope * at >= budget:
            return (budget - constant) / slope
        if kind == 0:
            constant -= bytes_
            slope += rate
        else:
            constant += bytes_
            slope -= rate
        if slope <= 1e-9:
            slope = 0.0
        if slope == 0.0 and constant >= budget:
            return at
    return (budget - constant) / slope if slope > 0 else float(2**40)


_DECAYS = tuple((1.0 - SMOOTHING) ** ticks for ticks in range(64))


def _decay(ticks: int) -> float:
    """What a smoothed rate keeps of itself over `ticks` ticks without a change."""
    return _DECAYS[ticks] if 0 <= ticks < 64 else (0.0 if ticks > 0 else 1.0)


class _Record:
    """What the governor knows of one queue: its counters and smoothed rates as of tick `tick`
    (a rate decays by `_decay` over the ticks since, which is what a sample of no change does),
    and, as last measured, what it wants of the budget and holds beyond paging's reach."""

    __slots__ = ("queue", "items", "length", "bytes", "ingress", "egress", "item_size", "tick",
                 "want", "fixed", "buffer", "target", "pinned")

    def __init__(self, q: PersistentQueue, tick: int) -> None:
        self.queue = q
        self.items = q.total_items
        self.length = q.length
        self.bytes = q.bytes
        self.ingress = 0.0
        self.egress = 0.0
        self.item_size = q.bytes / q.length if q.length else 1024.0
        self.tick = tick
        self.want = 0
        self.fixed = 0  # its open reads' and cursor buffer's bytes
        self.buffer = 0  # its cursor buffer's bytes
        self.target = 0  # its target as a pressed plan, or a tick after it, gave it
        self.pinned = 0  # its pinned bytes as a plan of every queue measured them

    def sample(self, q: PersistentQueue, seconds: float, tick: int) -> None:
        """The rates at tick `tick`: the ticks between the last sample and this one saw no change
        (the queue would have been noted), this one saw the counters move by what they did in
        `seconds`. Items in = total_items' growth; items out = that less the length's growth."""
        if tick <= self.tick:
            return  # sampled this tick already
        quiet = _decay(tick - self.tick - 1)
        self.tick = tick
        added = q.total_items - self.items
        left = max(0, added - (q.length - self.length))
        if q.length:
            self.item_size = q.bytes / q.length
        out_bytes = left * self.item_size
        in_bytes = max(0.0, q.bytes - self.bytes + out_bytes)
        ingress, egress = self.ingress * quiet, self.egress * quiet
        self.ingress = ingress + SMOOTHING * (in_bytes / seconds - ingress)
        self.egress = egress + SMOOTHING * (out_bytes / seconds - egress)
        self.items, self.length, self.bytes = q.total_items, q.length, q.bytes

    def demand(self, q: PersistentQueue, pinned: int, interval_s: float) -> Demand:
        """What the queue asks of the budget as just sampled; its want noted here too."""
        ceiling = q.config.max_memory_size
        self.want = wanted(q.bytes, ceiling, self.ingress, interval_s)
        return Demand(self.want, ceiling, self.ingress, self.egress, pinned)


class _Measure(NamedTuple):
    """What a plan's measure found: the queues (those deleted meanwhile left out), their records
    and what each asks of the budget, and the sums of their bytes in memory, of what paging cannot
    release (open reads and cursor buffers)."""

    queues: list[PersistentQueue]
    records: list[_Record]  # (a list: `forget` takes a queue deleted in a pause out of the dict)
    demands: list[Demand]
    held: int
    fixed: int


class MemoryGovernor:
    """Keeps the sum of what `queues()` hold in memory under `budget` bytes (see the module doc).

    `tick()` is one round (tests call it under a manual runtime); `start()` runs it every
    `interval_ms` on the runtime's timer. `ledger` is the running total the queues keep (the
    collection's); the governor sets its limit and is called by it when a put would pass it.
    `changes`, when given, returns the queues changed since its last call (every queue the
    collection creates, changes or deletes): a tick then visits those alone while the budget is
    far from full, and nothing at all when none changed.
    """

    def __init__(self, queues: Callable[[], Iterable[PersistentQueue]], budget: int, runtime: Runtime,
                 ledger: MemoryLedger | None = None, interval_ms: int = INTERVAL_MS,
                 hold_ms: int = HOLD_MS,
                 changes: Callable[[], Collection[PersistentQueue]] | None = None) -> None:
        self._queues = queues
        self._changes = changes
        self.budget = budget
        self.runtime = runtime
        self.clock = runtime.clock
        self.interval_ms = interval_ms
        self.hold_ms = hold_ms
        self.ledger = ledger if ledger is not None else MemoryLedger()
        self.ledger.governor = self
        self.ledger.limit = budget
        self._records: dict[PersistentQueue, _Record] = {}
        self._tick = 0
        # Over every record, kept as records change: wants, fixed bytes (open reads and cursor
        # buffers), and ingress as of tick `_sums_tick` (every rate decays alike between samples).
        self._want_total = self._fixed_total = 0
        self._ingress_total = 0.0
        self._sums_tick = 0
        # The pinned bytes of every record as the last plan of every queue measured them: what flow
        # control can wait for no page-out to release (`_flow`).
        self._pinned_total = 0
        # The last plan's wants did not fit the budget: how it shared it, at which tick, and the sum
        # of the targets given by it and the ticks after (each record's `target`).
        self._pressed: PressedShares | None = None
        self._planned = 0
        self._target_total = 0
        self._at_ease = False  # let go (`_let_go`): memory far under the budget, nothing measured
        # Queues whose read-behind cursor held its file (and maybe a read buffer) when last measured:
        # each gives them back once its egress and ingress decay below IDLE. A cursor opens its file
        # only for a change (a put too: any change may read, an expiry at the head), which the next
        # tick measures: backlogs whose cursors are closed (most of them, pressed) are not visited.
        self._watch: set[_Record] = set()
        # Queues over their targets at the last tick, the longest wait last: what a put pages out.
        self._candidates: list[PersistentQueue] = []
        # Candidates a put could not page out (its reads would wait for the disk, another thread
        # held the queue): the next tick pages them out, its reads off the loop.
        self._left: list[PersistentQueue] = []
        self._last_tick = self._monotonic_ms()
        self._timer: Timer | None = None
        self._released = runtime.event()
        self._released.set()
        self.closed = False
        self.flow_control = False
        self._over = False  # the last tick ended over the budget
        self._flow_since = 0  # when the current spell began (`_monotonic_ms`)
        self.flow_control_ms = 0  # time spent under flow control before the current spell
        self.memory_total = 0  # what the queues held at the last tick, after paging
        self.paged_out_total = 0  # bytes dropped from memory by paging since start
        self.refused_puts = 0

    def _monotonic_ms(self) -> int:
        """The runtime clock's monotonic reading in ms: what the rates and flow-control spells are
        measured on (the wall clock steps, and a step would make a rate or a spell negative, or an
        hour long)."""
        return round(self.clock.monotonic() * 1000.0)

    # -----------------------------------------------------------------------------------------
    # Running

    def start(self) -> None:
        if self._timer is None and not self.closed:
            self._timer = self.runtime.call_later(self.interval_ms / 1000.0, self._run)

    def _run(self) -> None:
        if self.closed:
            return
        try:
            self.tick()
        except Exception:
            log.exception("memory governor tick failed")
        if not self.closed:
            self._timer = self.runtime.call_later(self.interval_ms / 1000.0, self._run)

    def close(self) -> None:
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.ledger.governor = None
        self.ledger.limit = MemoryAccount.UNLIMITED
        self._candidates = []
        self._left = []
        self._records = {}
        self._watch = set()
        self._released.set()

    def forget(self, queue: PersistentQueue) -> None:
        """`queue` was deleted: its record leaves the sums, and nothing here holds it any more (it
        is freed at its delete, not at the next tick: docs/queue-lifetime.md)."""
        record = self._records.pop(queue, None)
        if record is not None:
            self._want_total -= record.want
            self._fixed_total -= record.fixed
            self._target_total -= record.target
            self._pinned_total -= record.pinned
            ingress = self._ingress_total - record.ingress * _decay(self._sums_tick - record.tick)
            self._ingress_total = max(ingress, 0.0)
            self._watch.discard(record)
        if queue in self._candidates:
            self._candidates = [q for q in self._candidates if q is not queue]
        if queue in self._left:
            self._left = [q for q in self._left if q is not queue]

    def admit(self, queue: PersistentQueue, among: int, waiting: int = 0) -> None:
        """`queue` is about to load its items from its files, one of `among` queues at start-up with
        `waiting` still to load after it: it may hold in memory what the budget has left beyond a
        floor kept for each of those (a floor is at most FLOOR, and all of them a quarter of the
        budget), and a floor at least. So a replay pages its backlog out as serving does: the items
        past its target stay on disk, for read-behind, and the next tick gives it its share."""
        floor = min(FLOOR, self.budget // (4 * max(among, 1)))
        room = self.ledger.limit - self.ledger.total - floor * waiting
        queue.set_memory_target(max(room, floor))

    # -----------------------------------------------------------------------------------------
    # One round

    def tick(self) -> None:
        """Measure rates, give each queue its target, page out the slowest over theirs, and start
        or end flow control.

        With `changes`, a tick measures nothing while the queues hold under LET_GO of the budget,
        until they hold more than ENGAGE of it (`_let_go`). Engaged, the queues that changed since
        the last tick are measured, and while memory is under the budget and out of flow control,
        only they get new targets (`_tick_changed`): an unchanged queue's target still holds what
        it has, and it gets a new one when it next changes. A tick with no change, under the budget
        and out of flow control, only lets idle read-behind cursors give their buffers back.
        Otherwise the tick measures and plans every queue.
        """
        if self._left:
            self._page_out_left()
            if self.closed:  # during a pause
                return
        now = self._monotonic_ms()
        seconds = max((now - self._last_tick) / 1000.0, 0.001)
        self._last_tick = now
        self._tick += 1
        if self._changes is not None:
            pressed = self.flow_control or self._over or self._pressed is not None
            held = self.ledger.total
            if self._at_ease:
                if held <= self.budget * ENGAGE and not pressed:
                    return  # the changed queues stay noted: a change costs each a flag test
                self._at_ease = False  # engaged: every queue measured and planned, rates from now on
                self._changes()  # and the changes noted afresh from now on
                self._tick_all(seconds, now)
                return
            changed = self._changes()
            if held < self.budget * LET_GO and not pressed:
                self._let_go()
                return
            elif not changed and not (self.flow_control or self._over) and held <= self.budget:
                # Nothing moved: the last plan holds, tight or not (its shares bind only what grows,
                # and what grows is a change, planned by the next tick), so an idle server is idle.
                self._release_idle_cursors()
                return
            elif not (self.flow_control or self._over) and self._tick_changed(changed, seconds, now):
                return
        self._tick_all(seconds, now)

    def _let_go(self) -> None:
        """Memory is far under the budget: each queue may hold up to its max_memory_size again, as
        without a budget, and the ticks measure nothing until the queues hold more than ENGAGE of
        it, so that a busy server pays nothing a queue for the budget while it does not bind. The
        put path still keeps the budget meanwhile (`make_room`: the putting queue's new items go to
        read-behind), and the tick that engages again measures and plans every queue, its rates
        from then on."""
        self._at_ease = True
        for q in self._queues():
            if not q.closed:
                q.free_memory_target()
        self._records = {}
        self._watch = set()
        self._candidates = []
        self._want_total = self._fixed_total = self._target_total = self._pinned_total = 0
        self._ingress_total = 0.0
        self._pressed = None

    def _tick_changed(self, changed: Iterable[PersistentQueue], seconds: float, now: int) -> bool:
        """Measure the changed queues and give them their shares of the budget: while every want
        fits it, as a plan would; while the last plan found they did not, by its rule, if their new
        shares keep the sum within the budget and that plan is under REPLAN ticks old. False (the
        records kept) when the tick must plan every queue instead. What a changed queue costs here is
        what a busy server pays for each queue it moves items through."""
        tick = self._tick
        interval = self.interval_ms / 1000.0
        records = self._records
        ingress_total = self._ingress_total * _decay(tick - self._sums_tick)
        want_total, fixed_total = self._want_total, self._fixed_total
        pressed = self._pressed
        fresh: list[_Record] = []
        demands: list[Demand] = []
        for q in changed:
            record = records.get(q)
            if record is None:
                if q.closed:
                    continue
                record = records[q] = _Record(q, tick)
            else:  # out of the sums, to come back in as measured now
                want_total -= record.want
                fixed_total -= record.fixed
                ingress_total -= record.ingress * _decay(tick - record.tick)
                if q.closed:  # deleted as this tick began (plain threads): `forget` may race it
                    records.pop(q, None)
                    self._watch.discard(record)
                    continue
                record.sample(q, seconds, tick)
            demand = record.demand(q, 0 if pressed is None else q.pinned_bytes(), interval)
            want_total += demand.want
            ingress_total += record.ingress
            if q.open_transactions or q.in_read_behind:
                _, opens, buffer = q.held_bytes()
                record.fixed, record.buffer = opens + buffer, buffer
                fixed_total += opens + buffer
            elif record.fixed:
                record.fixed = record.buffer = 0
            fresh.append(record)
            demands.append(demand)
        self._want_total, self._fixed_total = want_total, fixed_total
        self._ingress_total, self._sums_tick = max(ingress_total, 0.0), tick
        total = self.ledger.total
        spare = self.budget - fixed_total - want_total
        if total > self.budget:
            return False
        shares: Shares
        if pressed is None:
            if spare < 0:
                return False
            shares = FittingShares(spare, len(records), self._ingress_total)
        elif spare >= 0 or tick - self._planned >= REPLAN:
            return False  # the wants fit again, or the plan is stale: plan every queue anew
        else:
            shares = pressed
        targets = [shares.share(demand) for demand in demands]
        if pressed is not None:
            target_total = self._target_total + sum(targets) - sum(record.target for record in fresh)
            if target_total > self.budget - fixed_total:
                return False
            self._target_total = target_total
            for record, target in zip(fresh, targets, strict=True):
                record.target = target
        watch = self._watch
        for record, target in zip(fresh, targets, strict=True):
            q = record.queue
            q.set_memory_target(target)
            if record.buffer or q.holds_cursor_file():
                watch.add(record)
        self._place_candidates([record.queue for record in fresh])
        self.memory_total = total
        self._flow(total, now, fixed_total)
        self._release_idle_cursors()
        return True

    def _tick_all(self, seconds: float, now: int) -> None:
        """Measure every queue, plan every share, page out if over the budget.

        Where the tasks share one thread, each walk over the queues (the measure, the plan's, the
        shares', the page-out) pauses for the others (a plan of 10,000 queues held the loop 40-60 ms
        compiled, 90-300 ms pure; its shares alone 4 ms and 25-30 ms). Its measure then spans the
        pauses, and the ledger, exact there, stays as it is; with threads the walks go on unpaused,
        and the measure sets the ledger (see MemoryLedger)."""
        queues = [q for q in self._queues() if not q.closed]
        pausing = self.runtime.shares_one_thread and len(queues) > PACE
        measured = self._measure_all(queues, seconds, pausing)
        if measured is None:
            return
        # Under flow control the shares sum to the low-water mark, where flow control ends.
        budget = int(self.budget * LOW_WATER) if self.flow_control else self.budget
        walk: Walk = (lambda demands: paced(demands, self.runtime)) if pausing else iter
        shares = plan(measured.demands, budget - measured.fixed, walk)
        self._pressed = shares if isinstance(shares, PressedShares) else None
        self._sums_tick = self._planned = self._tick
        over = self._give_shares(shares, measured, pausing)
        if over is None:
            return
        if pausing:
            total = self.ledger.total
        else:
            total = self.ledger.total = measured.held + measured.fixed  # as measured (see MemoryLedger)
        if total > self.budget or (self.flow_control and total > self.budget * LOW_WATER):
            # Under flow control no put reaches `make_room`: only a tick can page out what holds the
            # total between the low-water mark and the budget, and flow control ends under the mark.
            freed = self._page_out(over, total - int(self.budget * LOW_WATER))
            if self.closed:  # during a pause
                return
            # On one thread the ledger is exact, and the page-out's pauses let other changes in.
            total = self.ledger.total if self.runtime.shares_one_thread else total - freed
            over = [q for q in over if q.memory_bytes > q.memory_target]
        self._candidates = over
        self.memory_total = total
        self._flow(total, now, self._fixed_total + self._pinned_total)
        self._release_idle_cursors()

    def _measure_all(self, queues: list[PersistentQueue], seconds: float, pausing: bool) -> _Measure | None:
        """Sample every queue of `queues` and note what it asks of the budget; the records kept are
        theirs alone (a queue deleted in a pause left). None: the governor closed in a pause."""
        tick = self._tick
        interval = self.interval_ms / 1000.0
        old = self._records
        records: dict[PersistentQueue, _Record] = {}
        demands: list[Demand] = []
        fixed_total = held_total = 0
        for q in paced(queues, self.runtime) if pausing else queues:
            if self.closed:  # during a pause
                return None
            record = old.get(q)
            if record is None:
                record = _Record(q, tick)
            else:
                record.sample(q, seconds, tick)
            records[q] = record
            mem, opens, buffer = q.held_bytes()
            held_total += mem
            record.fixed, record.buffer = opens + buffer, buffer
            fixed_total += opens + buffer
            record.pinned = pinned = q.pinned_bytes()
            demands.append(record.demand(q, pinned, interval))
        if pausing and any(q.closed for q in queues):  # deleted in a pause: `forget` missed its new record
            kept = [i for i, q in enumerate(queues) if not q.closed]
            queues, demands = [queues[i] for i in kept], [demands[i] for i in kept]
            records = {q: records[q] for q in queues}
            fixed_total = sum(record.fixed for record in records.values())
        self._records = records
        return _Measure(queues, list(records.values()), demands, held_total, fixed_total)

    def _give_shares(self, shares: Shares, measured: _Measure, pausing: bool) -> list[PersistentQueue] | None:
        """Give each measured queue its share as its target, in a walk that pauses as the measure
        did, and set the sums from them; the queues over their targets, the shortest wait first
        (`_wait`). A queue deleted in a pause is passed over or, given its share already, taken out
        of the sums after. None: the governor closed in a pause."""
        entries = list(zip(measured.queues, measured.records, measured.demands, strict=True))
        want_total = target_total = pinned_total = 0
        ingress_total = 0.0
        over: list[PersistentQueue] = []
        waits: list[float] = []
        watch: set[_Record] = set()
        for q, record, demand in paced(entries, self.runtime) if pausing else entries:
            if self.closed:  # during a pause
                return None
            if q.closed:
                continue
            record.target = target = shares.share(demand)
            q.set_memory_target(target)
            want_total += demand.want
            target_total += target
            ingress_total += demand.ingress
            pinned_total += demand.pinned
            if q.memory_bytes > target:
                over.append(q)
                waits.append(self._wait(q))
            if record.buffer or q.holds_cursor_file():
                watch.add(record)
        fixed_total = measured.fixed
        records = self._records
        if len(records) < len(entries):  # deleted in a pause: `forget` took its record out
            want_total = sum(record.want for record in records.values())
            fixed_total = sum(record.fixed for record in records.values())
            target_total = sum(record.target for record in records.values())
            ingress_total = sum(record.ingress for record in records.values())
            pinned_total = sum(record.pinned for record in records.values())
            watch = {record for record in watch if not record.queue.closed}
        self._want_total, self._fixed_total = want_total, fixed_total
        self._target_total, self._ingress_total = target_total, ingress_total
        self._watch = watch
        self._pinned_total = pinned_total
        return [over[i] for i in sorted(range(len(over)), key=waits.__getitem__) if not over[i].closed]

    def _place_candidates(self, changed: list[PersistentQueue]) -> None:
        """The candidates after a tick of the `changed` queues alone: each leaves the list and, over
        its new target, comes back in where its wait places it. The others keep their order (an
        unchanged queue holds the same bytes, and every rate decays alike), so a few changes cost
        a few places in the list, not a sort of it (pressed, it holds most queues); many, a sort."""
        if len(changed) * 16 > len(self._candidates):
            over = {q for q in self._candidates if not q.closed and q.memory_bytes > q.memory_target}
            over.update(q for q in changed if q.memory_bytes > q.memory_target)
            self._candidates = sorted(over, key=self._wait)
            return
        candidates = list(self._candidates)  # a copy: a put on another thread may pop from that one
        for q in changed:
            if q in candidates:
                candidates.remove(q)
        for q in changed:
            if q.memory_bytes > q.memory_target:
                insort(candidates, q, key=self._wait)
        self._candidates = candidates

    def _wait(self, q: PersistentQueue) -> float:
        """How long `q`'s items in memory wait: its bytes held over its egress (bytes a second)."""
        record = self._records.get(q)
        egress = record.egress * _decay(self._tick - record.tick) if record is not None else 0.0
        return q.memory_bytes / max(egress, 1.0)

    def _release_idle_cursors(self) -> None:
        """A watched queue (in read-behind when last measured) whose egress and ingress have decayed
        under IDLE gives its cursor's read buffer and file back (its next change opens it again). Fed
        and not read, it keeps them: released every tick, each put opened the file again. The last
        step of a tick, in a walk that pauses every PACE queues (10,000 backlogs whose puts stop
        together close their files in one tick, a few microseconds each)."""
        watch = self._watch
        if not watch:
            return
        for record in paced(list(watch), self.runtime):
            if self.closed:  # during a pause
                return
            q = record.queue
            if q.closed or not q.in_read_behind:
                watch.discard(record)
            elif (record.egress + record.ingress) * _decay(self._tick - record.tick) < IDLE:
                watch.discard(record)
                q.release_cursor()
                if record.buffer and self._records.get(q) is record:
                    self._fixed_total -= record.buffer
                    record.fixed -= record.buffer
                    record.buffer = 0

    def _page_out_left(self) -> None:
        """Page out the queues a put left to this tick (`make_room`), still over their targets."""
        left, self._left = self._left, []
        for q in paced(left, self.runtime, SHED_PACE):
            if self.closed:  # during a pause
                return
            if q.memory_bytes > q.memory_target:  # (a queue deleted meanwhile sheds nothing)
                self.paged_out_total += q.shed()

    def _page_out(self, over: list[PersistentQueue], excess: int) -> int:
        """Shed the queues of `over` (those over their targets, in `_wait`'s order, the shortest
        wait first) from the longest wait down, until `excess` bytes are freed; the bytes freed."""
        freed = 0
        for q in paced(reversed(over), self.runtime, SHED_PACE):
            if freed >= excess or self.closed:
                break
            freed += q.shed()  # (a queue deleted during a pause sheds nothing)
        self.paged_out_total += freed
        return freed

    def make_room(self, queue: PersistentQueue, size: int) -> None:
        """A put of `size` bytes into `queue`'s memory would take the ledger over its limit: page
        out now rather than at the next tick. The queues the last tick found over their targets
        shed first, longest wait first, until the total is back under the low-water mark; one that
        frees nothing now is left to the next tick (another thread holds its lock, or placing its
        cursor would read what the page cache does not hold: this put must not wait for the disk).
        A put pages out at most SHED_PACE queues, so that it holds the loop a few milliseconds at
        most; the tick pages out the rest. If that is not enough, `queue` takes no more into memory
        (its new items go to read-behind, read back as its head drains), and if memory is over the
        budget even without this put, flow control starts now.
        """
        ledger = self.ledger
        goal = int(ledger.limit * LOW_WATER) - size
        candidates = self._candidates
        sheds = 0
        while ledger.total > goal and candidates and sheds < SHED_PACE:
            victim = candidates.pop()
            if not victim.closed:
                sheds += 1
                freed = victim.shed(wait=False)
                if not freed:
                    self._left.append(victim)
                self.paged_out_total += freed
        if ledger.total + size > ledger.limit:
            queue.hold_new_items_on_disk()
            if ledger.total > ledger.limit and not self.flow_control:
                self._start_flow(ledger.total, self._monotonic_ms())

    # -----------------------------------------------------------------------------------------
    # Flow control

    def _flow(self, total: int, now: int, unpageable: int) -> None:
        """Start after two ticks in a row over the budget once paged (a put starts it at once, in
        `make_room`); end under the low-water mark, or under the budget once paging has released
        all it can (`unpageable`: open reads, cursor buffers, heads): held above the mark by what
        only reads of those queues release, it refused every put for good (a put over the budget
        starts it again)."""
        over, self._over = self._over, total > self.budget
        if not self.flow_control and over and self._over:
            self._start_flow(total, now)
        elif self.flow_control and total <= max(self.budget * LOW_WATER, min(unpageable, self.budget)):
            self.flow_control = False
            spell = now - self._flow_since
            self.flow_control_ms += spell
            self._released.set()
            log.warning("memory back under budget: puts accepted again", memory=total,
                        max_memory_total=self.budget, held_ms=spell)

    def _start_flow(self, total: int, now: int) -> None:
        self.flow_control = True
        self.memory_total = total
        self._flow_since = now
        self._released.clear()
        # From inside a put (`make_room`), which must not pause: logged after it.
        log_later(self.runtime, log.warning, "memory over budget that paging cannot release: holding and "
                  "refusing puts", memory=total, max_memory_total=self.budget)

    def admit_put(self) -> None:
        """Under flow control: wait up to `hold_ms` for it to end, then raise MemoryBudgetExceeded."""
        if not self.flow_control:
            return
        self._released.wait(self.hold_ms / 1000.0)
        if self.flow_control:
            self.refused_puts += 1
            raise MemoryBudgetExceeded(
                f"server memory {self.memory_total} bytes went over max_memory_total {self.budget} and is "
                f"not yet under {int(self.budget * LOW_WATER)}, nor under the budget with nothing left to "
                f"page out (open reads and each queue's head stay in memory until read); put refused, "
                f"try again later")

    def measure(self) -> int:
        """What the queues hold in memory now: items, open reads, read-behind buffers (a walk that
        lets the other tasks in where they share one thread, as the plan's walks do)."""
        return sum(sum(q.held_bytes()) for q in paced(list(self._queues()), self.runtime) if not q.closed)

    def stats(self) -> dict[str, int]:
        """The server's figures (memcache stats, /stats.json, /metrics)."""
        under = self.flow_control_ms
        if self.flow_control:
            under += self._monotonic_ms() - self._flow_since
        return {
            "memory_total": self.measure(),
            "max_memory_total": self.budget,
            "memory_paged_total": self.paged_out_total,
            "flow_control": int(self.flow_control),
            "flow_control_ms": under,
            "flow_control_refused": self.refused_puts,
        }
