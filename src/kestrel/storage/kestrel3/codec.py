"""Kestrel 3 journal records: the only code that knows their byte layout.

A file is a 4-byte header naming its kind (writer journal or reader checkpoint), then records. A
record is a command byte — the command in the high nibble, the number of 32-bit header words in the
low nibble — then those header words, little-endian, then for commands 8 to 15 a data block whose
byte count is the first header word. One dataclass per command, pure encode/decode, no I/O; runs of
PUTs read as rows (`decode_puts`, with its compiled twin `_codec.c`).

READ_DONE's first header word counts data bytes (8 per id): that is the rule for every command with
a data block, and what Kestrel 3 writes; the format document's field name "count" could also be
read as a count of ids.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Final

from kestrel.storage.kestrel2.codec import Incomplete, Malformed
from kestrel.storage.torn_tail import Chains, any_of

# `Final` throughout: the compiled build reads a final name directly, any other module-level name by
# a lookup in the module's dictionary, several for every record read.
WRITER_MAGIC: Final = bytes.fromhex("27642603")
READER_MAGIC: Final = bytes.fromhex("263C2603")
MAGIC_SIZE: Final = 4

READ_HEAD: Final = 0
PUT: Final = 8
READ_DONE: Final = 9

COMMAND_NAMES: Final = {READ_HEAD: "READ_HEAD", PUT: "PUT", READ_DONE: "READ_DONE"}

# Data sizes are i32 and ids u64 (non-zero for items).
MAX_DATA: Final = 2**31 - 1
MAX_ID: Final = 2**64 - 1

_I32: Final = struct.Struct("<i")
_U64: Final = struct.Struct("<Q")
_PUT_HEAD: Final = struct.Struct("<iiQq")  # data size, error count, id, add time
_I64: Final = struct.Struct("<q")


class FileKind(Enum):
    """Which of the two file kinds a header announces; the value is the header itself."""

    WRITER = WRITER_MAGIC
    READER = READER_MAGIC

    @property
    def title(self) -> str:
        return "writer journal" if self is FileKind.WRITER else "reader checkpoint"


def kind_of(header: bytes) -> FileKind | None:
    """The kind of file whose first four bytes are `header`, or None for anything else."""
    for kind in FileKind:
        if header == kind.value:
            return kind
    return None


# A record is made for every item put, read back or loaded: each class has its own `__init__` and
# `Final` fields, not `frozen=True` (docs/architecture.md, "The compiled build").
@dataclass(init=False, slots=True)
class Put:
    """An item added to the queue (writer files only). Times are ms since the epoch."""

    id: Final[int]
    error_count: Final[int]
    add_time: Final[int]
    expire_time: Final[int | None]
    data: Final[bytes]

    def __init__(self, id: int, error_count: int, add_time: int, expire_time: int | None,
                 data: bytes) -> None:
        self.id = id
        self.error_count = error_count
        self.add_time = add_time
        self.expire_time = expire_time
        self.data = data


@dataclass(init=False, slots=True)
class ReadHead:
    """A reader's head: the id of the last item it consumed (0 = nothing consumed yet)."""

    id: Final[int]

    def __init__(self, id: int) -> None:
        self.id = id


@dataclass(init=False, slots=True)
class ReadDone:
    """Ids above the head that the reader confirmed out of order."""

    ids: Final[tuple[int, ...]]

    def __init__(self, ids: tuple[int, ...]) -> None:
        self.ids = ids


Record = Put | ReadHead | ReadDone

# The commands each kind of file may hold, and the header words each command takes.
_WRITER_COMMANDS: Final = (PUT,)
_READER_COMMANDS: Final = (READ_HEAD, READ_DONE)
_HEADER_WORDS: Final = {PUT: (6, 8), READ_HEAD: (2,), READ_DONE: (1,)}


def unfinished_header(header: bytes) -> bool:
    """Whether a file's first bytes, shorter than a header, begin a writer journal's: a file created
    whose header never reached the disk (`files.header_unwritten`)."""
    return len(header) < MAGIC_SIZE and WRITER_MAGIC.startswith(header)


def allowed_commands(kind: FileKind) -> tuple[int, ...]:
    """The commands a file of `kind` may hold (told by identity: an Enum's hash runs interpreted)."""
    return _WRITER_COMMANDS if kind is FileKind.WRITER else _READER_COMMANDS


def command_byte(command: int, header_words: int) -> int:
    return command << 4 | header_words


def encode(record: Record) -> bytes:
    """The bytes of one record, exactly as the format lays them out.

    Raises ValueError for values the format cannot hold (id 0 or over 64 bits, negative counts).
    """
    match record:
        case Put(item_id, errors, add_time, expire_time, data):
            _check_id(item_id, "PUT")
            if not 0 <= errors <= MAX_DATA:
                raise ValueError(f"error count {errors!r} is not a non-negative 32-bit number")
            if len(data) > MAX_DATA:
                raise ValueError(f"item of {len(data)} bytes is larger than {MAX_DATA} bytes")
            head = _PUT_HEAD.pack(len(data), errors, item_id, add_time)
            if expire_time is None:
                return bytes([command_byte(PUT, 6)]) + head + data
            return bytes([command_byte(PUT, 8)]) + head + _I64.pack(expire_time) + data
        case ReadHead(item_id):
            if not 0 <= item_id <= MAX_ID:
                raise ValueError(f"head id {item_id!r} is not a 64-bit number")
            return bytes([command_byte(READ_HEAD, 2)]) + _U64.pack(item_id)
        case ReadDone(ids):
            for item_id in ids:
                _check_id(item_id, "READ_DONE")
            return (bytes([command_byte(READ_DONE, 1)]) + _I32.pack(8 * len(ids))
                    + struct.pack(f"<{len(ids)}Q", *ids))
    raise TypeError(f"not a Kestrel 3 record: {record!r}")


def _check_id(item_id: int, where: str) -> None:
    if not 0 < item_id <= MAX_ID:
        raise ValueError(f"{where} id {item_id!r} is not a non-zero 64-bit number")


def record_length(buf: bytes | memoryview, pos: int, kind: FileKind) -> int:
    """The full length of the record starting at `pos`, read from its command byte and header.

    Needs only the command byte and first header word, so a reader can check the length against
    what the file still holds before it reads (or allocates) the rest. Raises Incomplete when even
    those are not in `buf`, Malformed when the command cannot start a record in this kind of file.
    """
    if pos >= len(buf):
        raise Incomplete
    byte = buf[pos]
    command, words = byte >> 4, byte & 0x0F
    if command not in COMMAND_NAMES:
        raise Malformed(byte, f"unknown command {command} (command byte 0x{byte:02x})")
    name = COMMAND_NAMES[command]
    if command not in allowed_commands(kind):
        raise Malformed(byte, f"{name} (command byte 0x{byte:02x}) does not belong in a {kind.title}")
    if words not in _HEADER_WORDS[command]:
        expected = " or ".join(str(n) for n in _HEADER_WORDS[command])
        raise Malformed(byte, f"{name} takes {expected} header words, not {words} "
                              f"(command byte 0x{byte:02x})")
    length = _head_length(byte)
    if command < 8:
        return length
    if pos + 5 > len(buf):
        raise Incomplete
    size: int
    (size,) = _I32.unpack_from(buf, pos + 1)
    if size < 0:
        raise Malformed(byte, f"{name} has a negative data size {size}")
    if command == READ_DONE and size % 8:
        raise Malformed(byte, f"READ_DONE data of {size} bytes is not a whole number of 8-byte ids")
    return length + size


def decode(buf: bytes | memoryview, pos: int, kind: FileKind) -> tuple[Record, int]:
    """Decode the record starting at `pos` in a file of `kind`; return it and the position after it.

    Raises Incomplete when `buf` ends inside the record, Malformed when the bytes cannot be one.
    """
    return decode_measured(buf, pos, _whole_record(buf, pos, kind))


def decode_measured(buf: bytes | memoryview, pos: int, stop: int) -> tuple[Record, int]:
    """`decode` of a record already measured by `record_length` and whole in `buf` up to `stop`.

    Raises Malformed for an id 0 or a negative error count.
    """
    command = buf[pos] >> 4
    if command == PUT:
        item_id, errors, add_time, expire_time = put_fields(buf, pos)
        data = bytes(buf[pos + _head_length(buf[pos]):stop])
        return Put(item_id, errors, add_time, expire_time, data), stop
    if command == READ_HEAD:
        return ReadHead(_U64.unpack_from(buf, pos + 1)[0]), stop
    return ReadDone(_done_ids(buf, pos, stop)), stop


def record_end(buf: bytes | memoryview, pos: int, kind: FileKind) -> int:
    """Where the record starting at `pos` ends, checked as `decode` checks it but copying no PUT
    data; raises as `decode` does."""
    stop = _whole_record(buf, pos, kind)
    command = buf[pos] >> 4
    if command == PUT:
        put_fields(buf, pos)
    elif command == READ_DONE:
        _done_ids(buf, pos, stop)
    return stop


def _whole_record(buf: bytes | memoryview, pos: int, kind: FileKind) -> int:
    """Where the record at `pos` ends, if `buf` holds it whole (else Incomplete)."""
    stop = pos + record_length(buf, pos, kind)
    if stop > len(buf):
        raise Incomplete
    return stop


PutFields = tuple[int, int, int, int | None]  # id, error count, add time, expiry: `Put(*fields, data)`


def put_fields(buf: bytes | memoryview, pos: int) -> PutFields:
    """The fields of the PUT whose header `buf` holds whole at `pos` (`item_start` bytes), checked;
    raises Malformed for an id 0 or a negative error count."""
    byte = buf[pos]
    _, errors, item_id, add_time = _PUT_HEAD.unpack_from(buf, pos + 1)
    if item_id == 0:
        raise Malformed(byte, "PUT of item id 0 (item ids are non-zero)")
    if errors < 0:
        raise Malformed(byte, f"PUT of item {item_id} has a negative error count {errors}")
    expire_time: int | None = _I64.unpack_from(buf, pos + 25)[0] if byte & 0x0F == 8 else None
    return item_id, errors, add_time, expire_time


# A PUT as `decode_puts` reads it: id, error count, add time, expiry (None: none), item.
PutRow = tuple[int, int, int, int | None, bytes]
_PUT_BYTES: Final = (command_byte(PUT, 6), command_byte(PUT, 8))


def decode_puts_python(buf: bytes, pos: int) -> tuple[list[PutRow], int]:
    """The run of PUT records that starts at `pos`, as rows: a reader's fast path through a writer
    journal (start-up reads every item of every reader that way).

    The run stops before a record that is not whole in `buf` and before anything `decode` would
    question or refuse (another command, a negative size, id 0, a negative error count): the
    record-by-record path takes over there, so every check keeps its one form. Returns the run and
    the position after it. The compiled twin is `_codec.decode_puts`.
    """
    if pos < 0:
        raise ValueError(f"negative position {pos}")
    run: list[PutRow] = []
    end = len(buf)
    while pos < end:
        byte = buf[pos]
        start = pos + _head_length(byte)
        if byte not in _PUT_BYTES or start > end:
            break
        size, errors, item_id, add_time = _PUT_HEAD.unpack_from(buf, pos + 1)
        if size < 0 or start + size > end or item_id == 0 or errors < 0:
            break
        expire_time: int | None = _I64.unpack_from(buf, pos + 25)[0] if byte & 0x0F == 8 else None
        run.append((item_id, errors, add_time, expire_time, buf[start:start + size]))
        pos = start + size
    return run, pos


def row_length(row: PutRow) -> int:
    """The bytes of the PUT record `row` was read from."""
    return _head_length(_PUT_BYTES[row[3] is not None]) + len(row[4])


def item_start(buf: bytes | memoryview, pos: int) -> int | None:
    """Where the item of the record at `pos` starts, counted from `pos` (its end is
    `record_length`), read from its command byte alone: a reader reads a large item on its own
    from there (`put_fields`). None unless the record is a PUT."""
    byte = buf[pos]
    return _head_length(byte) if byte >> 4 == PUT else None


def _head_length(byte: int) -> int:
    """The bytes before a record's data block: its command byte and header words."""
    return 1 + 4 * (byte & 0x0F)


def _done_ids(buf: bytes | memoryview, pos: int, stop: int) -> tuple[int, ...]:
    """The ids of the READ_DONE at `pos` (ending at `stop`), read once; raises Malformed for id 0."""
    ids: tuple[int, ...] = struct.unpack_from(f"<{(stop - pos - 5) // 8}Q", buf, pos + 5)
    if 0 in ids:
        raise Malformed(buf[pos], "READ_DONE lists item id 0 (item ids are non-zero)")
    return ids


class TailRecords:
    """How the records of one kind of Kestrel 3 file read, for the one torn-tail rule
    (src/kestrel/storage/torn_tail.py)."""

    evidence_before_nonsense = 2

    def __init__(self, kind: FileKind) -> None:
        self.kind = kind
        self._starts = any_of(bytes(command_byte(command, words) for command in allowed_commands(kind)
                                    for words in _HEADER_WORDS[command]))
        # A checkpoint's ids are small numbers whose bytes often read as a READ_HEAD: there, two
        # whole records are asked for even at the end.
        self.evidence_at_end = 1 if kind is FileKind.WRITER else 2

    def starts(self, data: bytes) -> re.Pattern[bytes]:
        return self._starts

    def body_start(self, data: bytes, at: int) -> int:
        return at + 5  # the command byte and the first header word (a data block's size)

    def record_at(self, data: bytes, pos: int) -> tuple[int, int] | None:
        try:
            return record_end(data, pos, self.kind), 1
        except (Incomplete, Malformed):
            return None

    def explain(self, data: bytes, at: int, end: int, offset: int, chains: Chains) -> str | None:
        return None


def describe(record: Record) -> str:
    """One record as a readable line, e.g. `put(id=5 errors=0 add=1700000000000 expire=- 2:hi)`."""
    match record:
        case Put(item_id, errors, add_time, expire_time, data):
            expire = "-" if expire_time is None else str(expire_time)
            return (f"put(id={item_id} errors={errors} add={add_time} expire={expire} "
                    f"{len(data)}:{data.decode('utf-8', 'replace')})")
        case ReadHead(item_id):
            return f"read-head({item_id})"
        case ReadDone(ids):
            return f"read-done({','.join(str(i) for i in ids)})"
    raise TypeError(f"not a Kestrel 3 record: {record!r}")


_decode_puts_c: Callable[[bytes, int], tuple[list[PutRow], int]] | None
try:
    from kestrel.storage.kestrel3._codec import decode_puts as _decode_puts_c
except ImportError:  # built without a C compiler: the Python loop alone
    _decode_puts_c = None
_DECODE_PUTS_C: Final = _decode_puts_c


def decode_puts(buf: bytes, pos: int) -> tuple[list[PutRow], int]:
    """`decode_puts_python`, compiled where the build had a C compiler
    (src/kestrel/storage/kestrel3/_codec.c): the same rows, without an object per field read."""
    return decode_puts_python(buf, pos) if _DECODE_PUTS_C is None else _DECODE_PUTS_C(buf, pos)
