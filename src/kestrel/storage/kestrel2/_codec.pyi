from collections.abc import Callable

_MisplacedEnd = Callable[[bytes, int, int], int | None]

def decode_common(buf: bytes, pos: int, base: int, budget: int, check_sizes: bool,
                  misplaced_end: _MisplacedEnd, /
                  ) -> tuple[list[tuple[int, int, int, int, int, bytes]], int, int]:
    """The run of common records from `pos`, as `storage.codec.decode_common_python` reads it."""

def decode_common_columns(buf: bytes, pos: int, base: int, budget: int, check_sizes: bool,
                          misplaced_end: _MisplacedEnd, /
                          ) -> tuple[tuple[int, bytes, bytes, bytes, bytes, bytes, bytes, bytes], int, int]:
    """The same run as column buffers (`storage.codec.decode_common_columns_python`)."""

def encode_addx_many(add_time: int, expiry: int, items: list[bytes], /) -> bytes | None:
    """`storage.codec.encode_addx_many_python` for lists of bytes; None where it must encode."""
