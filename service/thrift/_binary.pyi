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
