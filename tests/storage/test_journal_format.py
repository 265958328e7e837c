"""The journal byte layout, checked against files built by hand from the format document."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from kestrel.storage import QueueCollection
from kestrel.storage.item import QItem
from kestrel.storage.kestrel2 import codec, packer
from kestrel.storage.kestrel2.codec import (
    Add,
    AddX,
    AddXid,
    ConfirmRemove,
    Remove,
    RemoveTentative,
    RemoveTentativeXid,
    SaveXid,
    StateDump,
    Unremove,
    describe,
    encode,
)
from kestrel.storage.kestrel2.reader import read_journal
from tests.support import kestrel24
from tests.support.queues import drain, one

T0 = 1_700_000_000_000


# Records written by hand, field by field, as kestrel-journal-format.md lays them out.
def add(expiry_s: int, data: bytes) -> bytes:
    return bytes([0]) + struct.pack("<i", 4 + len(data)) + struct.pack("<i", expiry_s) + data


def addx(data: bytes, add_time: int = T0, expiry: int = 0) -> bytes:
    return bytes([2]) + struct.pack("<i", 16 + len(data)) + struct.pack("<q", add_time) + struct.pack(
        "<q", expiry) + data


def remove() -> bytes:
    return bytes([1])


def remove_tentative() -> bytes:
    return bytes([3])


def xid_op(op: int, xid: int) -> bytes:
    return bytes([op]) + struct.pack("<i", xid)


def add_xid(xid: int, data: bytes, add_time: int = T0, expiry: int = 0) -> bytes:
    return bytes([7]) + struct.pack("<i", xid) + struct.pack("<i", 16 + len(data)) + struct.pack(
        "<qq", add_time, expiry) + data


def state_dump(xid: int, count: int) -> bytes:
    return bytes([8]) + struct.pack("<ii", xid, count)


def continue_(xid: int, data: bytes, add_time: int = T0, expiry: int = 0) -> bytes:
    return bytes([8]) + struct.pack("<i", xid) + struct.pack("<i", 16 + len(data)) + struct.pack(
        "<qq", add_time, expiry) + data


def load(tmp_path: Path, name: str, content: bytes) -> QueueCollection:
    (tmp_path / name).write_bytes(content)
    coll = QueueCollection(str(tmp_path))
    coll.load()
    return coll


def test_each_opcode_encodes_to_the_documented_bytes() -> None:
    assert encode(AddX(T0, 0, b"hi")) == addx(b"hi")
    assert encode(Remove()) == remove()
    assert encode(RemoveTentative()) == remove_tentative()
    assert encode(SaveXid(7)) == xid_op(4, 7)
    assert encode(Unremove(7)) == xid_op(5, 7)
    assert encode(ConfirmRemove(7)) == xid_op(6, 7)
    assert encode(AddXid(9, T0, 5, b"x")) == add_xid(9, b"x", expiry=5)
    assert encode(StateDump(3, 0)) == state_dump(3, 0)
    assert encode(RemoveTentativeXid(4)) == xid_op(9, 4)
    # The document's example, byte for byte: an ADD of a one-byte item has a size of 5.
    assert encode(Add(0, b"z")) == b"\x00" + b"\x05\x00\x00\x00" + b"\x00\x00\x00\x00" + b"z"


def test_add_legacy_opcode_replays(tmp_path: Path) -> None:
    coll = load(tmp_path, "q", add(0, b"one") + add(0, b"two") + remove())
    assert drain(coll, "q") == [b"two"]


def test_addx_keeps_times_and_expiry(tmp_path: Path) -> None:
    far = 4_000_000_000_000
    coll = load(tmp_path, "q", addx(b"a", T0, far) + addx(b"b", T0 + 1))
    item = coll.peek("q")
    assert item is not None and (item.add_time, item.expiry, item.data) == (T0, far, b"a")
    assert drain(coll, "q") == [b"a", b"b"]


def test_remove_tentative_then_confirm_and_unremove(tmp_path: Path) -> None:
    journal = (addx(b"a") + addx(b"b") + addx(b"c") + remove_tentative() + remove_tentative()
               + xid_op(6, 1) + xid_op(5, 2))
    coll = load(tmp_path, "q", journal)
    # a was confirmed; b was aborted back to the head; c follows.
    assert drain(coll, "q") == [b"b", b"c"]


def test_open_read_at_crash_returns_to_the_head(tmp_path: Path) -> None:
    coll = load(tmp_path, "q", addx(b"a") + addx(b"b") + remove_tentative())
    q = coll.queue("q")
    assert q.length == 2 and q.open_transactions == 0
    assert drain(coll, "q") == [b"a", b"b"]


def test_save_xid_sets_the_next_xid(tmp_path: Path) -> None:
    coll = load(tmp_path, "q", xid_op(4, 41) + addx(b"a") + addx(b"b"))
    item = one(coll.remove("q", transaction=True))
    assert item is not None and item.xid == 42


def test_xids_skip_open_ones_and_zero(tmp_path: Path) -> None:
    # save_xid(-1): the next is 0, which is never used, so 1; 2 is held open by ADD_XID.
    journal = xid_op(4, -1) + add_xid(2, b"held") + remove_tentative() + addx(b"a") + remove_tentative()
    (tmp_path / "q").write_bytes(journal)
    coll = QueueCollection(str(tmp_path))
    q = coll.queue("q")
    # Both were open at "crash" time: replay gave them xids 2 (named) and 1 (next free).
    # They are back at the head, lowest xid first.
    assert drain(coll, "q") == [b"a", b"held"]
    assert q.open_transactions == 0


def test_add_xid_preamble_reopens_under_its_xid(tmp_path: Path) -> None:
    journal = xid_op(4, 10) + add_xid(7, b"open") + remove_tentative() + addx(b"x") + xid_op(6, 7)
    coll = load(tmp_path, "q", journal)
    assert drain(coll, "q") == [b"x"]
    item_after = coll.queue("q")
    assert item_after.open_transactions == 0


def test_state_dump_of_the_document(tmp_path: Path) -> None:
    journal = state_dump(20, 2) + add_xid(5, b"p") + add_xid(6, b"q") + addx(b"r")
    coll = load(tmp_path, "q", journal)
    assert drain(coll, "q") == [b"p", b"q", b"r"]
    coll.put("q", [b"s"])
    item = one(coll.remove("q", transaction=True))
    assert item is not None and item.xid == 21


def test_kestrel_24_continue_and_remove_tentative_xid(tmp_path: Path) -> None:
    journal = (addx(b"a") + addx(b"b") + xid_op(9, 5) + continue_(5, b"a2") + xid_op(9, 6))
    coll = load(tmp_path, "q", journal)
    # xid 5 opened a; CONTINUE closed it and added a2 at the tail; xid 6 opened b (back at head).
    assert drain(coll, "q") == [b"b", b"a2"]
    coll.put("q", [b"c"])
    item = one(coll.remove("q", transaction=True))
    assert item is not None and item.xid == 7


def test_continue_told_from_state_dump_at_end_of_file(tmp_path: Path) -> None:
    journal = addx(b"a") + xid_op(9, 3) + continue_(3, b"z" * 20)
    coll = load(tmp_path, "q", journal)
    assert drain(coll, "q") == [b"z" * 20]


def test_mixed_journal_describes_legibly(tmp_path: Path) -> None:
    path = tmp_path / "q"
    path.write_bytes(addx(b"hello") + remove_tentative() + xid_op(6, 1))
    records = [r for _, r in read_journal(str(path))]
    assert describe(records) == "addx(5:0:hello), remove-tentative, confirm(1)"


def independent_reader(data: bytes) -> list[tuple]:
    """A reader written from the document alone, to check what our writer produces."""
    out: list[tuple] = []
    i = 0
    while i < len(data):
        op = data[i]
        i += 1
        if op == 2:
            (size,) = struct.unpack("<i", data[i:i + 4])
            add_time, expiry = struct.unpack("<qq", data[i + 4:i + 20])
            out.append(("addx", add_time, expiry, data[i + 20:i + 4 + size]))
            i += 4 + size
        elif op in (1, 3):
            out.append(("remove",) if op == 1 else ("remove_tentative",))
        elif op in (4, 5, 6, 9):
            (xid,) = struct.unpack("<i", data[i:i + 4])
            out.append(({4: "save_xid", 5: "unremove", 6: "confirm", 9: "remove_tentative_xid"}[op], xid))
            i += 4
        elif op == 7:
            xid, size = struct.unpack("<ii", data[i:i + 8])
            add_time, expiry = struct.unpack("<qq", data[i + 8:i + 24])
            out.append(("add_xid", xid, add_time, expiry, data[i + 24:i + 8 + size]))
            i += 8 + size
        else:
            raise AssertionError(f"our writer used opcode {op}, which it must not")
    return out


def test_files_we_write_read_back_with_an_independent_reader(tmp_path: Path) -> None:
    from kestrel.storage.clock import FakeClock

    clock = FakeClock(T0)
    coll = QueueCollection(str(tmp_path), clock=clock)
    coll.put("work", [b"one"], expiry_ms=T0 + 60_000)
    coll.put("work", [b"two", b"three"])
    first = one(coll.remove("work", transaction=True))
    assert first is not None
    coll.remove("work")
    coll.unremove("work", [first.xid])
    again = one(coll.remove("work", transaction=True))
    assert again is not None
    coll.confirm("work", [again.xid])
    coll.close()
    records = independent_reader((tmp_path / "work").read_bytes())
    assert records == [
        ("addx", T0, T0 + 60_000, b"one"),
        ("addx", T0, 0, b"two"),
        ("addx", T0, 0, b"three"),
        ("remove_tentative_xid", 1),
        ("remove",),
        ("unremove", 1),
        ("remove_tentative_xid", 2),
        ("confirm", 2),
    ]


def test_open_reads_load_the_same_in_kestrel_24(tmp_path: Path) -> None:
    # Opcode 3 would be xid 0 in every released Kestrel: this journal would load there as [b].
    coll = QueueCollection(str(tmp_path))
    coll.put("q", [b"a", b"b"])
    first = one(coll.remove("q", transaction=True))
    second = one(coll.remove("q", transaction=True))
    assert first is not None and second is not None
    assert coll.confirm("q", [second.xid])
    coll.close()
    data = (tmp_path / "q").read_bytes()
    assert xid_op(9, first.xid) in data and xid_op(9, second.xid) in data
    assert kestrel24.load(data) == [b"a"]
    again = QueueCollection(str(tmp_path))
    again.load()
    assert drain(again, "q") == [b"a"]


def test_opcode_3_replays_differently_in_kestrel_24_which_is_why_we_do_not_write_it() -> None:
    # The same history written with the document's REMOVE_TENTATIVE: Kestrel 2.4 keeps b, not a.
    journal = addx(b"a") + addx(b"b") + remove_tentative() + remove_tentative() + xid_op(6, 2)
    assert kestrel24.load(journal) == [b"b"]


def test_a_pack_loads_the_same_in_kestrel_24(tmp_path: Path) -> None:
    held = QItem(T0, 0, b"held")
    request = packer.PackRequest(str(tmp_path), "q", 100, 7, [(5, held)],
                                 [None, None, QItem(T0, 0, b"kept"), QItem(T0, 0, b"last")], T0)
    pack = packer.write_pack(request, [])
    # What happened after the checkpoint: two items left (their placeholders), one more was read.
    (tmp_path / "q").write_bytes(remove() + remove() + xid_op(9, 8) + addx(b"new"))
    data = Path(pack).read_bytes() + (tmp_path / "q").read_bytes()
    assert kestrel24.replay(data) == ([b"last", b"new"], {5: b"held", 8: b"kept"})
    coll = QueueCollection(str(tmp_path))
    q = coll.queue("q")
    q_opens = {i.xid: i.data for i in q.open_reads()}
    assert q_opens == {}  # reopened at start-up, as Kestrel does
    assert drain(coll, "q") == kestrel24.load(data) == [b"held", b"kept", b"last", b"new"]


@pytest.mark.parametrize("opcode", [10, 0x7F, 0xFF])
def test_unknown_opcode_is_named_in_the_error(tmp_path: Path, opcode: int) -> None:
    from kestrel.storage.errors import CorruptJournalError
    from tests.support.queues import load_strictly

    (tmp_path / "q").write_bytes(addx(b"a") + bytes([opcode]) + addx(b"b"))
    coll = QueueCollection(str(tmp_path))
    with pytest.raises(CorruptJournalError) as err:
        load_strictly(coll)
    assert err.value.offset == len(addx(b"a"))
    assert err.value.opcode == opcode
    assert str(tmp_path / "q") in str(err.value)



@pytest.mark.parametrize("record", [Add(9, b"abc"), AddX(T0, 0, b"abc"), AddXid(4, T0, 0, b""),
                                    codec.Continue(4, T0, 0, b"abc")], ids=lambda r: type(r).__name__)
def test_an_item_record_ends_where_its_header_says(record: codec.Record) -> None:
    """One rule for where an item record ends: `record_span` (the whole record, as replay and the
    torn-tail rule read it) agrees with `item_extent` (its header alone, as a reader reading a large
    item reads it), and a size too small for the header is refused, not taken for an extent."""
    data = b"\x01" + encode(record)  # at offset 1: the extent counts from the record
    extent = codec.item_extent(data, 1)
    assert extent is not None and len(data) == 1 + extent[1]
    start, end = extent
    assert codec.record_span(data, 1, True) == (1 + end, 1 + start)
    assert codec.item_extent(data[:1 + start], 1) == extent  # the header alone
    assert codec.item_extent(data[:start], 1) is None  # a byte short of it
    if isinstance(record, codec.Continue):
        return  # its size too small reads as a STATE_DUMP's count
    small = bytearray(data)
    field = 5 if isinstance(record, AddXid) else 1
    small[1 + field:1 + field + 4] = struct.pack("<i", 3)
    with pytest.raises(codec.Malformed, match="of 3 bytes is shorter than its"):
        codec.record_span(bytes(small), 1, True)
