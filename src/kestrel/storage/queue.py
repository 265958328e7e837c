"""PersistentQueue: one queue's rules, written once for both journal formats.

The collection and every protocol use a queue through this class alone. It keeps the queue in
memory (the items from the head, up to `max_memory_size` bytes of them; the open reads by id; the
guide's figures) and applies every rule the guide gives a queue: the limits and discard-old, expiry
at the head and the expiry queue, open reads, poison items, read-behind (items past the memory
budget are only counted, and read back from disk as the head drains), waits and stats.

A format subclasses it and supplies only how items are stored, read back and made durable: the
storage hooks at the end of the class. `Kestrel2Queue` (src/kestrel/storage/kestrel2/queue.py) journals every
change as a record and rebuilds from its journal when a write fails; `Kestrel3Queue`
(src/kestrel/storage/kestrel3/queue.py) is one reader of a writer journal that several readers share, and
records only what it consumes. A change tells its format what happened, in order (`_log_*`), then
`_commit`s; a format may buffer the records until then.

A subclass rather than a storage object beside the queue: a format rebuilds this state itself
(replay, read-behind), and every per-item step would otherwise cross one more object.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from itertools import islice
from operator import attrgetter
from typing import Any, ClassVar, Final, Protocol, TypeVar

import structlog

from kestrel.storage import poison
from kestrel.storage.acknowledgements import holder
from kestrel.storage.clock import Clock, age_ms
from kestrel.storage.config import NATIVE_LIMIT, QueueConfig, native_limit
from kestrel.storage.deferred_log import log_later
from kestrel.storage.errors import JournalReadError, JournalWriteError, QueueClosed
from kestrel.storage.item import LookedItems, QItem, data_sizes, item_data, new_items, take_items
from kestrel.storage.no_lock import NO_LOCK
from kestrel.storage.queue_path import JournalFileFigures, JournalFiles
from kestrel.storage.read_behind import Cursor, ReadBehind
from kestrel.storage.runtime import Lock, Runtime
from kestrel.storage.wait_list import WaitList
from kestrel.storage.write_gate import CachedReads, NotCached, WriteGate

log = structlog.get_logger("kestrel.queue")

_XID = attrgetter("xid")

T = TypeVar("T")

# Called by every put and get, bound once: names imported from a module the build leaves
# interpreted (`storage.item`, the Python twin of its C helper) are looked up in this module's
# dictionary each call, where a `Final` one is a C static (src/kestrel/build.py).
_data_sizes: Final = data_sizes
_new_items: Final = new_items
_take_items: Final = take_items

class MemoryAccount:
    """Where a queue counts the bytes it holds in memory (its items in memory, its open reads and its
    read-behind cursor's buffer), kept as they change: a batch's bytes once as it enters or leaves
    memory. A queue has one of its own until the collection counts it in the server's, the memory
    governor's ledger (src/kestrel/storage/memory.py), whose `limit` is the budget and whose
    `make_room` pages out."""

    __slots__ = ("total", "limit")

    UNLIMITED: ClassVar[int] = NATIVE_LIMIT  # a limit that no total reaches

    def __init__(self) -> None:
        self.total = 0
        self.limit = MemoryAccount.UNLIMITED

    def make_room(self, queue: PersistentQueue, size: int) -> None:
        """A put of `size` bytes into `queue`'s memory would take `total` over `limit`."""


class AddCount:
    """Where a queue counts its adds beside its own `total_items`, at the same line: the collection
    hands every queue its one, so that the server's `total_items` is every queue's adds (fanout
    copies, items expiry or poison moved to another queue), whichever path added them, and cannot
    disagree with the queues' own. A queue counts in one of its own until the collection holds it."""

    __slots__ = ("items",)

    def __init__(self) -> None:
        self.items = 0


@dataclass(frozen=True)
class ReaderPosition:
    """One reader's place in a shared writer journal (Kestrel 3)."""

    queue: str  # the queue it serves: the writer's name, or `name+reader` for a fanout child
    head: int  # every item id at or below this one is consumed
    done_above: int  # ids above the head consumed out of order (confirmed while older ones are open)
    items: int
    open_reads: int
    tail: int  # the newest item id written to the journal


class DepartureWatcher(Protocol):
    """Told of each item that leaves the head (Kestrel 2's rotation checkpoints)."""

    def note_departure(self, item: QItem, opened: bool) -> None: ...


def _unwatched(queue: PersistentQueue) -> None:
    """What a queue no collection watches tells of its changes: nothing."""


def _reaching(items: Iterable[QItem], max_bytes: int) -> tuple[int, int]:
    """How many of `items` a reply holds: those up to the first whose bytes reach `max_bytes` (one at
    least), and their bytes. The one byte bound of a get's and a look's items."""
    size = 0
    keep = 0
    for item in items:
        size += len(item.data)
        keep += 1
        if size >= max_bytes:
            break
    return keep, size


def _within(mem: deque[QItem], taken: list[QItem], max_bytes: int) -> tuple[list[QItem], int]:
    """Of items just taken from the head of `mem`, those `_reaching` keeps, and their bytes; the
    rest go back to the head, in order (nothing was logged)."""
    keep, size = _reaching(taken, max_bytes)
    mem.extendleft(reversed(taken[keep:]))
    return taken[:keep], size



def capped_expiry(add_time: int, expiry: int, max_age: int | None) -> int:
    """An item's expiry (0 = never) capped by `max_age` (None or 0: no cap) after its add time."""
    if not max_age:
        return expiry
    cap = add_time + max_age
    return min(expiry, cap) if expiry else cap


class PersistentQueue(ABC):
    """A durable FIFO queue with reliable reads, limits, expiry, poison items and read-behind.

    Locking is decided here once: every change takes the queue's lock, in `with self:`
    (`__enter__`), and the rules take none of their own. Under gevent (the server) the runtime's
    lock is a no-op: a greenlet is never preempted, and a change does not yield before its records
    are appended (the sync policy's wait comes last, in `_commit`), so the loop needs no lock and
    pays for none. A program of plain threads (`ThreadsRuntime`) gets a reentrant lock, so that each
    change is atomic against the other threads; the readers of one Kestrel 3 writer journal share
    their journal's lock, since a put changes each of them. Readers wait for items outside the
    lock (`remove`). An append of megabytes is the exception: it is written off the loop, and the
    changes of its journal wait at the journal's gate meanwhile (`src/kestrel/storage/write_gate.py`).

    Parameters: `name` (`q`, or `q+child` for a fanout child), `queue_path`, `config`, `clock`,
    `runtime`, `expire_to` (looks up the queue that expired items move to).
    """

    # A put reaches every reader of one shared write (Kestrel 3), rather than the collection copying
    # it to each fanout child (Kestrel 2).
    shares_writes: ClassVar[bool] = False
    # Whether, in read-behind, `_restore` (the undo of a failed write) may wait: for a pack of the
    # journal, and for the refill's reads off the loop (Kestrel 2 replays its journal).
    undo_waits_in_read_behind: ClassVar[bool] = False
    journal_format: ClassVar[int] = 0  # the format's number, 2 or 3 (Kestrel 2's journal, Kestrel 3's files)
    # Kestrel 2's packs keep the place of items gone since their rotation with empty items that
    # expired at this time; they move to no expiry queue. -1: no placeholders.
    _placeholder_expiry: ClassVar[int] = -1
    # Settings a queue takes at its creation and keeps through reloads: a restart applies a change.
    # A fanout-only parent keeps no journal (Kestrel 2) or reader (Kestrel 3) of its own, so one
    # reloaded to hold items would hold them in memory alone, each acknowledged and lost at a restart.
    fixed_settings: ClassVar[tuple[str, ...]] = ("fanout_only",)

    # What every put and get reads, declared ahead of the rest so that the compiled build lays these
    # fields out together, in the object's first three cache lines (the flags side by side): with
    # 10,000 queues a request finds its queue out of the CPU's caches, and fields spread over the
    # whole object cost a miss a line (bench/README.md, "Cost that follows the work"). `bytes`, whose
    # name here would hide the type in the annotations below, is the first field `__init__` sets.
    _locks: bool
    is_child: bool
    fanout_only: bool
    noted: bool
    may_expire: bool
    closed: bool
    read_only: bool
    clock: Clock
    _gate: WriteGate
    _mem: deque[QItem]
    _behind: ReadBehind | None
    _watchers: Sequence[DepartureWatcher]
    _waits: WaitList | None
    _ledger: MemoryAccount
    adds: AddCount
    _config: QueueConfig
    _max_items: int
    _max_size: int
    _max_item_size: int
    memory_target: int
    length: int
    memory_bytes: int
    total_items: int
    current_age: int
    total_transactions: int

    def __init__(self, name: str, queue_path: str, config: QueueConfig, clock: Clock, runtime: Runtime,
                 expire_to: Callable[[str], PersistentQueue | None] | None) -> None:
        self.bytes = 0  # first: laid out beside the fields declared above
        self.name = name
        self.queue_path = queue_path
        self.config = config
        self.clock = clock
        self.runtime = runtime
        self._expire_to = expire_to
        self._lock: Lock = runtime.lock()
        # A change enters the lock only when it is one: gevent's (`NO_LOCK`) does nothing, and its two
        # calls a change were a method looked up and called by name each (the type is the protocol's).
        self._locks = self._lock is not NO_LOCK
        # Where changes wait while a large append of this queue's journal is written off the loop
        # (Kestrel 3: its writer journal's, which every reader shares).
        self._gate = WriteGate(runtime)
        self.is_child = "+" in name
        # A parent only feeding its fanout children: it stores no put (fixed at creation).
        self.fanout_only = self._fanout_only_by(config)
        self._mem: deque[QItem] = deque()  # the items held in memory, from the head
        self._opens: dict[int, QItem] = {}  # open reads by id
        self._behind: ReadBehind | None = None  # while in read-behind (src/kestrel/storage/read_behind.py)
        self._buffered = 0  # its cursor's read buffer, as counted in the ledger (`_count_buffer`)
        self._reads_behind = True  # whether items past max_memory_size may stay on disk
        # What the read-behind rules hold in memory: max_memory_size, or less while the memory
        # governor (src/kestrel/storage/memory.py) gives this queue a smaller share of the server's budget.
        self.memory_target = config.max_memory_size
        self._governed = False
        # The running total of the server's memory this queue counts its items and open reads in
        # (`count_in`): its own until the collection counts it in the server's.
        self._ledger = MemoryAccount()
        # The count of items added to every queue of the server this queue adds to (`AddCount`).
        self.adds = AddCount()
        # Whether a change since the collection last looked was noted (`note_changes_to`): the
        # memory governor visits the queues that changed, not every one.
        self.noted = True  # nothing to tell until `note_changes_to`
        self._changed: Callable[[PersistentQueue], None] | None = None
        # Whether anything here can expire (`watch_expiry`); once true, told after every change.
        self.may_expire = False
        # The `max_age` the items held were last capped by (`age_held_items`).
        self._aged_by: int | None = None
        self._expiry_watch: Callable[[PersistentQueue], None] = _unwatched
        # At least as many as the items at the head of memory that were taken before (aborted reads
        # back at the head, always its first items): the tail beyond them is the newest adds, in
        # journal order (`shed`). Each item leaving the head lowers it: once they are gone, a shed
        # may page out any item but the head (it kept them in memory for good, and a server whose
        # memory they held above the flow-control mark refused every put).
        self._pushed = 0
        self._watchers: Sequence[DepartureWatcher] = ()
        # Readers waiting for an item: made at the first wait (`_wait_list`), so that a queue nobody
        # waits on keeps no list to look at on each put.
        self._waits: WaitList | None = None
        # Takes items aborted max_errors times, told the queue's name and error queue (poison.hand_over).
        self.on_poison: poison.Receiver | None = None
        self.closed = False
        # A close is under way (`close`): work a format would start meanwhile (a Kestrel 2 rotation
        # its journal refused) is not started.
        self.closing = False
        # Which of the queues ever called by this name in this process it is (given by the
        # collection at its creation; 0 outside one): an open read closes only on the queue it was
        # opened on, never on one created under the same name after a delete (its xids start again).
        self.serial = 0
        # A write of the journal failed: changes are refused until a probe write succeeds.
        self.read_only = False
        self._own_failure: BaseException | None = None  # the change in progress failed a write of ours
        # Returns a failing journal refused that nobody will try again (`unremove`): made once it can be
        # written again.
        self._owed_returns: list[tuple[list[int], bool]] = []
        self.length = 0
        self.memory_bytes = 0
        self.create_time = clock.now_ms()
        self.total_items = 0
        self._found = 0  # items the queue held when it was opened (`look` counts positions from them)
        self.expired_items = 0
        self.discarded = 0
        self.total_flushes = 0
        self.total_transactions = 0
        self.canceled_transactions = 0
        self.poisoned = 0
        self.current_age = 0
        self.journal_write_errors = 0

    # Every change runs `with self:` (a queue refers to no object that refers back to it, so a deleted
    # queue is freed by reference counting alone, even where the garbage collector never looks:
    # src/kestrel/service/gc_pauses.py). A context manager rather than a generator, since every add
    # and remove enters it (a generator's cost a microsecond each time); it keeps no state, so nested
    # changes share it.
    def __enter__(self) -> None:
        """The queue's lock, the closed check, the probe of a read-only queue's journal, the
        read-behind cursor's file and `_prepare_change`."""
        if self._locks:
            self._lock.__enter__()
        gate = self._gate
        counted = False
        try:
            if gate.busy is not None:
                gate.wait_turn()
            if self.closed:
                raise QueueClosed(f"queue {self.name!r} is closed")
            gate.changes += 1  # in progress from here to `__exit__` (`WriteGate.read`)
            counted = True
            if self.read_only:
                self._probe()
            if self._behind is not None:
                self._open_cursor_file()
            self._prepare_change()
        except BaseException:
            if counted:
                gate.changes -= 1
            if self._locks:
                self._lock.__exit__(None, None, None)
            raise

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: object) -> None:
        """`_after_change` or `_change_failed`, the collection told, the lock released."""
        if not self.noted:
            self.note_change()
        if self.may_expire:
            self._expiry_watch(self)
        try:
            if error is None:
                self._after_change()
            else:
                self._change_failed(error)
        finally:
            self._gate.changes -= 1
            if self._locks:
                self._lock.__exit__(None, None, None)

    # -----------------------------------------------------------------------------------------
    # Figures

    @property
    def config(self) -> QueueConfig:
        """The queue's settings. Setting them sets the limits each put compares its totals with, in
        the compiled build without a Python object (`native_limit`)."""
        return self._config

    @config.setter
    def config(self, config: QueueConfig) -> None:
        self._config = config
        self._max_items = native_limit(config.max_items)
        self._max_size = native_limit(config.max_size)
        self._max_item_size = native_limit(config.max_item_size)

    @property
    def open_transactions(self) -> int:
        return len(self._opens)

    @property
    def waiters(self) -> int:
        return len(self._waits) if self._waits is not None else 0

    @property
    def waits_ended(self) -> bool:
        return self._waits is not None and self._waits.ended

    @property
    def paged_out(self) -> int:
        """Bytes of items only in the journal (read-behind, or paged out under the memory budget)."""
        return self.bytes - self.memory_bytes

    @property
    def in_read_behind(self) -> bool:
        """Whether items beyond `max_memory_size` are only counted, to be read back from disk."""
        return self._behind is not None

    def stats(self) -> dict[str, int]:
        """The guide's per-queue figures, under its names, and ours (read-only, write errors, poison,
        memory, how long the head item has waited, the journal format)."""
        age = self.current_age if self.length else 0
        mem = self._mem
        return {
            "items": self.length,
            "bytes": self.bytes,
            "total_items": self.total_items,
            "logsize": self.live_journal_size,
            "journal_size": self.journal_size,
            "expired_items": self.expired_items,
            "mem_items": len(self._mem),
            "mem_bytes": self.memory_bytes,
            "age": age,
            "discarded": self.discarded,
            "waiters": self.waiters,
            "open_transactions": len(self._opens),
            "transactions": self.total_transactions,
            "canceled_transactions": self.canceled_transactions,
            "total_flushes": self.total_flushes,
            "age_msec": age,
            "create_time": self.create_time,
            "read_only": int(self.read_only),
            "journal_write_errors": self.journal_write_errors,
            "poisoned": self.poisoned,
            # Not ending in _bytes: Kestrel clients read `queue_<name>_<...>_bytes` as a queue name.
            "memory_target": self.memory_target,
            "paged_out": self.paged_out,
            # Not ending in _age: Kestrel clients read `queue_<name>_<...>_age` as a queue name too.
            "head_wait_ms": age_ms(self.clock.now_ms(), mem[0].add_time) if self.length and mem else 0,
            "read_behind": int(self._behind is not None),
            "journal_format": self.journal_format,
        }

    def open_reads(self) -> list[QItem]:
        """The items of the open reads, lowest id first."""
        return [self._opens[xid] for xid in sorted(self._opens)]

    def readers_on_disk(self) -> list[str]:
        """Fanout readers found on disk that the collection has still to open (Kestrel 3: their
        checkpoints; a Kestrel 2 child's journal is found by the collection's own scan)."""
        return []

    def journal_files(self) -> list[JournalFileFigures]:
        """The queue's files on disk now, oldest first, each with what its manifest records."""
        return []

    def reader_positions(self) -> list[ReaderPosition]:
        """Where each reader of the journal this queue reads stands (Kestrel 3: the queue and its
        fanout children share one writer journal); none for a format with a journal per queue."""
        return []

    # -----------------------------------------------------------------------------------------
    # What the collection's background work reads: which queues changed, what can expire, when

    def note_changes_to(self, changed: Callable[[PersistentQueue], None]) -> None:
        """From now on the first change after `noted` is cleared calls `changed(self)` and sets it:
        one attribute test a change, so that the memory governor visits the queues that changed
        rather than all of them."""
        self._changed = changed
        self.noted = False

    def note_change(self) -> None:
        """This queue changed (or may have: a replay, new settings) since `noted` was cleared."""
        self.noted = True
        if self._changed is not None:
            self._changed(self)

    def watch_expiry(self, watch: Callable[[PersistentQueue], None]) -> None:
        """From now on `watch(self)` after every change while anything here can expire: the
        settings age items or the queue (`max_age`, `max_queue_age`), or it was given an item with
        an expiry (`_receive`) or loaded one, or items wait on disk, unread. Called once the queue is
        loaded and after new settings; a queue that can expire nothing costs the expiry sweep
        nothing (src/kestrel/storage/expiry.py). Once true it stays so: an open read or a later item
        may still carry an expiry."""
        self._expiry_watch = watch
        if not self.may_expire:
            cfg = self.config
            self.may_expire = bool(cfg.max_age or cfg.max_queue_age or self._behind is not None
                                   or any(item.expiry for item in self._mem)
                                   or any(item.expiry for item in self._opens.values()))
        if self.may_expire:
            watch(self)

    def age_held_items(self) -> None:
        """Cap the items held (in memory, and open reads) by `max_age` after their add time, once the
        queue is loaded and after new settings. Kestrel reads its current `max_age` at each look at
        the head (`adjustExpiry`), so lowering it, by a reload or in the settings of a restart, ages
        the items already queued, not only those put after (items read back from disk are capped
        as they come: `_fill`). A raised `max_age` lengthens no cap already given, as in Kestrel,
        where an item keeps the expiry its put was given."""
        max_age = self.config.max_age
        if max_age is None or max_age == self._aged_by:
            self._aged_by = max_age
            return
        self._aged_by = max_age
        with self._lock:
            for held in (self._mem, self._opens.values()):
                for item in held:
                    item.expiry = capped_expiry(item.add_time, item.expiry, max_age)

    def head_expiry(self) -> int:
        """When the head item expires: 0 never (or no item), -1 when the head is not in memory (a
        read-behind cursor holds it), so that only a look can tell. Takes no lock: under plain
        threads the head may be another a moment later, and that change notes the queue again."""
        try:
            return self._mem[0].expiry
        except IndexError:
            return -1 if self._behind is not None else 0

    # -----------------------------------------------------------------------------------------
    # Adding

    def put(self, items: list[bytes], expiry: int = 0, add_time: int | None = None) -> int:
        """Add items at the tail with one journal write; how many were accepted: those before the
        first one refused (over `max_item_size`, or the queue full), as Kestrel's put counts them.

        `expiry` is absolute milliseconds since the epoch (0 = never), capped by `max_age`;
        `add_time` is now unless given. A fanout-only parent stores none, as Kestrel's: it counts
        those that fit, and offers its readers those and the first that does not (Kestrel 3).
        Raises JournalWriteError (nothing was added).
        """
        with self:
            now = self.clock.now_ms() if add_time is None else add_time
            if self.fanout_only:
                fitting = self._fitting(items)
                if self.shares_writes:
                    self._put_shared(items[:fitting + 1], expiry, now)
                self.adds.items += fitting  # the server counts the put, as Kestrel's; the queue stores none
                return fitting
            if self.shares_writes:
                return self._put_shared(items, expiry, now)
            count, size = self._admit(items, now)
            if count:
                self._receive(items if count == len(items) else items[:count], size, now, expiry, 0)
            self._commit()
            return count

    def _fitting(self, items: list[bytes]) -> int:
        """How many of `items` come before the first one over `max_item_size`."""
        limit = self.config.max_item_size
        if _data_sizes(items)[1] <= limit:
            return len(items)
        return next(i for i, data in enumerate(items) if len(data) > limit)

    def _admit(self, items: list[bytes], now: int) -> tuple[int, int]:
        """How many of `items` (a prefix) this queue takes, and their bytes: those before the first
        one over `max_item_size`, as many as fit the limits, or all of them when it discards old
        items to make room. Expired items leave the head first."""
        mem = self._mem
        if self._behind is not None or (mem and mem[0].expiry):
            self._expire_head(now)
        size, largest = _data_sizes(items)
        count = len(items)
        max_items, max_size = self._max_items, self._max_size
        if largest > self._max_item_size:
            count = self._fitting(items)
            size = _data_sizes(items[:count])[0]
        if self.length + count < max_items and self.bytes + size < max_size:
            return count, size  # all fit with room to spare (the common put)
        if self.config.discard_old_when_full:
            return (0, 0) if max_items == 0 or max_size == 0 else (count, size)
        length, total, taken = self.length, self.bytes, 0
        for data in items[:count]:
            if length >= max_items or total >= max_size:
                break
            length += 1
            total += len(data)
            taken += 1
        return taken, total - self.bytes

    def _receive(self, items: list[bytes], size: int, now: int, expiry: int, first_id: int) -> None:
        """The items `_admit` took (of `size` bytes) join the tail, old ones discarded to make room
        if the queue is set to; past `max_memory_size` they are only counted (read-behind).
        `first_id` is the first item's id (Kestrel 3: their ids follow it), or 0."""
        if not self.noted:  # a shared write reaches each reader outside its own change
            self.note_change()
        cfg = self.config
        if cfg.max_age:
            expiry = self._capped_expiry(now, expiry)
        if expiry:
            self.may_expire = True
        count = len(items)
        ledger = self._ledger
        if self._behind is None and ledger.total + size > ledger.limit:
            # over the server's budget: page out now (src/kestrel/storage/memory.py)
            ledger.make_room(self, size)
        max_items, max_size = self._max_items, self._max_size
        if (self._behind is None and self.length + count < max_items and self.bytes + size < max_size
                and self.memory_bytes + size < self.memory_target):
            # All fit in memory with room to spare: no per-item checks (the common put).
            self._log_put(items, now, expiry, first_id)
            self._mem.extend(_new_items(now, expiry, items, first_id))
            self.length += count
            self.bytes += size
            self.memory_bytes += size
            ledger.total += size
        else:
            # Item by item: old items discarded to make room first, read-behind starting after the
            # item that fills memory. Each run of adds is journaled before a discard or read-behind
            # reads the journal.
            discard = cfg.discard_old_when_full
            logged = 0  # items[:logged] are journaled
            for n, item in enumerate(new_items(now, expiry, items, first_id)):
                if discard and (self.length >= max_items or self.bytes >= max_size):
                    self._log_put(items[logged:n], now, expiry, first_id + logged if first_id else 0)
                    logged = n
                    while self.length >= max_items or self.bytes >= max_size:
                        if not self._discard_head():
                            break
                if self._append(item):
                    self._log_put(items[logged:n + 1], now, expiry, first_id + logged if first_id else 0)
                    logged = n + 1
                    self._enter_read_behind(item)
            if logged < count:
                self._log_put(items[logged:], now, expiry, first_id + logged if first_id else 0)
        self.total_items += count
        self.adds.items += count  # the server's, counted with the queue's
        waits = self._waits
        if waits is not None and len(waits):
            waits.wake(count)

    def _capped_expiry(self, add_time: int, expiry: int) -> int:
        return capped_expiry(add_time, expiry, self.config.max_age)

    def _discard_head(self) -> bool:
        """Discard the head item to make room; False if there is none."""
        item = self._take_head()
        if item is None:
            return False
        self._log_gone([item])
        self.discarded += 1
        return True

    # -----------------------------------------------------------------------------------------
    # Removing

    def remove(self, count: int = 1, transaction: bool = False, timeout: float = 0.0,
               held: bool = False, max_bytes: int = NATIVE_LIMIT) -> list[QItem]:
        """Take up to `count` items from the head with one journal write; with `transaction` each
        becomes an open read (its `xid` set). The items taken stop once their bytes reach
        `max_bytes` (one at least): what a get's reply holds is bounded before any item is read
        back from disk or laid out. An empty queue is waited on up to `timeout` seconds
        for its next items, waiters served first come first (outside the lock). `held` open reads
        are a get's own until it replies (confirmed then, or put back with `handed_out=False`):
        not counted as transactions.

        Raises JournalWriteError (nothing was taken).
        """
        with self:
            now = self.clock.now_ms()
            mem = self._mem
            if self._behind is None and not self._watchers:
                # The common get: when none of the items can expire they go in one step.
                taken, size = _take_items(mem, count)
                if size < 0:
                    taken = self._take_each(count, now, transaction, max_bytes)
                elif taken:
                    if size > max_bytes:
                        taken, size = _within(mem, taken, max_bytes)
                    if self._pushed:
                        self._pushed = max(0, self._pushed - len(taken))
                    self.length -= len(taken)
                    self.bytes -= size
                    self.memory_bytes -= size
                    if transaction:
                        self._opened(taken)  # held still, as open reads: the ledger keeps them
                    else:
                        self._ledger.total -= size
                        self._log_gone(taken)
            else:
                taken = self._take_each(count, now, transaction, max_bytes)
            if taken:
                self.current_age = age_ms(now, taken[-1].add_time)
                if held:
                    self.total_transactions -= len(taken)
            self._commit()
        if taken or timeout <= 0:
            return taken
        return self._wait_list().wait(lambda: self.remove(count, transaction, 0.0, held, max_bytes) or None,
                                      timeout) or []

    def never_waits(self, removing: bool = False) -> bool:
        """Whether a put to this queue, a confirm or an abort of open reads, or (`removing`) a remove
        of one slice without a wait, returns without yielding: its changes wait for no fsync, no
        large append or read of its journal runs off the loop (nothing holds its gate: a Kestrel 2
        rotation's work neither), it hands no item to another queue
        (expired or poison: that queue's creation may wait; a poison item dropped is logged after the
        change), and it reads nothing back from disk (`_reads_back`: in read-behind, what the page
        cache does not hold is read off the loop).

        No fsync is waited for under `never`, under a periodic sync (a timer or the commit log's
        round fsyncs later), nor under `always` where every file a change commits logs to the
        commit log and the caller holds its acknowledgements: the change leaves its turn of the log
        to the holder (`CommitLog.sync`), and what a change may start besides (a rotation, a
        segment filling, a checkpoint, a pack, a failed turn's fallback) runs off it. A file holding
        bytes of a turn the log settled without making durable does not log alone: its commit waits
        for its own fsync (`_commit_logged`)."""
        cfg = self.config
        sync = cfg.sync_journal
        return ((sync is None or sync > 0 or (self._commit_logged() and holder() is not None))
                and self._gate.busy is None and cfg.expire_to_queue is None and cfg.error_queue is None
                and not self._reads_back(removing))

    def _reads_back(self, removing: bool) -> bool:
        """Whether a change may read items back from the journal, which waits for the disk where
        the page cache does not hold them: in read-behind, a remove, a put that takes items from
        the head (an expired one, or old ones it discards to make room) or finds none in memory,
        any change whose cursor must read its file to open it (Kestrel 3's checks its header), and
        any change of a format whose undo of a failed write may wait (`undo_waits_in_read_behind`)."""
        behind = self._behind
        if behind is None:
            return False
        mem = self._mem
        if (removing or not mem or self.config.discard_old_when_full or behind.cursor.opening_reads()
                or self.undo_waits_in_read_behind):
            return True
        expiry = mem[0].expiry
        return 0 < expiry <= self.clock.now_ms()

    def holds(self, count: int) -> bool:
        """Whether a remove of `count` takes `count` items now: the queue holds them and none can
        expire (`may_expire`; one expired at the head would be dropped rather than taken)."""
        return self.length >= count and not self.may_expire

    def _take_each(self, count: int, now: int, transaction: bool, max_bytes: int) -> list[QItem]:
        """`remove`'s items one at a time, each head checked for expiry first (read-behind, or items
        that can expire)."""
        mem = self._mem
        taken: list[QItem] = []
        size = 0
        while len(taken) < count and size < max_bytes:
            if self._behind is not None or (mem and mem[0].expiry):
                self._expire_head(now)
            item = self._take_head(opened=transaction)
            if item is None:
                break
            if transaction:
                self._ledger.total += len(item.data)  # held still, as an open read
                self._opened([item])
            else:
                self._log_gone([item])
            taken.append(item)
            size += len(item.data)
        return taken

    def _opened(self, items: list[QItem]) -> None:
        """Items taken from the head become open reads, each with its xid."""
        self._log_open(items)
        self._opens.update(zip(map(_XID, items), items, strict=True))
        self.total_transactions += len(items)

    def peek(self) -> QItem | None:
        """The head item, left in place (expired items are dropped first, unless read-only)."""
        if self.read_only:
            if self.closed:
                raise QueueClosed(f"queue {self.name!r} is closed")
            now = self.clock.now_ms()
            with self._lock:
                return next((i for i in self._mem if not i.expiry or i.expiry > now), None)
        with self:
            if self._expire_head(self.clock.now_ms()):
                self._commit(housekeeping=True)
            mem = self._mem
            if not mem and self._behind is not None:
                self._fill()
            return mem[0] if mem else None

    def look(self, first: int, count: int, max_bytes: int = NATIVE_LIMIT) -> LookedItems:
        """Up to `count` items from position `first` on (from the head, if that is past it), left
        where they are: nothing is taken, opened, counted or journaled, so a look is not a delivery
        and moves no error count towards `max_errors`. Expired items are left out, as a get would.
        The items covered stop once their bytes reach `max_bytes` (one at least, so that looks from
        `after` on go on), as a get's do (`remove`); an expired one counts, being passed over.

        The head's position is how many items have left the head since the queue was opened, less
        those put back: the items found at the start and added since, less those it holds.
        Only items held in memory are shown: `after` stops where read-behind keeps the rest on disk.
        """
        with self._lock:
            if self.closed:
                raise QueueClosed(f"queue {self.name!r} is closed")
            head = self._found + self.total_items - self.length
            start = max(first - head, 0)
            mem = self._mem
            end = min(start + max(count, 0), len(mem)) if start < len(mem) else start
            covered = list(islice(mem, start, end))
            del covered[_reaching(covered, max_bytes)[0]:]
            now = self.clock.now_ms()
            shown = [item for item in covered if not item.expiry or item.expiry > now]
            return LookedItems(self.create_time, head, self.length, head + start + len(covered), shown)

    def discard_expired(self, limit: int | None = None) -> int:
        """Drop expired items from the head (at most `limit`); the sweeper calls this.

        Raises JournalWriteError (nothing was dropped).
        """
        if self.closed or self.read_only:
            return 0
        with self:
            expired = self._expire_head(self.clock.now_ms(), limit)
            if expired:
                self._commit()
            return expired

    def _expire_head(self, now: int, limit: int | None = None) -> int:
        """Remove expired items from the head, each moved to `expire_to_queue` if one is set; how many."""
        mem = self._mem
        removed = refused = 0
        target_name = self.config.expire_to_queue
        while limit is None or removed < limit:
            if not mem and self._behind is not None:
                self._fill()
            if not mem:
                break
            head = mem[0]
            if not head.expiry or head.expiry > now:
                break
            self._take_head()
            self._log_gone([head])
            removed += 1
            self.expired_items += 1
            if (target_name and self._expire_to is not None
                    and (head.data or head.expiry != self._placeholder_expiry)
                    and not self._hand_over(self._move_expired, target_name, head.data)):
                refused += 1
        if refused:
            log_later(self.runtime, log.warning, "expire_to_queue refused expired items (full, or an item "
                      "over its max_item_size); they are dropped, as Kestrel drops them", queue=self.name,
                      expire_to_queue=target_name, dropped=refused)
        return removed

    def _move_expired(self, target_name: str, data: bytes) -> bool:
        """An expired item's data to `expire_to_queue` (found, or made, by name; not to this queue,
        which drops it); whether it was not refused there."""
        assert self._expire_to is not None
        target = self._expire_to(target_name)
        return target is None or target is self or target.put([data]) == 1

    def _hand_over(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)`, the change in progress handing items to another queue, which may pause
        (that queue's creation, its gate, its fsync) with this change half made: what the change
        noted is its own meanwhile (`_set_aside`), and the journal's other changes wait at its gate
        (`WriteGate.hand_over`). Another one going on found this one half made: it wrote this
        one's records or consumed ids before that queue had the items (lost, should its put fail),
        or undid this one with itself when its own write failed (the items handed over twice)."""
        notes = self._set_aside()
        try:
            return self._gate.hand_over(fn, *args)
        finally:
            self._take_back(notes)

    def flush(self) -> None:
        """Drop every item (open reads stay open). Those expired at the head expire first, counted
        and moved to `expire_to_queue`, as Kestrel's flush (a loop of removes) expires them.

        Raises JournalWriteError (nothing was dropped).
        """
        with self:
            self._expire_head(self.clock.now_ms())
            self._drop_items()
            self.total_flushes += 1
            self._commit()

    # -----------------------------------------------------------------------------------------
    # Open reads

    def confirm(self, xids: Iterable[int]) -> int:
        """Close these open reads for good, their records in one journal write; how many were open.

        Raises JournalWriteError (the reads stay open).
        """
        with self:
            opens = self._opens
            closed = [item for xid in xids if (item := opens.pop(xid, None)) is not None]
            if closed:
                self._ledger.total -= data_sizes(item_data(closed))[0]
                self._log_confirm(closed)
                self._commit()
            return len(closed)

    def unremove(self, xids: Iterable[int], handed_out: bool = True, owed: bool = False) -> int:
        """Abort these open reads, each item going back to the head in turn (so the last one given
        ends up first), their records in one journal write; how many were open. An item aborted for
        the `max_errors`th time leaves for good instead (journaled as a confirm) and goes to
        `on_poison` (src/kestrel/storage/poison.py). Items never `handed_out` (a get that ended
        without a reply) just go back: no error counted, no abort, never poison.

        Raises JournalWriteError (the reads stay open and no error is counted; an item already
        handed to `on_poison` may then be there too: a copy, never a loss). A return `owed` (the
        caller took the reads from whoever held them: nobody is left to try again) is then made once
        the journal can be written again (`_pay_owed_returns`), where the reads stayed open until the
        next start.
        """
        xids = list(xids)
        try:
            return self._unremove_all(xids, handed_out)
        except JournalWriteError:
            if owed:
                self._owed_returns.append((xids, handed_out))
            raise

    def _pay_owed_returns(self) -> None:
        """The journal can be written again: the returns it refused are made (of reads still open)."""
        owed, self._owed_returns = self._owed_returns, []
        for xids, handed_out in owed:
            try:
                self.unremove(xids, handed_out, owed=True)
            except JournalWriteError:
                pass  # owed again, until the next probe that succeeds
            except QueueClosed:
                return  # open reads in its journal: the next start returns them

    def _unremove_all(self, xids: list[int], handed_out: bool) -> int:
        """`unremove`'s change. An abort counts each item's error once, however many times its
        write is tried: a write that fails undoes the change (`_change_failed`), its counts with it,
        so that a retry (or an owed return paid) counts them again, and only then."""
        with self:
            aborted = 0
            counted: list[QItem] = []
            returned: list[QItem] = []
            poisoned: list[QItem] = []
            try:
                for xid in xids:
                    item = self._opens.get(xid)
                    if item is None:
                        continue
                    aborted += 1
                    if not handed_out:
                        if self._unremove(xid):
                            returned.append(item)
                        continue
                    item.errors += 1
                    counted.append(item)
                    if poison.is_poison(item, self.config) and self._hand_over(
                            poison.hand_over, self.on_poison, self.name, self.config.error_queue, item,
                            self.runtime):
                        if self._opens.pop(xid, None) is item:  # still open after the hand-over
                            self._ledger.total -= len(item.data)
                            poisoned.append(item)
                    elif self._unremove(xid):
                        returned.append(item)
                if poisoned:
                    self._log_confirm(poisoned)
                if returned:
                    self._log_return(returned)
                    waits = self._waits
                    if waits is not None:
                        waits.wake(len(returned))
                if aborted:
                    self._commit()
            except (OSError, JournalWriteError):  # the failures `_change_failed` undoes the change for
                for item in counted:
                    item.errors -= 1
                raise
            self.canceled_transactions += len(counted)
            self.poisoned += len(poisoned)
            return aborted

    # -----------------------------------------------------------------------------------------
    # Waiting

    def end_waits(self) -> None:
        """Waiting readers return empty-handed now and later reads do not wait (the server is stopping)."""
        self._wait_list().end()

    def wait_peek(self, timeout: float, taking: bool = False) -> QItem | None:
        """The head item, waiting up to `timeout` seconds for one. Each item added wakes one waiter,
        the longest waiting: a look passes its wake-up on (it takes nothing), a waiter `taking` keeps
        it and removes next, or hands it on with `pass_turn`. (Were it passed on by every waiter,
        the next one could take the item first and the first would wait again behind the others.)
        A look that waited for nothing wakes nobody."""
        return self._wait_list().wait(self.peek, timeout, looking=not taking)

    def pass_turn(self) -> None:
        """A waiter `wait_peek` woke to take an item will not take it: the next waiter looks."""
        waits = self._waits
        if waits is not None:
            waits.wake()

    def _wait_list(self) -> WaitList:
        """The queue's waiting readers, made at the first wait (or end of waits)."""
        waits = self._waits
        if waits is None:
            waits = self._waits = WaitList(self.runtime)
        return waits

    # -----------------------------------------------------------------------------------------
    # Settings and shutting down

    def close(self) -> None:
        """Finish any pack, make the journal durable and close it; waiting readers get nothing.
        `closing` while it runs (a close cut short before the queue is closed leaves it open, as
        it was)."""
        if self.closed:
            return
        self.closing = True
        try:
            self.wait_for_packing()
            with self._lock:
                self._gate.wait_turn()
                self.closed = True
                self._wait_list().end()
                self._close_files()
                self._end_read_behind()
                self.count_in(MemoryAccount())  # what it holds leaves the server's total
        finally:
            self.closing = self.closed

    # -----------------------------------------------------------------------------------------
    # The in-memory mechanics, for the rules above and for a format rebuilding its state

    def _take_head(self, opened: bool = False) -> QItem | None:
        """Pop the head item; `opened` says whether it becomes an open read or is gone for good."""
        mem = self._mem
        if not mem:
            if self._behind is None:
                return None
            self._fill()
            if not mem:
                return None
        item = mem.popleft()
        if self._pushed:
            self._pushed -= 1
        size = len(item.data)
        self.length -= 1
        self.bytes -= size
        self.memory_bytes -= size
        self._ledger.total -= size  # counted again if it becomes an open read
        for watcher in self._watchers:
            # Before refilling: crossing a checkpoint while refilling starts a pack that must see it.
            watcher.note_departure(item, opened)
        if self._behind is not None and (self.memory_bytes < self.memory_target or not mem):
            # The head at least stays in memory (a read-only peek reads only memory). An item
            # becoming an open read is counted again once opened: the refill counts it now.
            self._fill(size if opened else 0)
        return item

    def _push_head(self, item: QItem) -> None:
        """Put an item back at the head (an open read's, still counted in the ledger)."""
        size = len(item.data)
        self._mem.appendleft(item)
        self._pushed += 1
        self.length += 1
        self.bytes += size
        self.memory_bytes += size

    def _unremove(self, xid: int) -> bool:
        """Open read `xid` goes back to the head; False if no such read is open."""
        item = self._opens.pop(xid, None)
        if item is None:
            return False
        self._push_head(item)
        return True

    def _append(self, item: QItem) -> bool:
        """Count `item` in at the tail (held in memory unless in read-behind); True when it fills
        the memory budget, so that read-behind must start after it."""
        size = len(item.data)
        self.length += 1
        self.bytes += size
        if self._behind is not None:
            return False
        self._mem.append(item)
        self.memory_bytes += size
        self._ledger.total += size
        return self.memory_bytes >= self.memory_target and self._reads_behind

    def _enter_read_behind(self, after: QItem | None) -> None:
        """Read-behind starts after `after`, the item of a put that filled memory (None: after the
        last item handed to the queue, before a put's items are journaled). Nothing is opened for it
        (its cursor opens its file at the next change: `_open_cursor_file`), so no put is refused for a
        descriptor once its items are journaled (one was, its items stored all the same, and a
        client's retry stored them twice)."""
        self._read_behind_from(self._start_read_behind(after))

    def _open_cursor_file(self) -> None:
        """Before a change of a queue in read-behind: its cursor's file opens, if the cursor has
        none (placed, or closed while the queue idled: `release_cursor`), so that no change fails
        half made for want of a descriptor. Raises JournalReadError: nothing changed."""
        assert self._behind is not None
        try:
            self._behind.cursor.open()
        except OSError as e:
            raise JournalReadError(self.name, e) from None

    def _read_behind_from(self, cursor: Cursor) -> None:
        """New items are only counted from now on; `cursor` reads them back as the head drains."""
        self._behind = ReadBehind(self.name, cursor, self.runtime)
        log_later(self.runtime, log.info, "queue entering read-behind", queue=self.name, bytes=self.bytes)

    def _fill(self, opening: int = 0) -> None:
        """Read items back into memory up to the target (the head item at least) or until every item
        is there (read-behind ends), and no further than the room the server's budget has left:
        the ledger's, less the `opening` bytes of an item on its way to the open reads (a replay's
        target is that room: `MemoryGovernor.admit`). Up to the target alone, refills between
        ticks passed the budget by the item that filled each queue, and by every open read whose
        item they read back in beside it."""
        behind = self._behind
        if behind is None:
            return
        mem = self._mem
        held = len(mem)
        ledger = self._ledger
        target = min(self.memory_target, self.memory_bytes + ledger.limit - ledger.total - opening)
        try:
            done = behind.fill(mem, self.memory_bytes, target, self.clock.now_ms())
        finally:
            self.memory_bytes += behind.filled
            self._ledger.total += behind.filled
            self._count_buffer()
            max_age = self.config.max_age
            if max_age:  # what the journal says, capped by the settings of now (`age_held_items`)
                for item in islice(reversed(mem), len(mem) - held):
                    item.expiry = self._capped_expiry(item.add_time, item.expiry)
        if done:
            self._end_read_behind()

    def _end_read_behind(self) -> None:
        behind = self._behind
        if behind is not None:
            self._behind = None
            behind.end(self.length)
            self._count_buffer()
            self._read_behind_ended()

    def _count_buffer(self) -> None:
        """Count the read-behind cursor's buffer in the ledger as it is now: it grows as a refill
        reads (to two reads of CURSOR_CHUNK at most) and goes with a release, a page-out's new
        cursor or the end of read-behind. Known only as the last tick measured it, the buffers
        grown since passed the budget unseen, by up to 128 KB a queue reading behind."""
        behind = self._behind
        buffered = behind.cursor.buffered() if behind is not None else 0
        self._ledger.total += buffered - self._buffered
        self._buffered = buffered

    def _forget_items(self) -> None:
        """Every item leaves memory and read-behind at once (a flush, or a rebuild from disk)."""
        self._end_read_behind()
        self._mem.clear()
        self._pushed = 0
        self._ledger.total -= self.memory_bytes
        self.length = self.bytes = self.memory_bytes = 0

    # -----------------------------------------------------------------------------------------
    # The memory governor's levers (src/kestrel/storage/memory.py): on its tick, and on a put that would pass
    # the server's budget (`_receive`)

    def _memory_ceiling_changed(self) -> None:
        """A reload changed max_memory_size: the target follows it, or stays under it when governed."""
        if self._governed:
            self.memory_target = min(self.memory_target, self.config.max_memory_size)
        else:
            self.memory_target = self.config.max_memory_size

    def set_memory_target(self, target: int) -> None:
        """Hold at most `target` bytes of items in memory from now on (capped by max_memory_size);
        what is held beyond it stays until `shed` or until the head drains."""
        self._governed = True
        self.memory_target = max(0, min(target, self.config.max_memory_size))

    def free_memory_target(self) -> None:
        """Hold up to max_memory_size again, as without a budget (the governor has let go)."""
        self._governed = False
        self.memory_target = self.config.max_memory_size

    def held_bytes(self) -> tuple[int, int, int]:
        """(bytes of items in memory, of open reads, of the read-behind cursor's buffer): the last
        two paging cannot release."""
        with self._lock:
            buffer = self._behind.cursor.buffered() if self._behind is not None else 0
            return self.memory_bytes, self._open_bytes(), buffer

    def pinned_bytes(self) -> int:
        """The bytes of the items in memory that `shed` keeps whatever the target: the memory
        governor plans the rest of the budget around them."""
        with self._lock:
            mem, count = self._mem, self._pinned()
            if count == len(mem):
                return self.memory_bytes
            return len(mem[0].data) if count == 1 else data_sizes(item_data(list(islice(mem, count))))[0]

    def _pinned(self) -> int:
        """How many items at the head of memory no page-out can drop: the head (a read-only peek
        reads memory only) and the items aborted back to it (the journal holds them out of order),
        or every one where the queue cannot page."""
        if self.closed or self.read_only or not self._reads_behind:
            return len(self._mem)
        return min(len(self._mem), max(self._pushed, 1))

    def hold_new_items_on_disk(self) -> None:
        """Inside a put, before its items are journaled: take no more into memory (the server's
        budget is full). The target falls to what is held and read-behind starts now, so the put's
        items are only counted; an empty queue still takes its head in. Lowering the target alone
        let the item that filled it into memory, past the budget."""
        self.set_memory_target(min(self.memory_target, self.memory_bytes))
        if self._behind is None and self._mem and self._reads_behind:
            self._enter_read_behind(None)

    def _open_bytes(self) -> int:
        """The open reads' bytes, summed in one compiled pass: the memory governor asks every tick,
        and a Spark stream holds a whole batch open (a generator over 200,000 reads cost 90 ms)."""
        return data_sizes(item_data(list(self._opens.values())))[0]

    def count_in(self, ledger: MemoryAccount) -> None:
        """Count what this queue holds (items in memory, open reads, its cursor's buffer) in
        `ledger` from now on, taking it out of the one it was counted in: the collection's, once
        it holds the queue."""
        with self._lock:
            held = self.memory_bytes + self._open_bytes() + self._buffered
            self._ledger.total -= held
            ledger.total += held
            self._ledger = ledger

    @contextlib.contextmanager
    def _recounted(self) -> Iterator[None]:
        """Around a rebuild of memory (a replay): the ledger is told the difference once, at the
        end, rather than each step (the replay moves items between memory and open reads itself)."""
        ledger = self._ledger
        self.count_in(MemoryAccount())
        try:
            yield
        finally:
            self.count_in(ledger)

    def holds_cursor_file(self) -> bool:
        """Whether its read-behind cursor holds its file open (opened by a change: `_open_cursor_file`)."""
        behind = self._behind
        return behind is not None and behind.cursor.holds_file()

    def release_cursor(self) -> None:
        """An idle queue in read-behind gives back its cursor's read buffer and file (the next
        change opens it again: `_open_cursor_file`)."""
        with self._lock:
            gate = self._gate
            if self._behind is not None and not self.closed and gate.busy is None and not gate.changes:
                self._behind.cursor.release()  # (not inside a change: it reads on with its file)
                if self._buffered:  # (a tick asks every idle cursor, most of them empty already)
                    self._count_buffer()

    def shed(self, wait: bool = True) -> int:
        """Drop the items held beyond `memory_target` from the tail of memory and read them back
        from the journal later, as read-behind does; the bytes freed.

        Only items the journal holds in order go: the tail beyond any aborted read back at the
        head. Order is kept (the cursor starts at the first item dropped), nothing is lost or
        read twice, and no file is rewritten. A format that cannot place its cursor now frees
        nothing, and so does a queue another thread is changing unless `wait`.

        What placing the cursor reads of the journal (Kestrel 2) and the page cache does not hold
        is read off the loop with `wait` (the memory governor's tick, a task of its own), through
        the journal's gate as a change's read (`WriteGate.read`: the page-out counts as one in
        progress, the queue's changes wait). Without it (`make_room`, inside another queue's put,
        which must not pause) only what the page cache holds is read, on the loop, and where it
        does not hold all of it nothing is freed (`CachedReads`): the tick pages the queue out.
        """
        if not self._lock.acquire(blocking=wait):
            return 0
        gate = self._gate
        try:
            if gate.busy is not None:  # the items dropped would be read back from bytes not yet written
                return 0
            gate.changes += 1
            try:
                return self._shed(gate if wait else CachedReads(self.runtime))
            finally:
                gate.changes -= 1
        finally:
            self._lock.release()

    def _shed(self, gate: WriteGate) -> int:
        if (self.closed or self.read_only or not self._reads_behind
                or self.memory_bytes <= self.memory_target):
            return 0
        mem = self._mem
        self._pushed = min(self._pushed, len(mem))
        keep = held = 0
        for item in mem:
            size = len(item.data)
            if held + size > self.memory_target:
                break
            held += size
            keep += 1
        keep = max(keep, self._pinned())  # the head stays, whatever the target
        count = len(mem) - keep
        if count <= 0:
            return 0
        try:
            cursor = self._cursor_at(mem[keep], count, mem[keep - 1] if keep else None, gate)
        except NotCached:  # inside a put: left to the tick, which reads off the loop
            return 0
        if cursor is None:
            return 0
        freed = 0
        for _ in range(count):
            freed += len(mem.pop().data)
        self.memory_bytes -= freed
        self._ledger.total -= freed
        if self._behind is not None:
            self._behind.moved(cursor)
        else:
            self._behind = ReadBehind(self.name, cursor, self.runtime)
            log_later(self.runtime, log.info, "queue paged out of memory", queue=self.name,
                      kept=self.memory_bytes, paged_out=self.bytes - self.memory_bytes)
        self._count_buffer()
        return freed

    # -----------------------------------------------------------------------------------------
    # A write that fails: one policy for both formats

    def _probe(self) -> None:
        """While read-only, before a change: see whether the journal can be written again (a write
        that changes nothing). Raises JournalWriteError: the change is refused, nothing changed."""
        path = self._journal_path()
        try:
            self._write_probe()
        except OSError as e:
            raise JournalWriteError(self.name, path, e) from None
        self.read_only = False
        log_later(self.runtime, log.warning, "journal can be written again; queue accepts changes",
                  queue=self.name, file=path)
        if self._owed_returns:
            self.runtime.spawn(self._pay_owed_returns)  # after this change: a change of their own

    def _write_error(self, path: str, error: OSError) -> JournalWriteError:
        """The error to raise for a write of this queue's files that failed (counted): the change
        it ends makes the queue read-only (`_change_failed`)."""
        self.journal_write_errors += 1
        failure = JournalWriteError(self.name, path, error)
        self._own_failure = failure
        return failure

    def _went_read_only(self, path: str, failure: BaseException) -> None:
        """A write of this queue's files failed: read-only until a probe write succeeds (logged once,
        after the change: src/kestrel/storage/deferred_log.py)."""
        if not self.read_only:
            log_later(self.runtime, log.error, "cannot write the journal; the queue is read-only until "
                      "it can", queue=self.name, file=path, error=str(failure))
        self.read_only = True

    def _change_failed(self, error: BaseException) -> None:
        """A change raised `error` (raised again after this, unless this raises another).

        A write of this queue's files that failed (an OSError from its writer, or `_write_error`'s)
        makes the queue read-only until a probe write succeeds (logged once, counted), and memory
        goes back to what the files hold (`_restore`): the change did not happen, in memory or on
        disk, and the caller gets JournalWriteError. A failed write of a queue this change fed (an
        expiry or error queue) brings memory back too. Anything else: `_abandon`.
        """
        own, self._own_failure = self._own_failure, None
        failure: JournalWriteError | None = None
        if isinstance(error, OSError):
            own = failure = self._write_error(self._journal_path(), error)
            self._own_failure = None
        if own is not None and (error is own or failure is not None):
            self._went_read_only(self._journal_path(), own)
        if isinstance(error, OSError | JournalWriteError):
            self._restore()
        else:
            self._abandon()
        if failure is not None:
            raise failure from None

    # -----------------------------------------------------------------------------------------
    # Storage hooks: what a format supplies

    def setup(self, reopen: bool = True, files: JournalFiles | None = None, fresh: bool = False) -> None:
        """Load the queue from its files and open them for writing.

        `files` is this queue's share of the collection's scan of the queue path (Kestrel 2), or
        None to scan for it; `fresh`: the path holds no file of the queue (nothing is scanned);
        reads open at a stop go back to the head unless `reopen` is False.
        Raises CorruptJournalError, ConfigError (its files are in the other format).
        """
        self._load_files(reopen, files, fresh)
        self._found = self.length + len(self._opens)  # reads open at the stop count once back
        if self.fanout_only and self._found:
            # Made fanout-only while it held items: as Kestrel's, it serves them and stores no put.
            log.warning("fanout-only queue holds items put before it was made fanout-only: they are "
                        "served until it is drained (or flushed); no put is stored in it",
                        queue=self.name, items=self._found)

    @abstractmethod
    def _load_files(self, reopen: bool, files: JournalFiles | None, fresh: bool) -> None:
        """The format's `setup`."""

    @property
    @abstractmethod
    def journal_size(self) -> int:
        """Bytes of the journal files this queue reads."""

    @property
    @abstractmethod
    def live_journal_size(self) -> int:
        """Bytes of the journal file being written: the guide's `logsize`, as Kestrel's (the rotated
        files are counted only in `journal_size`)."""

    @abstractmethod
    def wait_for_packing(self) -> None:
        """Return once every pack taken so far is written (or has failed) and every rotated file
        is in the manifest: the queue's files then change only as it is used."""

    @abstractmethod
    def reconfigure(self, config: QueueConfig) -> None:
        """New settings from a reload (those fixed at creation stay: `keeping_fixed`)."""

    def _fanout_only_by(self, config: QueueConfig) -> bool:
        """Whether `config` makes this queue fanout-only: a parent's setting; a child, which takes its
        parent's settings, never is."""
        return config.fanout_only and not self.is_child

    def settings(self, config: QueueConfig | None = None) -> dict[str, Any]:
        """`config`'s settings (this queue's own by default) as they apply to this queue, in
        `QueueConfig.describe`'s terms (`dump_config`, a reload's log line): a child shares its
        parent's settings object, `fanout_only` included, and is never fanout-only."""
        config = self.config if config is None else config
        return config.describe() | {key: self._fixed_by(config, key) for key in self.fixed_settings}

    def settings_changed(self, before: QueueConfig) -> dict[str, list[Any]]:
        """Each setting whose value as it applies here differs from `before`'s, as [before's, this
        one's]: what a reload changed (or reset to its default), for its log line."""
        if self.config == before:
            return {}
        was, now = self.settings(before), self.settings()
        return {name: [was[name], value] for name, value in now.items() if value != was[name]}

    def _fixed_by(self, config: QueueConfig, key: str) -> object:
        """What fixed setting `key` of `config` makes of this queue."""
        return self._fanout_only_by(config) if key == "fanout_only" else getattr(config, key)

    def reload_ignores(self, config: QueueConfig) -> list[str]:
        """The settings whose change in `config` a reload leaves until a restart: those whose change
        would make something else of this queue (a child's `fanout_only` makes nothing: the child
        goes on sharing its parent's settings object)."""
        return [key for key in self.fixed_settings
                if self._fixed_by(config, key) != self._fixed_by(self.config, key)]

    def keeping_fixed(self, config: QueueConfig) -> QueueConfig:
        """`config` with the settings fixed at this queue's creation as they are: `config` itself
        where none differs, so that the queues of one setting go on sharing its one object, which
        every put and get reads (`QueueConfig.from_mapping`), rather than each taking a copy."""
        kept = self.reload_ignores(config)
        return replace(config, **{key: getattr(self.config, key) for key in kept}) if kept else config

    @abstractmethod
    def destroy(self) -> list[str]:
        """Close and delete this queue's files (the `delete` command). Returns the queue names that
        own no file any more (`files.file_owner`): naming one again creates a queue from nothing,
        with no directory to read."""

    @abstractmethod
    def _close_files(self) -> None:
        """Under the lock, at `close`: make what was written durable and close the files."""

    @abstractmethod
    def _prepare_change(self) -> None:
        """Under the lock, before a change: refuse it (raise JournalWriteError) if it cannot be
        made durable now."""

    @abstractmethod
    def _after_change(self) -> None:
        """Under the lock, after a change that succeeded."""

    @abstractmethod
    def _commit_logged(self) -> bool:
        """Whether every file a change of this queue commits logs its appends to the commit log,
        whose turn then holds the change (`never_waits`): none falls back on its own fsync
        (`JournalWriter.falls_back`)."""

    @abstractmethod
    def _journal_path(self) -> str:
        """The file a failed write is reported against."""

    @abstractmethod
    def _write_probe(self) -> None:
        """Write a record that changes nothing (raises OSError while the journal cannot be written)."""

    @abstractmethod
    def _restore(self) -> None:
        """A write failed: bring memory back to what the files hold."""

    @abstractmethod
    def _abandon(self) -> None:
        """A change raised something else than a failed write: forget what it noted for its records."""

    def _set_aside(self) -> object:
        """What the change in progress noted for its undo and its records, taken out of sight of
        the changes that go on while it waits (`_hand_over`: one that was waiting for its fsync);
        for `_take_back`. Kestrel 2 keeps nothing aside: its notes are its pending records, which
        such a change no longer writes, and its undo a replay of the journal, which waits its turn
        at the gate (`Kestrel2Queue._rebuild`)."""
        return None

    def _take_back(self, notes: object) -> None:
        """What `_set_aside` took comes back, ahead of anything noted since."""
        return

    def _put_shared(self, items: list[bytes], expiry: int, now: int) -> int:
        """A put where `shares_writes`: `_admit` and `_receive` at every reader of the one write;
        how many this queue took."""
        raise NotImplementedError(f"{type(self).__name__} does not share writes")

    @abstractmethod
    def _log_put(self, items: list[bytes], now: int, expiry: int, first_id: int) -> None:
        """Items join the tail, all added at `now` expiring at `expiry`; `first_id` is the first
        one's id (Kestrel 3: the others' follow it), or 0."""

    @abstractmethod
    def _log_gone(self, items: list[QItem]) -> None:
        """These head items left for good (removed, expired or discarded), in order."""

    @abstractmethod
    def _log_open(self, items: list[QItem]) -> None:
        """These head items become open reads, in order; each gets its `xid`."""

    @abstractmethod
    def _log_confirm(self, items: list[QItem]) -> None:
        """These open reads (by their `xid`) are closed for good (confirmed, or poisoned)."""

    @abstractmethod
    def _log_return(self, items: list[QItem]) -> None:
        """These open reads (by their `xid`) went back to the head (aborted), in order."""

    @abstractmethod
    def _drop_items(self) -> None:
        """A flush: every item leaves for good (open reads stay). Raises JournalWriteError."""

    @abstractmethod
    def _commit(self, housekeeping: bool = False) -> None:
        """The change's last step: make its records durable as the sync policy says (this may
        yield). `housekeeping`: the change only expired items (a peek), which a format may record
        later if it cannot now. Raises OSError or JournalWriteError."""

    @abstractmethod
    def _start_read_behind(self, after: QItem | None) -> Cursor:
        """A cursor that reads back the items added after `after` (which filled memory; None: after
        the last item handed to the queue) (src/kestrel/storage/read_behind.py)."""

    def _cursor_at(self, first: QItem, count: int, before: QItem | None,
                   gate: WriteGate) -> Cursor | None:
        """A cursor that reads back the tail `first` starts (the newest `count` items in memory,
        each never taken; `before` is the item ahead of them) and every item after it, to replace
        any cursor open now (the queue closes that one); None when the format cannot place one now
        (nothing changes then). What it reads of the journal to place it, it reads through `gate`
        (raises NotCached through `CachedReads`: nothing changes then either)."""
        return None

    def _read_behind_ended(self) -> None:
        """Every item is in memory again, or gone (the cursor is closed)."""
        return
