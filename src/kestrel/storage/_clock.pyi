def perf_counter() -> float:
    """The monotonic clock in seconds: `time.perf_counter`'s reading, read more cheaply."""

def now_ms() -> int:
    """The wall clock in milliseconds since the epoch: `time.time_ns() // 1_000_000`."""
