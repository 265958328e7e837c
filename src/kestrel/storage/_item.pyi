from collections.abc import Sequence

class QItem:
    """`storage.item.QItemPython` compiled: the same attributes, constructor, equality and repr."""

    add_time: int
    expiry: int
    data: bytes
    xid: int
    errors: int

    def __init__(self, add_time: int, expiry: int, data: bytes, xid: int = 0, errors: int = 0) -> None: ...

def data_sizes(datas: Sequence[bytes], /) -> tuple[int, int]: ...
def plain_size(items: Sequence[QItem], /) -> int: ...
def item_data(items: list[QItem], /) -> list[bytes]: ...
def data_with_ids(items: list[QItem], ids: int | list[int], /) -> list[tuple[bytes, int]]: ...
