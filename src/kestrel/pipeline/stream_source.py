"""`spark.readStream.format("kestrel")`: queues as a stream, exactly-once into idempotent sinks.

How a micro-batch lives:
1. Planning (driver, `latestOffset`): ask every server that answers, all at once over the
   driver's pooled connections, which queues it holds and how many items each of the stream's
   holds (`peek_items`, which creates nothing), and decide how many items to take from each,
   within `maxItemsPerTrigger`. No items are taken yet; an idle stream only asks.
2. Reading (executors, `read`): each partition checks that it sees the checkpoint the driver
   wrote, takes its share as open reads and writes them, with their read ids, to the write-ahead
   log under the checkpoint before Spark sees a row. A replayed batch reads the log instead of
   the servers, so it yields the same rows: it is split as it was planned (the split is kept in its
   offset), whatever the options of the query that replays it.
3. Committing: once Spark's commit log shows the batch committed by the sink (the driver's keeper
   thread looks every COMMIT_WATCH_S while a batch awaits its commit, and at every planning: Spark
   tells a source of a commit only when it plans the next batch, and a stopped query ends the
   source without calling its stop()), its read ids are confirmed, off the planning's path, while
   the next batch is fetched; a planning with nothing to take confirms at once (an AvailableNow
   query ends after it). A confirm the server could not take stays pending in the log and is tried
   again, never dropped.

Reads in flight are handed to the log, not renewed: Kestrel has no call that extends an open read,
so reads older than half of `autoAbortMs` are confirmed early, their items already safe in the log
(a replay of the batch reads them from there). No read of a live batch times out and comes back,
however long the sink takes.

A server's read ids are unique for the life of its queue directory, so logged ids are confirmed
over any connection to their server, by whichever query runs from the checkpoint: a query restarted
after a stop or a driver kill confirms the batches the sink committed, and confirms at once the
logged reads of the batch it replays (their rows come from the log). An id from before a server
restart closes nothing (the restarted server never hands it out again): the restart returned its
item to the queue, the item is delivered again, and is counted as a possible duplicate
(`<checkpoint>/kestrel/<source>/returned`), as are the reads of a queue deleted and made anew since
the fetch, which a confirm cannot tell from a restart; those of a queue deleted for good are not.

A server that does not answer within `timeoutMs` is left out of the plannings that follow and
asked again in the background, once a second, so that it stalls no batch but the one that found it
gone; the query fails once no server has answered for `unreachableTimeoutMs`. An AvailableNow
query cannot go on without one: a server that holds items it is to take must answer, or it fails.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
import uuid
from collections.abc import Collection, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar

import structlog
from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)

from kestrel.client import Cluster, KestrelClientError, ServerUnavailable
from kestrel.pipeline import wal
from kestrel.pipeline.options import Option, parse_options, queue_names, reader_name, text, whole
from kestrel.pipeline.rows import queue_rows
from kestrel.pipeline.servers import Reachability, ServersUnreachable, parse_servers, take_open_reads
from kestrel.pipeline.subscription import Subscription
from kestrel.pipeline.worker import source_stopping, spare_collections, stop_source_when_terminated

log = structlog.get_logger("kestrel.pipeline")

# PySpark (4.3 included) gives a Python streaming source neither its query's checkpoint location nor
# any other per-query directory (the JVM's toMicroBatchStream(checkpointLocation) drops it), so the
# location comes again as an option.
CHECKPOINT_HELP = ("give the source the same path as the query's own checkpoint location, "
                   "readStream.format('kestrel').option('checkpointLocation', path) and "
                   "writeStream.option('checkpointLocation', path): the source keeps its write-ahead log "
                   "of taken items there and reads Spark's commit log from there, and PySpark does not tell "
                   "a Python source where its query's checkpoint is")

# Spark passes every trigger the source's default read limit except Trigger.Once, which gets
# ReadAllAvailable: the default is therefore never ReadAllAvailable, so that Once can be told apart.
NO_CAP = 2**63 - 1

ONCE_REFUSED = ("kestrel stream: Trigger.Once is not supported; use .trigger(availableNow=True). Spark "
                "plans nothing after the only batch of a Once query and does not stop the source, so the "
                "source never learns that the sink committed the batch: its items would stay open reads, "
                "return to their queue after autoAbortMs and be delivered again by the next run. "
                "AvailableNow takes what the queues hold when the query starts (in batches of at most "
                "maxItemsPerTrigger), confirms every batch the sink committed, then stops")

# Reads in flight are confirmed once older than half of autoAbortMs, looked at every sixteenth of
# it: a driver that stops leaves none at risk for longer than 9/16 of autoAbortMs after its fetch,
# so a restart within 7/16 of autoAbortMs of the stop duplicates nothing (RESTART_WINDOW). A read's
# age is the wall clock's since its fetch, or, where the driver's wall clock stepped back, the time
# its monotonic clock has run since the keeper first saw the log file plus the fetch's own time:
# short of the true age by the file's writing and one look of the keeper (COMMIT_WATCH_S), so
# through such a step the window is that much, a few tens of ms, narrower.
EARLY_CONFIRM = 1 / 2
KEEPER_PERIOD = 1 / 16
RESTART_WINDOW = 1 - EARLY_CONFIRM - KEEPER_PERIOD

# While a planned batch is not yet committed, the keeper looks at Spark's commit log this often:
# Spark tells a source of a commit only when it plans the next batch, and a query stopped before
# that ends the source's process without calling its stop(), so a committed batch must be confirmed
# on its own, at once. A look is a listing of the commit log's folder.
COMMIT_WATCH_S = 0.05

# Each partition costs Spark a task, and the source a fetch begun and a log file fsynced: at 10,000
# items a partition a stream ran at about 40% of its speed at 50,000 (bench/README.md). A task holds
# its partition's items in memory about three times over (fetched, logged, as Arrow).
ITEMS_PER_PARTITION = 50_000

STREAM_OPTIONS = [
    Option("servers", text, doc="host:port,host:port,..."),
    Option("queue", queue_names, doc="one queue, or several comma-separated; `*`, `?` and `[...]` make a "
                                     "pattern over the queues the servers hold, new ones joining"),
    Option("reader", reader_name, None, "read each queue's fanout child <queue>+<reader>, created for it"),
    Option("checkpointLocation", text, doc="the query's own checkpoint location, again (the log goes there)"),
    Option("maxItemsPerTrigger", whole(1), None, "a cap on the items of one micro-batch, over all servers"),
    Option("itemsPerPartition", whole(1), ITEMS_PER_PARTITION,
           "a server's share is split into partitions of this size"),
    Option("minPartitions", whole(1), None, "at least this many partitions per micro-batch, when it has as "
                                            "many items"),
    Option("autoAbortMs", whole(1000), 600_000, "open reads return to their queue if not confirmed in time; "
                                                "a restarted query duplicates nothing within 7/16 of it"),
    Option("timeoutMs", whole(100), 10_000, "a call a server has not answered in this time counts as failed"),
    Option("unreachableTimeoutMs", whole(0), 120_000, "fail the query once no server has answered for this "
                                                       "long (0: never)"),
]


class CheckpointNotShared(RuntimeError):
    """Raised in a task that does not see the checkpoint the driver wrote: the executors' log of
    taken items would be lost to the driver, which confirms from it."""


class StreamPartition(InputPartition):
    """One task's share of one queue on one server in one micro-batch."""

    def __init__(self, path: str, server: str, queue: str, quota: int, auto_abort_ms: int, timeout_ms: int,
                 token: str, opened_at: int | None) -> None:
        super().__init__(path)
        self.path, self.server, self.queue, self.quota = path, server, queue, quota
        self.auto_abort_ms, self.timeout_ms = auto_abort_ms, timeout_ms
        self.token, self.opened_at = token, opened_at


def read_partition(partition: StreamPartition) -> Iterator[Any]:
    """The partition's rows: from the log if it exists, else fetched and logged first."""
    if os.path.exists(partition.path):
        logged = wal.read_items(partition.path)
    else:
        check_shared(partition)
        started, began = time.time(), time.monotonic()
        # A server failing mid-fetch leaves this batch shorter; the next batch asks it again.
        taken = take_open_reads(partition.server, partition.queue, partition.quota, partition.auto_abort_ms,
                                partition.timeout_ms)
        logged = wal.Logged(taken.items, taken.added, taken.expiry)
        header = wal.WalHeader(partition.server, started, len(taken.ids), partition.queue,
                               opened_at=partition.opened_at, took=time.monotonic() - began,
                               auto_abort_ms=partition.auto_abort_ms)
        if not wal.write_partition(partition.path, header, taken.ids, logged):
            logged = wal.read_items(partition.path)  # another attempt logged first: its rows stand
    yield from queue_rows(logged.items, partition.queue, partition.server, logged.added, logged.expiry)


def check_shared(partition: StreamPartition) -> None:
    """Refuse to take anything where the driver's mark of this stream's log cannot be seen: the
    checkpoint is not storage the driver and this executor share."""
    root = os.path.dirname(os.path.dirname(partition.path))
    if wal.read_token(root) != partition.token:
        checkpoint = os.path.dirname(os.path.dirname(root))
        raise CheckpointNotShared(
            f"kestrel stream: this executor ({os.uname().nodename}) does not see the checkpoint the driver "
            f"wrote at {checkpoint} (its mark {wal.token_path(root)} is missing or another): the "
            f"checkpoint location must be storage the driver and every executor share, the same directory "
            f"seen at the same path (a shared mount), since executors log the items they take there and "
            f"the driver confirms them from it. Nothing was taken")


@dataclass
class Answer:
    """What one server said at a planning: each queue's items and the opening its positions count from."""

    address: str
    started: float  # monotonic, when the first call was sent
    depth: dict[str, tuple[int, int]] = field(default_factory=dict)  # queue: (items, opened_at)
    error: KestrelClientError | None = None


class KestrelStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    def __init__(self, options: Mapping[str, str]) -> None:
        o = parse_options(options, STREAM_OPTIONS, "kestrel stream", required=("servers", "queue"))
        if o["checkpointLocation"] is None:
            raise ValueError(f"kestrel stream: option 'checkpointLocation' is required: {CHECKPOINT_HELP}")
        self.servers = parse_servers(o["servers"])
        self.subscription = Subscription(tuple(o["queue"]), o["reader"])
        self.max_per_trigger: int | None = o["maxItemsPerTrigger"]
        self.per_partition: int = o["itemsPerPartition"]
        self.min_partitions: int | None = o["minPartitions"]
        self.auto_abort_ms: int = o["autoAbortMs"]
        self.timeout_ms: int = o["timeoutMs"]
        self.checkpoint = wal.checkpoint_dir(o["checkpointLocation"])
        self.source_key = self._identity(o["queue"], o["servers"])
        self.root = os.path.join(self.checkpoint, "kestrel", self.source_key)
        self.spark_log = wal.SparkCommitLog(self.checkpoint, self.source_key)
        self.cluster = Cluster(self.servers, timeout_ms=self.timeout_ms,
                               connect_timeout_ms=min(self.timeout_ms, 2000))
        self.available_now: dict[tuple[str, str], int] | None = None  # left to take, per (server, queue)
        self.owed: dict[int, dict[tuple[str, str], int]] = {}  # AvailableNow batches planned, not yet counted
        self.fetched: dict[int, dict[tuple[str, str], int]] = {}  # what committed batches' logs hold
        self.reach = Reachability(self.servers, o["unreachableTimeoutMs"] / 1000.0,
                                  f"kestrel stream of {','.join(self.subscription.entries)!r}")
        self.asking = ThreadPoolExecutor(2 * len(self.servers), thread_name_prefix="kestrel-ask")
        self.probes: dict[str, Future[Answer]] = {}  # servers down, being asked again in the background
        self.depth: dict[tuple[str, str], int] = {}  # items waiting, as the latest planning saw them
        self.last_batch: dict[str, int] = {}  # the latest committed batch: its items, its longest fetch
        self.token = ""
        self.lock = threading.Lock()  # planning's state: what the servers hold, what is left to take
        self.confirming = threading.Lock()  # the log's files, confirmed by one thread at a time
        self._committed_hint = -1  # the latest batch Spark said it committed (its commit log may lag)
        self._planned = -1  # the latest batch planned or replayed: the keeper watches for its commit
        self._wake = threading.Event()  # committed batches may wait to be confirmed
        self._stopped = threading.Event()
        self._keeper: threading.Thread | None = None  # started by the first planning, in the driver
        # log files not yet confirmed, as the keeper saw them: their fetch's wall time, and a time on
        # the driver's monotonic clock no earlier than the fetch (see `_watch_in_flight`)
        self._in_flight: dict[str, tuple[float, float]] = {}

    def _identity(self, listed: list[str], servers: str) -> str:
        """The stream's name in the checkpoint and in Spark's offsets: what it reads (the set of
        servers, the queues or patterns and the reader), however the options spell or order them.
        A checkpoint of a version that named a stream by its options' text keeps that name."""
        label = listed[0] if len(listed) == 1 and not self.subscription.patterns else f"{len(listed)}-queues"
        spelled = ",".join(listed) + "@" + servers
        earlier = f"{label}-{hashlib.sha1(spelled.encode()).hexdigest()[:12]}"
        if os.path.isdir(os.path.join(self.checkpoint, "kestrel", earlier)):
            return earlier
        what = self.subscription.key() + "@" + ",".join(sorted(self.servers))
        return f"{label}-{hashlib.sha1(what.encode()).hexdigest()[:12]}"

    # -- planning -------------------------------------------------------------------------------

    def initialOffset(self) -> dict[str, Any]:
        return {"source": self.source_key, "batch": -1}

    def getDefaultReadLimit(self) -> ReadLimit:
        return ReadMaxRows(self.max_per_trigger or NO_CAP)

    def prepareForTriggerAvailableNow(self) -> None:
        """Take what is there now and no more; every server must answer before anything is taken."""
        with self.lock:
            self.available_now = {k: n for k, (n, _) in self._waiting(needed=self.servers).items()}

    def _ask(self, address: str) -> Answer:
        """One server's queues and how many items each holds; a reader's children created first."""
        answer = Answer(address, time.monotonic())
        try:
            server = self.cluster.server(address)
            held = server.queue_names()  # a peek would create the queue it looks at
            for child in self.subscription.children(held):
                server.peek(child)  # creates the reader's child (and its queue): it keeps what comes now
                log.info("created a fanout child for this stream's reader", server=address, queue=child)
                held.append(child)
            for queue in self.subscription.queues(held):
                at = server.peek_items(queue, 0, 0)
                answer.depth[queue] = (int(at.items), int(at.opened_at))
        except KestrelClientError as e:
            answer.error = e
        return answer

    def _waiting(self, needed: Collection[str] = ()) -> dict[tuple[str, str], tuple[int, int]]:
        """How many items wait in each queue on each server, and each queue's opening, asked of
        every server at once; none where the server holds no such queue (nothing is created, but a
        reader's children). A server that failed is left out and asked again in the background,
        once a second, until it answers; but one `needed` (an AvailableNow query's, while it holds
        items the query is to take) is asked now, and fails the query if it does not answer: left
        out, it would make the query end as if it had taken them."""
        asked: dict[str, Future[Answer]] = {}
        for address in self.servers:
            if address in needed or not self.reach.is_down(address):
                asked[address] = self.asking.submit(self._ask, address)
                continue
            probe = self.probes.get(address)
            if probe is None and self.reach.due(address):
                self.probes[address] = self.asking.submit(self._ask, address)
            elif probe is not None and probe.done():
                asked[address] = self.probes.pop(address)
        waiting: dict[tuple[str, str], tuple[int, int]] = {}
        for address, future in asked.items():
            answer = future.result()
            if answer.error is not None:
                if address in needed:
                    raise ServersUnreachable(self._unanswered(address, answer.error)) from answer.error
                self.reach.failed(address, "peek_items", answer.error, started=answer.started)
                continue
            self.reach.answered(address)
            waiting.update({(address, queue): depth for queue, depth in answer.depth.items()})
        self.depth = {k: n for k, (n, _) in waiting.items()}
        return waiting

    def _unanswered(self, address: str, error: KestrelClientError) -> str:
        """Why an AvailableNow query fails when `address` does not answer: before anything was taken,
        or with items left there that the query was to take."""
        if self.available_now is None:
            return f"{error}: nothing was taken from any server"
        left = sum(n for (server, _), n in self.available_now.items() if server == address)
        return (f"kestrel stream (availableNow): server {address} did not answer ({error}) while it held "
                f"{left} items this query was to take: the query fails rather than end as if it had taken "
                f"them. The batches committed so far stand; run it again from its checkpoint once the "
                f"server answers")

    def _start(self) -> None:
        """Once per query, in the driver, before the first batch is planned or replayed: mark the
        log for the executors to find, confirm what it holds (committed batches for good, the
        batch to be replayed early, since its rows come from the log), then keep in-flight reads
        from timing out."""
        if self._keeper is not None:
            return
        if not os.path.exists(os.path.join(self.checkpoint, "metadata")):
            raise ValueError(f"kestrel stream: option 'checkpointLocation' ({self.checkpoint}) holds no "
                             f"Spark checkpoint, so it is not this query's: {CHECKPOINT_HELP}")
        self.token = wal.read_token(self.root) or wal.write_token(self.root, uuid.uuid4().hex)
        stop_source_when_terminated()  # a stopped query's last committed batch is confirmed by stop()
        self._note_others()
        for batch in wal.batches(self.root):
            self._note_late(batch)
        self._confirm_up_to(self._committed())
        for batch in wal.batches(self.root):
            for path in wal.batch_files(self.root, batch):
                if not wal.is_confirmed(path):
                    self._confirm(path)
        self._keeper = threading.Thread(target=self._keep_reads_alive, daemon=True, name="kestrel-keeper")
        self._keeper.start()

    def _note_late(self, batch: int) -> None:
        """Warn when a restarted query finds reads of its log older than autoAbortMs, not confirmed:
        the servers have put their items back, and they will be delivered again."""
        late = [header for path in wal.batch_files(self.root, batch) if not wal.is_confirmed(path)
                for header in (wal.read_ids(path)[0],)
                if header.count and time.time() > header.returned_at(self.auto_abort_ms)]
        if late:
            past_s = time.time() - min(h.returned_at(self.auto_abort_ms) for h in late)
            opened_ms = max(h.auto_abort_ms or self.auto_abort_ms for h in late)
            window_s = RESTART_WINDOW * opened_ms / 1000
            log.warning(f"kestrel stream restarted {past_s:.0f} s too late: batch {batch} was fetched more "
                        f"than the autoAbortMs its reads were opened with ({opened_ms} ms) ago and they were "
                        f"never confirmed, so the servers have put its items back and they are delivered "
                        f"again. A restart duplicates nothing if it comes within {window_s:.0f} s "
                        f"({RESTART_WINDOW:.4g} of autoAbortMs) of the stop: raise autoAbortMs for longer "
                        f"ones",
                        batch=batch, items=sum(h.count for h in late), checkpoint=self.checkpoint)

    def _note_others(self) -> None:
        """Warn of the logs of other streams in this checkpoint (its servers or queues were others)
        still holding reads: this stream does not confirm them."""
        top = os.path.join(self.checkpoint, "kestrel")
        for name in sorted(os.listdir(top)) if os.path.isdir(top) else []:
            other = os.path.join(top, name)
            if name != self.source_key and os.path.isdir(other):
                pending = sum(1 for batch in wal.batches(other) for path in wal.batch_files(other, batch)
                              if not wal.is_confirmed(path))
                if pending:
                    log.warning("the checkpoint holds the log of a stream that read other servers or queues; "
                                "its reads are not confirmed by this one and go back to their queues after "
                                "autoAbortMs", log=other, files=pending)

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        if isinstance(limit, ReadAllAvailable) and self.available_now is None:
            raise ValueError(ONCE_REFUSED)
        with self.lock:
            self._start()
            self._wake.set()  # the keeper confirms what the sink committed, while this batch goes on
            if self.available_now is not None:
                with self.confirming:
                    self._confirm_up_to(self._committed())  # counts what the batches committed fetched
                self._settle()
            needed = [] if self.available_now is None else \
                sorted({address for (address, _), n in self.available_now.items() if n})
            found = self._waiting(needed)
            self.reach.check()
            waiting = {k: n for k, (n, _) in found.items()}
            if self.available_now is not None:
                waiting = {k: min(n, self.available_now.get(k, 0)) for k, n in waiting.items()}
            cap = limit.max_rows if isinstance(limit, ReadMaxRows) else None
            take = share(waiting, cap)
            if not take:
                # Nothing to fetch meanwhile, and an AvailableNow query ends here: confirm now.
                with self.confirming:
                    self._confirm_up_to(self._committed())
                return start
            batch = int(start.get("batch", -1)) + 1
            if self.available_now is not None:
                for k, n in take.items():
                    self.available_now[k] -= n
                self.owed[batch] = take
            by_server: dict[str, dict[str, int]] = {}
            opened: dict[str, dict[str, int]] = {}
            for (address, queue), n in take.items():
                by_server.setdefault(address, {})[queue] = n
                opened.setdefault(address, {})[queue] = found[(address, queue)][1]
            # The split goes with the batch: a replay names the log files the batch was fetched into,
            # whatever itemsPerPartition and minPartitions say by then.
            split = partition_size(sum(take.values()), self.per_partition, self.min_partitions)
            return {"source": self.source_key, "batch": batch, "take": by_server,
                    "opened": opened, "split": split}

    def _settle(self) -> None:
        """Give back to what an AvailableNow query has left to take the share of each batch it
        planned that its fetch did not take (a server that failed mid-fetch ends it early): that
        server is still needed, so a later planning takes the rest or fails if it does not answer."""
        assert self.available_now is not None
        for batch in [b for b in self.owed if b in self.fetched]:
            fetched = self.fetched.pop(batch)
            for k, n in self.owed.pop(batch).items():
                self.available_now[k] += n - min(n, fetched.get(k, 0))

    def reportLatestOffset(self) -> dict[str, Any]:
        """What Spark shows as the source's latest offset in each progress report: the items each
        queue holds on each server (what the stream has still to read), the servers left out as
        down, and the latest committed batch: its items and its longest fetch."""
        waiting: dict[str, dict[str, int]] = {}
        with self.lock:
            for (address, queue), n in sorted(self.depth.items()):
                waiting.setdefault(address, {})[queue] = n
            report: dict[str, Any] = {"source": self.source_key, "waiting": waiting,
                                      "down": self.reach.down_now()}
            if self.last_batch:
                report["lastBatch"] = self.last_batch
        return report

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> list[InputPartition]:
        if end.get("batch") == start.get("batch") or "take" not in end:
            return []
        batch = int(end["batch"])
        planned_by = end.get("source", self.source_key)
        if planned_by != self.source_key:
            raise ValueError(self._replay_refused(batch, planned_by, end["take"]))
        out: list[InputPartition] = []
        with self.lock:
            self._start()
            self._planned = max(self._planned, batch)
            self._wake.set()  # the keeper watches for its commit from now on
            # {server: {queue: n}}; offsets of versions that read one queue are {server: n}
            first = self.subscription.target(self.subscription.entries[0])
            take = {(address, queue): n for address, counts in end["take"].items() for queue, n in
                    (counts if isinstance(counts, dict) else {first: counts}).items()}
            opened = end.get("opened", {})
            # offsets of versions that did not keep the split were split by the options of the day
            size = int(end.get("split") or partition_size(sum(take.values()), self.per_partition,
                                                          self.min_partitions))
            several = len(self.subscription.entries) > 1 or bool(self.subscription.patterns)
            for (address, queue), count in sorted(take.items()):
                for part, first_item in enumerate(range(0, count, size)):
                    name = f"{address.replace(':', '_')}-{part}"
                    if several:
                        name = f"{queue}~{name}"
                    path = os.path.join(self.root, str(batch), name)
                    quota = min(size, count - first_item)
                    opened_at = opened.get(address, {}).get(queue)
                    out.append(StreamPartition(path, address, queue, quota, self.auto_abort_ms,
                                               self.timeout_ms, self.token, opened_at))
        return out

    def _replay_refused(self, batch: int, planned_by: str, take: dict[str, Any]) -> str:
        """Why a batch another stream planned is not replayed by this one: its log is the other's,
        and may alone hold its items (reads confirmed early); fetched anew, they were lost."""
        taken = "; ".join(f"{address}: {', '.join(sorted(counts)) if isinstance(counts, dict) else counts}"
                          for address, counts in sorted(take.items()))
        return (f"kestrel stream: Spark replays batch {batch} of this checkpoint as it was planned, by a "
                f"stream that read other servers or queues (it took from {taken}; its log is "
                f"{os.path.join(self.checkpoint, 'kestrel', planned_by)}), and this one cannot replay it: "
                f"that batch's items are in the other stream's log, some perhaps there alone. Run the query "
                f"with the servers, queue and reader options it had until that batch is committed, then "
                f"change them. Nothing was taken")

    def read(self, partition: InputPartition) -> Iterator[Any]:
        assert isinstance(partition, StreamPartition)
        spare_collections()
        return read_partition(partition)

    def __getstate__(self) -> dict[str, Any]:
        """Spark ships `read` to the executors with its reader: the driver's state stays behind."""
        return {}

    # -- committing -----------------------------------------------------------------------------

    def commit(self, end: dict[str, Any]) -> None:
        self._committed_hint = max(self._committed_hint, int(end.get("batch", -1)))
        self._wake.set()

    def _committed(self) -> int:
        """The latest batch the sink has committed, as Spark's commit log or its `commit` call says."""
        return max(self.spark_log.committed(), self._committed_hint)

    def _confirm_up_to(self, committed: int) -> None:
        """Confirm the reads of every logged batch the sink has committed, then forget the batch.

        A log file whose server could not take the confirm stays in the log, pending: it is tried
        again at every planning and commit (and by a query restarted from the checkpoint)."""
        for batch in wal.batches(self.root):
            if batch > committed:
                break
            pending = 0
            files = wal.batch_files(self.root, batch)
            if batch > self.last_batch.get("batch", -1):
                headers = [wal.read_ids(path)[0] for path in files]
                self.last_batch = {"batch": batch, "items": sum(h.count for h in headers),
                                   "fetchMs": round(1000 * max((h.took or 0.0 for h in headers), default=0))}
                if batch in self.owed:
                    fetched: dict[tuple[str, str], int] = {}
                    for h in headers:
                        k = (h.server, h.queue or self.subscription.target(self.subscription.entries[0]))
                        fetched[k] = fetched.get(k, 0) + h.count
                    self.fetched[batch] = fetched
            for path in files:
                if wal.is_confirmed(path) or self._confirm(path):
                    wal.forget_file(path)
                else:
                    pending += 1
            if not pending:
                wal.forget_batch(self.root, batch)

    def _confirm(self, path: str) -> bool:
        """Confirm one log file's reads, over any connection to their server, and mark it so.

        False when the server did not take it (unreachable, shutting down, refusing), or is down
        (asked again in the background): the file stays as it was, to be tried again. A confirm
        whose answer was lost (a time-out) leaves its `.confirming` mark with the time it was sent.
        Reads the server no longer holds open are told apart by `_note_closed` (a read id from
        before a restart closes nothing, as a server never hands out an id twice)."""
        header, ids = wal.read_ids(path)
        if ids:
            if self.reach.is_down(header.server):
                return False
            queue = header.queue or self.subscription.target(self.subscription.entries[0])
            sent_before = wal.confirming_since(path)
            sent = time.time()
            wal.mark_confirming(path, sent if sent_before is None else sent_before)
            started = time.monotonic()
            try:
                server = self.cluster.server(header.server)
                closed = server.confirm(queue, set(ids))
            except KestrelClientError as e:
                if not (isinstance(e, ServerUnavailable) and e.maybe_done) and sent_before is None:
                    wal.unmark_confirming(path)
                self.reach.failed(header.server, "confirm (kept in the log, tried again)", e, started=started)
                return False
            self.reach.answered(header.server)
            if closed < len(ids):
                self._note_closed(header, queue, len(ids) - closed, sent_before)
        wal.mark_confirmed(path)
        return True

    def _note_closed(self, header: wal.WalHeader, queue: str, items: int, sent_before: float | None) -> None:
        """Say what became of `items` reads a confirm found no longer open, from what the server
        shows of their queue now, and count in `returned` those whose items may be delivered again.

        The server no longer holds the queue: it was deleted, the items with it (not counted). The
        queue has stayed open since the fetch: an earlier confirm whose answer was lost closed them
        if it was sent before any could time out (not counted), else autoAbortMs returned them and
        they are delivered again. The queue was reopened since the fetch: a server restart returned
        them (delivered again), or a delete dropped them and a put made the queue anew (gone); a
        confirm cannot tell the two apart, so they count, and the warning names both."""
        try:
            opened_at: int | None = int(self.cluster.server(header.server).peek_items(queue, 0, 0).opened_at)
        except KestrelClientError:
            opened_at = None
        if opened_at == 0:
            log.warning("reads of a queue deleted since their fetch: their items went with it, none is "
                        "delivered again", server=header.server, queue=queue, items=items)
            return
        if header.opened_at is None or opened_at is None:
            why = ("a server restart or autoAbortMs returned them to their queue, and their items are "
                   "delivered again; or their queue was deleted and made anew, and they went with it")
        elif opened_at != header.opened_at:
            why = ("their queue was reopened since the fetch: by a server restart, which returned them "
                   "(their items are delivered again), or by a delete and a put that made it anew (their "
                   "items went with the old one); a confirm cannot tell which")
        elif sent_before is not None and sent_before < header.returned_at(self.auto_abort_ms):
            return  # closed by the earlier confirm, sent before any of them could time out
        else:
            why = "autoAbortMs returned them to their queue: their items are delivered again"
        total = wal.count_returned(self.root, items)
        log.warning(f"reads no longer open: {why}", server=header.server, queue=queue, items=items,
                    returned_so_far=total)

    def _keep_reads_alive(self) -> None:
        """Confirm the batches the sink committed as soon as Spark's commit log shows them (looked at
        every COMMIT_WATCH_S while a planned batch awaits its commit, and at every planning), off the
        planning's path, so that the next batch is fetched meanwhile; and, every sixteenth of
        autoAbortMs, in-flight reads older than half of it (their items are in the log)."""
        period = self.auto_abort_ms * KEEPER_PERIOD / 1000.0
        early_due = time.monotonic() + period
        committed = -1
        while True:
            awaited = self._planned > committed
            self._wake.wait(COMMIT_WATCH_S if awaited else max(0.0, early_due - time.monotonic()))
            self._wake.clear()
            if self._stopped.is_set():
                return
            with self.confirming:
                committed = self._committed()
                self._confirm_up_to(committed)
                self._watch_in_flight(committed)
                if time.monotonic() < early_due:
                    continue
                early_due = time.monotonic() + period
                half = self.auto_abort_ms * EARLY_CONFIRM / 1000.0
                for path, (fetched_at, since) in list(self._in_flight.items()):
                    if max(time.time() - fetched_at, time.monotonic() - since) > half and self._confirm(path):
                        del self._in_flight[path]

    def _watch_in_flight(self, committed: int) -> None:
        """Note each log file of a batch the sink has not committed (those of one it has are
        `_confirm_up_to`'s) and not yet confirmed, as the keeper first sees it (it looks every
        COMMIT_WATCH_S while a batch is in flight), and forget the rest.

        The fetch's wall time comes from the executor's clock, and the driver's may step (NTP, a
        resumed VM): stepped back, it would find the reads younger than they are and confirm them
        after the server, whose auto-abort runs on its monotonic clock, had put them back. So each
        file also gets a time on the driver's monotonic clock no earlier than its fetch began: when
        first seen, less the fetch's own time (the file is written after it). The age counted from
        it is never more than the reads' own, so no read is confirmed sooner than the rule says."""
        now = time.monotonic()
        seen: dict[str, tuple[float, float]] = {}
        for batch in wal.batches(self.root):
            if batch <= committed:
                continue
            for path in wal.batch_files(self.root, batch):
                known = self._in_flight.get(path)  # (the keeper's own confirm forgets its file)
                if known is not None:
                    seen[path] = known
                elif not wal.is_confirmed(path):
                    header, _ = wal.read_ids(path)
                    seen[path] = (header.fetched_at, now - max(0.0, header.took or 0.0))
        self._in_flight = seen

    def stop(self) -> None:
        """Confirm what the sink committed. The reads of a batch it did not commit stay open: the
        next query from this checkpoint replays that batch from the log and confirms them (or,
        after autoAbortMs, they return to their queue)."""
        source_stopping()
        self._stopped.set()
        self._wake.set()
        with self.confirming:
            self._confirm_up_to(self._committed())
        self.asking.shutdown(wait=False, cancel_futures=True)
        self.cluster.close()


class RefusedStream(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """A stream whose options were refused: its first call from Spark raises the refusal."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def _refuse(self) -> NoReturn:
        raise self.error

    def initialOffset(self) -> dict[str, Any]:
        self._refuse()

    def getDefaultReadLimit(self) -> ReadLimit:
        self._refuse()

    def prepareForTriggerAvailableNow(self) -> None:
        self._refuse()

    def latestOffset(self, start: dict[str, Any], limit: ReadLimit) -> dict[str, Any]:
        self._refuse()

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> list[InputPartition]:
        self._refuse()

    def read(self, partition: InputPartition) -> Iterator[Any]:
        self._refuse()

    def commit(self, end: dict[str, Any]) -> None:
        pass

    def stop(self) -> None:
        pass


K = TypeVar("K", str, tuple[str, str])


def partition_size(total: int, per_partition: int, min_partitions: int | None) -> int:
    """Items per partition: `itemsPerPartition`, or fewer so that a batch of `total` items makes at
    least `minPartitions` partitions (each server's and queue's share is split on its own)."""
    if not min_partitions:
        return per_partition
    return max(1, min(per_partition, total // min_partitions))


def share(waiting: dict[K, int], cap: int | None) -> dict[K, int]:
    """How many to take from each server (and queue): everything, or `cap` split in proportion to
    what waits."""
    total = sum(waiting.values())
    if total == 0:
        return {}
    if cap is None or cap >= total:
        return {a: n for a, n in waiting.items() if n}
    take = {a: n * cap // total for a, n in waiting.items()}
    for address in sorted(waiting, key=lambda a: waiting[a] - take[a], reverse=True):
        if sum(take.values()) >= cap:
            break
        if take[address] < waiting[address]:
            take[address] += 1
    return {a: n for a, n in take.items() if n}
