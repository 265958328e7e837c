"""Kestrel 3 journal records written by hand, field by field, as kestrel3-journal-format.md lays
them out: a command byte (command << 4 | header words), little-endian header words, then the data
block. The tests' reference twin of the format, independent of the production encoder
(src/kestrel/storage/kestrel3/codec.py) on purpose, so that a test built on it fails if that encoder
or its decoder is wrong."""

from __future__ import annotations

T0 = 1_700_000_000_000  # the add time a PUT carries unless told
WRITER = bytes([0x27, 0x64, 0x26, 0x03])  # a writer journal's header
READER = bytes([0x26, 0x3C, 0x26, 0x03])  # a reader checkpoint's header


def put6(xid: int, data: bytes, errors: int = 0, add_time: int = T0) -> bytes:
    """PUT (8) of six header words: data size, error count, id, add time; then the data."""
    return (bytes([8 << 4 | 6]) + len(data).to_bytes(4, "little") + errors.to_bytes(4, "little")
            + xid.to_bytes(8, "little") + add_time.to_bytes(8, "little") + data)


def put8(xid: int, data: bytes, expire: int, errors: int = 0, add_time: int = T0) -> bytes:
    """PUT (8) of eight header words: a six-word PUT's, then the expiry time."""
    return (bytes([8 << 4 | 8]) + len(data).to_bytes(4, "little") + errors.to_bytes(4, "little")
            + xid.to_bytes(8, "little") + add_time.to_bytes(8, "little") + expire.to_bytes(8, "little")
            + data)


def read_head(xid: int) -> bytes:
    """READ_HEAD (0) of two header words: the reader's head id."""
    return bytes([0 << 4 | 2]) + xid.to_bytes(8, "little")


def read_done(*ids: int) -> bytes:
    """READ_DONE (9) of one header word, the data size; then the ids, 8 bytes each."""
    return bytes([9 << 4 | 1]) + (8 * len(ids)).to_bytes(4, "little") + b"".join(
        i.to_bytes(8, "little") for i in ids)
