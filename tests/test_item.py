"""The queue item: the compiled class (storage/_item.c) and the Python one it stands in for answer
alike, and the compiled one is what the storage engine uses where it was built."""

from __future__ import annotations

import operator
import shutil
import sys
from typing import Any

import pytest

from storage import item
from storage.item import QItemPython

try:
    from storage._item import QItem as QItemCompiled
except ImportError:  # the build skips the helper only where there is no C compiler
    if shutil.which("cc") or shutil.which("gcc"):
        raise
    QItemCompiled = None

CLASSES = [QItemPython] + ([QItemCompiled] if QItemCompiled is not None else [])


def test_the_engine_uses_the_compiled_item_where_it_was_built() -> None:
    assert item.QItem is (QItemCompiled or QItemPython)


@pytest.mark.parametrize("cls", CLASSES)
def test_fields_defaults_and_changes(cls: Any) -> None:
    one = cls(1_700_000_000_000, 0, b"data")
    assert (one.add_time, one.expiry, one.data, one.xid, one.errors) == (1_700_000_000_000, 0, b"data", 0, 0)
    two = cls(5, 6, b"x", 7, errors=8)
    assert (two.xid, two.errors) == (7, 8)
    three = cls(add_time=1, expiry=2, data=b"y", xid=3, errors=4)
    assert (three.add_time, three.expiry, three.data, three.xid, three.errors) == (1, 2, b"y", 3, 4)
    two.xid = 0
    two.errors += 1
    two.expiry = 99
    assert (two.xid, two.errors, two.expiry) == (0, 9, 99)
    with pytest.raises(AttributeError):
        two.other = 1  # no attributes beyond the five


@pytest.mark.parametrize("cls", CLASSES)
def test_wrong_arguments_are_refused(cls: Any) -> None:
    for args, kwargs in [((1, 2), {}), ((1, 2, b"x", 0, 0, 0), {}), ((1, 2, b"x"), {"colour": 1}),
                         ((1, 2, b"x"), {"data": b"y"})]:
        with pytest.raises(TypeError):
            cls(*args, **kwargs)


@pytest.mark.parametrize("cls", CLASSES)
def test_equal_by_time_expiry_and_data_and_never_hashed(cls: Any) -> None:
    a = cls(1, 2, b"x", xid=5, errors=1)
    assert a == cls(1, 2, b"x")  # open read and errors do not count
    assert operator.ne(a, cls(1, 2, b"x")) is False  # both comparisons, each answered
    for other in (cls(0, 2, b"x"), cls(1, 3, b"x"), cls(1, 2, b"y")):
        assert operator.ne(a, other) is True and operator.eq(a, other) is False
    assert a != (1, 2, b"x") and a != b"x"
    with pytest.raises(TypeError):
        hash(a)


@pytest.mark.parametrize("cls", CLASSES)
def test_repr_and_a_deleted_field(cls: Any) -> None:
    a = cls(1, 2, b"x\x00", 3)
    assert repr(a) == "QItem(add_time=1, expiry=2, data=b'x\\x00', xid=3)"
    del a.xid
    with pytest.raises(AttributeError):
        _ = a.xid


@pytest.mark.skipif(QItemCompiled is None, reason="built without a C compiler")
def test_compiled_items_hold_their_fields_once_and_let_go_of_them() -> None:
    data = b"held by each item"
    before = sys.getrefcount(data)
    items = [QItemCompiled(1, 2, data) for _ in range(1000)]
    assert sys.getrefcount(data) == before + 1000
    del items
    assert sys.getrefcount(data) == before
