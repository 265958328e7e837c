"""A disk whose fsyncs are slow, for the tests of what a wait for one lets happen meanwhile (a
creation's, a delete's, a close's)."""

from __future__ import annotations

import os
import time

import pytest


def slow_fsyncs(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Every `os.fsync` of the test takes `seconds` more (it sleeps in the calling thread: the pool's,
    where the server runs its fsyncs off the loop); undone with the test's monkeypatch."""
    real = os.fsync

    def slow(fd: int) -> None:
        time.sleep(seconds)
        real(fd)

    monkeypatch.setattr(os, "fsync", slow)
