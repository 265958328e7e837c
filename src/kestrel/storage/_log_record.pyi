def append_record(out: bytearray, name: bytes, name_crc: int, place: int, offset: int, data: list[bytes],
                  /) -> bool:
    """`commit_log.append_record_python`, True; False (nothing appended) where a part is not bytes."""
