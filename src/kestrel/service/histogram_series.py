"""One histogram's counts for one label set, observed on the request path (each answer's time, each
journal write's): compiled with it (src/kestrel/build.py); `metrics.py` names and exports them."""

from __future__ import annotations

from kestrel.storage.timing import Timing


class HistogramSeries(Timing):
    """One label set's counts: `counts[i]` observations at or below `bounds[i]` and above the one before.

    The first bucket's count is an attribute of its own (`in_first`), the others a list (`above`):
    most observations fall in the first (a request's answer, a journal write), and compiled, an int
    attribute adds natively where a list's item is boxed anew at each count past Python's small ints
    (an allocation, and the old count freed: about 150 instructions an observation)."""

    __slots__ = ("bounds", "in_first", "above", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.in_first = 0
        self.above = [0] * (len(bounds) - 1)
        self.sum = 0.0

    @property
    def counts(self) -> list[int]:
        """Each bucket's count, in the order of `bounds`."""
        return [self.in_first, *self.above]

    def observe(self, seconds: float) -> None:
        self.observe_many(seconds, 1)

    def observe_many(self, seconds: float, count: int) -> None:
        """`count` requests answered together in `seconds` (a pipelined run): each took that long."""
        self.sum += seconds * count
        i = self.bucket(seconds)
        if not i:
            self.in_first += count
            return
        above = self.above
        # (not `+=` on the item: compiled, that is Python's generic in-place add of two objects)
        total: int = above[i - 1]
        above[i - 1] = total + count

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
