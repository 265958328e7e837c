def start(fds: list[int], eventfd: int, syncfs: bool = False, /) -> None:
    """fdatasync every descriptor (or syncfs its file system) concurrently on C threads; `eventfd`
    gets 1 when all are done."""

def finish() -> list[int]:
    """For each descriptor of the round that is over, 0 or the errno of its fdatasync (or syncfs)."""

def prefer(cpu: int, /) -> None:
    """Run the rounds on `cpu` wherever the calling thread may run there (-1: on the CPU the caller
    runs on, the default)."""
