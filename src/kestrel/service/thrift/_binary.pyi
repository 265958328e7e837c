from typing import Any

def read_binary_list(buf: bytes | bytearray, pos: int, end: int, count: int, budget: int, /
                     ) -> tuple[list[bytes], int] | None:
    """The list's elements and the position after them; None where the Python loop must read."""

def write_reply(head: bytes, seqid: int, /, *values: Any) -> bytes | None:
    """A binary reply: `(head, seqid)` void, `(head, seqid, result)` an i32, `(head, seqid, fids,
    datas, ids[, added, expiries])` a list of Items or TimedItems; None where Python must write."""

def write_framed_reply(head: bytes, seqid: int, /, *values: Any) -> bytes | None:
    """`write_reply`'s reply as one frame of the framed transport: its 4-byte size, then the reply."""

# Each method: its name as UTF-8, itself, its defaults in argument order, its field rules: three
# bytes a field id (position, wire type, kind), 0xff first where the reader has none.
Methods = tuple[tuple[bytes, Any, tuple[Any, ...], bytes], ...]

def read_call(frame: bytes | bytearray, methods: Methods, max_items: int, max_bytes: int, /
              ) -> tuple[Any, int, int, tuple[Any, ...], int] | None:
    """A whole call frame's method (as `methods` gives it), message type, sequence id, arguments in
    order and end; None where Python must read it."""

def read_framed_call(buf: bytes | bytearray, max_frame: int, methods: Methods, max_items: int,
                     max_bytes: int, /) -> tuple[Any, int, tuple[Any, ...], int] | None:
    """The call of the whole frame `buf` starts with (method, sequence id, arguments) and where the
    frame ends; None where the frame is not whole, is refused, or Python must read its call."""
