"""A queue item as it lives in memory.

`QItem` is the compiled class (storage/_item.c) where the build had a C compiler, else
`QItemPython`, the reference: the same attributes, constructor, equality and repr, checked on both
by tests/test_item.py. A batch put makes one item per element, and replay one per record.
"""

from __future__ import annotations

from typing import TYPE_CHECKING


class QItemPython:
    """One item: its data, when it was added and when it expires (ms since epoch, 0 = never).

    `xid` is non-zero while the item is an open read, and also for an item replayed from an
    ADD_XID record until the REMOVE_TENTATIVE that reopens it. `errors` counts the aborts and
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


if TYPE_CHECKING:
    QItem = QItemPython
else:
    try:
        from storage._item import QItem
    except ImportError:  # built without a C compiler: the Python class
        QItem = QItemPython
