"""The batch fast paths give what the item-by-item ones give: the same journal bytes, the same items."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kestrel.storage import QueueCollection
from kestrel.storage.clock import FakeClock
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
