def append_record(out: bytearray, head: bytes, offset: int, data: bytes | list[bytes], /) -> bool:
    """`commit_log.append_record_python`, True; False (nothing appended) where a part is not bytes."""


def crc32_combine(crc1: int, crc2: int, length: int, /) -> int:
    """`commit_log.crc32_combine_python`: the CRC-32 of A + B from A's, B's and B's `length`."""
