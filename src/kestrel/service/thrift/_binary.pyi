from typing import Any

def read_binary_list(buf: bytes | bytearray, pos: int, end: int, count: int, budget: int, /
                     ) -> tuple[list[bytes], int] | None:
    """The list's elements and the position after them; None where the Python loop must read."""

def write_items(fid1: int, fid2: int, datas: list[Any], ids: int | list[Any], /) -> bytes | None:
    """Each data with its id (one for all, or a list) as binary-then-i64 structs; None where the
    Python loop must write."""

def read_call(frame: bytes | bytearray, methods: dict[str, Any], max_items: int, max_bytes: int, /
              ) -> tuple[str, int, int, dict[str, Any], int] | None:
    """A whole call frame's name, message type, sequence id, arguments and end; None where Python
    must read it."""

def read_framed_call(buf: bytes | bytearray, max_frame: int, methods: dict[str, Any], max_items: int,
                     max_bytes: int, /) -> tuple[str, int, dict[str, Any], int] | None:
    """The call of the whole frame `buf` starts with (name, sequence id, arguments) and where the
    frame ends; None where the frame is not whole, is refused, or Python must read its call."""
