"""CPython's full garbage collections with thousands of queues: timed, and kept short by freezing
what lives long.

A full collection walks every object the collector tracks, and no client is answered meanwhile.
Items are not tracked, but each queue accounts for a dozen objects (the queue, its journal and
writer, their lists and sets), so with 10,000 queues one collection walked 150,000 objects or more
(250,000 before the queues had fewer): 0.1–0.9 s of the loop. CPython runs one once the objects
that survived the younger collections have grown the old ones by a quarter
(`FULL_COLLECTION_AFTER` middle ones apart at least), which creating queues, or serving a heap
that large, soon brings about.

`gc.freeze()` moves every object alive to a generation no collection walks. The server freezes:
- what start-up made, once the journals are loaded and before it listens (`freeze_loaded`): the
  queues and their journals, and nothing of a client yet;
- after a full collection that left more than `FREEZE_ABOVE` objects unfrozen, where the server
  has `QUEUES_TO_FREEZE` queues more than at the last freeze, what survived it: the next full
  collection walks only what came after. Not where the queues did not grow: what survived is then
  what lives while clients are connected (a thousand connections are some 20,000 objects), and a
  freeze of that is undone, with a walk of the whole heap, after a wave of closes (below).

Python's own rule runs a full collection only once the old objects have grown by a quarter of
what the last one left, start-up's frozen heap included, and after a hundred middle collections: so
10,000 queues made while serving were walked in one collection, 65-90 ms of the loop (pure build).
The server walks the oldest generation itself, on the loop, once its unfrozen objects have grown by
`WALK_ABOVE` since the last full collection (looked at after each middle collection, the one that
fills it), so that each walk is of about that many objects where the queues grow, and a few walks
in all where they do not.

A frozen object is never collected, so cyclic garbage among frozen objects would stay. Neither a
queue nor a connection makes any: a deleted queue, freed at its delete (docs/queue-lifetime.md), and a
closed connection of any protocol, killed in a wait or not (tests/server/test_connection_cycles.py),
are freed by reference counting, frozen or not. Whatever else might still die frozen in a cycle
(objects of gevent's or of the admin port's web server, an error's traceback) is not proven free
of them; so the server still thaws everything before the full collection it makes after a wave of
closes (src/kestrel/service/memory_return.py), and freezes again what survives it when that is more
than `FREEZE_ABOVE`.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

# A hundred middle collections between full ones (Python's default is ten). A full collection walks
# every object alive: a client holding tens of thousands of reads open (a Spark stream's batch,
# until its sink commits) brought one about every few calls at ten, and such fetches spent 45% of
# the server's CPU in it. Cycles that reach the oldest generation wait that much longer to be freed.
FULL_COLLECTION_AFTER = 100

# Growth of the oldest generation's unfrozen objects since the last full collection past which the
# server walks it (about 1,700 queues' worth); the objects a full collection may leave before they
# are frozen (half of it, so that at least that many come between two walks), where the server has
# QUEUES_TO_FREEZE queues more than at the last freeze.
WALK_ABOVE = 20_000
FREEZE_ABOVE = WALK_ABOVE // 2
QUEUES_TO_FREEZE = 500

# How old the figure of frozen objects may be: counting them walks their list, 27 ns an object
# (5 ms of the loop at 200,000, which 10,000 queues make), and every read of the server's figures
# asked for it. The server counts them in a turn of the loop of its own, never within a read's.
FROZEN_COUNT_AGE_S = 1.0


class Pauses:
    """A `gc.callbacks` entry: times each full collection, freezes what one leaves when it is more
    than `freeze_above` objects (installed with a count of the queues: and they grew), and, installed
    with a way to call back on the loop, has the oldest generation walked there once it grew by
    `walk_above`."""

    def __init__(self, freeze_above: int = FREEZE_ABOVE, walk_above: int = WALK_ABOVE,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.freeze_above = freeze_above
        self.walk_above = walk_above
        self._clock = clock
        self._later: Callable[[Callable[[], None]], object] | None = None
        self._queues: Callable[[], int] | None = None
        self._queues_frozen: int | None = None  # the queues at the last freeze; None: thawed since
        self._look_asked = False
        self._count_asked = False
        self._frozen, self._frozen_counted = 0, float("-inf")
        self._started = 0.0
        self.full_collections = 0
        self.full_collection_s = 0.0
        self.longest_s = 0.0
        self.freezes = 0
        self.left_unfrozen = 0  # by the last full collection: where the next one's walk starts
        self._freezes_without_clients = 0  # freezes made when no client could be connected

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if info["generation"] != 2:
            if info["generation"] == 1 and phase == "stop" and self._later is not None \
                    and not self._look_asked:
                # Not here: a collection runs inside whatever allocated, on any thread, and
                # `gc.collect()` does nothing while one runs.
                self._look_asked = True
                self._later(self._walk_if_grown)
            return
        if phase == "start":
            self._started = self._clock()
            return
        took = self._clock() - self._started
        self.full_collections += 1
        self.full_collection_s += took
        self.longest_s = max(self.longest_s, took)
        # Everything unfrozen is in the oldest generation now, and only what is alive.
        self.left_unfrozen = len(gc.get_objects())
        if self.left_unfrozen > self.freeze_above and self._queues_grew():
            self.freeze()

    def _queues_grew(self) -> bool:
        """By QUEUES_TO_FREEZE since the last freeze, or nothing is frozen since a thaw (what
        survives the collection after it, the queues among it, is frozen again)."""
        return self._queues is None or self._queues_frozen is None \
            or self._queues() - self._queues_frozen >= QUEUES_TO_FREEZE

    def _walk_if_grown(self) -> None:
        """On the loop: a full collection where the oldest generation's unfrozen objects grew by
        more than `walk_above` since the last one (counting them takes about 6 ns each)."""
        self._look_asked = False
        if len(gc.get_objects(generation=2)) > self.left_unfrozen + self.walk_above:
            gc.collect()

    def freeze(self) -> None:
        """Freeze every object alive: those the last full collection left (`left_unfrozen`), which
        the figure of frozen objects gains."""
        gc.freeze()
        self.freezes += 1
        self._frozen += self.left_unfrozen
        self.left_unfrozen = 0
        if self._queues is not None:
            self._queues_frozen = self._queues()

    def install(self, later: Callable[[Callable[[], None]], object] | None = None,
                queues: Callable[[], int] | None = None) -> None:
        """Collect as this module says, from now on in this process; `later` calls a function on
        the loop from any thread (the walks need it), `queues` counts the server's queues (what a
        freeze waits for)."""
        young, middle, _ = gc.get_threshold()
        gc.set_threshold(young, middle, FULL_COLLECTION_AFTER)
        self._later, self._queues = later, queues
        # a look or a count asked of a loop before an uninstall may never have run
        self._look_asked = self._count_asked = False
        if self not in gc.callbacks:
            gc.callbacks.append(self)

    def uninstall(self) -> None:
        self._later = self._queues = None
        if self in gc.callbacks:
            gc.callbacks.remove(self)

    def freeze_loaded(self) -> None:
        """Once the journals are loaded, before any client connects: collect what start-up left
        (the walk no client waits for), then freeze the rest."""
        frozen = self.freezes
        gc.collect()
        if self.freezes == frozen:  # the collection did not freeze it already
            self.freeze()
        self._freezes_without_clients = self.freezes
        self._count_frozen()

    def thaw_after_closes(self) -> bool:
        """Before a full collection after a wave of closes: make every frozen object collectable
        again if a freeze since the last wave may have caught connections (the collection then
        walks them all, frees what died frozen, and freezes again what survives, past
        `freeze_above`). Whether it did."""
        if self.freezes == self._freezes_without_clients:
            return False
        gc.unfreeze()
        self._freezes_without_clients = self.freezes
        self._frozen = 0
        self._queues_frozen = None
        return True

    def frozen_objects(self) -> int:
        """The objects frozen: as last counted, with what the freezes made here added since (a thaw
        made here leaves none). Frozen objects freed meanwhile lower it once the count is
        `FROZEN_COUNT_AGE_S` old and counted again: in a callback of its own on the loop, where
        installed with one (this read's figure is the old one), or here."""
        if self._clock() - self._frozen_counted >= FROZEN_COUNT_AGE_S:
            if self._later is None:
                self._count_frozen()
            elif not self._count_asked:
                self._count_asked = True
                self._later(self._count_frozen)
        return self._frozen

    def _count_frozen(self) -> None:
        self._count_asked = False
        self._frozen, self._frozen_counted = gc.get_freeze_count(), self._clock()

    def stats(self) -> dict[str, int]:
        """The server's figures: full collections and their time, the objects the last one left
        unfrozen, and the objects frozen (`frozen_objects`)."""
        return {
            "gc_full_collections": self.full_collections,
            "gc_full_collection_ms": round(self.full_collection_s * 1000),
            "gc_longest_full_collection_ms": round(self.longest_s * 1000),
            "gc_objects": self.left_unfrozen,
            "gc_frozen_objects": self.frozen_objects(),
            "gc_freezes": self.freezes,
        }


# One per process, as the collector it watches.
GC_PAUSES = Pauses()
