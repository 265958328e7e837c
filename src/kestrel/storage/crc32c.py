"""CRC32C (Castagnoli), the checksum of the queue manifest (`src/kestrel/storage/manifest.py`).

The compiled module of the same name (src/kestrel/storage/_crc32c.c: slice-by-8, or the SSE 4.2
instruction) is used where the build had a C compiler; the table-driven Python here is its
reference, checked against it by tests/storage/test_manifest.py. No package is needed for one
function that start-up, rotation and packing call a few times.
"""

from __future__ import annotations

from collections.abc import Callable
from io import BufferedIOBase

from kestrel.storage.disk import open_to_read

POLYNOMIAL = 0x82F63B78  # reflected


def _table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ POLYNOMIAL if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _table()


def crc32c_python(data: bytes | bytearray | memoryview, crc: int = 0, /) -> int:
    """CRC32C of `data`, continuing from `crc` (the CRC of what came before it)."""
    table = _TABLE
    c = crc ^ 0xFFFFFFFF
    for byte in bytes(data):
        c = table[(c ^ byte) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


crc32c: Callable[..., int]
try:
    from kestrel.storage._crc32c import crc32c
except ImportError:  # pragma: no cover - built without a C compiler
    crc32c = crc32c_python


def file_crc32c(path: str, size: int | None = None) -> int:
    """CRC32C of the file's first `size` bytes (all of it when None); OSError if it is shorter."""
    with open_to_read(path) as f:
        return read_crc32c(f, size, path)


def read_crc32c(f: BufferedIOBase, size: int | None, path: str) -> int:
    """`file_crc32c` of the file open as `f`, from where it stands (`path` names it in an error).

    Read into one reused buffer: a rotated journal costs its checksum and one copy from the page
    cache, not a new bytes object per chunk (twice as fast).
    """
    crc = 0
    left = size
    buffer = bytearray(1 << 20)
    with memoryview(buffer) as view:
        while left is None or left > 0:
            want = view if left is None or left >= len(buffer) else view[:left]
            got = f.readinto(want)
            if not got:
                if left:
                    raise OSError(f"{path} holds fewer than {size} bytes")
                break
            crc = crc32c(view[:got], crc)
            if left is not None:
                left -= got
    return crc
