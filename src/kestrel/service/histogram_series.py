"""One histogram's counts for one label set, observed on the request path (each answer's time, each
journal write's): compiled with it (src/kestrel/build.py); `metrics.py` names and exports them."""

from __future__ import annotations

from kestrel.storage.timing import Timing


class HistogramSeries(Timing):
    """One label set's counts: `counts[i]` observations at or below `bounds[i]` and above the one before."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.observe_many(seconds, 1)

    def observe_many(self, seconds: float, count: int) -> None:
        """`count` requests answered together in `seconds` (a pipelined run): each took that long."""
        counts, i = self.counts, self.bucket(seconds)
        # (not `+=` on the item: compiled, that is Python's generic in-place add of two objects)
        total: int = counts[i]
        counts[i] = total + count
        self.sum += seconds * count

    def bucket(self, seconds: float) -> int:
        """The index of the first bound at or above `seconds` (`bisect_left`'s answer), found from the
        lowest bound up: most observations (a request's answer, a journal write) fall in the first
        buckets, and compiled, each step compares two C doubles where `bisect_left` called Python's
        comparison of two float objects (about 0.3 µs an observation, four an item)."""
        bounds = self.bounds
        i = 0
        while bounds[i] < seconds:
            i += 1
        return i
