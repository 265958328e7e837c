"""Prometheus metrics for `/metrics`, rendered by prometheus-client, and `/metrics/per-queue`.

Three sources: latency histograms, fed as things happen (requests through `timed`/`observe`, journal
writes, fsyncs and packs through storage's timing hook); the server's Kestrel figures, read at scrape
time from `server_document` and, per queue, each queue's `stats()` (`ServerState.queue_stats`), the
sources `/stats.json` shows too, so they agree; and the process's own (`process_*`: CPU, memory,
descriptors). The sums over the queues on `/metrics` read the five figures summed from each queue
and build no queue's document: with 10,000 queues that was most of a scrape.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kestrel.service.histogram_series import HistogramSeries
from kestrel.service.session.server_state import ServerState
from kestrel.service.session.status import Status
from kestrel.service.stats_render import QUEUES_A_SLICE, Pieces, server_document
from kestrel.storage import journal_file
from kestrel.storage.clock import perf_counter
from kestrel.storage.runtime import paced

__all__ = ["CONTENT_TYPE_LATEST", "install_storage_timing", "observe", "render", "render_per_queue",
           "request_latency", "timed"]

T = TypeVar("T")


class LoopHistogram(Collector):
    """A latency histogram observed from the event loop's thread only, so with no lock.

    prometheus-client's `Histogram` takes a lock for its sum and again for its bucket at each
    observation (1.3 µs under gevent's patched locks, against 0.16 µs here), and a request makes two
    (its own latency and its journal write's). Observations happen on the loop's thread (requests,
    journal writes, fsync rounds and packs all finish there), so plain counts suffice; they are
    handed to prometheus-client as a `HistogramMetricFamily` when scraped."""

    def __init__(self, name: str, documentation: str, buckets: tuple[float, ...],
                 labelnames: tuple[str, ...] = ()) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = list(labelnames)
        self.bounds = (*sorted(buckets), math.inf)
        self._series: dict[tuple[str, ...], HistogramSeries] = {}

    def labels(self, *values: str) -> HistogramSeries:
        series = self._series.get(values)
        if series is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name} takes labels {self.labelnames}, not {values}")
            series = self._series[values] = HistogramSeries(self.bounds)
        return series

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, series in list(self._series.items()):
            buckets, running = [], 0
            for bound, count in zip(self.bounds, series.counts, strict=True):
                running += count
                buckets.append((floatToGoString(bound), running))  # type: ignore[no-untyped-call]
            family.add_metric(list(values), buckets, series.sum)
        yield family


# Requests range from microseconds (a memcache get) to minutes (a get that waits for an item).
_REQUEST_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
_DISK_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
                 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_PACK_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0)

REQUEST_SECONDS = LoopHistogram(
    "kestrel_request_duration_seconds",
    "Time from a request's arrival to its answer, by protocol and command; includes time spent waiting "
    "for an item (get with a timeout, monitor).",
    _REQUEST_BUCKETS, ("protocol", "command"))
_STORAGE_HISTOGRAMS = {
    "write": LoopHistogram("kestrel_journal_write_duration_seconds",
                           "Time to hand one batch of journal records to the operating system (write(2)).",
                           _DISK_BUCKETS),
    "fsync": LoopHistogram("kestrel_journal_fsync_duration_seconds",
                           "Time of one journal fsync; writers that arrive during it share the next one.",
                           _DISK_BUCKETS),
    "pack": LoopHistogram("kestrel_journal_pack_duration_seconds",
                          "Time to pack a queue's rotated journals into one file (runs in the background).",
                          _PACK_BUCKETS),
}
_STORAGE_SECONDS = {event: histogram.labels() for event, histogram in _STORAGE_HISTOGRAMS.items()}
HISTOGRAMS = (REQUEST_SECONDS, *_STORAGE_HISTOGRAMS.values())

_request_series: dict[tuple[str, str], HistogramSeries] = {}


def request_latency(protocol: str, command: str) -> HistogramSeries:
    """The histogram of one command's answer times (a connection may keep it, to skip the lookup)."""
    series = _request_series.get((protocol, command))
    if series is None:
        series = _request_series[(protocol, command)] = REQUEST_SECONDS.labels(protocol, command)
    return series


def observe(protocol: str, command: str, seconds: float) -> None:
    """Record how long one request took to answer."""
    request_latency(protocol, command).observe(seconds)


def timed(protocol: str, command: str, call: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """`call(*args, **kwargs)`, its duration recorded under `protocol` and `command` (also when it
    raises)."""
    started = perf_counter()
    try:
        return call(*args, **kwargs)
    finally:
        observe(protocol, command, perf_counter() - started)


def storage_totals() -> dict[str, tuple[int, float]]:
    """(count, seconds) of each storage event so far ("write", "fsync", "pack"): the histograms' totals."""
    return {event: (sum(series.counts), series.sum) for event, series in _STORAGE_SECONDS.items()}


def install_storage_timing() -> None:
    """Route storage's journal write, fsync and pack timings to the histograms."""
    for event, series in _STORAGE_SECONDS.items():
        setattr(journal_file.timings, event, series)


# ---------------------------------------------------------------------------------------------
# The Kestrel figures, by Prometheus's conventions
#
# /stats.json and memcache `stats` keep Kestrel's names, which its clients read; here each figure
# gets a name by Prometheus's rules: base units (seconds, bytes), `_total` on counters alone. A
# figure left out of these tables is not exported (tests/server/test_metrics.py checks each is
# placed). `/metrics` holds the server's figures and sums over its queues, a few series whatever
# the number of queues; `/metrics/per-queue` each queue's own, as RabbitMQ's plugin splits them.


@dataclass(frozen=True)
class Figure:
    """How one Kestrel figure is exported: its Prometheus name, kind, help, and scale to base units."""

    name: str
    kind: str  # "counter" or "gauge"
    help: str
    scale: float = 1.0


def _counter(name: str, help_text: str, scale: float = 1.0) -> Figure:
    return Figure(name, "counter", help_text, scale)


def _gauge(name: str, help_text: str, scale: float = 1.0) -> Figure:
    return Figure(name, "gauge", help_text, scale)


MS = 0.001  # Kestrel counts milliseconds; Prometheus, seconds

# Kestrel's server figure -> how it is exported (None: not exported, and why).
SERVER_FIGURES: dict[str, Figure | None] = {
    "uptime": None,  # process_start_time_seconds
    "time": None,  # the scrape's own timestamp
    "version": None,  # kestrel_build_info
    "curr_items": _gauge("kestrel_items",
                         "Items waiting in every queue (open reads are kestrel_open_reads)."),
    "total_items": _counter("kestrel_items_added_total",
                            "Items ever added to a queue (fanout copies count)."),
    "bytes": _gauge("kestrel_item_bytes", "Bytes of item data in every queue."),
    "reserved_memory_ratio": None,  # Kestrel's text figure; the queues' memory targets are exported
    "curr_connections": _gauge("kestrel_open_connections", "Client connections open now, every protocol."),
    "total_connections": _counter("kestrel_accepted_connections_total", "Client connections accepted."),
    "cmd_get": _counter("kestrel_get_requests_total", "Get requests; a get that waits counts once."),
    "cmd_set": _counter("kestrel_put_items_total", "Items offered by put and set requests, stored or not."),
    "cmd_peek": _counter("kestrel_peek_requests_total", "Peek requests."),
    "get_hits": _counter("kestrel_get_hits_total", "Gets and peeks that found an item; a Thrift get: each."),
    "get_misses": _counter("kestrel_get_misses_total", "Gets and peeks that found their queue empty."),
    "bytes_read": _counter("kestrel_received_bytes_total", "Bytes read from clients."),
    "bytes_written": _counter("kestrel_sent_bytes_total", "Bytes written to clients."),
    "queue_creates": _counter("kestrel_queues_created_total", "Queues created, at start-up or by a request."),
    "queue_deletes": _counter("kestrel_queues_deleted_total",
                              "Queues deleted by a request or for their age."),
    "queue_expires": _counter("kestrel_queues_expired_total", "Queues deleted for reaching max_queue_age."),
    "refused_queues": _gauge("kestrel_refused_queues", "Queues refused (at start-up, or as first named after "
                             "it) because their files are damaged or cannot be written; they answer every "
                             "request with an error, the others serve."),
    "memory_total": _gauge("kestrel_memory_held_bytes", "Bytes the queues hold in memory: items, open "
                           "reads, read-behind buffers (counted against kestrel_memory_budget_bytes)."),
    "max_memory_total": _gauge("kestrel_memory_budget_bytes", "The memory budget of every queue together "
                               "(max_memory_total); 0 when there is none."),
    "memory_paged_total": _counter("kestrel_memory_paged_out_bytes_total", "Bytes of items paged out of "
                                   "memory to stay under the budget, since start (each read back from its "
                                   "journal as its queue drains; what waits there now: "
                                   "kestrel_paged_out_bytes)."),
    "flow_control": _gauge("kestrel_flow_control", "1 while puts wait and are refused because memory stays "
                           "over the budget, else 0."),
    "flow_control_ms": _counter("kestrel_flow_control_seconds_total", "Time spent under flow control.", MS),
    "flow_control_refused": _counter("kestrel_flow_control_refused_puts_total",
                                     "Puts refused under flow control."),
    "gc_full_collections": _counter("kestrel_gc_full_collections_total", "Full garbage collections of the "
                                    "server's process: the loop answers nobody during each."),
    "gc_full_collection_ms": _counter("kestrel_gc_full_collection_seconds_total",
                                      "Time spent in full garbage collections.", MS),
    "gc_longest_full_collection_ms": _gauge("kestrel_gc_longest_full_collection_seconds",
                                            "The longest full garbage collection since start.", MS),
    "gc_objects": _gauge("kestrel_gc_objects", "Objects the last full garbage collection left unfrozen: "
                         "where the next one's walk starts."),
    "gc_frozen_objects": _gauge("kestrel_gc_frozen_objects", "Objects frozen out of the garbage collector's "
                                "walks (the loaded queues, and what a full collection left), counted "
                                "at most once a second."),
    "gc_freezes": _counter("kestrel_gc_freezes_total", "Times the objects alive were frozen."),
}

# Kestrel's per-queue figure -> how each queue's is exported on /metrics/per-queue, label `queue`.
QUEUE_FIGURES: dict[str, Figure | None] = {
    "items": _gauge("kestrel_queue_items",
                    "Items waiting in the queue (open reads are kestrel_queue_open_reads)."),
    "bytes": _gauge("kestrel_queue_item_bytes", "Bytes of item data in the queue."),
    "total_items": _counter("kestrel_queue_items_added_total", "Items ever added to the queue."),
    "logsize": None,  # the live file of journal_size
    "journal_size": _gauge("kestrel_queue_journal_bytes", "Bytes of the queue's journal files on disk; a "
                           "Kestrel 3 queue's writer files count in its own, not its fanout children's."),
    "expired_items": _counter("kestrel_queue_items_expired_total", "Items that expired in the queue."),
    "mem_items": _gauge("kestrel_queue_memory_items", "Items held in memory; the rest wait in the journal."),
    "mem_bytes": _gauge("kestrel_queue_memory_bytes", "Bytes of item data held in memory."),
    "age": _gauge("kestrel_queue_last_item_age_seconds", "How long the last item taken had waited in the "
                  "queue (0 once the queue is empty).", MS),
    "age_msec": None,  # the same figure as age
    "discarded": _counter("kestrel_queue_items_discarded_total", "Items dropped because the queue was full "
                          "(discard_old_when_full)."),
    "waiters": _gauge("kestrel_queue_waiters", "Clients waiting for an item."),
    "open_transactions": _gauge("kestrel_queue_open_reads",
                                "Reads handed out, not yet confirmed or aborted."),
    "transactions": _counter("kestrel_queue_reads_opened_total", "Reliable reads opened."),
    "canceled_transactions": _counter("kestrel_queue_reads_aborted_total", "Reliable reads aborted: by the "
                                      "client, the auto-abort timer or a disconnect."),
    "total_flushes": _counter("kestrel_queue_flushes_total", "Times the queue was flushed."),
    "create_time": _gauge("kestrel_queue_created_timestamp_seconds", "When the queue was created, in "
                          "seconds since the epoch.", MS),
    "read_only": _gauge("kestrel_queue_read_only", "1 while the queue refuses changes after a failed journal "
                        "write, until a probe write succeeds; else 0."),
    "journal_write_errors": _counter("kestrel_queue_journal_write_errors_total", "Journal writes that failed "
                                     "(full disk, I/O error)."),
    "poisoned": _counter("kestrel_queue_items_poisoned_total", "Items aborted max_errors times, moved to the "
                         "error_queue or dropped."),
    "memory_target": _gauge("kestrel_queue_memory_target_bytes", "Bytes of items the queue may hold in "
                            "memory now: its share of the memory budget."),
    "paged_out": _gauge("kestrel_queue_paged_out_bytes", "Bytes of the queue's items only in its journal."),
    "head_wait_ms": _gauge("kestrel_queue_head_item_age_seconds", "How long the item at the head of the "
                           "queue has waited since it was added (0 when the queue is empty).", MS),
    "read_behind": _gauge("kestrel_queue_read_behind", "1 while items of the queue wait in its journal to be "
                          "read back into memory; else 0."),
    "journal_format": _gauge("kestrel_queue_journal_format", "The queue's journal format: 2 (Kestrel 2's "
                             "journal) or 3 (Kestrel 3's writer and reader files)."),
}

# Sums over the queues on /metrics (`queue_sums`): gauges, since a sum falls when a queue is deleted.
QUEUE_SUMS: dict[str, Figure] = {
    "open_transactions": _gauge("kestrel_open_reads", "Reads handed out, not yet confirmed or aborted, in "
                                "every queue."),
    "waiters": _gauge("kestrel_waiters", "Clients waiting for an item, on every queue."),
    "journal_size": _gauge("kestrel_journal_bytes", "Bytes of journal files on disk, every queue's, each "
                           "file once."),
    "read_only": _gauge("kestrel_read_only_queues", "Queues refusing changes after a failed journal write."),
    "paged_out": _gauge("kestrel_paged_out_bytes", "Bytes of items only in the journals, every queue."),
}

STATUSES = (Status.UP, Status.READ_ONLY, Status.QUIESCENT)


def queue_sums(server: ServerState) -> tuple[int, dict[str, int]]:
    """How many queues there are, and QUEUE_SUMS's figures summed over them (under the names of
    `PersistentQueue.stats`), read from each queue a slice at a time (`paced`)."""
    queues = server.collection.queues()
    opens = waiters = journal = read_only = paged = 0
    for q in paced(queues, server.runtime):
        opens += q.open_transactions
        waiters += q.waiters
        journal += q.journal_size
        read_only += q.read_only
        paged += q.paged_out
    return len(queues), {"open_transactions": opens, "waiters": waiters, "journal_size": journal,
                         "read_only": read_only, "paged_out": paged}


def _family(figure: Figure, labels: list[str] | None = None) -> CounterMetricFamily | GaugeMetricFamily:
    if figure.kind == "counter":
        return CounterMetricFamily(figure.name.removesuffix("_total"), figure.help, labels=labels)
    return GaugeMetricFamily(figure.name, figure.help, labels=labels)


class ServerCollector(Collector):
    """/metrics: the server's figures, its status and server-set membership, sums over its queues
    (`stats`: `server_document`; `queues`: how many; `sums`: by the names of QUEUE_SUMS)."""

    def __init__(self, stats: dict[str, Any], queues: int, sums: dict[str, int]) -> None:
        self.stats = stats
        self.queues = queues
        self.sums = sums

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        info = InfoMetricFamily("kestrel_build", "The server's version.")
        info.add_metric([], {"version": str(stats["server"]["version"])})
        yield info
        status = GaugeMetricFamily("kestrel_status", "The server's status (set_status, the status command): "
                                   "1 for the current one. Up takes every request, ReadOnly refuses changes, "
                                   "Quiescent everything but closing open reads.", labels=["status"])
        # Without a status file the server is always Up.
        current = Status.UP.label if stats["status"] == Status.NOT_CONFIGURED.label else stats["status"]
        for each in STATUSES:
            status.add_metric([each.label], 1.0 if each.label == current else 0.0)
        yield status
        sets = stats["server_sets"]
        if sets is not None:
            connected = GaugeMetricFamily("kestrel_zookeeper_connected", "1 while the server has a ZooKeeper "
                                          "session, else 0.", value=1.0 if sets["connected"] else 0.0)
            yield connected
            member = GaugeMetricFamily("kestrel_server_set_member", "1 while the server is a member of the "
                                       "ZooKeeper server set (read or write), else 0.", labels=["set"])
            for name in ("read", "write"):
                member.add_metric([name], 1.0 if sets[name] else 0.0)
            yield member
        for key, value in stats["server"].items():
            figure = SERVER_FIGURES.get(key)
            if figure is not None:
                family = _family(figure)
                family.add_metric([], value * figure.scale)
                yield family
        yield GaugeMetricFamily("kestrel_queues", "Queues the server holds (fanout children count).",
                                value=self.queues)
        for key, figure in QUEUE_SUMS.items():
            family = _family(figure)
            family.add_metric([], float(self.sums[key]))
            yield family


def _label_value(name: str) -> str:
    """A queue's name as a label value. Labels are UTF-8, and a Kestrel 2 queue's name may hold a lone
    surrogate (a key of bytes that are not UTF-8): it is written as `/stats.json` shows it, `\\udcff`."""
    text = name.encode("utf-8", "backslashreplace").decode("utf-8")
    return text.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _family_header(name: str, kind: str, help_text: str) -> str:
    escaped = help_text.replace("\\", "\\\\").replace("\n", "\\n")
    return f"# HELP {name} {escaped}\n# TYPE {name} {kind}\n"


REFUSED_HELP = ("1 for a queue refused (at start-up, or as first named after it) because its files are "
                "damaged or cannot be written (/stats.json says where and why); it answers every request "
                "with an error until repaired.")


def render_per_queue(server: ServerState) -> Pieces:
    """/metrics/per-queue: each queue's figures labelled `queue`, and each refused queue as 1.

    Written here in Prometheus's text format rather than by prometheus-client, which renders a page
    in one call: 10,000 queues are about 220,000 series, and that call held every client for
    seconds. The queues are walked once, a slice at a time with the others served between, each
    queue's figures appended to their families' lines."""
    families = [(key, figure.name, figure.scale, [_family_header(figure.name, figure.kind, figure.help)])
                for key, figure in QUEUE_FIGURES.items() if figure is not None]
    for queue, figures in paced(server.queue_stats().items(), server.runtime, every=QUEUES_A_SLICE):
        label = _label_value(queue)
        for key, name, scale, lines in families:
            if key in figures:
                lines.append(f'{name}{{queue="{label}"}} {floatToGoString(figures[key] * scale)}\n')  # type: ignore[no-untyped-call]
    refused = [_family_header("kestrel_queue_refused", "gauge", REFUSED_HELP)]
    refused.extend(f'kestrel_queue_refused{{queue="{_label_value(queue)}"}} 1.0\n'
                   for queue in server.collection.refused_queues())
    # Each family joined on its own, the others served between, a piece of the page: the page joined
    # at once was the longest stretch of it (11 MB at 10,000 queues).
    texts = [*(lines for *_, lines in families), refused]
    return ["".join(lines).encode() for lines in paced(texts, server.runtime, every=1)]


def render(server: ServerState) -> bytes:
    """The text exposition for `/metrics`: the server's figures, sums over its queues, histograms,
    and the process's figures."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ServerCollector(server_document(server), *queue_sums(server)))
    for histogram in HISTOGRAMS:
        registry.register(histogram)
    process = CollectorRegistry(auto_describe=False)
    ProcessCollector(registry=process)
    # The process's figures list every open descriptor in /proc (10,000 queues' journals take tens
    # of milliseconds): read on a thread, the clients served meanwhile.
    return generate_latest(registry) + server.runtime.run_blocking(generate_latest, process)
