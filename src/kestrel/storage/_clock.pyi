def perf_counter() -> float:
    """The monotonic clock in seconds: `time.perf_counter`'s reading, read more cheaply."""
