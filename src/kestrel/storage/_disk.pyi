def write(fd: int, data: bytes | memoryview, /) -> int:
    """How many bytes of `data` file `fd` took (as `os.write`), the interpreter's lock held unless
    a call runs on a worker thread (`workers`)."""

def writev_all(fd: int, pieces: list[bytes], /) -> int:
    """Every byte of `pieces`, in order, written to file `fd` in gathering writes (as
    `disk.writev_all_python`); how many bytes. The interpreter's lock held unless a call runs on a
    worker thread (`workers`)."""

def workers(change: int, /) -> int:
    """Add `change` to the calls running on worker threads; how many run now."""
