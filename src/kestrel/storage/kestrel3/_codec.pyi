def decode_puts(buf: bytes, pos: int, /) -> tuple[list[tuple[int, int, int, int | None, bytes]], int]:
    """The run of PUT records from `pos`, as `storage.kestrel3.codec.decode_puts_python` reads it."""
