"""The admin page's figures: a snapshot of the server and of every queue, taken when a page asks and
shared by every page that asks within SNAPSHOT_S (or longer, where the server has so many queues
that a snapshot a second would take more than SHARE of its time), with the rates since the
snapshot before and a few minutes of history.

Nothing runs while no page is open: no timer, no sampling. A snapshot reads what `/stats.json`
reads (`stats_render.server_document`, and each queue's `stats()`, what `queue_stats()` is made
of), SLICE queues at a time with a yield to the loop between slices, so that 10,000 queues never
hold the clients up for long, and the totals of the journal write, fsync and pack histograms
`/metrics` shows; its JSON is encoded once, whatever the number of pages open.

Rates are derived, not counted: a queue's items in are the growth of its `total_items`, its items
out that less the growth of its `items` (taken, expired, discarded or flushed). The server's are
the sums over its queues, so a put to a queue with two fanout children counts three items in.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from kestrel.service import metrics
from kestrel.service.session.server_state import ServerState
from kestrel.service.stats_render import server_document
from kestrel.storage.config import QueueConfig

SNAPSHOT_S = 0.9  # a snapshot answers every page asking within this long (pages poll every second)
SHARE = 0.05  # or longer, so that taking snapshots keeps to this share of the server's time
SLICE = 500  # queues read between two yields to the loop (a few milliseconds)
HISTORY_POINTS = 300  # about five minutes at a snapshot a second
MAX_GAP_S = 5.0  # snapshots further apart (or than 3 lifetimes) give no rates, and break the lines
WATCH_S = 60.0  # a queue page's history is kept this long after the page last asked
MAX_WATCHED = 16  # queue pages whose history is kept at once

# One row per queue in the snapshot's JSON, in this order (the page reads the names).
COLUMNS = ("name", "state", "items", "bytes", "open_reads", "head_wait_ms", "in", "out", "poisoned", "format")

SERVING, READ_BEHIND, PAGED_OUT, FLOW_CONTROLLED, READ_ONLY, REFUSED = (
    "serving", "read-behind", "paged out", "flow-controlled", "read-only", "refused")


def queue_state(stats: dict[str, int], config: QueueConfig, flow_control: bool) -> str:
    """One word for how a queue serves: read-only (its journal cannot be written), flow-controlled
    (the server holds and refuses puts: memory is over max_memory_total), paged out (items wait on
    disk because the memory budget's share for it is under its max_memory_size), read-behind (items
    past its max_memory_size wait on disk), or serving. A refused queue has no stats: REFUSED."""
    if stats["read_only"]:
        return READ_ONLY
    if flow_control:
        return FLOW_CONTROLLED
    if stats["read_behind"]:
        return PAGED_OUT if stats["memory_target"] < config.max_memory_size else READ_BEHIND
    return SERVING


class Series:
    """A few figures sampled at snapshot times (the server clock's monotonic seconds), oldest first,
    at most HISTORY_POINTS of them; a sample of None values marks a gap (no snapshot for a while)."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self.points: deque[tuple[float, tuple[float | None, ...]]] = deque(maxlen=HISTORY_POINTS)

    def add(self, taken: float, values: tuple[float | None, ...]) -> None:
        self.points.append((taken, values))

    def columns(self, now: Snapshot) -> dict[str, list[Any]]:
        """{"time": [ms, ...], name: [value, ...], ...}: the layout the page's charts take. Each
        sample's time is told back from snapshot `now`'s wall-clock time by the monotonic time
        since: the times stay in order, as far apart as the samples were, whatever steps the wall
        clock took meanwhile (the charts take an ascending time axis)."""
        times = [now.time_ms - round((now.taken - t) * 1000) for t, _ in self.points]
        out: dict[str, list[Any]] = {"time": times}
        for i, name in enumerate(self.names):
            out[name] = [values[i] for _, values in self.points]
        return out


@dataclass
class Snapshot:
    taken: float  # the server clock's monotonic seconds
    time_ms: int
    rates: dict[str, tuple[float, float]] = field(default_factory=dict)  # queue -> (in, out) per second
    body: bytes = b""  # the overview's JSON
    fresh_for: float = SNAPSHOT_S  # seconds it answers every page for


class Figures:
    """The snapshots, the counters they derive rates from, and the history the charts draw."""

    def __init__(self, server: ServerState) -> None:
        self.server = server
        self.clock = server.runtime.clock
        self._snapshot: Snapshot | None = None
        self._taking = server.runtime.event()  # set while no snapshot is being taken
        self._taking.set()
        self._counts: dict[str, tuple[int, int]] = {}  # queue -> (total_items, items) at the last snapshot
        self._history = Series(("in", "out", "items"))
        self._watched: dict[str, tuple[float, Series]] = {}  # queue -> (last asked, its history)

    def snapshot(self) -> Snapshot:
        """The latest snapshot, taken now if it has served its time (one at a time: a page asking
        meanwhile waits for it)."""
        while True:
            snapshot = self._snapshot
            if snapshot is not None and self.clock.monotonic() - snapshot.taken < snapshot.fresh_for:
                return snapshot
            if self._taking.is_set():
                break
            self._taking.wait()
        self._taking.clear()
        try:
            self._snapshot = self._take()
        finally:
            self._taking.set()
        return self._snapshot

    def watch(self, name: str) -> Series:
        """The history of queue `name`, kept from now on while its page keeps asking."""
        now = self.clock.monotonic()
        entry = self._watched.get(name)
        series = entry[1] if entry is not None else Series(("items", "in", "out"))
        self._watched[name] = (now, series)
        for stale in [n for n, (asked, _) in self._watched.items() if now - asked > WATCH_S]:
            del self._watched[stale]
        while len(self._watched) > MAX_WATCHED:
            del self._watched[min(self._watched, key=lambda n: self._watched[n][0])]
        return series

    # -----------------------------------------------------------------------------------------

    def _take(self) -> Snapshot:
        server = self.server
        previous = self._snapshot
        taken = self.clock.monotonic()
        snapshot = Snapshot(taken, self.clock.now_ms())
        seconds = taken - previous.taken if previous is not None else None
        if previous is not None and not 0 < taken - previous.taken <= max(MAX_GAP_S, 3 * previous.fresh_for):
            seconds = None
        started = time.thread_time()
        document = server_document(server)
        flow_control = bool(document["server"].get("flow_control"))
        counts: dict[str, tuple[int, int]] = {}
        pieces = []
        busy = 0.0
        for names in self._slices():
            busy += time.thread_time() - started
            server.runtime.pause()  # let the clients in between slices
            started = time.thread_time()
            rows = self._rows(names, seconds, flow_control, counts, snapshot.rates)
            if rows:
                pieces.append(json.dumps(rows, separators=(",", ":"))[1:-1])
        for name in document["refused_queues"]:
            pieces.append(json.dumps([[name, REFUSED, *[None] * (len(COLUMNS) - 2)]])[1:-1])
        self._counts = counts
        rates = None
        if seconds is None:
            self._history.add(snapshot.taken, (None, None, None))  # a gap
        else:
            rates = {"in": round(sum(r[0] for r in snapshot.rates.values()), 1),
                     "out": round(sum(r[1] for r in snapshot.rates.values()), 1)}
            items = sum(count[1] for count in counts.values())
            self._history.add(snapshot.taken, (rates["in"], rates["out"], items))
        self._sample_watched(snapshot, counts if seconds is not None else None)
        journal_io = {event: {"count": count, "seconds": seconds}
                      for event, (count, seconds) in metrics.storage_totals().items()}
        document.update(time_ms=snapshot.time_ms, max_queues=server.config.max_queues, rates=rates,
                        journal_io=journal_io, history=self._history.columns(snapshot), columns=COLUMNS)
        head = json.dumps(document, separators=(",", ":"))
        snapshot.body = f'{head[:-1]},"rows":[{",".join(pieces)}]}}'.encode()
        busy += time.thread_time() - started  # CPU: a loaded machine's waits do not count
        snapshot.fresh_for = max(SNAPSHOT_S, busy / SHARE)
        return snapshot

    def _rows(self, names: list[str], seconds: float | None, flow_control: bool,
              counts: dict[str, tuple[int, int]], rates: dict[str, tuple[float, float]]) -> list[list[Any]]:
        """The table's rows of the queues `names` (each queue's `stats()`), with their rates over the
        `seconds` since the last snapshot (None: too long ago, or none), keeping their counts."""
        get = self.server.collection.get
        last_counts = self._counts
        rows = []
        for name in names:
            q = get(name)
            if q is None:
                continue  # deleted since the list was read
            stats = q.stats()
            count = counts[name] = (stats["total_items"], stats["items"])
            rate_in = rate_out = None
            if seconds is not None:
                last = last_counts.get(name, (0, 0))
                added = max(count[0] - last[0], 0)
                left = max(added - (count[1] - last[1]), 0)
                rate_in, rate_out = rates[name] = (round(added / seconds, 1), round(left / seconds, 1))
            rows.append([name, queue_state(stats, q.config, flow_control), stats["items"], stats["bytes"],
                         stats["open_transactions"], stats["head_wait_ms"], rate_in, rate_out,
                         stats["poisoned"], stats["journal_format"]])
        return rows

    def _slices(self) -> Iterator[list[str]]:
        names = self.server.collection.queue_names()
        for start in range(0, len(names), SLICE):
            yield names[start:start + SLICE]

    def _sample_watched(self, snapshot: Snapshot, counts: dict[str, tuple[int, int]] | None) -> None:
        for name, (_, series) in self._watched.items():
            rates = snapshot.rates.get(name)
            if counts is None or name not in counts or rates is None:
                series.add(snapshot.taken, (None, None, None))
            else:
                series.add(snapshot.taken, (counts[name][1], *rates))
