"""Thrift's binary and compact protocols, read with every length and count checked before use.

A reader works on one message in a buffer: `end` is how far the buffer holds data, `limit` how far
the message may reach (the frame's end, or `max_frame_size` bytes on for unframed transport). Every
length and count is checked against `limit` (each element needs at least its smallest encoding)
and against the batch limits before anything is read or allocated; when a read goes past `end` but
not past `limit`, `more` (unframed transport only) reads on from the socket. Writers build replies.
No I/O here. The binary protocol's hot paths are compiled (src/kestrel/service/thrift/_binary.c,
`compiled_binary`): here a batch put's list; a whole call and a reply in
src/kestrel/service/thrift/messages.py. It takes the plain case and hands everything else back to the
Python code here, which stays the reference (docs/protocols.md: which parser runs where).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any, ClassVar, Final

try:
    from kestrel.service.thrift import _binary as _thrift_binary
except ImportError:  # built without a C compiler: the Python code alone
    _thrift_binary = None  # type: ignore[assignment]
compiled_binary = _thrift_binary  # what src/kestrel/service/thrift/messages.py uses too

# Type codes as the binary protocol writes them, and message types (`Final`: constants in the
# compiled build, where a module's name is a lookup in its dictionary at each use).
STOP: Final = 0
BOOL: Final = 2
BYTE: Final = 3
DOUBLE: Final = 4
I16: Final = 6
I32: Final = 8
I64: Final = 10
STRING: Final = 11
STRUCT: Final = 12
MAP: Final = 13
SET: Final = 14
LIST: Final = 15
UUID: Final = 16
CALL: Final = 1
REPLY: Final = 2
EXCEPTION: Final = 3
MAX_DEPTH = 32  # nesting of skipped structs and containers
# Fields in one message, nested ones included: a call of the contract has four at most. Each field,
# as each container element (`max_batch_items` for the whole message), costs the loop a step of
# Python that no other client is served during, whether it is read or skipped.
MAX_FIELDS = 1024
# Values read or skipped one at a time between two looks at the connection's turn: the largest message
# the limits let through (100,000 elements) is tens of milliseconds of Python, which every other
# client of the loop would wait for; in pieces of this size each is well under a turn.
PAUSE_EVERY = 256

_I8 = struct.Struct("!b")
_I16 = struct.Struct("!h")
_I32 = struct.Struct("!i")
_I64 = struct.Struct("!q")
_DOUBLE = struct.Struct("!d")
_DOUBLE_LE = struct.Struct("<d")
_FIELD = struct.Struct("!bh")

# A value of this many bytes or more (a get's item) stays where it is until a Python writer's reply
# is joined, rather than being copied into the writer's buffer first and then into the reply.
GATHER_FROM: Final = 512
_BINARY_VERSION = 0x80010000
_COMPACT_ID = 0x82


class ThriftProtocolError(Exception):
    """Raised when a message is malformed, shorter than it announces, or over a limit."""


class Reader:
    """One message in a buffer, from `start` on. Subclasses read one protocol; `more(need)` reads on
    to `need` bytes and returns the new end (None: the buffer holds the whole frame, to `limit`);
    `pause()` lets the connection step aside if its turn is over, every PAUSE_EVERY values read or
    skipped one at a time, so that a large message is read in pieces between other clients' requests."""

    MIN_SIZE: ClassVar[dict[int, int]] = {}

    def __init__(self, buf: bytes | bytearray, end: int, limit: int, max_items: int, max_bytes: int,
                 more: Callable[[int], int] | None = None, scope: str = "frame", start: int = 0,
                 pause: Callable[[], None] | None = None) -> None:
        self.buf = buf
        self.pos = start
        self.end = end
        self.limit = limit
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.more = more
        self.scope = scope
        self.mutable = isinstance(buf, bytearray)
        self.elements = 0  # in the message's containers so far, read or skipped
        self.fields = 0  # in the message so far, nested ones included
        self.pause = pause
        self.countdown = PAUSE_EVERY  # values to read or skip before the next pause

    def tick(self) -> None:
        """One value read or skipped on its own: the connection may step aside every PAUSE_EVERY."""
        self.countdown -= 1
        if not self.countdown:
            self.countdown = PAUSE_EVERY
            if self.pause is not None:
                self.pause()

    def _short(self, pos: int, n: int, what: str) -> int:
        """`n` bytes at `pos` are past the data at hand: read on, or refuse. Returns the new end."""
        if n < 0 or pos + n > self.limit:
            raise ThriftProtocolError(f"{what} needs {n} bytes but only {self.limit - pos} are left in the "
                                      f"{self.scope}")
        assert self.more is not None  # a whole frame has end == limit
        self.end = self.more(pos + n)
        return self.end

    def _count(self, ttype: int, count: int, what: str) -> None:
        """A container's element count, checked before anything is allocated."""
        size = self.MIN_SIZE.get(ttype)
        if size is None:
            raise ThriftProtocolError(f"{what} has elements of unknown type {ttype}")
        if count < 0:
            raise ThriftProtocolError(f"{what} announces a negative count {count}")
        if count * size > self.limit - self.pos:
            raise ThriftProtocolError(f"{what} announces {count} elements but only {self.limit - self.pos} "
                                      f"bytes are left in the {self.scope}")
        if count > self.max_items:
            raise ThriftProtocolError(f"{what} has {count} elements, over max_batch_items {self.max_items}")
        self.elements += count
        if self.elements > self.max_items:
            raise ThriftProtocolError(f"the message's containers hold more than max_batch_items "
                                      f"{self.max_items} elements in all")

    @staticmethod
    def too_many_fields() -> ThriftProtocolError:
        """What each protocol's `read_field_begin` raises at the field past MAX_FIELDS (it counts
        them inline: a call here would cost every request of the Python readers)."""
        return ThriftProtocolError(f"a message of more than {MAX_FIELDS} fields")

    def take(self, n: int, what: str) -> bytes:
        pos = self.pos
        if pos + n > self.end or n < 0:
            self._short(pos, n, what)
        self.pos = pos + n
        if self.mutable:  # a receive buffer: copied once, through a view (its own slice is a copy)
            with memoryview(self.buf) as view:
                return bytes(view[pos:pos + n])
        return self.buf[pos:pos + n]  # type: ignore[return-value]

    def read_string(self, what: str) -> str:
        data = self.read_binary(what)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{what} is not valid UTF-8 (byte {data[e.start]:#04x} at {e.start}): "
                             f"Thrift strings must be UTF-8") from None

    def read_binary(self, what: str) -> bytes:
        raise NotImplementedError

    def read_message_begin(self) -> tuple[str, int, int]:
        """The method name, message type and sequence id."""
        raise NotImplementedError

    def read_list_begin(self, what: str) -> tuple[int, int]:
        raise NotImplementedError

    def read_binary_list(self, count: int, what: str) -> list[bytes]:
        raise NotImplementedError

    def read_field_begin(self) -> tuple[int, int]:
        """The next field's type and id (STOP: the struct ends), counted against MAX_FIELDS."""
        raise NotImplementedError

    def read_struct_begin(self) -> None:
        pass

    def read_struct_end(self) -> None:
        pass

    def read_map_begin(self, what: str) -> tuple[int, int, int]:
        raise NotImplementedError

    def read_bool(self) -> bool:
        return self.take(1, "a bool") != b"\x00"

    def read_byte(self) -> int:
        return int(_I8.unpack(self.take(1, "a byte"))[0])

    def read_i16(self) -> int:
        raise NotImplementedError

    def read_i32(self) -> int:
        raise NotImplementedError

    def read_i64(self) -> int:
        raise NotImplementedError

    def read_double(self) -> float:
        raise NotImplementedError

    def read_value(self, ttype: int, what: str) -> Any:
        """A primitive value (what containers of Kestrel's arguments hold)."""
        if ttype == STRING:
            return self.read_binary(what)
        if ttype == I64:
            return self.read_i64()
        if ttype == I32:
            return self.read_i32()
        if ttype == I16:
            return self.read_i16()
        if ttype == BYTE:
            return self.read_byte()
        if ttype == BOOL:
            return self.read_bool()
        if ttype == DOUBLE:
            return self.read_double()
        raise ThriftProtocolError(f"{what}: cannot read a value of type {ttype} here")

    def skip(self, ttype: int, depth: int = 0) -> None:
        """Step over a value of a field this server does not know (bounded like any other read)."""
        if depth > MAX_DEPTH:
            raise ThriftProtocolError(f"values nested deeper than {MAX_DEPTH}")
        self.tick()
        if ttype == STRUCT:
            self.read_struct_begin()
            while True:
                ftype, _ = self.read_field_begin()
                if ftype == STOP:
                    break
                self.skip(ftype, depth + 1)
            self.read_struct_end()
        elif ttype in (LIST, SET):
            etype, count = self.read_list_begin("a skipped container")
            for _ in range(count):
                self.skip(etype, depth + 1)
        elif ttype == MAP:
            ktype, vtype, count = self.read_map_begin("a skipped map")
            for _ in range(count):
                self.skip(ktype, depth + 1)
                self.skip(vtype, depth + 1)
        elif ttype == UUID:
            self.take(16, "a uuid")
        elif ttype == BOOL:
            self.read_bool()
        else:
            self.read_value(ttype, "a skipped field")


class BinaryReader(Reader):
    """TBinaryProtocol: big-endian fixed-width numbers, i32 lengths."""

    MIN_SIZE: ClassVar[dict[int, int]] = {
        BOOL: 1, BYTE: 1, I16: 2, I32: 4, I64: 8, DOUBLE: 8, STRING: 4, STRUCT: 1, MAP: 6,
        SET: 5, LIST: 5, UUID: 16}

    def _fixed(self, s: struct.Struct, what: str) -> Any:
        pos = self.pos
        if pos + s.size > self.end:
            self._short(pos, s.size, what)
        self.pos = pos + s.size
        return s.unpack_from(self.buf, pos)[0]

    def read_i16(self) -> int:
        return int(self._fixed(_I16, "an i16"))

    def read_i32(self) -> int:
        return int(self._fixed(_I32, "an i32"))

    def read_i64(self) -> int:
        return int(self._fixed(_I64, "an i64"))

    def read_double(self) -> float:
        return float(self._fixed(_DOUBLE, "a double"))

    def read_binary(self, what: str) -> bytes:
        n = self._fixed(_I32, what)
        if n < 0:
            raise ThriftProtocolError(f"{what} announces a negative length {n}")
        return self.take(n, what)

    def read_message_begin(self) -> tuple[str, int, int]:
        first = self._fixed(_I32, "the message header")
        if first < 0:
            if first & 0xffff0000 != _BINARY_VERSION:
                hint = " (a compact-protocol client?)" if (first >> 24) & 0xff == _COMPACT_ID else ""
                raise ThriftProtocolError(f"bad binary protocol version {first & 0xffffffff:#010x}{hint}")
            mtype = first & 0xff
            name = self.take_name(self._fixed(_I32, "the method name"))
        else:  # the old unversioned header: name, then type
            name = self.take_name(first)
            mtype = self._fixed(_I8, "the message type")
        return name, mtype, self._fixed(_I32, "the sequence id")

    def take_name(self, n: int) -> str:
        if n < 0 or n > 256:
            raise ThriftProtocolError(f"a method name of {n} bytes")
        raw = self.take(n, "the method name")
        if raw[:2] == b"\x80\x01" or raw[:1] == b"\x82":  # (no method name begins so: not UTF-8)
            kind = "binary" if raw[0] == 0x80 else "compact"
            raise ThriftProtocolError(f"this looks like a framed {kind}-protocol client, but the server "
                                      "expects unframed (buffered) transport")
        return raw.decode("utf-8", "replace")

    def read_field_begin(self) -> tuple[int, int]:
        pos = self.pos
        if pos + 1 > self.end:
            self._short(pos, 1, "a field header")
        ttype = self.buf[pos]
        if ttype == STOP:
            self.pos = pos + 1
            return STOP, 0
        if pos + 3 > self.end:
            self._short(pos, 3, "a field header")
        self.pos = pos + 3
        self.fields += 1
        if self.fields > MAX_FIELDS:
            raise self.too_many_fields()
        ttype, fid = _FIELD.unpack_from(self.buf, pos)
        return ttype, fid

    def read_list_begin(self, what: str) -> tuple[int, int]:
        etype = self._fixed(_I8, what)
        count = self._fixed(_I32, what)
        self._count(etype, count, what)
        return etype, count

    def read_map_begin(self, what: str) -> tuple[int, int, int]:
        ktype = self._fixed(_I8, what)
        vtype = self._fixed(_I8, what)
        count = self._fixed(_I32, what)
        self._count(ktype, count, what)
        self._count(vtype, count, what)
        return ktype, vtype, count

    def read_binary_list(self, count: int, what: str) -> list[bytes]:
        """The hot path of `put`: each length checked against the frame and the byte budget."""
        if compiled_binary is not None:
            read = compiled_binary.read_binary_list(self.buf, self.pos, self.end, count, self.max_bytes)
            if read is not None:
                items, self.pos = read
                return items
        return self.read_binary_list_python(count, what)

    def read_binary_list_python(self, count: int, what: str) -> list[bytes]:
        """`read_binary_list` in Python: the reference, and the way for anything but an intact list
        at hand (it names the fault, or reads on for an unframed request)."""
        buf, pos, end, budget = self.buf, self.pos, self.end, self.max_bytes
        unpack = _I32.unpack_from
        items: list[Any] = []
        append = items.append
        for i in range(count):
            self.tick()
            if pos + 4 > end:
                end = self._short(pos, 4, f"{what} element {i}")
            (n,) = unpack(buf, pos)
            pos += 4
            stop = pos + n
            if n < 0 or n > budget or stop > end:  # rare: refuse, or (unframed) read on
                if n < 0:
                    raise ThriftProtocolError(f"{what} element {i} announces a negative length {n}")
                if n > budget:
                    raise ThriftProtocolError(f"{what} holds more than max_batch_bytes {self.max_bytes}")
                end = self._short(pos, n, f"{what} element {i}")
            budget -= n
            append(buf[pos:stop])
            pos = stop
        self.pos = pos
        return [bytes(x) for x in items] if self.mutable else items


def _zigzag(n: int) -> int:
    return (n >> 1) ^ -(n & 1)


def _out_of_range(what: str, value: int) -> ThriftProtocolError:
    return ThriftProtocolError(f"{what} of {value} is out of range")


# Compact type nibble -> binary type code (1 and 2 are bools carrying their value).
_FROM_COMPACT = {1: BOOL, 2: BOOL, 3: BYTE, 4: I16, 5: I32, 6: I64, 7: DOUBLE, 8: STRING, 9: LIST, 10: SET,
                 11: MAP, 12: STRUCT, 13: UUID}
_TO_COMPACT = {BOOL: 1, BYTE: 3, I16: 4, I32: 5, I64: 6, DOUBLE: 7, STRING: 8, LIST: 9, SET: 10, MAP: 11,
               STRUCT: 12, UUID: 13}


def _unknown_type(nibble: int, what: str) -> ThriftProtocolError:
    """A compact type nibble the protocol lacks, named by its own number (not by the binary code it
    has none of)."""
    return ThriftProtocolError(f"{what} has the unknown compact type {nibble}")


class CompactReader(Reader):
    """TCompactProtocol: zigzag varints, field-id deltas, bools folded into field headers."""

    MIN_SIZE: ClassVar[dict[int, int]] = {
        BOOL: 1, BYTE: 1, I16: 1, I32: 1, I64: 1, DOUBLE: 8, STRING: 1, STRUCT: 1, MAP: 1,
        SET: 1, LIST: 1, UUID: 16}

    def __init__(self, buf: bytes | bytearray, end: int, limit: int, max_items: int, max_bytes: int,
                 more: Callable[[int], int] | None = None, scope: str = "frame", start: int = 0,
                 pause: Callable[[], None] | None = None) -> None:
        super().__init__(buf, end, limit, max_items, max_bytes, more, scope, start, pause)
        self._last_fid = 0
        self._fids: list[int] = []
        self._bool: bool | None = None

    def _ubyte(self, what: str) -> int:
        pos = self.pos
        if pos + 1 > self.end:
            self._short(pos, 1, what)
        self.pos = pos + 1
        return self.buf[pos]

    def _varint(self, max_bytes: int, what: str) -> int:
        result = shift = 0
        for _ in range(max_bytes):
            b = self._ubyte(what)
            result |= (b & 0x7f) << shift
            if not b & 0x80:
                return result
            shift += 7
        raise ThriftProtocolError(f"{what}: a varint longer than {max_bytes} bytes")

    # Each integer is a zigzag varint of at most the bytes its type takes, refused past its range:
    # the longest varint holds 7 bits a byte, more than the type (2^69 in an i64's ten bytes).

    def read_i16(self) -> int:
        value = _zigzag(self._varint(3, "an i16"))
        if not -0x8000 <= value < 0x8000:
            raise _out_of_range("an i16", value)
        return value

    def read_i32(self) -> int:
        value = _zigzag(self._varint(5, "an i32"))
        if not -0x8000_0000 <= value < 0x8000_0000:
            raise _out_of_range("an i32", value)
        return value

    def read_i64(self) -> int:
        value = _zigzag(self._varint(10, "an i64"))
        if not -0x8000_0000_0000_0000 <= value < 0x8000_0000_0000_0000:
            raise _out_of_range("an i64", value)
        return value

    def read_double(self) -> float:
        return float(_DOUBLE_LE.unpack(self.take(8, "a double"))[0])

    def read_bool(self) -> bool:
        if self._bool is not None:
            value, self._bool = self._bool, None
            return value
        return self._ubyte("a bool") == 1

    def read_binary(self, what: str) -> bytes:
        return self.take(self._varint(5, what), what)

    def read_message_begin(self) -> tuple[str, int, int]:
        pid = self._ubyte("the message header")
        if pid != _COMPACT_ID:
            hint = " (a binary-protocol client?)" if pid == 0x80 else ""
            raise ThriftProtocolError(f"expected the compact protocol id 0x82, got {pid:#04x}{hint}")
        vt = self._ubyte("the message header")
        if vt & 0x1f != 1:
            raise ThriftProtocolError(f"unknown compact protocol version {vt & 0x1f}")
        seqid = self._varint(5, "the sequence id")  # an i32, written as the unsigned 32 bits it has
        if seqid >> 32:
            raise ThriftProtocolError(f"a sequence id of {seqid} is past 32 bits")
        seqid -= (seqid >> 31) << 32
        n = self._varint(5, "the method name")
        if n > 256:
            raise ThriftProtocolError(f"a method name of {n} bytes")
        name = self.take(n, "the method name").decode("utf-8", "replace")
        return name, vt >> 5, seqid

    def read_struct_begin(self) -> None:
        self._fids.append(self._last_fid)
        self._last_fid = 0

    def read_struct_end(self) -> None:
        self._last_fid = self._fids.pop()

    def read_field_begin(self) -> tuple[int, int]:
        b = self._ubyte("a field header")
        if b == 0:
            return STOP, 0
        self.fields += 1
        if self.fields > MAX_FIELDS:
            raise self.too_many_fields()
        ttype = _FROM_COMPACT.get(b & 0x0f)
        if ttype is None:
            raise _unknown_type(b & 0x0f, "a field")
        delta = b >> 4
        fid = self._last_fid + delta if delta else self.read_i16()
        self._last_fid = fid
        if ttype == BOOL:
            self._bool = b & 0x0f == 1
        return ttype, fid

    def read_list_begin(self, what: str) -> tuple[int, int]:
        b = self._ubyte(what)
        count = b >> 4
        if count == 15:
            count = self._varint(5, what)
        etype = _FROM_COMPACT.get(b & 0x0f)
        if etype is None:
            raise _unknown_type(b & 0x0f, what)
        self._count(etype, count, what)
        return etype, count

    def read_map_begin(self, what: str) -> tuple[int, int, int]:
        count = self._varint(5, what)
        if count == 0:
            return STRING, STRING, 0
        kv = self._ubyte(what)
        ktype, vtype = _FROM_COMPACT.get(kv >> 4), _FROM_COMPACT.get(kv & 0x0f)
        if ktype is None or vtype is None:
            raise _unknown_type(kv >> 4 if ktype is None else kv & 0x0f, what)
        self._count(ktype, count, what)
        self._count(vtype, count, what)
        return ktype, vtype, count

    def read_binary_list(self, count: int, what: str) -> list[bytes]:
        items, budget = [], self.max_bytes
        for i in range(count):
            self.tick()
            n = self._varint(5, f"{what} element {i}")
            if n > budget:
                raise ThriftProtocolError(f"{what} holds more than max_batch_bytes {self.max_bytes} bytes")
            budget -= n
            items.append(self.take(n, f"{what} element {i}"))
        return items


class Writer:
    """A reply under construction; `getvalue()` is the message, `framed`: as one frame of the framed
    transport (its size first, room for it kept from the start). A large value (a get's item) is
    kept where it is until then, so that its bytes are copied once, into the message."""

    def __init__(self, framed: bool = False) -> None:
        self.framed = framed
        self.out = bytearray(4 if framed else 0)
        self._before: list[bytes | bytearray] = []  # what precedes `out`, large values as they are

    def getvalue(self) -> bytes:
        if self.framed:  # the room at the front of the first piece takes the frame's size
            first = self._before[0] if self._before else self.out
            assert isinstance(first, bytearray)
            size = len(self.out) + sum(len(piece) for piece in self._before) - 4
            _I32.pack_into(first, 0, size)
        if not self._before:
            return bytes(self.out)
        return b"".join((*self._before, self.out))

    def _value_bytes(self, raw: bytes) -> None:
        if len(raw) < GATHER_FROM:
            self.out += raw
        else:
            self._before += (self.out, raw)
            self.out = bytearray()

    def write_message_begin(self, name: str, mtype: int, seqid: int) -> None:
        raise NotImplementedError

    def write_field(self, ttype: int, fid: int) -> None:
        raise NotImplementedError

    def write_struct_begin(self) -> None:
        pass

    def write_struct_end(self) -> None:
        self.out.append(0)

    def write_list_begin(self, etype: int, count: int) -> None:
        raise NotImplementedError

    def write_value(self, ttype: int, value: Any) -> None:
        raise NotImplementedError


class BinaryWriter(Writer):
    def write_message_begin(self, name: str, mtype: int, seqid: int) -> None:
        raw = name.encode()
        self.out += _I32.pack((_BINARY_VERSION - (1 << 32)) | mtype) + _I32.pack(len(raw))
        self.out += raw + _I32.pack(seqid)

    def write_field(self, ttype: int, fid: int) -> None:
        self.out += _FIELD.pack(ttype, fid)

    def write_list_begin(self, etype: int, count: int) -> None:
        self.out += _I8.pack(etype) + _I32.pack(count)

    def write_value(self, ttype: int, value: Any) -> None:
        out = self.out
        if ttype == STRING:
            raw = value.encode() if isinstance(value, str) else value
            out += _I32.pack(len(raw))
            self._value_bytes(raw)
        elif ttype == I64:
            out += _I64.pack(value)
        elif ttype == I32:
            out += _I32.pack(value)
        elif ttype == I16:
            out += _I16.pack(value)
        elif ttype in (BYTE, BOOL):
            out += _I8.pack(int(value))
        elif ttype == DOUBLE:
            out += _DOUBLE.pack(value)
        else:
            raise TypeError(f"cannot write a value of type {ttype}")


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7f:
        out.append((n & 0x7f) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


class CompactWriter(Writer):
    def __init__(self, framed: bool = False) -> None:
        super().__init__(framed)
        self._last_fid = 0
        self._fids: list[int] = []
        self._bool_fid: int | None = None

    def write_message_begin(self, name: str, mtype: int, seqid: int) -> None:
        raw = name.encode()
        self.out += bytes((_COMPACT_ID, 1 | (mtype << 5))) + _varint(seqid & 0xffffffff)
        self.out += _varint(len(raw)) + raw

    def write_struct_begin(self) -> None:
        self._fids.append(self._last_fid)
        self._last_fid = 0

    def write_struct_end(self) -> None:
        self.out.append(0)
        self._last_fid = self._fids.pop()

    def write_field(self, ttype: int, fid: int) -> None:
        if ttype == BOOL:
            self._bool_fid = fid  # the value goes in the header: written by write_value
            return
        self._header(_TO_COMPACT[ttype], fid)

    def _header(self, ctype: int, fid: int) -> None:
        delta = fid - self._last_fid
        if 0 < delta <= 15:
            self.out.append((delta << 4) | ctype)
        else:
            self.out.append(ctype)
            self.out += _varint((fid << 1) ^ (fid >> 63))
        self._last_fid = fid

    def write_list_begin(self, etype: int, count: int) -> None:
        ctype = _TO_COMPACT[etype]
        if count < 15:
            self.out.append((count << 4) | ctype)
        else:
            self.out.append(0xf0 | ctype)
            self.out += _varint(count)

    def write_value(self, ttype: int, value: Any) -> None:
        out = self.out
        if ttype == STRING:
            raw = value.encode() if isinstance(value, str) else value
            out += _varint(len(raw))
            self._value_bytes(raw)
        elif ttype in (I64, I32, I16):
            out += _varint((value << 1) ^ (value >> 63))
        elif ttype == BYTE:
            out += _I8.pack(value)
        elif ttype == BOOL:
            if self._bool_fid is not None:
                self._header(1 if value else 2, self._bool_fid)
                self._bool_fid = None
            else:
                out.append(1 if value else 2)
        elif ttype == DOUBLE:
            out += _DOUBLE_LE.pack(value)
        else:
            raise TypeError(f"cannot write a value of type {ttype}")


PROTOCOLS: dict[str, tuple[type[Reader], type[Writer]]] = {
    "binary": (BinaryReader, BinaryWriter),
    "compact": (CompactReader, CompactWriter),
}
