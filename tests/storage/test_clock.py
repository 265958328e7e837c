"""The clocks read on every request: the C twins (src/kestrel/storage/_clock.c) read the clocks that
`time.perf_counter` and `time.time_ns` read, to the same float and the same milliseconds, and are
what the server reads where they were built."""

from __future__ import annotations

import shutil
import time
from typing import Any

import pytest

from kestrel.storage import clock

try:
    from kestrel.storage._clock import now_ms as c_now_ms
    from kestrel.storage._clock import perf_counter as c_perf_counter
except ImportError:  # the build skips the helper only where there is no C compiler
    if shutil.which("cc") or shutil.which("gcc"):
        raise
    c_now_ms = c_perf_counter = None

MONOTONIC = time.get_clock_info("perf_counter").implementation == "clock_gettime(CLOCK_MONOTONIC)"
REALTIME = time.get_clock_info("time").implementation == "clock_gettime(CLOCK_REALTIME)"
NOW_MS = [clock.wall_ms_python] + ([c_now_ms] if c_now_ms is not None else [])


def test_the_server_reads_the_c_clocks_where_they_were_built_for_these_clocks() -> None:
    assert clock.perf_counter is (c_perf_counter if c_perf_counter is not None and MONOTONIC
                                  else time.perf_counter)
    assert clock._now_ms is (c_now_ms if c_now_ms is not None and REALTIME else clock.wall_ms_python)


def test_each_reading_lies_between_python_readings_taken_around_it() -> None:
    """The same clock in the same unit: a reading of another clock (the wall clock, or one in
    nanoseconds) would fall outside, and the timings that mix the two would be wrong."""
    for _ in range(1000):
        before = time.perf_counter()
        read = clock.perf_counter()
        after = time.perf_counter()
        assert before <= read <= after
        assert type(read) is float


def test_a_reading_is_python_s_float_of_the_same_nanoseconds() -> None:
    """Made of the nanoseconds as Python makes its seconds of them (`ns / 1e9`): readings at the
    same nanosecond are the same float, so differences of the two clocks' readings never go below
    zero by a rounding."""
    for _ in range(1000):
        ns = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        read = clock.perf_counter()
        later = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        assert ns / 1e9 <= read <= later / 1e9


@pytest.mark.parametrize("now_ms", NOW_MS)
def test_the_wall_clock_s_milliseconds_are_python_s_nanoseconds_floored(now_ms: Any) -> None:
    """What a put stamps its items with and expiry compares with: the milliseconds a reading of
    `time.time_ns` taken before it or after it gives (never one more, as a rounding would)."""
    for _ in range(1000):
        before = time.time_ns() // 1_000_000
        read = now_ms()
        after = time.time_ns() // 1_000_000
        assert before <= read <= after
        assert type(read) is int
    assert clock.SYSTEM_CLOCK.now_ms() >= read
