"""The batch fast paths give what the item-by-item ones give: the same journal bytes, the same items."""

from __future__ import annotations

import dataclasses
import gc
import struct
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kestrel.storage import QueueCollection, item
from kestrel.storage.clock import FakeClock
from kestrel.storage.config import QueueConfigs
from kestrel.storage.kestrel2 import codec
from tests.support.queues import drain


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**62), st.integers(0, 2**62), st.lists(st.binary(max_size=40), max_size=20),
       st.booleans())
def test_addx_records_of_a_batch_are_those_of_each_item(add_time: int, expiry: int, items: list[bytes],
                                                        same_size: bool) -> None:
    if same_size:
        items = [data.ljust(40, b"-") for data in items]
    each = b"".join(codec.encode_addx(add_time, expiry, data) for data in items)
    assert codec.encode_addx_many(add_time, expiry, items) == each  # compiled, where it was built
    assert codec.encode_addx_many_python(add_time, expiry, items) == each


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([codec.REMOVE_TENTATIVE_XID, codec.CONFIRM_REMOVE, codec.UNREMOVE]),
       st.lists(st.integers(-(2**31), 2**31 - 1), max_size=3 * codec.XIDS_LAID_OUT))
def test_xid_records_of_a_batch_are_those_of_each_xid(opcode: int, xids: list[int]) -> None:
    assert codec.encode_xids(opcode, xids) == b"".join(codec.encode_xid(opcode, xid) for xid in xids)
    assert codec.encode_xids(opcode, xids) == b"".join(bytes([opcode]) + struct.pack("<i", xid) for xid in xids)


@pytest.mark.parametrize(("add_time", "expiry", "items", "refusal"), [
    (2**63, 0, [b"x"], "argument out of range"),  # a time past the record's i64
    (0, -(2**63) - 1, [b"x"], "argument out of range"),
    (0, 0, [b"x", "text"], "expected a bytes-like object, str found"),
])
def test_what_the_compiled_encoder_declines_the_python_one_refuses(add_time: int, expiry: int, items: list[Any],
                                                                   refusal: str) -> None:
    with pytest.raises((struct.error, TypeError), match=refusal):
        codec.encode_addx_many(add_time, expiry, items)


def test_bytes_like_items_are_encoded_by_the_python_encoder() -> None:
    items: list[Any] = [bytearray(b"ab"), b"cd", memoryview(b"ef")]
    assert codec.encode_addx_many(5, 6, items) == b"".join(codec.encode_addx(5, 6, bytes(d)) for d in items)


def test_items_given_other_than_as_a_list_are_refused() -> None:
    items: Any = (b"ab", b"cd")
    with pytest.raises(TypeError):
        codec.encode_addx_many(5, 6, items)


def test_a_batch_get_takes_items_in_order_and_journals_a_remove_each(tmp_path: Path) -> None:
    coll = QueueCollection(str(tmp_path))
    coll.load()
    coll.put("q", [b"%d" % i for i in range(10)])
    size = (tmp_path / "q").stat().st_size
    assert [item.data for item in coll.remove("q", 4)] == [b"0", b"1", b"2", b"3"]
    assert (tmp_path / "q").read_bytes()[size:] == codec.REMOVE_BYTES * 4
    q = coll.queue("q")
    assert (q.length, q.bytes, q.memory_bytes) == (6, 6, 6)
    assert [item.data for item in coll.remove("q", 100)] == [b"%d" % i for i in range(4, 10)]
    assert coll.remove("q", 5) == [] and (q.length, q.bytes) == (0, 0)
    coll.close()
    again = QueueCollection(str(tmp_path))
    again.load()
    assert drain(again, "q") == []


def test_a_batch_get_over_items_that_expire_drops_the_expired_ones(tmp_path: Path) -> None:
    clock = FakeClock()
    coll = QueueCollection(str(tmp_path), clock=clock)
    coll.load()
    coll.put("q", [b"a", b"b"])
    coll.put("q", [b"gone1", b"gone2"], expiry_ms=clock.now_ms() + 10)
    coll.put("q", [b"c"])
    clock.advance(20)
    assert [item.data for item in coll.remove("q", 10)] == [b"a", b"b", b"c"]
    assert coll.queue("q").length == 0
    coll.close()


FORMATS = ["kestrel2", "kestrel3"]


def _collection(tmp_path: Path, journal_format: str, clock: FakeClock | None = None,
                **settings: object) -> QueueCollection:
    coll = QueueCollection(str(tmp_path), QueueConfigs({}, {"q": {"journal_format": journal_format, **settings}}),
                           clock=clock or FakeClock(1_700_000_000_000))
    coll.load()
    return coll


@pytest.mark.parametrize("journal_format", FORMATS)
def test_an_empty_batch_adds_and_takes_nothing(tmp_path: Path, journal_format: str) -> None:
    coll = _collection(tmp_path, journal_format)
    q = coll.queue("q")
    assert coll.put("q", []) == 0 and q.length == 0
    assert coll.remove("q", 0) == [] and coll.remove("q", 100) == []
    coll.put("q", [b"a"])
    assert coll.remove("q", 0) == [] and q.length == 1  # asked for none: none taken
    assert [one.data for one in coll.remove("q", 100)] == [b"a"]
    coll.close()


@pytest.mark.parametrize("journal_format", FORMATS)
def test_batches_crossing_into_read_behind_come_back_whole_and_in_order(tmp_path: Path,
                                                                        journal_format: str) -> None:
    """A put of 100 that fills memory part way through goes on into read-behind; gets of 100 take
    the items held in memory and then those read back from the journal, in order, and the queue
    comes back the same after a restart."""
    sent = [b"%05d" % n + b"x" * 120 for n in range(1000)]
    coll = _collection(tmp_path, journal_format, max_memory_size=4096, default_journal_size=8192)
    q = coll.queue("q")
    for start in range(0, 500, 100):
        assert coll.put("q", sent[start:start + 100]) == 100
    assert q.in_read_behind and q.length == 500
    got = [one.data for one in coll.remove("q", 150)]
    for start in range(500, 1000, 100):
        assert coll.put("q", sent[start:start + 100]) == 100
    assert got == sent[:150]
    coll.close()
    again = _collection(tmp_path, journal_format, max_memory_size=4096, default_journal_size=8192)
    assert drain(again, "q") == sent[150:]
    again.close()


@pytest.mark.parametrize("journal_format", FORMATS)
def test_a_batch_get_takes_the_items_left_after_expired_ones_in_the_batch(tmp_path: Path,
                                                                          journal_format: str) -> None:
    clock = FakeClock(1_700_000_000_000)
    coll = _collection(tmp_path, journal_format, clock)
    coll.put("q", [b"a%d" % n for n in range(50)])
    coll.put("q", [b"gone%d" % n for n in range(50)], expiry_ms=clock.now_ms() + 10)
    coll.put("q", [b"b%d" % n for n in range(50)])
    assert [one.data for one in coll.remove("q", 40)] == [b"a%d" % n for n in range(40)]  # none expired yet
    clock.advance(20)
    got = coll.remove("q", 100)
    assert [one.data for one in got] == [b"a%d" % n for n in range(40, 50)] + [b"b%d" % n for n in range(50)]
    assert coll.queue("q").length == 0
    coll.close()


@pytest.mark.parametrize("journal_format", FORMATS)
@pytest.mark.parametrize("discard_old", [False, True])
def test_a_batch_put_over_max_items_keeps_what_the_limit_allows(tmp_path: Path, journal_format: str,
                                                                discard_old: bool) -> None:
    coll = _collection(tmp_path, journal_format, max_items=30, discard_old_when_full=discard_old)
    sent = [b"%03d" % n for n in range(100)]
    accepted = coll.put("q", sent)
    kept = sent[70:] if discard_old else sent[:30]
    assert accepted == (100 if discard_old else 30)
    assert coll.queue("q").length == 30
    assert [one.data for one in coll.remove("q", 100)] == kept
    coll.close()


@pytest.mark.parametrize("journal_format", FORMATS)
def test_limits_past_any_total_limit_nothing_and_show_as_set(tmp_path: Path, journal_format: str) -> None:
    largest = 2**63 - 1  # the most a config file takes (past the unboxed limit)
    coll = _collection(tmp_path, journal_format, max_items=largest, max_size=largest, max_item_size=largest)
    q = coll.queue("q")
    assert (q.config.max_items, q.config.max_size, q.config.max_item_size) == (largest, largest, largest)
    assert coll.put("q", [b"x" * 1000] * 50) == 50
    huge = 2**70  # past an i64, as a program setting a queue's config itself may give
    q.config = dataclasses.replace(q.config, max_items=huge, max_size=huge, max_item_size=huge)
    assert (q.config.max_items, q.config.max_size, q.config.max_item_size) == (huge, huge, huge)
    assert coll.put("q", [b"x" * 1000] * 50) == 50
    assert q.length == 100
    coll.close()


@pytest.mark.parametrize("journal_format", FORMATS)
def test_a_reload_sets_the_limits_each_put_keeps_to(tmp_path: Path, journal_format: str) -> None:
    coll = _collection(tmp_path, journal_format)
    assert coll.put("q", [b"abc"] * 4) == 4
    coll.reload(QueueConfigs({}, {"q": {"journal_format": journal_format, "max_items": 6, "max_item_size": 3}}), {})
    assert coll.put("q", [b"abc", b"abcd"]) == 1  # the second is over max_item_size
    assert coll.put("q", [b"a"] * 3) == 1  # the sixth item fills the queue
    coll.reload(QueueConfigs({}, {"q": {"journal_format": journal_format, "max_size": 18}}), {})
    assert coll.put("q", [b"a"] * 3) == 2  # 16 bytes in the queue: two more, and it holds max_size
    coll.close()


def _python_calls(work: Callable[[], object]) -> int:
    """The Python functions `work` calls (each resumption of a generator counts as one), with the
    collector held off, so that no finalizer of an earlier test's garbage runs among them."""
    calls = 0

    def count(_frame: FrameType, event: str, _arg: object) -> None:
        nonlocal calls
        calls += event == "call"

    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    sys.setprofile(count)
    try:
        work()
    finally:
        sys.setprofile(None)
        if collecting:
            gc.enable()
    return calls


@pytest.mark.skipif(item.QItem is item.QItemPython, reason="built without the C item helpers: the Python "
                                                           "twins make each item in Python")
@pytest.mark.parametrize("size", [100, 600])  # copied into one string of records; written where they are
def test_a_batch_put_and_get_call_no_python_per_item(tmp_path: Path, size: int) -> None:
    """A put of 1,000 items and their get run the Python of a put and a get of 10 (Kestrel 2, the
    default format; Kestrel 3's codec still makes each record in Python): a writer's puts of 10,000
    rows spent a quarter of the pure build's time in a loop over each item's length."""
    coll = _collection(tmp_path, "kestrel2")

    def round_of(count: int) -> Callable[[], object]:
        batch = [bytes([n % 256]) * size for n in range(count)]
        return lambda: (coll.put("q", batch), coll.remove("q", count))

    round_of(10)()  # warmed up: the queue made, its journal open
    assert _python_calls(round_of(1000)) == _python_calls(round_of(10))
    coll.close()
