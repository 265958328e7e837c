"""Whether the machine has a core to spare (src/kestrel/storage/spare_cpu.py), from readings of
/proc/stat taken at most once a second."""

from __future__ import annotations

import os

import pytest

from kestrel.storage.clock import FakeClock
from kestrel.storage.spare_cpu import SpareCpu, read_proc_stat


class Readings:
    def __init__(self, *readings: tuple[int, int, int]) -> None:
        self.readings = list(readings)
        self.taken = 0

    def __call__(self) -> tuple[int, int, int]:
        self.taken += 1
        return self.readings.pop(0)


def test_half_a_core_idle_between_two_readings_is_a_core_to_spare() -> None:
    clock = FakeClock(0)
    # two CPUs: 100 ticks in all, then 30 of 100 idle (0.6 cores), then 20 of 100 (0.4 cores)
    read = Readings((0, 0, 2), (30, 100, 2), (50, 200, 2))
    spare = SpareCpu(clock, read)
    assert spare() is False  # one reading says nothing yet
    clock.advance(1_000)
    assert spare() is True
    clock.advance(1_000)
    assert spare() is False


def test_the_reading_is_taken_again_only_once_a_second_has_passed() -> None:
    clock = FakeClock(0)
    read = Readings((0, 0, 1), (100, 100, 1))
    spare = SpareCpu(clock, read)
    spare()
    clock.advance(1_000)
    assert spare() is True
    clock.advance(500)
    assert spare() is True and read.taken == 2


def test_without_proc_stat_no_core_is_spare() -> None:
    def unreadable() -> tuple[int, int, int]:
        raise OSError("no /proc/stat")

    spare = SpareCpu(FakeClock(0), unreadable)
    assert spare() is False


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="Linux only")
def test_proc_stat_reads_as_idle_ticks_within_all_ticks_of_every_cpu() -> None:
    idle, total, cpus = read_proc_stat()
    assert 0 < idle <= total and cpus == os.cpu_count()
