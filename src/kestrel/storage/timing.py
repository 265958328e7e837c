"""What storage reports the time of a journal write, an fsync or a pack to (it knows no metrics
library): the server's histograms derive from `Timing` (src/kestrel/service/histogram_series.py), so
that in the compiled build each append's report is a direct call rather than a call of whatever
callable was installed."""

from __future__ import annotations


class Timing:
    """Takes the seconds each event of one kind took."""

    def observe(self, seconds: float) -> None:
        raise NotImplementedError
