"""The arguments of a call, checked before anything is sent.

Thrift would encode a `str` item as UTF-8 and iterate a `str` or `bytes` batch item by item, and
reject other types deep in its encoder with its own exception; a queue stores what it is given, so
a mistake found only by the consumer is found too late. Each check raises TypeError (a wrong type)
or ValueError (a value out of range) naming the call, the queue and the item's position.
"""

from __future__ import annotations

from collections.abc import Iterable

BytesLike = bytes | bytearray | memoryview
BYTES_LIKE = (bytes, bytearray, memoryview)
I32_MAX = 2**31 - 1
I64 = range(-(2**63), 2**63)
_JUST_BYTES = {bytes}


def check_queue(queue: object, what: str) -> str:
    """The queue name, which must be a str (the server judges the name itself)."""
    if not isinstance(queue, str):
        raise TypeError(f"{what}: the queue name must be a str, got {type(queue).__name__}")
    return queue


def check_count(value: object, name: str, what: str, *, least: int = 0) -> int:
    """An int argument (not a bool) from `least` up to the contract's 32-bit limit."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what}: {name} must be an int, got {type(value).__name__}")
    if not least <= value <= I32_MAX:
        raise ValueError(f"{what}: {name} must be from {least} to {I32_MAX}, got {value}")
    return value


def check_seconds(value: object, name: str, what: str) -> float:
    """A duration in seconds: an int or float, not negative."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{what}: {name} must be a number of seconds, got {type(value).__name__}")
    if not value >= 0:  # also refuses NaN
        raise ValueError(f"{what}: {name} must not be negative, got {value}")
    return float(value)


def check_ids(ids: object, what: str) -> set[int]:
    """Read ids as a set of ints (each an i64 of the contract), refusing a single value or a str,
    whose characters would otherwise each be taken for an id."""
    if isinstance(ids, str | bytes | bytearray | memoryview) or not isinstance(ids, Iterable):
        raise TypeError(f"{what}: ids must be a set of ints, got {type(ids).__name__}")
    checked = set(ids)
    for read_id in checked:
        if isinstance(read_id, bool) or not isinstance(read_id, int):
            raise TypeError(f"{what}: each id must be an int, got {type(read_id).__name__}")
        if read_id not in I64:
            raise ValueError(f"{what}: id {read_id} is outside the contract's 64-bit ids")
    return checked


def _item_error(what: str, where: str, item: object) -> TypeError:
    hint = " (encode text first, e.g. text.encode())" if isinstance(item, str) else ""
    return TypeError(f"{what}: {where} is {type(item).__name__}, not bytes, bytearray or memoryview{hint}")


def check_item(item: object, what: str) -> bytes:
    """One item as bytes: bytes, bytearray and memoryview are accepted, nothing else (str neither)."""
    if isinstance(item, bytes):
        return item
    if isinstance(item, bytearray | memoryview):
        return bytes(item)
    raise _item_error(what, "the item", item)


def check_items(items: Iterable[BytesLike], what: str) -> list[bytes]:
    """A batch of items as a list of bytes, refusing a batch that is a single str or bytes (whose
    characters or bytes would otherwise each become an item). A list of bytes is returned as it is,
    the caller's own list: it is sent, never changed."""
    if isinstance(items, str | bytes | bytearray | memoryview):
        raise TypeError(f"{what}: items must be a list of bytes, got a single {type(items).__name__} "
                        f"(to put one item, call put() or wrap it in a list)")
    if type(items) is list and {*map(type, items)} <= _JUST_BYTES:
        return items  # a list of plain bytes, the usual batch: looked at in one compiled pass, not copied
    try:
        listed = list(items)
    except TypeError:
        raise TypeError(f"{what}: items must be a list of bytes, got {type(items).__name__}") from None
    out: list[bytes] = []
    for position, item in enumerate(listed):
        if isinstance(item, bytes):
            out.append(item)
        elif isinstance(item, bytearray | memoryview):
            out.append(bytes(item))
        else:
            raise _item_error(what, f"item {position}", item)
    return out
