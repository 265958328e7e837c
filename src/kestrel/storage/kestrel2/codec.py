"""Kestrel 2.x journal records: the only Python code that knows the byte layout (its compiled twin
for runs of common records and for a batch's ADDX records, src/kestrel/storage/kestrel2/_codec.c, is tested
against
`decode_common_python` and `encode_addx_many_python`).

Every record is a one-byte opcode and its fields, little-endian; a leading `size` covers the whole
block after it. One frozen dataclass per record kind, and pure encode/decode functions with no I/O.

Opcode 8 means STATE_DUMP in the journal format document and CONTINUE in released Kestrel 2.4;
`decode` tells them apart by what follows (see `_opcode_8_span`). A reliable read is written as
released Kestrel 2.4 writes it, REMOVE_TENTATIVE_XID (9) with its xid: every Kestrel from 2.1 to 2.4
reads the document's REMOVE_TENTATIVE (3) as xid 0, so a journal of opcode-3 records would replay
differently there. Opcode 3 is still read as the document says (the next free xid).
"""

from __future__ import annotations

import re
import struct
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from kestrel.storage.torn_tail import Chains, any_of

ADD = 0
REMOVE = 1
ADDX = 2
REMOVE_TENTATIVE = 3
SAVE_XID = 4
UNREMOVE = 5
CONFIRM_REMOVE = 6
ADD_XID = 7
STATE_DUMP = 8
REMOVE_TENTATIVE_XID = 9
MAX_OPCODE = REMOVE_TENTATIVE_XID
_ITEM_OPCODES = (ADD, ADDX, ADD_XID)  # the records that add an item (`_records_reach` counts them)

_I32 = struct.Struct("<i")
_U32 = struct.Struct("<I")  # a size field as the torn-tail rule weighs it: its 32 bits, never negative
_XID_RECORD = struct.Struct("<Bi")  # an opcode and its xid: one pack, no concatenation
XID_RECORD_SIZE = _XID_RECORD.size
XIDS_LAID_OUT = 8  # from this many xid records on, `encode_xids` lays them out whole
_ADD_HEAD = struct.Struct("<ii")  # size, expiry seconds
_ADDX_HEAD = struct.Struct("<iqq")  # size, add time ms, expiry ms
_ADDX_RECORD_HEAD = struct.Struct("<Biqq")  # the opcode, then as _ADDX_HEAD
_XID_ADDX_HEAD = struct.Struct("<iiqq")  # xid, size, add time, expiry
_TWO_I32 = struct.Struct("<ii")
_TWO_I64 = struct.Struct("<qq")

# An item block (add time + expiry) is 16 bytes before the data.
ITEM_HEADER = 16
# A pack's stand-in for an item that left the queue after the checkpoint: empty and expired at
# 1 ms after the epoch. A later REMOVE consumes it on replay; if that REMOVE was lost (a salvaged
# journal), the stand-in is dropped as expired instead of being served as an empty item.
PLACEHOLDER_EXPIRY = 1
# Anything bigger than this in a size field is damage, not an item (Kestrel's sizes are i32).
MAX_BLOCK = 2**31 - 1


@dataclass(frozen=True, slots=True)
class Add:
    """Starling's ADD (opcode 0): expiry in whole seconds, no add time."""

    expiry_s: int
    data: bytes


@dataclass(frozen=True, slots=True)
class Remove:
    """Drop the head item for good."""


@dataclass(frozen=True, slots=True)
class AddX:
    """Add an item at the tail; times in milliseconds since the epoch, expiry 0 = never."""

    add_time: int
    expiry: int
    data: bytes


@dataclass(frozen=True, slots=True)
class RemoveTentative:
    """Open a read on the head item under the next free xid."""


@dataclass(frozen=True, slots=True)
class SaveXid:
    """Set the last-used xid (the start of a rewritten journal)."""

    xid: int


@dataclass(frozen=True, slots=True)
class Unremove:
    """Abort the open read `xid`: its item goes back to the head."""

    xid: int


@dataclass(frozen=True, slots=True)
class ConfirmRemove:
    """Confirm the open read `xid`: its item is gone for good."""

    xid: int


@dataclass(frozen=True, slots=True)
class AddXid:
    """Add an item that the next REMOVE_TENTATIVE reopens under `xid` (rewritten journals)."""

    xid: int
    add_time: int
    expiry: int
    data: bytes


@dataclass(frozen=True, slots=True)
class StateDump:
    """The format document's opcode 8: an xid and a count of ADD_XID records that follow."""

    xid: int
    count: int


@dataclass(frozen=True, slots=True)
class Continue:
    """Released Kestrel 2.4's opcode 8: open read `xid` ends and its item is added at the tail."""

    xid: int
    add_time: int
    expiry: int
    data: bytes


@dataclass(frozen=True, slots=True)
class RemoveTentativeXid:
    """Released Kestrel 2.4's opcode 9: open a read on the head item under a named xid."""

    xid: int


Record = (
    Add | Remove | AddX | RemoveTentative | SaveXid | Unremove | ConfirmRemove | AddXid | StateDump
    | Continue | RemoveTentativeXid
)

OPCODE_NAMES: dict[type, str] = {
    Add: "ADD", Remove: "REMOVE", AddX: "ADDX", RemoveTentative: "REMOVE_TENTATIVE", SaveXid: "SAVE_XID",
    Unremove: "UNREMOVE", ConfirmRemove: "CONFIRM_REMOVE", AddXid: "ADD_XID", StateDump: "STATE_DUMP",
    Continue: "CONTINUE", RemoveTentativeXid: "REMOVE_TENTATIVE_XID",
}

REMOVE_BYTES: Final = bytes([REMOVE])


class Incomplete(Exception):
    """The buffer ends inside a record: more bytes are needed (or the tail is torn)."""


class Malformed(Exception):
    """A record that can never be valid, whatever follows it."""

    def __init__(self, opcode: int | None, reason: str) -> None:
        super().__init__(reason)
        self.opcode = opcode
        self.reason = reason


def encode_addx(add_time: int, expiry: int, data: bytes) -> bytes:
    return b"\x02" + _ADDX_HEAD.pack(ITEM_HEADER + len(data), add_time, expiry) + data


def addx_parts(add_time: int, expiry: int, items: list[bytes]) -> list[bytes]:
    """The ADDX records of items added together (one time and expiry) as the pieces a gathering
    write takes: each record's header, then the item itself, not a copy of it. Joined, the same
    bytes as `encode_addx` of each; each distinct header is packed once."""
    if len(items) == 1:  # the usual large put: one header
        return [_ADDX_RECORD_HEAD.pack(ADDX, ITEM_HEADER + len(items[0]), add_time, expiry), items[0]]
    times = _TWO_I64.pack(add_time, expiry)
    sizes = list(map(len, items))
    if sizes and min(sizes) == max(sizes):  # the usual batch: one header for all
        heads = [b"\x02" + _I32.pack(ITEM_HEADER + sizes[0]) + times] * len(items)
    else:
        known: dict[int, bytes] = {}
        heads = [known.get(n) or known.setdefault(n, b"\x02" + _I32.pack(ITEM_HEADER + n) + times)
                 for n in sizes]
    parts = items * 2
    parts[::2] = heads
    parts[1::2] = items
    return parts


def encode_addx_many_python(add_time: int, expiry: int, items: list[bytes]) -> bytes:
    """The ADDX records of items added together, as one string (the reference for the compiled
    `encode_addx_many`)."""
    return b"".join(addx_parts(add_time, expiry, items))


def encode_xid(opcode: int, xid: int) -> bytes:
    return _XID_RECORD.pack(opcode, xid)


def encode_xids(opcode: int, xids: list[int]) -> bytes:
    """The records of `opcode` (REMOVE_TENTATIVE_XID, CONFIRM_REMOVE, UNREMOVE) for each xid in turn,
    as one string: a run of them laid out in a few whole-buffer steps (the xids packed at once, then
    each byte column placed beside the opcodes) rather than a pack per record."""
    count = len(xids)
    if count < XIDS_LAID_OUT:
        return b"".join([_XID_RECORD.pack(opcode, xid) for xid in xids])
    packed = struct.pack(f"<{count}i", *xids)
    records = bytearray(XID_RECORD_SIZE * count)
    records[0::XID_RECORD_SIZE] = bytes((opcode,)) * count
    for column in range(4):
        records[column + 1::XID_RECORD_SIZE] = packed[column::4]
    return bytes(records)


def encode(record: Record) -> bytes:
    """The bytes of one record, exactly as Kestrel writes them."""
    match record:
        case AddX(add_time, expiry, data):
            return encode_addx(add_time, expiry, data)
        case Remove():
            return REMOVE_BYTES
        case RemoveTentative():
            return bytes([REMOVE_TENTATIVE])
        case SaveXid(xid):
            return encode_xid(SAVE_XID, xid)
        case Unremove(xid):
            return encode_xid(UNREMOVE, xid)
        case ConfirmRemove(xid):
            return encode_xid(CONFIRM_REMOVE, xid)
        case AddXid(xid, add_time, expiry, data):
            return b"\x07" + _XID_ADDX_HEAD.pack(xid, ITEM_HEADER + len(data), add_time, expiry) + data
        case Add(expiry_s, data):
            return b"\x00" + _ADD_HEAD.pack(4 + len(data), expiry_s) + data
        case StateDump(xid, count):
            return b"\x08" + _TWO_I32.pack(xid, count)
        case Continue(xid, add_time, expiry, data):
            return b"\x08" + _XID_ADDX_HEAD.pack(xid, ITEM_HEADER + len(data), add_time, expiry) + data
        case RemoveTentativeXid(xid):
            return encode_xid(REMOVE_TENTATIVE_XID, xid)
    raise TypeError(f"not a journal record: {record!r}")


def decode(buf: bytes | memoryview, pos: int, at_eof: bool) -> tuple[Record, int]:
    """Decode the record starting at `pos`; return it and the position after it.

    Raises Incomplete when `buf` ends inside the record, Malformed when the bytes cannot be a
    record. `at_eof` says that nothing follows `buf`, which opcode 8 needs to look ahead.
    """
    stop, data = record_span(buf, pos, at_eof)
    op = buf[pos]
    if op == ADDX:
        add_time, expiry = _TWO_I64.unpack_from(buf, pos + 5)
        return AddX(add_time, expiry, bytes(buf[data:stop])), stop
    if op == REMOVE:
        return Remove(), stop
    if op == REMOVE_TENTATIVE:
        return RemoveTentative(), stop
    if op == ADD_XID:
        xid, _, add_time, expiry = _XID_ADDX_HEAD.unpack_from(buf, pos + 1)
        return AddXid(xid, add_time, expiry, bytes(buf[data:stop])), stop
    if op == 8:
        xid, second = _TWO_I32.unpack_from(buf, pos + 1)
        if stop == pos + 9:
            return StateDump(xid, second), stop
        add_time, expiry = _TWO_I64.unpack_from(buf, pos + 9)
        return Continue(xid, add_time, expiry, bytes(buf[data:stop])), stop
    if op == ADD:
        (expiry_s,) = _I32.unpack_from(buf, pos + 5)
        return Add(expiry_s, bytes(buf[data:stop])), stop
    (xid,) = _I32.unpack_from(buf, pos + 1)
    return _XID_RECORDS[op](xid), stop


def record_span(buf: bytes | memoryview, pos: int, at_eof: bool) -> tuple[int, int]:
    """Where the record starting at `pos` ends and where its item data starts (its end if it has
    none), read as `decode` reads it but copying nothing; raises as `decode` does."""
    end = len(buf)
    if pos >= end:
        raise Incomplete
    op = buf[pos]
    p = pos + 1
    if op in _ITEM_OPCODES:
        return _item_span(buf, pos)
    if op in (REMOVE, REMOVE_TENTATIVE):
        return p, p
    if op in _XID_RECORDS:
        if p + 4 > end:
            raise Incomplete
        return p + 4, p + 4
    if op == 8:
        return _opcode_8_span(buf, pos, at_eof)
    raise Malformed(op, f"unknown opcode {op}")


_XID_RECORDS: dict[int, type[SaveXid] | type[Unremove] | type[ConfirmRemove] | type[RemoveTentativeXid]] = {
    SAVE_XID: SaveXid,
    UNREMOVE: Unremove,
    CONFIRM_REMOVE: ConfirmRemove,
    REMOVE_TENTATIVE_XID: RemoveTentativeXid,
}


def _item_span(buf: bytes | memoryview, pos: int) -> tuple[int, int]:
    """`record_span` of the ADD, ADDX or ADD_XID at `pos`, by `item_extent`."""
    extent = item_extent(buf, pos)
    if extent is None:
        raise Incomplete
    start, stop = extent
    if stop < start:
        op = buf[pos]
        size = stop - start + _SIZE_FIELD[op][1]
        raise Malformed(op, f"ADD block of {size} bytes is shorter than its 4-byte expiry" if op == ADD
                        else f"item block of {size} bytes is shorter than its 16-byte header")
    if pos + stop > len(buf):
        raise Incomplete
    return pos + stop, pos + start


def _opcode_8_span(buf: bytes | memoryview, pos: int, at_eof: bool) -> tuple[int, int]:
    """STATE_DUMP (xid, count, then `count` ADD_XID records) or CONTINUE (xid, item block).

    A STATE_DUMP is taken when its count is 0 or the next `count` records all decode as ADD_XID:
    it ends after its count (its data start and end are the same). Otherwise it is a CONTINUE if its
    block is a plausible item block followed by the end of the file or a known opcode. If neither
    reading fits, the record is malformed.
    """
    p = pos + 1
    end = len(buf)
    if p + 8 > end:
        raise Incomplete
    xid, second = _TWO_I32.unpack_from(buf, p)
    after = p + 8
    if second == 0 or (second > 0 and _add_xids_follow(buf, after, second, at_eof)):
        return after, after
    if second >= ITEM_HEADER:
        extent = item_extent(buf, pos)  # read as a CONTINUE
        if extent is None or pos + extent[1] > end or (pos + extent[1] == end and not at_eof):
            raise Incomplete
        stop = pos + extent[1]
        if stop == end or buf[stop] <= MAX_OPCODE:
            return stop, pos + extent[0]
    raise Malformed(8, f"opcode 8 with xid {xid} and {second} is neither a STATE_DUMP nor a CONTINUE")


def _add_xids_follow(buf: bytes | memoryview, p: int, count: int, at_eof: bool) -> bool:
    """Whether `count` well-formed ADD_XID records start at `p` (a STATE_DUMP's tail).

    Raises Incomplete when the buffer ends before that can be told and more bytes may come.
    """
    for _ in range(count):
        if p >= len(buf):
            if at_eof:
                return False
            raise Incomplete
        if buf[p] != ADD_XID:
            return False
        try:
            p = _item_span(buf, p)[0]
        except Malformed:
            return False
        except Incomplete:
            if at_eof:
                return False
            raise
    return True


# The records `decode_common` reads, as (opcode, offset, xid, add time, expiry, data); fields a
# record does not have are 0 (and data b"").
Common = tuple[int, int, int, int, int, bytes]
_NO_DATA = b""


def decode_common_python(buf: bytes, pos: int, base: int, budget: int,
                         check_sizes: bool) -> tuple[list[Common], int, int]:
    """Decode the run of common records (ADDX, ADD_XID, REMOVE, CONFIRM_REMOVE,
    REMOVE_TENTATIVE_XID) that starts at `pos`, as plain tuples: replay's fast path.

    The run stops before any other record, before a record that is not whole in `buf`, before one
    that `decode` or the reader's damage checks would question (a REMOVE not followed by an opcode,
    a size too small, with `check_sizes` a size that `misplaced_end` finds one bit off), and before
    an add whose data would bring the run's total to `budget` bytes: the general path takes over
    there, so every check keeps its full form. Offsets are `base + ` the position in `buf`.
    Returns the run, the position after it, and the position of its last record if that has a
    size field (else -1).
    """
    run: list[Common] = []
    end = len(buf)
    previous = -1
    total = 0
    while pos < end:
        op = buf[pos]
        if op in (ADDX, ADD_XID):
            if op == ADDX:
                head = pos + 21
                if head > end:
                    break
                size, add_time, expiry = _ADDX_HEAD.unpack_from(buf, pos + 1)
                xid = 0
            else:
                head = pos + 25
                if head > end:
                    break
                xid, size, add_time, expiry = _XID_ADDX_HEAD.unpack_from(buf, pos + 1)
            stop = head + size - ITEM_HEADER
            total += stop - head
            if size < ITEM_HEADER or stop > end or total >= budget:
                break
            if check_sizes and _may_be_misplaced(buf, head, stop, size) \
                    and misplaced_end(buf, pos, stop) is not None:
                break
            run.append((op, base + pos, xid, add_time, expiry, buf[head:stop]))
            previous = pos
            pos = stop
        elif op == REMOVE:
            if pos + 1 >= end or buf[pos + 1] > MAX_OPCODE:
                break
            run.append((op, base + pos, 0, 0, 0, _NO_DATA))
            previous = -1
            pos += 1
        elif op in (CONFIRM_REMOVE, REMOVE_TENTATIVE_XID):
            if pos + 5 > end:
                break
            run.append((op, base + pos, _I32.unpack_from(buf, pos + 1)[0], 0, 0, _NO_DATA))
            previous = -1
            pos += 5
        else:
            break
    return run, pos, previous


# `decode_common_columns`: the run's fields as native little-endian buffers in Arrow's layout: the
# record count, then opcodes (int8), offsets (int64), xids (int32), add times and expiries (int64
# ms), data ends (int32, count + 1 of them from 0) and the data concatenated.
CommonColumns = tuple[int, bytes, bytes, bytes, bytes, bytes, bytes, bytes]


def decode_common_columns_python(buf: bytes, pos: int, base: int, budget: int,
                                 check_sizes: bool) -> tuple[CommonColumns, int, int]:
    """`decode_common_python`'s run as column buffers (the reference for the compiled one)."""
    run, pos, previous = decode_common_python(buf, pos, base, budget, check_sizes)
    ops, offsets, xids, added, expiry, data = zip(*run, strict=True) if run else ((),) * 6
    ends = array("i", [0])
    for item in data:
        ends.append(ends[-1] + len(item))
    columns = (len(run), array("b", ops).tobytes(), array("q", offsets).tobytes(),
               array("i", xids).tobytes(), array("q", added).tobytes(), array("q", expiry).tobytes(),
               ends.tobytes(), b"".join(data))
    return columns, pos, previous


_c_encode_addx_many: Callable[[int, int, list[bytes]], bytes | None] | None
try:
    from kestrel.storage.kestrel2 import _codec
except ImportError:  # built without a C compiler: the Python loops alone
    decode_common = decode_common_python
    decode_common_columns = decode_common_columns_python
    _c_encode_addx_many = None
else:
    _c_encode_addx_many = _codec.encode_addx_many

    def decode_common(buf: bytes, pos: int, base: int, budget: int,
                      check_sizes: bool) -> tuple[list[Common], int, int]:
        """`decode_common_python` compiled (src/kestrel/storage/kestrel2/_codec.c): the same tuples, several
        times faster; the records it questions go to `misplaced_end` as in Python."""
        return _codec.decode_common(buf, pos, base, budget, check_sizes, misplaced_end)

    def decode_common_columns(buf: bytes, pos: int, base: int, budget: int,
                              check_sizes: bool) -> tuple[CommonColumns, int, int]:
        """`decode_common_columns_python` compiled: no Python object per record."""
        return _codec.decode_common_columns(buf, pos, base, budget, check_sizes, misplaced_end)


# (bound `Final`: the compiled build reads it from a C static, not from the module's dictionary)
_encode_addx_many_c: Final = _c_encode_addx_many


def encode_addx_many(add_time: int, expiry: int, items: list[bytes]) -> bytes:
    """`encode_addx_many_python` compiled (src/kestrel/storage/kestrel2/_codec.c) for lists of bytes
    where the build has the helper; anything else goes to the Python function, which encodes it or
    says what is wrong. Defined once whatever the build, so that the compiled queue calls it as a
    compiled function (its ints unboxed), not through a Python object chosen at import."""
    encoded = None if _encode_addx_many_c is None else _encode_addx_many_c(add_time, expiry, items)
    return encode_addx_many_python(add_time, expiry, items) if encoded is None else encoded


def _may_be_misplaced(buf: bytes, head: int, stop: int, size: int) -> bool:
    """Whether a one-bit smaller `size` would end the item record whose data is `buf[head:stop]`
    on an opcode byte: `misplaced_end` can find damage only then (the usual answer is no). The
    caller has checked `size` is at least an item header: a negative int never runs out of set bits.
    Runs for every item record replay reads, so it walks the set bits alone."""
    rest = size
    while rest:
        bit = rest & -rest
        rest ^= bit
        if stop - bit >= head and buf[stop - bit] <= MAX_OPCODE:
            return True
    return False


# Records with a size field: the ones whose size can be damaged into a wrong but readable one.
SIZED_RECORDS = (Add, AddX, AddXid, Continue)
# Where each sized record keeps its size field (counted from its opcode byte), and its least size
# (the bytes of its block before the item): opcode 8 as a CONTINUE, a STATE_DUMP's second field
# being its count.
_SIZE_FIELD = {ADD: (1, 4), ADDX: (1, ITEM_HEADER), ADD_XID: (5, ITEM_HEADER), 8: (5, ITEM_HEADER)}


def misplaced_end(buf: bytes | memoryview, pos: int, limit: int, grow: bool = False,
                  fills: Callable[[int], bool] | None = None) -> int | None:
    """Where the record at `pos` really ends if its size field has one bit flipped, else None.

    The format has no checksums; this is the one damage it lets us see. A record whose size is one
    bit too large swallows the records after it (or runs past the end of the file); if a one-bit
    smaller size leaves records that read as whole journal records up to `limit` (the record's
    claimed end, or the end of the file), the size is taken as damaged. With `grow`, one-bit larger
    sizes are tried too (a record that ended too early, so that what follows it is unreadable).
    Item data would need whole item records at that exact place to be mistaken for this. `fills`
    answers `_records_fill` to `limit` where the caller keeps those answers (the torn-tail rule's
    chains).
    """
    field = _SIZE_FIELD.get(buf[pos]) if pos < len(buf) else None
    if field is None or pos + field[0] + 4 > len(buf):
        return None
    at, least = field
    size: int = _U32.unpack_from(buf, pos + at)[0]
    start = pos + at + 4
    sizes = [size ^ (1 << b) for b in range(32) if size & (1 << b)]
    if grow:
        sizes.extend(size | (1 << b) for b in range(31) if not size & (1 << b))
    for real in sizes:
        end = start + real
        if real >= least and end < limit and buf[end] <= MAX_OPCODE \
                and (fills(end) if fills is not None else _records_fill(buf, end, limit)):
            return end
    return None


def item_extent(buf: bytes | memoryview, pos: int) -> tuple[int, int] | None:
    """Where the item of the record at `pos` starts and where the record ends, counted from `pos`,
    read from its header alone: the one rule of an item record's extent, which `record_span`
    follows and by which a reader reads a large item at once (`item_record`). None unless the
    record is an ADD, ADDX, ADD_XID or opcode 8 (read as a CONTINUE) whose header `buf` holds
    whole. A size too small for the header ends the record before its item starts: `record_span`
    refuses it."""
    field = _SIZE_FIELD.get(buf[pos]) if pos < len(buf) else None
    if field is None:
        return None
    at, least = field
    start = at + 4 + least
    if pos + start > len(buf):
        return None
    size: int = _I32.unpack_from(buf, pos + at)[0]
    return start, at + 4 + size


def item_record(head: bytes | memoryview, data: bytes) -> Add | AddX | AddXid:
    """The ADD, ADDX or ADD_XID whose bytes before its item are `head` (an `item_extent` start's
    worth), holding `data` as its item, as it is (not copied)."""
    op = head[0]
    if op == ADDX:
        _, add_time, expiry = _ADDX_HEAD.unpack_from(head, 1)
        return AddX(add_time, expiry, data)
    if op == ADD_XID:
        xid, _, add_time, expiry = _XID_ADDX_HEAD.unpack_from(head, 1)
        return AddXid(xid, add_time, expiry, data)
    _, expiry_s = _ADD_HEAD.unpack_from(head, 1)
    return Add(expiry_s, data)


def resyncs_between(chains: Chains, start: int, stop: int) -> bool:
    """Whether whole records (as `misplaced_end` means them) start anywhere in `chains.tail[start:stop]`:
    then stray bytes explain what follows as well as a damaged size field does. Each place's chain
    is read once (read again from every place, crafted bytes took minutes)."""
    tail, whole = chains.tail, chains.whole_records_at
    return any(tail[p] <= MAX_OPCODE and whole(p) for p in range(start, min(stop, chains.end)))


def _records_fill(buf: bytes | memoryview, pos: int, limit: int) -> bool:
    """Whether whole records start at `pos`: reaching `limit` with an item record among them, or
    at least two item records before the bytes stop making sense."""
    return _records_reach(memoryview(buf)[:limit], pos, limit)


def _records_reach(view: memoryview, pos: int, end: int) -> bool:
    """`_records_fill` over what `view` holds, a last record free to run past `end` within it."""
    items = 0
    while pos < end:
        try:
            record, pos = decode(view, pos, True)
        except (Incomplete, Malformed):
            return items >= 2
        items += isinstance(record, AddX | AddXid | Add)
    return items >= 1


class TailRecords:
    """How Kestrel 2 records read, for the one torn-tail rule (src/kestrel/storage/torn_tail.py):
    item records count, as `_records_fill` counts them."""

    evidence_at_end = 1
    evidence_before_nonsense = 2

    def starts(self, data: bytes) -> re.Pattern[bytes]:
        return _OPCODE_BYTES

    def body_start(self, data: bytes, at: int) -> int:
        field = _SIZE_FIELD.get(data[at]) if at < len(data) else None
        return at + (field[0] + 4 if field is not None else 1)

    def record_at(self, data: bytes, pos: int) -> tuple[int, int] | None:
        try:
            stop = record_span(data, pos, True)[0]
        except (Incomplete, Malformed):
            return None
        return stop, 1 if data[pos] in _ITEM_OPCODES else 0

    def explain(self, data: bytes, at: int, end: int, offset: int, chains: Chains) -> str | None:
        real_end = misplaced_end(data, at, len(data), fills=chains.whole_records_at)
        return None if real_end is None else size_damage(offset, offset + real_end - at)


_OPCODE_BYTES: Final = any_of(bytes(range(MAX_OPCODE + 1)))  # the bytes a record can begin with
TAIL_RECORDS = TailRecords()


def size_damage(offset: int, real_end: int) -> str:
    return (f"the size field of the record at offset {offset} looks damaged: with one bit changed it "
            f"would end at offset {real_end}, where whole records follow")


def describe(records: list[Record]) -> str:
    """A journal as a readable line, e.g. `addx(5:0:hello), remove-tentative, confirm(1)`."""
    out = []
    for r in records:
        match r:
            case AddX(_, expiry, data):
                out.append(f"addx({len(data)}:{expiry}:{data.decode('utf-8', 'replace')})")
            case Continue(xid, _, expiry, data):
                out.append(f"continue({xid}:{len(data)}:{expiry}:{data.decode('utf-8', 'replace')})")
            case AddXid(xid, _, expiry, data):
                out.append(f"add-xid({xid}:{len(data)}:{expiry}:{data.decode('utf-8', 'replace')})")
            case Add(expiry_s, data):
                out.append(f"add({len(data)}:{expiry_s}:{data.decode('utf-8', 'replace')})")
            case Remove():
                out.append("remove")
            case RemoveTentative():
                out.append("remove-tentative")
            case RemoveTentativeXid(xid):
                out.append(f"remove-tentative({xid})")
            case SaveXid(xid):
                out.append(f"save-xid({xid})")
            case Unremove(xid):
                out.append(f"unremove({xid})")
            case ConfirmRemove(xid):
                out.append(f"confirm({xid})")
            case StateDump(xid, count):
                out.append(f"state-dump({xid}:{count})")
    return ", ".join(out)
