"""A queue item as it lives in memory.

`QItem` is the compiled class (src/kestrel/storage/_item.c) where the build had a C compiler, else
`QItemPython`, the reference: the same attributes, constructor, equality and repr, checked on both
by tests/storage/test_item.py. A batch put makes one item per element (`new_items`, all in one
call), and replay one per record. Likewise `data_sizes`, `plain_size`, `item_data`,
`data_with_ids` and `take_items` (a get's items from the head of the queue), one pass over a batch
each where Python made two or three, or a call per item.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from itertools import count as count_from
from itertools import islice, repeat, starmap
from operator import attrgetter
from typing import TYPE_CHECKING, NamedTuple


class QItemPython:
    """One item: its data, when it was added and when it expires (ms since epoch, 0 = never).

    `xid` is the id of the item's open read. In a Kestrel 2 queue it is non-zero while the item is
    an open read, and also for an item replayed from an ADD_XID record until the REMOVE_TENTATIVE
    that reopens it; a Kestrel 3 item's xid is its id throughout. `errors` counts the aborts and
    auto-aborts the item has been through (what `max_errors` is checked against).
    """

    __slots__ = ("add_time", "expiry", "data", "xid", "errors")

    def __init__(self, add_time: int, expiry: int, data: bytes, xid: int = 0, errors: int = 0) -> None:
        self.add_time = add_time
        self.expiry = expiry
        self.data = data
        self.xid = xid
        self.errors = errors

    def __repr__(self) -> str:
        return f"QItem(add_time={self.add_time}, expiry={self.expiry}, data={self.data!r}, xid={self.xid})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, QItemPython):
            return NotImplemented
        return (self.add_time, self.expiry, self.data) == (other.add_time, other.expiry, other.data)

    __hash__ = None  # type: ignore[assignment]


_ADD_TIME, _EXPIRY, _DATA = attrgetter("add_time"), attrgetter("expiry"), attrgetter("data")


def data_sizes_python(datas: Sequence[bytes]) -> tuple[int, int]:
    """(total bytes, largest) of a batch's data: what a batch put checks against the queue's limits."""
    sizes = list(map(len, datas))
    return sum(sizes), max(sizes, default=0)


def plain_size_python(items: Sequence[QItemPython]) -> int:
    """The bytes of data of `items` when none of them can expire, else -1: whether a batch get may
    take them without looking at each (and how much the queue then holds less)."""
    if any(map(_EXPIRY, items)):
        return -1
    return sum(map(len, map(_DATA, items)))


def data_with_ids_python(items: list[QItemPython], ids: int | list[int]) -> list[tuple[bytes, int]]:
    """Each item's data with an id (`ids` one for every item, or a list, one each): the items of a
    get as the protocols hand them out, each with the id of its open read, or 0."""
    if isinstance(ids, int):
        return list(zip(map(_DATA, items), repeat(ids)))
    if len(ids) != len(items):
        raise ValueError(f"{len(items)} items but {len(ids)} ids")
    return list(zip(map(_DATA, items), ids, strict=True))


def new_items_python(add_time: int, expiry: int, datas: Sequence[bytes], first_id: int) -> list[QItemPython]:
    """A batch put's items, one for each of `datas`, their xids counting up from `first_id` (0: each
    xid 0, as a Kestrel 2 item's is until it is opened)."""
    ids = count_from(first_id) if first_id else repeat(0)
    return list(map(QItemPython, repeat(add_time), repeat(expiry), datas, ids))


def take_items_python(mem: deque[QItemPython], count: int) -> tuple[list[QItemPython], int]:
    """Up to `count` items from the head of `mem` and their bytes of data, taken in one step when
    none of them can expire (the common get); else ([], -1) with `mem` as it was, for the caller to
    take them one by one, each head checked for expiry."""
    length = len(mem)
    n = max(0, min(count, length))
    taken = list(mem) if n == length else list(islice(mem, n))
    size = plain_size_python(taken)
    if size < 0:
        return [], -1
    if n == length:
        mem.clear()
    else:
        deque(starmap(mem.popleft, repeat((), n)), maxlen=0)  # popleft, n times
    return taken, size


def item_data_python(items: list[QItemPython]) -> list[bytes]:
    """Each item's data: what a get's reply is laid out from, beside the ids (`TakenItems`)."""
    return list(map(_DATA, items))


if TYPE_CHECKING:
    QItem = QItemPython
    data_sizes = data_sizes_python
    plain_size = plain_size_python
    data_with_ids = data_with_ids_python
    item_data = item_data_python
    new_items = new_items_python
    take_items = take_items_python
else:
    try:
        from kestrel.storage._item import (
            QItem,
            data_sizes,
            data_with_ids,
            item_data,
            new_items,
            plain_size,
            take_items,
        )
    except ImportError:  # built without a C compiler: the Python class and functions
        QItem, data_sizes, plain_size, data_with_ids, item_data, new_items, take_items = (
            QItemPython, data_sizes_python, plain_size_python, data_with_ids_python, item_data_python,
            new_items_python, take_items_python)


class LookedItems(NamedTuple):
    """What a look at a queue (`PersistentQueue.look`) saw: items left where they are.

    Positions count the queue's items from when the server opened it: `head` is the head item's,
    the one behind it is at `head + 1`, and an item keeps its position while it stays in the queue
    (the items taken from the head move `head` on, an aborted read put back moves it one back).
    `after` is the position after the last one the look covered, `items` the queue's length."""

    opened_at: int  # when the queue was opened (ms since the epoch): positions count from then
    head: int
    items: int
    after: int
    shown: list[QItem]
