"""The compiled binary protocol paths (src/kestrel/service/thrift/_binary.c) against the Python they stand in for.

A whole call frame, intact or damaged, is read by both: where the compiled reader answers, it must
give the name, sequence id, arguments and position the Python readers (`read_message_begin`,
`read_args`) give, and it must answer every intact call of the hot path; anything else it leaves to
the Python readers. A batch put's list of binaries is read by both from intact lists, under byte
budgets that cut them anywhere, and after bytes are overwritten or the data cut short: where the
compiled loop answers, it must give the Python loop's items and position; where it declines (None),
the Python loop must refuse the list (a whole frame) or need more data (unframed). Every reply the
compiled writer lays out (nothing, an i32, a get's Items or TimedItems) must be the bytes
`write_reply` writes field by field, and anything else is left to it.
"""

from __future__ import annotations

import shutil
import struct
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kestrel.service.thrift.messages import (
    _PLAIN_CALLS,
    METHODS,
    encode_reply,
    field_rules,
    read_args,
    read_buffered_frame,
    read_plain_frame,
    write_reply,
)
from kestrel.service.thrift.protocol import (
    CALL,
    BinaryReader,
    BinaryWriter,
    CompactWriter,
    ThriftProtocolError,
)
from kestrel.storage.item import QItem
from kestrel.storage.taken_items import TakenItems
from tests.support.thrift_wire import encode_call, framed
from tests.thrift.test_thrift_codec import CALLS

try:
    from kestrel.service.thrift import _binary as compiled
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
TIMED = st.lists(st.tuples(st.binary(max_size=100), st.integers(-(2**63), 2**63 - 1),
                           st.integers(0, 2**63 - 1), st.integers(0, 2**63 - 1) | st.just(0)), max_size=20)


@settings(max_examples=300, deadline=None)
@given(PAIRS, TIMED, st.integers(-(2**31), 2**31 - 1))
def test_items_are_laid_out_as_write_reply_lays_them_out(pairs: list[tuple[bytes, int]],
                                                         timed: list[tuple[bytes, int, int, int]], seqid: int) -> None:
    head = METHODS["get"].reply_head
    datas = [data for data, _ in pairs]
    reference = write_reply(BinaryWriter(), METHODS["get"], seqid, pairs)
    assert compiled.write_reply(head, seqid, (1, 2), datas, [number for _, number in pairs]) == reference
    if len({number for _, number in pairs}) == 1:  # one id for every item
        assert compiled.write_reply(head, seqid, (1, 2), datas, pairs[0][1]) == reference
    fields = [(data, number, added, expiry or None) for data, number, added, expiry in timed]
    reference = write_reply(BinaryWriter(), METHODS["get_timed"], seqid, fields)
    columns = [list(column) for column in zip(*timed, strict=True)] or [[], [], [], []]
    assert compiled.write_reply(METHODS["get_timed"].reply_head, seqid, (1, 2, 3, 4), *columns) == reference


@pytest.mark.parametrize("datas, ids", [
    ([b"ok", b"x"], [0, True]),  # a bool is an int, but not a plain one
    ([b"ok", b"x"], [0, 2**63]),  # over an i64
    ([b"ok", b"x"], 2**63),
    ([b"ok", b"x"], [0]),  # an id short
    ([b"ok", bytearray(b"x")], 1),
    ([b"ok", "x"], 1),
])
def test_anything_but_bytes_and_plain_ids_is_left_to_write_reply(datas: list[Any], ids: Any) -> None:
    assert compiled.write_reply(b"head", 1, (1, 2), datas, ids) is None
    assert compiled.write_reply(b"head", 1, (1, 2, 3, 4), datas, ids, [0] * len(datas), [0] * len(datas)) is None
    assert compiled.write_reply(b"head", 1, (1, 2, 3, 4), [b"x"], 0, [1], [2**63]) is None  # an expiry too
    assert compiled.write_reply(b"head", 2**31, 5) is None and compiled.write_reply(b"head", 1, 2**31) is None
    assert compiled.write_framed_reply(b"head", 1, (1, 2), datas, ids) is None
    assert compiled.write_framed_reply(b"head", 2**31, 5) is None


@pytest.mark.parametrize("ids", [0, list(range(50))])
def test_get_replies_are_the_same_bytes_with_and_without_the_compiled_loop(ids: int | list[int]) -> None:
    got = TakenItems([QItem(0, 0, b"a" * n) for n in range(50)], ids)
    fast = encode_reply(BinaryWriter, METHODS["get"], 5, got)  # laid out by the compiled writer
    assert write_reply(BinaryWriter(), METHODS["get"], 5, got.pairs()) == fast  # the Python loop
    assert encode_reply(CompactWriter, METHODS["get"], 5, got) == write_reply(CompactWriter(), METHODS["get"], 5,
                                                                             got.pairs())


def python_call(frame: bytes) -> Any:
    """What the Python readers make of a whole frame: (name, seqid, args, pos), or None where it is
    not a call of a known method under a strict header, or is refused, or has a problem to answer."""
    reader = BinaryReader(frame, len(frame), len(frame), 100_000, 16 << 20)
    try:
        name, mtype, seqid = reader.read_message_begin()
        method = METHODS.get(name)
        if frame[:2] != b"\x80\x01" or mtype != CALL or method is None:
            return None
        args, problem = read_args(reader, method)
    except ThriftProtocolError:
        return None
    return None if problem is not None else (name, seqid, args, reader.pos)


def check_call(frame: bytes, intact: bool = False) -> Any:
    """The compiled reader's answer: the Python readers' where it answers (it must answer an intact
    call of Kestrel's)."""
    call = compiled_call(frame)
    if call is not None or intact:
        assert call == python_call(frame)
    return call


def compiled_call(frame: bytes) -> Any:
    """The compiled reader's answer, in the same shape: (name, seqid, args, pos) or None."""
    call = compiled.read_call(frame, _PLAIN_CALLS, 100_000, 16 << 20)
    if call is None:
        assert read_plain_frame(frame, 100_000, 16 << 20) is None
        return None
    method, _, seqid, args, pos = call
    assert method is METHODS[method.name]
    assert read_plain_frame(frame, 100_000, 16 << 20) == (method, seqid, args)
    return method.name, seqid, args, pos


@settings(max_examples=500, deadline=None)
@given(CALLS, st.data())
def test_call_frames_read_as_the_python_readers_read_them(call: tuple[str, Any], data: Any) -> None:
    raw = bytearray(encode_call("binary", call[0], seqid=data.draw(st.integers(-(2**31), 2**31 - 1)), **call[1]))
    assert check_call(bytes(raw), intact=True) is not None
    for _ in range(data.draw(st.integers(1, 4))):  # and damaged: bytes changed, or the tail cut
        if data.draw(st.booleans()):
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
        else:
            del raw[data.draw(st.integers(0, len(raw) - 1)):]
            if not raw:
                break
    check_call(bytes(raw))


def test_calls_of_the_hot_path_take_the_compiled_reader() -> None:
    put = encode_call("binary", "put", seqid=7, queue_name="q", items=[b"a", b"bc"], expiration_msec=5)
    assert compiled_call(put) == ("put", 7, ("q", [b"a", b"bc"], 5), len(put))
    get = encode_call("binary", "get", seqid=8, queue_name="q", max_items=10, timeout_msec=0, auto_abort_msec=0)
    assert compiled_call(get) is not None
    confirm = encode_call("binary", "confirm", seqid=9, queue_name="q", ids={1, 2})
    read = compiled_call(confirm)
    assert read is not None and read[:2] == ("confirm", 9) and sorted(read[2][1]) == [1, 2]
    unknown_field = put[:-1] + b"\x08\x00\x63" + struct.pack("!i", 1) + b"\x00"  # field 99: not put's
    assert compiled_call(unknown_field) is None and python_call(unknown_field) is not None  # read field by field


def _name_slot(name: str) -> int:
    """The slot the compiled reader keeps an ASCII name's str in (FNV-1a of its bytes, 64 slots)."""
    raw = name.encode()
    h = 2166136261 ^ len(raw)
    for byte in raw:
        h = ((h ^ byte) * 16777619) & 0xFFFFFFFF
    return h % 64


def _name_read(name: str) -> str:
    call = compiled_call(encode_call("binary", "peek", seqid=1, queue_name=name))
    assert call is not None
    read: str = call[2][0]
    assert read == name
    return read


def test_a_queue_name_read_again_is_the_same_str() -> None:
    """A name the reader has kept is given again for the same bytes (no decode, its hash known), also
    after another name took its slot and gave it back; names over 64 bytes or not ASCII are decoded
    each time, and every name reads as the Python reader reads it (`compiled_call` checks that)."""
    first = _name_read("orders")
    assert _name_read("orders") is first
    rival = next(f"q{n}" for n in range(10_000) if _name_slot(f"q{n}") == _name_slot("orders"))
    kept_rival = _name_read(rival)  # takes the slot
    assert _name_read(rival) is kept_rival
    assert _name_read("orders") is not first  # read anew, and kept again
    assert _name_read("ordert") != "orders" and _name_read("order") == "order"  # same slot or not, its own bytes
    for name in ("q" * 65, "файлы", "caf\u00e9"):
        assert _name_read(name) is not _name_read(name)


@settings(max_examples=300, deadline=None)
@given(CALLS, st.data())
def test_a_frame_in_the_receive_buffer_reads_as_its_payload_reads(call: tuple[str, Any], data: Any) -> None:
    """In place, a whole frame's call is what `read_plain_frame` reads from the frame's payload, with
    the frame's end; a frame not whole yet, over `max_frame` or announcing a negative size is left to
    the connection, as is every call `read_plain_frame` declines; what follows the frame is not read."""
    payload = bytearray(encode_call("binary", call[0], seqid=data.draw(st.integers(-(2**31), 2**31 - 1)),
                                    **call[1]))
    if data.draw(st.booleans()):  # damaged: a byte changed, or the tail cut (the frame says where it ends)
        if data.draw(st.booleans()):
            payload[data.draw(st.integers(0, len(payload) - 1))] = data.draw(st.integers(0, 255))
        else:
            del payload[data.draw(st.integers(1, len(payload) - 1)):]
    frame = struct.pack("!i", len(payload)) + payload
    buf = bytearray(frame + data.draw(st.binary(max_size=20)))  # the next request may have begun
    plain = read_plain_frame(bytes(payload), 100_000, 16 << 20)
    expected = None if plain is None else (*plain, len(frame))
    assert read_buffered_frame(buf, len(payload), 100_000, 16 << 20) == expected
    assert read_buffered_frame(buf, len(payload) - 1, 100_000, 16 << 20) is None  # over max_frame
    assert read_buffered_frame(buf[:data.draw(st.integers(0, len(frame) - 1))], len(payload), 100_000,
                               16 << 20) is None  # not whole yet
    negative = bytearray(struct.pack("!i", -len(payload))) + payload
    assert read_buffered_frame(negative, 1 << 20, 100_000, 16 << 20) is None


def test_a_receive_buffer_is_held_still_while_read_and_let_go_after() -> None:
    """The readers hold a bytearray's bytes by its export count, as its buffer protocol does: after
    every answer (a call, a decline, an error) it can be resized again, as the connection does to
    take the frame out; and a buffer already exported (a view over it) is read alike."""
    payload = encode_call("binary", "put", seqid=3, queue_name="q", items=[b"ab"], expiration_msec=0)
    frame = struct.pack("!i", len(payload)) + payload
    buf = bytearray(frame + b"next")
    read = read_buffered_frame(buf, len(payload), 100_000, 16 << 20)
    assert read is not None and read[1:] == (3, ("q", [b"ab"], 0), len(frame))
    assert read_buffered_frame(buf, len(payload) - 1, 100_000, 16 << 20) is None  # declined: over max_frame
    with pytest.raises(TypeError):
        compiled.read_framed_call(buf, len(payload), _PLAIN_CALLS, "many", 16 << 20)
    body = bytearray(encoded([b"x", b"yz"]))
    assert compiled.read_binary_list(body, 0, len(body), 2, 100) == ([b"x", b"yz"], len(body))
    with memoryview(buf):  # exported meanwhile: not resizable until the view goes
        assert read_buffered_frame(buf, len(payload), 100_000, 16 << 20) == read
        with pytest.raises(BufferError):
            del buf[:len(frame)]
    del buf[:len(frame)]
    del body[:]
    assert buf == b"next"


@pytest.mark.parametrize("etype", [2, 3, 4, 6, 8, 10, 11, 12, 13, 14, 15, 16, 0, 1, 5, 99])
def test_an_empty_list_of_any_element_type_reads_as_the_python_reader_reads_it(etype: int) -> None:
    """An empty list names an element type the Python reader takes (or refuses) without reading one."""
    put = encode_call("binary", "put", seqid=1, queue_name="q", items=[], expiration_msec=0)
    at = put.index(b"\x0f\x00\x02") + 3
    frame = put[:at] + bytes([etype]) + put[at + 1:]
    assert (compiled_call(frame) is None) == (python_call(frame) is None)
    check_call(frame)


def test_limits_and_bad_text_are_left_to_the_python_readers() -> None:
    put = encode_call("binary", "put", queue_name="q", items=[b"x"] * 5, expiration_msec=0)
    for max_items, max_bytes in [(4, 100), (5, 4)]:
        assert read_plain_frame(put, max_items, max_bytes) is None
    assert read_plain_frame(put, 5, 5) is not None
    bad_name = encode_call("binary", "peek", queue_name="q").replace(b"\x00\x00\x00\x01q", b"\x00\x00\x00\x01\xff")
    assert compiled_call(bad_name) is None


def test_every_argument_kind_is_read_whole_or_declined_at_every_cut() -> None:
    """A made-up method with one argument of each kind (Kestrel's own have no plain i64), its frame
    cut at every length: only the whole frame is read, and to the right values, each in its place
    (not the order of the field ids), the default where the call has none."""
    fields = field_rules((None, (1, 8, 0), (0, 10, 1), (2, 11, 2), (3, 11, 3), (4, 15, 4), (5, 14, 5)))
    methods = ((b"n", "not this", (None,), field_rules((None, (0, 8, 0)))), (b"m", "M", (None,) * 6 + (7,), fields))
    body = (b"\x08\x00\x01" + struct.pack("!i", -5) + b"\x0a\x00\x02" + struct.pack("!q", -(2**40))
            + b"\x0b\x00\x03" + struct.pack("!i", 3) + "é!".encode() + b"\x0b\x00\x04" + struct.pack("!i", 2)
            + b"\xff\x00" + b"\x0f\x00\x05\x0b" + struct.pack("!i", 2) + encoded([b"x", b"yz"])
            + b"\x0e\x00\x06\x0a" + struct.pack("!iqq", 2, -1, 2**62) + b"\x00")
    frame = struct.pack("!I", 0x80010001) + struct.pack("!i", 1) + b"m" + struct.pack("!i", 42) + body
    whole = compiled.read_call(frame, methods, 100, 100)
    assert whole == ("M", 1, 42, (-(2**40), -5, "é!", b"\xff\x00", [b"x", b"yz"], [-1, 2**62], 7), len(frame))
    for cut in range(len(frame)):
        assert compiled.read_call(frame[:cut], methods, 100, 100) is None


REPLIES = st.one_of(
    st.tuples(st.just("put"), st.integers(-(2**31), 2**31 - 1)),
    st.tuples(st.just("put"), st.integers(2**31, 2**40)),  # past an i32: refused alike
    st.tuples(st.sampled_from(["confirm", "abort", "current_status"]), st.integers(-(2**31), 2**31 - 1)),
    st.tuples(st.just("get"), PAIRS.map(lambda pairs: TakenItems([QItem(0, 0, d) for d, _ in pairs],
                                                                 [n for _, n in pairs]))),
    st.tuples(st.just("get"), st.lists(st.tuples(st.binary(max_size=5), st.booleans()), max_size=3)),
    st.tuples(st.just("get_timed"), TIMED.map(lambda timed: TakenItems(
        [QItem(added, expiry, d) for d, _, added, expiry in timed], [n for _, n, _, _ in timed]))),
    st.tuples(st.sampled_from(["flush_queue", "delete_queue", "flush_all_queues", "set_status"]), st.none()),
    st.tuples(st.just("get_version"), st.text(max_size=10)),
)


@settings(max_examples=400, deadline=None)
@given(REPLIES, st.integers(-(2**31), 2**31 - 1) | st.integers(2**31, 2**33))
def test_binary_replies_are_the_bytes_written_field_by_field(reply: tuple[str, Any], seqid: int) -> None:
    name, value = reply
    fields = value
    if isinstance(value, TakenItems):  # the writers' tuples of the fields in order
        fields = value.pairs() if name == "get" else value.timed()
    try:
        reference: Any = write_reply(BinaryWriter(), METHODS[name], seqid, fields)
    except (struct.error, TypeError, ValueError) as e:
        reference = type(e)
    try:
        laid: Any = encode_reply(BinaryWriter, METHODS[name], seqid, value)
    except (struct.error, TypeError, ValueError) as e:
        laid = type(e)
    assert laid == reference


@settings(max_examples=300, deadline=None)
@given(REPLIES, st.integers(-(2**31), 2**31 - 1), st.sampled_from([BinaryWriter, CompactWriter]))
def test_a_framed_reply_is_the_reply_after_its_size(reply: tuple[str, Any], seqid: int,
                                                     protocol: type[BinaryWriter] | type[CompactWriter]) -> None:
    """A framed transport's reply is made as one frame, its size first: by the compiled writer
    (binary) and by the Python writers, the bytes of the unframed reply after a 4-byte size."""
    name, value = reply
    fields = value
    if isinstance(value, TakenItems):
        fields = value.pairs() if name == "get" else value.timed()

    def made(make: Any) -> Any:
        try:
            return make()
        except (struct.error, TypeError, ValueError) as e:  # a value out of its type's range
            return type(e)

    reference = made(lambda: write_reply(protocol(), METHODS[name], seqid, fields))
    if isinstance(reference, bytes):
        reference = framed(reference)
    assert made(lambda: encode_reply(protocol, METHODS[name], seqid, value, framed=True)) == reference
    assert made(lambda: write_reply(protocol(framed=True), METHODS[name], seqid, fields)) == reference


@pytest.mark.parametrize("sizes", [[600], [3, 70_000, 10, 512], [511, 1]])
@pytest.mark.parametrize("protocol", [BinaryWriter, CompactWriter])
def test_a_framed_reply_holding_large_items_is_one_frame(sizes: list[int],
                                                         protocol: type[BinaryWriter] | type[CompactWriter]) -> None:
    """Items from `GATHER_FROM` bytes up stay where they are until the reply is joined: the frame's
    size, at the front of the first piece, counts every piece."""
    got = TakenItems([QItem(0, 0, bytes([n % 251]) * n) for n in sizes], 7)
    reference = write_reply(protocol(), METHODS["get"], 9, got.pairs())
    assert write_reply(protocol(framed=True), METHODS["get"], 9, got.pairs()) == framed(reference)
    assert encode_reply(protocol, METHODS["get"], 9, got, framed=True) == framed(reference)
    head = METHODS["get"].reply_head
    if protocol is BinaryWriter:
        laid = compiled.write_framed_reply(head, 9, (1, 2), [data for data, _ in got.pairs()], 7)
        assert laid == framed(reference)
