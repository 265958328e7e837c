"""Whether the machine has a core to spare: the share of idle CPU time in /proc/stat, read at most
once a second.

Why: the commit log can overlap the event loop's work with the fsync in flight by splitting its
clients into two rounds (src/kestrel/storage/commit_log.py), at the cost of one fsync more per
pair of rounds. That pays only where another core is idle to run the extra fsync; on a machine
whose cores are all busy it only adds CPU time, and one round for every client is the better.
"""

from __future__ import annotations

from collections.abc import Callable

from kestrel.storage.clock import SYSTEM_CLOCK, Clock

SPARE_CORES = 0.5  # idle time, in cores, that counts as a core to spare
EVERY_SECONDS = 1.0  # how often the reading is taken again


def read_proc_stat() -> tuple[int, int, int]:
    """Idle ticks (idle and iowait) and all ticks of every CPU since boot, and how many CPUs.

    Raises OSError where there is no /proc/stat (not Linux)."""
    with open("/proc/stat", "rb") as f:
        lines = f.read().splitlines()
    ticks = [int(field) for field in lines[0].split()[1:]]
    cpus = sum(1 for line in lines if line.startswith(b"cpu") and line[3:4].isdigit())
    return ticks[3] + ticks[4], sum(ticks[:8]), max(cpus, 1)


class SpareCpu:
    """Called: whether at least SPARE_CORES of the machine's CPU time went idle between the last two
    readings. False until two readings have been taken, and wherever /proc/stat cannot be read."""

    def __init__(self, clock: Clock = SYSTEM_CLOCK,
                 read: Callable[[], tuple[int, int, int]] = read_proc_stat) -> None:
        self._clock = clock
        self._read = read
        self._taken_at = -EVERY_SECONDS
        self._last: tuple[int, int, int] | None = None
        self._spare = False

    def __call__(self) -> bool:
        now = self._clock.monotonic()
        if now - self._taken_at < EVERY_SECONDS:
            return self._spare
        self._taken_at = now
        try:
            reading = self._read()
        except (OSError, ValueError, IndexError):
            self._last, self._spare = None, False
            return False
        last, self._last = self._last, reading
        if last is not None:
            idle, total = reading[0] - last[0], reading[1] - last[1]
            self._spare = total > 0 and idle / total * reading[2] >= SPARE_CORES
        return self._spare
