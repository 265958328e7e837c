"""Fanout: a queue `q` feeds its children `q+name`, each a queue of its own that gets every item put
to `q` from the moment it exists (Kestrel's guide: fanout queues).

What a child is offered of a put is Kestrel's, whose put offers its items one by one, each to the
children and then to the parent, and stops after the first item the parent refuses: a child is
offered the items the parent accepted and the one it refused, and takes each on its own (one over
the child's `max_item_size` is refused and the next one may still be taken). A Kestrel 2 child
keeps a journal of its own (the collection puts the items to it); the children of a Kestrel 3 queue
are readers of their parent's one writer journal (src/kestrel/storage/kestrel3/queue.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from kestrel.storage.item import data_sizes
from kestrel.storage.runtime import Runtime, paced

if TYPE_CHECKING:
    from kestrel.storage.queue import PersistentQueue

# Work a parent's put does for its children between two pauses, in bytes of their items and, for
# each item's objects and journal record, what about as many bytes cost (compiled, 180 ns an item
# and 1.3 ns a byte): about 5 ms.
FEED_PACE = 4 << 20
FEED_ITEM_COST = 128


def parent_of(name: str) -> str | None:
    """The parent of fanout child `name` (`q` of `q+a`), or None for a queue that is not one."""
    parent, plus, _ = name.partition("+")
    return parent if plus else None


def offered(items: list[bytes], accepted: int) -> list[bytes]:
    """What a parent's children are offered of its put of `items`, of which it accepted `accepted`:
    those, and the first one it refused."""
    return items if accepted >= len(items) else items[:accepted + 1]


def fitting(items: list[bytes], max_item_size: int) -> list[int] | None:
    """The positions of the items a child may take, each on its own: those not over its
    `max_item_size` (None: every one)."""
    if data_sizes(items)[1] <= max_item_size:
        return None
    return [n for n, data in enumerate(items) if len(data) <= max_item_size]


def runs(positions: list[int]) -> Iterator[tuple[int, int]]:
    """Consecutive positions as (start, stop) ranges, in order."""
    start = stop = -1
    for n in positions:
        if n != stop:
            if stop > start:
                yield start, stop
            start = n
        stop = n + 1
    if stop > start:
        yield start, stop


def feed(children: Sequence[PersistentQueue], given: list[bytes], expiry: int, now: int,
         runtime: Runtime) -> None:
    """Put what their parent was offered to fanout children that keep journals of their own
    (Kestrel 2), each taking every item on its own (each counts its adds, as every queue does).
    The children are fed in runs of about FEED_PACE of work, with a pause for the other tasks
    between runs (2,000 children each given 15 items of 64 KB held the loop for 4 s; of 5,000 small
    items, 1.5 s), as a put to each child alone would let them in; a child deleted meanwhile is
    passed over. Two puts to the parent may then reach the children not yet fed in either order,
    as in Kestrel, whose puts feed the children from threads of their own."""
    work = data_sizes(given)[0] + FEED_ITEM_COST * len(given)
    for child in paced(children, runtime, max(1, FEED_PACE // work)):
        if child.closed:
            continue
        keep = fitting(given, child.config.max_item_size)
        child.put(given if keep is None else [given[n] for n in keep], expiry, now)


class Fanouts(dict[str, set[str]]):
    """Each queue's fanout children by name, as the collection holds them: a parent is a key while
    it has children (a dict, so that a put's look-up costs no Python call)."""

    def add(self, child: str) -> None:
        parent = parent_of(child)
        if parent is not None:
            self.setdefault(parent, set()).add(child)

    def discard(self, child: str) -> None:
        parent = parent_of(child)
        if parent is not None and parent in self:
            self[parent].discard(child)
            if not self[parent]:
                del self[parent]

    def children(self, parent: str) -> list[str]:
        return sorted(self.get(parent, ()))
