"""The compiled list loops (service/_thrift_lists.c) against the Python loops they stand in for.

A batch put's list of binaries is read by both from intact lists, under byte budgets that cut them
anywhere, and after bytes are overwritten or the data cut short: where the compiled loop answers,
it must give the Python loop's items and position; where it declines (None), the Python loop must
refuse the list (a whole frame) or need more data (unframed). A batch get's Items must be the same
bytes either way, and anything but (bytes, int) pairs is left to the Python loop.
"""

from __future__ import annotations

import shutil
import struct
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service import thrift_protocol
from service.thrift_messages import METHODS, ValueType, encode_reply
from service.thrift_protocol import BinaryReader, BinaryWriter, ThriftProtocolError

try:
    from service import _thrift_lists as compiled
except ImportError:  # the build skips the helper only where there is no C compiler
    if shutil.which("cc") or shutil.which("gcc"):
        raise
    pytest.skip("built without a C compiler", allow_module_level=True)

ITEMS = st.lists(st.binary(max_size=300), max_size=40)


def encoded(items: list[bytes]) -> bytes:
    return b"".join(struct.pack("!i", len(x)) + x for x in items)


def python_read(buf: bytes | bytearray, pos: int, end: int, count: int, budget: int) -> Any:
    """The Python loop's answer on a whole frame ending at `end`: (items, position) or the error."""
    reader = BinaryReader(buf, end, end, 100_000, budget)
    reader.pos = pos
    try:
        return reader.read_binary_list_python(count, "items"), reader.pos
    except ThriftProtocolError as e:
        return str(e)


@settings(max_examples=400, deadline=None)
@given(ITEMS, st.binary(max_size=8), st.integers(0, 20_000), st.data())
def test_intact_and_damaged_lists_read_as_the_python_loop_reads_them(items: list[bytes], prefix: bytes,
                                                                     budget: int, data: Any) -> None:
    raw = bytearray(prefix + encoded(items) + b"\x00")
    for damage in range(data.draw(st.integers(0, 3))):
        if damage == 0 and data.draw(st.booleans()):
            del raw[data.draw(st.integers(0, len(raw))):]
        elif raw:
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    count = len(items) + data.draw(st.integers(-1, 2)) if items else data.draw(st.integers(0, 2))
    pos = min(len(prefix), len(raw))  # a reader is never past its data
    for buf in (bytes(raw), raw):  # frames are bytes; an unframed request's buffer a bytearray
        fast = compiled.read_binary_list(buf, pos, len(buf), max(count, 0), budget)
        reference = python_read(buf, pos, len(buf), max(count, 0), budget)
        if fast is None:
            assert isinstance(reference, str), "declined a list the Python loop reads"
        else:
            assert list(fast) == list(reference)
            assert all(type(x) is bytes for x in fast[0])


def test_a_list_past_the_data_at_hand_is_left_to_the_python_loop_which_reads_on() -> None:
    """Unframed transport: the rest of the list has not arrived, and the Python loop asks for it."""
    whole = encoded([b"a" * 10, b"b" * 20, b"c" * 30]) + b"\x00"
    arrived = bytearray(whole[:25])
    assert compiled.read_binary_list(arrived, 0, len(arrived), 3, 1000) is None

    def more(need: int) -> int:
        arrived[len(arrived):] = whole[len(arrived):need]
        return len(arrived)

    reader = BinaryReader(arrived, len(arrived), len(whole), 100, 1000, more=more)
    assert reader.read_binary_list(3, "items") == [b"a" * 10, b"b" * 20, b"c" * 30]
    assert reader.pos == len(whole) - 1


def test_a_count_the_data_cannot_hold_is_declined_before_allocating() -> None:
    assert compiled.read_binary_list(b"\x00" * 64, 0, 64, 2**31 - 1, 2**40) is None
    assert compiled.read_binary_list(b"\x00" * 64, 0, 64, 16, 0) == ([b""] * 16, 64)
    assert compiled.read_binary_list(b"\x00" * 64, 70, 64, 0, 0) is None  # a position past the end


def test_the_reader_uses_the_compiled_loop_and_names_faults_as_the_python_loop_does() -> None:
    buf = encoded([b"x" * 8, b"y" * 9])
    reader = BinaryReader(buf, len(buf), len(buf), 100, 16)
    with pytest.raises(ThriftProtocolError, match="holds more than max_batch_bytes 16"):
        reader.read_binary_list(2, "items")
    reader = BinaryReader(buf, len(buf), len(buf), 100, 17)
    assert reader.read_binary_list(2, "items") == [b"x" * 8, b"y" * 9] and reader.pos == len(buf)


PAIRS = st.lists(st.tuples(st.binary(max_size=300), st.integers(-(2**63), 2**63 - 1)), max_size=30)


@settings(max_examples=300, deadline=None)
@given(PAIRS, st.integers(-(2**15), 2**15 - 1), st.integers(-(2**15), 2**15 - 1))
def test_items_are_laid_out_as_the_python_loop_lays_them_out(pairs: list[tuple[bytes, int]], fid1: int,
                                                              fid2: int) -> None:
    fields = [(fid1, "data", ValueType(thrift_protocol.STRING)),
              (fid2, "id", ValueType(thrift_protocol.I64))]
    fast = compiled.write_items(fid1, fid2, pairs)
    writer = BinaryWriter()
    saved, thrift_protocol._lists = thrift_protocol._lists, None
    try:
        writer.write_flat_structs(fields, pairs)
    finally:
        thrift_protocol._lists = saved
    assert fast == bytes(writer.out)


@pytest.mark.parametrize("odd", [
    (b"x", True),  # a bool is an int, but not a plain one
    (b"x", 2**63),  # over an i64
    (bytearray(b"x"), 1),
    ("x", 1),
    (b"x", 1, 2),
    [b"x", 1],
])
def test_anything_but_bytes_and_int_pairs_is_left_to_the_python_loop(odd: Any) -> None:
    assert compiled.write_items(1, 2, [(b"ok", 0), odd]) is None


def test_get_replies_are_the_same_bytes_with_and_without_the_compiled_loop() -> None:
    got = [(b"a" * n, n * 7 - 3) for n in range(50)]
    fast = encode_reply(BinaryWriter(), METHODS["get"], 5, got)
    saved, thrift_protocol._lists = thrift_protocol._lists, None
    try:
        assert encode_reply(BinaryWriter(), METHODS["get"], 5, got) == fast
    finally:
        thrift_protocol._lists = saved
