"""The queue item: the compiled class (src/kestrel/storage/_item.c) and the Python one it stands in for answer
alike, and the compiled one is what the storage engine uses where it was built."""

from __future__ import annotations

import operator
import random
import shutil
import sys
from collections import deque
from typing import Any

import pytest

from kestrel.storage import item
from kestrel.storage.item import QItemPython
from kestrel.storage.taken_items import TakenItems

try:
    from kestrel.storage._item import QItem as QItemCompiled
    from kestrel.storage._item import data_sizes, data_with_ids, item_data, new_items, plain_size, take_items
except ImportError:  # the build skips the helper only where there is no C compiler
    if shutil.which("cc") or shutil.which("gcc"):
        raise
    QItemCompiled = data_sizes = data_with_ids = item_data = new_items = plain_size = take_items = None

CLASSES = [QItemPython] + ([QItemCompiled] if QItemCompiled is not None else [])
SIZES = [item.data_sizes_python] + ([data_sizes] if data_sizes is not None else [])
PLAIN = [item.plain_size_python] + ([plain_size] if plain_size is not None else [])
WITH_IDS = [item.data_with_ids_python] + ([data_with_ids] if data_with_ids is not None else [])
DATA = [item.item_data_python] + ([item_data] if item_data is not None else [])
NEW = [(item.new_items_python, QItemPython)] + ([(new_items, QItemCompiled)] if new_items is not None else [])
TAKE = [item.take_items_python] + ([take_items] if take_items is not None else [])


def test_the_engine_uses_the_compiled_item_where_it_was_built() -> None:
    assert item.QItem is (QItemCompiled or QItemPython)
    assert item.data_sizes is (data_sizes or item.data_sizes_python)
    assert item.plain_size is (plain_size or item.plain_size_python)
    assert item.data_with_ids is (data_with_ids or item.data_with_ids_python)
    assert item.item_data is (item_data or item.item_data_python)
    assert item.new_items is (new_items or item.new_items_python)
    assert item.take_items is (take_items or item.take_items_python)


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


@pytest.mark.parametrize("sizes", SIZES)
def test_data_sizes_of_a_batch(sizes: Any) -> None:
    assert sizes([]) == (0, 0)
    assert sizes([b""]) == (0, 0)
    assert sizes([b"abc", b"", b"hello", b"xy"]) == (10, 5)
    assert sizes((bytearray(7), memoryview(b"12345678"), b"z")) == (16, 8)  # anything with a length
    with pytest.raises(TypeError):
        sizes([b"a", 5])
    with pytest.raises(TypeError):
        sizes(None)


@pytest.mark.parametrize("plain", PLAIN)
@pytest.mark.parametrize("cls", CLASSES)
def test_plain_size_of_items_that_cannot_expire(plain: Any, cls: Any) -> None:
    assert plain([]) == 0
    items = [cls(1, 0, b"abc"), cls(2, 0, b""), cls(3, 0, b"hello")]
    assert plain(items) == 8
    for i in range(len(items)):  # one that can expire, wherever it is, makes the batch not plain
        marked = list(items)
        marked[i] = cls(1, 99, b"abc")
        assert plain(marked) == -1
    # the usual item (bytes, expiry the int 0) is read in place; any other is asked as Python would
    assert plain([*items, cls(4, False, bytearray(b"xy")), cls(5, 0, memoryview(b"z"))]) == 11
    item_without_data = cls(1, 0, b"x")
    del item_without_data.data
    with pytest.raises(AttributeError):
        plain([item_without_data])
    with pytest.raises(TypeError):
        plain(None)


@pytest.mark.parametrize("with_ids", WITH_IDS)
@pytest.mark.parametrize("cls", CLASSES)
def test_data_with_ids(with_ids: Any, cls: Any) -> None:
    items = [cls(1, 0, b"a"), cls(2, 5, b""), cls(3, 0, b"ccc")]
    assert with_ids(items, 0) == [(b"a", 0), (b"", 0), (b"ccc", 0)]
    assert with_ids(items, [7, 2**62, 9]) == [(b"a", 7), (b"", 2**62), (b"ccc", 9)]
    assert with_ids([], 0) == [] and with_ids([], []) == []
    with pytest.raises(ValueError):
        with_ids(items, [1, 2])
    gone = cls(1, 0, b"x")
    del gone.data
    with pytest.raises(AttributeError):
        with_ids([gone], 0)


@pytest.mark.parametrize("data_of", DATA)
@pytest.mark.parametrize("cls", CLASSES)
def test_item_data(data_of: Any, cls: Any) -> None:
    items = [cls(1, 0, b"a"), cls(2, 5, b""), cls(3, 0, b"ccc")]
    assert data_of(items) == [b"a", b"", b"ccc"] and data_of([]) == []
    assert all(data is one.data for data, one in zip(data_of(items), items, strict=True))  # no copies
    gone = cls(1, 0, b"x")
    del gone.data
    with pytest.raises(AttributeError):
        data_of([gone])


def test_taken_items_give_their_data_and_their_pairs() -> None:
    items = [item.QItem(1, 0, b"a"), item.QItem(2, 0, b"bb")]
    assert len(TakenItems(items, 0)) == 2 and TakenItems(items, 0).data() == [b"a", b"bb"]
    assert TakenItems(items, [4, 5]).pairs() == [(b"a", 4), (b"bb", 5)]


@pytest.mark.skipif(data_with_ids is None, reason="built without a C compiler")
def test_compiled_data_with_ids_refuses_what_it_cannot_read() -> None:
    for args in [(None, 0), ([], None), ([], 0, 1), ((), 0)]:
        with pytest.raises(TypeError):
            data_with_ids(*args)


def test_compiled_batch_functions_answer_as_the_python_ones_on_random_batches() -> None:
    if data_sizes is None or plain_size is None or data_with_ids is None or item_data is None:
        pytest.skip("built without a C compiler")
    draw = random.Random(20261125)
    for _ in range(2000):
        datas = [bytes(draw.choice((0, 1, 7, 128, 4096))) for _ in range(draw.randrange(0, 40))]
        assert data_sizes(datas) == item.data_sizes_python(datas)
        cls = draw.choice(CLASSES)
        items = [cls(1, 0 if draw.random() < 0.97 else draw.randrange(1, 10**13), data) for data in datas]
        assert plain_size(items) == item.plain_size_python(items)
        ids = [draw.randrange(0, 2**63) for _ in items]
        assert data_with_ids(items, ids) == item.data_with_ids_python(items, ids)
        assert data_with_ids(items, 0) == item.data_with_ids_python(items, 0)
        assert item_data(items) == item.item_data_python(items)


@pytest.mark.parametrize(("make", "cls"), NEW)
def test_new_items_of_a_batch(make: Any, cls: Any) -> None:
    assert make(5, 0, [], 0) == [] and make(5, 0, [], 7) == []
    datas = [b"a", b"", b"ccc"]
    made = make(1_700_000_000_000, 99, datas, 0)
    assert all(type(one) is cls for one in made)
    assert [(one.add_time, one.expiry, one.data, one.xid, one.errors) for one in made] == [
        (1_700_000_000_000, 99, b"a", 0, 0), (1_700_000_000_000, 99, b"", 0, 0), (1_700_000_000_000, 99, b"ccc", 0, 0)]
    assert all(one.data is data for one, data in zip(made, datas, strict=True))  # no copies
    assert [one.xid for one in make(1, 0, datas, 41)] == [41, 42, 43]  # Kestrel 3: each its id
    edge = 2**63 - 2  # ids past a C long long count on as Python's ints do
    assert [one.xid for one in make(1, 0, datas, edge)] == [edge, edge + 1, edge + 2]
    assert [one.xid for one in make(1, 0, datas, 2**70)] == [2**70, 2**70 + 1, 2**70 + 2]
    assert [one.data for one in make(1, 0, (b"x", b"y"), 0)] == [b"x", b"y"]  # any sequence
    with pytest.raises(TypeError):
        make(1, 0, None, 0)


@pytest.mark.parametrize("take", TAKE)
@pytest.mark.parametrize("cls", CLASSES)
def test_take_items_from_the_head(take: Any, cls: Any) -> None:
    empty: deque[Any] = deque()
    assert take(empty, 5) == ([], 0) and take(empty, 0) == ([], 0)
    items = [cls(1, 0, b"a"), cls(2, 0, b"bb"), cls(3, 0, b"ccc"), cls(4, 0, b"dddd")]
    mem = deque(items)
    assert take(mem, 0) == ([], 0) and take(mem, -3) == ([], 0) and take(mem, -(2**70)) == ([], 0)
    assert len(mem) == 4
    taken, size = take(mem, 2)  # part of the queue
    assert [one.data for one in taken] == [b"a", b"bb"] and size == 3 and list(mem) == items[2:]
    assert taken[0] is items[0]
    taken, size = take(mem, 100)  # more than it holds: all of it
    assert [one.data for one in taken] == [b"ccc", b"dddd"] and size == 7 and not mem
    mem = deque(items)
    assert take(mem, 4)[1] == 10 and not mem  # exactly what it holds
    mem = deque(items)
    assert take(mem, 2**70) == (items, 10) and not mem  # a count past any length


@pytest.mark.parametrize("take", TAKE)
@pytest.mark.parametrize("cls", CLASSES)
def test_take_items_leaves_items_that_can_expire(take: Any, cls: Any) -> None:
    """An item that can expire among those asked for: nothing is taken (the caller takes them one by
    one, dropping the expired); one past them does not count."""
    items = [cls(1, 0, b"a"), cls(2, 0, b"bb"), cls(3, 50, b"ccc"), cls(4, 0, b"dddd")]
    for count in (3, 4, 10):
        mem = deque(items)
        assert take(mem, count) == ([], -1)
        assert list(mem) == items and all(a is b for a, b in zip(mem, items, strict=True))
    mem = deque(items)
    taken, size = take(mem, 2)
    assert taken == items[:2] and size == 3 and list(mem) == items[2:]
    gone = cls(1, 0, b"x")
    del gone.data
    mem = deque([gone])
    with pytest.raises(AttributeError):
        take(mem, 1)
    assert list(mem) == [gone]


@pytest.mark.skipif(take_items is None, reason="built without a C compiler")
def test_compiled_take_items_refuses_what_it_cannot_read() -> None:
    for args in [([], 1), (deque(), None), (deque(),), (deque(), 1, 2)]:
        with pytest.raises(TypeError):
            take_items(*args)


@pytest.mark.skipif(new_items is None, reason="built without a C compiler")
def test_compiled_items_made_after_others_were_freed_hold_only_their_own_fields() -> None:
    """Freed items are kept for the next ones made (more of them than the helper keeps, here): an
    item made from a freed one has its own fields, and the freed one's are let go of."""
    old, new = b"the first batch's", b"the second batch's"
    before = sys.getrefcount(old)
    first = new_items(1, 2, [old] * 3000, 7) + [QItemCompiled(3, 4, old, 5, 6) for _ in range(100)]
    del first
    assert sys.getrefcount(old) == before
    second = new_items(8, 0, [new] * 3000, 0) + [QItemCompiled(9, 10, new) for _ in range(100)]
    assert [(i.add_time, i.expiry, i.data, i.xid, i.errors) for i in second] == (
        [(8, 0, new, 0, 0)] * 3000 + [(9, 10, new, 0, 0)] * 100)
    assert sys.getrefcount(old) == before


@pytest.mark.skipif(new_items is None, reason="built without a C compiler")
def test_compiled_new_items_hold_their_data_once_and_let_go_of_it() -> None:
    data = b"held by each item"
    before = sys.getrefcount(data)
    made = new_items(1, 0, [data] * 1000, 0)
    assert sys.getrefcount(data) == before + 1000
    mem = deque(made)
    del made
    taken, _ = take_items(mem, 600)
    assert len(taken) == 600 and len(mem) == 400
    del taken, mem
    assert sys.getrefcount(data) == before


def test_compiled_new_and_take_items_answer_as_the_python_ones_on_random_batches() -> None:
    if new_items is None or take_items is None:
        pytest.skip("built without a C compiler")
    draw = random.Random(20261129)
    for _ in range(1000):
        datas = [bytes(draw.choice((0, 1, 7, 128))) for _ in range(draw.randrange(0, 40))]
        first_id = draw.choice((0, 0, 1, draw.randrange(0, 2**64)))
        expiry = 0 if draw.random() < 0.8 else draw.randrange(1, 10**13)
        compiled, python = new_items(3, expiry, datas, first_id), item.new_items_python(3, expiry, datas, first_id)
        assert [(one.add_time, one.expiry, one.data, one.xid) for one in compiled] == [
            (one.add_time, one.expiry, one.data, one.xid) for one in python]
        if draw.random() < 0.3:  # some of the queue may expire
            compiled = [QItemCompiled(1, draw.choice((0, 0, 0, 9)), one.data) for one in compiled]
        count = draw.randrange(-1, 50)
        a, b = deque(compiled), deque(compiled)
        assert take_items(a, count) == item.take_items_python(b, count)
        assert list(a) == list(b)
