"""QueueCollection: every queue of one queue path, with fanout, aliases and the expiry sweeper."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterable, Mapping
from functools import partial
from typing import Any, Final

import structlog

from kestrel.storage import fanout, formats, layout, poison
from kestrel.storage.aliases import Aliases, AliasPuts
from kestrel.storage.changes import ChangedQueues
from kestrel.storage.clock import Clock
from kestrel.storage.commit_log import CommitLog
from kestrel.storage.commit_log import recover as recover_commit_log
from kestrel.storage.config import NATIVE_LIMIT, QueueConfig, QueueConfigs, check_across_queues
from kestrel.storage.errors import (
    CorruptJournalError,
    InvalidQueueName,
    JournalWriteError,
    QueueDamaged,
    TooManyQueues,
)
from kestrel.storage.expiry import ExpirySchedule
from kestrel.storage.fanout import Fanouts
from kestrel.storage.filenames import check_queue_name
from kestrel.storage.item import QItem
from kestrel.storage.kestrel2.queue import Kestrel2Queue
from kestrel.storage.kestrel3.journal import Kestrel3Journals
from kestrel.storage.kestrel3.queue import Kestrel3Queue
from kestrel.storage.memory import MemoryGovernor, MemoryLedger
from kestrel.storage.queue import AddCount, PersistentQueue
from kestrel.storage.queue_path import JournalFiles, delete_temporaries, list_journal_files, scan_queue_dir
from kestrel.storage.runtime import (
    DEFAULT_RUNTIME,
    Event,
    GeventRuntime,
    OneAtATime,
    Runtime,
    Timer,
    all_side_by_side,
    paced,
    side_by_side,
)

log = structlog.get_logger("kestrel.collection")

# The queues a log line names at most (its `count` says how many there were): a reload changing a
# default that 10,000 queues inherit names the first of them.
LOGGED_NAMES: Final = 100
# The queues a shutdown closes side by side (`QueueCollection.close`): as many fsyncs as one round of
# the group commit issues at once (`fsync/group_commit.py` MAX_THREADS); the threads runtime starts a
# thread for each.
CLOSED_AT_ONCE: Final = 64
# Items `flush_all` drops between two pauses for the other tasks: about 15 ms of work.
FLUSH_PACE: Final = 100_000


class QueueCollection:
    """Maps names to queues. Reading or writing a name creates its queue, as Kestrel does; flushing,
    deleting, confirming or aborting one that does not exist creates nothing.

    `aliases` maps an alias name to the queues its writes go to; reading an alias gives nothing.
    `runtime` is the concurrency model (`src/kestrel/storage/runtime.py`): gevent unless given, or
    `ThreadsRuntime()` in a program of plain threads; `clock` is the runtime's unless given.
    `max_memory_total` is the budget of what every queue holds in memory (0: none;
    src/kestrel/storage/memory.py).
    `commit_log`: queues under `sync_journal: always` or a periodic sync, in either format, wait
    for one server-wide log's fsync instead of their journals' (src/kestrel/storage/commit_log.py),
    from `load` on (the server's default; the library's is off). Whatever the setting, `load`
    first recovers what a log left by an earlier run holds.
    """

    def __init__(self, path: str, configs: QueueConfigs | None = None,
                 aliases: Mapping[str, list[str]] | None = None, clock: Clock | None = None,
                 salvage: bool = False, max_queues: int | None = None,
                 runtime: Runtime | None = None, max_memory_total: int = 0,
                 commit_log: bool = False) -> None:
        if runtime is None:
            runtime = DEFAULT_RUNTIME if clock is None else GeventRuntime(clock)
        self.runtime = runtime
        self.path = path
        self.max_queues = max_queues
        self.configs = configs or QueueConfigs()
        self.aliases = Aliases.of(aliases)
        check_across_queues(self.configs, self.aliases)
        self.clock = clock if clock is not None else runtime.clock
        self.salvage = salvage
        self._lock = runtime.lock()  # creating and deleting queues
        self._queues: dict[str, PersistentQueue] = {}
        # Names whose queue is being created or deleted: either may wait (an fsync), and under gevent
        # the lock above takes nothing, so a client naming the queue meanwhile waits for this event
        # (a creation beside a delete took up the files the delete then removed under it).
        self._changing: dict[str, Event] = {}
        self._reloads = OneAtATime(self.runtime, self._lock)
        # Queues whose journal was refused at start-up (damage, without salvage), or as they were first
        # named after it (`_refuse_found`): they serve nothing and keep their files as they are; every
        # other queue serves.
        self.refused: dict[str, CorruptJournalError] = {}
        self._refused_later: set[str] = set()  # those refused as they were first named
        # After `load`: the owner (`files.file_owner`) of every file in the queue path, and of every
        # queue whose creation was tried since. A new queue owning none has no file to look for:
        # creating it reads no directory (None before `load`: each new queue lists the path for its
        # own files).
        self._owners: set[str] | None = None
        self._kestrel3: Kestrel3Journals[Kestrel3Queue] = Kestrel3Journals(path, runtime, salvage=salvage)
        self.fanouts = Fanouts()
        self.alias_puts = AliasPuts()
        self._sweeper: Timer | None = None
        # Items added to every queue since start: each queue counts its adds here (`AddCount`).
        self.adds = AddCount()
        self.queue_creates = 0
        self._serials = 0  # the last `serial` given to a queue
        self.queue_deletes = 0
        self.queue_expires = 0
        self.closed = False
        self._closing: Event | None = None  # set once `close` has ended
        self.waits_ended = False
        self._commit_log_on = commit_log
        self.commit_log: CommitLog | None = None  # opened by `load`, after recovery
        self._loaded = False  # `load` ran: a second would open a second commit log beside the first
        # The queues changed since the governor's last tick: what it visits, rather than every
        # queue (src/kestrel/storage/changes.py); the sweep visits only the queues due.
        self._changes = ChangedQueues()
        self._expiry = ExpirySchedule(runtime.lock())
        # What every queue calls back, each bound once for all of them: a bound method made for each
        # queue would be one more object of each that every full garbage collection walks
        # (src/kestrel/service/gc_pauses.py).
        self._note_change = self._changes.note
        self._watch_expiry = self._expiry.watch
        self._expire_to = self._expire_target
        self._poison_to = self._route_poison
        self.ledger = MemoryLedger()  # what every queue holds in memory, kept as it changes
        self.governor = (MemoryGovernor(lambda: list(self._queues.values()), max_memory_total, runtime,
                                        self.ledger, changes=self._changes.reader())
                         if max_memory_total else None)
        # During `load`: how many queues it found, and how many of them are still to replay (each
        # replays under the budget, src/kestrel/storage/memory.py `admit`), Kestrel 3 readers among
        # them (`_readers_left`: loaded with their queue, not named in the scan's queues).
        self._loading = self._waiting = self._readers_left = 0
        os.makedirs(path, exist_ok=True)

    # -----------------------------------------------------------------------------------------
    # Queues by name

    def load(self) -> None:
        """Replay every journal found in the queue path (parents before their fanout children).

        The path is read once, so start-up is linear in the number of files; the temporaries of
        every queue (even of one that no longer exists) are removed. Queues already on disk are
        all loaded, even past `max_queues` (which then only stops new ones). A journal conversion
        interrupted after its switch is finished first. Raises TooManyQueues when the process runs
        out of file descriptors, ConfigError for files in the other format than `journal_format`.
        A queue whose journal is damaged (CorruptJournalError, without salvage), or whose records in
        a commit log left by a crash cannot be placed in its journal, is refused alone: logged,
        kept in `refused`, and every request to it raises QueueDamaged. Raises RuntimeError when
        the collection was loaded already.
        """
        if self._loaded:
            raise RuntimeError(f"the queue collection at {self.path} is loaded already: load it once")
        self._loaded = True
        layout.tidy(self.path)
        if (converted := formats.finish_interrupted(self.path)) is not None:
            log.warning("finished a journal conversion that was interrupted", queue=converted)
        for name, error in recover_commit_log(self.path, self.clock.now_ms(), self.salvage).refused.items():
            self._refuse(name, error)
        if self._commit_log_on:
            commit_log = CommitLog(self.path, self.runtime)
            try:
                commit_log.open()
            except OSError as e:
                if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                # A full disk: nothing is lost, the journals fsync themselves.
                log.warning("cannot open the commit log: the disk is full; every journal fsyncs itself",
                            error=str(e))
            else:
                self.commit_log = self._kestrel3.commit_log = commit_log
        found = scan_queue_dir(self.path)
        delete_temporaries(found.temporaries)
        self._owners = found.owners
        self._loading = len(found.queues) + found.readers
        self._readers_left = found.readers
        try:
            self._load_found(found.queues, formats.refused_before_load(found))
        finally:
            self._loading = self._waiting = self._readers_left = 0
            self._kestrel3.loaded()
        if self.max_queues is not None and len(self._queues) > self.max_queues:
            log.warning("more queues on disk than max_queues; no new queue can be created",
                        queues=len(self._queues), max_queues=self.max_queues)
        self._warn_masked()

    def _load_found(self, queues: dict[str, JournalFiles],
                    refused: Mapping[str, CorruptJournalError]) -> None:
        ignored = formats.ignored_names(queues)
        for index, name in enumerate(sorted(queues, key=formats.load_order)):
            self._waiting = len(queues) - index - 1 + self._readers_left
            if name in ignored:
                log.warning("ignoring journal with an invalid queue name", file=name, reason=ignored[name])
                continue
            if name in refused:  # before anything opens its files (it would write another queue's)
                self._refuse(name, refused[name])
                continue
            formats.check_format(self.path, name, queues[name], self.config_for(name).journal_format)
            try:
                self._create(name, queues)
            except QueueDamaged:
                continue  # its parent was refused (and logged)
            except CorruptJournalError as e:
                self._refuse(name, e)

    def _refuse(self, name: str, error: CorruptJournalError) -> None:
        self.refused[name] = error
        log.error(f"QUEUE REFUSED: {error.refusal}; the other queues serve, this one answers "
                  "every request with an error", queue=name, file=error.path, offset=error.offset,
                  opcode=error.opcode, reason=error.reason,
                  remedy=error.remedy())

    def check_refused(self, name: str) -> None:
        """Raise QueueDamaged if `name` (or its fanout parent) was refused."""
        if not self.refused:
            return
        error = self.refused.get(name)
        if error is not None:
            raise QueueDamaged(name, error, later=name in self._refused_later)
        parent, plus, _ = name.partition("+")
        if plus and (error := self.refused.get(parent)) is not None:
            raise QueueDamaged(name, error, parent, later=parent in self._refused_later)

    def _refuse_found(self, name: str) -> None:
        """Refuse queue `name`, first named after start-up, as a start refuses it when its files
        there begin with neither format or are in both (`formats.refused_by_content`: a stray file
        put there since), before anything opens them. Raises QueueDamaged."""
        refusal = formats.refused_by_content(list_journal_files(self.path, name))
        if refusal is not None:
            self._refused_later.add(name)
            self._refuse(name, refusal)
            self.check_refused(name)

    def refused_queues(self) -> dict[str, str]:
        """Each queue refused, with the damage found."""
        return {name: str(error) for name, error in sorted(self.refused.items())}

    def get(self, name: str) -> PersistentQueue | None:
        return self._queues.get(name)

    def queue(self, name: str) -> PersistentQueue:
        """The queue called `name`, created (and its journal replayed) on first reference.

        Raises InvalidQueueName, TooManyQueues (the server holds `max_queues`, or is out of file
        descriptors: the queues it has keep working), QueueDamaged (refused, at start-up or now),
        JournalWriteError (its files could not be made or fsynced: the next reference tries again).
        """
        q = self._queues.get(name)
        if q is not None:
            return q
        check_queue_name(name)
        self.check_refused(name)
        with self._lock:
            return self._create(name, None)

    def _create(self, name: str, scanned: dict[str, JournalFiles] | None) -> PersistentQueue:
        existing = self._queues.get(name)
        if existing is not None:
            return existing
        self.check_refused(name)
        parent_name, plus, _ = name.partition("+")
        if plus and self._made_in(name) == formats.KESTREL3:
            # A Kestrel 3 child is a reader of its parent's journal: the parent comes first (and
            # creates the readers it finds). A Kestrel 2 child stands alone, as in Kestrel: its
            # parent is created by its own first reference.
            if scanned is None and parent_name in self.aliases:  # one on disk loads, masked
                raise InvalidQueueName(f"queue {name!r} would read the journal of {parent_name!r}, "
                                       f"an alias, which keeps none (a Kestrel 3 fanout child reads "
                                       f"its parent's journal)")
            self._create(parent_name, scanned)
            existing = self._queues.get(name)
            if existing is not None:
                return existing
        changing = self._changing.get(name)
        if changing is not None:  # another client's creation or delete of it is waiting (an fsync)
            changing.wait()
            return self._create(name, scanned)  # created, or failed or deleted: then this one tries
        self._changing[name] = changing = self.runtime.event()
        try:
            return self._set_up(name, plus, scanned)
        finally:
            del self._changing[name]
            changing.set()

    def _set_up(self, name: str, plus: str, scanned: dict[str, JournalFiles] | None
                ) -> PersistentQueue:
        # The others being created (or deleted: their files are still there) count too: a creation
        # waits for its fsyncs off the loop.
        if (scanned is None and self.max_queues is not None and len(self._queues)
                + sum(other not in self._queues for other in self._changing) - 1 >= self.max_queues):
            raise TooManyQueues(f"cannot create queue {name!r}: the server already holds "
                                f"max_queues = {self.max_queues} queues")
        owners = self._owners
        # A name that owned no file at the start-up scan has none to look for (creating its queue reads
        # no directory), unless a file named as its live journal was put there since: one look by name.
        fresh = (scanned is None and owners is not None and name not in owners
                 and not os.path.exists(os.path.join(self.path, name)))
        configs = self.configs
        q = self._new_queue(name)
        self._serials += 1
        q.serial = self._serials
        q.on_poison = self._poison_to
        q.adds = self.adds
        q.count_in(self.ledger)
        files = None if scanned is None else scanned.get(name, JournalFiles())
        if owners is not None:
            # From its first try on: one that fails (an fsync error) may leave files, which the next
            # looks for and takes up (a second Kestrel 3 writer file beside them was refused at the
            # next start, older than the one the manifest lists).
            owners.add(name)
        if scanned is not None and plus and name not in scanned and self._readers_left:
            # a Kestrel 3 reader loading with its queue: one fewer still to load
            self._readers_left -= 1
            self._waiting = max(self._waiting - 1, 0)
        if self.governor is not None and not fresh:
            # What the replay may hold in memory: the budget is kept at start-up as while serving.
            self.governor.admit(q, self._loading or len(self._queues) + 1, self._waiting)
        try:
            if scanned is None and not fresh:
                self._refuse_found(name)
            q.setup(files=files, fresh=fresh)
        except OSError as e:
            q.close()
            if e.errno in (errno.EMFILE, errno.ENFILE):
                raise TooManyQueues(f"cannot create queue {name!r}: out of file descriptors "
                                    f"({len(self._queues)} queues open; raise the limit or lower "
                                    f"max_queues)") from None
            if scanned is None:  # made by a request: answered as any other journal write that failed
                raise self._write_failed(name, e, "cannot create the queue: its files cannot be "
                                         "written") from None
            raise
        except BaseException:
            # Damage, its files refused (`_refuse_found`), a write refused (JournalWriteError), or a
            # kill of its client (a stop's time-out), raised as the creation's next call on the thread
            # pool begins: a Kestrel 3 queue's manifest written, its checkpoint not. What it opened is
            # closed, or its journal stayed open past the commit log's close.
            with contextlib.suppress(Exception):
                q.close()
            raise
        if self.configs is not configs:  # a reload while it waited (an fsync) did not see it: applied now
            q.reconfigure(self.config_for(name))
        self._queues[name] = q
        q.note_changes_to(self._note_change)
        q.note_change()  # the governor looks at what it loaded
        q.age_held_items()
        q.watch_expiry(self._watch_expiry)
        if self.waits_ended:
            q.end_waits()
        self.fanouts.add(name)
        self.queue_creates += 1
        # At start-up (`scanned`), a queue found on disk; later, one a request made.
        log.info("queue loaded" if scanned is not None else "queue created", queue=name, items=q.length)
        if not plus:
            for reader in q.readers_on_disk():
                self._create(f"{name}+{reader}", scanned)
        return q

    def _write_failed(self, name: str, e: OSError, event: str) -> JournalWriteError:
        """A creation or a delete of queue `name` that failed on the disk, logged as `event` and
        answered as any other journal write that failed (naming the queue and the system's reason),
        not as an internal error with a traceback."""
        failure = JournalWriteError(name, e.filename or self.path, e)
        log.error(event, queue=name, error=str(failure))
        return failure

    def _made_in(self, name: str) -> str:
        """The journal format a new queue `name` is made in: its parent's (a fanout child of a
        Kestrel 3 queue is a reader of its parent's one writer journal)."""
        return self.config_for(name.partition("+")[0]).journal_format

    def _new_queue(self, name: str) -> PersistentQueue:
        """Queue `name` in the format it is made in (`_made_in`), not yet set up."""
        config = self.config_for(name)
        if self._made_in(name) == formats.KESTREL3:
            return Kestrel3Queue(name, self.path, config, self.clock, expire_to=self._expire_to,
                                 journals=self._kestrel3)
        return Kestrel2Queue(name, self.path, config, self.clock, expire_to=self._expire_to,
                             salvage=self.salvage, runtime=self.runtime, commit_log=self.commit_log)

    def config_for(self, name: str) -> QueueConfig:
        return self.configs.for_queue(name)

    def _expire_target(self, name: str) -> PersistentQueue | None:
        try:
            return self.queue(name)
        except InvalidQueueName:
            log.warning("expire_to_queue names an invalid queue", queue=name)
            return None
        except TooManyQueues as e:
            log.warning("expire_to_queue names a queue that cannot be created", queue=name, reason=str(e))
            return None

    def _route_poison(self, source: str, error_queue: str | None, item: QItem) -> None:
        poison.route(self.put, self.runtime, source, error_queue, item)

    def is_alias(self, name: str) -> bool:
        return name in self.aliases

    def queue_names(self) -> list[str]:
        return sorted(self._queues)

    def queue_count(self) -> int:
        return len(self._queues)

    # -----------------------------------------------------------------------------------------
    # Operations by name

    def put(self, name: str, items: list[bytes], expiry_ms: int = 0) -> int:
        """Add items in order to a queue (and its fanout children) or to an alias's destinations,
        with one journal write a queue.

        Returns how many items were accepted before the first one refused (queue full, item over
        `max_item_size`), as Kestrel's put counts them; nothing after a refused item is added. A
        fanout child is offered what its parent was (src/kestrel/storage/fanout.py); through an
        alias an item counts only if every destination accepted it (src/kestrel/storage/aliases.py).
        Raises InvalidQueueName. A put of no items creates nothing, as Kestrel's (a loop over them).
        """
        if not items:
            check_queue_name(name)
            return 0
        # (an `in` of a dict that lacks the name costs about 100 instructions: the request path asks
        # first whether there is any alias or fanout at all, as most servers have none)
        if self.aliases and name in self.aliases:
            check_queue_name(name)
            accepted = self.aliases.put(name, items, expiry_ms, self.put)
            self.alias_puts.count(name, items[:accepted + 1])
            return accepted
        q = self.queue(name)
        now = self.clock.now_ms()
        accepted = q.put(items, expiry_ms, now)
        if self.fanouts and name in self.fanouts and not q.shares_writes:  # else one write feeds the children
            children = [cq for child in self.fanouts.children(name) if (cq := self._queues.get(child))]
            fanout.feed(children, fanout.offered(items, accepted), expiry_ms, now, self.runtime)
        return accepted

    def remove(self, name: str, count: int = 1, transaction: bool = False,
               timeout: float = 0.0, held: bool = False, max_bytes: int = NATIVE_LIMIT) -> list[QItem]:
        """Take up to `count` items from the head with one journal write (with `transaction`, as
        open reads; `held` ones a get's own until it replies; stopping once their bytes reach
        `max_bytes`: `PersistentQueue.remove`), waiting up to `timeout` seconds for the next ones
        when there are none; an alias gives none. Raises InvalidQueueName, even when asked for no
        items."""
        if self.aliases and name in self.aliases:  # (as in `put`)
            return []
        if count <= 0:
            check_queue_name(name)
            return []
        return self.queue(name).remove(count, transaction, timeout, held, max_bytes)

    def never_waits(self, name: str, removing: bool = False) -> bool:
        """Whether a put to queue `name`, a confirm or an abort of its open reads, or (`removing`) a
        remove of one slice from it without a wait, returns without yielding: the queue is held (a
        creation may wait for an fsync), is neither an alias nor a fanout parent, its own changes
        never wait (`PersistentQueue.never_waits`: under `always`, only through the commit log where
        the caller holds its acknowledgements), and the memory governor holds no puts."""
        q = self._queues.get(name)
        if q is None or (self.aliases and name in self.aliases) or (self.fanouts and name in self.fanouts):
            return False
        governor = self.governor
        return (governor is None or not governor.flow_control) and q.never_waits(removing)

    def holds(self, name: str, count: int) -> bool:
        """Whether a remove of `count` from queue `name` takes `count` items now
        (`PersistentQueue.holds`); False for a queue not held, or an alias."""
        if self.aliases and name in self.aliases:  # (as in `put`)
            return False
        q = self._queues.get(name)
        return q is not None and q.holds(count)

    def peek(self, name: str, timeout: float = 0.0, taking: bool = False) -> QItem | None:
        """The head item of queue `name` (`PersistentQueue.wait_peek`); None for an alias."""
        if name in self.aliases:
            return None
        return self.queue(name).wait_peek(timeout, taking)

    def pass_turn(self, name: str) -> None:
        """The next waiter on queue `name` looks for the item a woken taker leaves
        (`PersistentQueue.pass_turn`)."""
        q = self._queues.get(name)
        if q is not None:
            q.pass_turn()

    def reading(self, name: str) -> PersistentQueue | None:
        """The queue a get on `name` takes from, created on first reference; None for an alias, which
        gives nothing. Its `serial` names the queue the reads it opens belong to. Raises as `queue`."""
        if self.aliases and name in self.aliases:  # (as in `put`)
            return None
        return self.queue(name)

    def confirm(self, name: str, xids: list[int], serial: int | None = None) -> int:
        """Confirm open reads with one journal write; how many were open. With `serial`, only on the
        queue of that serial (`opened_on`)."""
        q = self.opened_on(name, serial)
        return q.confirm(xids) if q is not None else 0

    def unremove(self, name: str, xids: list[int], handed_out: bool = True, serial: int | None = None,
                 owed: bool = False) -> int:
        """Abort open reads with one journal write, each back at the head in turn; how many were
        open. Those never `handed_out` count no error; an `owed` return a failing journal refuses
        is made once it can be written again (`PersistentQueue.unremove`). With `serial`, only on
        the queue of that serial (`opened_on`)."""
        q = self.opened_on(name, serial)
        return q.unremove(xids, handed_out, owed) if q is not None else 0

    def opened_on(self, name: str, serial: int | None) -> PersistentQueue | None:
        """Queue `name`, if it is still the queue of `serial` (None: whichever it is now): the reads
        opened on a queue deleted since are gone with its items, and their xids name other items of
        a queue created under its name after it."""
        q = self._queues.get(name)
        return q if q is not None and (serial is None or q.serial == serial) else None

    def flush(self, name: str) -> None:
        """Empty a queue; one that does not exist is not created (as Kestrel). Raises
        InvalidQueueName, QueueDamaged."""
        if name in self.aliases:
            return
        q = self._queues.get(name)
        if q is None:
            check_queue_name(name)
            self.check_refused(name)
            return
        q.flush()

    def flush_all(self) -> None:
        """Flush every queue; one whose journal cannot be written does not stop the others. The
        other tasks are let in after each FLUSH_PACE items dropped (12 million items in 2,000 queues
        held the loop for 1.6 s).

        Raises the first JournalWriteError once every other queue is flushed.
        """
        failed: JournalWriteError | None = None
        dropped = 0
        for name in self.queue_names():
            if dropped >= FLUSH_PACE:
                self.runtime.pause()
                dropped = 0
            q = self._queues.get(name)  # (after a pause: deleted meanwhile, or made)
            if q is not None:
                dropped += q.length + 1
                try:
                    q.flush()
                except JournalWriteError as e:
                    failed = failed or e
        if failed is not None:
            raise failed

    def delete(self, name: str) -> None:
        """Drop a queue and its journal files; a parent stops feeding a deleted fanout child.

        A creation of the name under way is waited for first (then deleted), and a client naming
        the queue while its files are being closed and removed (its close waits for fsyncs) waits
        for the delete, then creates it anew from nothing, never from the files going. Raises
        JournalWriteError (its files could not be fsynced or removed: they stay, and the next
        reference to the queue, or a restart, takes them up)."""
        if name in self.aliases:
            return
        check_queue_name(name)
        self.check_refused(name)  # its files stay as they are until repaired
        with self._lock:
            while (changing := self._changing.get(name)) is not None:
                changing.wait()
            q = self._queues.pop(name, None)
            self.fanouts.discard(name)
            if q is None:
                return
            self._changing[name] = changing = self.runtime.event()
        # In a task of its own, holding the name until it ends: a kill of the caller (a stop's
        # time-out, at one of the close's waits for an fsync) ends the caller's wait, not the close,
        # which the stop waits for as for any delete under way (`close`). Cut short, it left the
        # queue half closed and out of the collection, a Kestrel 3 journal open past the commit
        # log's close.
        all_side_by_side(self.runtime, [partial(self._destroy, q, changing)])

    def _destroy(self, q: PersistentQueue, changing: Event) -> None:
        """`delete`'s work on queue `q`, taken out of the collection: its files closed and removed,
        then its name given up. Raises JournalWriteError (the files stay)."""
        name = q.name
        try:
            gone = q.destroy()
            if self._owners is not None:
                self._owners.difference_update(gone)  # named again, it is created from nothing
        except OSError as e:  # the files stay: naming the queue again (or a restart) takes them up
            raise self._write_failed(name, e, "cannot delete the queue: its files cannot be written; "
                                     "they stay, and the next reference to it takes them up") from None
        finally:
            del self._changing[name]
            changing.set()
        # Nothing of the collection's background work holds it past this line: freed now, by
        # reference counting (docs/queue-lifetime.md).
        self._changes.forget(q)
        if self.governor is not None:
            self.governor.forget(q)
        self._expiry.forget(q)
        self.queue_deletes += 1
        log.info("queue deleted", queue=name)

    # -----------------------------------------------------------------------------------------
    # Figures

    @property
    def total_items_added(self) -> int:
        """Items added to the queues since start (the server's `total_items`): every queue's adds,
        fanout copies and items moved by expiry or poison included, and the puts a `fanout_only`
        parent accepted (Kestrel's count); each queue counts them where it counts its own (`AddCount`)."""
        return self.adds.items

    def queues(self) -> list[PersistentQueue]:
        """Every queue now: a copy, since a walk over it may let other tasks in (`paced`)."""
        return list(self._queues.values())

    def current_items(self) -> int:
        """Items in every queue: a walk that lets the other tasks in (`paced`), over a copy."""
        return sum(q.length for q in paced(self.queues(), self.runtime))

    def current_bytes(self) -> int:
        return sum(q.bytes for q in paced(self.queues(), self.runtime))

    def reserved_memory(self) -> int:
        """What the queues may hold in memory together: their `max_memory_size`s (Kestrel's sum)."""
        return sum(q.config.max_memory_size for q in paced(self.queues(), self.runtime))

    # -----------------------------------------------------------------------------------------
    # Background expiry and configuration

    def sweep(self) -> int:
        """Expire the due items at the heads of the queues, and delete the empty queues past
        `max_queue_age`: a look at the queues where something is due
        (src/kestrel/storage/expiry.py). Returns the items expired."""
        return self._expiry.sweep(self.clock.now_ms(), self._expire_queue)

    def _expire_queue(self, q: PersistentQueue) -> None:
        if self._queues.get(q.name) is not q:
            return
        log.info("queue expired", queue=q.name, age_ms=self.clock.now_ms() - q.create_time)
        self.delete(q.name)
        self.queue_expires += 1

    def start_sweeper(self, frequency_ms: int) -> None:
        """Run `sweep` every `frequency_ms` on the runtime's timer (0 turns it off)."""
        if frequency_ms <= 0 or self._sweeper is not None:
            return

        def tick() -> None:
            if self.closed:
                return
            try:
                self.sweep()
            except Exception:
                log.exception("expiry sweep failed")
            if not self.closed:
                self._sweeper = self.runtime.call_later(frequency_ms / 1000.0, tick)

        self._sweeper = self.runtime.call_later(frequency_ms / 1000.0, tick)

    def reload(self, configs: QueueConfigs, aliases: Mapping[str, list[str]]) -> None:
        """Apply new queue and alias settings to the live queues. Raises ConfigError (nothing changed).

        The walk over the live queues lets the other tasks in every `PACE` queues (`paced`): a new
        default applied to 10,000 queues at once held every client for a quarter of a second on a
        slow machine. A queue made meanwhile is made with the new settings, one deleted meanwhile is
        passed over, and a reload asked for meanwhile begins once this one has ended."""
        with self._reloads.turn():
            self._reload(configs, aliases)

    def _reload(self, configs: QueueConfigs, aliases: Mapping[str, list[str]]) -> None:
        check_across_queues(configs, aliases)
        # A live queue keeps its files' format; so does one whose creation (or delete) is under way,
        # made in the format it was begun in: accepted, the next start refused its files. The look
        # pauses (`paced`); the queues made or begun meanwhile, in the settings still in force, are
        # then looked at without a pause, up to the settings' change.
        made_in = self._made_in_now()
        self._refuse_changed_formats(configs, paced(made_in.items(), self.runtime))
        since = [(name, fmt) for name, fmt in self._made_in_now().items() if made_in.get(name) != fmt]
        self._refuse_changed_formats(configs, since)
        self.configs = configs
        self.aliases = Aliases.of(aliases)
        kept: dict[str, list[str]] = {}
        # What the reload did, a reset to a default included (a file cut short resets every queue it
        # no longer names), as an operator reads it: one line for each change, naming the queues it
        # made it to, so that a changed default inherited by 10,000 queues is one line, not 10,000.
        changes: dict[str, tuple[dict[str, list[Any]], list[str]]] = {}
        # Each pair of settings objects, before and after, is compared once: the queues of one
        # setting share its object, so a default 10,000 queues inherit is one comparison on the
        # event loop, not 10,000. The pair is held here, so that no other object takes its ids.
        compared: dict[tuple[int, int, bool], tuple[QueueConfig, QueueConfig, list[str] | None]] = {}
        for name, q in paced(list(self._queues.items()), self.runtime):
            if self.closed:
                break
            if self._queues.get(name) is not q:
                continue  # deleted, or deleted and made again (with these settings), meanwhile
            config = self.config_for(name)
            if ignored := q.reload_ignores(config):
                kept[name] = ignored
            before = q.config
            q.reconfigure(config)
            pair = compared.get((id(before), id(q.config), q.is_child))
            if pair is None:
                changed = q.settings_changed(before)
                names = None
                if changed:
                    names = changes.setdefault(repr(sorted(changed.items())), (changed, []))[1]
                pair = compared[id(before), id(q.config), q.is_child] = (before, q.config, names)
            if pair[2] is not None:
                pair[2].append(name)
            if not q.noted:
                q.note_change()  # its limits and ceiling may have changed
            q.age_held_items()
            q.watch_expiry(self._watch_expiry)  # and its ages
        for changed, names in changes.values():
            log.info("reload changed queue settings", queues=names[:LOGGED_NAMES], count=len(names),
                     keys=list(changed), was={k: v[0] for k, v in changed.items()},
                     now={k: v[1] for k, v in changed.items()})
        log.info("queue settings reloaded", queues=len(self._queues), aliases=len(self.aliases))
        self._warn_masked()
        if kept:
            log.warning("reload ignored changed queue settings that a queue keeps from its creation; a "
                        "restart applies them", queues=dict(list(kept.items())[:LOGGED_NAMES]),
                        count=len(kept))

    def _made_in_now(self) -> dict[str, str]:
        """The format of each live queue's files, and of each queue's whose creation or delete is
        under way."""
        made_in = {name: f"kestrel{q.journal_format}" for name, q in self._queues.items()}
        made_in.update((name, self._made_in(name)) for name in self._changing if name not in made_in)
        return made_in

    def _refuse_changed_formats(self, configs: QueueConfigs, made_in: Iterable[tuple[str, str]]) -> None:
        """Raise ConfigError for the first queue of `made_in` whose format `configs` would change."""
        for name, on_disk in made_in:
            configured = configs.for_queue(name).journal_format
            if on_disk != configured:
                raise formats.format_refusal(self.path, name, on_disk, configured)

    def _warn_masked(self) -> None:
        """Name the queues an alias of the same name hides: a get of the name reads the alias (no
        item, as in Kestrel), so what such a queue holds is read only once the alias is gone."""
        masked = {name: self._queues[name].length for name in sorted(self.aliases) if name in self._queues}
        if masked:
            log.warning("queue name(s) masked by alias(es): their items cannot be read while the alias "
                        "exists", queues=masked)

    def end_waits(self) -> None:
        """Wake every waiting reader empty-handed; from now on no read waits (the server is stopping)."""
        self.waits_ended = True
        for q in list(self._queues.values()):
            q.end_waits()

    def close(self) -> None:
        """Stop the sweeper and close every queue (journals flushed and fsynced), then the commit log.

        The queues close side by side, `CLOSED_AT_ONCE` at a time, each in a task of the runtime: their
        final fsyncs overlap (one round of the group commit, or a thread each), so that a stop waits
        for about one fsync rather than one a file. A creation or a delete under way (a client's
        whose connection outlived the shutdown timeout) ends first, so that its queue is among them.
        Each queue's own files close in their order, and the commit log only once every queue has.
        Raises the first error a queue's close raised,
        once the others are closed (the commit log is then left for the next start's recovery).
        A second close changes nothing: it returns once the first has ended, raising nothing.
        """
        closing = self._closing
        if closing is not None:
            closing.wait()
            return
        self._closing = closing = self.runtime.event()
        try:
            self._close_all()
        finally:
            closing.set()

    def _close_all(self) -> None:
        """`close`'s work, done once."""
        self.closed = True
        if self.governor is not None:
            self.governor.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        if self.commit_log is not None:
            self.commit_log.closing()  # the queues' closes fsync what its checkpoints would
        while self._changing:  # a creation or a delete waiting for an fsync: its queue closes with these
            next(iter(self._changing.values())).wait()
        queues = list(self._queues.values())
        failed: list[BaseException] = []
        for first in range(0, len(queues), CLOSED_AT_ONCE):
            failed += side_by_side(self.runtime, [q.close for q in queues[first:first + CLOSED_AT_ONCE]])
        if failed:
            raise failed[0]
        if self.commit_log is not None:
            self.commit_log.close()
