"""One histogram's counts for one label set, observed on the request path (each answer's time, each
journal write's): compiled with it (src/kestrel/build.py); `metrics.py` names and exports them."""

from __future__ import annotations

from bisect import bisect_left
from typing import Final

# Bound once: the compiled build calls it from a C static, not a lookup in the module's dictionary.
_bisect_left: Final = bisect_left


class HistogramSeries:
    """One label set's counts: `counts[i]` observations at or below `bounds[i]` and above the one before."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * len(bounds)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[_bisect_left(self.bounds, seconds)] += 1
        self.sum += seconds

    def observe_many(self, seconds: float, count: int) -> None:
        """`count` requests answered together in `seconds` (a pipelined run): each took that long."""
        self.counts[_bisect_left(self.bounds, seconds)] += count
        self.sum += seconds * count
