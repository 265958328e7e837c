def drop_answered(buf: bytearray, end: int, /) -> None:
    """`del buf[:end]`, a small block kept when that empties `buf`."""

def receive(fd: int, buf: bytearray, chunk: int, /) -> int:
    """Up to `chunk` bytes from socket `fd` appended to `buf`; how many (0: the end of the stream),
    -1 when nothing is there yet."""

def receive_in_place(fd: int, buf: bytearray, room: int, /) -> int:
    """Up to `room` bytes from socket `fd` received straight onto the end of `buf`, with no copy;
    how many (0: the end of the stream), -1 when nothing is there yet."""

def send(fd: int, data: bytes | memoryview, /) -> int:
    """How many bytes of `data` socket `fd` took at once (0: it had no room)."""
