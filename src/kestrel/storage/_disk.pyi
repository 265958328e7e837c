def write(fd: int, data: bytes | memoryview, /) -> int:
    """How many bytes of `data` file `fd` took (as `os.write`), the interpreter's lock held."""
