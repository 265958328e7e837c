def fsync_many(fds: list[int], /) -> list[int]:
    """fdatasync every descriptor concurrently; for each, 0 or the errno of its failure."""
