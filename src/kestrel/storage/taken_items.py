"""The items one get took, handed from the queue through the session to a protocol's reply: compiled
with the request path (src/kestrel/build.py), since every get makes one."""

from __future__ import annotations

from typing import Final

from kestrel.storage.item import QItem, data_with_ids, item_data

# (bound `Final`: the compiled build calls them from C statics, not the module's dictionary)
_item_data: Final = item_data
_data_with_ids: Final = data_with_ids


class TakenItems:
    """The items one get took and the ids of their open reads (`ids`: one for every item, 0 without
    auto-abort, or a list, one each). A protocol lays its reply out from the data and the ids
    apart: a (data, id) pair made and freed for each item cost a 100,000-item get more than taking
    the items did (bench/bench_fairness.py, 2026-11-27); `pairs()` makes them where a protocol
    needs them."""

    __slots__ = ("items", "ids")

    def __init__(self, items: list[QItem], ids: int | list[int]) -> None:
        self.items, self.ids = items, ids

    def __len__(self) -> int:
        return len(self.items)

    def data(self) -> list[bytes]:
        return _item_data(self.items)

    def pairs(self) -> list[tuple[bytes, int]]:
        return _data_with_ids(self.items, self.ids)

    def times(self) -> tuple[list[int], list[int]]:
        """Each item's add time, and each one's expiry (0: never)."""
        return [item.add_time for item in self.items], [item.expiry for item in self.items]

    def timed(self) -> list[tuple[bytes, int, int, int | None]]:
        """Each item as (data, id, add time, expiry or None): what `get_timed` hands out."""
        ids = [self.ids] * len(self.items) if isinstance(self.ids, int) else self.ids
        return [(item.data, xid, item.add_time, item.expiry or None)
                for item, xid in zip(self.items, ids, strict=True)]
