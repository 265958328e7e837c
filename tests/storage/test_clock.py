"""The performance counter: the C twin (src/kestrel/storage/_clock.c) reads the clock that
`time.perf_counter` reads, to the same float, and is what the server reads where it was built."""

from __future__ import annotations

import shutil
import time

from kestrel.storage import clock

try:
    from kestrel.storage._clock import perf_counter as c_perf_counter
except ImportError:  # the build skips the helper only where there is no C compiler
    if shutil.which("cc") or shutil.which("gcc"):
        raise
    c_perf_counter = None

MONOTONIC = time.get_clock_info("perf_counter").implementation == "clock_gettime(CLOCK_MONOTONIC)"


def test_the_server_reads_the_c_clock_where_it_was_built_for_this_clock() -> None:
    assert clock.perf_counter is (c_perf_counter if c_perf_counter is not None and MONOTONIC
                                  else time.perf_counter)


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
