def lengthen(buf: bytearray, room: int, /) -> int:
    """Make `buf` `room` bytes longer, the new bytes unwritten; its length before."""
