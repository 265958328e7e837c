"""A disk whose fsyncs are slow, for the tests of what a wait for one lets happen meanwhile (a
creation's, a delete's, a close's)."""

from __future__ import annotations

import os
import threading
import time

import pytest


def slow_fsyncs(monkeypatch: pytest.MonkeyPatch, seconds: float) -> list[int]:
    """Every `os.fsync` of the test takes `seconds` more (it sleeps in the calling thread: the pool's,
    where the server runs its fsyncs off the loop); undone with the test's monkeypatch. Returns the
    threads (`threading.get_ident`) the fsyncs ran in, as they run: whether one ran on the loop's
    thread says whether it stalled the loop, where a clock's reading on a busy machine cannot."""
    real = os.fsync
    threads: list[int] = []

    def slow(fd: int) -> None:
        threads.append(threading.get_ident())
        time.sleep(seconds)
        real(fd)

    monkeypatch.setattr(os, "fsync", slow)
    return threads
