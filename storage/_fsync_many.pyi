def start(fds: list[int], eventfd: int, /) -> None:
    """fdatasync every descriptor concurrently on C threads; `eventfd` gets 1 when all are done."""

def finish() -> list[int]:
    """For each descriptor of the round that is over, 0 or the errno of its fdatasync."""
